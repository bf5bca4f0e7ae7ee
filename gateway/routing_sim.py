"""Routing simulation: a trace through N block caches behind the real router.

`kvgate replay TRACE --replicas N --routing prefix-aware,least-load,...` lands
here.  Each replica is an ``engine.block_pool.BlockPool`` (the engine's own
cache, no tensors) of the given capacity; ``gateway.router.Router`` (the code
the gateway runs) picks the replica of every request, seeing each pool as an
exact index, as a gateway following KV events would.

Load model.  Replay is instantaneous, but the router's load term and its
imbalance valve need in-flight work.  Each request therefore stays in flight
on its replica for a service time

    service_s = prefill_s_per_token * uncached prompt tokens
              + decode_s_per_token  * output_length

with fixed per-token costs (defaults: 0.1 ms per prefilled token, i.e. 10k
tokens/s of prefill per replica, and 30 ms per decoded token, a typical
batched TPOT for a 7B-class model).  Cached tokens cost nothing, so good
routing also shortens the work it creates.  There is no queueing: replicas
are assumed to batch whatever is in flight; the costs only decide how long a
request counts against its replica in the router (a recording's request holds
its blocks for its own ``duration_s``, below).  The router charges each
request ``Router.load_tokens(prompt, output, 1)`` tokens, exactly what the
gateway charges (the real max_tokens is unknown to the trace, so the known
output length stands in for it).

What the router knows.  By default each pool is an exact index, current at
every decision: a gateway following a ``kvgate engine``'s KV events with no
delay.  ``index_lag_s`` > 0 delivers those events (the pool's own) that much
later, through the gateway's ``ExactIndex``: how routing degrades when the
events lag.  ``index="approx"`` is the gateway's ``ApproxIndex`` instead, what
it keeps for an external server (vLLM, SGLang) that publishes no events: the
prompts it sent there, forgotten after ``router.approx_ttl_s`` or past
``router.approx_capacity_blocks``.

Replay semantics per replica are ``engine.replay``'s (``replay_request``): the
leading run of cached keys is the hit, every cacheable key is touched or
inserted, a recording's answer blocks are cached after them, blocks are
released tail first (a recording's request holds them until it ended, its
``duration_s``).  The reference is one pooled cache of N times the capacity:
about what routing could recover by putting every request where its prefix is.
It is no strict bound: N separate caches under a recency policy can keep a
little more of what their own requests reuse than one shared cache does.
"""

from __future__ import annotations

import heapq
import json
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

from engine.block_pool import BlockPool
from engine.config import CacheConfig
from engine.replay import HeldRequests, pool_sizes, replay, replay_request
from engine.replay_report import (
    collect_until_interrupted, host_tier_note, interrupted_note, plot_title, print_row, save_figure,
    trace_line, unfinished_outputs, write_outputs,
)
from engine.traces import Trace
from gateway.config import RouterConfig
from gateway.router import ApproxIndex, ExactIndex, Router, share_fleet

ROUTINGS = ("prefix-aware", "least-load", "round-robin", "session")
INDEXES = ("exact", "approx")
# The routings that ask the index what each replica holds (Router.choose); the others
# go by load, turn or session alone.
INDEX_READERS = frozenset({"prefix-aware"})
# Defaults of the load model (see the module docstring).
PREFILL_S_PER_TOKEN = 1e-4
DECODE_S_PER_TOKEN = 0.03


@dataclass(slots=True)
class RoutingResult:
    routing: str
    replicas: int
    policy: str
    capacity_blocks: int  # per replica
    capacity_fraction: float  # per replica, of the trace's unique blocks
    hit_ratio: float
    accesses: int
    load_imbalance: float  # max over mean of per-replica block accesses
    per_replica_accesses: list[int]
    pooled_hit_ratio: float  # one cache of replicas x capacity, same policy
    share_of_pooled: float
    mean_inflight: float  # requests in flight per replica, averaged over arrivals
    # max over mean of in-flight tokens across replicas, averaged over arrivals:
    # how unevenly the *work* (not the blocks) is spread while it runs.
    inflight_imbalance: float
    decisions: dict[str, int]
    index: str = "exact"  # what the router knew: "exact" (KV events) or "approx" (no events)
    index_lag_s: float = 0.0  # how late the KV events reached it (exact)

    def to_json(self) -> dict:
        return asdict(self)


