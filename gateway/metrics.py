"""The gateway's Prometheus series (one registry per app, so tests and several
apps in one process never collide).

Labels are bounded: endpoint, workload, type, status, replica name, tier,
state, direction, decision reason, policy name, top fraction.  Never a user id
or prompt.  Units are base units (seconds, bytes, tokens counted in ``_total``
series).

Two kinds of series:
- request series (counters, histograms) updated on the request path, a few
  increments per request (one histogram observation per generated token for
  the inter-token latency).  They are ``LoopCounter``/``LoopHistogram``: plain
  numbers updated on the event loop thread and exported by a collector, because
  prometheus_client's own Counter/Histogram validate labels on every
  ``labels()`` and take a lock per increment and per histogram bucket: ~25 lock
  round trips and 9 label lookups per streamed request, the largest single
  cost of the gateway's hot path in bench/gateway.py's profile;
- state series (engine KV blocks, evictions, swap bytes, policy state, reuse
  ratio, user hit share, replica load) read at scrape time by ``_ScrapeCollector``
  from whatever already holds them, so the request path pays nothing for them.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from engine.context import WORKLOADS
from gateway.protocol import CHAT, COMPLETIONS
from gateway.responses_api import RESPONSES
from gateway.router import DECISION_REASONS
from gateway.version import kvgate_version

# Seconds; TTFT on a CPU engine ranges from milliseconds to tens of seconds, and
# a long stream may run for minutes (replicas' read_timeout_s is 300 s).  Finer
# from 0.5 to 10 s, where GPU serving's TTFT objectives sit (vLLM's 0.75 and 7.5 too).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 4.0, 5.0, 7.5, 10.0,
                    30.0, 60.0, 120.0, 300.0, 600.0)
# kvgate_requests_total statuses exported from zero for every endpoint and
# workload: success, bad request, rate limited, failed, unavailable.
_COMMON_STATUSES = ("200", "400", "429", "499", "500", "502", "503")
# Gaps between streamed tokens are much shorter than whole-request latencies.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
# An idle engine's queue is well under a millisecond: from 5 ms up, a p50 of
# 0.2 ms waits read as ~2.5 ms (histogram_quantile interpolates within a bucket).
_QUEUE_BUCKETS = (0.0005, 0.001, 0.0025) + _LATENCY_BUCKETS

# What a replica's engine stats (AsyncEngine.stats(), or the same dict fetched
# from a `kvgate engine` server) look like to the collector; None: no engine
# behind the replica (an external OpenAI server) or no answer yet.
EngineStats = Mapping | None
ReplicaStatsSource = Callable[[], Iterable[tuple[str, EngineStats]]]


class RequestSeries(NamedTuple):
    """The children one engine request updates, looked up once per (workload, replica)."""

    itl: "_HistogramChild"
    queue_time: "_HistogramChild"
    prefix_queries: "_CounterChild"
    prefix_hits: "_CounterChild"
    predicted_hits: "_CounterChild"
    prompt_tokens: "_CounterChild"
    generation_tokens: "_CounterChild"
    ttft: "_HistogramChild"
    e2e: "_HistogramChild"


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, role: str = "gateway") -> None:
        self._request_series: dict[tuple[str, str], RequestSeries] = {}
        self.registry = r = CollectorRegistry(auto_describe=True)
        # Memory, CPU, open files and GC of this process, as every Python exporter has them.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        # Which process this is: dashboards tell a gateway from a `kvgate engine` by role.
        info = Gauge("kvgate_build_info", "Always 1: kvgate's version and this process's role (gateway or engine).",
                     ["version", "role"], registry=r)
        info.labels(kvgate_version(), role).set(1)
        # A `kvgate engine` routes to itself alone: its routing and replica series
        # would say nothing; they are the gateways' to export, a series per replica.
        routing = r if role == "gateway" else None
        self.requests = LoopCounter(
            "kvgate_requests", "Requests served, by endpoint, workload and HTTP status.",
            ["endpoint", "workload", "status"], registry=r,
        )
        # Exported from zero, so that rate() and alerts see the first error of a
        # kind (a series born at 1 shows no increase); rarer statuses appear as they come.
        for endpoint in (CHAT, COMPLETIONS, RESPONSES):
            for workload in (*WORKLOADS, "unknown"):
                for status in _COMMON_STATUSES:
                    self.requests.labels(endpoint, workload, status)
        self.http_refused = LoopCounter(
            "kvgate_http_refused", "Requests answered before any endpoint's handler, so in no kvgate_requests_total "
            "series: HTTP that does not parse (400), br or zstd without their decoder packages (415), headers "
            "slower than limits.header_timeout_s (408), a path no endpoint serves (404) or a method it does not take "
            "(405), and an Expect: 100-continue refused before the body (401, 404, 405, 413, 417).",
            ["status"], registry=r,
        )
        for status in ("400", "404", "405", "408"):
            self.http_refused.labels(status)  # from zero, as the request counts
        self.ttft = LoopHistogram(
            "kvgate_time_to_first_token_seconds", "Time from request arrival until the gateway has the first "
            "generated tokens from the replica (a stream sends them then; a non-streaming response waits for the "
            "whole answer), by the replica that sent them.",
            ["workload", "replica"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = LoopHistogram(
            "kvgate_e2e_request_latency_seconds", "Time from arrival to the last byte of successful (HTTP 200) requests, "
            "by the replica that served the request's (first) prompt.",
            ["workload", "replica"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = LoopHistogram(
            "kvgate_queue_time_seconds", "Time an engine request waited before its first step (one per request, "
            "whatever its n).",
            ["workload", "replica"], buckets=_QUEUE_BUCKETS, registry=r,
        )
        self.itl = LoopHistogram(
            "kvgate_inter_token_latency_seconds", "Time between successive deltas of one choice as the gateway receives them (tokens that arrive together are one delta).",
            ["workload", "replica"], buckets=_ITL_BUCKETS, registry=r,
        )
        # (The latency histograms are by replica, which finds a slow one; from zero,
        # as the request counts above: watch_replica.)
        self.prefix_queries = LoopCounter(
            "kvgate_prefix_cache_queries_tokens", "Prompt tokens looked up in a replica's prefix cache.",
            ["workload", "replica"], registry=r,
        )
        self.prefix_hits = LoopCounter(
            "kvgate_prefix_cache_hits_tokens", "Prompt tokens served from a replica's prefix cache (engine-reported).",
            ["workload", "replica"], registry=r,
        )
        self.predicted_hits = LoopCounter(
            "kvgate_router_predicted_hit_tokens", "Prompt tokens the router expected to hit when it chose the replica.",
            ["workload", "replica"], registry=routing,
        )
        self.prompt_tokens = LoopCounter(
            "kvgate_prompt_tokens", "Prompt tokens of engine requests the replica prefilled, also those cut short "
            "(client gone, error), counted once prefilled, as vLLM's prompt_tokens_total.",
            ["workload", "replica"], registry=r,
        )
        self.generation_tokens = LoopCounter(
            "kvgate_generation_tokens", "Tokens generated for engine requests, all choices, also those cut short "
            "(client gone, error), counted as they arrive, as vLLM's generation_tokens_total.",
            ["workload", "replica"], registry=r,
        )
        self.decisions = LoopCounter(
            "kvgate_router_decisions", "Routing decisions, by chosen replica and reason.",
            ["replica", "reason"], registry=routing,
        )
        self.replica_failures = LoopCounter(
            "kvgate_replica_failures", "Requests a replica failed (refused, cut, timed out, 5xx), by when: "
            "before_first_token ones were tried on another replica; mid_stream ones, after its first output, ended "
            "with an error event when streamed and were tried on another replica when not (what clients got is in "
            "kvgate_requests_total).  A replica shutting down is no failure.",
            ["replica", "stage"], registry=routing,
        )
        self.lost_requests = LoopCounter(
            "kvgate_requests_lost", "Requests whose replicas' connections broke while they ran them "
            "(router.lost_attempts in a row): failed, not tried on another; and requests refused because their "
            "prompt was lost that way (router.lost_quarantine_s): a prompt that may bring replicas down.",
            ["outcome"], registry=routing,
        )
        for outcome in ("failed", "refused"):
            self.lost_requests.labels(outcome)  # from zero: an alert sees the first one
        self.inflight = Gauge("kvgate_replica_inflight", "Requests in flight on a replica.", ["replica"], registry=routing)
        self.healthy = Gauge("kvgate_replica_healthy", "1 if the replica takes traffic.", ["replica"], registry=routing)
        self.absent = Gauge("kvgate_replica_absent", "1 if the replica is a slot of a replica entry with a count "
                            "whose host name does not resolve (no such server now): out of routing, not down.",
                            ["replica"], registry=routing)
        self.index_blocks = Gauge(
            "kvgate_router_index_blocks", "Block keys in the router's index of a replica.", ["replica"], registry=routing
        )
        self.external_load = Gauge(
            "kvgate_router_external_load_tokens", "Load a replica reported that this gateway did not send (other "
            "gateways' requests on a shared engine, an external server's queue), in the router's tokens.",
            ["replica"], registry=routing,
        )

    def request_series(self, workload: str, replica: str) -> RequestSeries:
        series = self._request_series.get((workload, replica))
        if series is None:
            series = self._request_series[(workload, replica)] = RequestSeries(
                self.itl.labels(workload, replica), self.queue_time.labels(workload, replica),
                self.prefix_queries.labels(workload, replica), self.prefix_hits.labels(workload, replica),
                self.predicted_hits.labels(workload, replica), self.prompt_tokens.labels(workload, replica),
                self.generation_tokens.labels(workload, replica),
                self.ttft.labels(workload, replica), self.e2e.labels(workload, replica),
            )
        return series

    def errors_total(self) -> tuple[int, int, int]:
        """Responses other than 200 since start, for the status line: refused
        (4xx but 429), over limits (429) and failed (5xx).  A 499, a client that
        left before its answer, is no error of the server's."""
        return (self._answered_with(lambda status: status[0] == "4" and status not in ("429", "499")),
                self._answered_with(lambda status: status == "429"),
                self._answered_with(lambda status: status[0] == "5"))

    def left_total(self) -> int:
        """Requests whose client went away before their end (499) since start."""
        return self._answered_with(lambda status: status == "499")

    def _answered_with(self, status_matches: Callable[[str], bool]) -> int:
        return int(sum(child.value for values, child in self.requests._exported() if status_matches(values[2])))

    def refused(self, status: int) -> None:
        """One request answered before any endpoint's handler (kvgate_http_refused_total)."""
        self.http_refused.labels(str(status)).inc()

    def generated_total(self) -> int:
        """Tokens generated since start, all replicas (the status line's generation rate)."""
        return int(sum(child.value for _, child in self.generation_tokens._exported()))

    def watch_replica(
        self, name: str, inflight: Callable[[], float], healthy: Callable[[], float], index_blocks: Callable[[], float],
        external_load: Callable[[], float], absent: Callable[[], float],
    ) -> None:
        self.inflight.labels(name).set_function(inflight)
        self.healthy.labels(name).set_function(healthy)
        self.absent.labels(name).set_function(absent)
        self.index_blocks.labels(name).set_function(index_blocks)
        self.external_load.labels(name).set_function(external_load)
        for stage in ("before_first_token", "mid_stream"):
            self.replica_failures.labels(name, stage)  # exported from zero, so rate() sees the first one
        for reason in DECISION_REASONS:
            self.decisions.labels(name, reason)  # the first safety-valve ("imbalance") decision, say
        for workload in WORKLOADS:
            self.request_series(workload, name)  # its token counters and latency histograms, likewise

    def watch_state(
        self,
        replica_stats: ReplicaStatsSource,
        reuse_ratio: Callable[[], Mapping[tuple[str, str], float]],
        user_hit_share: Callable[[], Mapping[float, float]],
    ) -> None:
        """Read engine, policy, reuse and user-share state at scrape time."""
        self.registry.register(_ScrapeCollector(replica_stats, reuse_ratio, user_hit_share))

    def watch_chat_tokens(self, stats: Callable[[], Mapping]) -> None:
        """Read the chat tokenizer's piece cache (engine/chat_tokens.py) at scrape time."""
        self.registry.register(_ChatTokensCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CounterChild:
    # No creation time: a `_created` series per counter doubles the page for
    # nothing a dashboard reads (vLLM turns them off too).
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # upper bounds, +Inf last
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Bucket i holds values in (bounds[i-1], bounds[i]]: Prometheus' "le".
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _LoopSeries:
    """A labelled series updated on the event loop thread only, exported by ``collect``.

    No locks: every update happens on the loop (the engine thread reports
    through the loop), so plain float additions are safe.  ``labels`` is a dict
    lookup after the first call for a label set.
    """

    family: type

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry=None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple, object] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str):
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            exported = tuple(str(v) for v in values)
            child = self._children.get(exported) or self._child()
            # Under both tuples, so that labels(200) and labels("200") are one series.
            self._children[exported] = self._children[values] = child
        return child

    def _child(self):
        raise NotImplementedError

    def _exported(self):
        """(label values as strings, child) once per series."""
        for values, child in list(self._children.items()):
            if all(type(v) is str for v in values):
                yield values, child

    def describe(self) -> list[Metric]:
        return [self.family(self.name, self.documentation, labels=self.labelnames)]


