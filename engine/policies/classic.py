"""Classic eviction orders: vLLM's LRU, FIFO and S3-FIFO."""

from __future__ import annotations

import heapq
from collections import OrderedDict

from engine.config import S3FifoConfig
from engine.context import RequestContext
from engine.policies.base import EvictionPolicy, NoEvictableBlock


class LRUPolicy(EvictionPolicy):
    """vLLM v1's free-block queue: released blocks join the tail, victims leave the head.

    A request's blocks are released tail first, so its tail is evicted before
    its head.  In-use blocks are simply absent from the queue.
    """

    name = "lru"

    def __init__(self, capacity: int = 0, **_: object) -> None:
        self._free: OrderedDict[int, None] = OrderedDict()

    def insert(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        pass

    def hit(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self._free.pop(key, None)

    def release(self, key: int, ctx: RequestContext, now: float) -> None:
        self._free[key] = None

    def evict(self, now: float) -> int:
        if not self._free:
            raise NoEvictableBlock("every cached block is in use")
        return self._free.popitem(last=False)[0]

    def remove(self, key: int) -> None:
        self._free.pop(key, None)

    def num_evictable(self) -> int:
        return len(self._free)

    def order(self) -> list[int]:
        """Evictable keys, next victim first (for tests and debugging)."""
        return list(self._free)


class FIFOPolicy(EvictionPolicy):
    """Evict the block cached longest ago; hits do not change the order."""

    name = "fifo"

    def __init__(self, capacity: int = 0, **_: object) -> None:
        self._seq = 0
        self._inserted: dict[int, int] = {}  # key -> insertion sequence
        # (sequence, key) of released keys, lazily pruned: at most one entry per key
        # in ``_queued`` (a key in use stays queued, so a hot key's hits and releases
        # add none), plus entries of keys removed since, dropped as they come up.
        self._heap: list[tuple[int, int]] = []
        self._queued: set[int] = set()
        self._evictable: set[int] = set()

    def insert(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self._seq += 1
        self._inserted[key] = self._seq

    def hit(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self._evictable.discard(key)

    def release(self, key: int, ctx: RequestContext, now: float) -> None:
        self._evictable.add(key)
        if key not in self._queued:
            self._queued.add(key)
            heapq.heappush(self._heap, (self._inserted[key], key))

    def evict(self, now: float) -> int:
        while self._heap:
            seq, key = heapq.heappop(self._heap)
            if self._inserted.get(key) != seq:
                continue  # a removed key's (it may be cached again, under a newer entry)
            self._queued.discard(key)
            if key in self._evictable:  # else in use: queued again when released
                self._evictable.discard(key)
                del self._inserted[key]
                return key
        raise NoEvictableBlock("every cached block is in use")

    def remove(self, key: int) -> None:
        self._evictable.discard(key)
        self._queued.discard(key)
        self._inserted.pop(key, None)
        if len(self._heap) > 2 * len(self._queued) + 64:
            # Removed keys' entries leave only as evictions reach them: a host tier
            # never full, its blocks promoted and demoted again and again, added one
            # a demotion for good.  Rebuilt from the live ones, amortised O(1) a removal.
            inserted = self._inserted
            self._heap = [(seq, key) for seq, key in self._heap if inserted.get(key) == seq]
            heapq.heapify(self._heap)

    def num_evictable(self) -> int:
        return len(self._evictable)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23) as libCacheSim's S3FIFO.c runs it.

    A small FIFO (10% of capacity) filters one-hit wonders: a key read at
    least ``move_to_main_threshold`` times while there moves to the main FIFO,
    the rest go to a ghost FIFO (keys only, 90% of capacity).  A miss found in
    the ghost is admitted straight to main.  Main is a CLOCK with a 2-bit
    counter.  Until the first eviction, a full small queue admits to main.
    A key that is in use when a scan reaches it is passed over as if read.
    """

    name = "s3fifo"

    def __init__(self, capacity: int, config: S3FifoConfig | None = None, **_: object) -> None:
        cfg = config or S3FifoConfig()
        self._small_size = int(capacity * cfg.small_size_ratio)
        self._main_size = capacity - self._small_size
        self._ghost_size = int(capacity * cfg.ghost_size_ratio)
        self._threshold = cfg.move_to_main_threshold
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._in_use: set[int] = set()
        self._has_evicted = False

    def insert(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        elif not self._has_evicted and len(self._small) >= self._small_size:
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0
        self._in_use.add(key)

    def hit(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self._freq[key] += 1
        self._in_use.add(key)

    def release(self, key: int, ctx: RequestContext, now: float) -> None:
        self._in_use.discard(key)

    def num_evictable(self) -> int:
        return len(self._freq) - len(self._in_use)

    def evict(self, now: float) -> int:
        if self.num_evictable() <= 0:
            raise NoEvictableBlock("every cached block is in use")
        self._has_evicted = True
        # Main keys passed over in a row because a request holds them.  Once
        # a whole lap of main is in use, main cannot shrink however far over
        # its share it is, so the victim must come from small; without this
        # the CLOCK spins forever while small holds the only evictable key.
        in_use_run = 0
        while True:
            main_can_shrink = in_use_run < len(self._main)
            if not self._small or (len(self._main) > self._main_size and main_can_shrink):
                key = next(iter(self._main))
                victim = self._evict_main()
                in_use_run = in_use_run + 1 if key in self._in_use else 0
            else:
                victim = self._evict_small()
            if victim is not None:
                return victim

    def _evict_small(self) -> int | None:
        key, _ = self._small.popitem(last=False)
        if key in self._in_use or self._freq[key] >= self._threshold:
            self._main[key] = None
            self._freq[key] = 0
            return None
        del self._freq[key]
        if self._ghost_size > 0:
            self._ghost[key] = None
            if len(self._ghost) > self._ghost_size:
                self._ghost.popitem(last=False)
        return key

    def _evict_main(self) -> int | None:
        key, _ = self._main.popitem(last=False)
        if key in self._in_use:
            self._main[key] = None
            return None
        freq = self._freq[key]
        if freq >= 1:
            self._main[key] = None
            self._freq[key] = min(freq, 3) - 1
            return None
        del self._freq[key]
        return key

    def remove(self, key: int) -> None:
        self._small.pop(key, None)
        self._main.pop(key, None)
        self._freq.pop(key, None)
        self._in_use.discard(key)
