"""A periodic status line in the log, as vLLM prints one: what the server did
since the last line and what its engines hold now.

    last 10 s: 12 answered, 2 refused (4xx), 1 failed (5xx), prompt 310 tok/s (62% cached), generation 45 tok/s; inprocess-0: 3 running, 1 waiting, KV 45% in use; vllm-1: down

Written only when something happened or is under way, so an idle server's
log stays quiet.  Requests (client requests answered in full, as
kvgate_requests_total's 200s) and prompt tokens (of the engine requests that
completed, where their replicas said their hits) are the differences of the
/stats history's running totals;
generation tokens are counted as they arrive, as vLLM counts them per step, so
a long stream shows its rate while it runs rather than all at its end; queue and KV figures
come from each replica's engine stats (none for external servers: their own
logs have them).  Errors are the responses other than 200 and 499 in the
interval, apart as a reader at 3 a.m. wants them: refused (the clients' 4xx),
over limits (429: the gateway or its engines at capacity) and failed (5xx);
"left" counts the requests whose client went away before the end (499); each
is shown when there are any.  A replica out of routing shows as down, or as
draining (stopping) or stalled (a hung model step); absent ones (slots of an
entry with a count whose pods do not exist) are only counted, at the end, so a
fleet of 2 pods in 8 slots does not read as 6 down.  Tokens alone (a stream
whose client left) make a line too.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol


class Totals(Protocol):
    """Running totals since start (gateway.stats.StatsHistory has them)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int


class StatusLog:
    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen = (0, 0, 0, 0, 0, 0, 0, 0)  # the totals at the last line

    def line(self, seconds: float, totals: Totals, replicas: Iterable[tuple[str, int, Mapping | None, str]],
             errors: tuple[int, int, int] = (0, 0, 0), generated: int = 0, left: int = 0) -> str | None:
        """The line for the last ``seconds``: ``totals``, ``errors`` (refused,
        over limits and failed responses since start), ``generated`` (tokens
        generated since start) and ``left`` (499s since start) against the last
        line's, and the replicas' (name, requests in flight, engine stats,
        state: "up", or "down", "draining", "stalled", "absent"); None when idle."""
        now = (totals.requests, totals.prompt_tokens, totals.cached_tokens, generated, *errors, left)
        requests, prompt, cached, completion, refused, limited, failed, gone = (
            a - b for a, b in zip(now, self._seen))
        self._seen = now
        parts = []
        busy = requests > 0 or refused or limited or failed or gone > 0 or prompt > 0 or completion > 0
        absent = 0
        for name, inflight, stats, state in replicas:
            if state == "absent":
                absent += 1
                continue
            if state != "up":
                busy = busy or inflight
                part = f"{name}: {state}" + (f", {inflight} in flight" if inflight else "")
            elif stats and "running" in stats:
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
        if absent:
            parts.append(f"{absent} absent")
        if not busy:
            return None
        share = f" ({100 * cached / prompt:.0f}% cached)" if prompt else ""
        errs = "".join(f", {n} {what}" for n, what in ((refused, "refused (4xx)"), (limited, "over limits (429)"),
                                                        (failed, "failed (5xx)"), (gone, "left")) if n)
        head = (f"last {round(seconds, 1):g} s: {requests} answered{errs}, prompt {prompt / seconds:.0f} tok/s{share}, "
                f"generation {completion / seconds:.0f} tok/s")
        return "; ".join([head, *parts])
