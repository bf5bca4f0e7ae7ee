"""Metadata-only shadow caches: what another policy would hit on the same accesses.

A shadow holds keys only, with the capacity of the real tier, and is fed the
same access and release stream the real policy sees.  It answers "would this
access have been cached?" so the fallback can compare hit ratios at run time.
"""

from __future__ import annotations

from collections import OrderedDict


class ShadowLRU:
    """LRU over keys: an access or a release moves a key to the MRU end.

    Releases come tail first, so after a request its head is most recent,
    as in the pool's LRU.  Unlike the pool it may drop a key that a running
    request still holds; that only matters when nearly the whole tier is in
    use, and keeps the shadow free of per-request bookkeeping.
    """

    __slots__ = ("capacity", "keys")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 1)
        self.keys: OrderedDict[int, None] = OrderedDict()

    def access(self, key: int) -> bool:
        keys = self.keys
        if key in keys:
            keys.move_to_end(key)
            return True
        keys[key] = None
        if len(keys) > self.capacity:
            keys.popitem(last=False)
        return False

    def release(self, key: int) -> None:
        if key in self.keys:
            self.keys.move_to_end(key)

    def __len__(self) -> int:
        return len(self.keys)
