"""Traffic rhythm (to-B spikes on the hour) and topic-switch detection (to-C).

Both learn from arrivals only (request starts), in the order they happen.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque


# Idle minutes stepped through at most between two arrivals (one week).
_MAX_IDLE_MINUTES = 7 * 24 * 60
# A measured spike lasts this long after the rate last exceeded the threshold.
_SPIKE_HOLD_S = 60.0

class TrafficRhythm:
    """Per-minute-of-hour arrival profile and a spike state.

    The profile is an average of the arrivals seen in each minute of the hour
    over the hours seen so far; the baseline is its median over observed
    minutes (robust to the spike minutes themselves).  The state is "spike"
    when the arrivals of the trailing ``rate_window_s`` exceed
    ``spike_factor`` x baseline, or, with ``prearm``, when the coming minute
    is a recurring one: it spiked in at least two hours, and in at least half
    of the hours seen since there was a baseline.  One burst is no rhythm: on
    a to-B trace, marking a minute after a single spike pre-armed ten minutes
    of the hour, most of them for bursts that never came back.
    """

    def __init__(
        self,
        spike_factor: float = 2.0,
        rate_window_s: float = 10.0,
        min_baseline_minutes: int = 10,
        prearm: bool = True,
        prearm_lead_minutes: int = 1,
    ) -> None:
        self.factor = spike_factor
        self.rate_window = rate_window_s
        self.min_minutes = min_baseline_minutes
        self.prearm = prearm
        self.lead = prearm_lead_minutes
        self.sums = [0.0] * 60  # arrivals per minute-of-hour, summed over hours
        self.hours = [0] * 60  # completed minutes observed per minute-of-hour
        self.minute: int | None = None  # absolute minute being counted
        self.count = 0
        self.recent: deque[float] = deque()
        self.baseline = 0.0
        self.minutes_seen = 0
        # Per minute-of-hour: hours judged against a baseline, and those that spiked.
        self.judged = [0] * 60
        self.spiked = [0] * 60
        # Minutes-of-hour that spike hour after hour (learned recurrence).
        self.recurring: set[int] = set()
        self.spiking = False
        self.prearmed = False
        self.measured_until = -math.inf  # the measured spike holds until then

    def _close_minutes(self, minute: int) -> None:
        if self.minute is None:
            self.minute = minute
            return
        while self.minute < minute:
            slot = self.minute % 60
            count = self.count
            self.sums[slot] += count
            self.hours[slot] += 1
            self.minutes_seen += 1
            self.count = 0
            self.minute += 1
            if self.baseline > 0:
                self.judged[slot] += 1
                self.spiked[slot] += count > self.factor * self.baseline
                if self.spiked[slot] >= 2 and 2 * self.spiked[slot] >= self.judged[slot]:
                    self.recurring.add(slot)
                else:
                    self.recurring.discard(slot)
            if self.minutes_seen >= self.min_minutes:
                means = sorted(self.sums[m] / self.hours[m] for m in range(60) if self.hours[m])
                # The median minute; the mean when most minutes are empty (API
                # traffic that comes only on the hour), or nothing would ever spike.
                self.baseline = means[len(means) // 2] or sum(means) / len(means)
            if minute - self.minute > _MAX_IDLE_MINUTES:
                # A longer silence (a gap in a trace) adds nothing but more empty
                # minutes: a week of them stands for all, instead of stepping
                # through years of trace time minute by minute.
                self.minute = minute - _MAX_IDLE_MINUTES

    def arrival(self, now: float) -> None:
        self.update(now)
        self.count += 1
        self.recent.append(now)

    def update(self, now: float) -> bool:
        """Advance to ``now``; returns the spike state."""
        self._close_minutes(int(now // 60))
        recent = self.recent
        limit = now - self.rate_window
        while recent and recent[0] < limit:
            recent.popleft()
        if self.baseline <= 0:
            self.spiking = self.prearmed = False
            return False
        per_minute = len(recent) * 60.0 / self.rate_window
        measured = per_minute > self.factor * self.baseline
        # A spike ends once the rate has stayed under the threshold for a minute
        # (the profile's own step): traffic hovering at it flipped the state, and
        # logged it, several times a minute, some flips 0.2 s apart (a few
        # arrivals in a 10 s window are a noisy rate; a 10 s hold still flipped
        # 10-16 times in 5 minutes, a minute's 1-3 times).
        if measured:
            self.measured_until = now + _SPIKE_HOLD_S
        elif now < self.measured_until:
            measured = True
        minute = int(now // 60)
        self.prearmed = self.prearm and any(
            (minute + ahead) % 60 in self.recurring for ahead in range(0, self.lead + 1)
        )
        self.spiking = measured or self.prearmed
        return self.spiking

    def profile(self) -> list[float]:
        return [self.sums[m] / self.hours[m] if self.hours[m] else math.nan for m in range(60)]


class TopicSwitchDetector:
    """Flags a to-C session whose last ``turns`` arrivals were each under ``max_gap_s`` apart."""

    def __init__(self, turns: int = 3, max_gap_s: float = 15.0, max_sessions: int = 200_000) -> None:
        self.turns = turns
        self.max_gap = max_gap_s
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[object, deque[float]] = OrderedDict()

    def arrival(self, session: object, now: float) -> bool:
        # Sessions are in the order of their last arrival.  One quiet for max_gap_s
        # or longer is forgotten: its next arrivals start a fresh run anyway (the
        # stale gap would sit in each of its next turns-1 checks), so the flags are
        # the same and only sessions active in the last max_gap_s are kept.
        sessions = self.sessions
        stale = now - self.max_gap
        while sessions:
            oldest = next(iter(sessions.values()))
            if oldest[-1] > stale:
                break
            sessions.popitem(last=False)
        times = sessions.get(session)
        if times is None:
            times = self.sessions[session] = deque(maxlen=self.turns)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(session)
        times.append(now)
        if len(times) < self.turns:
            return False
        return all(b - a < self.max_gap for a, b in zip(times, list(times)[1:]))
