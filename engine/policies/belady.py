"""Belady's MIN: evict the block whose next use lies farthest in the future.

Offline only (trace replay): it is handed the whole trace's access schedule.
It gives the upper bound that replay reports next to the online policies.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right

from engine.context import RequestContext
from engine.policies.base import EvictionPolicy, NoEvictableBlock

NEVER = float("inf")


class BeladyPolicy(EvictionPolicy):
    name = "belady"
    offline = True

    def __init__(self, capacity: int = 0, future: dict[int, list[int]] | None = None, **_: object) -> None:
        if future is None:
            raise ValueError("belady needs the trace's future accesses; it runs in `kvgate replay` only")
        # key -> sorted request indices that access it.
        self._future = future
        self._next_use: dict[int, float] = {}
        self._offset: dict[int, int] = {}
        self._heap: list[tuple[float, int, int]] = []  # (-next use, -offset, key), lazily pruned
        self._evictable: set[int] = set()

    def _touch(self, key: int, ctx: RequestContext, offset: int) -> None:
        uses = self._future.get(key, ())
        i = bisect_right(uses, ctx.request_index)
        self._next_use[key] = uses[i] if i < len(uses) else NEVER
        self._offset[key] = offset
        self._evictable.discard(key)

    def insert(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self._touch(key, ctx, offset)

    def hit(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self._touch(key, ctx, offset)

    def release(self, key: int, ctx: RequestContext, now: float) -> None:
        self._evictable.add(key)
        # Among blocks next used by the same request, drop the deeper one: its
        # parent is needed for the child to count as a prefix hit anyway.
        heapq.heappush(self._heap, (-self._next_use[key], -self._offset[key], key))

    def evict(self, now: float) -> int:
        while self._heap:
            neg_next, _, key = heapq.heappop(self._heap)
            if key in self._evictable and self._next_use.get(key) == -neg_next:
                self._evictable.discard(key)
                del self._next_use[key], self._offset[key]
                return key
        raise NoEvictableBlock("every cached block is in use")

    def remove(self, key: int) -> None:
        self._evictable.discard(key)
        self._next_use.pop(key, None)
        self._offset.pop(key, None)

    def num_evictable(self) -> int:
        return len(self._evictable)