class SimOutcome(NamedTuple):
    hit_ratio: float
    accesses: int
    per_replica_accesses: list[int]
    mean_inflight: float
    inflight_imbalance: float
    decisions: dict[str, int]


class _PoolIndex:
    """A pool seen as the router's index: blocks in either tier count as held."""

    __slots__ = ("pool",)

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def match(self, keys: Sequence[int]) -> int:
        m = self.pool.match_prefix(keys)
        return m.device + m.host


class _LaggingIndex(ExactIndex):
    """The gateway's exact index, fed a pool's KV events ``lag_s`` after they happen."""

    __slots__ = ("lag_s", "now", "_pending")

    def __init__(self, lag_s: float) -> None:
        super().__init__()
        self.lag_s = lag_s
        self.now = 0.0  # the simulation's clock, set before each request is replayed
        self._pending: deque[tuple[float, str, list[int], str]] = deque()

    def on_pool_event(self, kind: str, keys: list[int], tier: str) -> None:
        self._pending.append((self.now + self.lag_s, kind, keys, tier))

    def catch_up(self, now: float) -> None:
        """Apply the events that have arrived by ``now``, in the order they happened."""
        pending = self._pending
        while pending and pending[0][0] <= now:
            _, kind, keys, tier = pending.popleft()
            self.apply(kind, keys, tier)


def simulate(
    trace: Trace,
    routing: str,
    replicas: int,
    capacity_blocks: int,
    policy: str = "lru",
    cache_config: CacheConfig | None = None,
    router_config: RouterConfig | None = None,
    *,
    host_blocks: int = 0,
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN,
    decode_s_per_token: float = DECODE_S_PER_TOKEN,
    index: str = "exact",
    index_lag_s: float = 0.0,
    gateway_block_tokens: int = 16,
    unique_blocks: int | None = None,
) -> "SimOutcome":
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
    if policy == "belady":
        raise ValueError("belady needs each replica's future, which depends on routing: not simulated")
    if index not in INDEXES:
        raise ValueError(f"unknown index {index!r}; choose from {', '.join(INDEXES)}")
    if index_lag_s < 0 or (index_lag_s and index != "exact"):
        raise ValueError("an index lag is a delay of KV events: give 0 or more seconds, with the exact index")
    cfg = (router_config or RouterConfig()).model_copy(update={"policy": routing})
    block_tokens = trace.block_tokens
    now = 0.0  # the trace's clock, for the approximate index's time-to-live
    lagging = [_LaggingIndex(index_lag_s) for _ in range(replicas)] if index_lag_s else []
    share_fleet(lagging)  # matched in one pass, as the gateway's are
    sizes = pool_sizes(capacity_blocks, host_blocks, unique_blocks if unique_blocks is not None else trace.unique_blocks())
    pools = [BlockPool(*sizes, policy, cache_config,
                       on_event=lagging[i].on_pool_event if lagging else None) for i in range(replicas)]
    approx: list[ApproxIndex] = []
    if index == "approx":
        approx = [ApproxIndex(cfg.approx_ttl_s, approx_trace_blocks(cfg.approx_capacity_blocks, gateway_block_tokens,
                                                                 block_tokens), clock=lambda: now) for _ in pools]
        indexes: list = approx
    else:
        indexes = lagging or [_PoolIndex(p) for p in pools]
    router = Router(cfg, [f"r{i}" for i in range(replicas)], block_tokens)
    healthy = [True] * replicas
    finishing: list[tuple[float, int, object]] = []  # (finish time, seq, ticket)
    per_replica = [0] * replicas
    decisions: dict[str, int] = {}
    hits = accesses = 0
    inflight_sum = 0
    work_skew_sum = 0.0
    # A recording's request holds its blocks on its replica until it ended (its
    # duration_s), as plain replay and the pooled reference hold them.
    held = [HeldRequests(pool) for pool in pools]
    for seq, request in enumerate(trace.requests):
        now = request.timestamp
        while finishing and finishing[0][0] <= now:
            router.release(heapq.heappop(finishing)[2])
        for lagged in lagging:
            lagged.catch_up(now)
            lagged.now = now  # the events this request causes happen now (and those of the ends before it)
        for ends in held:
            ends.end_until(now)
        keys = request.keys
        ctx = request.context
        decision = router.choose(keys, indexes, healthy, ctx.session)
        r = decision.replica
        if approx:
            approx[r].record(keys)  # what the gateway notes when it sends a prompt to an external server
        decisions[decision.reason] = decisions.get(decision.reason, 0) + 1
        inflight_sum += sum(router.inflight_requests)
        total = sum(router.inflight_tokens)
        work_skew_sum += max(router.inflight_tokens) * replicas / total if total else 1.0
        hit = replay_request(pools[r], request, held[r])
        hits += hit
        accesses += len(keys)
        per_replica[r] += len(keys)
        tokens = request.input_length or len(keys) * block_tokens
        ticket = router.acquire(r, router.load_tokens(tokens, request.output_length, 1), keys, decision.matched_blocks)
        uncached = max(0, tokens - hit * block_tokens)
        service = prefill_s_per_token * uncached + decode_s_per_token * request.output_length
        heapq.heappush(finishing, (now + service, seq, ticket))
    n = max(1, len(trace.requests))
    return SimOutcome(hits / accesses if accesses else 0.0, accesses, per_replica, inflight_sum / n / replicas,
                      work_skew_sum / n, decisions)


