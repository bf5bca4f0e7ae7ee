"""Bad-input suite: every malformed request gets a 4xx OpenAI error body and the server keeps serving.

One gateway (one real tiny engine replica) runs in a background thread so
that the checks, including hypothesis' fuzzing of the request schema, are
plain synchronous HTTP calls over loopback.  Bounded: a fixed case list and
a capped number of fuzzed examples, each with a tiny max_tokens.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.config import ReplicaConfig
from gateway.server import start_server
from tests.engine_procs import MODEL, tiny_config

ERROR_KEYS = {"message", "type", "param", "code"}


class Server:
    def __init__(self, model_dir: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app = create_app(tiny_config(model_dir, [ReplicaConfig(kind="inprocess")]))
        self.server = self.call(start_server(app), 120)
        self.port = int(self.server.url.rsplit(":", 1)[1])

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, body: bytes, content_type: str = "application/json",
             headers: dict | None = None) -> tuple[int, dict | None]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": content_type, **(headers or {})})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, None

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server(tiny_model_dir)
    yield s
    s.close()


def _assert_4xx(status: int, data: dict | None, what: str) -> None:
    assert 400 <= status < 500, (what, status, data)
    assert data is not None and set(data["error"]) == ERROR_KEYS, (what, data)
    assert isinstance(data["error"]["message"], str) and data["error"]["message"]


def _assert_serving(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 1}
    status, data = server.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and data["choices"], data


def _chat(**fields) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    body.update(fields)
    return json.dumps(body).encode()


CASES = [
    ("truncated JSON", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "us'),
    ("empty body", "/v1/chat/completions", b""),
    ("not an object", "/v1/chat/completions", b"[1, 2, 3]"),
    ("invalid UTF-8", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    ("messages not a list", "/v1/chat/completions", _chat(messages="hello")),
    ("content a number", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 42}])),
    ("max_tokens a string", "/v1/chat/completions", _chat(max_tokens="ten")),
    ("max_tokens a float", "/v1/chat/completions", _chat(max_tokens=1.5)),
    ("negative max_tokens", "/v1/chat/completions", _chat(max_tokens=-5)),
    ("zero max_tokens", "/v1/chat/completions", _chat(max_tokens=0)),
    ("huge max_tokens", "/v1/chat/completions", _chat(max_tokens=10**30)),
    ("huge temperature", "/v1/chat/completions", _chat(temperature=1e308 * 10)),
    ("huge n", "/v1/chat/completions", _chat(n=2**63)),
    ("huge seed", "/v1/chat/completions", _chat(seed=10**40)),
    ("NaN top_p", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}'),
    ("unknown role", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "abracadabra"}])),
    ("missing role", "/v1/chat/completions", _chat(messages=[{"content": "who am I"}])),
    ("empty messages", "/v1/chat/completions", _chat(messages=[])),
    ("10,000 messages", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": "x"}] * 10_000)),
    ("stream not a bool", "/v1/chat/completions", _chat(stream="yes")),
    ("stop of numbers", "/v1/chat/completions", _chat(stop=[1, 2])),
    ("logprobs wrong type", "/v1/chat/completions", _chat(logprobs="all")),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-nope")),
    ("model missing", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()),
    ("prompt missing", "/v1/completions", json.dumps({"model": MODEL}).encode()),
    ("prompt token out of vocab", "/v1/completions", json.dumps({"model": MODEL, "prompt": [10**9]}).encode()),
    ("prompt negative token", "/v1/completions", json.dumps({"model": MODEL, "prompt": [-1, 5]}).encode()),
    ("prompt nested wrong", "/v1/completions", json.dumps({"model": MODEL, "prompt": [[1, "a"]]}).encode()),
    ("prompt too long", "/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 5000}).encode()),
    ("10 MB body", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "'
     + b"a" * (10 * 1024 * 1024) + b'"}]}'),
]


@pytest.mark.parametrize("what,path,body", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_a_4xx_openai_error(server, what, path, body):
    status, data = server.post(path, body)
    _assert_4xx(status, data, what)
    if what == "10 MB body":
        assert status == 413


@pytest.mark.parametrize("encoding,body,says", [
    ("gzip", b"this is not gzip at all", "Content-Encoding"),
    ("deflate", b"\x00\x01 nor deflate", "Content-Encoding"),
    ("gzip", gzip.compress(_chat())[:-12], "JSON"),  # cut short: what decodes is no whole JSON
])
def test_a_body_that_does_not_decode_is_a_400(server, encoding, body, says):
    status, data = server.post("/v1/chat/completions", body, headers={"Content-Encoding": encoding})
    _assert_4xx(status, data, f"bad {encoding} body")
    assert status == 400 and says in data["error"]["message"]
    # A body that does decode is served.
    status, data = server.post("/v1/chat/completions", gzip.compress(_chat()), headers={"Content-Encoding": "gzip"})
    assert status == 200 and data["choices"], data


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "text/json"])
def test_a_body_sent_as_another_media_type_is_refused(server, content_type):
    """What a page on any site can make a browser send without a CORS preflight
    (text/plain, a form) was read as JSON and run: a 415 now, as JSON's own is
    served with or without parameters, and with no Content-Type at all."""
    status, data = server.post("/v1/chat/completions", _chat(), content_type=content_type)
    _assert_4xx(status, data, content_type)
    assert status == 415 and data["error"]["code"] == "unsupported_media_type"
    assert "application/json" in data["error"]["message"]
    for served in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        status, data = server.post("/v1/chat/completions", _chat(), content_type=served)
        assert status == 200 and data["choices"], (served, data)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=_chat())  # http.client sends no Content-Type
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["choices"]
        # ... but not from a browser (it sends Origin), whose fetch of an untyped Blob needs no
        # preflight either: a page on any site would run its request here.
        conn.request("POST", "/v1/chat/completions", body=_chat(), headers={"Origin": "https://evil.example"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        assert resp.status == 415 and data["error"]["code"] == "unsupported_media_type"
        assert data["error"]["message"].startswith("Content-Type none is not supported here")
    finally:
        conn.close()


def test_server_still_serving_after_the_bad_cases(server):
    for what, path, body in CASES[:5]:
        server.post(path, body)
    _assert_serving(server)


# ----------------------------------------------------------------------------- fuzzing

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False), st.text(max_size=20),
)
_anything = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", ""]), _anything)
_content = st.one_of(st.text(max_size=40), _anything,
                     st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "audio"]),
                                                     "text": st.text(max_size=10)}), max_size=2))
_message = st.one_of(st.fixed_dictionaries({"role": _role, "content": _content}), _anything)
_chat_body = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), _anything), "messages": st.one_of(st.lists(_message, max_size=4), _anything)},
    optional={
        "max_tokens": st.one_of(st.integers(min_value=-3, max_value=2), _anything),
        "temperature": st.one_of(st.floats(min_value=-1, max_value=3), _anything),
        "top_p": _anything, "n": st.one_of(st.integers(min_value=-1, max_value=3), _anything),
        "stream": st.one_of(st.booleans(), _anything), "stop": _anything, "seed": _anything,
        "logprobs": _anything, "top_logprobs": _anything, "presence_penalty": _anything,
        "user": _anything, "stream_options": _anything, "response_format": _anything,
    },
)
_completion_body = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), _anything),
     "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(min_value=-5, max_value=600), max_size=8), _anything)},
    optional={"max_tokens": st.one_of(st.integers(min_value=-3, max_value=2), _anything), "n": _anything,
              "echo": _anything, "logprobs": _anything, "best_of": _anything, "suffix": _anything},
)


_response_part = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal", "input_file"])},
                          optional={"text": _anything, "image_url": _anything, "refusal": _anything}),
    _anything)
_response_item = st.one_of(
    st.fixed_dictionaries({"role": _role, "content": st.one_of(st.text(max_size=40), st.lists(_response_part, max_size=2),
                                                               _anything)},
                          optional={"type": st.one_of(st.just("message"), _anything)}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning"])},
                          optional={"call_id": st.one_of(st.just("c"), _anything), "name": _anything,
                                    "arguments": _anything, "output": _anything}),
    _anything)
_response_tool = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"])},
                          optional={"name": st.one_of(st.just("f"), _anything), "parameters": _anything,
                                    "strict": _anything}),
    _anything)
_response_body = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), _anything),
     "input": st.one_of(st.text(max_size=30), st.lists(_response_item, max_size=3), _anything)},
    optional={
        "instructions": st.one_of(st.text(max_size=20), _anything),
        "max_output_tokens": st.one_of(st.integers(min_value=-3, max_value=2), _anything),
        "temperature": _anything, "text": st.one_of(st.fixed_dictionaries({"format": _anything}), _anything),
        "metadata": _anything, "truncation": _anything, "previous_response_id": _anything,
        "tools": st.one_of(st.lists(_response_tool, max_size=2), _anything), "tool_choice": _anything,
        "stream": st.one_of(st.booleans(), _anything), "include": _anything, "top_logprobs": _anything,
        "reasoning": _anything, "background": _anything, "store": _anything,
    },
)


def _bounded(body: dict, field: str = "max_tokens") -> dict:
    # A fuzzed body that happens to be valid must still finish fast.
    if isinstance(body.get(field), int) and body[field] > 2:
        body[field] = 2
    elif field not in body:
        body[field] = 2
    return body


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.one_of(_chat_body.map(lambda b: ("/v1/chat/completions", b)),
                 _completion_body.map(lambda b: ("/v1/completions", b))))
def test_fuzzed_requests_never_5xx(server, case):
    path, body = case
    status, data = server.post(path, json.dumps(_bounded(body)).encode())
    if status == 200:
        return  # valid by chance: served
    _assert_4xx(status, data, json.dumps(body)[:200])


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(_response_body)
def test_fuzzed_responses_requests_never_5xx(server, body):
    status, data = server.post("/v1/responses", json.dumps(_bounded(body, "max_output_tokens")).encode())
    if status == 200:
        return  # valid by chance: served
    _assert_4xx(status, data, json.dumps(body)[:200])


def test_still_serving_after_fuzzing(server):
    _assert_serving(server)
