"""Browser access to the API (CORS) from the origins in ``server.cors_allow_origins``."""

from __future__ import annotations

from aiohttp import web

from gateway.errors import ApiError


class Cors:
    """Browser access from ``server.cors_allow_origins``: preflights answered,
    responses marked for the allowed origins (their scripts may then read them)."""

    def __init__(self, origins: list[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def _allowed(self, origin: str | None) -> str | None:
        if origin is None:
            return None
        return "*" if self.any else origin if origin in self.origins else None

    async def on_response(self, request: web.Request, resp: web.StreamResponse) -> None:
        allowed = self._allowed(request.headers.get("Origin"))
        if allowed is not None:
            resp.headers["Access-Control-Allow-Origin"] = allowed
            resp.headers["Access-Control-Expose-Headers"] = "x-request-id, retry-after"
        if not self.any:
            # The answer depends on the Origin, allowed or not: a shared cache must not
            # hand one origin's copy (without the allow header) to another (Fetch, "CORS
            # protocol and HTTP caches").
            resp.headers["Vary"] = "Origin"

    async def preflight(self, request: web.Request, methods: set[str]) -> web.Response:
        if self._allowed(request.headers.get("Origin")) is None:
            raise ApiError(403, "This origin may not call the API from a browser (server.cors_allow_origins).",
                           "invalid_request_error", None, "origin_not_allowed")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": ", ".join(sorted(methods)),
            # Whatever the page's request carries (Authorization, the SDK's x-stainless-* headers).
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ""),
            "Access-Control-Max-Age": "600",
        })
