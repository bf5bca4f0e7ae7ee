"""Where requests go: in-process engines, `kvgate engine` servers, external OpenAI servers.

Every replica offers the same small interface to the gateway:

    start() / close()                   lifecycle (inside the app's cleanup_ctx)
    generate(job) -> async iterator     GenerationOutput per step, engine contract;
                                        closing it early aborts the work upstream
    index                               what the router believes the replica holds
    healthy                             whether the router may pick it
    info                                model name, block size, hash salt, context length

A replica that cannot take a request *before producing anything* raises
``ReplicaUnavailable`` so the gateway can try another one; after the first
output a failure ends that stream with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable
from urllib.parse import urlsplit

import aiohttp

from engine.request import GenerationOutput, GenerationRequest, TokenLogprob, Usage
from gateway.config import KvgateConfig, ReplicaConfig, RouterConfig
from gateway.protocol import CHAT, ParsedRequest
from gateway.router import ApproxIndex, ExactIndex

log = logging.getLogger(__name__)

# Output index meaning "usage for the whole request" (remote replicas report one
# usage chunk for all choices rather than one per choice).
USAGE_ALL = -1


class ReplicaUnavailable(RuntimeError):
    """The replica could not start the request; another replica may."""


class UpstreamError(RuntimeError):
    """The replica answered with an OpenAI error; ``status`` and ``body`` pass through."""

    def __init__(self, status: int, body: dict) -> None:
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else None
        super().__init__(message or f"upstream error {status}")
        self.status = status
        self.body = body


@dataclass(slots=True)
class ReplicaInfo:
    model: str
    block_size: int
    hash_salt: str | bytes
    max_model_len: int


@dataclass(slots=True)
class Job:
    """One engine request plus what a remote replica needs to re-issue it."""

    request: GenerationRequest
    parsed: ParsedRequest
    keys: list[int]
    # completions with several prompts: which one this job carries.
    prompt: Any = None
    max_tokens: int = 16
    extra: dict = field(default_factory=dict)


class Replica:
    kind = "base"

    def __init__(self, name: str) -> None:
        self.name = name
        self.healthy = False
        self.info: ReplicaInfo | None = None
        self.index: ExactIndex | ApproxIndex = ExactIndex()

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        self.healthy = False

    def generate(self, job: Job) -> AsyncIterator[GenerationOutput]:
        raise NotImplementedError


# ----------------------------------------------------------------------------- in-process


KvListener = Callable[[int, str, list[int], str], None]


class InProcessReplica(Replica):
    """An engine in this process; its KV events keep the index exact.

    The engine may call the event callback from its worker thread: the index
    is a dict updated key by key (atomic under the GIL) and listeners (the
    /kv_events streams of `kvgate engine`) get the event through the loop.
    """

    kind = "inprocess"

    def __init__(self, name: str, config: KvgateConfig | None = None, engine: Any = None) -> None:
        super().__init__(name)
        self.config = config
        self.engine = engine
        self.seq = 0
        self._listeners: list[KvListener] = []
        self._seq_lock = threading.Lock()
        self._owns_engine = engine is None

    async def start(self) -> None:
        if self.engine is None:
            from engine.async_engine import AsyncEngine

            cfg = self.config
            # Loading a model takes seconds; keep the loop responsive meanwhile.
            self.engine = await asyncio.to_thread(AsyncEngine.from_config, cfg.model, cfg.engine, cfg.cache)
        started = self.engine.start()
        if inspect.isawaitable(started):
            await started
        eng = self.engine
        self.info = ReplicaInfo(eng.model_name, eng.block_size, eng.hash_salt, eng.max_model_len)
        eng.subscribe_kv_events(self._on_event)
        self.index.reset(self.held_keys())
        self.healthy = True

    async def close(self) -> None:
        self.healthy = False
        if self.engine is not None and self._owns_engine:
            done = self.engine.shutdown()
            if inspect.isawaitable(done):
                await done

    def held_keys(self) -> dict[str, list[int]]:
        """The engine's cached keys by tier, whatever shape ``cached_keys()`` returns."""
        held = self.engine.cached_keys()
        if isinstance(held, dict):
            return {str(tier): list(keys) for tier, keys in held.items()}
        out: dict[str, list[int]] = {}
        for item in held:
            if isinstance(item, tuple):
                key, tier = item
                out.setdefault(str(tier), []).append(key)
            else:
                out.setdefault("device", []).append(item)
        return out

    def _on_event(self, kind: str, keys: list[int], tier: str) -> None:
        self.index.apply(kind, keys, tier)
        if self._listeners:
            with self._seq_lock:
                self.seq += 1
                seq = self.seq
            for listener in list(self._listeners):
                listener(seq, kind, list(keys), tier)

    def add_listener(self, listener: KvListener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def generate(self, job: Job) -> AsyncIterator[GenerationOutput]:
        return self.engine.generate(job.request)

    def inflight_engine(self) -> int:
        stats = self.engine.stats() if self.engine is not None else {}
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0)) if isinstance(stats, dict) else 0


