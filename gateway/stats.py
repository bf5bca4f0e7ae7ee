"""The JSON behind `GET /stats` and the dashboard: recent history in bounded memory.

Every ``sample_s`` seconds the requests finished since the last sample are
folded into one history point (hit ratio per workload, TTFT p50/p99); the
last ``keep`` points are kept (10 minutes at the defaults).
"""

from __future__ import annotations

from collections import defaultdict, deque


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class StatsHistory:
    def __init__(self, sample_s: float = 5.0, keep: int = 120) -> None:
        self.sample_s = sample_s
        self.history: deque[dict] = deque(maxlen=keep)
        self._period_start: float | None = None
        self._tokens: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._ttfts: list[float] = []
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def record(self, workload: str, prompt_tokens: int, cached_tokens: int, ttft_s: float | None, now: float) -> None:
        self._roll(now)
        tally = self._tokens[workload]
        tally[0] += prompt_tokens
        tally[1] += cached_tokens
        if ttft_s is not None:
            self._ttfts.append(ttft_s)
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def snapshot(self, replicas: list[dict], now: float) -> dict:
        self._roll(now)
        return {
            "now": now,
            "history": list(self.history),
            "replicas": replicas,
            "totals": {
                "requests": self.requests,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_ratio": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            },
        }

    def _roll(self, now: float) -> None:
        if self._period_start is None:
            self._period_start = now
            return
        if now - self._period_start < self.sample_s:
            return
        if self._tokens or self._ttfts:
            self.history.append({
                "t": now,
                "hit_ratio": {w: cached / prompt for w, (prompt, cached) in self._tokens.items() if prompt},
                "ttft_p50": percentile(self._ttfts, 0.50),
                "ttft_p99": percentile(self._ttfts, 0.99),
            })
        self._tokens.clear()
        self._ttfts = []
        self._period_start = now
