"""`kvgate tune`: search the workload-aware policy's weights and windows on a trace.

Coordinate descent over a small grid per knob, starting from the given
settings (config.yaml's, else the defaults): each round tries every value of
one knob with the others held, keeps the best if it beats the current hit
ratio by more than ``min_gain``, and moves to the next knob; rounds repeat
until one changes nothing, or the time or evaluation budget runs out (a
value at the top of its grid adds the next doubling for the next round).  Every
candidate is scored by ``engine.replay.replay`` on the same trace and
capacity, so the numbers are those `kvgate replay` prints.

The score is ``R (w_r + w_s spatial) + w_l [t < W]`` (``spatial_mode:
scale``, the default; ``add`` gives ``w_r R + w_s spatial + w_l [t < W]``) and
only its order matters, so multiplying all three weights changes nothing: the
reuse weight stays fixed and sets the scale, and spatial and lifetime are
searched relative to it.

A holdout (the last fraction of the trace, by time) is replayed from a cold
cache with the chosen settings, the starting ones and LRU, so an operator can
see whether the gain survives on traffic the search did not see.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.config import CacheConfig, WorkloadAwareConfig
from engine.replay import replay
from engine.traces import Trace

# (dotted key under cache.workload_aware, candidate values).
SEARCH_SPACE: list[tuple[str, list[Any]]] = [
    ("weights.spatial", [0.0, 0.05, 0.15, 0.3, 0.6, 1.5]),
    ("weights.lifetime", [0.0, 0.1, 0.2, 0.4, 1.0]),
    ("lifetime_c", [0.5, 1.0, 2.0, 4.0, 8.0]),
    ("lifetime_max_s", [30.0, 120.0, 300.0, 900.0]),
    ("life_s", [None, 5.0, 30.0, 120.0, 600.0]),
    ("model.window_s", [120.0, 300.0, 600.0, 1800.0]),
    ("position_classes", [1, 2, 4]),
]


@dataclass(slots=True)
class Evaluation:
    settings: dict[str, Any]  # dotted key -> value, for the searched keys
    hit_ratio: float


@dataclass(slots=True)
class TuneResult:
    capacity_blocks: int
    host_blocks: int
    lru: float
    start: Evaluation
    best: Evaluation
    evaluations: int
    rounds: int
    elapsed_s: float
    stopped: str  # "converged", "round limit", "time limit", "evaluation limit"
    skipped: list[str] = field(default_factory=list)  # search keys this config does not have
    holdout: dict[str, float] | None = None  # lru / start / best on the held-out tail


def get_path(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def with_settings(base: WorkloadAwareConfig, settings: dict[str, Any]) -> WorkloadAwareConfig:
    data = base.model_dump()
    for dotted, value in settings.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return WorkloadAwareConfig.model_validate(data)


def split_trace(trace: Trace, holdout: float) -> tuple[Trace, Trace | None]:
    """The first (1 - holdout) of the requests (by time) to search on, the rest to check."""
    if holdout <= 0:
        return trace, None
    cut = int(len(trace.requests) * (1.0 - holdout))
    if cut < 1 or cut >= len(trace.requests):
        raise ValueError(f"holdout {holdout} leaves no requests on one side of a {len(trace.requests)}-request trace")
    head = Trace(trace.path, trace.format, trace.block_tokens, trace.requests[:cut])
    tail = Trace(trace.path, trace.format, trace.block_tokens, trace.requests[cut:])
    return head, tail


def tune(
    trace: Trace,
    capacity_blocks: int,
    base: CacheConfig | None = None,
    *,
    host_blocks: int = 0,
    time_limit_s: float = 300.0,
    max_evaluations: int | None = None,
    max_rounds: int = 4,
    min_gain: float = 1e-4,
    holdout: float = 0.0,
    space: list[tuple[str, list[Any]]] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> TuneResult:
    """Search ``space`` for the workload-aware settings with the best hit ratio on ``trace``.

    ``progress(done, planned, description)`` is told after every replay.
    """
    base = base or CacheConfig()
    wa = base.workload_aware
    search, check = split_trace(trace, holdout)
    unique = search.unique_blocks()
    dumped = wa.model_dump()
    knobs, skipped = [], []
    for dotted, values in space or SEARCH_SPACE:
        try:
            current = get_path(dumped, dotted)
        except (KeyError, TypeError):
            skipped.append(dotted)  # the config no longer has this knob
            continue
        knobs.append((dotted, list(values) if current in values else [current, *values]))
    start_time = time.monotonic()
    cache: dict[tuple, float] = {}
    planned = 2 + sum(len(v) - 1 for _, v in knobs)
    done = 0

    def score(settings: dict[str, Any], label: str, policy: str = "wa") -> float:
        nonlocal done
        key = (policy, tuple(sorted(settings.items())))
        if key not in cache:
            cfg = base.model_copy(update={"policy": policy, "workload_aware": with_settings(wa, settings)})
            cache[key] = replay(search, policy, capacity_blocks, cfg, host_blocks=host_blocks,
                                unique_blocks=unique).hit_ratio
            done += 1
            if progress is not None:
                progress(done, max(planned, done), label)
        return cache[key]

    current = {dotted: get_path(dumped, dotted) for dotted, _ in knobs}
    lru = score({}, "lru", policy="lru")
    start = Evaluation(dict(current), score(current, "defaults"))
    best = Evaluation(dict(current), start.hit_ratio)
    stopped = "converged"
    rounds = 0

    def out_of_budget() -> str | None:
        if time.monotonic() - start_time >= time_limit_s:
            return "time limit"
        if max_evaluations is not None and done >= max_evaluations:
            return "evaluation limit"
        return None

    improved = True
    while improved and rounds < max_rounds:
        rounds += 1
        improved = False
        for dotted, values in knobs:
            for value in values:
                if value == best.settings[dotted]:
                    continue
                reason = out_of_budget()
                if reason:
                    stopped = reason
                    break
                trial = {**best.settings, dotted: value}
                try:
                    ratio = score(trial, f"round {rounds}: {dotted}={value}")
                except ValueError:
                    continue  # a combination the config rejects
                if ratio > best.hit_ratio + min_gain:
                    best = Evaluation(trial, ratio)
                    improved = True
            if stopped != "converged":
                break
        if stopped != "converged" or not improved:
            break
        # A best value at the top of its grid may not be the top: look one step further.
        for dotted, values in knobs:
            top = best.settings[dotted]
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if numbers and top == max(numbers) and top > 0:
                values.append(type(top)(top * 2))
        planned = done + sum(len(v) - 1 for _, v in knobs)
    if stopped == "converged" and improved:
        stopped = "round limit"  # the last round still improved
    held = None
    if check is not None:
        held_unique = check.unique_blocks()

        def held_ratio(policy: str, settings: dict[str, Any]) -> float:
            cfg = base.model_copy(update={"policy": policy, "workload_aware": with_settings(wa, settings)})
            return replay(check, policy, capacity_blocks, cfg, host_blocks=host_blocks, unique_blocks=held_unique).hit_ratio

        held = {"lru": held_ratio("lru", {}), "start": held_ratio("wa", start.settings),
                "best": held_ratio("wa", best.settings)}
    return TuneResult(capacity_blocks, host_blocks, lru, start, best, done, rounds,
                      time.monotonic() - start_time, stopped, skipped, held)


def config_snippet(result: TuneResult) -> str:
    """The settings that differ from the starting ones, as a config.yaml fragment."""
    changed = {k: v for k, v in result.best.settings.items() if result.start.settings.get(k) != v}
    lines = ["cache:", "  policy: wa", "  workload_aware:"]
    if not changed:
        lines.append("    {}  # the starting settings were the best found")
        return "\n".join(lines)
    tree: dict = {}
    for dotted, value in sorted(changed.items()):
        node = tree
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def emit(node: dict, indent: int) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                lines.append(" " * indent + f"{key}:")
                emit(value, indent + 2)
            else:
                lines.append(" " * indent + f"{key}: {_yaml_scalar(value)}")

    emit(tree, 4)
    return "\n".join(lines)


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return f"{value:.1f}"
    return str(value)


def format_report(result: TuneResult, trace_name: str, requests: int, unique_blocks: int) -> str:
    def pts(a: float, b: float) -> str:
        return f"{(a - b) * 100:+.2f} points"

    frac = result.capacity_blocks / unique_blocks if unique_blocks else 0.0
    lines = [
        f"# kvgate tune {trace_name}: {requests} requests, capacity {result.capacity_blocks} blocks "
        f"({frac:.1%} of {unique_blocks} unique)" + (f" + {result.host_blocks} host" if result.host_blocks else ""),
        f"# {result.evaluations} replays in {result.elapsed_s:.0f} s, {result.rounds} round(s), stopped: {result.stopped}",
        f"#   lru                   hit ratio {result.lru:.4f}",
        f"#   wa, starting settings hit ratio {result.start.hit_ratio:.4f}  ({pts(result.start.hit_ratio, result.lru)} vs lru)",
        f"#   wa, tuned             hit ratio {result.best.hit_ratio:.4f}  ({pts(result.best.hit_ratio, result.start.hit_ratio)} "
        f"vs starting, {pts(result.best.hit_ratio, result.lru)} vs lru)",
    ]
    if result.holdout is not None:
        h = result.holdout
        lines.append(f"# held-out tail (cold cache): lru {h['lru']:.4f}, starting {h['start']:.4f}, tuned {h['best']:.4f} "
                     f"({pts(h['best'], h['start'])} vs starting)")
    if result.skipped:
        lines.append(f"# not searched (not in this config): {', '.join(result.skipped)}")
    if result.holdout is not None and result.holdout["best"] < result.holdout["start"]:
        # The search fitted the head of the trace, not its traffic.  What is not
        # commented out is what a reader pastes (or a script keeps): the starting settings.
        lines.append("# the tuned settings lose on the held-out tail; for reference only:")
        lines.extend("#   " + line for line in config_snippet(result).splitlines())
        lines.append("cache:\n  policy: wa\n  workload_aware:\n    {}  # keep the starting settings")
    else:
        lines.append(config_snippet(result))
    return "\n".join(lines)
