"""What the gateway watches about itself, in one place: the request hooks and the state readers.

The request path calls three hooks, each a handful of additions:
``first_token`` (TTFT; gateway/respond.py), ``answered`` (a client request
answered in full; gateway/app.py) and ``finished`` (one engine request
completed: engine-actual prompt/cached tokens feed the minute reuse ratio, the
user hit share, the /stats history and the trace recorder; gateway/dispatch.py).
Inter-token latency is observed by the dispatcher itself.  Everything else (engine KV blocks, evictions, swap bytes, policy
state) is read when someone asks: a Prometheus scrape or a /stats poll.

Engine stats per replica:
- in-process: ``AsyncEngine.stats()`` (between steps; during a step, the
  figures from just before it), read on the event loop thread;
- `kvgate engine` servers: their ``GET /kvgate/stats`` (the same dict),
  fetched on demand by ``refresh()`` before a scrape or /stats answer, at most
  once a second per replica, all replicas concurrently with a short timeout;
  a replica that does not answer keeps its last figures for _REMOTE_KEEP_S,
  and one out of routing shows none;
- external OpenAI servers: none (their own /metrics has vLLM's series).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

import aiohttp

from engine.block_hash import chain_salt
from engine.context import RequestContext
from gateway.config import KvgateConfig
from gateway.metrics import GatewayMetrics
from gateway.prefix import Prompt
from gateway.recorder import TraceRecorder, generated_keys
from gateway.reuse_rate import MinuteReuse
from gateway.stats import StatsHistory, replica_entry
from gateway.status_log import StatusLog
from gateway.user_share import UserHitShare

log = logging.getLogger(__name__)

# Remote engine stats: refetched at most this often, waited for at most this long.
_REMOTE_MIN_AGE_S = 1.0
_REMOTE_TIMEOUT_S = 2.0
# Last good figures outlive failed fetches this long (the health checks take a
# dead engine out of routing sooner, and its figures with it).
_REMOTE_KEEP_S = 15.0


@dataclass(slots=True)
class Finished:
    """One completed engine request, as the engine reported it."""

    ctx: RequestContext
    replica: str
    prompt: Prompt  # token ids, image hashes and block keys, as the gateway computed them
    prompt_tokens: int
    # None: the replica never said (an external server cut off before its usage):
    # recorded, but kept out of the hit figures, as out of the metrics' lookups.
    cached_tokens: int | None
    completion_tokens: int
    arrival: float  # time.monotonic() when the request was sent to routing
    user: str | None  # the request's `user` field, scoped by tenant below
    generated: list[int] | None = None  # choice 0's token ids, collected only while recording
    cache_salt: str | None = None  # the request's (its block keys chain from it)


class Observer:
    def __init__(self, config: KvgateConfig, metrics: GatewayMetrics, record: bool = True) -> None:
        self.config = config
        self.record = record  # server.record_trace is read (not by a `kvgate engine`)
        self.metrics = metrics
        self.history = StatsHistory(started=time.time())
        self.reuse = MinuteReuse()
        self.user_share = UserHitShare()
        self.recorder: TraceRecorder | None = None
        self.status = StatusLog()
        self._status_task: asyncio.Task | None = None
        self._replicas: list = []
        self._inflight = lambda i: 0
        self._remote: dict[str, tuple[float, dict | None]] = {}
        self._remote_ok: dict[str, float] = {}  # when each replica's stats last came
        self._session: aiohttp.ClientSession | None = None
        self._refreshing: asyncio.Task | None = None  # the fetch every scrape meanwhile waits for
        # Minute boundaries of the reuse ratio are wall-clock minutes (tests move this clock).
        self.wall_clock = time.time
        metrics.watch_state(self.replica_stats, self._reuse_now, self._shares_now)

    # -- lifecycle

    def start(self, replicas: list, inflight, block_size: int, salt: str | bytes = "") -> None:
        """``inflight(i)``: requests in flight on replica i (the router's count);
        ``block_size`` and ``salt``: the block identity the engines use."""
        self._replicas = replicas
        self._inflight = inflight
        self._block_size = block_size
        self._salt = salt
        server = self.config.server
        if server.record_trace and self.record:
            self.recorder = TraceRecorder(server.record_trace, server.record_max_bytes, block_tokens=block_size)
            log.info("recording served traffic to %s (block ids per %d tokens)", server.record_trace, block_size)
        elif server.record_trace:
            log.info("server.record_trace is kvgate serve's: an engine does not record (its gateway does)")
        if server.log_stats_interval_s:
            self._status_task = asyncio.get_running_loop().create_task(self._log_status(server.log_stats_interval_s))

    @property
    def recording(self) -> bool:
        return self.recorder is not None

    async def close(self) -> None:
        # The status line first: it refreshes too, and could start a fetch that outlived this.
        if self._status_task is not None:
            self._status_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._status_task
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refreshing
        if self.recorder is not None:
            with contextlib.suppress(OSError, ValueError):
                self.recorder.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.user_share.clear()

    # -- request hooks

    def first_token(self, workload: str, replica: str, ttft_s: float) -> None:
        self.metrics.request_series(workload, replica).ttft.observe(ttft_s)
        self.history.first_token(ttft_s, time.monotonic())

    def answered(self) -> None:
        """A client request answered in full (status 200): the dashboard's and the
        status line's request count, in kvgate_requests_total's unit."""
        self.history.answered()

    def finished(self, done: Finished, record: bool = True) -> None:
        """An engine request ended.  Every one counts in the figures (as on
        /metrics: its replica did the prefill); ``record`` False for an attempt a
        restart elsewhere superseded, as the recording has one line a request."""
        ctx = done.ctx
        # The replica's load counts every engine request; the hit ratio only those whose hits are known.
        self.history.finished(ctx.workload, done.replica, done.prompt_tokens, done.cached_tokens, time.monotonic())
        if done.cached_tokens is not None:
            self.reuse.record(ctx.workload, ctx.type, done.prompt_tokens, done.cached_tokens, self.wall_clock())
            user = user_identity(done.user, ctx.tenant)
            if user is not None:
                self.user_share.record(user, done.cached_tokens, time.monotonic())
        if record:
            self.record_line(done)

    def record_line(self, done: Finished) -> None:
        """The recording's line for an engine request (no figures counted)."""
        if self.recorder is not None:
            ctx, prompt = done.ctx, done.prompt
            # Token ids come back from in-process engines only; remote streams carry text.
            output_keys = generated_keys(prompt.token_ids, prompt.keys, done.generated, self._block_size,
                                         chain_salt(self._salt, done.cache_salt), prompt.mm_hashes) if done.generated else []
            try:
                # The prompt's length as its block ids count it (the gateway's own
                # tokens): an external server's count, by another tokenizer or
                # template, made lines whose ids replay found too many or too few.
                self.recorder.record(ctx, prompt.keys, len(prompt.token_ids), done.completion_tokens, done.arrival,
                                     output_keys)
            except (OSError, ValueError) as exc:
                # A full disk (or a file gone from under it) must not fail requests:
                # stop recording and say so once.
                self._stop_recording(exc)

    def block_identity(self, block_size: int, salt: str | bytes) -> None:
        """The engines' block identity, once a remote one has told it (it may differ
        from what the gateway assumed at start)."""
        self._block_size = block_size
        self._salt = salt
        if self.recorder is not None and self.recorder.block_tokens != block_size:
            try:
                self.recorder.set_block_tokens(block_size)
            except OSError as exc:
                self._stop_recording(exc)
            else:
                log.info("recording block ids per %d tokens from now on", block_size)

    def _stop_recording(self, exc: Exception) -> None:
        recorder, self.recorder = self.recorder, None
        log.error("trace recording to %s failed (%s); recording stopped", recorder.path, exc)
        with contextlib.suppress(OSError, ValueError):
            recorder.close()  # flushing the line that failed may fail again

    async def _log_status(self, interval: float) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
                # The window since the last line, not the interval: a remote
                # engine's stats poll may take seconds, which rates over the
                # interval alone would overstate.
                now = time.monotonic()
                window, last = now - last, now
                line = self.status.line(window, self.history, (
                    (r.name, int(self._inflight(i)), self._engine_stats(r), _state(r)) for i, r in enumerate(self._replicas)
                ), self.metrics.errors_total(), self.metrics.generated_total(), self.metrics.left_total())
            except Exception:  # noqa: BLE001 - a status line must never stop the server
                log.exception("status line failed")
                continue
            if line is not None:
                log.info("%s", line)

    # -- state readers

    def replica_stats(self) -> Iterable[tuple[str, Mapping | None]]:
        for replica in self._replicas:
            yield replica.name, self._engine_stats(replica)

    def _engine_stats(self, replica) -> Mapping | None:
        engine = getattr(replica, "engine", None)
        if engine is not None and replica.kind == "inprocess":
            try:
                stats = engine.stats()
            except Exception:  # noqa: BLE001 - a scrape must not fail over one replica
                log.exception("stats of replica %s failed", replica.name)
                return None
            return stats if isinstance(stats, Mapping) else None
        if not replica.healthy:
            return None  # a replica out of routing has no figures, rather than its last ones forever
        cached = self._remote.get(replica.name)
        return cached[1] if cached else None

    async def refresh(self) -> None:
        """Fetch fresh stats from `kvgate engine` replicas (no-op for the rest).

        One fetch at a time: scrapes that come while it runs (/metrics and /stats
        are open, and a fetch takes up to _REMOTE_TIMEOUT_S) wait for its figures;
        each sent its own, every engine asked once per concurrent scrape."""
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(self._refreshed)
        # A scrape whose client leaves does not cancel the fetch the others wait for.
        await asyncio.shield(self._refreshing)

    def _refreshed(self, task: asyncio.Task) -> None:
        if self._refreshing is task:
            self._refreshing = None

    async def _refresh(self) -> None:
        now = time.monotonic()
        # Not those out of routing, whose figures are not shown: a hung one's took
        # every other scrape its full timeout.
        due = [
            r for r in self._replicas
            if r.kind == "engine" and r.healthy and getattr(r, "base", None)
            and now - self._remote.get(r.name, (-1e9, None))[0] >= _REMOTE_MIN_AGE_S
        ]
        if not due:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_REMOTE_TIMEOUT_S))
        await asyncio.gather(*(self._fetch(r, now) for r in due))

    async def _fetch(self, replica, now: float) -> None:
        headers = replica.auth_headers()  # api_key or api_key_env, as every other call to it
        stats = None
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            async with self._session.get(replica.base + "/kvgate/stats", headers=headers) as resp:
                if resp.status == 200:
                    stats = await resp.json()
        if stats is not None:
            self._remote_ok[replica.name] = now
        elif now - self._remote_ok.get(replica.name, -1e9) < _REMOTE_KEEP_S:
            # One slow answer (a busy engine) keeps the last figures a little, rather
            # than a gap in the series exactly under load; an unreachable engine's go.
            stats = self._remote.get(replica.name, (0.0, None))[1]
        self._remote[replica.name] = (now, stats)

    def stats_json(self) -> dict:
        replicas = [
            replica_entry(r.name, bool(r.healthy), int(self._inflight(i)), self._engine_stats(r), r.absent)
            for i, r in enumerate(self._replicas)
        ]
        return self.history.snapshot(replicas, time.monotonic())

    def _reuse_now(self) -> Mapping[tuple[str, str], float]:
        return self.reuse.last_full_minute(self.wall_clock())

    def _shares_now(self) -> Mapping[float, float]:
        return self.user_share.shares(time.monotonic())


def user_identity(user: str | None, tenant: str | None) -> str | None:
    """Who a request counts for in the user hit share: its `user` field within
    its tenant, else its API-key tenant; None for anonymous traffic (not counted)."""
    if user:
        return f"{tenant or ''}\x00{user}"
    if tenant:
        return f"\x01{tenant}"
    return None


def _state(replica) -> str:
    """A replica as the status line names it: up, or why it is out of routing
    (a rolling restart's draining engine, a hung model step) where that is known."""
    if replica.healthy:
        return "up"
    if replica.absent:
        return "absent"
    if getattr(replica, "draining", False):
        return "draining"
    stalled_for = getattr(replica, "stalled_for", None)
    if stalled_for is not None and stalled_for() > 0:
        return "stalled"
    return "down"
