"""aiohttp's HTTP/1.1 server protocol with its gaps closed, below the app's handlers.

- A request aiohttp cannot parse (a bad request line, an invalid header, broken
  chunked framing, a line over the size limit) gets an OpenAI error body with a
  message of ours; broken framing inside a body already being read fails that
  body, which the handler answers with a 400, rather than leave it waiting.  aiohttp's own answer is a text/plain page quoting the
  offending bytes, an Authorization header (an API key) included.
- A request's headers must arrive within ``header_timeout_s`` of its first byte
  (a new connection's first request: of the connection's opening).  aiohttp
  has no such deadline, so a client sending its headers a byte at a time
  (slow-loris) would hold a connection, and a file descriptor, for aiohttp's
  keep-alive hour.  The idle wait between requests stays aiohttp's
  ``keepalive_timeout``.
- A client that reads nothing of a response for ``send_timeout_s`` while the
  send buffer is full is disconnected: aiohttp would wait on it for ever, and
  the handler waiting to write holds the request's engine work and slots.  A
  client still reading, however slowly, is not (the check is for progress).
  The kernel's own send buffer (up to ``net.ipv4.tcp_wmem``'s maximum, a few
  MB) fills first: a stream smaller than that runs to its end.
- A request target that is no path (``OPTIONS *``, ``CONNECT host:port``)
  gets an OpenAI 404; aiohttp's router never offers it to the app's routes.

aiohttp internals relied on (checked against 3.14): ``AppRunner._make_server``
(runs the app's startup and returns the ``web.Server`` the sites use as their
protocol factory); ``Server._loop`` and ``Server._kwargs`` (what
``Server.__call__`` passes to the protocol); and in ``RequestHandler``,
``handle_error``'s signature, ``_waiter`` (set only while ``start()`` waits for
the next request), ``_messages`` (requests parsed and not yet taken, a parse
error among them, as an ``_ErrInfo``), ``_current_request``, ``close()`` and
``_loop``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import struct
from http import HTTPStatus
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import (
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.http_parser import HttpRequestParser, HttpRequestParserPy
from aiohttp.streams import EMPTY_PAYLOAD, EmptyStreamReader, StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from gateway import errors
from gateway.errors import ApiError

log = logging.getLogger(__name__)

try:  # the kernel's unsent bytes of a socket (Linux: SIOCOUTQ, same value as TIOCOUTQ)
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):
    fcntl = None
    _OUTQ = None

# The first match names the error; all are the client's (400, as aiohttp answers them).
_PARSE_ERRORS = (
    (LineTooLong, "HTTP request line or header field too long", "line_too_long"),
    (InvalidHeader, "Malformed HTTP request header", "invalid_header"),
    (InvalidURLError, "Malformed request URL", "invalid_url"),
    (BadStatusLine, "Malformed HTTP request line", "invalid_request_line"),
    (HttpProcessingError, "Malformed HTTP request", "malformed_request"),
)

# llhttp's reason, a fixed string, before aiohttp's quote of the bytes: "Invalid header token:\n\n  b'...'".
# Only the C parser's: some of the pure-Python parser's messages begin with the bytes.
_LLHTTP_REASON = re.compile(r"([A-Za-z][A-Za-z0-9_ '/.-]{0,79}):\n\n  ")
_C_PARSER = HttpRequestParser is not HttpRequestParserPy
# aiohttp's refusal of an encoding it has no decoder for: "... content-encoding: brotli (br). Please install ...".
_UNSUPPORTED_ENCODING = re.compile(r"content-encoding: \w+ \((br|zstd)\)\. Please install")
# aiohttp's own messages that quote nothing the client sent.
_FIXED_REASONS = frozenset({
    "Too many headers received",
    "Missing 'Host' header in request.",
    "Received HTTPS traffic on an HTTP port",
})


def parse_error(exc: HttpProcessingError, status: int = 400) -> ApiError:
    """The OpenAI error for a request aiohttp could not parse; its message
    never repeats the request's bytes."""
    unsupported = _UNSUPPORTED_ENCODING.search(exc.message) if isinstance(exc, ContentEncodingError) else None
    if unsupported:
        # br or zstd without its decoder installed: the client's choice of encoding,
        # not a malformed request (RFC 9110's 415 names what to send instead).
        return errors.unsupported_encoding(unsupported.group(1))
    summary, code = next((s, c) for kind, s, c in _PARSE_ERRORS if isinstance(exc, kind))
    detail = ""
    if isinstance(exc, LineTooLong):
        if isinstance(exc.args[1], int):
            detail = f"the limit is {exc.args[1]} bytes"
    elif exc.message in _FIXED_REASONS:
        detail = exc.message.rstrip(".")
    elif _C_PARSER and (reason := _LLHTTP_REASON.match(exc.message)):
        detail = reason.group(1)
    message = f"{summary}: {detail}." if detail else f"{summary}."
    return ApiError(status, message, "invalid_request_error", None, code)


