"""`kvgate tune`: search the workload-aware policy's weights and windows on a trace.

Coordinate descent over a small grid per knob, starting from the given
settings (config.yaml's, else the defaults): each round tries every value of
one knob with the others held, keeps the best if it beats the current hit
ratio by more than ``min_gain``, and moves to the next knob; rounds repeat
until one changes nothing, or the time or evaluation budget runs out (a
value at the top of its grid adds the next doubling for the next round).  Every
candidate is scored by ``engine.replay.replay`` on the same trace and
capacity, so the numbers are those `kvgate replay` prints.  A replay still
running when the time limit passes is abandoned (one on a long trace takes
minutes), and Ctrl-C stops the search the same way: either way the report is
the best found so far, flagged as incomplete when not every value was tried.

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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.config import CacheConfig, WorkloadAwareConfig
from engine.replay import replay
from engine.traces import Trace

# (dotted key under cache.workload_aware, candidate values) per knob.
Space = list[tuple[str, list[Any]]]
SEARCH_SPACE: Space = [
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
    stopped: str  # "converged", "round limit", "time limit", "evaluation limit", "interrupted"
    skipped: list[str] = field(default_factory=list)  # search keys this config does not have
    # lru / start / best on the held-out tail (and configured: the config's policy when neither wa nor lru)
    holdout: dict[str, float] | None = None
    # Whether every candidate of the first round was tried: before that, the best
    # so far is a guess from a few settings, not a search result.
    first_round_done: bool = True
    holdout_skipped: str | None = None  # why a requested held-out check did not run
    # The starting workload-aware section whole (its settings outside the search too),
    # so that a snippet can be the complete section that was scored.
    base: WorkloadAwareConfig = field(default_factory=WorkloadAwareConfig)
    # The config's own cache.policy, and its hit ratio when it is neither wa nor lru.
    configured_policy: str = "wa"
    configured: float | None = None
    searched_requests: int = 0  # the head of the trace the search replayed (all of it without --holdout)
    searched_ideal: float | None = None  # that head's ideal hit ratio (an infinite cache's)


class NothingFinished(Exception):
    """The search stopped (``stopped``: "time limit" or "interrupted") before the
    baselines, LRU and the starting settings, were scored: there is nothing to report."""

    def __init__(self, stopped: str) -> None:
        super().__init__(stopped)
        self.stopped = stopped


class _OutOfTime(Exception):
    """Raised from a replay's progress callback once the deadline has passed.

    A replay takes minutes on a long trace; finishing it would overshoot the
    time limit by that much, so it is abandoned and its result never counted.
    """


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


def _deadline_check(deadline: float, total: int) -> Callable[[int], None]:
    """A replay progress callback that abandons the replay once ``deadline`` has
    passed, unless it has replayed all ``total`` requests (its last call comes
    after the last request: a finished result is kept)."""
    done = 0

    def check(requests: int) -> None:
        nonlocal done
        done += requests
        if done < total and time.monotonic() >= deadline:
            raise _OutOfTime
    return check


def _cache_key(settings: dict[str, Any], policy: str) -> tuple:
    """A trial's identity in _Runner.cache: its policy and settings, in any order given."""
    return policy, tuple(sorted(settings.items()))


class _Runner:
    """Scores settings by replay on the search part, within the time and replay budget."""

    def __init__(self, trace: Trace, capacity_blocks: int, base: CacheConfig, host_blocks: int, time_limit_s: float,
                 max_evaluations: int | None, progress: Callable[[int, int, str], None] | None,
                 held_share: float) -> None:
        self.trace, self.capacity_blocks, self.base, self.host_blocks = trace, capacity_blocks, base, host_blocks
        self.unique = trace.unique_blocks()
        self.max_evaluations, self.progress, self.held_share = max_evaluations, progress, held_share
        self.started = time.monotonic()
        self.deadline = self.started + time_limit_s
        self.cache: dict[tuple, float] = {}
        self.seconds: defaultdict[str, list[float]] = defaultdict(list)  # per finished replay, by policy
        self.done = 0
        self.planned = 0

    def score(self, settings: dict[str, Any], label: str, policy: str = "wa", deadline: float | None = None) -> float:
        key = _cache_key(settings, policy)
        if key not in self.cache:
            cfg = self.base.model_copy(update={"policy": policy,
                                               "workload_aware": with_settings(self.base.workload_aware, settings)})
            began = time.monotonic()
            ratio = replay(self.trace, policy, self.capacity_blocks, cfg, host_blocks=self.host_blocks,
                           unique_blocks=self.unique,
                           progress=_deadline_check(self.search_deadline() if deadline is None else deadline,
                                                    len(self.trace.requests))).hit_ratio
            self.seconds[policy].append(time.monotonic() - began)
            self.cache[key] = ratio
            self.done += 1
            if self.progress is not None:
                self.progress(self.done, max(self.planned, self.done), label)
        return self.cache[key]

    def has_scored(self, settings: dict[str, Any], policy: str = "wa") -> bool:
        return _cache_key(settings, policy) in self.cache

    def search_deadline(self) -> float:
        """The deadline less the time the held-out check will take, so that the
        whole run, check included, stays within the limit."""
        return self.deadline - self.holdout_estimate_s()

    def holdout_estimate_s(self) -> float:
        if not self.held_share:
            return 0.0

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else 0.0

        # The check replays lru once, wa twice and the config's other policy once on a tail
        # of held_share x the search part; a quarter more, as a cold cache on a tail need
        # not replay at the head's pace.
        served = mean(self.seconds[self.base.policy]) if self.base.policy not in ("wa", "lru") else 0.0
        return 1.25 * (mean(self.seconds["lru"]) + 2 * mean(self.seconds["wa"]) + served) * self.held_share

    def out_of_budget(self) -> str | None:
        if time.monotonic() >= self.search_deadline():
            return "time limit"
        if self.max_evaluations is not None and self.done >= self.max_evaluations:
            return "evaluation limit"
        return None