# ----------------------------------------------------------------------------- remote


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or url


class RemoteReplica(Replica):
    """A replica over HTTP: a `kvgate engine` server (exact index from its
    /kv_events stream) or any OpenAI-compatible server (approximate index).

    Requests are always streamed upstream, whatever the client asked, so the
    gateway sees tokens as they come and a client disconnect closes the
    upstream connection, which aborts the work there.
    """

    def __init__(self, cfg: ReplicaConfig, router_cfg: RouterConfig, fallback: ReplicaInfo, name: str | None = None) -> None:
        super().__init__(name or cfg.name or _host_port(cfg.url))
        self.cfg = cfg
        self.kind = cfg.kind
        self.base = _base_url(cfg.url)
        self.router_cfg = router_cfg
        self.info = fallback
        if cfg.kind == "openai":
            self.index = ApproxIndex(router_cfg.approx_ttl_s, router_cfg.approx_capacity_blocks)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._failures = 0
        self._open_until = 0.0
        self.events_seen = 0

    # -- lifecycle

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
        )
        if self.kind == "engine":
            # The hash salt and block size must come from the engine itself, or the
            # index will never match; give a server that is still starting a moment.
            deadline = time.monotonic() + self.cfg.connect_timeout_s
            while True:
                try:
                    await self._fetch_info()
                    break
                except Exception as exc:  # noqa: BLE001
                    if time.monotonic() >= deadline:
                        log.warning("replica %s: no /kvgate/info (%s); using config defaults", self.name, exc)
                        break
                    await asyncio.sleep(0.25)
            self._tasks.append(asyncio.create_task(self._follow_kv_events(), name=f"kv-events:{self.name}"))
        else:
            with contextlib.suppress(Exception):
                self.healthy = await self._probe()
            with contextlib.suppress(Exception):
                await self._fetch_models()
        self._tasks.append(asyncio.create_task(self._health_loop(), name=f"health:{self.name}"))

    async def close(self) -> None:
        self.healthy = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._session is not None:
            await self._session.close()

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    async def _fetch_info(self) -> None:
        async with self._session.get(
            self.base + "/kvgate/info", headers=self._auth(), timeout=aiohttp.ClientTimeout(total=5)
        ) as resp:
            resp.raise_for_status()
            data = await resp.json()
        self.info = ReplicaInfo(data["model"], int(data["block_size"]), data["hash_salt"], int(data["max_model_len"]))

    async def _fetch_models(self) -> None:
        """An external server's model name (the gateway serves it under that name
        unless model.served_name says otherwise)."""
        async with self._session.get(self.base + "/v1/models", headers=self._auth(), timeout=aiohttp.ClientTimeout(total=5)) as resp:
            resp.raise_for_status()
            data = await resp.json()
        ids = [m["id"] for m in data.get("data", ())]
        model = self.cfg.model if self.cfg.model in ids else (ids[0] if ids else None)
        if model:
            self.info = ReplicaInfo(model, self.info.block_size, self.info.hash_salt, self.info.max_model_len)

    async def _probe(self) -> bool:
        path = "/health" if self.kind == "engine" else "/v1/models"
        try:
            async with self._session.get(self.base + path, headers=self._auth(), timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _health_loop(self) -> None:
        interval = self.router_cfg.health_interval_s
        while True:
            await asyncio.sleep(interval)
            ok = await self._probe()
            if ok:
                self._failures = 0
                if self.kind == "openai" or self._following:
                    self.healthy = time.monotonic() >= self._open_until
            else:
                self._note_failure()

    def _note_failure(self) -> None:
        # Circuit breaker: after N straight failures stop routing here for a while.
        self._failures += 1
        if self._failures >= self.router_cfg.breaker_failures:
            self.healthy = False
            self._open_until = time.monotonic() + self.router_cfg.breaker_reset_s

    _following = False

    async def _follow_kv_events(self) -> None:
        """Keep the index equal to the replica's cache: snapshot, then ordered events.

        A gap in sequence numbers or a dropped stream means events were lost:
        start over from a fresh snapshot (the index is cleared meanwhile so the
        router never trusts a stale view).
        """
        backoff = 0.2
        while True:
            try:
                async with self._session.get(self.base + "/kv_events", headers=self._auth()) as resp:
                    if resp.status != 200:
                        raise ReplicaUnavailable(f"/kv_events answered {resp.status}")
                    last = None
                    async for event, data in _sse_events(resp.content):
                        if event == "snapshot":
                            self.index.reset(data["keys"])
                            last = data["seq"]
                            if self.info is None or self.info.model != data.get("model"):
                                with contextlib.suppress(Exception):
                                    await self._fetch_info()
                            self._following = True
                            self._failures = 0
                            self.healthy = time.monotonic() >= self._open_until
                            backoff = 0.2
                            continue
                        seq = data["seq"]
                        if last is None or seq <= last:
                            continue  # already part of the snapshot
                        if seq > last + 1:
                            raise ReplicaUnavailable(f"kv event gap {last} -> {seq}")
                        last = seq
                        self.events_seen += 1
                        self.index.apply(data["kind"], data["keys"], data["tier"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means: resync
                log.info("replica %s: kv event stream lost (%s); resyncing", self.name, exc)
            self._following = False
            self.index.reset({})
            self._note_failure()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    # -- requests

    def _payload(self, job: Job) -> tuple[str, dict]:
        parsed = job.parsed
        s = job.request.sampling
        if self.kind == "engine":
            ctx = job.request.context
            body = {
                "model": self.info.model if self.info else parsed.model,
                "prompt": job.request.prompt_token_ids,
                "max_tokens": s.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "n": s.n,
                "stop": s.stop or None,
                "seed": s.seed,
                "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty,
                "logprobs": s.logprobs,
                "top_k": s.top_k,
                "ignore_eos": s.ignore_eos,
                "user": parsed.user,
                "kvgate_context": {
                    "workload": ctx.workload, "type": ctx.type, "turn": ctx.turn, "session": ctx.session,
                    "tenant": ctx.tenant, "signature": ctx.signature, "chat_id": ctx.chat_id,
                    "parent_chat_id": ctx.parent_chat_id,
                },
                "kvgate_mm_hashes": [[off, h.hex()] for off, h in job.request.mm_hashes],
            }
            path = "/v1/completions"
        else:
            body = dict(parsed.body)
            body["model"] = self.cfg.model or parsed.model
            body["max_tokens"] = job.max_tokens
            body.pop("max_completion_tokens", None)
            if parsed.endpoint != CHAT:
                body["prompt"] = job.prompt
            path = "/v1/chat/completions" if parsed.endpoint == CHAT else "/v1/completions"
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return path, body

    async def generate(self, job: Job) -> AsyncIterator[GenerationOutput]:
        if time.monotonic() < self._open_until or self._session is None:
            raise ReplicaUnavailable(f"replica {self.name} is not taking requests")
        path, body = self._payload(job)
        chat = self.kind != "engine" and job.parsed.endpoint == CHAT
        headers = self._auth()
        if isinstance(self.index, ApproxIndex):
            self.index.record(job.keys)
        rid = job.request.request_id
        try:
            resp = await self._session.post(self.base + path, json=body, headers=headers)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            self._note_failure()
            raise ReplicaUnavailable(f"replica {self.name}: {exc}") from exc
        try:
            if resp.status != 200:
                try:
                    err = await resp.json(content_type=None)
                except Exception:  # noqa: BLE001
                    err = {}
                if resp.status >= 500 or not isinstance(err, dict) or "error" not in err:
                    self._note_failure()
                    raise ReplicaUnavailable(f"replica {self.name} answered {resp.status}")
                raise UpstreamError(resp.status, err)
            self._failures = 0
            text_offsets: dict[int, int] = {}
            async for _event, chunk in _sse_events(resp.content):
                if "error" in chunk:
                    raise UpstreamError(500, chunk)
                for choice in chunk.get("choices") or ():
                    index = choice.get("index", 0)
                    if chat:
                        text = (choice.get("delta") or {}).get("content") or ""
                        lps = _chat_logprobs(choice.get("logprobs"))
                    else:
                        text = choice.get("text") or ""
                        lps = _completion_logprobs(choice.get("logprobs"))
                    finish = choice.get("finish_reason")
                    if not text and finish is None and not lps:
                        continue  # the role chunk
                    text_offsets[index] = text_offsets.get(index, 0) + len(text)
                    yield GenerationOutput(rid, index, [], text, lps, finish)
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    yield GenerationOutput(
                        rid, USAGE_ALL, [], "", None, None,
                        Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), details.get("cached_tokens") or 0),
                    )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            self._note_failure()
            raise ReplicaUnavailable(f"replica {self.name} failed mid-request: {exc}") from exc
        finally:
            # Closing the connection is what aborts the request upstream.
            resp.close()


def _chat_logprobs(lp: dict | None) -> list[TokenLogprob] | None:
    if not lp or lp.get("content") is None:
        return None
    return [
        TokenLogprob(-1, item["token"], item["logprob"], [(-1, t["token"], t["logprob"]) for t in item.get("top_logprobs") or ()])
        for item in lp["content"]
    ]


def _completion_logprobs(lp: dict | None) -> list[TokenLogprob] | None:
    if not lp or lp.get("tokens") is None:
        return None
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return [
        TokenLogprob(-1, tok, val if val is not None else 0.0, [(-1, t, v) for t, v in (top or {}).items()])
        for tok, val, top in zip(lp["tokens"], lp.get("token_logprobs") or [], tops)
    ]


async def _sse_events(stream: aiohttp.StreamReader) -> AsyncIterator[tuple[str, Any]]:
    """(event name, decoded data) of each SSE event until ``[DONE]`` or EOF."""
    event = "message"
    data: list[bytes] = []
    async for line in stream:
        line = line.rstrip(b"\r\n")
        if not line:
            if data:
                payload = b"\n".join(data)
                data = []
                if payload == b"[DONE]":
                    return
                yield event, json.loads(payload)
            event = "message"
            continue
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        elif line.startswith(b"event:"):
            event = line[6:].strip().decode()
    if data and b"\n".join(data) != b"[DONE]":
        yield event, json.loads(b"\n".join(data))


# ----------------------------------------------------------------------------- construction


def build_replicas(config: KvgateConfig, urls: list[str] = ()) -> list[Replica]:
    """Replicas from config plus ``--replica`` URLs (``openai+http://...`` for external servers)."""
    specs = list(config.replicas)
    for url in urls:
        if url.startswith("openai+"):
            specs.append(ReplicaConfig(kind="openai", url=url[len("openai+") :]))
        else:
            specs.append(ReplicaConfig(kind="engine", url=url))
    if not specs:
        specs = [ReplicaConfig(kind="inprocess")]
    fallback = ReplicaInfo(
        config.model.served_name or _default_name(config),
        config.engine.block_size,
        "",
        config.model.max_model_len,
    )
    out: list[Replica] = []
    names: set[str] = set()
    for i, spec in enumerate(specs):
        if spec.kind == "inprocess":
            replica: Replica = InProcessReplica(spec.name or f"inprocess-{i}", config)
        else:
            replica = RemoteReplica(spec, config.router, fallback)
        if replica.name in names:
            replica.name = f"{replica.name}-{i}"
        names.add(replica.name)
        out.append(replica)
    return out


def _default_name(config: KvgateConfig) -> str:
    from engine.model_loader import served_name

    return served_name(config.model)


def load_tokenizer(config: KvgateConfig):
    """The model's tokenizer alone, for a gateway whose engines are all remote."""
    from transformers import AutoTokenizer

    from engine.model_loader import default_model_dir

    cfg = config.model
    source = cfg.path if cfg.path is not None else default_model_dir(cfg.cache_dir)
    kwargs = {}
    if source.endswith(".gguf"):
        source, kwargs["gguf_file"] = os.path.split(os.path.abspath(source))
    return AutoTokenizer.from_pretrained(os.path.expanduser(source), **kwargs)
