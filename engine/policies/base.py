"""The eviction policy contract.

A policy orders the cached blocks of one tier; the block pool owns everything
else (reference counts, the hash table, tiers, copies).  Policies see block
*keys* (the chained block hashes), never physical block ids, so the same
policy code serves the engine, trace replay and metadata-only shadows.

Lifecycle of a key, as the pool drives it:

    insert(key, ctx, offset, now)   newly cached; in use until released
    hit(key, ctx, offset, now)      reused by a request; in use until released
    release(key, ctx, now)          no request holds it: it may now be evicted
    evict(now) -> key               choose an evictable key and forget it
    remove(key)                     forget a key the pool dropped itself

``offset`` is the block's index in the prompt of the request touching it
(0 = head).  A request's blocks are released tail first, as vLLM does.
``evict`` must never return a key that is in use (inserted or hit and not
yet released); it raises ``NoEvictableBlock`` when there is none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from engine.context import RequestContext


class NoEvictableBlock(RuntimeError):
    """Every cached block of the tier is in use."""


class EvictionPolicy(ABC):
    name: ClassVar[str]
    # Belady needs the whole future; the engine refuses such policies.
    offline: ClassVar[bool] = False

    @abstractmethod
    def insert(self, key: int, ctx: RequestContext, offset: int, now: float) -> None: ...

    @abstractmethod
    def hit(self, key: int, ctx: RequestContext, offset: int, now: float) -> None: ...

    @abstractmethod
    def release(self, key: int, ctx: RequestContext, now: float) -> None: ...

    @abstractmethod
    def evict(self, now: float) -> int: ...

    @abstractmethod
    def remove(self, key: int) -> None: ...

    @abstractmethod
    def num_evictable(self) -> int: ...

    def state(self, now: float | None = None) -> dict:
        """Run-time state for metrics (active sub-policy, alarms); empty by default.
        ``now``: the policy clock's time, for figures that go stale while idle."""
        return {}