@dataclass(slots=True)
class _Descent:
    best: Evaluation
    rounds: int = 0
    stopped: str = "converged"
    first_round_done: bool = False


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
    space: Space | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> TuneResult:
    """Search ``space`` for the workload-aware settings with the best hit ratio on ``trace``.

    ``progress(done, planned, description)`` is told after every replay.  The
    time limit holds to within one replay progress step: a replay still running
    at the deadline is abandoned.  Ctrl-C (KeyboardInterrupt) stops the search
    too; the result says ``stopped="interrupted"``.  Either raises
    ``NothingFinished`` when it comes before the baselines were scored.
    """
    base = base or CacheConfig()
    search, check = split_trace(trace, holdout)
    knobs, skipped = _knobs(base.workload_aware, space or SEARCH_SPACE)
    held_share = len(check.requests) / len(search.requests) if check is not None else 0.0
    run = _Runner(search, capacity_blocks, base, host_blocks, time_limit_s, max_evaluations, progress, held_share)
    run.planned = 2 + sum(len(v) - 1 for _, v in knobs)
    current = {dotted: get_path(base.workload_aware.model_dump(), dotted) for dotted, _ in knobs}
    configured = None
    try:
        lru = run.score({}, "lru", policy="lru", deadline=run.deadline)
        start = Evaluation(dict(current), run.score(current, "defaults", deadline=run.deadline))
        if base.policy not in ("wa", "lru"):
            # What the config serves with now: the baseline an operator compares against.
            configured = run.score({}, base.policy, policy=base.policy, deadline=run.deadline)
    except KeyboardInterrupt:
        raise NothingFinished("interrupted") from None
    except _OutOfTime:
        raise NothingFinished("time limit") from None
    descent = _descend(run, knobs, start, max_rounds, min_gain)
    held, held_skipped = None, None
    if check is not None:
        held, held_skipped = _check_holdout(run, check, start, descent)
    return TuneResult(capacity_blocks, host_blocks, lru, start, descent.best, run.done, descent.rounds,
                      time.monotonic() - run.started, descent.stopped, skipped, held, descent.first_round_done,
                      held_skipped, base.workload_aware, base.policy, configured, len(search.requests),
                      search.ideal_hit_ratio())


def _knobs(wa: WorkloadAwareConfig, space: Space) -> tuple[Space, list[str]]:
    """The knobs to search (each grid holding the current value) and those this config lacks."""
    dumped = wa.model_dump()
    knobs, skipped = [], []
    for dotted, values in space:
        try:
            current = get_path(dumped, dotted)
        except (KeyError, TypeError):
            skipped.append(dotted)  # the config no longer has this knob
            continue
        knobs.append((dotted, list(values) if current in values else [current, *values]))
    return knobs, skipped


def _descend(run: _Runner, knobs: Space, start: Evaluation, max_rounds: int, min_gain: float) -> _Descent:
    """Coordinate descent from ``start``; what it found when it stopped, however it stopped."""
    state = _Descent(Evaluation(dict(start.settings), start.hit_ratio))
    try:
        _rounds(run, knobs, state, max_rounds, min_gain)
    except KeyboardInterrupt:
        state.stopped = "interrupted"  # the replay under way is lost; the finished ones stand
    except _OutOfTime:
        state.stopped = "time limit"
    return state


