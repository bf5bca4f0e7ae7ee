"""The aiohttp app: OpenAI endpoints in front of a set of replicas.

The request path, and where each step lives: auth -> body
limits -> parse/validate (gateway/protocol.py) -> tokenise once, block keys
(gateway/prefix.py; the prompt tokens go to the engine with the request) ->
classify (gateway/classify.py) -> route and generate (gateway/dispatch.py:
in-flight counted before sending, released on every exit) -> shape as OpenAI
JSON or SSE (gateway/respond.py).  This module holds the app and the steps
up to the dispatch.

The same app, built with ``engine_mode=True`` over a single in-process replica,
is `kvgate engine`: it also accepts ``kvgate_context`` (the gateway's
classification) and serves the endpoints of gateway/engine_endpoints.py
(``/kv_events`` and friends) so a remote gateway can keep an exact index of
this engine's cache.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from aiohttp import HttpVersion11, web
from aiohttp.web_protocol import RequestPayloadError

from engine.chat_tokens import ChatTokenizer
from engine.config import ConfigError
from engine.context import REQUEST_TYPES, WORKLOADS, RequestContext
from gateway import errors
from gateway.classify import ANONYMOUS, Classifier, Principal
from gateway.config import ENGINE_REPLICA_NAME, MAX_TENANT_NAME, KvgateConfig
from gateway.cors import Cors
from gateway.dispatch import Dispatcher, Sub
from gateway.engine_endpoints import EngineEndpoints
from gateway.errors import ApiError, bad_request
from gateway.metrics import GatewayMetrics
from gateway.observe import Observer
from gateway.prefix import PrefixHasher, Prompt
from gateway.protocol import CHAT, COMPLETIONS, ParsedRequest, new_id, parse_json, parse_request
from gateway.replicas import InProcessReplica, Replica, build_replicas, default_model_name, load_tokenizer
from gateway.respond import Responder, uncancel
from gateway.responses_api import RESPONSES, ResponsesCall, chat_request
from gateway.router import Router, share_fleet
from gateway.shapes import now_s
from gateway.startup_thread import in_daemon_thread

log = logging.getLogger(__name__)
# Distinct ignored request fields named in the log, at most.
_MAX_IGNORED_LOGGED = 64

# Completions default (OpenAI's); chat defaults to what the context leaves, capped by limits.
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Content-Encodings aiohttp decodes as it reads a body (br and zstd only with their
# optional package: without it aiohttp refuses them, gateway/http_protocol.py).
_READ_ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})
# Status label for requests whose client went away (nginx's convention).
CLIENT_GONE = "499"
_STATIC = Path(__file__).parent / "static"
_DASHBOARD_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Type": "text/html; charset=utf-8",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # img-src data: for the page's empty icon (<link rel="icon" href="data:,">), which
    # stops the browser's /favicon.ico request; under default-src 'none' alone it was
    # a CSP violation in the console at every load instead of that request's 404.
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "img-src data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'none'",
}


class Gateway:
    """Everything one app holds: replicas, router, classifier, hasher, metrics."""

    def __init__(
        self, config: KvgateConfig, replicas: list[Replica], engine_mode: bool = False, tokenizer: object = None
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self.limits = config.server.limits
        self.max_inflight = config.server.limits.max_inflight_requests
        self.admitted = 0  # requests past their body, for max_inflight_requests
        self.pending_body_bytes = 0  # of bodies still arriving, for max_pending_body_bytes
        self.max_per_tenant = config.server.limits.max_inflight_per_tenant
        self.tenant_admitted: dict[str, int] = {}  # the same per tenant (only those with requests in flight)
        self.replicas = replicas
        # The exact indexes share one map, so that routing reads every replica in
        # one pass; before the replicas start following their engines' events.
        share_fleet([r.index for r in replicas])
        self.engine_mode = engine_mode
        self.metrics = GatewayMetrics("engine" if engine_mode else "gateway")
        # Recording is the gateway's: engines sharing its config (as the manifests'
        # do) would each write the same path, or fail on a read-only disk.
        self.observer = Observer(config, self.metrics, record=not engine_mode)
        self.principals = _load_keys(config)
        if self.max_per_tenant is not None and not self.principals:
            # Tenants are API keys': without keys every request is anonymous, and no limit applies.
            log.warning("server.limits.max_inflight_per_tenant is set but there are no API keys, so there are no "
                        "tenants and it limits nothing (set server.api_keys, or max_inflight_requests for all)")
        # A `kvgate engine` takes the salt its gateway computed as it is (prepare).
        self.isolate_tenants = config.server.isolate_tenant_caches
        self._warn_where_tenants_are_not_kept_apart()
        self.router: Router | None = None
        self.hasher: PrefixHasher | None = None
        self.classifier: Classifier | None = None
        self.dispatcher: Dispatcher | None = None
        self.responder: Responder | None = None
        self.model_name = ""
        self.max_model_len = config.model.max_model_len
        self.passthrough = False
        self.has_external = False
        # Stopping (gateway/server.py): draining -> /ready fails; refusing -> new
        # requests get a 503; cutting -> the requests still in ``live`` are being
        # cancelled, and end with an OpenAI error rather than a dropped connection.
        self.draining = False
        self.refusing = False
        self.cutting = False
        self.live: set[asyncio.Task] = set()
        self.drain_hooks: list[Callable[[], None]] = []
        self._identity_known = True
        # The block identity (block size, hash salt) each `kvgate engine` last said:
        # once all of them agree on one, the gateway hashes with it.
        self._identities: dict[str, tuple[int, str | bytes]] = {}
        # The context length each replica last said it serves: requests are held to
        # the shortest of these (a replica restarted longer raises it again).
        self._lengths: dict[str, int] = {}
        self._token_chars: float | None = None  # see _chars_per_token
        self.created = now_s()
        # Request fields no one reads, each logged once (clients pick the names: bounded).
        self.ignored_logged: set[str] = set()
        # The model's own sampling defaults (its generation_config.json), for the fields requests leave out.
        self.sampling_defaults: dict = {}
        # The model's max_new_tokens (generation_config.json): chat's default max_tokens.
        self.model_max_tokens: int | None = None

    # -- lifecycle

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.close()

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.close()  # the replicas that started: their sessions and probes
            raise

    async def _start(self) -> None:
        local = next((r for r in self.replicas if isinstance(r, InProcessReplica)), None)
        tokenizer = None
        if local is None:
            # Before the replicas: a model that cannot be read stops the gateway now,
            # not after waiting out a replica that is not answering yet.
            tokenizer = self._tokenizer or await in_daemon_thread(load_tokenizer, self.config)
        await asyncio.gather(*(r.start() for r in self.replicas))
        from engine.model_loader import sampling_defaults

        defaults = await in_daemon_thread(sampling_defaults, self.config.model)
        if defaults:
            log.info("the model's generation_config sets %s for requests that leave them out (as vLLM's "
                     "--generation-config auto)", ", ".join(f"{k}={v:g}" for k, v in defaults.items()))
        self.model_max_tokens = defaults.pop("max_tokens", None)
        self.sampling_defaults = defaults
        if local is not None:
            eng = local.engine
            chat_tokens = getattr(eng, "chat_tokens", None)
            encoder = chat_tokens.encode_text if chat_tokens is not None else None
            self.hasher = PrefixHasher(eng.tokenizer, eng.block_size, eng.hash_salt, eng.apply_chat_template, encoder)
            info = local.info
        else:
            chat_tokens = await in_daemon_thread(ChatTokenizer, tokenizer, self.config.model.tokenize_cache_tokens)
            # Engines know their block identity exactly; external servers only their name.
            engines = [r for r in self.replicas if r.kind == "engine"]
            known = next((r for r in engines if r.info_known), None)
            info = (known or (engines or self.replicas)[0]).info
            # No engine answered yet: hash with the config's identity (the one an
            # engine on the same config has) until one says otherwise.
            self._identity_known = known is not None or not engines
            self.hasher = PrefixHasher(
                tokenizer, info.block_size, info.hash_salt, chat_tokens.encode_chat, chat_tokens.encode_text
            )
        if chat_tokens is not None:
            self.metrics.watch_chat_tokens(chat_tokens.stats)
        self.model_name = self.config.model.served_name or info.model
        self.max_model_len = info.max_model_len
        if local is not None and not self.engine_mode:
            # Known now for an in-process engine; a remote one's comes later (not checked).
            self._warn_if_no_file_class()
        # Fields the kvgate engine cannot honour (tools, JSON output, echo with
        # logprobs, ...) are the external servers' to handle, passed through as
        # sent; in a mixed fleet such requests go to those servers only.
        self.passthrough = all(r.kind == "openai" for r in self.replicas)
        self.has_external = any(r.kind == "openai" for r in self.replicas)
        self.classifier = Classifier(self.config.classifier, self.hasher)
        self.router = Router(self.config.router, [r.name for r in self.replicas], self.hasher.block_size,
                             rotation=random.randrange(1 << 20))
        self.dispatcher = Dispatcher(self.router, self.replicas, self.metrics, self.observer)
        self.responder = Responder(self.model_name, self.observer, self.engine_mode,
                                   (lambda: local.seq) if self.engine_mode else None)
        for r in self.replicas:
            r.info_listener = self.replica_learnt
            if r.kind == "inprocess":
                self._lengths[r.name] = r.info.max_model_len
            elif r.info_known:  # it answered as the replicas started, before anyone listened
                self.replica_learnt(r)
        if self._lengths:
            self.max_model_len = min(self._lengths.values())
        for i, r in enumerate(self.replicas):
            # Load the gateway cannot count itself: other gateways' requests on a shared
            # `kvgate engine`, other clients' and queueing on an external server.
            r.load_listener = lambda load, i=i: self.router.set_external_load(i, load)
        for i, r in enumerate(self.replicas):
            self.metrics.watch_replica(
                r.name,
                lambda i=i: self.router.inflight_requests[i],
                lambda r=r: 1.0 if r.healthy else 0.0,
                lambda r=r: len(r.index),
                lambda i=i: self.router.external_tokens[i],
                lambda r=r: 1.0 if r.absent else 0.0,
            )
        self.observer.start(self.replicas, lambda i: self.router.inflight_requests[i], self.hasher.block_size, self.hasher.salt)
        if not self.engine_mode:
            self._log_fleet()

    def _log_fleet(self) -> None:
        """What a gateway serves and over which replicas, once, at start: an
        engine says what it runs, but a gateway over remote replicas said
        nothing but "listening"."""
        def named(r: Replica) -> str:
            if r.kind == "inprocess":
                return f"{r.name} (in-process)"
            state = "in routing" if r.healthy else "absent" if r.absent else "not in routing yet"
            return f"{r.name} ({r.kind}, {state})"

        log.info("serving %r (context %d tokens) over %d %s: %s; routing %s; client API keys %s", self.model_name,
                 self.max_model_len, len(self.replicas), "replica" if len(self.replicas) == 1 else "replicas",
                 ", ".join(named(r) for r in self.replicas), self.config.router.policy,
                 f"on ({len(self.principals)})" if self.principals else "off")

    def _warn_where_tenants_are_not_kept_apart(self) -> None:
        """Tenants are kept apart in an external server's cache only by the salt
        the gateway sends it (send_cache_salt, off by default as vLLM V0 refuses
        the field): without it their prompts hit each other's blocks there, and
        cached_tokens tells one what another sent.  In a kvgate engine's, only by
        its key: a keyless one takes any client's salt, a tenant's included."""
        if not self.isolate_tenants or not any(p.tenant for p in self.principals.values()):
            return
        for replica in self.replicas:
            cfg = getattr(replica, "cfg", None)
            if replica.kind == "openai" and cfg is not None and not cfg.send_cache_salt:
                log.warning("replica %s is an external server without send_cache_salt: tenants share its prefix cache "
                            "(server.isolate_tenant_caches holds on kvgate engines only); set send_cache_salt: true "
                            "for a vLLM V1 server", replica.name)
            elif replica.kind == "engine" and not replica.auth_headers():
                # The tenants' salts are easily guessed: the engine is the boundary.
                log.warning("replica %s is a kvgate engine reached without a key: whoever can reach it (any process "
                            "on its host, for one on loopback) may send it a tenant's cache_salt and learn what that "
                            "tenant sent (cached_tokens, its /kv_events); start engines with KVGATE_API_KEYS and "
                            "give this replica api_key_env", replica.name)

    def _warn_if_no_file_class(self) -> None:
        """A prompt of file_min_tokens or more leaves no room for an answer in
        max_model_len (a 400): the file rule would never fire, silently (the
        defaults, 2048 and the bundled model's 2048, are such a pair)."""
        cfg = self.config.classifier
        if cfg.file_min_tokens >= self.max_model_len and any(rule.when == "file" for rule in cfg.rules):
            log.warning("classifier.file_min_tokens (%d) is not below the %d tokens the model serves (max_model_len): "
                        "no request can be classified as a file, so the file rule, cache.workload_aware.overrides.file "
                        "and signatures never apply; set classifier.file_min_tokens below %d", cfg.file_min_tokens,
                        self.max_model_len, self.max_model_len)

    def replica_learnt(self, replica: Replica) -> None:
        """A remote replica told the gateway what it is: an external server its model
        name and context length (it may have been down at start); a `kvgate engine`
        its block identity, which the gateway's hashes must equal or its index never
        matches a prompt."""
        info = replica.info
        if replica.kind == "openai":
            if any(r.kind != "openai" for r in self.replicas):
                # A mixed fleet keeps the name its own replicas gave it (clients
                # already use it); the server is sent its own name.
                self._hold_to_shortest(replica, info.max_model_len)
                if info.model != self.model_name:
                    log.info("replica %s serves the model as %r; the gateway keeps serving it as %r", replica.name,
                             info.model, self.model_name)
                return
            if self.config.model.served_name is None and info.model != self.model_name:
                log.info("serving the model as %r, the name replica %s gives it", info.model, replica.name)
                self.model_name = self.responder.model_name = info.model
            self._hold_to_shortest(replica, info.max_model_len)
            return
        identity = (info.block_size, info.hash_salt)
        self._identities[replica.name] = identity
        current = (self.hasher.block_size, self.hasher.salt)
        if identity != current or not self._identity_known:
            # An in-process engine's identity is fixed; otherwise the engines' own,
            # once they all say the same (after a rolling restart onto another
            # engine.block_size, the gateway's hashes would match none of them).
            local = any(r.kind == "inprocess" for r in self.replicas)
            if not local and set(self._identities.values()) == {identity}:
                again, self._identity_known = self._identity_known, True
                self.hasher.block_size = self.router.block_size = info.block_size
                self.hasher.salt = info.hash_salt
                self.observer.block_identity(info.block_size, info.hash_salt)
                if again:
                    log.warning("every engine now hashes blocks of %d tokens salted %r (the gateway hashed %d salted "
                                "%r): hashing as they do", info.block_size, info.hash_salt, *current)
                else:
                    log.info("replica %s answered: hashing blocks as it does (%d tokens, salt %r)", replica.name,
                             info.block_size, info.hash_salt)
            else:
                log.error("replica %s hashes blocks of %d tokens salted %r, the gateway %d salted %r: its prefix index "
                          "cannot match (run every engine on the same model and engine.block_size)", replica.name,
                          info.block_size, info.hash_salt, *current)
        self._hold_to_shortest(replica, info.max_model_len)
        expected = default_model_name(self.config)
        if info.model != expected and self.config.model.served_name is None:
            log.error("replica %s runs model %r but the gateway tokenises prompts for %r (model.path): give the "
                      "gateway the engines' model", replica.name, info.model, expected)

    def _hold_to_shortest(self, replica: Replica, its_length: int) -> None:
        """Replicas of different context lengths (models, KV pools, vLLM's
        --max-model-len): a request that fits one replica only would get a 400
        wherever the router sent it otherwise, so every request is held to the
        shortest each replica last said, with a warning.  Not a ratchet: a
        replica restarted with a longer context raises the limit again."""
        others = [n for name, n in self._lengths.items() if name != replica.name]
        self._lengths[replica.name] = its_length
        self.max_model_len = min(self._lengths.values())
        if others and its_length != min(others):
            log.warning("replica %s serves at most %d tokens (its model or KV pool), another %d: requests are held "
                        "to %d, what every replica serves (give the replicas the same model.max_model_len and KV "
                        "pool, or vLLM the same --max-model-len)", replica.name, its_length, min(others),
                        self.max_model_len)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas), return_exceptions=True)
        await self.observer.close()

    # -- small endpoints

    def stalled_steps(self) -> dict[str, float]:
        """In-process replicas whose model step has run past engine.step_timeout_s
        (a stuck kernel, a hung GPU), name -> seconds: out of routing meanwhile.
        The event loop answers while the step's thread hangs, so only this shows it."""
        stalled = {}
        for replica in self.replicas:
            seconds = replica.stalled_for() if isinstance(replica, InProcessReplica) else 0.0
            if seconds:
                stalled[replica.name] = round(seconds, 1)
        return stalled

    async def health(self, request: web.Request) -> web.Response:
        # A hung model step is what a liveness check (Docker's HEALTHCHECK, a
        # Kubernetes probe) must see: only a restart frees the device.
        stalled = self.stalled_steps()
        if stalled:
            return web.json_response({"status": "stalled", "stalled_replicas": stalled}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        healthy = [r.name for r in self.replicas if r.healthy]
        ready = bool(healthy) and not self.draining
        body = {"ready": ready, "healthy_replicas": healthy}
        if self.draining:
            body["draining"] = True
        return web.json_response(body, status=200 if ready else 503)

    # -- stopping (driven by gateway/server.py)

    def begin_drain(self) -> None:
        """Out of load balancers' rotation: /ready fails from now on; requests are still served."""
        if not self.draining:
            self.draining = True
            self.responder.draining = True
            for hook in self.drain_hooks:
                hook()

    def cut_live(self) -> None:
        """End the requests still in flight: each answers with an OpenAI error (an
        error event for a stream under way) instead of a dropped connection."""
        self.refusing = self.cutting = True
        self.responder.cutting = True
        for task in list(self.live):
            task.cancel()

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        await self.observer.refresh()
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = self.metrics.content_type
        return resp

    async def stats(self, request: web.Request) -> web.Response:
        """The dashboard's data (schema in gateway/stats.py)."""
        await self.observer.refresh()
        return web.json_response(self.observer.stats_json())

    async def dashboard(self, request: web.Request) -> web.FileResponse:
        # Served from the package: the page loads nothing from anywhere else, and
        # its policy says so (only its own inline script and style, /stats from
        # here; no framing by other sites).
        return web.FileResponse(_STATIC / "dashboard.html", headers=_DASHBOARD_HEADERS)

    async def models(self, request: web.Request) -> web.Response:
        self.authenticate(request)
        data = [self.model_card()] if any(r.healthy for r in self.replicas) else []
        return web.json_response({"object": "list", "data": data}, headers={"x-request-id": new_id("req-")})

    async def model(self, request: web.Request) -> web.Response:
        self.authenticate(request)
        name = request.match_info["model"]
        if name != self.model_name or not any(r.healthy for r in self.replicas):
            raise errors.model_not_found(name)
        return web.json_response(self.model_card(), headers={"x-request-id": new_id("req-")})

    def model_name_unknown(self) -> bool:
        """Whether the served model's name is still to learn: no ``model.served_name``, and
        the external servers that name it (a fleet of them alone) have not answered yet."""
        return (self.passthrough and self.config.model.served_name is None
                and not any(r.info_known for r in self.replicas))

    def model_card(self) -> dict:
        # max_model_len as vLLM gives it: clients (and a gateway in front of this
        # one) size their requests by it.
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvgate",
                "max_model_len": self.max_model_len}

    # -- auth and body

    def authenticate(self, request: web.Request) -> Principal:
        if not self.principals:
            return ANONYMOUS
        sent = request.headers.getall("Authorization", ())
        if len(sent) > 1:
            # One credential: a proxy adding its own beside the client's must not find the client's taking its place.
            raise errors.unauthorized()
        scheme, _, key = (sent[0] if sent else "").strip().partition(" ")
        key = key.strip()
        if not key and scheme.lower() in ("", "bearer"):  # no header, or "Bearer" alone
            raise errors.missing_api_key()
        if scheme.lower() != "bearer":
            raise errors.unauthorized()
        # Looked up by digest: the time a lookup takes says nothing about how much
        # of a guessed key was right (a dict of the keys themselves compares them).
        principal = self.principals.get(_key_digest(key))
        if principal is None:
            raise errors.unauthorized()
        return principal

    async def read_body(self, request: web.Request) -> dict:
        content_type = request.headers.get("Content-Type")
        if content_type:
            if not _is_json_media_type(content_type):
                # A page on any site may make a browser POST text/plain or a form here with
                # no CORS preflight: reading such a body as JSON would run its request.
                raise errors.unsupported_media_type(content_type.split(";")[0].strip()[:60])
        elif "Origin" in request.headers:
            # So may it a body of no type (fetch of a Blob, mode no-cors): only
            # browsers send Origin, and a client of the API sends its JSON typed.
            raise errors.unsupported_media_type("none")
        coding = request.headers.get("Content-Encoding")
        if coding is not None and coding.strip().lower() not in _READ_ENCODINGS:
            # aiohttp would hand such a body over as it came, to fail as JSON if
            # compressed ("compress", a chain of two) and be read if not.
            raise errors.unsupported_encoding(coding.strip()[:40])
        limit = self.limits.max_body_bytes
        content = request.content
        try:
            if content.is_eof():
                # The whole body came with the headers (any small request): take it
                # as it lies, without request.read()'s copy and its two awaits.
                raw = content.read_nowait()
                if len(raw) > limit:
                    raise errors.too_large(limit)
                return parse_json(raw)
            if request.content_length is not None and request.content_length > limit:
                raise errors.too_large(limit)
            raw = await asyncio.wait_for(self._read_pending_body(content, limit),
                                         self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise errors.body_timeout(self.limits.body_timeout_s) from None
        except RequestPayloadError:
            # aiohttp decodes a compressed body as it reads it; one that does not decode is the client's.
            raise bad_request("The request body could not be read: it does not decode as its Content-Encoding "
                              "says, or its framing is broken.") from None
        return parse_json(raw)

    async def _read_pending_body(self, content, limit: int) -> bytes:
        """A body still arriving, within limits.max_pending_body_bytes of all such
        bodies together, counted as its bytes come (a declared length, reserved
        before any of it came, let 32 connections that sent only their headers
        hold the default budget for body_timeout_s: every other body that did not
        come with its headers got a 429 meanwhile).  Beyond the budget a 429
        (OpenAI's SDKs retry it), and the body is not buffered further."""
        budget = self.limits.max_pending_body_bytes
        reserved = 0
        try:
            chunks, size = [], 0
            while chunk := await content.readany():
                size += len(chunk)
                if size > limit:
                    raise errors.too_large(limit)  # aiohttp decodes a compressed body as it comes
                if budget is not None:
                    if self.pending_body_bytes + len(chunk) > budget:
                        raise errors.bodies_overloaded(budget)
                    self.pending_body_bytes += len(chunk)
                    reserved = size
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            self.pending_body_bytes -= reserved

    # -- completions

    async def serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        start = time.perf_counter()
        workload = "unknown"
        subs: list[Sub] = []
        status = "500"
        task = asyncio.current_task()
        self.live.add(task)
        admitted = False
        tenant_admitted: str | None = None
        parsed: ParsedRequest | None = None
        call: ResponsesCall | None = None
        try:
            principal = self.authenticate(request)
            # A key that fixes the workload names it before classification, so a
            # request refused from here on (429 above all) counts under its own.
            workload = principal.workload or workload
            if self.refusing:
                raise errors.shutting_down()
            body = await self.read_body(request)
            # Counted once the body is in: a client trickling its body holds no slot.
            # An engine's limits are for clients calling it directly: a gateway's
            # requests were counted by that gateway (per gateway, as README says), and
            # here they all come under its one key, every tenant of every gateway.
            limited = not (self.engine_mode and endpoint != RESPONSES and isinstance(body.get("kvgate_context"), dict))
            if self.max_inflight is not None and limited:
                if self.admitted >= self.max_inflight:
                    raise errors.overloaded(self.max_inflight)
                self.admitted += 1
                admitted = True
            if self.max_per_tenant is not None and principal.tenant is not None and limited:
                held = self.tenant_admitted.get(principal.tenant, 0)
                if held >= self.max_per_tenant:
                    raise errors.tenant_overloaded(self.max_per_tenant)
                self.tenant_admitted[principal.tenant] = held + 1
                tenant_admitted = principal.tenant
            if endpoint == RESPONSES:
                body, call = chat_request(body)
                parsed = parse_request(CHAT, body, self.limits, self.engine_mode, self.sampling_defaults)
                parsed.responses, parsed.id = call, new_id("resp_")
                for name in ("temperature", "top_p"):
                    if body.get(name) is None and name in self.sampling_defaults:
                        # What it is sampled with: the model's generation_config default, not OpenAI's 1.0.
                        call.echo[name] = self.sampling_defaults[name]
                parsed.ignored = call.ignored_as_sent(parsed.ignored)
                if call.ignored and self.has_external:
                    self.note_ignored(call.ignored)  # this API's own: no server gets them either
            else:
                parsed = parse_request(endpoint, body, self.limits, self.engine_mode, self.sampling_defaults)
            given_id = request.headers.get("X-Request-Id")
            if given_id is not None:
                parsed.id = _named_completion_id(given_id, parsed.id)
                if self.engine_mode:
                    parsed.sent_as = given_id
            if self.engine_mode:
                endpoint = forwarded_endpoint(parsed.body, endpoint)
            if parsed.model != self.model_name:
                if self.model_name_unknown():
                    # No external server has named its model yet (every one down since the
                    # gateway started): the name may well be the one it will give, so the
                    # client is told to come back (503, which OpenAI's SDKs retry) rather
                    # than that its model does not exist.
                    raise errors.no_replica("No model server has answered yet, so the model it serves is not "
                                            f"known: `{parsed.model[:256]}` may be it; retry shortly.")
                raise errors.model_not_found(parsed.model)
            if parsed.engine_unsupported is not None and not self.has_external:
                raise bad_request(*parsed.engine_unsupported)
            if parsed.ignored is not None and not self.has_external:  # an external server may read them
                self.note_ignored(parsed.ignored)
            subs = await self.prepare(request, parsed, principal)
            workload = subs[0].context.workload
            gen, single = self.dispatcher.run(subs, parsed)
            if parsed.stream:
                stream = self.responder.stream if call is None else self.responder.stream_events
                resp = await stream(request, gen, single, parsed, subs, start)
            else:
                resp = await self.responder.complete(gen, single, parsed, subs, start)
            # A stream that failed after its first byte counts under its error's status.
            status = str(getattr(resp, "failed_status", None) or resp.status)
            if not self.engine_mode:
                # For the access line, as nginx's $upstream_addr: which replica served it.
                resp.replica = _replicas_of(subs)
            if self.draining:
                # A keep-alive client would keep coming back here; on a new
                # connection the load balancer sends it to an instance that stays.
                resp.force_close()
            return resp
        except ApiError as exc:
            status = str(exc.status)
            if call is not None:
                call.rename(exc)  # chat's field names, as this API calls them
            if parsed is not None:
                exc.request_id = parsed.id
            raise
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            if self.cutting and isinstance(exc, asyncio.CancelledError):
                # Cancelled by cut_live(), not by the client leaving: answer.
                uncancel(task)
                status = "503"
                cut = errors.shutting_down()
                if parsed is not None:
                    # Raised here, past the ApiError clause above: named as it does.
                    cut.request_id = parsed.id
                raise cut from None
            status = CLIENT_GONE
            _log_client_gone(request, start, exc, parsed.id if parsed is not None else None,
                             None if self.engine_mode else _replicas_of(subs))
            raise
        finally:
            self.live.discard(task)
            if admitted:
                self.admitted -= 1
            if tenant_admitted is not None:
                held = self.tenant_admitted[tenant_admitted] - 1
                if held:
                    self.tenant_admitted[tenant_admitted] = held
                else:
                    del self.tenant_admitted[tenant_admitted]  # bounded by the tenants with requests in flight
            self.metrics.requests.labels(endpoint, workload, status).inc()
            if status == "200":
                self.metrics.request_series(workload, subs[0].replica).e2e.observe(time.perf_counter() - start)
                self.observer.answered()

    def note_ignored(self, fields: set[str]) -> None:
        """Say once per name that requests carry a field nothing reads, as vLLM
        logs them: a misspelt option would otherwise go unnoticed."""
        new = fields - self.ignored_logged
        room = _MAX_IGNORED_LOGGED - len(self.ignored_logged)
        if not new or room <= 0:
            return
        names = sorted(new)[:room]
        self.ignored_logged.update(names)
        full = f" ({_MAX_IGNORED_LOGGED} names logged: later ones are not)" if room <= len(names) else ""
        log.warning("requests carry fields the kvgate engine does not read, ignored: %s%s",
                    ", ".join(repr(name[:64]) for name in names), full)

    async def prepare(self, request: web.Request, parsed: ParsedRequest, principal: Principal) -> list[Sub]:
        """Tokenise, check lengths, classify: everything before routing."""
        # A request with kvgate_context is a gateway's, its salt the tenant's already; a
        # `kvgate engine` serving clients directly keeps their tenants apart itself.
        if self.isolate_tenants and principal.tenant is not None and not (
                self.engine_mode and "kvgate_context" in parsed.body):
            # The tenant joins the request's own salt: its blocks are its own.
            # Length-prefixed, so no tenant name and own salt can spell another pair.
            tenant, own = principal.tenant, parsed.cache_salt or ""
            parsed.cache_salt = f"tenant:{len(tenant)}:{tenant}:{own}"
        prompts, sources = await self.tokenize(parsed)
        for prompt in prompts:
            if not prompt.token_ids:
                raise bad_request("The prompt is empty after tokenisation.", parsed.prompt_param)
        if not self.passthrough:
            # Token ids are checked against the engines' vocabulary, the gateway's own.
            # External servers judge theirs: a file-less gateway's tokenizer (the
            # bundled model's) is not the served model's.
            self._check_token_ids(parsed, prompts)
        # Each prompt its own (vLLM's rule): a default fills what its own length leaves,
        # not what the longest prompt leaves.
        default = self._default_max_tokens(parsed) if parsed.max_tokens is None else 0
        uncounted = self._uncounted_tokens(parsed) if parsed.max_tokens is None else 0
        max_tokens = [self.resolve_max_tokens(parsed, len(prompt.token_ids), default, uncounted) for prompt in prompts]
        parsed.sampling.max_tokens = max(max_tokens)
        if parsed.sampling.min_tokens > min(max_tokens):
            raise bad_request(f"min_tokens ({parsed.sampling.min_tokens}) must be at most max_tokens "
                              f"({min(max_tokens)}).", "min_tokens")
        if parsed.echo and not self.passthrough and parsed.engine_unsupported is None:
            decode = self.hasher.tokenizer.decode
            parsed.echo_texts = [p if isinstance(p, str) else decode(p) for p in sources]
        override = self.engine_context(parsed.body) if self.engine_mode else None
        subs = []
        n = parsed.sampling.n
        for p, (prompt, source) in enumerate(zip(prompts, sources)):
            if override is not None:
                ctx = override
                ctx.prompt_tokens = len(prompt.token_ids)
                ctx.prompt_blocks = len(prompt.keys)
            else:
                ctx = self.classifier.classify(
                    parsed, principal, request.headers, len(prompt.token_ids), len(prompt.keys), prompt.token_ids, p
                )
            # A default that is the context's room by the gateway's count: an external
            # server counts the prompt with its own tokenizer and fills its room itself.
            fills_room = parsed.max_tokens is None and max_tokens[p] < default
            subs.append(Sub(prompt, source, ctx, p * n, max_tokens[p], fills_room=fills_room))
        return subs

    def _check_token_ids(self, parsed: ParsedRequest, prompts: list[Prompt]) -> None:
        vocab = self.hasher.vocab_size
        # Client-supplied token ids only; template output is valid by construction.
        if parsed.endpoint != CHAT and any(max(prompt.token_ids) >= vocab for prompt in prompts):
            raise bad_request(f"Token ids must be below the vocabulary size {vocab}.", "prompt")
        bias = parsed.sampling.logit_bias
        if bias and max(bias) >= vocab:
            raise bad_request(f"Invalid key in 'logit_bias': {max(bias)}. Token ids must be below the vocabulary size "
                              f"{vocab}.", "logit_bias")
        stop_ids = parsed.sampling.stop_token_ids
        if stop_ids and max(stop_ids) >= vocab:
            raise bad_request(f"Invalid 'stop_token_ids': {max(stop_ids)}. Token ids must be below the vocabulary size "
                              f"{vocab}.", "stop_token_ids")

    def _chars_per_token(self) -> float:
        """The most characters one token of this tokenizer stands for (its longest
        vocabulary entry: a byte-level entry has a character per byte, and a
        decoded character takes at least one), twice over for normalisers;
        unbounded for a tokenizer that cannot list its vocabulary."""
        if self._token_chars is None:
            try:
                vocab = self.hasher.tokenizer.get_vocab()
                self._token_chars = 2 * max((len(piece) for piece in vocab), default=1)
            except Exception:  # noqa: BLE001 - no vocabulary to read: every prompt is tokenised and judged
                log.warning("the tokenizer lists no vocabulary: prompts are tokenised whatever their length "
                            "before the context length is checked")
                self._token_chars = math.inf
        return self._token_chars

    def _refuse_unfitting_prompts(self, parsed: ParsedRequest) -> None:
        """Refuse a prompt that cannot fit the context before tokenising it: a
        prompt of megabytes, refused only after, took seconds of CPU and
        gigabytes of memory (about 280 bytes a token) from any key holder.
        A text longer than the context's tokens could hold at the most
        characters per token has more tokens than the context; token lists are
        counted as they are."""
        limit = self.max_model_len
        param = parsed.prompt_param
        if parsed.endpoint == CHAT:
            sizes = [(False, parsed.content_chars)]
        else:
            sizes = [(isinstance(p, list), len(p)) for p in parsed.prompts]
        for ids, size in sizes:
            if ids and size > limit:
                said = f"resulted in {size} tokens"
            elif not ids and size > limit * self._chars_per_token():
                said = f"ran to {size} characters, more than {limit} tokens can hold"
            else:
                continue
            raise errors.context_too_long(limit, f"your {param} {said}", param)

    async def tokenize(self, parsed: ParsedRequest) -> tuple[list[Prompt], list]:
        self._refuse_unfitting_prompts(parsed)
        hasher = self.hasher
        salt = parsed.cache_salt
        if parsed.endpoint == CHAT:
            # An external server renders the tools of tool calling itself (_uncounted_tokens estimates them).
            work = lambda: [hasher.chat(parsed.messages, parsed.images, salt, parsed.template_tools)]  # noqa: E731
            sources = [None]
            size = parsed.content_chars
        else:
            specials = parsed.add_special_tokens
            work = lambda: [hasher.text(p, salt, specials) for p in parsed.prompts]  # noqa: E731
            sources = parsed.prompts
            # Characters of text, or ids of token lists (hashing a million ids stalls the loop too).
            size = sum(len(p) for p in parsed.prompts)
        try:
            if size > self.config.server.offload_tokenize_chars:
                # A huge document would stall every other stream on the loop.
                prompts = await asyncio.to_thread(work)
            else:
                prompts = work()
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - template/tokenizer errors are the request's fault
            param = parsed.prompt_param
            raise bad_request(f"Could not tokenise the {param}: {exc}", param) from None
        if self.engine_mode and parsed.body.get("kvgate_mm_hashes"):
            prompts = [prompts[0]._replace(mm_hashes=_mm_hashes(parsed.body["kvgate_mm_hashes"]))]
        return prompts, sources

    def _uncounted_tokens(self, parsed: ParsedRequest) -> int:
        """About how many tokens an external server's prompt holds beyond the
        messages the gateway counts: tool definitions and earlier tool calls, which
        its chat template renders into the prompt (counted as their JSON).  Earlier
        calls count twice where the gateway's own template writes them too: a
        default max_tokens then errs small, and the server fills the room itself."""
        if parsed.endpoint != CHAT or parsed.engine_unsupported is None:
            return 0
        body = parsed.body
        parts = [body.get("tools"), body.get("functions")]
        parts += [m.get("tool_calls") for m in parsed.messages or () if isinstance(m, dict)]
        parts = [p for p in parts if p]
        if not parts:
            return 0
        text = json.dumps(parts)
        if len(text) > self.max_model_len * self._chars_per_token():
            return self.max_model_len  # more than the context, surely: no need to tokenise megabytes to say so
        return len(self.hasher.tokenizer.encode(text, add_special_tokens=False))

    def resolve_max_tokens(self, parsed: ParsedRequest, prompt_len: int, default: int, uncounted: int = 0) -> int:
        """The request's max_tokens, or ``default`` (_default_max_tokens) as far as
        the context holds it.  ``uncounted``: tokens the server's prompt holds
        beyond ``prompt_len`` by estimate (tools): a default leaves room for them
        when it can."""
        room = self.max_model_len - prompt_len
        param = parsed.prompt_param
        if parsed.max_tokens is None:
            if room < 1:
                raise errors.context_too_long(self.max_model_len, f"your {param} resulted in {prompt_len} tokens", param)
            if parsed.endpoint != CHAT and default > room and not self.passthrough:
                # Completions' default (16) counts against the context as a max_tokens sent does,
                # as OpenAI's and vLLM's: a 400, not a shorter answer.  (External servers count
                # the prompt themselves, where the gateway's count may be an estimate: sent
                # without max_tokens below, the server's own 16 and count judge it.)
                raise errors.context_too_long(
                    self.max_model_len, f"you requested {prompt_len + default} tokens ({prompt_len} in the {param}, "
                    f"{default} in the completion)", param, reduce=f"{param} or completion")
            # Past the context by the estimate: the server, which counts exactly, judges.
            return min(default, room - uncounted if room - uncounted >= 1 else room)
        if parsed.max_tokens > room:
            raise errors.context_too_long(
                self.max_model_len, f"you requested {prompt_len + parsed.max_tokens} tokens ({prompt_len} in the "
                f"{param}, {parsed.max_tokens} in the completion)", param, reduce=f"{param} or completion")
        return parsed.max_tokens

    def _default_max_tokens(self, parsed: ParsedRequest) -> int:
        """max_tokens for a request without one, the context's room aside."""
        if parsed.endpoint != CHAT:  # OpenAI's 16, within the server's bound
            return min(_COMPLETIONS_DEFAULT_MAX_TOKENS, self.limits.max_tokens)
        if self.model_max_tokens is not None:
            return min(self.model_max_tokens, self.limits.max_tokens)
        return self.limits.max_tokens

    def engine_context(self, body: dict) -> RequestContext | None:
        """`kvgate engine`: the calling gateway's classification, used as is."""
        raw = body.get("kvgate_context")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise bad_request("kvgate_context must be an object.", "kvgate_context")
        ctx = RequestContext()
        for key, kind in (("workload", str), ("type", str), ("session", str), ("tenant", str)):
            value = raw.get(key)
            if value is not None:
                if not isinstance(value, kind):
                    raise bad_request(f"kvgate_context.{key} must be a string.", f"kvgate_context.{key}")
                if key == "session" and len(value) > _MAX_SESSION_CHARS:
                    # The policy keeps sessions as keys (up to 200k of them): a body's
                    # worth of text each would be gigabytes.  Gateways send short hashes.
                    raise bad_request(f"kvgate_context.session is longer than {_MAX_SESSION_CHARS} characters.",
                                      "kvgate_context.session")
                setattr(ctx, key, value)
        for key in ("turn", "signature", "chat_id", "parent_chat_id"):
            value = raw.get(key)
            if value is not None:
                if type(value) is not int:
                    raise bad_request(f"kvgate_context.{key} must be an integer.", f"kvgate_context.{key}")
                setattr(ctx, key, value)
        if ctx.workload not in WORKLOADS:
            raise bad_request(f"kvgate_context.workload must be one of {', '.join(WORKLOADS)}.", "kvgate_context.workload")
        if ctx.type not in REQUEST_TYPES:
            raise bad_request(f"kvgate_context.type must be one of {', '.join(REQUEST_TYPES)}.", "kvgate_context.type")
        if raw.get("endpoint", CHAT) not in (CHAT, COMPLETIONS):  # read by forwarded_endpoint
            raise bad_request(f"kvgate_context.endpoint must be {CHAT} or {COMPLETIONS}.", "kvgate_context.endpoint")
        return ctx

_MAX_SESSION_CHARS = 256


def forwarded_endpoint(body: dict, endpoint: str) -> str:
    """`kvgate engine`: the endpoint its gateway's client called (kvgate_context.endpoint),
    for the engine's request counts; anything else leaves the engine's own."""
    ctx = body.get("kvgate_context")
    named = ctx.get("endpoint") if isinstance(ctx, dict) else None
    return named if named in (CHAT, COMPLETIONS) else endpoint


class _ClientLeft:
    """What aiohttp's access logger reads of a response, for one whose client left:
    nginx's 499 and the bytes sent (head included, as aiohttp counts them)."""

    status = int(CLIENT_GONE)

    def __init__(self, sent: int, request_id: str | None, replica: str | None = None) -> None:
        self.body_length = sent
        self.headers = {"x-request-id": request_id} if request_id else {}
        self.replica = replica  # the replica serving it when its client left


def _replicas_of(subs: list[Sub]) -> str | None:
    """The access line's replica field: each sub-request's replica, once each (none dispatched: None)."""
    return ",".join(dict.fromkeys(s.replica for s in subs if s.replica)) or None


def _log_client_gone(request: web.Request, start: float, exc: BaseException, request_id: str | None,
                     replica: str | None = None) -> None:
    """server.access_log writes one line a request, but aiohttp writes none for a
    handler cancelled by its client leaving (a stream closed, a request given up),
    nor for a write that failed part way.  (A write failing before any byte went
    gets aiohttp's own line, as a 500.)"""
    protocol = request.protocol
    if protocol is None or protocol.access_logger is None:
        return  # access_log off, the usual case
    sent = request.writer.output_size
    if isinstance(exc, ConnectionResetError) and not sent:
        return
    began = asyncio.get_running_loop().time() - (time.perf_counter() - start)
    protocol.log_access(request, _ClientLeft(sent, request_id, replica), began)


def _mm_hashes(raw) -> list[tuple[int, bytes]]:
    try:
        return [(int(off), bytes.fromhex(h)) for off, h in raw]
    except (TypeError, ValueError):
        raise bad_request("kvgate_mm_hashes must be [[offset, hex], ...].", "kvgate_mm_hashes") from None


def _is_json_media_type(content_type: str) -> bool:
    """application/json or any +json type, parameters aside (charset=utf-8)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# A client's X-Request-Id (or the completion id of a gateway in front) names the
# completion, as vLLM takes it: one id in every hop's log and answer.  Visible
# ASCII only, as it goes into logs and headers; anything else is ignored.
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def _answered_for(request: web.Request, response: web.Response) -> web.Response:
    """An error answer carries the client's own X-Request-Id, as it was sent,
    when it gave one fit for a log line (its access line then names it too)."""
    given = request.headers.get("X-Request-Id")
    if given is not None and _REQUEST_ID.fullmatch(given):
        response.headers["x-request-id"] = given
    return response


def _named_completion_id(given: str, default: str) -> str:
    """``default``'s prefix (chatcmpl-, cmpl-, resp_) before the id given, once: a
    chat completion forwarded to an engine's completions endpoint keeps its own part."""
    if not _REQUEST_ID.fullmatch(given):
        return default
    for prefix in _ID_PREFIXES:
        if given.startswith(prefix) and len(given) > len(prefix):
            given = given[len(prefix):]
            break
    return next(p for p in _ID_PREFIXES if default.startswith(p)) + given


_ID_PREFIXES = ("chatcmpl-", "cmpl-", "resp_")


def _key_digest(key: str) -> bytes:
    # surrogateescape: header bytes that are not UTF-8 come back as they were sent.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _load_keys(config: KvgateConfig) -> dict[bytes, Principal]:
    """API keys from config and KVGATE_API_KEYS ("key[:tenant[:workload]],...")."""
    keys = {k.key: Principal(k.tenant, k.workload) for k in config.server.api_keys}
    for number, item in enumerate(os.environ.get("KVGATE_API_KEYS", "").split(","), 1):
        item = item.strip()
        if not item:
            continue
        # Spaces around each part go, as around a config key (ApiKeyConfig): no
        # client could send a key with them, and " team" would be another tenant.
        key, _, rest = item.partition(":")
        key = key.strip()
        if not key:
            # Refused as the config's `key: ""` is (ApiKeyConfig): no key is empty.
            raise ConfigError(f"KVGATE_API_KEYS: entry {number} has an empty key (before its first ':'); "
                              "the format is key[:tenant[:workload]],...")
        tenant, _, workload = (part.strip() for part in rest.partition(":"))
        if len(tenant) > MAX_TENANT_NAME:
            raise ConfigError(f"KVGATE_API_KEYS: entry {number} has a tenant name of {len(tenant)} characters; "
                              f"at most {MAX_TENANT_NAME}")
        if workload and workload not in WORKLOADS:
            raise ConfigError(f"KVGATE_API_KEYS: workload {workload!r} for a key must be one of {', '.join(WORKLOADS)}")
        principal = Principal(tenant or "default", workload or None)
        if keys.setdefault(key, principal) != principal:
            # The key itself is a secret and stays out of the message.
            raise ConfigError(f"KVGATE_API_KEYS: entry {number} gives a key listed earlier (there or in "
                              "server.api_keys) another tenant or workload; give each key once")
    return {_key_digest(key): principal for key, principal in keys.items()}


# ----------------------------------------------------------------------------- app


GATEWAY = web.AppKey("gateway", Gateway)


def openai_errors(handler):
    """``handler`` with every error leaving as an OpenAI error body; nothing else reaches the wire.

    A wrapper per route rather than an app middleware: aiohttp runs any app
    with middlewares through a chain of extra frames on every request (about
    9 us here, a quarter of a bare handler's cost).
    """

    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            response = exc.response()
            if request.app[GATEWAY].draining:
                response.force_close()  # see Gateway.serve
        except web.HTTPRequestEntityTooLarge:
            response = errors.too_large(request.app[GATEWAY].limits.max_body_bytes).response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = ApiError(exc.status, exc.reason or "error").response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            response = _answered_for(request, errors.internal_error().response())
            log.exception("unhandled error on %s %s (x-request-id %s)", request.method, request.path,
                          response.headers["x-request-id"])
            return response
        return _answered_for(request, response)

    guarded.__name__ = getattr(handler, "__name__", "handler")
    return guarded


async def _unmatched(request: web.Request) -> web.Response:
    """The last route: 404 for an unknown path, 405 for a known one asked with the wrong method
    (counted: a client with a typo in its base URL leaves a trace, as no endpoint counts it)."""
    if request.path == "/v1/chat/completions" and request.method in ("GET", "HEAD"):
        # The SDK's chat.completions.list(): stored chat completions, of which kvgate keeps
        # none (it ignores `store`): an empty page, as OpenAI lists a project that stored none.
        request.app[GATEWAY].authenticate(request)
        return web.json_response({"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False},
                                 headers={"x-request-id": new_id("req-")})
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    request.app[GATEWAY].metrics.refused(405 if allowed else 404)
    if allowed:
        resp = ApiError(405, f"Method {request.method} not allowed for {request.path}.", code="method_not_allowed").response()
        resp.headers["Allow"] = ", ".join(sorted(allowed))  # a 405 says what is allowed (RFC 9110)
        return resp
    response_id = request.path.split("/")[3] if request.path.startswith("/v1/responses/") else ""
    if response_id and response_id not in _RESPONSES_API_OTHERS:  # retrieve, delete, cancel, input_items
        raise errors.response_not_stored(response_id)
    completion_id = request.path.split("/")[4] if request.path.startswith("/v1/chat/completions/") else ""
    if completion_id:  # the SDK's chat.completions.retrieve, update, delete and messages.list
        raise errors.completion_not_stored(completion_id)
    raise errors.not_found(request.path)


# /v1/responses/NAME paths that are the Responses API's other endpoints, not a response's id.
_RESPONSES_API_OTHERS = frozenset({"input_tokens", "compact"})


def _expectation_refused(request: web.Request) -> web.StreamResponse | None:
    """The answer to an ``Expect`` header instead of 100 Continue, or None: an
    expectation other than 100-continue (in OpenAI's error shape), a body
    declared over the limit, or a request to /v1 without a good key, whose 413
    or 401 comes before the body is sent (the point of asking first)."""
    gateway = request.app[GATEWAY]
    if request.headers.get("Expect", "").lower() != "100-continue":
        gateway.metrics.refused(417)
        return ApiError(417, "Unsupported Expect header; only 100-continue is supported.",
                        code="expectation_failed").response()
    limit = gateway.limits.max_body_bytes
    refusal = errors.too_large(limit) if request.content_length is not None and request.content_length > limit else None
    if refusal is None and request.path.startswith("/v1/"):
        # A request without a good key is told so before it uploads its body, too.
        try:
            gateway.authenticate(request)
        except ApiError as exc:
            refusal = exc
    if refusal is None:
        return None
    gateway.metrics.refused(refusal.status)
    response = refusal.response()
    response.force_close()  # the body the client holds back is never read
    return response


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """An ``Expect`` header, as aiohttp's own handler takes it, but refusing
    what _expectation_refused refuses."""
    if request.version != HttpVersion11:
        return None  # HTTP/1.0 has no Expect
    refused = _expectation_refused(request)
    if refused is not None:
        return refused
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the response proper has not begun
    return None


async def _expect_unmatched(request: web.Request) -> web.StreamResponse | None:
    """No route: its 404 or 405 comes before the body, not after 100 Continue."""
    if request.version != HttpVersion11:
        return None
    refused = _expectation_refused(request)
    if refused is not None:
        return refused
    try:
        response = await _unmatched(request)  # which counts the refusal
    except ApiError as exc:
        response = exc.response()
    response.force_close()  # the body the client holds back is never read
    return response


def create_app(
    config: KvgateConfig,
    replicas: list[Replica] | None = None,
    *,
    replica_urls: list[str] = (),
    engine_mode: bool = False,
    tokenizer: object = None,
) -> web.Application:
    """The gateway app; ``engine_mode`` makes it `kvgate engine` (one in-process replica).

    ``tokenizer`` is only used when every replica is remote (default: the
    configured model's tokenizer, loaded at startup).
    """
    if replicas is None:
        if engine_mode:
            replicas = [InProcessReplica(ENGINE_REPLICA_NAME, config)]
        else:
            replicas = build_replicas(config, list(replica_urls))
    if engine_mode and (len(replicas) != 1 or not isinstance(replicas[0], InProcessReplica)):
        raise ValueError("engine mode serves exactly one in-process replica")
    # Bodies above the limit are refused by aiohttp itself; openai_errors words it.
    app = web.Application(client_max_size=config.server.limits.max_body_bytes)
    gw = Gateway(config, replicas, engine_mode, tokenizer)
    app[GATEWAY] = gw
    app.cleanup_ctx.append(gw.lifespan)
    extra = EngineEndpoints(gw) if engine_mode else None
    routes = [
        ("POST", "/v1/chat/completions", functools.partial(gw.serve, endpoint=CHAT)),
        ("POST", "/v1/completions", functools.partial(gw.serve, endpoint=COMPLETIONS)),
        ("POST", "/v1/responses", functools.partial(gw.serve, endpoint=RESPONSES)),
        ("GET", "/v1/models", gw.models),
        ("GET", "/v1/models/{model:.+}", gw.model),
        # An engine's probe answer carries its load, for the gateways in front of it.
        ("GET", "/health", extra.health if extra is not None else gw.health),
        ("GET", "/ready", gw.ready),
        ("GET", "/metrics", gw.metrics_endpoint),
        ("GET", "/stats", gw.stats),
        ("GET", "/dashboard", gw.dashboard),
    ]
    if extra is not None:
        gw.drain_hooks.append(extra.announce_draining)
        app.on_shutdown.append(extra.on_shutdown)
        routes += [
            ("GET", "/kv_events", extra.kv_events),
            ("GET", "/kvgate/info", extra.info),
            ("GET", "/kvgate/stats", extra.stats),
        ]
    for method, path, handler in routes:
        # GET routes answer HEAD too, as aiohttp's add_get does.
        app.router.add_route(method, path, openai_errors(handler), expect_handler=_expect)
        if method == "GET":
            app.router.add_route("HEAD", path, openai_errors(handler), expect_handler=_expect)
    origins = config.server.cors_allow_origins
    if origins:
        # Only when asked for: a response signal costs every request a little.
        cors = Cors(origins)
        app.on_response_prepare.append(cors.on_response)
        methods: dict[str, set[str]] = {}
        for method, path, _ in routes:
            methods.setdefault(path, {"HEAD"} if method == "GET" else set()).add(method)
        for path, allowed in methods.items():
            app.router.add_route("OPTIONS", path, openai_errors(functools.partial(cors.preflight, methods=allowed)))
    app.router.add_route("*", "/{tail:.*}", openai_errors(_unmatched), expect_handler=_expect_unmatched)
    return app