def _server_error(status: int) -> ApiError:
    if status == 500:
        return errors.internal_error()
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return ApiError(status, f"{HTTPStatus(status).phrase}.", kind)


def _header_timeout_response(seconds: float) -> bytes:
    """A whole 408 response, written by hand: there is no request object to answer."""
    error = ApiError(408, f"The request headers did not arrive within {seconds:g} s.", code="request_timeout")
    body = json.dumps(error.body())
    head = ("HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return (head + body).encode()


class KvgateRequestHandler(RequestHandler):
    """aiohttp's protocol, one per connection, plus OpenAI parse errors and a header deadline.

    The deadline costs no timer per request: a head that comes in one read
    touches none, one that comes in pieces sets ``_header_deadline``, and the
    connection's one timer, when it fires early, moves itself to the deadline
    then in force (as aiohttp's keep-alive timer does).
    """

    __slots__ = ("_header_timeout", "_header_deadline", "_header_started", "_header_timer", "_no_request_yet",
                 "_last_payload", "_send_timeout", "_send_timer", "_send_backlog", "_on_refused")

    def __init__(self, manager: web.Server, *, header_timeout_s: float | None = None,
                 send_timeout_s: float | None = None, on_refused: Callable[[int], None] | None = None,
                 **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._on_refused = on_refused  # told the status of each answer given here, not by a handler
        self._header_timeout = header_timeout_s or 0.0
        self._send_timeout = send_timeout_s or 0.0
        self._send_timer: asyncio.TimerHandle | None = None
        self._send_backlog = 0  # bytes the transport held when the send timer was (re)armed
        self._header_deadline = 0.0  # 0: no request's headers awaited
        self._header_started = False  # some of them arrived
        self._header_timer: asyncio.TimerHandle | None = None
        # start() may not have run yet when the first bytes come (uvloop hands
        # them over in the same turn as the accept), so its waiter is not there
        # to say the connection is idle.
        self._no_request_yet = True
        self._last_payload: StreamReader | EmptyStreamReader = EMPTY_PAYLOAD  # the newest request's body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._header_timeout:
            self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        # start() idle: these bytes begin or continue a request's head
        awaiting = self._waiter is not None or (self._no_request_yet and not self._messages)
        # Decided before the parser takes them: they also begin the next head when
        # the newest request's body had all come before them, though its handler
        # may still be finishing (the client has its whole answer).  Bytes that end
        # a body, or that a handler leaves unread, never start a deadline.
        head_next = awaiting or (not self._upgraded and self._last_payload.is_eof())
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:
            self._last_payload = self._messages[-1][1]
            if not awaiting:
                self._fail_unfinished_body()
        if self._messages:  # a request's head is in (or a parse error queued): the handler's limits take over
            self._no_request_yet = False
            self._header_deadline = 0.0
            self._header_started = False
        elif head_next and self._header_timeout and data.strip(b"\r\n"):
            # Bare line ends between requests are ignored (RFC 9112 2.2), not timed.
            if not self._header_deadline:
                self._arm_header_deadline()
            self._header_started = True

    def _fail_unfinished_body(self) -> None:
        """Broken framing inside the body being read (a bad chunk size, say):
        aiohttp queues the error as a request of its own and leaves that body
        waiting for bytes that will never come right, until body_timeout_s.
        The body fails instead (the handler answers 400) and the connection
        closes after that answer."""
        message = self._messages[-1][0]
        request = self._current_request
        if not isinstance(message, _ErrInfo) or request is None or request.content.is_eof():
            return  # a broken request behind a whole one: answered in its turn
        self._messages.pop()
        request.content.set_exception(RequestPayloadError("broken framing in the request body"))
        self.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().connection_lost(exc)

    # The transport calls these as its send buffer passes its high and low
    # water marks: a timer runs only while a client is behind.
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timeout and self._send_timer is None:
            self._arm_send_timer()

    def _arm_send_timer(self) -> None:
        self._send_backlog = self._unsent_bytes()
        self._send_timer = self._loop.call_later(self._send_timeout, self._client_stopped_reading)

    def _unsent_bytes(self) -> int:
        """What the client has yet to take: the transport's buffer, plus the
        kernel's send queue where it says (Linux).  The transport's alone moves
        in steps: the kernel wakes its writer only once much of a send buffer
        of up to a few MB has drained, which a slow reader may take seconds for."""
        transport = self.transport
        if transport is None:
            return 0
        unsent = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if _OUTQ is not None and sock is not None:
            try:
                unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
            except (OSError, ValueError):
                pass
        return unsent

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().resume_writing()

    def _client_stopped_reading(self) -> None:
        self._send_timer = None
        if self.transport is not None and self._paused:
            if self._unsent_bytes() < self._send_backlog:
                # Behind but reading: a large body written at once stays above the
                # low-water mark until nearly all of it has gone, so progress, not
                # resume_writing, is what shows a client still taking it.
                self._arm_send_timer()
                return
            log.info("disconnecting a client that read nothing for %g s (limits.send_timeout_s)", self._send_timeout)
            # The handler's pending write fails as if the client had gone: the
            # request is aborted and its slots freed.
            self.transport.abort()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp's own: its logging (server.py filters out the bytes) and its
        # ConnectionError when a response is already under way; its page is dropped.
        super().handle_error(request, status, exc, message)
        error = parse_error(exc, status) if isinstance(exc, HttpProcessingError) else _server_error(status)
        response = error.response()
        response.force_close()
        # Said outright: aiohttp leaves it implicit in the HTTP/1.0 it answers a parse error in.
        response.headers["Connection"] = "close"
        if self._on_refused is not None and isinstance(exc, HttpProcessingError):
            self._on_refused(error.status)  # a handler's own 500 is counted by the handler
        return response

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self._loop.time() + self._header_timeout
        if self._header_timer is None:
            self._header_timer = self._loop.call_at(self._header_deadline, self._check_header_deadline)

    def _check_header_deadline(self) -> None:
        self._header_timer = None
        deadline = self._header_deadline
        if not deadline or self.transport is None:
            return  # the next request's first byte arms it again
        if self._loop.time() < deadline:
            self._header_timer = self._loop.call_at(deadline, self._check_header_deadline)
            return
        if self._messages:  # its head came after all
            self._header_deadline = 0.0
            self._header_started = False
            return
        if self._waiter is None:
            # The last request's handler is still running (a head begun while it
            # finishes): no 408 may interleave with its response; look again later.
            self._header_timer = self._loop.call_at(self._loop.time() + self._header_timeout,
                                                    self._check_header_deadline)
            return
        log.debug("closing a connection whose request headers took over %g s", self._header_timeout)
        if self._header_started:
            # The previous response is complete (start() waits for a request), so this
            # cannot interleave with one.  None for a connection that sent nothing: a
            # client may be about to reuse it, and would read a 408 as its answer.
            self.transport.write(_header_timeout_response(self._header_timeout))
            if self._on_refused is not None:
                self._on_refused(408)
        self.force_close()  # the transport sends what is buffered, then closes


class KvgateServer(web.Server):
    """``web.Server`` (the protocol factory) building KvgateRequestHandler."""

    def __init__(self, *args, header_timeout_s: float | None = None, send_timeout_s: float | None = None,
                 on_refused: Callable[[int], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.send_timeout_s = send_timeout_s
        self.on_refused = on_refused

    def __call__(self) -> KvgateRequestHandler:
        return KvgateRequestHandler(self, loop=self._loop, header_timeout_s=self.header_timeout_s,
                                    send_timeout_s=self.send_timeout_s, on_refused=self.on_refused, **self._kwargs)


class KvgateRunner(web.AppRunner):
    """``web.AppRunner`` whose connections get KvgateRequestHandler; takes AppRunner's arguments."""

    __slots__ = ("_header_timeout_s", "_send_timeout_s", "_on_refused")

    def __init__(self, app: web.Application, *, header_timeout_s: float | None, send_timeout_s: float | None = None,
                 on_refused: Callable[[int], None] | None = None, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._send_timeout_s = send_timeout_s
        self._on_refused = on_refused

    async def _make_server(self) -> web.Server:
        # AppRunner's own runs the app's startup and builds the app's Server;
        # the same one is built again here, as ours, from the same arguments.
        plain = await super()._make_server()
        return KvgateServer(_paths_only(plain.request_handler), request_factory=plain.request_factory,
                            handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                            header_timeout_s=self._header_timeout_s, send_timeout_s=self._send_timeout_s,
                            on_refused=self._on_refused, **plain._kwargs)


def _paths_only(handler):
    """The app's handler, but a request target that is no path (``OPTIONS *``,
    ``CONNECT host:port``) gets an OpenAI 404: aiohttp's router only tries
    routes on paths, so the app's catch-all route never sees these and aiohttp
    answers with a text/plain page.
    """

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.path[:1] != "/":
            return errors.not_found(f"{request.method} {request.raw_path}").response()
        return await handler(request)

    return handle