def _rounds(run: _Runner, knobs: Space, state: _Descent, max_rounds: int, min_gain: float) -> None:
    improved = True
    while improved and state.rounds < max_rounds:
        state.rounds += 1
        improved = False
        for dotted, values in knobs:
            for value in values:
                if value == state.best.settings[dotted]:
                    continue
                trial = {**state.best.settings, dotted: value}
                # Only a replay costs time: a trial scored before is no reason to stop.
                reason = None if run.has_scored(trial) else run.out_of_budget()
                if reason:
                    state.stopped = reason
                    return
                try:
                    ratio = run.score(trial, f"round {state.rounds}: {dotted}={value}")
                except ValueError:
                    continue  # a combination the config rejects
                if ratio > state.best.hit_ratio + min_gain:
                    state.best = Evaluation(trial, ratio)
                    improved = True
        state.first_round_done = True
        if not improved:
            return
        _extend_grids(knobs, state.best)
        run.planned = run.done + sum(len(v) - 1 for _, v in knobs)
    state.stopped = "round limit"  # the last round still improved


def _extend_grids(knobs: Space, best: Evaluation) -> None:
    """A best value at the top of its grid may not be the top: look one step further."""
    for dotted, values in knobs:
        top = best.settings[dotted]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers and top == max(numbers) and top > 0:
            values.append(type(top)(top * 2))


def _check_holdout(run: _Runner, check: Trace, start: Evaluation,
                   descent: _Descent) -> tuple[dict[str, float] | None, str | None]:
    """LRU, the starting and the tuned settings (and the config's policy, if another) replayed on the held-out tail from
    a cold cache.  The search stopped early enough to leave the time this takes,
    and it always runs to its end (only Ctrl-C stops it): a search cut by the time
    limit is the very one whose result needs the check."""
    if descent.stopped == "interrupted":
        return None, "interrupted"
    held_unique = check.unique_blocks()

    def held_ratio(policy: str, settings: dict[str, Any]) -> float:
        cfg = run.base.model_copy(update={"policy": policy,
                                          "workload_aware": with_settings(run.base.workload_aware, settings)})
        return replay(check, policy, run.capacity_blocks, cfg, host_blocks=run.host_blocks,
                      unique_blocks=held_unique).hit_ratio

    try:
        held = {"lru": held_ratio("lru", {}), "start": held_ratio("wa", start.settings)}
        # Unchanged settings need no second replay (time the limit may not have).
        same = descent.best.settings == start.settings
        held["best"] = held["start"] if same else held_ratio("wa", descent.best.settings)
        if run.base.policy not in ("wa", "lru"):
            held["configured"] = held_ratio(run.base.policy, {})  # what a switch would give up
        return held, None
    except KeyboardInterrupt:
        descent.stopped = "interrupted"
        return None, "interrupted"


def config_snippet(result: TuneResult, settings: dict[str, Any] | None = None) -> str:
    """A config.yaml cache section with ``settings`` (default: the tuned ones) on
    the starting section: the whole workload_aware section that was scored (what
    differs from the defaults), to replace the config's, not to merge into it."""
    scored = with_settings(result.base, result.best.settings if settings is None else settings).model_dump()
    tree = _differences(scored, WorkloadAwareConfig().model_dump())
    switch = f"  # was {result.configured_policy}" if result.configured_policy != "wa" else ""
    lines = ["cache:", f"  policy: wa{switch}", "  workload_aware:"]
    if not tree:
        lines.append("    {}  # the defaults")
        return "\n".join(lines)

    def emit(node: dict, indent: int) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                lines.append(" " * indent + f"{key}:")
                emit(value, indent + 2)
            else:
                lines.append(" " * indent + f"{key}: {_yaml_scalar(value)}")

    emit(tree, 4)
    return "\n".join(lines)


def _differences(values: dict, defaults: dict) -> dict:
    """The leaves of ``values`` that differ from ``defaults``, nested as they are."""
    out: dict = {}
    for key, value in sorted(values.items()):
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            inner = _differences(value, default)
            if inner:
                out[key] = inner
        elif value != default:
            out[key] = value
    return out


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return f"{value:.1f}"
    text = str(value)
    if isinstance(value, float) and "e" in text and "." not in text:
        # YAML reads 5e-05 as text; 5.0e-05 is the float.
        mantissa, _, exponent = text.partition("e")
        text = f"{mantissa}.0e{exponent}"
    return text


