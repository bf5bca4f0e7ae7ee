"""Reuse rate per (workload, type) at minute granularity.

The reuse rate of a minute is cached prompt tokens / prompt tokens of the
requests that finished prefill in it (engine-actual, not predicted).  The
metric shows the last *full* minute, so a value never jumps about while its
minute fills.
"""

from __future__ import annotations

from collections import defaultdict


class MinuteReuse:
    def __init__(self) -> None:
        self._minute: int | None = None
        self._current: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self._last: dict[tuple[str, str], float] = {}

    def record(self, workload: str, request_type: str, prompt_tokens: int, cached_tokens: int, now: float) -> None:
        self._roll(now)
        tally = self._current[(workload, request_type)]
        tally[0] += prompt_tokens
        tally[1] += cached_tokens

    def last_full_minute(self, now: float) -> dict[tuple[str, str], float]:
        """(workload, type) -> reuse rate over the last full minute."""
        self._roll(now)
        return dict(self._last)

    def _roll(self, now: float) -> None:
        minute = int(now // 60)
        if self._minute is None:
            self._minute = minute
        if minute == self._minute:
            return
        if minute == self._minute + 1:
            self._last = {key: cached / prompt for key, (prompt, cached) in self._current.items() if prompt}
        else:
            self._last = {}  # an idle minute passed: nothing was served in the last full one
        self._current.clear()
        self._minute = minute
