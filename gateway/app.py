"""The aiohttp app: OpenAI endpoints in front of a set of replicas.

Request path (DESIGN section 1): auth -> body limits -> parse/validate ->
tokenise once (prompt tokens go to the engine with the request) -> classify ->
block keys -> route (in-flight counted before sending) -> generate -> shape as
OpenAI JSON or SSE.  Every exit path releases the in-flight count and closes
the engine iterator, which aborts the engine work when the client has gone.

The same app, built with ``engine_mode=True`` over a single in-process replica,
is `kvgate engine`: it also accepts ``kvgate_context`` (the gateway's
classification) and serves ``/kv_events`` so a remote gateway can keep an
exact index of this engine's cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from aiohttp import web

from engine.context import REQUEST_TYPES, WORKLOADS, RequestContext
from engine.request import GenerationOutput, GenerationRequest, Usage, coalesce
from gateway import errors
from gateway.classify import ANONYMOUS, Classifier, Principal
from gateway.config import KvgateConfig
from gateway.errors import ApiError, bad_request
from gateway.metrics import GatewayMetrics
from gateway.observe import Finished, Observer
from gateway.prefix import PrefixHasher, Prompt
from gateway.protocol import (
    CHAT,
    COMPLETIONS,
    DONE,
    ChoiceState,
    ParsedRequest,
    StreamFormatter,
    chat_completion,
    new_id,
    now_s,
    parse_json,
    parse_request,
    sse_error,
    text_completion,
    usage_dict,
)
from gateway.replicas import (
    USAGE_ALL,
    InProcessReplica,
    Job,
    Replica,
    ReplicaUnavailable,
    UpstreamError,
    build_replicas,
    load_tokenizer,
)
from gateway.router import Router

log = logging.getLogger(__name__)

# Completions default (OpenAI's); chat defaults to what the context leaves, capped by limits.
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A /kv_events consumer this far behind is cut off; it resyncs from a snapshot.
_KV_EVENTS_BACKLOG = 100_000
# Status label for requests whose client went away (nginx's convention).
CLIENT_GONE = "499"
_STATIC = Path(__file__).parent / "static"


@dataclass(slots=True)
class Sub:
    """One engine request of a client request (completions may carry several prompts)."""

    prompt: Prompt
    source: object  # the prompt as the client sent it (for external replicas)
    context: RequestContext
    shift: int  # choice index offset of this prompt's choices


class Gateway:
    """Everything one app holds: replicas, router, classifier, hasher, metrics."""

    def __init__(
        self, config: KvgateConfig, replicas: list[Replica], engine_mode: bool = False, tokenizer: object = None
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self.limits = config.server.limits
        self.replicas = replicas
        self.engine_mode = engine_mode
        self.metrics = GatewayMetrics()
        self.observer = Observer(config, self.metrics)
        self.principals = _load_keys(config)
        self.router: Router | None = None
        self.hasher: PrefixHasher | None = None
        self.classifier: Classifier | None = None
        self.model_name = ""
        self.max_model_len = config.model.max_model_len
        self.created = now_s()
        self._kv_streams: set[asyncio.Queue] = set()

    # -- lifecycle

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.close()

    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))
        local = next((r for r in self.replicas if isinstance(r, InProcessReplica)), None)
        if local is not None:
            eng = local.engine
            self.hasher = PrefixHasher(eng.tokenizer, eng.block_size, eng.hash_salt, eng.apply_chat_template)
            info = local.info
        else:
            tokenizer = self._tokenizer or await asyncio.to_thread(load_tokenizer, self.config)
            # Engines know their block identity exactly; external servers only their name.
            info = next((r.info for r in self.replicas if r.kind == "engine"), None) or self.replicas[0].info
            self.hasher = PrefixHasher(tokenizer, info.block_size, info.hash_salt)
        self.model_name = self.config.model.served_name or info.model
        self.max_model_len = info.max_model_len
        self.classifier = Classifier(self.config.classifier, self.hasher)
        self.router = Router(self.config.router, [r.name for r in self.replicas], self.hasher.block_size)
        for i, r in enumerate(self.replicas):
            # Backends with a metrics_url report load the gateway cannot count itself.
            r.load_listener = lambda waiting, usage, i=i: self.router.set_external_load(i, waiting, usage)
        for i, r in enumerate(self.replicas):
            self.metrics.watch_replica(
                r.name,
                lambda i=i: self.router.inflight_requests[i],
                lambda r=r: 1.0 if r.healthy else 0.0,
                lambda r=r: len(r.index),
            )
        self.observer.start(self.replicas, lambda i: self.router.inflight_requests[i], self.hasher.block_size, self.hasher.salt)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas), return_exceptions=True)
        await self.observer.close()

    # -- small endpoints

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        healthy = [r.name for r in self.replicas if r.healthy]
        status = 200 if healthy else 503
        return web.json_response({"ready": bool(healthy), "healthy_replicas": healthy}, status=status)

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
        # Served from the package: the page loads nothing from anywhere else.
        return web.FileResponse(_STATIC / "dashboard.html", headers={"Cache-Control": "no-cache"})

    async def engine_stats(self, request: web.Request) -> web.Response:
        """`kvgate engine`: AsyncEngine.stats(), polled by gateways for their /metrics and /stats."""
        self.authenticate(request)
        return web.json_response(self.replicas[0].engine.stats())

    async def models(self, request: web.Request) -> web.Response:
        self.authenticate(request)
        data = []
        if any(r.healthy for r in self.replicas):
            data.append({"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvgate"})
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        self.authenticate(request)
        name = request.match_info["model"]
        if name != self.model_name or not any(r.healthy for r in self.replicas):
            raise errors.model_not_found(name)
        return web.json_response({"id": name, "object": "model", "created": self.created, "owned_by": "kvgate"})

    # -- auth and body

    def authenticate(self, request: web.Request) -> Principal:
        if not self.principals:
            return ANONYMOUS
        header = request.headers.get("Authorization", "")
        if not header:
            raise errors.unauthorized(
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise errors.unauthorized()
        principal = self.principals.get(key)
        if principal is None:
            # Compare anyway so a wrong key costs the same as a right one.
            hmac.compare_digest(key, key)
            raise errors.unauthorized()
        return principal

    async def read_body(self, request: web.Request) -> dict:
        limit = self.limits.max_body_bytes
        content = request.content
        if content.is_eof():
            # The whole body came with the headers (any small request): take it
            # as it lies, without request.read()'s copy and its two awaits.
            raw = content.read_nowait()
            if len(raw) > limit:
                raise errors.too_large(limit)
            return parse_json(raw)
        if request.content_length is not None and request.content_length > limit:
            raise errors.too_large(limit)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise errors.too_large(limit) from None
        return parse_json(raw)

    # -- completions

    async def serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        start = time.perf_counter()
        workload = "unknown"
        status = "500"
        try:
            principal = self.authenticate(request)
            body = await self.read_body(request)
            parsed = parse_request(endpoint, body, self.limits, engine_mode=self.engine_mode)
            if parsed.model != self.model_name:
                raise errors.model_not_found(parsed.model)
            subs, max_tokens = await self.prepare(request, parsed, principal)
            workload = subs[0].context.workload
            if parsed.stream:
                resp = await self.stream(request, parsed, subs, max_tokens, start)
            else:
                resp = await self.complete(parsed, subs, max_tokens, start)
            status = str(resp.status)
            return resp
        except ApiError as exc:
            status = str(exc.status)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_GONE
            raise
        finally:
            self.metrics.requests.labels(endpoint, workload, status).inc()
            if status == "200":
                self.metrics.e2e.labels(workload).observe(time.perf_counter() - start)

    async def prepare(self, request: web.Request, parsed: ParsedRequest, principal: Principal) -> tuple[list[Sub], int]:
        """Tokenise, check lengths, classify: everything before routing."""
        prompts, sources = await self.tokenize(parsed)
        longest = 0
        for prompt in prompts:
            if not prompt.token_ids:
                raise bad_request("The prompt is empty after tokenisation.", "messages" if parsed.endpoint == CHAT else "prompt")
            # Client-supplied token ids only; template output is valid by construction.
            if parsed.endpoint != CHAT and max(prompt.token_ids) >= self.hasher.vocab_size:
                raise bad_request(f"Token ids must be below the vocabulary size {self.hasher.vocab_size}.", "prompt")
            longest = max(longest, len(prompt.token_ids))
        max_tokens = self.resolve_max_tokens(parsed, longest)
        parsed.sampling.max_tokens = max_tokens
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
                    parsed, principal, request.headers, len(prompt.token_ids), len(prompt.keys), prompt.token_ids
                )
            subs.append(Sub(prompt, source, ctx, p * n))
        return subs, max_tokens

    async def tokenize(self, parsed: ParsedRequest) -> tuple[list[Prompt], list]:
        hasher = self.hasher
        if parsed.endpoint == CHAT:
            work = lambda: [hasher.chat(parsed.messages, parsed.images)]  # noqa: E731
            sources = [None]
            size = parsed.content_chars
        else:
            work = lambda: [hasher.text(p) for p in parsed.prompts]  # noqa: E731
            sources = parsed.prompts
            size = sum(len(p) for p in parsed.prompts if isinstance(p, str))
        try:
            if size > self.config.server.offload_tokenize_chars:
                # A huge document would stall every other stream on the loop.
                prompts = await asyncio.to_thread(work)
            else:
                prompts = work()
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - template/tokenizer errors are the request's fault
            param = "messages" if parsed.endpoint == CHAT else "prompt"
            raise bad_request(f"Could not tokenise the {param}: {exc}", param) from None
        if self.engine_mode and parsed.body.get("kvgate_mm_hashes"):
            prompts = [prompts[0]._replace(mm_hashes=_mm_hashes(parsed.body["kvgate_mm_hashes"]))]
        return prompts, sources

    def resolve_max_tokens(self, parsed: ParsedRequest, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        param = "messages" if parsed.endpoint == CHAT else "prompt"
        if parsed.max_tokens is None:
            if room < 1:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"{param} resulted in {prompt_len} tokens. Please reduce the length of the {param}.",
                    param=param,
                    code="context_length_exceeded",
                )
            default = self.limits.max_tokens if parsed.endpoint == CHAT else _COMPLETIONS_DEFAULT_MAX_TOKENS
            return min(default, room)
        if parsed.max_tokens > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + parsed.max_tokens} tokens ({prompt_len} in the {param}, {parsed.max_tokens} in the "
                f"completion). Please reduce the length of the {param} or completion.",
                param=param,
                code="context_length_exceeded",
            )
        return parsed.max_tokens

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
        return ctx

    # -- routing and generation

    async def outputs(self, sub: Sub, parsed: ParsedRequest, max_tokens: int) -> AsyncIterator[list[GenerationOutput]]:
        """One sub-request's outputs from the replica the router picks, in the
        batches the replica delivers them (what was ready together).

        In-flight work is counted before the request is sent and released in
        ``finally``; the engine iterator is closed there too, which aborts the
        engine request if we stop early (client gone, error).  A replica that
        fails before its first output is excluded and another one tried.
        """
        router = self.router
        # Engines only read the sampling parameters, so every sub-request shares
        # the parsed ones (prepare() resolved their max_tokens).
        s = parsed.sampling
        request = GenerationRequest(new_id("req-"), sub.prompt.token_ids, s, sub.context, sub.prompt.mm_hashes)
        job = Job(request, parsed, sub.prompt.keys, sub.source, max_tokens)
        load = router.load_tokens(len(sub.prompt.token_ids), max_tokens, s.n)
        workload = sub.context.workload
        arrival = time.monotonic()
        tried: list[int] = []
        while True:
            decision = router.choose(
                sub.prompt.keys,
                [r.index for r in self.replicas],
                [r.healthy for r in self.replicas],
                sub.context.session,
                tried,
            )
            if decision is None:
                raise errors.no_replica()
            replica = self.replicas[decision.replica]
            ticket = router.acquire(decision.replica, load, sub.prompt.keys, decision.matched_blocks)
            self.metrics.decisions.labels(replica.name, decision.reason).inc()
            series = self.metrics.request_series(workload, replica.name)
            # The engine never serves the block holding the prompt's last token from
            # cache (its logits must be computed), so neither is it predicted.
            bs = self.hasher.block_size
            predicted = min(decision.matched_blocks, (len(sub.prompt.token_ids) - 1) // bs)
            series.predicted_hits.inc(predicted * bs)
            produced = exhausted = False
            usage = _UsageSum(1)
            last_token: float | None = None
            # The recorder also wants the blocks the engine fills with generated tokens.
            generated: list[int] | None = [] if self.observer.recording else None
            gen = replica.generate(job)
            try:
                async for batch in gen:
                    produced = True
                    # Tokens that arrived together leave as one delta per choice (one
                    # frame), and the inter-token gap is measured between deltas:
                    # what the client sees.
                    batch = coalesce(batch)
                    now = time.perf_counter()
                    for out in batch:
                        if out.index == 0 and (out.token_ids or out.text):
                            if last_token is not None:
                                series.itl.observe(now - last_token)
                            last_token = now
                            if generated is not None:
                                generated.extend(out.token_ids)
                        if out.usage is not None:
                            usage.add(0, out)
                            if out.index == 0 or out.index == USAGE_ALL:
                                series.prefix_queries.inc(out.usage.prompt_tokens)
                                series.prefix_hits.inc(out.usage.cached_tokens)
                        if out.queue_time_s is not None:
                            series.queue_time.observe(out.queue_time_s)
                    yield batch
                exhausted = True
                self.observer.finished(Finished(
                    sub.context, replica.name, sub.prompt, usage.prompt[0] or len(sub.prompt.token_ids),
                    usage.cached[0], usage.completion[0], arrival, parsed.user, generated,
                ))
                return
            except ValueError as exc:
                # The engine refuses requests it cannot run (prompt too long for its
                # pool, token ids outside the vocabulary): the caller's problem.
                if produced:
                    raise
                raise bad_request(str(exc), "messages" if parsed.endpoint == CHAT else "prompt") from None
            except ReplicaUnavailable as exc:
                if produced:
                    raise errors.upstream_error(str(exc)) from None
                log.warning("replica %s unavailable, trying another: %s", replica.name, exc)
                tried.append(decision.replica)
            except UpstreamError as exc:
                body = exc.body.get("error") if isinstance(exc.body.get("error"), dict) else {}
                raise ApiError(
                    exc.status if 400 <= exc.status < 600 else 502,
                    body.get("message") or str(exc),
                    body.get("type") or "api_error",
                    body.get("param"),
                    body.get("code"),
                ) from None
            finally:
                if not exhausted:
                    await _aclose(gen)
                router.release(ticket)

    async def merged(
        self, subs: list[Sub], parsed: ParsedRequest, max_tokens: int
    ) -> AsyncIterator[list[tuple[int, list[GenerationOutput]]]]:
        """(choice shift, batch of outputs) of several sub-requests (completions
        with a list of prompts), grouped by what is ready together.

        One pump task per sub-request; the consumer takes everything queued at
        once, so outputs that arrive together still leave in one send.  (One
        sub-request needs none of this: callers read its ``outputs`` directly.)
        """
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(sub: Sub) -> None:
            gen = self.outputs(sub, parsed, max_tokens)
            try:
                async for batch in gen:
                    queue.put_nowait((sub.shift, batch))
                queue.put_nowait(end)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(exc)
                raise
            finally:
                await _aclose(gen)

        tasks = [asyncio.create_task(pump(sub)) for sub in subs]
        try:
            left = len(tasks)
            while left:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                group = []
                for item in items:
                    if item is end:
                        left -= 1
                    elif isinstance(item, BaseException):
                        if group:
                            yield group  # what came before the failure
                        raise item
                    else:
                        group.append(item)
                if group:
                    yield group
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(self, parsed: ParsedRequest, subs: list[Sub], max_tokens: int, start: float) -> web.Response:
        n = parsed.sampling.n
        choices = [ChoiceState() for _ in range(n * len(subs))]
        usage = _UsageSum(len(subs))
        workload = subs[0].context.workload
        first = True
        single = len(subs) == 1
        gen = self.outputs(subs[0], parsed, max_tokens) if single else self.merged(subs, parsed, max_tokens)
        try:
            async for group in gen:
                if single:
                    group = ((0, group),)
                if first:
                    first = False
                    self.observer.first_token(workload, time.perf_counter() - start)
                for sub, shift, out in _each_output(group, n):
                    usage.add(sub, out)
                    if out.index == USAGE_ALL:
                        continue
                    choice = choices[shift + out.index]
                    if out.text:
                        choice.text.append(out.text)
                    if out.logprobs is not None:
                        choice.logprobs = (choice.logprobs or []) + out.logprobs
                    if out.finish_reason is not None:
                        _check_finish(out.finish_reason)
                        choice.finish_reason = out.finish_reason
            gen = None  # exhausted: nothing to close
        finally:
            await _aclose(gen)
        rid = new_id("chatcmpl-" if parsed.endpoint == CHAT else "cmpl-")
        shape = chat_completion if parsed.endpoint == CHAT else text_completion
        obj = shape(rid, now_s(), self.model_name, choices, usage.as_dict(subs))
        return web.Response(body=json.dumps(obj).encode(), content_type="application/json")

    async def stream(
        self, request: web.Request, parsed: ParsedRequest, subs: list[Sub], max_tokens: int, start: float
    ) -> web.StreamResponse:
        n = parsed.sampling.n
        chat = parsed.endpoint == CHAT
        rid = new_id("chatcmpl-" if chat else "cmpl-")
        fmt = StreamFormatter(parsed.endpoint, rid, now_s(), self.model_name, parsed.include_usage)
        states = [ChoiceState() for _ in range(n * len(subs))]
        usage = _UsageSum(len(subs))
        workload = subs[0].context.workload
        resp: web.StreamResponse | None = None
        choices_left = len(states)
        tail_frames = b""
        # One sub-request (the common case) reads its outputs directly.
        single = len(subs) == 1
        gen = self.outputs(subs[0], parsed, max_tokens) if single else self.merged(subs, parsed, max_tokens)
        try:
            async for group in gen:
                if single:
                    group = ((0, group),)
                # Everything that arrived together leaves in one send; the outputs
                # that finish the last choice wait for the stream's tail and end
                # (usage, [DONE]) and leave with them.
                frames = []
                try:
                    for sub, shift, out in _each_output(group, n):
                        usage.add(sub, out)
                        if out.index == USAGE_ALL:
                            continue
                        if resp is None:
                            # Headers go out with the first output so that failures before
                            # it (no replica, upstream 4xx) still get a proper status code.
                            resp = _SseResponse(headers=_SSE_HEADERS)
                            await resp.prepare(request)
                            self.observer.first_token(workload, time.perf_counter() - start)
                        index = shift + out.index
                        state = states[index]
                        if chat and not state.started:
                            frames.append(fmt.role(index))
                        state.started = True
                        if out.finish_reason is not None:
                            _check_finish(out.finish_reason)
                            choices_left -= 1
                        if out.text or out.logprobs or out.finish_reason is not None:
                            frames.append(fmt.delta(index, out.text, out.logprobs, state, out.finish_reason))
                        state.text_len += len(out.text)
                except ApiError:
                    if frames:
                        await resp.write(b"".join(frames))  # what came before the failure
                    raise
                if choices_left <= 0:
                    tail_frames += b"".join(frames)
                elif frames:
                    await resp.write(b"".join(frames))
            gen = None  # exhausted: nothing to close
            if resp is None:
                resp = _SseResponse(headers=_SSE_HEADERS)
                await resp.prepare(request)
            tail = fmt.usage(usage.as_dict(subs)) + DONE if parsed.include_usage else DONE
            await resp.write_eof(tail_frames + tail)  # one send for the last frames, the tail and the end
            return resp
        except Exception as exc:
            if resp is None:
                raise
            if not isinstance(exc, ApiError):
                if isinstance(exc, ConnectionError):
                    raise  # the client is gone; nobody to tell
                log.exception("stream %s failed after its first byte", rid)
                exc = errors.internal_error()
            # Mid-stream: the status is already sent; OpenAI clients raise on an error
            # event, and [DONE] still ends the stream for clients that wait for it.
            with contextlib.suppress(ConnectionError):
                await resp.write(tail_frames + sse_error(exc.body()) + DONE)
                await resp.write_eof()
            return resp
        finally:
            await _aclose(gen)

    # -- kvgate engine: the KV event stream

    async def kvgate_info(self, request: web.Request) -> web.Response:
        replica = self.replicas[0]
        salt = replica.info.hash_salt
        return web.json_response(
            {
                "model": self.model_name,
                "block_size": replica.info.block_size,
                "hash_salt": salt.decode() if isinstance(salt, bytes) else salt,
                "max_model_len": self.max_model_len,
            }
        )

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        """SSE: a snapshot of the held keys, then every stored/removed event in order.

        The listener is attached before the snapshot is taken and buffers what
        arrives meanwhile; replaying those events over the snapshot converges
        to the engine's state because each event is applied in order.  A
        consumer that falls too far behind is cut off and resyncs.
        """
        self.authenticate(request)
        replica = self.replicas[0]
        assert isinstance(replica, InProcessReplica)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        owner = threading.get_ident()
        lagging = False

        def put(item) -> None:
            nonlocal lagging
            if queue.qsize() >= _KV_EVENTS_BACKLOG:
                lagging = True
            queue.put_nowait(item)

        def listener(seq: int, kind: str, keys: list[int], tier: str) -> None:
            item = (seq, kind, keys, tier)
            if threading.get_ident() == owner:
                put(item)
            else:
                loop.call_soon_threadsafe(put, item)

        detach = replica.add_listener(listener)
        self._kv_streams.add(queue)
        try:
            resp = web.StreamResponse(headers=_SSE_HEADERS)
            await resp.prepare(request)
            snapshot = {"seq": replica.seq, "model": self.model_name, "keys": replica.held_keys()}
            await resp.write(b"event: snapshot\ndata: " + json.dumps(snapshot).encode() + b"\n\n")
            while not lagging:
                item = await queue.get()
                if item is None:
                    break  # shutting down
                seq, kind, keys, tier = item
                frame = {"seq": seq, "kind": kind, "keys": keys, "tier": tier}
                await resp.write(b"data: " + json.dumps(frame).encode() + b"\n\n")
            return resp
        finally:
            self._kv_streams.discard(queue)
            detach()

    async def on_shutdown(self, app: web.Application) -> None:
        # Long-lived /kv_events streams would otherwise hold shutdown for its full timeout.
        for queue in list(self._kv_streams):
            queue.put_nowait(None)


class _SseResponse(web.StreamResponse):
    # Headers ride with the first frames (one send, not two); aiohttp's own
    # web.Response does the same.
    _send_headers_immediately = False


class _UsageSum:
    """Usage over sub-requests: prompt counted once per prompt, completions summed."""

    __slots__ = ("prompt", "cached", "completion", "all")

    def __init__(self, subs: int) -> None:
        self.prompt = [0] * subs
        self.cached = [0] * subs
        self.completion = [0] * subs
        self.all = [False] * subs

    def add(self, sub: int, out: GenerationOutput) -> None:
        u = out.usage
        if u is None:
            return
        if out.index == USAGE_ALL:
            self.prompt[sub], self.cached[sub], self.completion[sub] = u.prompt_tokens, u.cached_tokens, u.completion_tokens
            self.all[sub] = True
            return
        if self.all[sub]:
            return
        self.prompt[sub] = max(self.prompt[sub], u.prompt_tokens)
        if out.index == 0:
            # The first choice looked the prompt up; later ones reuse its blocks.
            self.cached[sub] = u.cached_tokens
        self.completion[sub] += u.completion_tokens

    def as_dict(self, subs: list[Sub]) -> dict:
        prompt = sum(p or len(s.prompt.token_ids) for p, s in zip(self.prompt, subs))

        return usage_dict(Usage(prompt, sum(self.completion), sum(self.cached)))


def _each_output(group, n: int):
    """(sub-request, choice shift, output) of each output in a group of
    (choice shift, batch) pairs; ``n`` choices per sub-request."""
    for shift, batch in group:
        sub = shift // n
        for out in batch:
            yield sub, shift, out


def _check_finish(reason: str) -> None:
    if reason == "abort":
        raise ApiError(503, "The engine aborted the request (it is shutting down or overloaded).", "server_error", None, "engine_abort")


def _mm_hashes(raw) -> list[tuple[int, bytes]]:
    try:
        return [(int(off), bytes.fromhex(h)) for off, h in raw]
    except (TypeError, ValueError):
        raise bad_request("kvgate_mm_hashes must be [[offset, hex], ...].", "kvgate_mm_hashes") from None


async def _aclose(gen) -> None:
    """Close an async iterator that may have stopped early (None: nothing to close)."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def _load_keys(config: KvgateConfig) -> dict[str, Principal]:
    """API keys from config and KVGATE_API_KEYS ("key[:tenant[:workload]],...")."""
    keys = {k.key: Principal(k.tenant, k.workload) for k in config.server.api_keys}
    for item in os.environ.get("KVGATE_API_KEYS", "").split(","):
        item = item.strip()
        if not item:
            continue
        key, _, rest = item.partition(":")
        tenant, _, workload = rest.partition(":")
        if workload and workload not in WORKLOADS:
            raise ValueError(f"KVGATE_API_KEYS: workload {workload!r} for a key must be one of {', '.join(WORKLOADS)}")
        keys[key] = Principal(tenant or "default", workload or None)
    return keys


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
            return exc.response()
        except web.HTTPRequestEntityTooLarge:
            return errors.too_large(request.app[GATEWAY].limits.max_body_bytes).response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return ApiError(exc.status, exc.reason or "error").response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return errors.internal_error().response()

    guarded.__name__ = getattr(handler, "__name__", "handler")
    return guarded


