"""`server.access_log`'s line: one a request, as an operator greps it::

    127.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 5856 0.412s chatcmpl-3f9c0a... "OpenAI/Python 1.0" r1

The client's address; the request line as sent; the status as
kvgate_requests_total counts it (a stream that failed after its first byte
shows its error event's, 502 or 503, though 200 went on the wire; 499: the
client left); bytes sent, head included; seconds since the request arrived;
its x-request-id (the completion id, which each hop's log names); the user
agent; the replica that answered (as nginx's $upstream_addr; several, comma
separated, for a request of several prompts; "-" where none did, as for a
refusal, and on a `kvgate engine`).  The record's own time is when the request
ended.  aiohttp's default line has neither the duration nor the id, and dates
the request twice.

Monitoring that succeeds is left out (nginx's ``access_log off`` on a
location): health probes, scrapes, the dashboard's polls and a gateway's polls
and event stream on its engines (and its probes of /v1/models on a kvgate
gateway behind it, told by its User-Agent) came every few seconds each and
buried the clients' lines.  Their failures are logged.
"""

from __future__ import annotations

import json
import logging

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse


# Paths polled by machines: /health and /ready (probes), /metrics (Prometheus),
# /stats (the dashboard, every 2 s), a `kvgate engine`'s to its gateways.
_MONITORING = frozenset({"/health", "/ready", "/metrics", "/stats", "/kv_events", "/kvgate/info", "/kvgate/stats"})


class AccessLine(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        if response.status < 400 and request.method in ("GET", "HEAD") and (
                request.path in _MONITORING or (request.path == "/v1/models" and _from_a_gateway(request))):
            return  # a gateway in front probes /v1/models every health_interval_s
        status = getattr(response, "failed_status", None) or response.status
        major, minor = request.version
        self.logger.info('%s "%s %s HTTP/%d.%d" %s %d %.3fs %s "%s" %s', request.remote or "-", request.method,
                         _printable(request.raw_path), major, minor, status, response.body_length, time,
                         _printable(response.headers.get("x-request-id", "-")),
                         _printable(request.headers.get("User-Agent", "-")),
                         _printable(getattr(response, "replica", None) or "-"))

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def _printable(text: str) -> str:
    """``text`` escaped as in a JSON string, quotes kept out: a client's header
    cannot end the line or forge a field."""
    return json.dumps(text)[1:-1]


def _from_a_gateway(request: BaseRequest) -> bool:
    return request.headers.get("User-Agent", "").startswith("kvgate-gateway/")
