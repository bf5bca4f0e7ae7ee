"""Presenting replay results: table, capacity-planning answer, JSON and plot."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence, TypeVar

from engine.replay import ReplayResult
from engine.traces import Trace

T = TypeVar("T")
# The shares of the ideal hit ratio that capacity planning asks about, in percent.
PLANNING_SHARES_PCT = (90.0, 95.0)


def trace_summary(trace: Trace, unique_blocks: int, ideal: float) -> dict:
    return {
        "path": trace.path,
        "format": trace.format,
        "requests": len(trace.requests),
        "accesses": trace.accesses,
        "unique_blocks": unique_blocks,
        "ideal_hit_ratio": ideal,
    }


def share_of_ideal_pct(hit_ratio: float, ideal: float) -> float:
    """``hit_ratio`` as a percentage of ``ideal``, rounded to the 0.1 the table prints.

    The table and the capacity-planning verdict both use this one number, so a
    row printed as 95.0% is never reported as not reaching 95%.  A trace with no
    reuse has an ideal of 0, which any cache matches.
    """
    if not ideal:
        return 100.0
    return round(100.0 * hit_ratio / ideal, 1)


def capacity_answers(results: Sequence[ReplayResult], ideal: float) -> dict[str, dict[str, int | None]]:
    """Per policy, the smallest tested capacity reaching 90% and 95% of the ideal hit ratio."""
    by_policy: dict[str, list[ReplayResult]] = defaultdict(list)
    for result in results:
        by_policy[result.policy].append(result)
    answers = {}
    for policy, rows in by_policy.items():
        rows.sort(key=lambda r: r.capacity_blocks)
        answers[policy] = {
            f"{share:g}%": next(
                (r.capacity_blocks for r in rows if share_of_ideal_pct(r.hit_ratio, ideal) >= share), None
            )
            for share in PLANNING_SHARES_PCT
        }
    return answers


def format_table(summary: dict, results: Sequence[ReplayResult]) -> str:
    lines = [
        f"trace {summary['path']} ({summary['format']}): {summary['requests']} requests, "
        f"{summary['accesses']} block accesses, {summary['unique_blocks']} unique blocks, "
        f"ideal hit ratio {summary['ideal_hit_ratio']:.4f}",
        "",
        f"{'policy':<10} {'capacity':>9} {'fraction':>8} {'hit ratio':>9} {'vs ideal':>8} "
        f"{'evictions':>10} {'evict us':>8} {'accesses/s':>11}",
    ]
    ideal = summary["ideal_hit_ratio"]
    for r in results:
        share = share_of_ideal_pct(r.hit_ratio, ideal)
        lines.append(
            f"{r.policy:<10} {r.capacity_blocks:>9} {r.capacity_fraction:>8.3f} {r.hit_ratio:>9.4f} "
            f"{share:>7.1f}% {r.evictions:>10} {r.eviction_us_p50:>8.2f} {r.accesses_per_s:>11,.0f}"
        )
    switched = [r for r in results if r.fallbacks]
    if switched:
        lines += ["", "shadow-LRU fallback (the workload-aware order trailed LRU and was replaced for a while):"]
        lines += [f"  {r.policy:<10} @ {r.capacity_blocks} blocks: {r.fallbacks} switch(es) to LRU" for r in switched]
    lines += ["", "capacity planning (smallest tested capacity reaching a share of the ideal hit ratio):"]
    for policy, answer in capacity_answers(results, ideal).items():
        parts = [f"{share}: {blocks if blocks is not None else 'not reached'}" for share, blocks in answer.items()]
        lines.append(f"  {policy:<10} " + "   ".join(parts))
    return "\n".join(lines)


def write_json(path: str | Path, summary: dict, results: Sequence[ReplayResult], extra: dict | None = None) -> None:
    payload = {"trace": summary, "results": [r.to_json() for r in results]}
    payload["capacity_planning"] = capacity_answers(results, summary["ideal_hit_ratio"])
    if extra:
        payload.update(extra)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def collect_until_interrupted(results: Iterable[T]) -> tuple[list[T], bool]:
    """The results of a long run, and whether Ctrl-C cut it short.

    An interrupted run still reports what finished: an hour of replays is not
    thrown away because the last capacity was taking too long.
    """
    done: list[T] = []
    try:
        for result in results:
            done.append(result)
    except KeyboardInterrupt:
        return done, True
    return done, False


def interrupted_note(done: int, planned: int) -> str:
    return f"kvgate: interrupted after {done} of {planned} runs; the results above are partial"


def plot_title(summary: dict, partial: bool) -> str:
    name = Path(summary["path"]).name
    return f"{name} (interrupted: partial results)" if partial else name


def write_plot(path: str | Path, summary: dict, results: Sequence[ReplayResult], partial: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_policy: dict[str, list[ReplayResult]] = defaultdict(list)
    for r in results:
        by_policy[r.policy].append(r)
    for policy, rows in by_policy.items():
        rows.sort(key=lambda r: r.capacity_fraction)
        ax.plot([r.capacity_fraction * 100 for r in rows], [r.hit_ratio for r in rows], marker="o", label=policy)
    ax.axhline(summary["ideal_hit_ratio"], color="black", linestyle="--", linewidth=1, label="ideal (infinite)")
    ax.set_xlabel("cache capacity (% of the trace's unique blocks)")
    ax.set_ylabel("hit ratio (prefix blocks)")
    ax.set_title(plot_title(summary, partial))
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