async def _unmatched(request: web.Request) -> web.Response:
    """The last route: 404 for an unknown path, 405 for a known one asked with the wrong method."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        raise ApiError(405, f"Method {request.method} not allowed for {request.path}.", code="method_not_allowed")
    raise errors.not_found(request.path)


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
            replicas = [InProcessReplica("engine", config)]
        else:
            replicas = build_replicas(config, list(replica_urls))
    if engine_mode and (len(replicas) != 1 or not isinstance(replicas[0], InProcessReplica)):
        raise ValueError("engine mode serves exactly one in-process replica")
    # Bodies above the limit are refused by aiohttp itself; openai_errors words it.
    app = web.Application(client_max_size=config.server.limits.max_body_bytes)
    gw = Gateway(config, replicas, engine_mode, tokenizer)
    app[GATEWAY] = gw
    app.cleanup_ctx.append(gw.lifespan)
    app.on_shutdown.append(gw.on_shutdown)
    routes = [
        ("POST", "/v1/chat/completions", functools.partial(gw.serve, endpoint=CHAT)),
        ("POST", "/v1/completions", functools.partial(gw.serve, endpoint=COMPLETIONS)),
        ("GET", "/v1/models", gw.models),
        ("GET", "/v1/models/{model}", gw.model),
        ("GET", "/health", gw.health),
        ("GET", "/ready", gw.ready),
        ("GET", "/metrics", gw.metrics_endpoint),
        ("GET", "/stats", gw.stats),
        ("GET", "/dashboard", gw.dashboard),
    ]
    if engine_mode:
        routes += [
            ("GET", "/kv_events", gw.kv_events),
            ("GET", "/kvgate/info", gw.kvgate_info),
            ("GET", "/kvgate/stats", gw.engine_stats),
        ]
    for method, path, handler in routes:
        # GET routes answer HEAD too, as aiohttp's add_get does.
        app.router.add_route(method, path, openai_errors(handler))
        if method == "GET":
            app.router.add_route("HEAD", path, openai_errors(handler))
    app.router.add_route("*", "/{tail:.*}", openai_errors(_unmatched))
    return app
