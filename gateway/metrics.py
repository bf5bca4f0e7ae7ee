"""The gateway's Prometheus series (one registry per app, so tests and several
apps in one process never collide).

Labels are bounded: endpoint, workload, status class, replica name, decision
reason.  Never a user id or prompt.  Gauges that mirror router state are read
at scrape time (``set_function``) so the request path pays nothing for them.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds; TTFT on a CPU engine ranges from milliseconds to tens of seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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

    def render(self) -> bytes:
        return generate_latest(self.registry)
