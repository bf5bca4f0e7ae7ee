"""A periodic status line in the log, as vLLM prints one: what the server did
since the last line and what its engines hold now.

    last 10 s: 12 requests, prompt 310 tok/s (62% cached), generation 45 tok/s; inprocess-0: 3 running, 1 waiting, KV 45% in use

Written only when something happened or is under way, so an idle server's
log stays quiet.  Counts come from the observer's ``finished`` hook (engine
requests that completed in the interval); queue and KV figures from each
replica's engine stats (none for external servers: their own logs have them).
"""

from __future__ import annotations

from typing import Iterable, Mapping


class StatusLog:
    __slots__ = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.requests = self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0

    def record(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.completion_tokens += completion_tokens

    def line(self, seconds: float, replicas: Iterable[tuple[str, int, Mapping | None]]) -> str | None:
        """The line for the last ``seconds`` and the replicas' (name, requests in
        flight, engine stats), then start a new interval; None when idle."""
        parts = []
        busy = self.requests > 0
        for name, inflight, stats in replicas:
            if stats and "running" in stats:
                running, waiting = int(stats["running"]), int(stats.get("waiting", 0))
                busy = busy or running or waiting
                part = f"{name}: {running} running, {waiting} waiting"
                device = (stats.get("blocks") or {}).get("device") or {}
                if device.get("total"):
                    part += f", KV {100 * device.get('in_use', 0) / device['total']:.0f}% in use"
            else:
                busy = busy or inflight
                part = f"{name}: {inflight} in flight"
            parts.append(part)
        if not busy:
            return None
        cached = f" ({100 * self.cached_tokens / self.prompt_tokens:.0f}% cached)" if self.prompt_tokens else ""
        head = (f"last {seconds:g} s: {self.requests} requests, prompt {self.prompt_tokens / seconds:.0f} tok/s{cached}, "
                f"generation {self.completion_tokens / seconds:.0f} tok/s")
        self._reset()
        return "; ".join([head, *parts])
