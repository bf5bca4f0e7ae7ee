"""OpenAI-shaped errors.

Every failure a client can see leaves the gateway as
``{"error": {"message", "type", "param", "code"}}`` with OpenAI's status codes,
so SDKs raise their own exception classes (BadRequestError, NotFoundError, ...).
Nothing else ever reaches the wire: no tracebacks, no aiohttp HTML pages.
"""

from __future__ import annotations

import json
from random import getrandbits

from aiohttp import web


class ApiError(Exception):
    """An error meant for the client; ``status`` and body follow OpenAI."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = 1  # seconds, on a 429 or 503 (an upstream server's own, when relayed)
        # False: the answer says so (x-should-retry, which OpenAI's SDKs obey instead of
        # retrying a 5xx): an error that a retry within seconds meets again.
        self.retryable = True
        self.relayed = False  # an upstream server's error, in its own words
        # The completion's id once the request was read: the one its replicas were
        # sent, so that the answer's x-request-id finds the request in their logs.
        self.request_id: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        resp = web.Response(
            status=self.status,
            body=json.dumps(self.body()).encode(),
            content_type="application/json",
        )
        if self.status in (429, 503):
            # A hint for any client (OpenAI's SDKs wait this long before their retry):
            # at capacity, no healthy replica yet, or this instance stopping.
            resp.headers["Retry-After"] = str(self.retry_after)
        elif self.status == 415:
            resp.headers["Accept-Encoding"] = "gzip, deflate"  # what to send instead (RFC 9110)
        elif self.status == 408:
            # A body that did not arrive in time: its rest cannot be told from a next
            # request, so the connection ends with this answer (RFC 9110 15.5.9), once
            # aiohttp's lingering read (up to 10 s) has taken what the client still sends.
            resp.force_close()
        if not self.retryable:
            resp.headers["x-should-retry"] = "false"
        # As on every OpenAI response (the SDK's error.request_id); a completion's is its own id.
        resp.headers["x-request-id"] = self.request_id or f"req-{getrandbits(96):024x}"
        return resp


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unsupported_encoding(coding: str) -> ApiError:
    return ApiError(415, f"Content-Encoding {coding} is not supported here: send the body as it is, or "
                    "compressed with gzip or deflate.", "invalid_request_error", None, "unsupported_content_encoding")


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, f"Content-Type {content_type} is not supported here: send the body as JSON with "
                    "Content-Type: application/json (curl: -H 'Content-Type: application/json').",
                    "invalid_request_error", None, "unsupported_media_type")


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")


def missing_api_key() -> ApiError:
    # OpenAI's answer to no key: the same 401, with no code (a wrong key's is invalid_api_key).
    return ApiError(401, "You didn't provide an API key. You need to provide your API key in an Authorization "
                    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", "invalid_request_error")


def context_too_long(limit: int, what: str, param: str, reduce: str | None = None) -> ApiError:
    """OpenAI's words for a prompt (and completion) past the context: ``what``
    the request came to, and what to shorten (``param`` by default)."""
    return ApiError(400, f"This model's maximum context length is {limit} tokens. However, {what}. "
                    f"Please reduce the length of the {reduce or param}.", param=param, code="context_length_exceeded")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def not_found(path: str) -> ApiError:
    return ApiError(404, f"Unknown request URL: {path}.", "invalid_request_error", None, "unknown_url")


def response_not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id[:64]}' not found: kvgate stores no responses (each says "
                    "store: false).", "invalid_request_error", None, "response_not_found")


def completion_not_stored(completion_id: str) -> ApiError:
    return ApiError(404, f"Chat completion with id '{completion_id[:64]}' not found: kvgate stores no chat completions "
                    "('store' is ignored).", "invalid_request_error", None, "chat_completion_not_found")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body too large: the limit is {limit} bytes.", "invalid_request_error", None, "request_too_large")


def body_timeout(seconds: float) -> ApiError:
    return ApiError(408, f"The request body did not arrive within {seconds:g} s.", "invalid_request_error", None,
                    "request_timeout")


def no_replica(reason: str = "No healthy replica is available to serve this request.") -> ApiError:
    # 503 (not 429): the client did nothing wrong, retrying later may succeed.
    return ApiError(503, reason, "service_unavailable", None, "no_healthy_replica")


def too_many_followers(limit: int) -> ApiError:
    return ApiError(503, f"This engine has {limit} /kv_events followers, its limits.max_kv_event_followers; "
                    "retry shortly.", "service_unavailable", None, "too_many_followers")


def overloaded(limit: int) -> ApiError:
    return ApiError(429, f"The server is at capacity ({limit} requests in flight); retry shortly.",
                    "rate_limit_error", None, "server_overloaded")


def bodies_overloaded(limit: int) -> ApiError:
    return ApiError(429, f"The server is receiving too many request bodies at once ({limit} bytes together); "
                    "retry shortly.", "rate_limit_error", None, "server_overloaded")


def tenant_overloaded(limit: int) -> ApiError:
    return ApiError(429, f"Too many requests in flight for your organization ({limit} at once); retry shortly.",
                    "rate_limit_error", None, "rate_limit_exceeded")


def shutting_down(message: str = "The server is shutting down; retry the request.") -> ApiError:
    # 503: OpenAI's SDK retries it, and behind a load balancer the retry lands
    # on an instance that is staying.
    return ApiError(503, message, "service_unavailable", None, "server_shutting_down")


def relayed(status: int, body: dict, message: str, type: str, code: str | None = None) -> ApiError:
    """An upstream server's OpenAI error body passed on; its own fields win
    over the defaults given here."""
    error = body.get("error") if isinstance(body.get("error"), dict) else {}
    exc = ApiError(status, error.get("message") or message, error.get("type") or type, error.get("param"),
                   error.get("code") or code)
    exc.relayed = True
    return exc


def upstream_error(message: str) -> ApiError:
    return ApiError(502, message, "api_error", None, "upstream_error")


def request_lost(servers: int) -> ApiError:
    return ApiError(502, f"The model server running this request failed while running it, {servers} time(s) on "
                         "different servers; it is not tried on another, in case it is what brings them down.",
                    "api_error", None, "request_lost")


def request_quarantined(seconds: int) -> ApiError:
    refused = ApiError(502, f"Model servers failed while running this prompt; it is refused for the next {seconds} s, "
                            "in case it is what brings them down.", "api_error", None, "request_quarantined")
    refused.retryable = False  # the SDK's retries (within ~10 s) would only be refused again
    return refused


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.", "server_error", None, None)
