"""Share of cache hits that the top users account for, in bounded memory.

The blog's long-tail figure (19% of to-C users give 90% of reuse) is watched
with two sketches per time bucket: a frequent-items sketch of hit tokens per
user and a HyperLogLog of users seen.  Buckets slide, so the figure covers the
last ``window_s`` seconds, and memory does not grow with the number of users.
User ids never leave this object (they are never metric labels).
"""

from __future__ import annotations

import math
from collections import deque

import datasketches as ds

DEFAULT_TOPS = (0.01, 0.10, 0.19)


class _Bucket:
    __slots__ = ("start", "hits", "users")

    def __init__(self, start: float, lg_max_items: int) -> None:
        self.start = start
        self.hits = ds.frequent_strings_sketch(lg_max_items)
        self.users = ds.hll_sketch(12)


class UserHitShare:
    def __init__(self, window_s: float = 3600.0, buckets: int = 6, lg_max_items: int = 12,
                 tops: tuple[float, ...] = DEFAULT_TOPS) -> None:
        self.bucket_s = window_s / buckets
        self.max_buckets = buckets
        self.lg_max_items = lg_max_items
        self.tops = tops
        self._buckets: deque[_Bucket] = deque()

    def record(self, user: str, hit_tokens: int, now: float) -> None:
        bucket = self._current(now)
        bucket.users.update(user)
        if hit_tokens > 0:
            bucket.hits.update(user, hit_tokens)

    def shares(self, now: float) -> dict[float, float]:
        """top fraction of users -> fraction of all hit tokens they account for."""
        self._expire(now)
        if not self._buckets:
            return {top: 0.0 for top in self.tops}
        hits = ds.frequent_strings_sketch(self.lg_max_items)
        users = ds.hll_union(12)
        for bucket in self._buckets:
            hits.merge(bucket.hits)
            users.update(bucket.users)
        total = hits.total_weight
        if total <= 0:
            return {top: 0.0 for top in self.tops}
        distinct = max(1, round(users.get_result().get_estimate()))
        items = hits.get_frequent_items(ds.frequent_items_error_type.NO_FALSE_NEGATIVES, 0)
        estimates = sorted((item[1] for item in items), reverse=True)
        result = {}
        for top in self.tops:
            count = max(1, math.ceil(top * distinct))
            result[top] = min(1.0, sum(estimates[:count]) / total)
        return result

    def _current(self, now: float) -> _Bucket:
        self._expire(now)
        if not self._buckets or now - self._buckets[-1].start >= self.bucket_s:
            self._buckets.append(_Bucket(now, self.lg_max_items))
        return self._buckets[-1]

    def _expire(self, now: float) -> None:
        horizon = now - self.bucket_s * self.max_buckets
        while self._buckets and self._buckets[0].start < horizon:
            self._buckets.popleft()
