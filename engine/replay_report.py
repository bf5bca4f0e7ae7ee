"""Presenting replay results: table, capacity-planning answer, JSON and plot."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from engine.replay import ReplayResult
from engine.traces import Trace
from engine.whole_file import written_whole

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
    """``hit_ratio`` as a percentage of ``ideal``, unrounded.

    A trace with no reuse has an ideal of 0, which any cache matches.
    """
    if not ideal:
        return 100.0
    return 100.0 * hit_ratio / ideal


def reaches(share_pct: float, target_pct: float) -> bool:
    """Whether a share of the ideal reaches a planning target: unrounded, so 94.96%
    does not count as 95% (the tolerance only absorbs float error)."""
    return share_pct >= target_pct - _TOLERANCE_PCT


def printed_share_pct(share_pct: float) -> float:
    """The share as the table prints it: cut (not rounded) to 0.1, so a printed
    95.0% always reaches 95% in the capacity plan, and 94.96% prints as 94.9%."""
    return math.floor((share_pct + _TOLERANCE_PCT) * 10) / 10


_TOLERANCE_PCT = 1e-9


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
                (r.capacity_blocks for r in rows if reaches(share_of_ideal_pct(r.hit_ratio, ideal), share)), None
            )
            for share in PLANNING_SHARES_PCT
        }
    return answers


def format_table(summary: dict, results: Sequence[ReplayResult], host_blocks: int | None = None) -> str:
    """The whole report: ``table_header``, a ``table_row`` per result, ``table_footer``."""
    if host_blocks is None:
        host_blocks = results[0].host_blocks if results else 0
    rows = [table_row(r, summary["ideal_hit_ratio"]) for r in results]
    return "\n".join([table_header(summary, host_blocks), *rows, table_footer(summary, results)])


def trace_line(summary: dict) -> str:
    return (f"trace {summary['path']} ({summary['format']}): {summary['requests']} requests, "
            f"{summary['accesses']} block accesses, {summary['unique_blocks']} unique blocks, "
            f"ideal hit ratio {summary['ideal_hit_ratio']:.4f}")


def host_tier_note(host_blocks: int) -> str:
    return f"host tier {host_blocks} blocks behind each device tier"


def table_header(summary: dict, host_blocks: int = 0) -> str:
    """What is printed before the first run finishes: the rows follow as they come."""
    lines = [trace_line(summary)]
    if host_blocks:
        lines.append(f"capacity = device tier; {host_tier_note(host_blocks)}")
    lines += [
        "",
        f"{'policy':<10} {'capacity':>9} {'fraction':>8} {'hit ratio':>9} {'vs ideal':>8} "
        f"{'evictions':>10} {'evict us':>8} {'accesses/s':>11}",
    ]
    return "\n".join(lines)


def table_row(r: ReplayResult, ideal: float) -> str:
    share = printed_share_pct(share_of_ideal_pct(r.hit_ratio, ideal))
    return (f"{r.policy:<10} {r.capacity_blocks:>9} {r.capacity_fraction:>8.3f} {r.hit_ratio:>9.4f} "
            f"{share:>7.1f}% {r.evictions:>10} {r.eviction_us_p50:>8.2f} {r.accesses_per_s:>11,.0f}")


def table_footer(summary: dict, results: Sequence[ReplayResult]) -> str:
    """What needs every row: the fallback summary and the capacity plan."""
    lines = []
    switched = [r for r in results if r.fallbacks]
    if switched:
        lines += ["", "shadow-LRU fallback (the workload-aware order trailed LRU and was replaced for a while):"]
        lines += [f"  {r.policy:<10} @ {r.capacity_blocks} blocks: {r.fallbacks} switch(es) to LRU" for r in switched]
    if not summary["ideal_hit_ratio"]:
        # Every cache "reaches" an ideal of 0: the smallest capacity tested would read as advice.
        lines += ["", "capacity planning: the trace reuses no block, so no capacity raises its hit ratio"]
        return "\n".join(lines)
    lines += ["", "capacity planning (smallest tested capacity reaching a share of the ideal hit ratio):"]
    for policy, answer in capacity_answers(results, summary["ideal_hit_ratio"]).items():
        parts = [f"{share}: {blocks if blocks is not None else 'not reached'}" for share, blocks in answer.items()]
        lines.append(f"  {policy:<10} " + "   ".join(parts))
    return "\n".join(lines)


@contextlib.contextmanager
def write_errors_as(error: type[Exception], flag: str, path: str | Path) -> Iterator[None]:
    """An output that fails as it is written (a full disk, a quota) raised as
    ``error`` with one line: the results are already on screen, a traceback
    would bury them.  A reader that left (`-o /dev/stdout | head`) is no failed
    write: it goes on as BrokenPipeError, which the CLI ends quietly (exit 141)."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise error(f"{flag}: cannot write {path}: {exc.strerror or exc}") from None


