"""Trace replay: drive the engine's own block pool and policies with a trace.

Semantics (README, "Replaying traffic"): requests in timestamp order; a request's hits
are the leading run of its keys already cached; then every key is touched or
inserted; then its blocks are released tail first.  Hit ratio = hit blocks /
prompt blocks.  Recordings of served traffic say what the engine did more
exactly: a trailing partial prompt block is an access that is never cached
(``cacheable``), and the blocks the engine filled with generated tokens
(``output_keys``) are cached after the prompt, as the engine publishes them,
without counting as accesses; a request that lasted (``duration``) holds its blocks
until it ends, and its answer's blocks are cached then.  Nothing here is a second
cache implementation: it is the ``BlockPool`` the engine uses, with no KV tensors
behind it.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

from engine.block_pool import BlockPool, NoFreeBlocks
from engine.config import CacheConfig
from engine.traces import Trace


@dataclass(slots=True)
class ReplayResult:
    policy: str
    capacity_blocks: int
    capacity_fraction: float
    hit_ratio: float
    hits: int
    accesses: int
    evictions: int
    eviction_us_p50: float
    accesses_per_s: float
    host_blocks: int = 0
    # Workload-aware policies: switches to the shadow-LRU fallback during the replay.
    fallbacks: int = 0

    def to_json(self) -> dict:
        data = asdict(self)
        del data["hits"]
        return data


def future_accesses(trace: Trace) -> dict[int, list[int]]:
    """key -> request indices that access it (ascending), for Belady."""
    future: dict[int, list[int]] = {}
    for index, request in enumerate(trace.requests):
        for key in request.keys:
            uses = future.setdefault(key, [])
            if not uses or uses[-1] != index:
                uses.append(index)
    return future


class _EvictionTimer:
    """Times one eviction in ``every``: cheap enough to leave on in replay."""

    def __init__(self, evict: Callable[[float], int], every: int = 8) -> None:
        self._evict = evict
        self._every = every
        self._count = 0
        self.samples_ns: list[int] = []

    def __call__(self, now: float) -> int:
        self._count += 1
        if self._count % self._every:
            return self._evict(now)
        start = time.perf_counter_ns()
        key = self._evict(now)
        self.samples_ns.append(time.perf_counter_ns() - start)
        return key

    def median_us(self) -> float:
        if not self.samples_ns:
            return 0.0
        ordered = sorted(self.samples_ns)
        return ordered[len(ordered) // 2] / 1000.0


def _insert_outputs(pool: BlockPool, keys: list[int], ctx, first_offset: int, now: float) -> list[int]:
    """Blocks the engine filled with generated tokens (recorded traces only).

    The engine publishes them as they fill, so a later turn that resends the
    answer can hit them; replay caches them the same way, after the prompt,
    without counting them as accesses.  A key already cached stays as it is
    (the engine keeps its duplicate private and frees it).
    """
    blocks: list[int] = []
    for i, key in enumerate(keys):
        if key in pool.cached:
            continue
        try:
            block = pool.allocate(1, now)[0]
        except NoFreeBlocks:
            break
        pool.cache_block(block, key, ctx, first_offset + i, now)
        blocks.append(block)
    return blocks


def replay_request(pool: BlockPool, request, held: "HeldRequests | None" = None) -> int:
    """One trace request through ``pool`` as the engine serves it; its hit blocks.

    The prompt's cacheable blocks are looked up or inserted (a recording's
    trailing partial block is never cached), the answer's blocks (recordings
    only) cached after them, and all released tail first.  A recording's last
    prompt block is never a hit, as in the engine.  With ``held``, a request
    that lasted (a recording's ``duration``) keeps its blocks until it ends,
    and its answer's blocks are cached then.
    """
    ctx = request.context
    now = request.timestamp
    keys = request.cacheable_keys()
    blocks, hit = pool.touch_or_insert(keys, ctx, now)
    if held is not None and request.duration > 0:
        held.hold(request, blocks, len(keys))
    else:
        _end(pool, request, blocks, len(keys), now)
    return request.served_hits(hit)


def _end(pool: BlockPool, request, blocks: list[int], first_output: int, now: float) -> None:
    if request.output_keys:
        blocks += _insert_outputs(pool, request.output_keys, request.context, first_output, now)
    blocks.reverse()
    pool.release(blocks, request.context, now)


class HeldRequests:
    """Requests that have started and not yet ended, each holding its blocks.

    The engine holds a request's blocks from its start to its end, and its
    policy sees them released then: a policy that scores blocks by their age
    (wa's lifetime window) read a recording of requests lasting seconds as
    older than they were when replay released them at arrival (wa 5 points under
    what the engine served, on a SmolLM2 soak; README, "Record -> replay -> tune").
    Ends are played in time order, between the arrivals they fall between."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._ends: list[tuple[float, int, object, list[int], int]] = []
        self._count = 0

    def hold(self, request, blocks: list[int], first_output: int) -> None:
        self._count += 1
        heapq.heappush(self._ends, (request.timestamp + request.duration, self._count, request, blocks, first_output))

    def end_until(self, now: float) -> None:
        """End every request that ended by ``now`` (math.inf: all)."""
        while self._ends and self._ends[0][0] <= now:
            end, _, request, blocks, first_output = heapq.heappop(self._ends)
            _end(self._pool, request, blocks, first_output, end)


def pool_sizes(device_blocks: int, host_blocks: int, unique_blocks: int) -> tuple[int, int]:
    """The tiers a replay allocates: never more than the trace's distinct blocks,
    which such a tier holds without one eviction, so a larger one changes no
    figure, only memory (100M blocks is ~7 GiB of bookkeeping up front)."""
    return min(device_blocks, max(1, unique_blocks)), min(host_blocks, unique_blocks)


def replay(
    trace: Trace,
    policy: str,
    capacity_blocks: int,
    cache_config: CacheConfig | None = None,
    *,
    host_blocks: int = 0,
    unique_blocks: int | None = None,
    progress: Callable[[int], None] | None = None,
    future: dict[int, list[int]] | None = None,
) -> ReplayResult:
    """Replay ``trace`` through one pool; ``progress(n)`` is told of each n requests done.
    ``unique_blocks``, when given, is the trace's own count (Trace.unique_blocks)."""
    kwargs = {}
    if policy == "belady":
        kwargs["future"] = future if future is not None else future_accesses(trace)
    unique = unique_blocks if unique_blocks is not None else trace.unique_blocks()
    pool = BlockPool(*pool_sizes(capacity_blocks, host_blocks, unique), policy, cache_config, policy_kwargs=kwargs)
    timer = _EvictionTimer(pool.device_policy.evict)
    pool.device_policy.evict = timer  # type: ignore[method-assign]
    hits = accesses = 0
    step = 1000
    start = time.perf_counter()
    held = HeldRequests(pool)
    for index, request in enumerate(trace.requests):
        held.end_until(request.timestamp)
        hits += replay_request(pool, request, held)
        accesses += len(request.keys)
        if progress is not None and index % step == step - 1:
            progress(step)
    held.end_until(math.inf)
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress(len(trace.requests) % step)
    return ReplayResult(
        policy=policy,
        capacity_blocks=capacity_blocks,
        capacity_fraction=capacity_blocks / unique if unique else 0.0,
        hit_ratio=hits / accesses if accesses else 0.0,
        hits=hits,
        accesses=accesses,
        evictions=pool.stats.device_evictions,
        eviction_us_p50=timer.median_us(),
        accesses_per_s=accesses / elapsed if elapsed > 0 else 0.0,
        host_blocks=host_blocks,
        fallbacks=int(pool.device_policy.state().get("fallbacks", 0)),
    )
