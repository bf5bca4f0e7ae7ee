"""Below the handlers: requests aiohttp cannot parse get OpenAI errors, and
headers that trickle in are cut off (gateway/http_protocol.py).

A real gateway (one tiny in-process engine) runs in a background thread with
limits.header_timeout_s 0.5, spoken to over raw loopback sockets, once on
uvloop (what `kvgate serve` runs on) and once on asyncio's own loop.  Time bounds
are several times the deadline, for a loaded two-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Iterator

import pytest
import uvloop
from aiohttp import ClientSession, web
from aiohttp.http_exceptions import BadStatusLine, InvalidHeader, LineTooLong, TransferEncodingError
from pydantic import ValidationError

from gateway.app import create_app
from gateway.config import LimitsConfig, ReplicaConfig
from gateway import http_protocol
from gateway.http_protocol import parse_error
from gateway.server import start_server
from tests.engine_procs import MODEL, EngineProcess, tiny_config

HEADER_TIMEOUT_S = 0.5
# How long a connection the deadline should end may take to end here.
BOUND_S = 5.0
SECRET = b"sk-kvgate-secret-4711"
ERROR_KEYS = {"message", "type", "param", "code"}


class Gateway:
    """A gateway on its own loop in a thread, so tests can use blocking sockets."""

    def __init__(self, model_dir: str, event_loop: str = "asyncio", api_keys=(), **limits) -> None:
        self.loop = uvloop.new_event_loop() if event_loop == "uvloop" else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = tiny_config(model_dir, [ReplicaConfig(kind="inprocess")], limits=LimitsConfig(**limits),
                             api_keys=list(api_keys))
        self.server = self._call(start_server(create_app(config)), 120)
        self.port = int(self.server.url.rsplit(":", 1)[1])

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self._call(self.server.stop(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


KEEPALIVE_TIMEOUT_S = 2.5


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def gateway(tiny_model_dir, request):
    gw = Gateway(tiny_model_dir, request.param, header_timeout_s=HEADER_TIMEOUT_S,
                 keepalive_timeout_s=KEEPALIVE_TIMEOUT_S)
    yield gw
    gw.close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length response off a connection that stays open."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {raw!r}"
        raw += chunk
    status, headers, body = _split(raw)
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return status, headers, body


def _health(port: int) -> bytes:
    return f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


def _short_chat(port: int) -> tuple[int, bytes]:
    """(status, body) of a one-token chat completion on a new connection."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 1})
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode()
    with _connect(port) as sock:
        sock.sendall(request)
        status, _, data = _split(_read_until_closed(sock))
    return status, data


def _assert_serving(port: int) -> None:
    """A normal chat completion on a new connection."""
    status, data = _short_chat(port)
    assert status == 200 and json.loads(data)["choices"], data


