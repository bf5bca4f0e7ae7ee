"""The gateway's Prometheus series (one registry per app, so tests and several
apps in one process never collide).

Labels are bounded: endpoint, workload, type, status, replica name, tier,
state, direction, decision reason, policy name, top fraction.  Never a user id
or prompt.  Units are base units (seconds, bytes, tokens counted in ``_total``
series).

Two kinds of series:
- request series (counters, histograms) updated on the request path, a few
  increments per request (one histogram observation per generated token for
  the inter-token latency);
- state series (engine KV blocks, evictions, swap bytes, policy state, reuse
  ratio, user hit share, replica load) read at scrape time by ``_ScrapeCollector``
  from whatever already holds them, so the request path pays nothing for them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds; TTFT on a CPU engine ranges from milliseconds to tens of seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Gaps between streamed tokens are much shorter than whole-request latencies.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)

# What a replica's engine stats (AsyncEngine.stats(), or the same dict fetched
# from a `kvgate engine` server) look like to the collector; None: no engine
# behind the replica (an external OpenAI server) or no answer yet.
EngineStats = Mapping | None
ReplicaStatsSource = Callable[[], Iterable[tuple[str, EngineStats]]]


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvgate_requests", "Requests served, by endpoint, workload and HTTP status.",
            ["endpoint", "workload", "status"], registry=r,
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds", "Time from request arrival to the first token sent.",
            ["workload"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "kvgate_e2e_request_latency_seconds", "Time from request arrival to its last byte.",
            ["workload"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "kvgate_queue_time_seconds", "Time a request waited in the engine before its first step.",
            ["workload"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "kvgate_inter_token_latency_seconds", "Time between successive tokens of one choice as the gateway receives them.",
            ["workload"], buckets=_ITL_BUCKETS, registry=r,
        )
        self.prefix_queries = Counter(
            "kvgate_prefix_cache_queries_tokens", "Prompt tokens looked up in a replica's prefix cache.",
            ["workload", "replica"], registry=r,
        )
        self.prefix_hits = Counter(
            "kvgate_prefix_cache_hits_tokens", "Prompt tokens served from a replica's prefix cache (engine-reported).",
            ["workload", "replica"], registry=r,
        )
        self.predicted_hits = Counter(
            "kvgate_router_predicted_hit_tokens", "Prompt tokens the router expected to hit when it chose the replica.",
            ["workload", "replica"], registry=r,
        )
        self.decisions = Counter(
            "kvgate_router_decisions", "Routing decisions, by chosen replica and reason.",
            ["replica", "reason"], registry=r,
        )
        self.inflight = Gauge("kvgate_replica_inflight", "Requests in flight on a replica.", ["replica"], registry=r)
        self.healthy = Gauge("kvgate_replica_healthy", "1 if the replica takes traffic.", ["replica"], registry=r)
        self.index_blocks = Gauge(
            "kvgate_router_index_blocks", "Block keys in the router's index of a replica.", ["replica"], registry=r
        )

    def watch_replica(
        self, name: str, inflight: Callable[[], float], healthy: Callable[[], float], index_blocks: Callable[[], float]
    ) -> None:
        self.inflight.labels(name).set_function(inflight)
        self.healthy.labels(name).set_function(healthy)
        self.index_blocks.labels(name).set_function(index_blocks)

    def watch_state(
        self,
        replica_stats: ReplicaStatsSource,
        reuse_ratio: Callable[[], Mapping[tuple[str, str], float]],
        user_hit_share: Callable[[], Mapping[float, float]],
    ) -> None:
        """Read engine, policy, reuse and user-share state at scrape time."""
        self.registry.register(_ScrapeCollector(replica_stats, reuse_ratio, user_hit_share))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def policy_rows(policy_name: str, state: Mapping) -> dict[str, int]:
    """policy label -> 1 for the order that evicts now, 0 for the one standing by.

    The workload-aware policies report ``active`` as "wa" or "lru" (the
    shadow-LRU fallback); both rows are always exported so a switch flips a
    value rather than making a series appear or vanish.  Other policies have
    one order and one row.
    """
    active = state.get("active")
    if active is None:
        return {policy_name: 1}
    fallback = active == "lru"
    return {policy_name: 0 if fallback else 1, "lru": 1 if fallback else 0}


class _ScrapeCollector:
    """State series, built from their sources on each scrape."""

    def __init__(
        self,
        replica_stats: ReplicaStatsSource,
        reuse_ratio: Callable[[], Mapping[tuple[str, str], float]],
        user_hit_share: Callable[[], Mapping[float, float]],
    ) -> None:
        self._replica_stats = replica_stats
        self._reuse_ratio = reuse_ratio
        self._user_hit_share = user_hit_share

    def describe(self) -> list[Metric]:
        # Names only, so registering does not call the sources before the app has started.
        return self._families()

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        blocks, evictions, swap, active, fallbacks, alarm, spike, reuse, share = families
        for name, stats in self._replica_stats():
            if not stats:
                continue
            for tier, counts in (stats.get("blocks") or {}).items():
                for state in ("free", "cached", "in_use"):
                    if state in counts:
                        blocks.add_metric([name, tier, state], counts[state])
            for tier, count in (stats.get("evictions") or {}).items():
                evictions.add_metric([name, tier], count)
            for direction, count in (stats.get("swap_bytes") or {}).items():
                swap.add_metric([name, direction], count)
            if "policy_name" not in stats:
                continue
            state = stats.get("policy") or {}
            for policy, value in policy_rows(stats["policy_name"], state).items():
                active.add_metric([name, policy], value)
            fallbacks.add_metric([name], state.get("fallbacks", 0))
            alarm.add_metric([name], 1.0 if state.get("reuse_alarm") else 0.0)
            spike.add_metric([name], 1.0 if state.get("traffic_spike") else 0.0)
        for (workload, request_type), ratio in sorted(self._reuse_ratio().items()):
            reuse.add_metric([workload, request_type], ratio)
        for top, value in sorted(self._user_hit_share().items()):
            share.add_metric([f"{top:g}"], value)
        return families

    @staticmethod
    def _families() -> list[Metric]:
        return [
            GaugeMetricFamily("kvgate_kv_cache_blocks", "KV cache blocks of a replica's engine, by tier and state.",
                              labels=["replica", "tier", "state"]),
            CounterMetricFamily("kvgate_kv_evictions", "Blocks evicted from a tier (device evictions demote to the host tier when it exists).",
                                labels=["replica", "tier"]),
            CounterMetricFamily("kvgate_kv_swap_bytes", "KV bytes copied between the device and host tiers.",
                                labels=["replica", "direction"]),
            GaugeMetricFamily("kvgate_cache_policy_active", "1 for the eviction order a replica uses now, 0 for the one standing by.",
                              labels=["replica", "policy"]),
            CounterMetricFamily("kvgate_cache_fallbacks", "Switches from the workload-aware order to the shadow-LRU fallback.",
                                labels=["replica"]),
            GaugeMetricFamily("kvgate_reuse_alarm", "1 while the replica's cache hit ratio is under the alarm threshold.",
                              labels=["replica"]),
            GaugeMetricFamily("kvgate_traffic_spike", "1 while the replica sees a to-B traffic spike (lifetime window relaxed).",
                              labels=["replica"]),
            GaugeMetricFamily("kvgate_reuse_ratio", "Cached prompt tokens / prompt tokens over the last full minute (engine-actual).",
                              labels=["workload", "type"]),
            GaugeMetricFamily("kvgate_user_hit_share", "Share of cache-hit tokens from the top fraction of users over a sliding window.",
                              labels=["top"]),
        ]