class OutputsInterrupted(KeyboardInterrupt):
    """A second signal while the outputs were written: which were, and which
    not, is said already (the CLI adds no line of its own)."""


def write_outputs(error: type[Exception], outputs: Sequence[tuple[str, str | None, Callable[[str], None]]]) -> bool:
    """Write each (flag, path, writer) whose path is set, with Ctrl-C and SIGTERM
    held until they are written: the runs behind them are finished, and a plot
    takes a second or so to draw, long enough for a late keypress to lose it.
    Each writer is given the path to write to, a file renamed over ``path`` once
    it is whole (``engine.whole_file``).  A second signal stops at once, leaves
    the file at ``path`` as it was, and says which was not written.  Returns whether
    Ctrl-C was pressed meanwhile; a held SIGTERM is delivered once the files are
    written, to whatever handles it."""
    held: list[int] = []

    def hold(signum, frame) -> None:
        held.append(signum)
        if len(held) > 1:
            raise KeyboardInterrupt

    # Handlers belong to the main thread; an ignored signal (SIGINT in a background job) stays ignored.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, hold)
    written: list[str] = []
    try:
        for flag, path, write in outputs:
            if not path:
                continue
            try:
                with write_errors_as(error, flag, path), written_whole(path) as target:
                    write(target)
            except KeyboardInterrupt:
                done = f"; {', '.join(written)} written" if written else ""
                print(f"kvgate: {flag} {path} not written (interrupted while written; "
                      f"any earlier file there is unchanged){done}", file=sys.stderr)
                raise OutputsInterrupted from None
            written.append(f"{flag} {path}")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    if signal.SIGTERM in held:
        # The CLI's handler notes it (exit status 143) and stops as Ctrl-C does.
        with contextlib.suppress(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    return bool(held)


def write_json(path: str | Path, summary: dict, results: Sequence[ReplayResult], extra: dict | None = None) -> None:
    payload = {"trace": summary, "results": [r.to_json() for r in results]}
    payload["capacity_planning"] = capacity_answers(results, summary["ideal_hit_ratio"])
    if extra:
        payload.update(extra)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def collect_until_interrupted(results: Iterable[T], on_result: Callable[[T], None] | None = None
                              ) -> tuple[list[T], bool]:
    """The results of a long run, and whether Ctrl-C cut it short.

    An interrupted run still reports what finished: an hour of replays is not
    thrown away because the last capacity was taking too long.  ``on_result``
    is told of each result as it finishes (to print it then, not at the end).
    """
    done: list[T] = []
    try:
        for result in results:
            done.append(result)
            if on_result is not None:
                on_result(result)
    except KeyboardInterrupt:
        return done, True
    return done, False


def print_row(line: str) -> None:
    """One result on stdout as soon as it is known, clear of the progress bar on
    stderr (tqdm lifts the bar, writes, and redraws it)."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()  # a pipe or a file is block-buffered: the row would wait for the end


def interrupted_note(done: int, planned: int) -> str:
    if not done:
        return "kvgate: interrupted before any run finished"
    if done == planned:  # Ctrl-C while the outputs were written, which it waited for
        return "kvgate: interrupted after every run had finished; the outputs were written first"
    return f"kvgate: interrupted after {done} of {planned} runs; the results above are partial"


def unfinished_outputs(outputs: Sequence[tuple[str, str | None]]) -> str | None:
    """The note for a run stopped before any result: which of the (flag, path)
    outputs given were left as they were (None when none was asked for).  An
    empty result is not written over an earlier run's."""
    named = [f"{flag} {path}" for flag, path in outputs if path]
    return f"kvgate: {', '.join(named)} not written: no run finished" if named else None


def plot_title(summary: dict, partial: bool, host_blocks: int = 0) -> str:
    title = Path(summary["path"]).name
    if host_blocks:
        title += f", host tier {host_blocks} blocks"  # the x axis is the device tier alone
    return f"{title} (interrupted: partial results)" if partial else title


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
    ax.set_title(plot_title(summary, partial, results[0].host_blocks if results else 0))
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def save_figure(fig, path: str | Path) -> None:
    """Write ``fig`` at ``path`` itself: a path without an extension is a PNG
    (matplotlib would write PATH.png)."""
    fig.savefig(path, dpi=110, format=None if os.path.splitext(path)[1] else "png")
