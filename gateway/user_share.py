"""Share of cache hits that the top users account for, in bounded memory.

The blog's long-tail figure (19% of to-C users give 90% of reuse) is watched
with two sketches per time bucket: a frequent-items (heavy-hitter) sketch of
hit tokens per user and a HyperLogLog of the users seen.  Buckets slide, so
the figure covers the last ``window_s`` seconds, and memory does not grow
with the number of users (about 1 MB per bucket at the default size).

Accuracy: while the window holds fewer users with hits than the sketch
tracks (0.75 * 2**lg_max_items, 12,288 at the default), every user's count
is exact; the number of users is the HyperLogLog's (~1.6% off), so the
shares are exact only when every user had hits (a user without any is in
no sketch but that one).  Beyond that the sketch keeps the heavy hitters
(each count within its error bound; the midpoint of the bounds is used) and
the weight it no longer attributes is spread evenly over the users it does
not track: right for the top 1% of a long tail, an estimate for the 19%.

Users are hashed on the way in: the sketch holds 64-bit digests, never the
ids themselves, and nothing here is ever a metric label.
"""

from __future__ import annotations

import math
from collections import deque

import datasketches as ds
import xxhash

DEFAULT_TOPS = (0.01, 0.10, 0.19)
_HLL_LG_K = 12  # ~1.6% relative error on the number of users


class _Bucket:
    __slots__ = ("start", "hits", "users")

    def __init__(self, start: float, lg_max_items: int) -> None:
        self.start = start
        self.hits = ds.frequent_strings_sketch(lg_max_items)
        self.users = ds.hll_sketch(_HLL_LG_K)


class UserHitShare:
    def __init__(self, window_s: float = 3600.0, buckets: int = 6, lg_max_items: int = 14,
                 tops: tuple[float, ...] = DEFAULT_TOPS) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError("window_s must be positive and buckets >= 1")
        self.bucket_s = window_s / buckets
        self.max_buckets = buckets
        self.lg_max_items = lg_max_items
        self.tops = tops
        self._buckets: deque[_Bucket] = deque()

    def clear(self) -> None:
        """Drop every bucket.  The sketches are C++ objects (nanobind): one still
        alive when the interpreter exits, as the app's reference cycles keep it,
        makes nanobind print hundreds of lines of leak warnings."""
        self._buckets.clear()

    def record(self, user: str, hit_tokens: int, now: float) -> None:
        """One finished request of ``user`` that hit ``hit_tokens`` cached tokens."""
        digest = xxhash.xxh3_64_hexdigest(user.encode("utf-8", "surrogatepass"))
        bucket = self._current(now)
        bucket.users.update(digest)
        if hit_tokens > 0:
            bucket.hits.update(digest, hit_tokens)

    def shares(self, now: float) -> dict[float, float]:
        """top fraction of users -> fraction of all hit tokens in the window they account for."""
        self._expire(now)
        hits = ds.frequent_strings_sketch(self.lg_max_items)
        users = ds.hll_union(_HLL_LG_K)
        for bucket in self._buckets:
            hits.merge(bucket.hits)
            users.update(bucket.users)
        total = hits.total_weight
        if total <= 0:
            return {top: 0.0 for top in self.tops}
        items = hits.get_frequent_items(ds.frequent_items_error_type.NO_FALSE_NEGATIVES, 0)
        # (item, estimate, lower bound, upper bound); exact counts have equal bounds.
        counts = sorted(((low + high) / 2 for _, _, low, high in items), reverse=True)
        tracked = sum(counts)
        distinct = max(len(counts), round(users.get_result().get_estimate()))
        untracked_users = distinct - len(counts)
        residual = max(0.0, total - tracked)
        result = {}
        for top in self.tops:
            k = max(1, math.ceil(top * distinct))
            share = sum(counts[:k])
            if k > len(counts) and untracked_users > 0:
                share += residual * min(1.0, (k - len(counts)) / untracked_users)
            result[top] = min(1.0, share / total)
        return result

    def _current(self, now: float) -> _Bucket:
        self._expire(now)
        if not self._buckets or now - self._buckets[-1].start >= self.bucket_s:
            self._buckets.append(_Bucket(now, self.lg_max_items))
        return self._buckets[-1]

    def _expire(self, now: float) -> None:
        # A bucket leaves once all of it is older than the window.
        horizon = now - self.bucket_s * self.max_buckets
        while self._buckets and self._buckets[0].start + self.bucket_s <= horizon:
            self._buckets.popleft()