def format_report(result: TuneResult, trace_name: str, requests: int, unique_blocks: int) -> str:
    def pts(a: float, b: float) -> str:
        return f"{(a - b) * 100:+.2f} points"

    frac = result.capacity_blocks / unique_blocks if unique_blocks else 0.0
    searched = result.searched_requests
    held_out = f" ({searched} searched, {requests - searched} held out)" if 0 < searched < requests else ""
    lines = [
        f"# kvgate tune {trace_name}: {requests} requests{held_out}, capacity {result.capacity_blocks} blocks "
        f"({frac:.1%} of {unique_blocks} unique)" + (f" + {result.host_blocks} host" if result.host_blocks else ""),
        f"# {result.evaluations} replays in {result.elapsed_s:.0f} s, {result.rounds} round(s), stopped: {result.stopped}",
        f"#   lru                   hit ratio {result.lru:.4f}",
        f"#   wa, starting settings hit ratio {result.start.hit_ratio:.4f}  ({pts(result.start.hit_ratio, result.lru)} vs lru)",
        f"#   wa, tuned             hit ratio {result.best.hit_ratio:.4f}  ({pts(result.best.hit_ratio, result.start.hit_ratio)} "
        f"vs starting, {pts(result.best.hit_ratio, result.lru)} vs lru)",
    ]
    if result.configured is not None:
        label = f"{result.configured_policy} (the config's)"
        lines.insert(3, f"#   {label:<21} hit ratio {result.configured:.4f}  ({pts(result.configured, result.lru)} vs lru)")
    if result.configured_policy != "wa":
        lines.append(f"# the config serves cache.policy {result.configured_policy}; the settings below are wa's, "
                     "and using them switches the policy")
    if result.holdout is not None:
        h = result.holdout
        served = f", {result.configured_policy} {h['configured']:.4f}" if "configured" in h else ""
        lines.append(f"# held-out tail (cold cache): lru {h['lru']:.4f}{served}, starting {h['start']:.4f}, "
                     f"tuned {h['best']:.4f} ({pts(h['best'], h['start'])} vs starting)")
    elif result.holdout_skipped:
        lines.append(f"# held-out tail not checked ({result.holdout_skipped})")
    if result.skipped:
        lines.append(f"# not searched (not in this config): {', '.join(result.skipped)}")
    if not result.first_round_done:
        lines.append("# the search is incomplete: it stopped before trying every setting once; "
                     + _more_budget(result.stopped))
    few = 4 * result.base.model.min_samples
    if 0 < searched < few:
        # Below this the reuse model runs on its priors: the settings tuned are those of the priors.
        lines.append(f"# only {searched} requests searched: too few for the reuse model to fit its categories "
                     f"(model.min_samples {result.base.model.min_samples} episodes each); give {few} or more")
    doubt = _doubt(result)
    if doubt:
        # What is not commented out is what a reader pastes (or a script keeps):
        # the starting settings, unless the tuned ones earned their place.
        lines.append(f"# {doubt}; for reference only:")
        lines.extend("#   " + line for line in config_snippet(result).splitlines())
        if result.configured_policy == "wa":
            lines.append("# keep the starting settings:")
            lines.append(config_snippet(result, result.start.settings))
        else:
            lines.append(f"cache:\n  policy: {result.configured_policy}  # keep the config's policy")
    else:
        lines.append(config_snippet(result))
    return "\n".join(lines)


def _doubt(result: TuneResult) -> str | None:
    """Why the tuned settings should not be pasted as they are, or None."""
    if result.searched_ideal == 0:
        return "the searched requests reuse no block, so no setting can make a difference"
    if result.lru == result.start.hit_ratio == result.best.hit_ratio == 0:
        return "no setting scored a hit at this capacity (too small to keep a prefix until it is reused)"
    if result.configured_policy != "wa":
        # The snippet switches the policy: only for one that beats what the config serves.
        policy = result.configured_policy
        served = result.lru if result.configured is None else result.configured
        if result.best.hit_ratio <= served:
            return f"tuned wa ({result.best.hit_ratio:.4f}) does not beat the config's {policy} ({served:.4f})"
        if result.holdout is not None:
            tail = result.holdout.get("configured", result.holdout["lru"])
            if result.holdout["best"] <= tail:
                return f"tuned wa does not beat the config's {policy} on the held-out tail"
    if result.holdout is not None:
        # The held-out tail has the last word, even on a short search.
        if result.holdout["best"] < result.holdout["start"]:
            return "the tuned settings lose on the held-out tail"  # fitted the head of the trace, not its traffic
        if not result.first_round_done and result.holdout["best"] <= result.holdout["start"]:
            # A guess from a few settings that merely ties on the tail is no reason to change.
            return "the best settings so far, from an incomplete search, do not beat the start on the held-out tail"
        return None
    if not result.first_round_done:
        return "the best settings so far, from an incomplete search"
    if result.holdout_skipped:
        return "the tuned settings were not checked on the held-out tail"
    return None


def _more_budget(stopped: str) -> str:
    if stopped == "evaluation limit":
        return "raise --max-evals"
    if stopped == "interrupted":
        return "let it run longer (or raise --time-limit)"
    return "raise --time-limit"
