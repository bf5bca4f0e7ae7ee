"""Eviction policies, chosen by name (``cache.policy`` in config.yaml)."""

from __future__ import annotations

from engine.config import CacheConfig
from engine.policies.base import EvictionPolicy, NoEvictableBlock
from engine.policies.belady import BeladyPolicy
from engine.policies.classic import FIFOPolicy, LRUPolicy, S3FIFOPolicy

__all__ = ["EvictionPolicy", "NoEvictableBlock", "make_policy", "policy_names"]

_CLASSIC = {"lru": LRUPolicy, "fifo": FIFOPolicy, "s3fifo": S3FIFOPolicy, "belady": BeladyPolicy}


def policy_names() -> list[str]:
    return [*_CLASSIC, "wa", "wa-paper"]


def make_policy(
    name: str, capacity: int, cache: CacheConfig | None = None, *, tier: str = "device", **extra: object
) -> EvictionPolicy:
    """Build the policy ``name`` for a tier ("device" or "host") of ``capacity`` blocks.

    ``extra`` carries what only some policies take (Belady's ``future``).
    """
    cache = cache or CacheConfig()
    if name in ("wa", "wa-paper"):
        from engine.policies.workload_aware import make_workload_aware

        return make_workload_aware(name, capacity, cache.workload_aware, tier=tier, **extra)
    cls = _CLASSIC.get(name)
    if cls is None:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(policy_names())}")
    return cls(capacity, config=cache.s3fifo if name == "s3fifo" else None, **extra)