MALFORMED = {
    "not HTTP at all": (b"HELLO " + SECRET + b"\r\n\r\n", "invalid_request_line"),
    "invalid method": (b"G@T /" + SECRET + b" HTTP/1.1\r\nHost: x\r\n\r\n", "invalid_request_line"),
    "HTTPS on the HTTP port": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + SECRET, "invalid_request_line"),
    "invalid header name": (b"GET /health HTTP/1.1\r\nHost: x\r\nX " + SECRET + b": v\r\n\r\n", "malformed_request"),
    "control byte in a header value": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SECRET + b"\x01\r\n\r\n", "malformed_request"),
    "invalid chunk size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + SECRET + b"\r\n{}\r\n0\r\n\r\n", "malformed_request"),
    "header over the size limit": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Api-Key: " + SECRET + b"a" * 9000 + b"\r\n\r\n", "line_too_long"),
    "request line over the size limit": (
        b"GET /" + SECRET + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "line_too_long"),
    "too many headers": (
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
        "malformed_request"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_unparsable_request_gets_an_openai_error_without_its_bytes(gateway, case, caplog):
    request, code = MALFORMED[case]
    caplog.set_level("DEBUG")
    with _connect(gateway.port) as sock:
        sock.sendall(request)
        raw = _read_until_closed(sock)  # and the server closes the connection
    status, headers, body = _split(raw)
    assert status == 400, raw
    assert headers["content-type"].startswith("application/json") and headers["connection"] == "close", headers
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error" and error["param"] is None
    assert error["code"] == code and error["message"], error
    assert SECRET not in raw and b"aaaaaaaa" not in raw, raw
    assert SECRET.decode() not in caplog.text
    _assert_serving(gateway.port)


def test_header_bytes_trickling_in_are_cut_off(gateway):
    """Slow-loris: a byte every 0.2 s; the server ends the connection about
    header_timeout_s after it opened, long before the head is complete."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + SECRET + b"\r\n")
    started = time.monotonic()
    answer = None
    with _connect(gateway.port) as sock:
        sock.settimeout(0.2)
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
                answer = sock.recv(65536)  # b"" or the 408: the server is done with us
                break
            except socket.timeout:
                pass
            except (BrokenPipeError, ConnectionResetError):
                answer = b""
                break
            assert time.monotonic() - started < 2 * BOUND_S, "the server is still reading the head"
    elapsed = time.monotonic() - started
    assert answer is not None, "the whole head went through"
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed < BOUND_S, elapsed
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer
    _assert_serving(gateway.port)


def test_unfinished_head_gets_408_and_close(gateway):
    with _connect(gateway.port) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ")
        raw = _read_until_closed(sock)
        elapsed = time.monotonic() - started
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed < BOUND_S, elapsed
    status, headers, body = _split(raw)
    assert status == 408 and headers["connection"] == "close" and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and error["code"] == "request_timeout", error


def test_connection_that_sends_nothing_is_closed_without_an_answer(gateway):
    """A new connection's first request counts from the connection's opening.  No
    408 there: a pooling client may be about to send on it, and would read that
    408 as its answer; a plain close it retries."""
    with _connect(gateway.port) as sock:
        started = time.monotonic()
        raw = _read_until_closed(sock)
        elapsed = time.monotonic() - started
    assert raw == b"" and HEADER_TIMEOUT_S * 0.9 <= elapsed < BOUND_S, (raw, elapsed)


def test_keep_alive_idle_is_not_counted_but_the_next_head_is(gateway):
    """Between requests the wait is limits.keepalive_timeout_s; the deadline
    starts again with the next request's first byte."""
    with _connect(gateway.port) as sock:
        for wait in (2 * HEADER_TIMEOUT_S, 0):
            sock.sendall(_health(gateway.port))
            status, _, body = _read_response(sock)
            assert status == 200, body
            time.sleep(wait)
        started = time.monotonic()
        sock.sendall(_health(gateway.port)[:20])
        raw = _read_until_closed(sock)
        elapsed = time.monotonic() - started
    assert raw.startswith(b"HTTP/1.1 408 ") and HEADER_TIMEOUT_S * 0.9 <= elapsed < BOUND_S, (raw, elapsed)


def test_an_idle_keep_alive_connection_closes_after_keepalive_timeout(gateway):
    """Bare line ends between requests (RFC 9112 allows them) neither start the
    header deadline nor keep the connection open past keepalive_timeout_s."""
    with _connect(gateway.port) as sock:
        sock.sendall(_health(gateway.port))
        assert _read_response(sock)[0] == 200
        sock.sendall(b"\r\n")
        time.sleep(3 * HEADER_TIMEOUT_S)  # no 408 for the line end
        sock.sendall(_health(gateway.port))
        assert _read_response(sock)[0] == 200
        started = time.monotonic()
        raw = _read_until_closed(sock)
        elapsed = time.monotonic() - started
    assert raw == b"" and KEEPALIVE_TIMEOUT_S * 0.9 <= elapsed < KEEPALIVE_TIMEOUT_S + BOUND_S, (raw, elapsed)
    assert LimitsConfig().keepalive_timeout_s == 75.0


def test_broken_framing_inside_a_body_being_read_is_a_400_at_once(gateway):
    """A bad chunk size after the head and a first good chunk, in a later packet:
    the body being read fails (400) instead of waiting out body_timeout_s."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    with _connect(gateway.port) as sock:
        sock.sendall(head + b"5\r\n{\"mod\r\n")
        time.sleep(0.3)  # the handler is reading the body by now
        started = time.monotonic()
        sock.sendall(b"zz" + SECRET + b"\r\n")
        raw = _read_until_closed(sock)  # the answer, then the server closes
        elapsed = time.monotonic() - started
    status, headers, body = _split(raw)
    assert status == 400 and elapsed < BOUND_S, (raw, elapsed)
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and "framing" in error["message"] and SECRET not in raw, error
    _assert_serving(gateway.port)


def test_a_body_that_does_not_decode_is_a_400_and_no_error_in_the_log(gateway, caplog):
    """The gzip header, then (in a later packet) no gzip: a 400, and when aiohttp
    drains the rest of the body its decoding error logs no traceback at ERROR."""
    caplog.set_level("DEBUG")
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: 64\r\n\r\n")
    with _connect(gateway.port) as sock:
        sock.sendall(head + b"\x1f\x8b\x08\x00")
        time.sleep(0.3)
        sock.sendall(b"\xff" * 60)
        status, _, body = _read_response(sock)
    assert status == 400 and "Content-Encoding" in json.loads(body)["error"]["message"], body
    _assert_serving(gateway.port)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


@pytest.mark.parametrize("encoding", ["br", "zstd"])
def test_an_encoding_with_no_decoder_here_is_a_415_naming_it(gateway, encoding):
    """aiohttp decodes br and zstd only with an optional package; without it the
    body is the client's choice of encoding, not a malformed request."""
    import aiohttp.http_parser

    if getattr(aiohttp.http_parser, "HAS_BROTLI" if encoding == "br" else "HAS_ZSTD"):
        pytest.skip(f"aiohttp decodes {encoding} in this environment")  # then a real body of it is served
    _assert_a_415_naming(gateway, encoding, b"abcd")


def _assert_a_415_naming(gateway, coding: str, body: bytes) -> None:
    """A chat request whose body says it is in ``coding`` gets a 415 naming it and
    what to send instead (RFC 9110's Accept-Encoding), and the server serves on."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: %s\r\nContent-Length: %d\r\n\r\n" % (coding.encode(), len(body)))
    with _connect(gateway.port) as sock:
        sock.sendall(head + body)
        status, headers, answer = _read_response(sock)
    error = json.loads(answer)["error"]
    assert status == 415 and error["code"] == "unsupported_content_encoding", answer
    assert headers["accept-encoding"] == "gzip, deflate"
    assert f"Content-Encoding {coding} is not supported" in error["message"]
    _assert_serving(gateway.port)


@pytest.mark.parametrize("coding", ["compress", "gzip, gzip", "x-unknown"])
def test_an_encoding_nothing_here_decodes_is_a_415(gateway, coding):
    """A body in a coding aiohttp does not decode used to be read as it came:
    a compressed one failed as bad JSON, a mislabelled one went through.  RFC
    9110: 415, naming what to send instead."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    _assert_a_415_naming(gateway, coding, body)


def test_expect_100_continue_is_met_and_other_expectations_get_an_openai_417(gateway):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nExpect: %s\r\n\r\n")
    with _connect(gateway.port) as sock:
        sock.sendall(head % (len(body), b"100-continue"))
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            interim += sock.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        status, _, data = _read_response(sock)
        assert status == 200 and json.loads(data)["choices"]
    for request in (head % (len(body), b"something-else") + body,
                    f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: foo\r\n\r\n".encode()):
        with _connect(gateway.port) as sock:
            sock.sendall(request)
            status, headers, data = _read_response(sock)
        assert status == 417 and headers["content-type"].startswith("application/json"), data
        assert set(json.loads(data)["error"]) == ERROR_KEYS
    _assert_serving(gateway.port)


def test_expect_100_continue_is_refused_before_the_body_when_it_would_be_refused_after(gateway):
    """Asking first saves the upload: a declared body over limits.max_body_bytes
    gets its 413, and an unknown path its 404, instead of 100 Continue."""
    head = (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n")
    for path, length, status, code in ((b"/v1/chat/completions", 9 * 2**20, 413, "request_too_large"),
                                       (b"/v1/no/such/path", 20, 404, "unknown_url")):
        with _connect(gateway.port) as sock:
            sock.sendall(head % (path, length))
            got, headers, data = _read_response(sock)
        assert got == status and json.loads(data)["error"]["code"] == code, data
    _assert_serving(gateway.port)


def test_expect_100_continue_without_a_good_key_gets_its_401_before_the_body(tiny_model_dir):
    """The client was invited to upload its body (up to the body limit) to be
    refused after; a good key still gets 100 Continue."""
    from gateway.config import ApiKeyConfig

    keyed = Gateway(tiny_model_dir, api_keys=[ApiKeyConfig(key="sk-good")])
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\nExpect: 100-continue\r\n{}\r\n")
    try:
        for auth in ("", "Authorization: Bearer sk-wrong\r\n"):
            with _connect(keyed.port) as sock:
                sock.sendall(head.format(len(body), auth).encode())
                status, headers, data = _read_response(sock)
            assert status == 401 and json.loads(data)["error"]["code"] == ("invalid_api_key" if auth else None), data
            assert headers["connection"] == "close"
        with _connect(keyed.port) as sock:
            sock.sendall(head.format(len(body), "Authorization: Bearer sk-good\r\n").encode())
            interim = b""
            while not interim.endswith(b"\r\n\r\n"):
                interim += sock.recv(1)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(body)
            assert _read_response(sock)[0] == 200
    finally:
        keyed.close()


def _refused(port: int) -> dict[str, float]:
    """kvgate_http_refused_total by status, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with _connect(port) as sock:
        sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        status, _, text = _read_response(sock)
    assert status == 200
    return {sample.labels["status"]: sample.value for family in text_string_to_metric_families(text.decode())
            for sample in family.samples if sample.name == "kvgate_http_refused_total"}


def test_what_the_http_layer_answers_itself_is_counted(gateway):
    """A request that never reaches an endpoint's handler (unparsable, headers too
    slow, an Expect refused before its body) was in no metric: a client or proxy
    sending broken requests was invisible in Grafana."""
    before = _refused(gateway.port)
    assert before["400"] >= 0 and before["408"] >= 0  # exported from zero
    with _connect(gateway.port) as sock:
        sock.sendall(MALFORMED["not HTTP at all"][0])
        assert _read_response(sock)[0] == 400
    with _connect(gateway.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (9 * 2**20))
        assert _read_response(sock)[0] == 413
    with _connect(gateway.port) as sock:
        sock.sendall(b"POST /v1/chat/comp")  # and nothing more
        status, _, _ = _split(_read_until_closed(sock))
        assert status == 408
    # A path no endpoint serves or a method it does not take, asked with Expect
    # (curl's way for bodies over 1 KiB), counts once, as without it.
    for line in (b"POST /v1/no/such/path HTTP/1.1", b"PUT /v1/chat/completions HTTP/1.1"):
        with _connect(gateway.port) as sock:
            sock.sendall(line + b"\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2000\r\nExpect: 100-continue\r\n\r\n")
            assert _read_response(sock)[0] in (404, 405)
    after = _refused(gateway.port)
    assert (after["400"] - before["400"], after["413"] - before.get("413", 0), after["408"] - before["408"],
            after["404"] - before["404"], after["405"] - before["405"]) == (1, 1, 1, 1, 1)


def test_request_targets_that_are_no_path_get_an_openai_404(gateway):
    """`OPTIONS *` and `CONNECT host:port` never reach aiohttp's routes; they get
    OpenAI's error shape too, and the connection goes on serving."""
    with _connect(gateway.port) as sock:
        for line in (b"OPTIONS * HTTP/1.1", b"CONNECT example.com:443 HTTP/1.1"):
            sock.sendall(line + b"\r\nHost: 127.0.0.1\r\n\r\n")
            status, headers, data = _read_response(sock)
            assert status == 404 and headers["content-type"].startswith("application/json"), data
            error = json.loads(data)["error"]
            assert set(error) == ERROR_KEYS and error["code"] == "unknown_url"
        sock.sendall(_health(gateway.port))
        assert _read_response(sock)[0] == 200
    _assert_serving(gateway.port)


def test_a_client_leaving_mid_body_logs_no_error(gateway, caplog):
    caplog.set_level("DEBUG")
    with _connect(gateway.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\"")
        time.sleep(0.3)  # the handler waits for the rest of the body
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # a reset
    _assert_serving(gateway.port)
    time.sleep(0.2)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_deadline_off_with_zero_and_never_negative(tiny_model_dir):
    assert LimitsConfig().header_timeout_s == 10.0
    assert LimitsConfig(header_timeout_s=None).header_timeout_s is None
    with pytest.raises(ValidationError, match="header_timeout_s"):
        LimitsConfig(header_timeout_s=-1.0)
    gw = Gateway(tiny_model_dir, header_timeout_s=0)
    try:
        with _connect(gw.port) as sock:
            request = _health(gw.port)
            sock.sendall(request[:20])
            time.sleep(3 * HEADER_TIMEOUT_S)
            sock.sendall(request[20:])
            status, _, body = _read_response(sock)
        assert status == 200, body
    finally:
        gw.close()


async def test_handler_exception_outside_the_gateway_routes_is_an_openai_500():
    """aiohttp's own 500 page (a handler with no openai_errors wrapper) is JSON too."""
    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("bug")

    app = web.Application()
    app.router.add_get("/broken", broken)
    server = await start_server(app)
    try:
        async with ClientSession() as session, session.get(server.url + "/broken") as resp:
            body = await resp.json()
        assert resp.status == 500 and resp.headers["Connection"] == "close", resp.headers
        assert body["error"]["type"] == "server_error" and set(body["error"]) == ERROR_KEYS, body
    finally:
        await server.stop()


@pytest.mark.parametrize("error, secret", [
    # The pure-Python parser's (AIOHTTP_NO_EXTENSIONS=1) messages quote the bytes, some first.
    (TransferEncodingError(SECRET.decode() + ":\n\n  x"), SECRET.decode()),
    (BadStatusLine(SECRET.decode()), SECRET.decode()),
    (InvalidHeader(SECRET), SECRET.decode()),
    (LineTooLong(SECRET + b"...", 8190), SECRET.decode()),
])
def test_parse_error_messages_quote_nothing(error, secret, monkeypatch):
    monkeypatch.setattr(http_protocol, "_C_PARSER", False)
    api_error = parse_error(error)
    assert api_error.status == 400 and api_error.message and secret not in api_error.message


def test_kvgate_engine_server_has_both(tiny_model_dir, tmp_path):
    """`kvgate engine` (and `kvgate serve`, the same _serve) runs with the new protocol and the config's deadline."""
    proc = EngineProcess(tiny_config(tiny_model_dir, limits=LimitsConfig(header_timeout_s=HEADER_TIMEOUT_S)),
                         str(tmp_path))
    proc.start()
    try:
        asyncio.run(proc.wait_ready())
        with _connect(proc.port) as sock:
            sock.sendall(MALFORMED["invalid header name"][0])
            status, headers, body = _split(_read_until_closed(sock))
        assert status == 400 and json.loads(body)["error"]["code"] == "malformed_request", body
        with _connect(proc.port) as sock:
            started = time.monotonic()
            sock.sendall(_health(proc.port)[:20])
            raw = _read_until_closed(sock)
        assert raw.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < BOUND_S, raw
        assert "(event loop: uvloop)" in proc.tail()  # server.event_loop's default
    finally:
        proc.stop()


def test_a_client_that_stops_reading_is_cut_off_and_frees_its_slot(tiny_model_dir):
    """A streaming client that keeps its receive window shut is alive to TCP:
    without limits.send_timeout_s its request would hold the one slot under
    max_inflight_requests (and its in-flight count) for as long as it likes."""
    gw = Gateway(tiny_model_dir, "uvloop", send_timeout_s=1.0, max_inflight_requests=1)
    stalled = socket.socket()
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", gw.port))
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True,
                           "n": 8, "logprobs": True, "top_logprobs": 20, "max_tokens": 1000, "ignore_eos": True})
        stalled.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.monotonic() + 60
        statuses = []
        while time.monotonic() < deadline:
            statuses.append(_short_chat(gw.port)[0])
            if statuses[-1] == 200:
                break
            time.sleep(0.5)
        assert statuses[0] == 429 and statuses[-1] == 200, statuses  # held, then freed
        stalled.settimeout(10)
        received = _read_until_closed(stalled)  # what the kernel still held, then the end
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    finally:
        stalled.close()
        gw.close()


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_client_reading_a_large_body_slowly_is_not_cut_off(event_loop):
    """A non-streamed body goes to the transport in one write: the buffer stays
    above its low-water mark until nearly all of it has gone, so a client that
    reads steadily but slower than the whole body per send_timeout_s was cut
    off part way (a 12.8 MB n=2 echo body at 24 KB/s).  Reading is progress."""
    size = 12 * 1024 * 1024
    payload = b"x" * size

    async def large(request):
        return web.Response(body=payload)

    with _served_in_a_thread(event_loop, "/large", large, send_timeout_s=1.0) as port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET /large HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        received = 0
        sock.settimeout(10)
        started = time.monotonic()
        while True:  # ~3 MB/s: about 4 s for the body, four times the deadline
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += len(chunk)
            time.sleep(0.02)
        sock.close()
        assert received > size, (received, time.monotonic() - started)
        assert time.monotonic() - started > 2.0  # slower than the deadline, or this shows nothing