class LoopCounter(_LoopSeries):
    family = CounterMetricFamily

    def _child(self) -> _CounterChild:
        return _CounterChild()

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._exported():
            family.add_metric(values, child.value)
        return [family]


class LoopHistogram(_LoopSeries):
    family = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry=None) -> None:
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(bounds):
            raise ValueError("histogram buckets must be sorted")
        self.bounds = bounds if bounds and bounds[-1] == float("inf") else bounds + (float("inf"),)
        self._le = [floatToGoString(b) for b in self.bounds]
        super().__init__(name, documentation, labelnames, registry)

    def _child(self) -> _HistogramChild:
        return _HistogramChild(self.bounds)

    def collect(self) -> list[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._exported():
            running, buckets = 0, []
            for le, count in zip(self._le, child.counts):
                running += count
                buckets.append((le, running))
            family.add_metric(values, buckets, child.sum)
        return [family]


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


class _ChatTokensCollector:
    def __init__(self, stats: Callable[[], Mapping]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        stats = self._stats()
        family.add_metric(["hit"], stats["hit_tokens"])
        family.add_metric(["miss"], stats["miss_tokens"])
        return [family]

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "kvgate_chat_tokenize_cache_tokens",
            "Chat prompt tokens taken from the tokenizer's piece cache (hit) or tokenised (miss).",
            labels=["result"],
        )


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
        (blocks, usage, evictions, swap, moves, preemptions, active, fallbacks, alarm, spike, window, categories,
         reuse, share, queue) = families
        for name, stats in self._replica_stats():
            if not stats:
                continue
            for state in ("running", "waiting"):
                if state in stats:
                    queue.add_metric([name, state], stats[state])
            if "preemptions" in stats:
                preemptions.add_metric([name], stats["preemptions"])
            for tier, counts in (stats.get("blocks") or {}).items():
                for state in ("free", "cached", "in_use"):
                    if state in counts:
                        blocks.add_metric([name, tier, state], counts[state])
                if counts.get("total") and tier == "device":
                    # As vLLM's kv_cache_usage_perc: blocks held by requests; cached
                    # idle blocks can be evicted at once, so they count as free.
                    usage.add_metric([name], counts.get("in_use", 0) / counts["total"])
            for tier, count in (stats.get("evictions") or {}).items():
                evictions.add_metric([name, tier], count)
            for direction, count in (stats.get("swap_bytes") or {}).items():
                swap.add_metric([name, direction], count)
            if "demotions" in stats:
                moves.add_metric([name, "device_to_host"], stats["demotions"])
                moves.add_metric([name, "host_to_device"], stats.get("promotions", 0))
            if "policy_name" not in stats:
                continue
            state = stats.get("policy") or {}
            for policy, value in policy_rows(stats["policy_name"], state).items():
                active.add_metric([name, policy], value)
            fallbacks.add_metric([name], state.get("fallbacks", 0))
            alarm.add_metric([name], 1.0 if state.get("reuse_alarm") else 0.0)
            spike.add_metric([name], 1.0 if state.get("traffic_spike") else 0.0)
            # What the fallback compares: the policy's and the shadow LRU's hit ratio.
            for order, key in (("policy", "window_hit_ratio"), ("shadow_lru", "shadow_lru_hit_ratio")):
                if state.get(key) is not None:
                    window.add_metric([name, order], state[key])
            if "categories" in state:
                categories.add_metric([name], state["categories"])
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
            GaugeMetricFamily("kvgate_kv_cache_usage_ratio", "Share of a replica's device KV blocks held by requests, "
                              "0-1 (vLLM's kv_cache_usage_perc; idle cached blocks count as free).",
                              labels=["replica"]),
            CounterMetricFamily("kvgate_kv_evictions", "Blocks evicted from a tier (device evictions demote to the host tier when it exists).",
                                labels=["replica", "tier"]),
            CounterMetricFamily("kvgate_kv_swap_bytes", "KV bytes copied between the device and host tiers.",
                                labels=["replica", "direction"]),
            CounterMetricFamily("kvgate_kv_block_moves", "KV blocks moved between tiers: demoted on eviction "
                                "(device_to_host) or promoted on a hit in the host tier (host_to_device).",
                                labels=["replica", "direction"]),
            CounterMetricFamily("kvgate_engine_preemptions", "Running requests a replica's engine preempted for KV "
                                "blocks (recomputed later), as vLLM's num_preemptions.", labels=["replica"]),
            GaugeMetricFamily("kvgate_cache_policy_active", "1 for the eviction order a replica uses now, 0 for the one standing by.",
                              labels=["replica", "policy"]),
            CounterMetricFamily("kvgate_cache_fallbacks", "Switches from the workload-aware order to the shadow-LRU fallback.",
                                labels=["replica"]),
            GaugeMetricFamily("kvgate_reuse_alarm", "1 while the replica's cache hit ratio is under the alarm threshold.",
                              labels=["replica"]),
            GaugeMetricFamily("kvgate_traffic_spike", "1 while the replica sees a to-B traffic spike (lifetime window relaxed).",
                              labels=["replica"]),
            GaugeMetricFamily("kvgate_cache_window_hit_ratio", "Hit ratio of the device tier over the fallback's window "
                              "(fallback.window_s): the policy's own (order=policy) and a shadow LRU's of the same size "
                              "on the same accesses (order=shadow_lru); the policy falls back to LRU when it trails.",
                              labels=["replica", "order"]),
            GaugeMetricFamily("kvgate_cache_categories", "Categories (request classes) the workload-aware policy keeps.",
                              labels=["replica"]),
            GaugeMetricFamily("kvgate_reuse_ratio", "Cached prompt tokens / prompt tokens over the last full minute (engine-actual).",
                              labels=["workload", "type"]),
            GaugeMetricFamily("kvgate_user_hit_share", "Share of cache-hit tokens from the top fraction of users over a sliding window.",
                              labels=["top"]),
            GaugeMetricFamily("kvgate_engine_requests", "Sequences in a replica's engine (a request of n choices is n): "
                              "running (in the batch) or waiting (queued for blocks or a batch slot), as vLLM's "
                              "num_requests_running/waiting.",
                              labels=["replica", "state"]),
        ]
