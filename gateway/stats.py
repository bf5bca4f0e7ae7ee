"""The JSON behind `GET /stats` and the dashboard: recent history in bounded memory.

Every ``sample_s`` seconds what happened since the last sample is folded into
one history point: hit ratio per workload (engine-reported cached tokens /
prompt tokens), TTFT p50/p99 and engine requests per second per replica.  The
last ``keep`` points are kept (10 minutes of traffic at the defaults).  A snapshot ends
with the period still filling, marked ``partial``, so a fresh gateway shows its
first requests at once instead of after a full period.

Periods with nothing in them make no points of their own; a stretch of a whole
period or more with nothing is marked by two ``idle`` points, where it starts
and where it ends (a snapshot taken during it ends with one at ``now``), so a
chart shows no load there, and no line across it, rather than the last busy
period's figures carried on.  A period during which a snapshot saw requests in
flight is not idle, though none started or ended in it (one long stream): its
point has the replicas' rates and no hit ratio or TTFT of its own.

Schema (the dashboard's ``render()`` reads exactly this)::

    {"now": t, "sample_s": s, "started": wall-clock time (Unix seconds) the gateway started,
     "history": [{"t", "partial", "idle", "hit_ratio": {workload: r}, "ttft_p50", "ttft_p99",
                  "rps": {replica: engine requests/s}}],
     "replicas": [{"name", "healthy", "absent", "inflight",
                   "cache": {tier: {"free", "cached", "in_use"}},
                   "policy": {"name", "active", "fallbacks", "reuse_alarm", "traffic_spike"}}],
     "totals": {"requests", "engine_requests", "prompt_tokens", "cached_tokens", "hit_ratio"}}

``now`` and the history's ``t`` are monotonic seconds (differences only); ``started``
lets the page tell a restart (whose history starts over) from a quiet spell.
``requests`` counts client requests answered in full (kvgate_requests_total's
200s); ``engine_requests`` what the replicas ran for them (a completions
request with three prompts is three), and the token figures those engine
requests whose replica said its cache hits.  ``absent``: a slot of a replica
entry with a count whose host name does not resolve (no such pod now).
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from typing import Mapping

# TTFT samples kept per period for the percentiles; past this, every other one
# is dropped (a uniform thinning), so a burst cannot grow memory.
_MAX_TTFTS = 4096


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def replica_entry(name: str, healthy: bool, inflight: int, engine: Mapping | None, absent: bool = False) -> dict:
    """One replica in the snapshot; ``engine`` is its engine stats dict (None: no engine behind it)."""
    cache: dict[str, dict] = {}
    policy: dict = {}
    if engine:
        for tier, counts in (engine.get("blocks") or {}).items():
            cache[tier] = {k: counts.get(k, 0) for k in ("free", "cached", "in_use")}
        if "policy_name" in engine:
            state = engine.get("policy") or {}
            policy_name = engine["policy_name"]
            # "active" is the order evicting now: the policy itself, or "lru" during a fallback.
            active = state.get("active", policy_name)
            policy = {
                "name": policy_name,
                "active": policy_name if active == "wa" else active,
                "fallbacks": state.get("fallbacks", 0),
                "reuse_alarm": bool(state.get("reuse_alarm", False)),
                "traffic_spike": bool(state.get("traffic_spike", False)),
            }
    return {"name": name, "healthy": healthy, "absent": absent, "inflight": inflight, "cache": cache, "policy": policy}


class StatsHistory:
    def __init__(self, sample_s: float = 5.0, keep: int = 120, started: float = 0.0) -> None:
        self.sample_s = sample_s
        self.started = started
        self.history: deque[dict] = deque(maxlen=keep)
        self._period_start: float | None = None
        self._tokens: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._ttfts: list[float] = []
        self._per_replica: Counter[str] = Counter()
        self._running = False  # a snapshot in this period saw requests in flight
        self.requests = 0  # client requests answered in full (the gateway counts them)
        self.engine_requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def first_token(self, ttft_s: float, now: float) -> None:
        self._active(now)
        ttfts = self._ttfts
        ttfts.append(ttft_s)
        if len(ttfts) >= _MAX_TTFTS:
            del ttfts[::2]

    def answered(self) -> None:
        """A client request answered in full."""
        self.requests += 1

    def finished(
        self, workload: str, replica: str, prompt_tokens: int, cached_tokens: int | None, now: float
    ) -> None:
        """An engine request ended; ``cached_tokens`` None: its replica did not say
        its hits (it still counts as the replica's load, not in the hit ratio)."""
        self._active(now)
        self._per_replica[replica] += 1
        self.engine_requests += 1
        if cached_tokens is None:
            return
        tally = self._tokens[workload]
        tally[0] += prompt_tokens
        tally[1] += cached_tokens
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def snapshot(self, replicas: list[dict], now: float) -> dict:
        running = any(r["inflight"] for r in replicas)
        if running:
            self._running = True  # in the period the roll may close...
        self._roll(now)
        if running:
            self._running = True  # ...and in the one under way
        history = list(self.history)
        if self._busy():
            history.append(self._point(now, partial=True))
        elif history and now - history[-1]["t"] >= self.sample_s:
            # Idle since the last point: say so up to now (not kept; the next snapshot redoes it).
            if not history[-1]["idle"]:
                history.append(_idle(history[-1]["t"] + self.sample_s))
            history.append(_idle(now))
        return {
            "now": now,
            "sample_s": self.sample_s,
            "started": self.started,
            "history": history,
            "replicas": replicas,
            "totals": {
                "requests": self.requests,
                "engine_requests": self.engine_requests,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_ratio": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            },
        }

    def _point(self, end: float, partial: bool) -> dict:
        return {
            "t": end,
            "partial": partial,
            "idle": False,
            "hit_ratio": {w: cached / prompt for w, (prompt, cached) in self._tokens.items() if prompt},
            "ttft_p50": percentile(self._ttfts, 0.50),
            "ttft_p99": percentile(self._ttfts, 0.99),
            "rps": self._rates(end),
        }

    def _rates(self, end: float) -> dict[str, float]:
        """Requests per second per replica over the trailing ``sample_s``.  A
        period still under way fills the rest of that span with the previous
        period's rate (when it ran up to this one): divided by its own short
        span, a request 20 ms in would read as 50 per second."""
        elapsed = end - self._period_start
        if elapsed >= self.sample_s:
            return {name: count / elapsed for name, count in self._per_replica.items()}
        previous: dict[str, float] = {}
        if self.history and self._period_start - self.history[-1]["t"] < self.sample_s:
            previous = self.history[-1]["rps"]
        rest = self.sample_s - max(elapsed, 0.0)
        names = set(self._per_replica) | set(previous)
        return {name: (self._per_replica[name] + previous.get(name, 0.0) * rest) / self.sample_s for name in names}

    def _busy(self) -> bool:
        """Whether the period under way has had anything in it."""
        return bool(self._tokens or self._ttfts or self._per_replica or self._running)

    def _active(self, now: float) -> None:
        """Roll to ``now`` for something that happens now, first marking the
        stretch with nothing since the last point, when it is a period or longer."""
        self._roll(now)
        if not self._busy() and self.history and not self.history[-1]["idle"]:
            last = self.history[-1]["t"]
            if now - last >= self.sample_s:
                self.history.append(_idle(last + self.sample_s))
                self.history.append(_idle(now))

    def _roll(self, now: float) -> None:
        if self._period_start is None:
            self._period_start = now
            return
        if now - self._period_start < self.sample_s:
            return
        if self._busy():
            # Stamped at the period's end, even when the roll comes late (after idle time).
            self.history.append(self._point(min(now, self._period_start + self.sample_s), partial=False))
        self._tokens.clear()
        self._ttfts = []
        self._per_replica.clear()
        self._running = False
        self._period_start = now


def _idle(t: float) -> dict:
    """A history point with nothing in it (see the module notes)."""
    return {"t": t, "partial": False, "idle": True, "hit_ratio": {}, "ttft_p50": None, "ttft_p99": None, "rps": {}}
