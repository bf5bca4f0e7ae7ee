"""Where requests go: in-process engines, `kvgate engine` servers, external OpenAI servers.

Every replica offers the same small interface to the gateway:

    start() / close()                   lifecycle (inside the app's cleanup_ctx)
    generate(job) -> async iterator     lists of GenerationOutput, each what arrived
                                        together (engine contract); closing it early
                                        aborts the work upstream
    index                               what the router believes the replica holds
    healthy                             whether the router may pick it
    draining, port_closed               a `kvgate engine` stopping: out of routing, but
                                        a last resort while no replica is in routing,
                                        until its port refuses a connection (dispatch)
    info                                model name, block size, hash salt, context length

A replica that cannot take a request *before producing anything* raises
``ReplicaUnavailable`` so the gateway can try another one (``OfferedElsewhere``:
a stopping engine had not started it, and its request there stands until
another replica answers); after the first output a failure ends that stream
with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable
from urllib.parse import urlsplit

import aiohttp
import aiohttp.http_exceptions

from engine.config import ConfigError
from engine.request import EngineFailed, GenerationOutput, GenerationRequest
from gateway.config import (
    KvgateConfig,
    ReplicaConfig,
    RouterConfig,
    replica_api_key,
    replica_base_url,
    replica_slots,
    without_userinfo,
)
from gateway.errors import internal_error
from gateway.kv_wire import PACKED_QUERY, held_from_snapshot
from gateway.protocol import CHAT, ParsedRequest
from gateway.router import ApproxIndex, BackendLoad, ExactIndex
from gateway.startup_thread import in_daemon_thread
from gateway.upstream import (
    DONE_EVENT,
    KNOWN_LOAD_METRICS,
    USAGE_ALL,
    answer_events,
    chunk_outputs,
    header_count,
    header_seconds,
    in_stream_error_status,
    is_stopping,
    openai_error_body,
    parse_backend_metrics,
    sse_events,
)
from gateway.version import kvgate_version

log = logging.getLogger(__name__)

# Failed /metrics polls of an external server after which its last load figures are dropped.
_METRICS_KEEP_POLLS = 3
# Requests a replica loses (ReplicaLost) within this many seconds of each other are one loss.
_LOSS_BURST_S = 1.0
# Idle pooled connections to a replica are closed after this long: below the 5 s
# of uvicorn (vLLM's and SGLang's server), so that the gateway never reuses one as
# the server closes it (that POST would break as if the server had died with it).
_KEEPALIVE_S = 4.0
# How long a replica's resolved address is reused (aiohttp's default is 10 s).  A
# StatefulSet's pod that restarts comes back under its name at a new address, and
# one scaled away loses its name: either was tried at the old address meanwhile.
_DNS_CACHE_S = 1.0

# A `kvgate engine`'s streams carry the seconds their request queued before its
# first step, which the gateway cannot see from outside (gateway/respond.py).
QUEUE_TIME_HEADER = "x-kvgate-queue-time"
# And the prompt tokens it served from its prefix cache: what the gateway counts
# for a stream cut short before its usage (the client left).
CACHED_TOKENS_HEADER = "x-kvgate-cached-tokens"
GATEWAY_USER_AGENT = f"kvgate-gateway/{kvgate_version()}"


class ReplicaUnavailable(RuntimeError):
    """The replica could not start the request; another replica may."""


class ReplicaBusy(ReplicaUnavailable):
    """The replica refused the request with 429 (at capacity): another replica may
    take it, and the replica is not failing.  ``body`` is its OpenAI error, for the
    client when every replica refuses."""

    def __init__(self, message: str, body: dict, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.body = body
        self.retry_after = retry_after  # its Retry-After, in seconds, when it gave one


class ReplicaAnswerFailed(ReplicaUnavailable):
    """The replica answered a well-formed server error (HTTP 5xx, or an error
    event before the first token).  The request itself may be the cause, so it
    counts toward the replica's breaker only once another replica has served the
    same request (``Replica.note_request_failure``): a request that fails
    everywhere must not take the whole fleet out of routing.  ``status`` and
    ``body`` are for the client when every replica fails it, with ``retry_after``
    (its Retry-After, in seconds, when it gave one: a 503's)."""

    def __init__(self, message: str, status: int, body: dict, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.retry_after = retry_after


class ReplicaStopping(ReplicaUnavailable):
    """The replica is shutting down: it ended the request (a `kvgate engine`
    past its drain time), refused it, or, tried as a last resort, its port had
    closed: another replica may take it; no failure of this one."""


class OfferedElsewhere(ReplicaStopping):
    """A `kvgate engine` that is shutting down had not started the request (queued
    behind the ones it runs): another replica may start it sooner.  Its request
    there stands meanwhile, ``sent`` (the POST, its answer not read): the
    dispatcher cancels it once another replica answers, or, if none takes it,
    reads it after all (``RemoteReplica.generate(job, sent)``)."""

    def __init__(self, message: str, sent: asyncio.Future) -> None:
        super().__init__(message)
        self.sent = sent

    def withdraw(self) -> None:
        """Another replica answers: the request here is given up (its connection
        closed, which aborts it on the engine)."""
        withdraw_post(self.sent)

    @property
    def answered(self) -> bool:
        """The stopping engine started it after all (its drain reached it) and
        answers: its output comes first, wherever else the request is waiting."""
        sent = self.sent
        return sent.done() and not sent.cancelled() and sent.exception() is None and sent.result().status == 200


def withdraw_post(post: asyncio.Future) -> None:
    """Give up a POST sent with aiohttp, answered or not: its connection goes."""
    post.cancel()
    if post.done() and not post.cancelled() and post.exception() is None:
        post.result().close()  # it answered in the same moment: let the connection go


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
    # The client set no max_tokens and ``max_tokens`` is the context's room by the
    # gateway's count of the prompt: an external server is sent none, and fills the
    # room by its own count (with another tokenizer, the gateway's may run past it).
    fills_room: bool = False
    # X-Request-Id for the server: the client request's completion id (each of
    # several prompts its own), so that every hop's log names the same request.
    forwarded_id: str | None = None


class Replica:
    kind = "base"
    # A slot of a replica entry with a count (ReplicaConfig.count) whose host name
    # does not resolve: no such server (yet), rather than one that is down.
    absent = False
    # A `kvgate engine` that said it is stopping (RemoteReplica): out of routing,
    # but it may still take requests for its server.shutdown_delay_s.
    draining = False
    # A draining engine whose port refused a connection: past that delay, no
    # last resort any more (each request would try it again, to be refused).
    port_closed = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.healthy = False
        self.info: ReplicaInfo | None = None
        self.index: ExactIndex | ApproxIndex = ExactIndex()
        # Set by the gateway: called whenever a backend reports its own load
        # (a `kvgate engine` on each probe, an external server from metrics_url).
        self.load_listener: Callable[[BackendLoad], None] | None = None

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        self.healthy = False

    def generate(self, job: Job) -> AsyncIterator[list[GenerationOutput]]:
        """The job's outputs in lists: each holds what arrived together, so the
        gateway sends it in one write.  Closing the iterator aborts the job."""
        raise NotImplementedError

    def note_request_failure(self) -> None:
        """A request this replica failed (``ReplicaAnswerFailed``) was served by another."""


# ----------------------------------------------------------------------------- in-process


KvListener = Callable[[int, str, list[int], str], None]
_MODEL_LOAD_LOCK = threading.Lock()


def engine_failure(replica: Replica, exc: EngineFailed) -> ReplicaAnswerFailed:
    """An in-process engine's own failure of a request, read as a remote replica's
    500 is: another replica may serve it.  The cause's text stays in the log."""
    failed = ReplicaAnswerFailed(f"replica {replica.name} failed the request ({exc.what})", 500, internal_error().body())
    failed.__cause__ = exc
    return failed


class InProcessReplica(Replica):
    """An engine in this process; its KV events keep the index exact.

    The engine calls the event callback on the event loop thread, between its
    model steps (engine/async_engine.py), so the index and the listeners (the
    /kv_events streams of `kvgate engine`) need no lock.

    An engine whose model step (or intake) raises fails the requests it holds
    (``EngineFailed``), and serves on.  Those failures count as a remote
    replica's 5xx do: toward the breaker once another replica has served the
    request, ``router.breaker_failures`` with no good step between them taking
    this replica out of routing for ``router.breaker_reset_s``.
    """

    kind = "inprocess"

    def __init__(self, name: str, config: KvgateConfig | None = None, engine: Any = None) -> None:
        self._up = False
        super().__init__(name)
        self.config = config
        self.engine = engine
        # A model step running longer is a hung engine (a stuck kernel): out of
        # routing until it ends, as a `kvgate engine` in that state leaves its gateways'.
        self.step_timeout_s = config.engine.step_timeout_s if config is not None else 0.0
        self._step_running: Callable[[], float] | None = None  # the engine's step clock, once it runs
        self.breaker_failures = config.router.breaker_failures if config is not None else 3
        self.breaker_reset_s = config.router.breaker_reset_s if config is not None else 10.0
        self._failures = 0  # requests failed in a row (no good model step between them)
        self._good_steps_then = -1  # the engine's good_steps at the last failure
        self._open_until = 0.0  # monotonic: out of routing until then
        self.seq = 0
        self._listeners: list[KvListener] = []
        self._owns_engine = engine is None

    @property
    def healthy(self) -> bool:
        # Read by the router for every request: the step clock is looked up once, at start.
        running = self._step_running
        return (self._up and (running is None or running() <= self.step_timeout_s)
                and (not self._open_until or time.monotonic() >= self._open_until))

    @healthy.setter
    def healthy(self, up: bool) -> None:
        self._up = up

    def stalled_for(self) -> float:
        """Seconds the model step under way has run, when past step_timeout_s; else 0."""
        running = self._step_running
        seconds = running() if running is not None else 0.0
        return seconds if seconds > self.step_timeout_s else 0.0

    async def start(self) -> None:
        if self.engine is None:
            cfg = self.config

            def load():
                # Imported here: torch's import takes seconds, which on the event loop
                # would keep a SIGTERM or Ctrl-C waiting.
                from engine.async_engine import AsyncEngine

                # One load at a time: transformers sets torch's process-wide default
                # dtype while it builds a model, so two loads in two threads race and
                # leave some layers in the other one's dtype (bf16 vs float32 matmul
                # errors at the first step).
                with _MODEL_LOAD_LOCK:
                    return AsyncEngine.from_config(cfg.model, cfg.engine, cfg.cache)

            # Loading a model takes seconds to minutes; keep the loop responsive
            # meanwhile, and let a Ctrl-C exit without waiting for it.
            self.engine = await in_daemon_thread(load, name="kvgate-model-load")
        started = self.engine.start()
        if inspect.isawaitable(started):
            await started
        eng = self.engine
        if self.step_timeout_s:
            self._step_running = getattr(eng, "step_running_s", None)
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
            self.seq += 1
            seq = self.seq
            for listener in list(self._listeners):
                listener(seq, kind, list(keys), tier)

    def add_listener(self, listener: KvListener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def note_request_failure(self) -> None:
        good_steps = getattr(self.engine, "good_steps", None)
        if good_steps != self._good_steps_then:
            self._failures = 0  # a step has served since the last failure: a new run
        self._good_steps_then = good_steps
        self._failures += 1
        if self._failures >= self.breaker_failures:
            log.warning("replica %s leaves routing for %g s (router.breaker_reset_s): %d requests failed in a row, "
                        "each served by another replica", self.name, self.breaker_reset_s, self._failures)
            self._failures = 0
            self._open_until = time.monotonic() + self.breaker_reset_s

    def generate(self, job: Job) -> AsyncIterator[list[GenerationOutput]]:
        batches = getattr(self.engine, "generate_batches", None)
        if batches is not None:
            return batches(job.request)
        return _single_output_batches(self.engine.generate(job.request))


async def _single_output_batches(outputs: AsyncIterator[GenerationOutput]) -> AsyncIterator[list[GenerationOutput]]:
    """An engine with only ``generate`` (one output at a time): one-output batches."""
    try:
        async for out in outputs:
            yield [out]
    finally:
        await outputs.aclose()


# ----------------------------------------------------------------------------- remote


def _host_port(url: str) -> str:
    """A remote replica's default name: its URL's host:port.  Never its user:password@
    (aiohttp sends those as basic auth; the name is a label on /metrics, /stats and
    the dashboard, and in logs), and always with a port (the scheme's when the URL
    has none), so that no default is "engine", the name a `kvgate engine` gives its
    own series and the Grafana dashboard drops."""
    parts = urlsplit(url)
    host = parts.hostname or ""  # ReplicaConfig made sure there is one
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RemoteReplica(Replica):
    """A replica over HTTP: a `kvgate engine` server (exact index from its
    /kv_events stream) or any OpenAI-compatible server (approximate index).

    Requests are always streamed upstream, whatever the client asked, so the
    gateway sees tokens as they come and a client disconnect closes the
    upstream connection, which aborts the work there.

    Health, in one place: a background probe every ``health_interval_s``;
    ``breaker_failures`` straight failures of probes, or of requests (refused,
    broken, or silent for read_timeout_s while nothing at all came from the
    replica), open the breaker for ``breaker_reset_s``; a request that dies
    after its first byte opens it at once (the replica is gone or broken, and
    the next request would find out the slow way).  While open the replica is
    out of routing; it rejoins when a probe succeeds after the reset time
    and, for a `kvgate engine`, once its KV events are followed again (an
    index that missed events must not steer requests).  Opening the breaker
    also cuts the replica's live upstream streams, so a replica that hangs
    instead of dying still ends its streams with an error instead of never.
    A `kvgate engine` that says it is stopping (``draining``) is out of routing
    too, its streams run on, and its answered probes do not bring it back: only
    a (re)started engine's snapshot does.
    """

    def __init__(self, cfg: ReplicaConfig, router_cfg: RouterConfig, fallback: ReplicaInfo, name: str | None = None) -> None:
        super().__init__(name or cfg.name or _host_port(cfg.url))
        self.cfg = cfg
        try:
            self._key = replica_api_key(cfg)
        except ValueError as exc:
            raise ConfigError(f"replica {self.name}: {exc}") from None
        self.kind = cfg.kind
        self.base = replica_base_url(cfg.url)
        self.router_cfg = router_cfg
        self.info = fallback
        if cfg.kind == "openai":
            self.index = ApproxIndex(router_cfg.approx_ttl_s, router_cfg.approx_capacity_blocks)
        self._session: aiohttp.ClientSession | None = None
        # For generation requests: sock_read bounds each wait for the replica's
        # next bytes, which is what a stuck request looks like from here.
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s or None
        )
        self._tasks: list[asyncio.Task] = []
        # Straight failures, probes and requests apart: a replica whose probe
        # answers while every request fails must not have its count wiped by
        # each good probe (at a few requests per probe interval it never tripped).
        self._probe_failures = 0
        self._request_failures = 0
        # When each current run of failures began: a stream with output since the
        # run that trips the breaker began is being served, and is left to finish.
        # Kept apart, as the counts are: a request that failed an hour ago, with no
        # request since to forgive it, must not date a run of probe failures now.
        self._probes_failing_since: float | None = None
        self._requests_failing_since: float | None = None
        self._probe_failure = "no probe yet"  # why the last health probe failed, for the log
        self._probe_timed_out = False  # the last probe failed by running out of time
        # One of the replicas an entry with a count stands for (a StatefulSet's pod):
        # its host name not resolving means absent, not down.  A replica listed
        # alone whose name does not resolve is a mistake to show.
        self.slot = cfg.count > 1
        self._unresolved = False  # the last contact's host name did not resolve
        self._key_refused = False  # /kv_events answered 401/403: said once, not at every retry
        self._no_events = False  # /kv_events answered 404 (no kvgate engine): said once too
        # /kv_events answered 503 too_many_followers (the engine's limits.max_kv_event_followers
        # taken by other gateways): said once too, and retried no sooner than its Retry-After.
        self._followers_full = False
        # When any request last got output from this replica: a request left silent
        # for read_timeout_s while nothing else came either is a hung replica's.
        self._last_output = time.monotonic()
        # Requests sent and without output yet -> when each was sent: one waiting past the
        # breaker's own time to notice a hung replica says it takes no new work (_busy_since).
        self._awaiting: dict[object, float] = {}
        # Requests sent and without an answer yet, by their X-Request-Id -> resolved
        # when this engine, stopping, says it has not started them (_offer_elsewhere).
        self._unanswered: dict[str, asyncio.Future] = {}
        # When a request sent here last got its first output: a busy replica whose queue
        # outlasts the breaker's time still starts requests; a wedged one starts none.
        self._last_start = time.monotonic()
        self._open_until = 0.0
        self._wait_said = False  # said that it answers again but waits out its breaker
        self._instance: object = _UNSEEN  # a `kvgate engine`'s process, as /kvgate/info names it
        self._trip_reason = ""
        self._following = False
        # The engine's last KV event applied to the index (its snapshot's, or an
        # event's), and the requests waiting for one (see _index_reaches).
        self._kv_applied = -1
        self._kv_waiters: list[tuple[int, asyncio.Future]] = []
        self._live: dict[aiohttp.ClientResponse, float] = {}  # -> when it last had output (0: none yet)
        self._events_resp: aiohttp.ClientResponse | None = None  # the /kv_events stream being followed
        # Resolved when the breaker opens: requests still waiting for their
        # response headers give up then (and go to another replica).
        self._cut: asyncio.Future | None = None
        # A probe sent when a connection broke mid-answer: gone (trip) or one connection lost.
        self._loss_check: asyncio.Task | None = None
        # A `kvgate engine` shutting down said so: out of routing, but its
        # streams run to their end rather than being cut.
        self.draining = self.port_closed = False
        self._was_healthy = False  # for the log: joining routing the first time, or coming back
        # Learnt from the replica itself (engine: /kvgate/info; external: /v1/models);
        # until then ``info`` holds the config's guess.  The gateway listens for changes.
        self.info_known = False
        self.info_listener: Callable[[Replica], None] | None = None
        self.events_seen = 0
        self.trips = 0
        # Last figures from the backend's Prometheus endpoint (metrics_url) or, for
        # a `kvgate engine`, its KV usage from the last probe.
        self.waiting: float = 0.0
        self.kv_usage: float | None = None
        self._metrics_unknown = False  # warned that its metrics page has no load figures
        self._models_unread = False  # warned that its /v1/models could not be read
        self._model_unlisted = False  # warned that its /v1/models does not list replicas[].model
        self._stream_lost_said = False  # said the KV event stream was lost, since its last snapshot
        self._losses = 0  # requests lost together (ReplicaLost), counted as one each time
        self._last_loss = float("-inf")

    @property
    def absent(self) -> bool:
        return self.slot and self._unresolved and not self.healthy

    def _note_contact(self, exc: BaseException | None) -> None:
        """A contact ended: an answer (``exc`` None) or ``exc``; whether the host name has no address."""
        if exc is None and self.absent:
            # A pod that did not exist a moment ago: its slot's breaker record (a
            # predecessor's failures, probes of no such server) is none of its own.
            self._open_until = 0.0
        self._unresolved = _no_such_host(exc)

    def _not_answering(self, why: str) -> None:
        """Said once at start: out of routing until it answers (absent: until its name resolves)."""
        if self.absent:
            log.info("replica %s (%s) is absent, its host name not resolving (a slot of replicas[].count): "
                     "it joins routing when it does", self.name, without_userinfo(self.base))
        else:
            log.warning("replica %s (%s) is not answering (%s): out of routing until it does",
                        self.name, without_userinfo(self.base), why)

    # -- lifecycle

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # No cap on connections (aiohttp's is 100 a session): each request in flight
            # holds one, and past the cap requests waited here, unseen by the replica's
            # scheduler, with the health probes and the /kv_events resync behind them (a
            # busy replica's late probes took it out of routing).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S, ttl_dns_cache=_DNS_CACHE_S),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
            # Named, so that a server's logs tell a gateway's polls from clients (a
            # kvgate gateway behind leaves its probes of /v1/models out of its access log).
            headers={"User-Agent": GATEWAY_USER_AGENT},
        )
        if self.kind == "engine":
            # The hash salt and block size must come from the engine itself, or the
            # index will never match; give a server that is still starting a moment
            # (connect_timeout_s).  Where nothing listens at all, a second: an engine
            # binds its port before it loads, and one not started yet joins once it
            # answers, while the gateway serves (and answers its probes) meanwhile.
            began = time.monotonic()
            while True:
                try:
                    # Each try within what is left of connect_timeout_s: a server that
                    # takes the connection and never answers held the start 5 s at least.
                    left = self.cfg.connect_timeout_s - (time.monotonic() - began)
                    await self._fetch_info(max(0.1, min(left, self.router_cfg.health_timeout_s)))
                    self._note_contact(None)
                    break
                except Exception as exc:  # noqa: BLE001
                    self._note_contact(exc)
                    nothing_listens = isinstance(exc, aiohttp.ClientConnectorError)
                    limit = min(_NOTHING_LISTENS_WAIT_S, self.cfg.connect_timeout_s) if nothing_listens \
                        else self.cfg.connect_timeout_s
                    if self.absent or time.monotonic() - began >= limit:
                        self._not_answering(_plain_reason(exc))
                        break
                    await asyncio.sleep(0.25)
            self._tasks.append(asyncio.create_task(self._follow_kv_events(), name=f"kv-events:{self.name}"))
        else:
            with contextlib.suppress(Exception):
                self.healthy = self._was_healthy = await self._probe()
            if not self.healthy:
                self._not_answering(self._probe_failure)
            await self._learn_model()
            if self.cfg.metrics_url:
                self._tasks.append(asyncio.create_task(self._poll_metrics(), name=f"metrics:{self.name}"))
        self._tasks.append(asyncio.create_task(self._health_loop(), name=f"health:{self.name}"))

    async def close(self) -> None:
        self.healthy = False
        tasks = [*self._tasks, *((self._loss_check,) if self._loss_check is not None else ())]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._cut_live()
        if self._session is not None:
            await self._session.close()

    def auth_headers(self) -> dict:
        """The Authorization header the replica expects (its api_key, or api_key_env's value)."""
        return {"Authorization": f"Bearer {self._key}"} if self._key else {}

    async def _fetch_info(self, timeout_s: float | None = None) -> bool:
        """Learn the engine's block identity and limits; True when it is another
        process than the one seen before (or the first seen).  Within ``timeout_s``
        (router.health_timeout_s by default)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.router_cfg.health_timeout_s)
        async with self._session.get(self.base + "/kvgate/info", headers=self.auth_headers(), timeout=timeout) as resp:
            resp.raise_for_status()
            data = await resp.json()
        instance = data.get("instance")  # None from an engine before 0.2
        # Another process than the one seen before (a restart, an upgrade from an engine
        # that named none): the breaker's record is its predecessor's.
        # The first answer ever is a new process too: whatever opened the breaker
        # before it (probes of a server not up yet) was no failure of its own.
        restarted = instance is not None and instance != self._instance
        self._instance = instance
        self._learn(ReplicaInfo(data["model"], int(data["block_size"]), data["hash_salt"], int(data["max_model_len"])))
        return restarted

    def _learn(self, info: ReplicaInfo) -> None:
        changed = info != self.info or not self.info_known
        self.info = info
        self.info_known = True
        if changed and self.info_listener is not None:
            self.info_listener(self)

    async def _learn_model(self) -> None:
        """``_fetch_models``, its failure said once (a 401, an answer of another
        shape): meanwhile the gateway serves the configured or default name."""
        try:
            await self._fetch_models()
        except Exception as exc:  # noqa: BLE001 - whatever the cause, the replica may still serve
            if self.healthy and not self._models_unread:
                self._models_unread = True
                reason = (f"HTTP {exc.status}" if isinstance(exc, aiohttp.ClientResponseError)
                          else "an answer of another shape" if isinstance(exc, (KeyError, TypeError, AttributeError))
                          else _plain_reason(exc))
                log.warning("replica %s: cannot read its model name from /v1/models (%s); the gateway serves %r "
                            "meanwhile (set replicas[].model or model.served_name)", self.name, reason, self.info.model)

    async def _fetch_models(self) -> None:
        """An external server's model name (the gateway serves it under that name
        unless model.served_name says otherwise) and context length."""
        timeout = aiohttp.ClientTimeout(total=self.router_cfg.health_timeout_s)
        async with self._session.get(self.base + "/v1/models", headers=self.auth_headers(), timeout=timeout) as resp:
            resp.raise_for_status()
            data = await resp.json()
        cards = {m["id"]: m for m in data.get("data", ())}
        model = self.cfg.model if self.cfg.model in cards else next(iter(cards), None)
        if model:
            # vLLM and SGLang say their context length on the model card.
            length = cards[model].get("max_model_len")
            if type(length) is not int or length < 2:
                length = self.info.max_model_len
            self._learn(ReplicaInfo(model, self.info.block_size, self.info.hash_salt, length))

    # -- health and the circuit breaker

    async def _probe(self) -> bool:
        """Whether the replica answers its health path; why not in ``_probe_failure``."""
        path = "/health" if self.kind == "engine" else "/v1/models"
        try:
            timeout = aiohttp.ClientTimeout(total=self.router_cfg.health_timeout_s)
            async with self._session.get(self.base + path, headers=self.auth_headers(), timeout=timeout) as resp:
                # Said at each answer, as a failure says it below: the health loop's probe
                # and a loss check's may overlap, and each caller reads the flag as its own left it.
                self._probe_timed_out = False
                self._note_contact(None)
                if resp.status != 200:
                    self._probe_failure = f"{path} answered {resp.status}"
                    return False
                if self.kind == "engine":
                    self._note_engine_load(await resp.read())
                    return True
                listed = _listed_models(await resp.read())
                if listed == []:
                    # Nothing to serve: another kvgate gateway with no replica in routing
                    # answers so (its requests would all be 503s).
                    self._probe_failure = f"{path} lists no model"
                    return False
                self._check_model_listed(listed)
                return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._probe_failure = _plain_reason(exc)
            self._probe_timed_out = isinstance(exc, asyncio.TimeoutError)
            self._note_contact(exc)
            return False

    def _busy_since(self, asked: float) -> bool:
        """The probe sent at ``asked`` ran out of time while answers from this replica
        kept coming: too busy to answer it in time, not down.  Counted as a failure,
        an overloaded fleet left routing all at once (every engine's probes late
        together) and every new request was a 503 while the streams went on.  A busy
        replica still takes new work, late: one that leaves a request without output
        longer than the breaker takes to notice a hung replica (breaker_failures x
        (interval + timeout)), and has started none of its requests for as long, only
        finishes old streams, and its late probes count."""
        if not (self._probe_timed_out and self._last_output >= asked):
            return False
        cfg = self.router_cfg
        oldest = min(self._awaiting.values(), default=None)
        # Waiting that long is a deep queue's while the replica still starts requests.
        return oldest is None or time.monotonic() - max(oldest, self._last_start) < cfg.breaker_failures * (
            cfg.health_interval_s + cfg.health_timeout_s)

    def _check_model_listed(self, listed: list[str] | None) -> None:
        """replicas[].model names what the server is sent: one it does not list
        makes every request a 404, which clients would read as their own mistake.
        Said once while it lasts."""
        model = self.cfg.model
        if model is None or listed is None:
            return
        missing = model not in listed
        if missing and not self._model_unlisted:
            log.warning("replica %s: its /v1/models lists %s, not %r (replicas[].model), so requests sent to it as %r "
                        "will fail", self.name, ", ".join(repr(m) for m in listed[:5]), model, model)
        self._model_unlisted = missing

    def _note_engine_load(self, body: bytes) -> None:
        """A `kvgate engine`'s probe answer holds every request it has, so several
        gateways sharing engines each see the others' work (EngineEndpoints.health)."""
        try:
            data = json.loads(body)
            held = int(data["requests"])  # requests, not sequences: one of n choices is one
            usage = float(data["kv_usage"])
        except (ValueError, TypeError, KeyError, OverflowError):
            return  # an engine that does not report load: priced by this gateway's own requests
        self.kv_usage = usage
        if self.load_listener is not None:
            self.load_listener(BackendLoad(0.0, usage, held))

    async def _health_loop(self) -> None:
        interval = self.router_cfg.health_interval_s
        while True:
            await asyncio.sleep(interval)
            asked = time.monotonic()
            if await self._probe():
                self._forgive(probes=True)
                if self.kind == "openai" and not self.info_known:
                    # Down when the gateway started: its model name is still to learn.
                    await self._learn_model()
                self._maybe_rejoin()
            elif not (self._busy_since(asked) or self.absent):  # no such server: nothing to break
                self._note_failure(probe=True)

    def _maybe_rejoin(self) -> None:
        if self.draining or (self.kind == "engine" and not self._following):
            # Draining: it said it stops (its /health answers all the same, until its
            # stream ends); only a new snapshot, of a (re)started engine, clears that.
            return
        wait = self._open_until - time.monotonic()
        if wait > 0:
            if not self._wait_said:  # else a replica back from a hang looks forgotten
                log.info("replica %s answers again: back in routing in %.0f s, when its breaker closes "
                         "(router.breaker_reset_s)", self.name, wait)
                self._wait_said = True
            return
        if not self.healthy:
            log.info("replica %s is healthy: %s routing", self.name, "back in" if self._was_healthy else "in")
        self.healthy = self._was_healthy = True

    def note_request_failure(self) -> None:
        self._note_failure()

    def _forgive(self, probes: bool = False, requests: bool = False) -> None:
        """A good probe, or a request's first output: that run of failures is over
        (a good probe does not forgive failed requests, nor output failed probes)."""
        if probes:
            self._probe_failures = 0
            self._probes_failing_since = None
        if requests:
            self._request_failures = 0
            self._requests_failing_since = None

    def _note_failure(self, probe: bool = False) -> None:
        now = time.monotonic()
        if probe:
            self._probe_failures += 1
            self._probes_failing_since = self._probes_failing_since or now
            failures, what, since = self._probe_failures, "probes", self._probes_failing_since
        else:
            self._request_failures += 1
            self._requests_failing_since = self._requests_failing_since or now
            failures, what, since = self._request_failures, "requests", self._requests_failing_since
        if failures >= self.router_cfg.breaker_failures:
            self._trip(f"{failures} {what} failed in a row", failing_since=since)

    def _trip(self, why: str, failing_since: float | None = None) -> None:
        """Open the breaker: out of routing for breaker_reset_s, live streams cut
        (unless the replica is draining: those streams are still being served).
        ``failing_since``: when the run of failures that tripped it began; streams
        with output since then are spared (None: every stream is cut)."""
        if self.healthy:
            # The last probe's failure in the log only: it may name internal addresses,
            # and ``why`` reaches clients whose streams are cut.
            last = f" (last probe: {self._probe_failure})" if self._probe_failures else ""
            log.warning("replica %s leaves routing: %s%s", self.name, why, last)
        self.trips += 1
        self._wait_said = False
        self.healthy = False
        self._trip_reason = why  # what the streams it cuts tell their clients
        self._forgive(probes=True, requests=True)
        self._open_until = time.monotonic() + self.router_cfg.breaker_reset_s
        if isinstance(self.index, ApproxIndex):
            self.index.clear()  # a restarted server holds none of it
        if not self.draining:
            # Streams with output since the failures began are being served (a
            # replica too busy for its probes): they finish.  The rest, hung or
            # not yet started, are cut; those with no output go to another replica.
            self._cut_live(spare_since=failing_since)
            if self.kind == "engine":
                # Whatever comes back after the breaker (this engine or a restarted
                # one) rejoins on a fresh snapshot and /kvgate/info, not on the
                # view of a stream that may be dead without knowing it.
                self._following = False
                if self._events_resp is not None:
                    self._events_resp.close()  # its reader fails at once: a resync

    def _check_after_loss(self, reason: str) -> None:
        """A connection broke mid-answer: probe the replica now, and take it out of
        routing if it does not answer (its streams with output since are spared:
        it is still serving them).  One probe at a time."""
        if self._loss_check is None or self._loss_check.done():
            self._loss_check = asyncio.create_task(self._probe_after_loss(reason, time.monotonic()),
                                                   name=f"loss-check:{self.name}")

    async def _probe_after_loss(self, reason: str, lost_at: float) -> None:
        asked = time.monotonic()
        if not await self._probe() and not self._busy_since(asked) and not self.breaker_open:
            self._trip(f"failed mid-request: {reason}", failing_since=lost_at)

    def _cut_live(self, spare_since: float | None = None) -> None:
        # Closing a response makes its reader fail at once (-> an error event).
        for resp, last_output in list(self._live.items()):
            if spare_since is None or last_output <= spare_since:
                resp.close()
        if self._cut is not None and not self._cut.done():
            self._cut.set_result(None)
        self._cut = None

    @property
    def breaker_open(self) -> bool:
        return time.monotonic() < self._open_until

    def _kv_advanced(self, seq: int) -> None:
        self._kv_applied = seq
        if self._kv_waiters:
            for want, reached in self._kv_waiters:
                if want <= seq and not reached.done():
                    reached.set_result(None)
            self._kv_waiters = [(want, reached) for want, reached in self._kv_waiters if not reached.done()]

    async def _index_reaches(self, seq: int) -> None:
        """Wait (briefly) until the index has applied the engine's KV events up to
        ``seq``: the events of the step that ended a request travel on their own
        stream, and a busy gateway could answer the request first.  Its client's
        next request, sent at once with the same prompt, was then routed on an
        index without the prompt's blocks (to another engine, all recomputed)."""
        if not self._following or self._kv_applied >= seq:
            return
        reached = asyncio.get_running_loop().create_future()
        self._kv_waiters.append((seq, reached))
        try:
            await asyncio.wait_for(reached, _KV_CATCH_UP_S)
        except asyncio.TimeoutError:
            pass  # the answer goes out all the same; the index follows when it follows
        finally:
            if not reached.done():
                reached.cancel()
            self._kv_waiters = [(want, other) for want, other in self._kv_waiters if other is not reached]

    async def _follow_kv_events(self) -> None:
        """Keep the index equal to the replica's cache: snapshot, then ordered events.

        A gap in sequence numbers or a dropped stream means events were lost:
        start over from a fresh snapshot (the index is cleared meanwhile so the
        router never trusts a stale view).  A stream that cannot even be
        reopened means the engine is gone: it leaves routing at once.
        """
        backoff = 0.2
        while True:
            try:
                async with self._session.get(
                    self.base + "/kv_events", params=PACKED_QUERY, headers=self.auth_headers(),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s,
                                                  sock_read=_KV_EVENTS_SILENT_S),
                ) as resp:
                    if resp.status in (401, 403):
                        # Its /health needs no key, so nothing else shows it: a setting to fix.
                        if not self._key_refused:
                            log.warning("replica %s refuses the gateway's key (/kv_events answered %d): it stays out "
                                        "of routing until its replicas[].api_key (or api_key_env) is one of the engine's keys",
                                        self.name, resp.status)
                        self._key_refused = True
                    if resp.status == 404:
                        # vLLM or SGLang given as `kind: engine` (or --replica without openai+).
                        if not self._no_events:
                            log.warning("replica %s has no /kv_events (it answered 404): it is no `kvgate engine`; "
                                        "give an OpenAI-compatible server (vLLM, SGLang) as kind: openai, or "
                                        "--replica openai+%s. It stays out of routing", self.name,
                                        without_userinfo(self.base))
                        self._no_events = True
                    if resp.status == 503 and await _error_code(resp) == "too_many_followers":
                        # Nothing else shows it: the replica just never joins routing.
                        if not self._followers_full:
                            log.warning("replica %s takes no more /kv_events followers (its "
                                        "limits.max_kv_event_followers, taken by other gateways): it stays out "
                                        "of routing until one leaves; raise that limit on the engine", self.name)
                        self._followers_full = True
                        retry_after = header_count(resp.headers.get("Retry-After")) or 0
                        backoff = min(max(backoff, retry_after), _KV_EVENTS_MAX_BACKOFF_S * 5)
                    if resp.status != 200:
                        raise ReplicaUnavailable(f"/kv_events answered {resp.status}")
                    self._key_refused = self._no_events = self._followers_full = False
                    self._events_resp = resp
                    last = None
                    async for event, data in sse_events(resp.content):
                        if event == "draining":
                            if self.healthy:
                                log.info("replica %s is shutting down: out of routing, its streams finish", self.name)
                            self.draining, self.port_closed = True, False
                            self.healthy = False
                            self._offer_elsewhere(data.get("unstarted"))
                            continue
                        if event == "snapshot":
                            trips = self.trips
                            if data.get("draining"):
                                # Reconnected to an engine that is still stopping: it stays out,
                                # and its blocks are not indexed (never routed on, and a million
                                # keys took ~0.7 s of this loop at every reconnect of its drain).
                                self.draining, self.healthy = True, False
                                self.port_closed = False  # it answered: its port is open still
                                self._offer_elsewhere(data.get("unstarted"))
                                continue
                            await self.index.rebuild(held_from_snapshot(data))
                            last = data["seq"]
                            self._kv_advanced(last)
                            self.draining = self.port_closed = False  # a (re)started engine
                            # A new snapshot may be a restarted engine with another block
                            # size, salt, model or context length: learn them again (the
                            # gateway says so if its hashes can no longer match).  Until
                            # they are known it stays out of routing.
                            try:
                                restarted = await self._fetch_info()
                            except Exception as exc:  # noqa: BLE001
                                raise ReplicaUnavailable(f"/kvgate/info failed: {_plain_reason(exc)}") from None
                            if self.trips != trips:
                                # Its breaker opened meanwhile, on this very process: this
                                # stream is closed, and what opened the breaker stands.
                                raise ReplicaUnavailable("its breaker opened while resyncing")
                            if restarted:
                                # Not the process whose failures opened the breaker: it is
                                # judged afresh.  The same process, flapping, still sits out
                                # breaker_reset_s.
                                self._open_until = 0.0
                            self._following = True
                            self._stream_lost_said = False
                            self._forgive(probes=True, requests=True)  # a (re)started engine
                            self._maybe_rejoin()
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
                        if self._kv_waiters:
                            self._kv_advanced(seq)
                        else:
                            self._kv_applied = seq
                    raise ReplicaUnavailable("/kv_events ended")
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
                # Nothing listens there: the engine is down, not merely resyncing.
                if self.healthy:
                    self._trip(_plain_reason(exc))
                elif self.draining and not (self._live or self._awaiting):
                    # It drained and exited: down now, until a process answers there again.
                    # (Not while requests sent here are open: it closed its port, but
                    # serves them still, and a failed probe must not cut them.)
                    log.info("replica %s has stopped (%s)", self.name, _plain_reason(exc))
                    self.draining = self.port_closed = False
            except Exception as exc:  # noqa: BLE001 - any other failure means: resync
                if not (self.draining or self._key_refused or self._no_events or self._followers_full):
                    # Each said already, or on purpose.
                    # Once an outage (a hung engine's stream fails every 20 s): then at DEBUG.
                    log.log(logging.DEBUG if self._stream_lost_said else logging.INFO,
                            "replica %s: kv event stream lost (%s); resyncing", self.name,
                            exc if isinstance(exc, ReplicaUnavailable) else _plain_reason(exc))
                    self._stream_lost_said = True
            finally:
                self._events_resp = None
            self._following = False
            self.index.reset({})
            await asyncio.sleep(_KV_EVENTS_MAX_BACKOFF_S if self.draining else backoff)
            backoff = min(backoff * 2, _KV_EVENTS_MAX_BACKOFF_S)

    def _offer_elsewhere(self, unstarted: object) -> None:
        """This engine is stopping, and names the requests it has not started
        (queued behind those it runs, which it finishes first, for up to its
        drain time): those of this gateway's that still wait for an answer are
        offered to another replica.  Each stays sent here until another answers
        it, so when every engine stops at once (a node drain) each is still
        served by the engine it was sent to (see OfferedElsewhere)."""
        if not isinstance(unstarted, list) or not self._unanswered:
            return
        offered = 0
        for name in unstarted:
            answer = self._unanswered.get(name) if isinstance(name, str) else None
            if answer is not None and not answer.done():
                answer.set_result(None)
                offered += 1
        if offered:
            log.info("replica %s: %d queued %s offered to other replicas", self.name, offered,
                     "request" if offered == 1 else "requests")

    async def _poll_metrics(self) -> None:
        """vLLM/SGLang Prometheus figures -> the router's load term (see Router.set_external_load)."""
        interval = self.router_cfg.health_interval_s
        failures = 0
        while True:
            try:
                async with self._session.get(self.cfg.metrics_url, headers=self.auth_headers(),
                                             timeout=aiohttp.ClientTimeout(total=self.router_cfg.health_timeout_s)) as resp:
                    resp.raise_for_status()
                    text = await resp.text()
                waiting, usage = parse_backend_metrics(text, self.cfg.model or (self.info.model if self.info else None))
                if waiting is None and usage is None and not self._metrics_unknown:
                    # Read as idle, silently, the server's own queue would never count.
                    self._metrics_unknown = True
                    log.warning("replica %s: its metrics at %s have none of %s: its own queue does not count in "
                                "routing", self.name, without_userinfo(self.cfg.metrics_url),
                                ", ".join(KNOWN_LOAD_METRICS))
                self.waiting, self.kv_usage = waiting or 0.0, usage
                if failures:
                    log.info("replica %s: its metrics answer again: its queue counts in routing", self.name)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                # A slot with no pod (its name does not resolve) is no outage: no warning
                # (it is said once at start, at INFO), and no figures.
                if not self.absent:
                    failures += 1
                    # Once per outage, not every poll: without them the router soon counts
                    # none of the server's own queue (other clients', its waiting requests).
                    log.log(logging.WARNING if failures == 1 else logging.DEBUG,
                            "replica %s: cannot read its metrics at %s (%s): routing goes by its last figures, then "
                            "by none, until they answer", self.name, without_userinfo(self.cfg.metrics_url),
                            f"HTTP {exc.status}" if isinstance(exc, aiohttp.ClientResponseError) else _plain_reason(exc))
                # A saturated server is the one whose /metrics times out: keep its last
                # figures for a few polls rather than read it as idle; then drop them
                # (an outage, not load, and the health checks judge those).
                if self.absent or failures > _METRICS_KEEP_POLLS:
                    self.waiting, self.kv_usage = 0.0, None
            if self.load_listener is not None:
                self.load_listener(BackendLoad(self.waiting, self.kv_usage))
            await asyncio.sleep(interval)

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
                "logit_bias": {str(k): v for k, v in s.logit_bias.items()} if s.logit_bias else None,
                "top_k": s.top_k,
                "ignore_eos": s.ignore_eos,
                "min_p": s.min_p,
                "repetition_penalty": s.repetition_penalty,
                "min_tokens": s.min_tokens,
                "include_stop_str_in_output": s.include_stop_str_in_output,
                "stop_token_ids": s.stop_token_ids or None,
                "user": parsed.user,
                "kvgate_context": {
                    "workload": ctx.workload, "type": ctx.type, "turn": ctx.turn, "session": ctx.session,
                    "tenant": ctx.tenant, "signature": ctx.signature, "chat_id": ctx.chat_id,
                    "parent_chat_id": ctx.parent_chat_id,
                    # A chat arrives as token ids on /v1/completions: the engine's metrics count it as a chat.
                    "endpoint": parsed.endpoint,
                },
                "kvgate_mm_hashes": [[off, h.hex()] for off, h in job.request.mm_hashes],
                "cache_salt": job.request.cache_salt,
                # Token ids on every chunk: exact generated-token counts for a stream
                # cut short, and the output blocks a recording names.
                "kvgate_token_ids": True,
            }
            path = "/v1/completions"
        else:
            body = dict(parsed.body)
            # kvgate's own fields are for a gateway's engines, set by the gateway: a
            # client's (a forged tenant or workload) reaches no server.  Nor do vLLM's
            # fields that steer the server rather than the answer: one tenant's priority
            # over the others', where a disaggregated prefill sends its KV.
            for own in _NOT_FROM_CLIENTS:
                body.pop(own, None)
            # The server's own name once learnt: the gateway may serve it under an alias.
            body["model"] = self.cfg.model or (self.info.model if self.info_known else parsed.model)
            if parsed.cache_salt and self.cfg.send_cache_salt:
                body["cache_salt"] = parsed.cache_salt  # vLLM (V1) keeps salted prompts' blocks apart too
            if job.fills_room:
                body.pop("max_tokens", None)
            else:
                body["max_tokens"] = job.max_tokens
            body.pop("max_completion_tokens", None)
            if parsed.endpoint != CHAT:
                body["prompt"] = job.prompt
                if parsed.echo_texts is not None:
                    body.pop("echo", None)  # the gateway echoes the prompt itself
            path = "/v1/chat/completions" if parsed.endpoint == CHAT else "/v1/completions"
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return path, body

    async def generate(self, job: Job, sent: asyncio.Future | None = None) -> AsyncIterator[list[GenerationOutput]]:
        """``job``'s outputs from this replica; ``sent``: its request already sent
        here and offered elsewhere (OfferedElsewhere), whose answer is read now."""
        if sent is None and (self.breaker_open or self._session is None):
            raise ReplicaUnavailable(f"replica {self.name} is not taking requests")
        chat = self.kind != "engine" and job.parsed.endpoint == CHAT
        rid = job.request.request_id
        started = time.monotonic()
        waiting = object()
        self._awaiting[waiting] = started
        # A `kvgate engine` that begins to stop names the requests it has not
        # started, by X-Request-Id: this one's may then be offered elsewhere (not
        # one sent while it stops, as a last resort: there is nowhere else).
        offer = name = None
        if sent is None and self.kind == "engine" and job.forwarded_id is not None and not self.draining:
            name = job.forwarded_id
            offer = self._unanswered[name] = asyncio.get_running_loop().create_future()
        try:
            if sent is None:
                path, body = self._payload(job)
                headers = self.auth_headers()
                if job.forwarded_id is not None:
                    headers["X-Request-Id"] = job.forwarded_id
                sent = asyncio.ensure_future(
                    self._session.post(self.base + path, json=body, headers=headers, timeout=self._request_timeout))
            resp = await self._answer(sent, started, offer)
        except BaseException:
            del self._awaiting[waiting]
            raise
        finally:
            if offer is not None and self._unanswered.get(name) is offer:
                del self._unanswered[name]
        self._live[resp] = 0.0
        produced = False  # a choice's output came and was handed on (usage alone is no answer)
        held: list[GenerationOutput] = []  # usage that came before it
        finished: set[int] = set()  # choice indexes with a finish_reason
        try:
            if resp.status != 200:
                raise await self._refusal(resp)
            if isinstance(self.index, ApproxIndex):
                # Only a prompt the server accepted can be in its cache.
                self.index.record(job.keys)
            ended = False
            queue_time = cached = kv_seq = None
            if self.kind == "engine":
                queue_time = header_seconds(resp.headers.get(QUEUE_TIME_HEADER))
                cached = header_count(resp.headers.get(CACHED_TOKENS_HEADER))
            try:
                async for _event, chunk in answer_events(resp):
                    if chunk is DONE_EVENT:
                        ended = True
                        break
                    if isinstance(chunk, dict) and ("error" in chunk or chunk.get("object") == "error"):
                        chunk = openai_error_body(chunk) or {"error": {}}
                        if is_stopping(chunk):
                            # Past its drain time: nothing of this replica's failing, and a
                            # non-streaming answer may start over elsewhere.
                            raise ReplicaStopping(f"replica {self.name} is shutting down")
                        status = in_stream_error_status(chunk)
                        if status >= 500 and (not produced or not job.parsed.stream):
                            # Failed before a token (vLLM and SGLang answer 200, then the
                            # error), or mid-answer for a client that has had nothing yet:
                            # another replica may well succeed, and if it does, this
                            # failure counts toward this one's breaker.
                            when = "mid-answer" if produced else "before its first token"
                            raise ReplicaAnswerFailed(f"replica {self.name} failed {when}: "
                                                      f"{UpstreamError(status, chunk)}", status, chunk)
                        raise UpstreamError(status, chunk)
                    batch = chunk_outputs(chunk, rid, chat)
                    if "kvgate_kv_seq" in chunk:  # a `kvgate engine`'s, with usage: its last KV event then
                        kv_seq = chunk["kvgate_kv_seq"]
                    finished.update(o.index for o in batch if o.finish_reason is not None)
                    if not produced:
                        if all(o.index == USAGE_ALL for o in batch):
                            # Usage before any choice is no answer yet: held, so that a
                            # stream ending here is retried as one that sent nothing.
                            held += batch
                            continue
                        # A 200 alone is not success (an error event may follow), nor usage alone.
                        self._forgive(requests=True)
                        self._awaiting.pop(waiting, None)
                        self._last_start = time.monotonic()
                        batch = held + batch
                        batch[0].queue_time_s = queue_time
                        batch[0].cached_tokens = cached
                        produced = True
                    if batch:
                        self._last_output = self._live[resp] = time.monotonic()
                        yield batch
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                if len(finished) < job.request.sampling.n:
                    raise
                # Every choice had finished: the connection went with only [DONE] (and
                # usage) unsent.  The answer is whole; nothing of the replica failed it.
                log.debug("replica %s: connection lost after request %s finished", self.name, rid)
            if len(finished) < job.request.sampling.n:
                # EOF without [DONE] before every choice finished: a silent
                # truncation would look like a complete answer to the client.
                if not ended:
                    raise _EndedEarly(f"replica {self.name} closed the stream before [DONE]")
                # So would [DONE] with a choice unfinished (cut upstream, or a server
                # that ignores n): a null finish_reason, or a choice left empty.
                # (With no choice at all, below: no answer, counted toward its breaker.)
                if produced:
                    unfinished = sorted(set(range(job.request.sampling.n)) - finished)
                    raise _DoneUnfinished(f"replica {self.name} sent [DONE] with choice "
                                          f"{', '.join(map(str, unfinished))} of {job.request.sampling.n} unfinished")
            if not produced:
                # [DONE] with no choice at all (every server sends at least a
                # finish_reason): an empty 200 would pass for the model's answer.
                raise _EndedEarly(f"replica {self.name} ended the stream without an answer")
            if type(kv_seq) is int:
                await self._index_reaches(kv_seq)
        except aiohttp.ServerTimeoutError as exc:
            # A request silent that long while the replica serves others (a deep
            # queue delays several at once) is not counted toward the breaker, whose
            # trip would cut every stream it has.  Silence from the whole replica
            # is: a hung model step (its HTTP server still answering the health
            # checks) would otherwise hold every request sent there for
            # read_timeout_s, for ever.
            if not produced and self._last_output < started and not self.breaker_open:
                self._note_failure()
            raise ReplicaUnavailable(f"replica {self.name}: {self._timeout_reason(exc)}") from exc
        except (ReplicaBusy, ReplicaAnswerFailed, ReplicaStopping, _DoneUnfinished):
            # At capacity, or counted by the dispatcher, or leaving, or a server that
            # talks fine but answers fewer choices (concurrent n=2 requests to one that
            # ignores n would trip its breaker for everyone): not failing here.
            raise
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, ReplicaUnavailable) as exc:
            # ValueError: a broken frame (JSONDecodeError) from a dying server.
            reason = str(exc) if isinstance(exc, ReplicaUnavailable) else _plain_reason(exc)
            if self.breaker_open:
                if not isinstance(exc, ReplicaUnavailable):
                    # The breaker cut this stream (it closed the connection): its cause,
                    # not "the connection failed", is what went wrong.
                    reason = f"it was taken out of routing ({self._trip_reason})"
                # Nothing more to count: the trip (or the failures before it) is the
                # replica's record, and counted again the streams it cut would trip
                # it anew soon after it rejoined.
            elif produced and not isinstance(exc, (ValueError, _EndedEarly)):
                # The connection broke mid-answer: the replica may be gone (a dead
                # process breaks every connection) or only this connection (a proxy's
                # idle timeout, a middlebox's reset), and one dropped connection must
                # not cut the hundred streams it serves.  A probe tells which.
                self._note_failure()
                self._check_after_loss(reason)
            else:
                # One malformed or cut-short answer from a replica that still talks
                # HTTP: counted, but not worth cutting every stream it serves.
                self._note_failure()
            if _lost(exc):
                raise ReplicaLost(f"replica {self.name} failed mid-request: {reason}", self._loss_event()) from exc
            if isinstance(exc, ReplicaUnavailable):
                raise
            raise ReplicaUnavailable(f"replica {self.name} failed mid-request: {reason}") from exc
        finally:
            self._live.pop(resp, None)
            self._awaiting.pop(waiting, None)
            # Closing the connection is what aborts the request upstream.
            resp.close()

    async def _answer(self, post: asyncio.Future, started: float, offer: asyncio.Future | None) -> aiohttp.ClientResponse:
        """The replica's answer (its head) to the request ``post`` sent; a failure to
        get one is ReplicaUnavailable, counted toward the breaker where it is the
        replica's.  ``offer`` resolved first: OfferedElsewhere, the request left sent."""
        # A replica that accepts the connection but never answers (stopped, hung
        # in prefill) would hold this request forever: it gives up when the
        # breaker opens, and, having produced nothing, is retried elsewhere.
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait((post, self._cut) if offer is None else (post, self._cut, offer),
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            withdraw_post(post)  # the client went away meanwhile
            raise
        if not post.done():
            if offer is not None and offer.done() and not self.breaker_open:
                raise OfferedElsewhere(f"replica {self.name} is shutting down and had not started the request", post)
            post.cancel()
            raise ReplicaUnavailable(f"replica {self.name} stopped answering")
        try:
            return post.result()
        except aiohttp.ServerTimeoutError as exc:
            if isinstance(exc, aiohttp.ConnectionTimeoutError) or self._last_output < started:
                # No connection at all, or silence from the whole replica (see generate).
                self._note_failure()
            raise ReplicaUnavailable(f"replica {self.name}: {self._timeout_reason(exc)}") from exc
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            if self.draining and isinstance(exc, aiohttp.ClientConnectorError):
                # Tried as a last resort (every engine stopping), past its shutdown
                # delay: its port closed, as it said it would; no failure of its.
                self.port_closed = True
                raise ReplicaStopping(f"replica {self.name} is shutting down") from exc
            self._note_failure()
            if _lost(exc):  # sent, then the connection broke
                raise ReplicaLost(f"replica {self.name}: {_plain_reason(exc)}", self._loss_event()) from exc
            raise ReplicaUnavailable(f"replica {self.name}: {_plain_reason(exc)}") from exc

    def _loss_event(self) -> tuple:
        """The requests this replica loses within _LOSS_BURST_S of each other are one
        loss (it died, and every connection it held broke), named by a count."""
        now = time.monotonic()
        if now - self._last_loss > _LOSS_BURST_S:
            self._losses += 1
        self._last_loss = now
        return self.name, self._losses

    async def _refusal(self, resp: aiohttp.ClientResponse) -> Exception:
        """What an answer other than 200 means: at capacity, stopping, the
        replica failing, or the request refused (the client's, passed on)."""
        try:
            err = await resp.json(content_type=None)
        except Exception:  # noqa: BLE001
            err = {}
        err = openai_error_body(err)
        if resp.status == 429:
            return ReplicaBusy(f"replica {self.name} is at capacity", err or {},
                               header_count(resp.headers.get("Retry-After")))
        if err is None:
            if resp.status in (502, 503, 504):  # a proxy's page: the server behind it is not there
                return ReplicaUnavailable(f"replica {self.name} answered {resp.status}")  # counted by generate
            # An answer all the same, in plain text: a refusal (a proxy's 413 page) is
            # the request's, passed on; a failure (a bare 500) is judged as OpenAI-shaped ones are.
            reason = resp.reason or ("Client Error" if resp.status < 500 else "Server Error")
            err = {"error": {"message": f"The model server {'refused' if resp.status < 500 else 'failed'} "
                                        f"the request: {resp.status} {reason}.",
                             "type": "invalid_request_error" if resp.status < 500 else "api_error"}}
        if is_stopping(err):
            return ReplicaStopping(f"replica {self.name} is shutting down")  # refusing new work: no failure
        if resp.status >= 500:
            return ReplicaAnswerFailed(f"replica {self.name} answered {resp.status}", resp.status, err,
                                       header_count(resp.headers.get("Retry-After")))
        return UpstreamError(resp.status, err)

    def _timeout_reason(self, exc: aiohttp.ServerTimeoutError) -> str:
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return f"no connection within {self.cfg.connect_timeout_s:g} s"
        return f"sent nothing for {self.cfg.read_timeout_s:g} s (read_timeout_s)"


async def _error_code(resp: aiohttp.ClientResponse) -> str | None:
    """An OpenAI-shaped error answer's code (None: no such answer)."""
    try:
        body = await resp.json(content_type=None)
        return body["error"]["code"]
    except Exception:  # noqa: BLE001 - any other answer has no code
        return None


# What a lookup answers for a name that does not exist (a StatefulSet's pod not
# there): getaddrinfo's "Name or service not known" / "No address associated",
# and c-ares's (aiohttp's resolver where aiodns is installed) ENOTFOUND / ENODATA.
_NO_SUCH_HOST = frozenset({socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})
_ARES_NO_SUCH_HOST = frozenset({1, 4})


def _no_such_host(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the host name has no address: no such pod, an absent
    slot.  Not a lookup that failed (EAI_AGAIN: the DNS server unreachable or
    timing out, EAI_FAIL): that is an outage, which shows as down and alerts."""
    if not isinstance(exc, aiohttp.ClientConnectorDNSError):
        return False
    cause = exc.os_error
    if isinstance(cause, socket.gaierror):
        return cause.errno in _NO_SUCH_HOST
    code = getattr(cause.__cause__, "args", ())[:1]  # aiodns's DNSError(code, text), under an OSError
    return bool(code) and code[0] in _ARES_NO_SUCH_HOST


def _plain_reason(exc: BaseException) -> str:
    """What went wrong with a replica, in words for an operator's log and a
    client's error message: aiohttp's own texts quote internal states (e.g.
    "TransferEncodingError: 400") that read like the client's fault."""
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's timeouts are these too
        return "it did not answer in time"
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Not asyncio's own words, which name the address ("Connect call failed
        # ('10.0.0.5', 8001)"): a trip's reason reaches the clients whose streams it cuts.
        errno = exc.errno
        words = os.strerror(errno) if isinstance(errno, int) and errno > 0 else exc.strerror
        return f"cannot connect ({words or exc.os_error.__class__.__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "it closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the connection closed before the end of the response"
    if isinstance(exc, (aiohttp.ClientConnectionError, ConnectionError)):
        return f"the connection failed ({exc.__class__.__name__})"
    if isinstance(exc, aiohttp.ClientResponseError):
        # Not aiohttp's text either, which ends with the request's URL (the replica's
        # address) and gives a malformed head as "400", the client's fault to read.
        if isinstance(exc, aiohttp.TooManyRedirects):
            return "it redirected the request too many times"
        if isinstance(exc.__cause__, aiohttp.http_exceptions.HttpProcessingError):
            return "it sent a malformed response"
        return f"it answered {exc.status}"
    if isinstance(exc, ValueError):
        return "it sent a malformed response"
    return str(exc) or exc.__class__.__name__


# Request fields an external server never gets from a client (RemoteReplica._payload).
_NOT_FROM_CLIENTS = ("kvgate_context", "kvgate_mm_hashes", "kvgate_token_ids", "priority", "kv_transfer_params",
                     "vllm_xargs")
# How long a gateway starting waits for an engine where nothing listens (RemoteReplica.start).
_NOTHING_LISTENS_WAIT_S = 1.0
# RemoteReplica._instance before /kvgate/info first answered (None: an engine that names no process).
_UNSEEN = object()
# Longest wait, at a request's end, for the KV events of the step that ended it
# (a gateway that follows keeps up in milliseconds; one that does not must not
# hold answers for it).
_KV_CATCH_UP_S = 0.05
# Longest wait before reopening /kv_events; also the wait while the engine drains.
_KV_EVENTS_MAX_BACKOFF_S = 2.0
# A `kvgate engine` sends an SSE comment down an idle /kv_events this often, so
# that its followers can tell a quiet engine from a connection that died without
# a FIN or RST (a host that rebooted, a proxy that dropped an idle stream): one
# silent for _KV_EVENTS_SILENT_S is given up and the follower resyncs.
KV_EVENTS_HEARTBEAT_S = 5.0
_KV_EVENTS_SILENT_S = 4 * KV_EVENTS_HEARTBEAT_S
class _EndedEarly(ReplicaUnavailable):
    """A stream that ended cleanly (no broken connection) before [DONE]."""


class _DoneUnfinished(ReplicaUnavailable):
    """A stream that sent [DONE] before every choice had its finish_reason."""


class ReplicaLost(ReplicaUnavailable):
    """The replica's connection broke while it ran the request (it had it, and
    then was gone): it may have died of the request itself.  ``event`` names the
    loss: the requests a replica lost together (its death) share it."""

    def __init__(self, message: str, event: tuple) -> None:
        super().__init__(message)
        self.event = event


def _lost(exc: BaseException) -> bool:
    """A connection that broke after the request reached the replica (not one
    that never opened: a replica already down had nothing to do with it; nor a
    stream that ended early over a connection that stayed whole)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError,
                            ConnectionResetError))


# ----------------------------------------------------------------------------- construction


def build_replicas(config: KvgateConfig, urls: list[str] = ()) -> list[Replica]:
    """Replicas from config plus ``--replica`` URLs (``openai+http://...`` for external servers)."""
    specs = [spec for _, spec in replica_slots(config.replicas)]
    for url in urls:
        if url.startswith("openai+"):
            specs.append(ReplicaConfig(kind="openai", url=url[len("openai+") :]))
        else:
            specs.append(ReplicaConfig(kind="engine", url=url))
    if not specs:
        specs = [ReplicaConfig(kind="inprocess")]
    name = default_model_name(config)
    # An engine on the same config salts its block hashes with this name.
    fallback = ReplicaInfo(config.model.served_name or name, config.engine.block_size, name, config.model.max_model_len)
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


def default_model_name(config: KvgateConfig) -> str:
    from engine.model_loader import served_name

    return served_name(config.model)


def load_tokenizer(config: KvgateConfig):
    """The model's tokenizer alone, for a gateway whose engines are all remote."""
    from engine.model_loader import load_tokenizer as load

    return load(config.model)


def _listed_models(body: bytes) -> list[str] | None:
    """The model ids of an OpenAI /v1/models answer; None for another shape (a
    server whose listing says nothing the probe can use)."""
    try:
        cards = json.loads(body)["data"]
        return [card["id"] for card in cards]
    except (ValueError, TypeError, KeyError):
        return None
