"""How long the event loop is held in one piece while something runs on it."""

from __future__ import annotations

import asyncio
import time


class LoopWatch:
    """``async with LoopWatch() as watch: ...``: ``watch.longest`` is then the
    longest stretch (seconds) in which a task of its own could not run, i.e. the
    longest any other work held the loop, as every request in flight would wait."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._done = False
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        last = time.perf_counter()
        while not self._done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            self.longest, last = max(self.longest, now - last), now

    async def __aenter__(self) -> LoopWatch:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)  # its first turn
        return self

    async def __aexit__(self, *exc) -> None:
        self._done = True
        await self._task