def approx_trace_blocks(capacity_blocks: int, gateway_block_tokens: int, trace_block_tokens: int) -> int:
    """router.approx_capacity_blocks counts the gateway's blocks (engine.block_size
    tokens); a trace's blocks can be larger (Mooncake's hold 512 tokens), and the
    same number of them would let the index remember 32 times as much."""
    return max(1, capacity_blocks * gateway_block_tokens // trace_block_tokens)


def load_imbalance(per_replica: Sequence[int]) -> float:
    mean = sum(per_replica) / len(per_replica) if per_replica else 0
    return max(per_replica) / mean if mean else 1.0


def run_routing(
    trace: Trace,
    routings: Sequence[str],
    replicas: int,
    policies: Sequence[str],
    capacities: Sequence[int],
    cache_config: CacheConfig | None = None,
    router_config: RouterConfig | None = None,
    *,
    host_blocks: int = 0,
    unique_blocks: int | None = None,
    index: str = "exact",
    index_lag_s: float = 0.0,
    gateway_block_tokens: int = 16,
) -> Iterator[RoutingResult]:
    """Per eviction policy and capacity: the pooled cache, then each routing over
    ``replicas`` caches; one result at a time, so an interrupted run keeps what finished."""
    unique = unique_blocks if unique_blocks is not None else trace.unique_blocks()
    for policy in policies:
        for capacity in capacities:
            pooled = replay(trace, policy, capacity * replicas, cache_config, host_blocks=host_blocks * replicas,
                            unique_blocks=unique).hit_ratio
            for routing in routings:
                out = simulate(
                    trace, routing, replicas, capacity, policy, cache_config, router_config, host_blocks=host_blocks,
                    index=index, index_lag_s=index_lag_s, gateway_block_tokens=gateway_block_tokens,
                    unique_blocks=unique,
                )
                yield RoutingResult(
                    routing=routing, replicas=replicas, policy=policy, capacity_blocks=capacity,
                    capacity_fraction=capacity / unique if unique else 0.0, hit_ratio=out.hit_ratio,
                    accesses=out.accesses, load_imbalance=load_imbalance(out.per_replica_accesses),
                    per_replica_accesses=out.per_replica_accesses, pooled_hit_ratio=pooled,
                    # Nothing for routing to recover counts as all of it, as plain replay's "vs ideal".
                    share_of_pooled=out.hit_ratio / pooled if pooled else 1.0, mean_inflight=out.mean_inflight,
                    inflight_imbalance=out.inflight_imbalance, decisions=out.decisions, index=index,
                    index_lag_s=index_lag_s,
                )


def index_note(index: str, index_lag_s: float = 0.0) -> str:
    """What the router knew, in words, for the table's header."""
    if index == "approx":
        return "router index: approximate (what was sent where, as for an external server)"
    return f"router index: KV events {index_lag_s:g} s late" if index_lag_s else "router index: exact (KV events)"


def routing_header(summary: dict, replicas: int, host_blocks: int = 0, index: str = "") -> str:
    """What is printed before the first simulation finishes: the rows follow as they come."""
    tiers = f"; {host_tier_note(host_blocks)}" if host_blocks else ""
    return "\n".join([
        trace_line(summary),
        f"{replicas} replicas; capacity is per replica (device tier){tiers}; "
        f"'pooled' = one cache of {replicas}x the capacity" + (f"; {index}" if index else ""),
        "",
        f"{'routing':<13} {'policy':<8} {'capacity':>9} {'fraction':>8} {'hit ratio':>9} {'pooled':>7} "
        f"{'vs pooled':>9} {'imbalance':>9} {'inflight':>8} {'work skew':>9}",
    ])


def routing_row(r: RoutingResult) -> str:
    return (f"{r.routing:<13} {r.policy:<8} {r.capacity_blocks:>9} {r.capacity_fraction:>8.3f} {r.hit_ratio:>9.4f} "
            f"{r.pooled_hit_ratio:>7.4f} {r.share_of_pooled:>9.1%} {r.load_imbalance:>9.2f} {r.mean_inflight:>8.1f} "
            f"{r.inflight_imbalance:>9.2f}")


def write_routing_json(path: str | Path, summary: dict, results: Sequence[RoutingResult], load_model: dict,
                       extra: dict | None = None) -> None:
    payload = {
        "trace": summary,
        "replicas": results[0].replicas if results else 0,
        "load_model": load_model,
        "results": [r.to_json() for r in results],
    }
    payload.update(extra or {})
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def write_routing_plot(path: str | Path, summary: dict, results: Sequence[RoutingResult],
                       partial: bool = False, host_blocks: int = 0, index: str = "") -> None:
    """Hit ratio (left) and load imbalance (right) against per-replica capacity:
    one line per routing and eviction policy, the routing as the colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hits_ax, skew_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {routing: f"C{i}" for i, routing in enumerate(ROUTINGS)}
    markers = "osD^vP*X"
    policies = list(dict.fromkeys(r.policy for r in results))
    for (routing, policy), rows in _routing_lines(results).items():
        percent = [r.capacity_fraction * 100 for r in rows]
        style = {"color": colours.get(routing), "marker": markers[policies.index(policy) % len(markers)],
                 "label": f"{routing} / {policy}"}
        hits_ax.plot(percent, [r.hit_ratio for r in rows], **style)
        skew_ax.plot(percent, [r.load_imbalance for r in rows], **style)
    _plot_pooled(hits_ax, results, policies, markers)
    hits_ax.axhline(summary["ideal_hit_ratio"], color="black", linestyle="--", linewidth=1, label="ideal (infinite)")
    hits_ax.set_ylim(0, 1)
    hits_ax.set_ylabel("aggregate hit ratio (prefix blocks)")
    skew_ax.axhline(1.0, color="black", linestyle=":", linewidth=1, label="perfect balance")
    skew_ax.set_ylabel("load imbalance (max / mean block accesses)")
    replicas = results[0].replicas if results else 0
    for ax in (hits_ax, skew_ax):
        ax.set_xlabel("capacity per replica (% of the trace's unique blocks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{plot_title(summary, partial, host_blocks)}: {replicas} replicas" + (f"; {index}" if index else ""))
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _routing_lines(results: Sequence[RoutingResult]) -> dict[tuple[str, str], list[RoutingResult]]:
    lines: dict[tuple[str, str], list[RoutingResult]] = {}
    for r in results:
        lines.setdefault((r.routing, r.policy), []).append(r)
    for rows in lines.values():
        rows.sort(key=lambda r: r.capacity_fraction)
    return lines


def _plot_pooled(ax, results: Sequence[RoutingResult], policies: list[str], markers: str) -> None:
    """The pooled cache per policy, grey: the reference routing is measured against."""
    for policy in policies:
        pooled = {r.capacity_fraction: r.pooled_hit_ratio for r in results if r.policy == policy}
        fractions = sorted(pooled)
        ax.plot([f * 100 for f in fractions], [pooled[f] for f in fractions], color="grey", linestyle="--",
                marker=markers[policies.index(policy) % len(markers)], label=f"pooled / {policy}")


def routings_from_cli(args) -> list[str]:
    """The routings ``--routing`` names, each once (all by default), checked with
    the index flags; cheap, so the CLI calls it before reading the trace too."""
    spec = ",".join(ROUTINGS) if args.routing is None else args.routing  # "" is a mistake, not "all"
    routings = list(dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    bad = [r for r in routings if r not in ROUTINGS]
    if bad or not routings:
        raise ValueError(f"--routing: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(ROUTINGS)}")
    index_flags = [flag for flag, given in (("--index approx", args.index != "exact"),
                                            ("--index-lag", args.index_lag != 0)) if given]
    if index_flags and INDEX_READERS.isdisjoint(routings):
        # Each of these routings ignores what the router knows of the caches: the
        # flag would change nothing, and the header would claim it had.
        raise ValueError(f"{index_flags[0]}: only {', '.join(sorted(INDEX_READERS))} routing reads the index; "
                         "add it to --routing")
    return routings


def run_from_cli(args, trace: Trace, policies: Sequence[str], capacities: Sequence[int], config, summary: dict,
                 unique: int) -> bool:
    """The replay subcommand's routing mode (``--replicas N``, N >= 2).

    Returns whether Ctrl-C cut the run short; the results that finished are
    reported (table, --json, --plot) either way.
    """
    routings = routings_from_cli(args)
    policies = _simulated_policies(policies)
    start = time.perf_counter()
    runs = run_routing(trace, routings, args.replicas, policies, capacities, config.cache, config.router,
                        host_blocks=args.host_blocks, unique_blocks=unique, index=args.index,
                        index_lag_s=args.index_lag, gateway_block_tokens=config.engine.block_size)
    # Rows as each simulation finishes: a long trace takes minutes per row.
    print(routing_header(summary, args.replicas, args.host_blocks, index_note(args.index, args.index_lag)),
          flush=True)
    results, interrupted = collect_until_interrupted(runs, on_result=lambda r: print_row(routing_row(r)))
    print(f"\n({time.perf_counter() - start:.1f} s; load model: prefill {PREFILL_S_PER_TOKEN * 1e3:g} ms/token, "
          f"decode {DECODE_S_PER_TOKEN * 1e3:g} ms/token, no queueing)")
    if any(r.routing == "session" for r in results) and all(r.context.session is None for r in trace.requests):
        print("(this trace names no sessions (Mooncake): session routing fell back to least-load "
              "for every request)")
    if not results and (note := unfinished_outputs([("--json", args.json), ("--plot", args.plot)])):
        print(note, file=sys.stderr)
    load_model = {"prefill_s_per_token": PREFILL_S_PER_TOKEN, "decode_s_per_token": DECODE_S_PER_TOKEN}
    interrupted |= write_outputs(ValueError, [
        ("--json", args.json if results else None, lambda out: write_routing_json(out, summary, results, load_model,
                                                             {"interrupted": True} if interrupted else None)),
        ("--plot", args.plot if results else None,
         lambda out: write_routing_plot(out, summary, results, partial=interrupted, host_blocks=args.host_blocks,
                                    index=index_note(args.index, args.index_lag))),
    ])
    if interrupted:
        print(interrupted_note(len(results), len(policies) * len(capacities) * len(routings)), file=sys.stderr)
    return interrupted


def _simulated_policies(policies: Sequence[str]) -> list[str]:
    """The policies simulated across replicas: all but belady, whose skipping is said, not silent."""
    kept = [p for p in policies if p != "belady"]
    if not kept:
        raise ValueError("--replicas: belady cannot be simulated across replicas; give another policy")
    if len(kept) < len(policies):
        print("kvgate: belady skipped: it needs each replica's future, which depends on the routing "
              "(not simulated across replicas)", file=sys.stderr)
    return kept