@pytest.mark.parametrize("event_loop, busy_s", [("uvloop", 0.2), ("asyncio", 0.2), ("uvloop", 1.2)])
def test_a_head_begun_while_the_last_handler_finishes_is_timed(event_loop, busy_s):
    """The client has its whole answer while the handler still runs (cleanup
    after write_eof; on a loaded machine, aiohttp's own bookkeeping): the next
    request's first bytes arrive before aiohttp waits for them, and must start
    the header deadline all the same, not leave the head to the keep-alive
    timeout (75 s by default).  A handler busy past the deadline gets its 408
    once it is done, never inside its response."""
    async def answered_then_busy(request):
        resp = web.StreamResponse(headers={"Content-Length": "2"})
        await resp.prepare(request)
        await resp.write(b"ok")
        await resp.write_eof()
        await asyncio.sleep(busy_s)
        return resp

    with _served_in_a_thread(event_loop, "/busy", answered_then_busy, keepalive_timeout=8.0) as port:
        with _connect(port) as sock:
            sock.sendall(f"GET /busy HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            status, _, body = _read_response(sock)
            assert (status, body) == (200, b"ok")
            started = time.monotonic()
            sock.sendall(_health(port)[:20])  # while the handler still runs
            raw = _read_until_closed(sock)
            elapsed = time.monotonic() - started
        assert raw.startswith(b"HTTP/1.1 408 ") and max(HEADER_TIMEOUT_S, busy_s) * 0.9 <= elapsed < BOUND_S, (
            raw, elapsed)


@contextlib.contextmanager
def _served_in_a_thread(event_loop: str, path: str, handler, **runner_kwargs) -> Iterator[int]:
    """One GET handler behind KvgateRunner, on its own event loop in a thread: its port."""
    from gateway.http_protocol import KvgateRunner

    loop = uvloop.new_event_loop() if event_loop == "uvloop" else asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        app = web.Application()
        app.router.add_get(path, handler)
        runner = KvgateRunner(app, header_timeout_s=HEADER_TIMEOUT_S, access_log=None, **runner_kwargs)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _idle_after(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sends on an idle connection within ``seconds`` (None:
    nothing, still open)."""
    sock.settimeout(seconds)
    try:
        return _read_until_closed(sock)
    except socket.timeout:
        return None


@pytest.mark.parametrize("how", ["body apart", "body unread", "chunked end apart", "expect 100-continue"])
def test_a_body_in_a_read_of_its_own_starts_no_header_deadline(gateway, how):
    """Body bytes are no next request's head, in whatever read they come (a long
    prompt arrives in several), read by the handler or not: an idle keep-alive
    connection after them gets no 408 and stays open."""
    port = gateway.port
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    path = "/v1/models" if how == "body unread" else "/v1/completions"  # a GET handler reads no body
    method = "GET" if how == "body unread" else "POST"
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    with _connect(port) as sock:
        if how == "chunked end apart":
            sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n".encode() + body + b"\r\n")
            time.sleep(0.1)
            sock.sendall(b"0\r\n\r\n")
        elif how == "expect 100-continue":
            sock.sendall(f"{head}Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
            sock.settimeout(10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")
            sock.sendall(body)
        else:
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
            time.sleep(0.1)
            sock.sendall(body)
        sock.settimeout(30)
        status, _, answer = _read_response(sock)
        assert status == 200, answer
        assert _idle_after(sock, 3 * HEADER_TIMEOUT_S) is None  # no 408, not closed
        sock.sendall(_health(port))  # and still serving on it
        assert _read_response(sock)[0] == 200
