"""Online per-category reuse model for the workload-aware policy.

Each category w has a reuse probability p_w and an exponential reuse-gap rate
lambda_w (the ATC'25 characterisation: within a category, the time to the
next reuse is exponential).  Both are fitted from the *access stream*, not
from the cache: a metadata-only history remembers every key seen in the last
``history_horizon_s`` (cached or long evicted), so a reuse that comes after
the block was evicted is still observed.  Fitting from cached blocks only
censors every gap longer than the cache's residency and, in a small cache,
makes every category look fast and hopeless.

An access of a key opens an *episode* for the category it was accessed in;
the episode ends as a reuse (the key is accessed again: gap g) or is censored
(the key is still unseen at age a, or left the history).  The mixture
"reused with probability p after Exp(lambda), else never" is fitted to
reused gaps and censored ages by EM (a few warm-started iterations per
refit).  Gaps under ``gap_floor_s`` are left out of the rate fit, as the
authors did with 0.3 s: they are requests of the same burst, not reuse
timing.  Everything is windowed in trace/wall time, so the model only ever
learns from the past, and by one clock, the time each episode *opened*: a fit
sees every episode opened in its window once, as a reuse or censored.  (By
their ends instead, the episodes that opened a window earlier and were never
reused would count, censored at the horizon, without those of the same age
that were reused before the window: p came out about 40% low.)

Categories may belong to a group (the sub-classes of one (workload, type,
turn): signature slots, position classes).  A member short of evidence takes
its group's pooled fit (all members' evidence summed) before the config prior:
a prior rate (0.15/s for to-C) is far too fast for file requests, whose reuse
gaps are minutes.
"""

from __future__ import annotations

import math
from collections import OrderedDict

# Censored ages are binned by last-access time; this many bins span the horizon.
_AGE_BINS = 64


def fit_lambda(gaps: list[float], floor: float = 0.0) -> float:
    """Maximum-likelihood rate of an exponential fitted to ``gaps`` above ``floor``.

    Memorylessness makes (g - floor | g > floor) exponential with the same
    rate, so the MLE is 1 / mean(g - floor).  Returns 0.0 without data.
    """
    kept = [g - floor for g in gaps if g >= floor]
    total = sum(kept)
    if not kept or total <= 0:
        return 0.0
    return len(kept) / total


def fit_mixture(
    n_fast: int,
    n_slow: int,
    sum_slow: float,
    censored: list[tuple[float, float]],
    floor: float,
    lam: float,
    p: float,
    iterations: int = 8,
) -> tuple[float, float]:
    """EM fit of (lambda, p) to reuses and censored (age, count) groups.

    Model: an episode is reused with probability p after floor + Exp(lambda);
    a censored episode of age a has survived, which has probability
    1 - p + p * exp(-lambda * (a - floor)).  ``n_fast`` reuses came before
    the floor (they count towards p only); ``n_slow`` came after it, their
    gaps minus the floor summing to ``sum_slow``.  Starts from (lam, p).
    """
    n_reused = n_fast + n_slow
    n_cens = sum(count for _, count in censored)
    total = n_reused + n_cens
    if total == 0:
        return lam, p
    if n_cens == 0:
        return (n_slow / sum_slow if n_slow and sum_slow > 0 else lam), 1.0
    ages = [(max(age - floor, 0.0), count) for age, count in censored]
    slow_share = n_slow / n_reused if n_reused else 1.0
    lam = max(lam, 1e-6)
    p = min(max(p, 1e-4), 1.0 - 1e-4)
    for _ in range(iterations):
        expected_reuses = 0.0
        expected_time = 0.0
        for age, count in ages:
            survive = math.exp(-lam * age)
            w = p * survive / (1.0 - p + p * survive)
            expected_reuses += count * w
            # A censored episode that will be reused has waited `age` and,
            # memoryless, waits 1/lambda more on average.
            expected_time += count * w * (age + 1.0 / lam)
        p = min(max((n_reused + expected_reuses) / total, 1e-4), 1.0 - 1e-4)
        slow_expected = expected_reuses * slow_share
        denominator = sum_slow + expected_time * slow_share
        if n_slow + slow_expected > 0 and denominator > 0:
            lam = max((n_slow + slow_expected) / denominator, 1e-6)
    return lam, p


