"""Prompts that bring replicas down ("queries of death"), found and refused.

A replica that dies loses every request it held, and the dispatcher sends those
elsewhere (each to at most router.lost_attempts replicas).  A prompt that is
itself the cause goes on killing a replica with every try, and again with every
retry of its client.  So each loss is recorded: the prompts a replica lost
together (one death) against that loss, and the losses against each prompt.  A
prompt lost in lost_attempts losses is refused for lost_quarantine_s once it is
the only prompt common to all of them.  The innocent requests that died beside
it on one replica do not follow it into every later loss; where some did (moved
with it each time), it takes one more loss to single it out, and they are not
refused.  A prompt served in full after a loss (on another replica, or asked
again) has shown it does not kill its replica: its losses are forgotten, so
that replicas dying for other reasons (out of memory, a node lost) never add up
to refusing a prompt that was merely being run each time, as a canary's is.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

from gateway.config import RouterConfig
from gateway.errors import ApiError, request_quarantined

log = logging.getLogger(__name__)

# Bounds on what is remembered (the oldest goes first): losses, and prompts lost.
_MAX_LOSSES = 256
_MAX_PROMPTS = 4096
# How often expired records are dropped while requests are checked.
_PRUNE_EVERY_S = 10.0


class LostPrompts:
    def __init__(self, config: Callable[[], RouterConfig], clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config  # read at each use: the router's settings as they are now
        self._clock = clock
        # loss -> (when, {prompt lost in it: the id of the request that held it}).
        self._losses: dict[tuple, tuple[float, dict[tuple, str]]] = {}
        self._prompts: dict[tuple, list[tuple]] = {}  # prompt -> the losses it was in
        self._refused: dict[tuple, float] = {}  # prompt -> refused until
        # Losses whose maps the bound on prompts cut: what is left of them would
        # single out a prompt that was lost beside another, forgotten one.
        self._cut: set[tuple] = set()
        self._next_prune = 0.0

    def __bool__(self) -> bool:
        """Anything to check a request against (else the request path skips it)."""
        return bool(self._prompts or self._refused)

    def note(self, prompt: tuple, loss: tuple, request_id: str) -> None:
        """``prompt`` was lost in ``loss`` (ReplicaLost.event), held by ``request_id``."""
        window = self._config().lost_quarantine_s
        if not window:
            return
        now = self._clock()
        record = self._losses.get(loss)
        if record is None:
            record = self._losses[loss] = (now, {})
            if len(self._losses) > _MAX_LOSSES:
                self._cut.discard(oldest := next(iter(self._losses)))
                del self._losses[oldest]
        record[1][prompt] = request_id
        seen = self._prompts.setdefault(prompt, [])
        if loss not in seen:
            seen.append(loss)
        if len(self._prompts) > _MAX_PROMPTS:
            # Forgotten in its losses too: a loss map holds only prompts still known
            # (a replica dropping connections for minutes is one loss, its map
            # grew with every request it lost until the window ended).  Those
            # losses single nobody out any more.
            oldest = next(iter(self._prompts))
            self._cut.update(self._prompts[oldest])
            self._forget(oldest)

    def served(self, prompt: tuple) -> None:
        """``prompt`` was answered in full: not what brought its replicas down.  (It
        also leaves the losses it was in, so that it no longer hides which prompt of
        those lost beside it did.)"""
        self._forget(prompt)

    def _forget(self, prompt: tuple) -> None:
        for loss in self._prompts.pop(prompt, ()):
            record = self._losses.get(loss)
            if record is not None:
                record[1].pop(prompt, None)

    def refusal(self, prompt: tuple, request_id: str) -> ApiError | None:
        """The error to refuse ``prompt`` with (``request_id`` asks for it), or None to serve it."""
        now = self._clock()
        if now >= self._next_prune:
            self._prune(now)
        until = self._refused.get(prompt)
        if until is not None:
            if until > now:
                return request_quarantined(math.ceil(until - now))
            del self._refused[prompt]
        seen = self._prompts.get(prompt)
        if seen is None:
            return None
        cfg = self._config()
        since = now - cfg.lost_quarantine_s  # losses older than the window are forgotten
        losses = [record[1] for loss in seen if (record := self._losses.get(loss)) and record[0] > since]
        if self._cut and any(loss in self._cut for loss in seen):
            return None  # a loss that forgot some of its prompts cannot tell which one it was
        if len(losses) < cfg.lost_attempts or set(losses[0]).intersection(*losses[1:]) != {prompt}:
            return None  # not lost often enough yet, or not singled out from those lost beside it
        self._refused[prompt] = now + cfg.lost_quarantine_s
        # Named by the requests that held it, which the access log and the clients' errors carry.
        log.warning("%s: its prompt was lost with %d replicas (in %s), alone among the requests lost with them "
                    "each time: refused for %g s (router.lost_quarantine_s)", request_id, len(losses),
                    ", ".join(dict.fromkeys(lost[prompt] for lost in losses)), cfg.lost_quarantine_s)
        return request_quarantined(math.ceil(cfg.lost_quarantine_s))

    def _prune(self, now: float) -> None:
        window = self._config().lost_quarantine_s
        self._next_prune = now + _PRUNE_EVERY_S
        self._refused = {prompt: until for prompt, until in self._refused.items() if until > now}
        self._losses = {loss: record for loss, record in self._losses.items() if record[0] > now - window}
        self._cut &= self._losses.keys()
        self._prompts = {prompt: kept for prompt, seen in self._prompts.items()
                         if (kept := [loss for loss in seen if loss in self._losses])}