class CategoryStats:
    """Windowed evidence, binned by the time each episode opened, and the current
    fit for one category."""

    __slots__ = ("reuses", "expired", "pending", "lam", "p", "fitted", "prior_lam", "prior_p")

    def __init__(self, prior_lam: float, prior_p: float, ring: int) -> None:
        # Ended episodes, by their opening bin (reuses end out of that order).
        self.reuses: dict[int, list] = {}  # bin -> [fast reuses, slow reuses, sum of slow gaps - floor]
        self.expired: dict[int, list] = {}  # bin -> [count, sum of ages at expiry]
        self.pending: list[int] = [0] * ring  # open episodes by last-access bin (mod ring)
        self.prior_lam = prior_lam
        self.prior_p = prior_p
        self.lam = prior_lam
        self.p = prior_p
        self.fitted = False

    def counts(self) -> tuple[int, int, float]:
        fast = slow = 0
        total = 0.0
        for f, s, g in self.reuses.values():
            fast += f
            slow += s
            total += g
        return fast, slow, total


class ReuseModel:
    """Metadata-only access history plus per-category (lambda, p) fits.

    Per access the caller runs ``observe`` (closes the key's open episode as a
    reuse and returns its history entry, None when unseen) and then ``open``
    with the category of this access.
    """

    def __init__(
        self,
        *,
        gap_floor_s: float,
        window_s: float,
        min_samples: int,
        refit_interval_s: float,
        history_horizon_s: float,
        history_max_blocks: int,
        em_iterations: int = 6,
    ) -> None:
        self.floor = gap_floor_s
        self.window = window_s
        self.min_samples = min_samples
        self.refit_interval = refit_interval_s
        self.horizon = history_horizon_s
        self.max_blocks = history_max_blocks
        self.em_iterations = em_iterations
        self.bin_s = max(history_horizon_s / _AGE_BINS, 1e-3)
        # Open episodes are never older than the horizon plus one refit interval.
        self.ring = _AGE_BINS + math.ceil(refit_interval_s / self.bin_s) + 8
        # key -> [last access time, category, session, shared]; oldest first.
        self.history: OrderedDict[int, list] = OrderedDict()
        self.stats: list[CategoryStats] = []
        # Optional pooling: a category with too little evidence of its own takes
        # the fit of its group (the evidence of all members summed) before the prior.
        self.group_of: list[int] = []
        self.group_index: dict[object, int] = {}
        self.group_fit: list[list] = []  # [lam, p, fitted]
        self.next_refit = -math.inf
        self.refits = 0

    def add_category(self, prior_lam: float, prior_p: float, group: object = None) -> int:
        self.stats.append(CategoryStats(prior_lam, prior_p, self.ring))
        g = -1
        if group is not None:
            g = self.group_index.get(group, -1)
            if g < 0:
                g = self.group_index[group] = len(self.group_fit)
                self.group_fit.append([prior_lam, prior_p, False])
        self.group_of.append(g)
        return len(self.stats) - 1

    def observe(self, key: int, now: float) -> list | None:
        entry = self.history.get(key)
        if entry is None:
            return None
        last = entry[0]
        stats = self.stats[entry[1]]
        bin_s = self.bin_s
        b = int(last / bin_s)  # the episode's, not the reuse's
        stats.pending[b % self.ring] -= 1
        row = stats.reuses.get(b)
        if row is None:
            row = stats.reuses[b] = [0, 0, 0.0]
        gap = now - last
        if gap < self.floor:
            row[0] += 1
        else:
            row[1] += 1
            row[2] += gap - self.floor
        self.history.move_to_end(key)
        return entry

    def open(self, key: int, entry: list | None, cat: int, session: object, shared: bool, now: float) -> list:
        if entry is None:
            entry = [now, cat, session, shared]
            self.history[key] = entry
        else:
            entry[0] = now
            entry[1] = cat
            entry[3] = shared
        self.stats[cat].pending[int(now / self.bin_s) % self.ring] += 1
        return entry

    def expire(self, now: float) -> None:
        """Censor for good the episodes older than the horizon (or beyond the size cap)."""
        history = self.history
        limit = now - self.horizon
        while history:
            key = next(iter(history))
            entry = history[key]
            if entry[0] > limit and len(history) <= self.max_blocks:
                break
            del history[key]
            stats = self.stats[entry[1]]
            b = int(entry[0] / self.bin_s)
            stats.pending[b % self.ring] -= 1
            row = stats.expired.get(b)
            if row is None:
                row = stats.expired[b] = [0, 0.0]
            row[0] += 1
            row[1] += now - entry[0]

    def maybe_refit(self, now: float) -> bool:
        if now < self.next_refit:
            return False
        self.next_refit = now + self.refit_interval
        self.refit(now)
        return True

    def refit(self, now: float) -> None:
        self.expire(now)
        self.refits += 1
        first_bin = int((now - self.window) / self.bin_s)
        ring = self.ring
        now_bin = int(now / self.bin_s)
        # Episodes that opened in the window: ended ones and the still open.
        bins = range(max(now_bin - ring + 1, first_bin), now_bin + 1)
        evidence = []
        for stats in self.stats:
            pending = stats.pending
            for ended in (stats.reuses, stats.expired):
                for b in [b for b in ended if b < first_bin]:
                    del ended[b]
            fast, slow, sum_slow = stats.counts()
            censored = [(now - (b + 0.5) * self.bin_s, pending[b % ring]) for b in bins if pending[b % ring]]
            censored.extend((age / n, n) for n, age in stats.expired.values() if n)
            episodes = fast + slow + sum(n for _, n in censored)
            evidence.append((fast, slow, sum_slow, censored, episodes))
        groups = self._fit_groups(evidence) if self.group_fit else None
        for cat, stats in enumerate(self.stats):
            fast, slow, sum_slow, censored, episodes = evidence[cat]
            g = self.group_of[cat]
            pooled = groups[g] if groups is not None and g >= 0 else None
            if episodes < self.min_samples:
                if pooled is not None and pooled[2]:
                    stats.lam, stats.p, stats.fitted = pooled[0], pooled[1], False
                else:
                    stats.lam, stats.p, stats.fitted = stats.prior_lam, stats.prior_p, False
                continue
            start_lam = stats.lam if stats.fitted else stats.prior_lam
            start_p = stats.p if stats.fitted else stats.prior_p
            lam, p = fit_mixture(fast, slow, sum_slow, censored, self.floor, start_lam, start_p, self.em_iterations)
            # Too few timed reuses to trust a rate: the group's rate, else the prior rate; the fitted p.
            if slow >= self.min_samples:
                stats.lam = lam
            elif pooled is not None and pooled[3]:
                stats.lam = pooled[0]
            else:
                stats.lam = stats.prior_lam
            stats.p = p
            stats.fitted = True

    def _fit_groups(self, evidence: list[tuple]) -> list[list]:
        """Pooled fits [lam, p, fitted, rate fitted] of the groups that have a member short of evidence."""
        needed = set()
        for cat, (_, slow, _, _, episodes) in enumerate(evidence):
            g = self.group_of[cat]
            if g >= 0 and (episodes < self.min_samples or slow < self.min_samples):
                needed.add(g)
        out: list[list] = [[f[0], f[1], False, False] for f in self.group_fit]
        for g in needed:
            fast = slow = episodes = 0
            sum_slow = 0.0
            censored: list[tuple[float, float]] = []
            for cat, ev in enumerate(evidence):
                if self.group_of[cat] == g:
                    fast += ev[0]
                    slow += ev[1]
                    sum_slow += ev[2]
                    censored.extend(ev[3])
                    episodes += ev[4]
            fit = self.group_fit[g]
            if episodes < self.min_samples:
                continue
            lam, p = fit_mixture(fast, slow, sum_slow, censored, self.floor, fit[0], fit[1], self.em_iterations)
            rate = slow >= self.min_samples
            if rate:
                fit[0] = lam
            fit[1], fit[2] = p, True
            out[g] = [fit[0], p, True, rate]
        return out
