"""Workload-aware eviction (ATC'25 "KVCache Cache in the Wild", plus the blog's additions).

A *category* is (workload, type, turn bucket) plus, where it pays, a few
classes: position in the prompt, blocks shared across sessions, a predicted
topic switch, a file signature slot.  K stays in the tens (``wa-paper`` gives
every turn its own category, as the paper: ~90 on a 2-hour to-C trace).  Each category
keeps its evictable keys in last-release order (vLLM's tail-first release);
inside a category the reuse term falls with the time since last access, so an
eviction scores only the K queue heads: O(K), whatever the number of blocks.
That is exact for the paper's score, but for ties: keys of two requests
released at the same instant score alike, and the first request's head blocks
go before the second's deeper ones, where (priority, -offset) would take the
deeper first (71 such evictions in a Mooncake replay at 5%; an exact order gave
the same hits at five capacities).  The weighted score also carries each
key's own spatial factor, so the head is the oldest key of its category but
not always its lowest score: 56-66% of weighted evictions were not the exact
minimum on 400 s synth traces (to-C, mixed; 2026-12-06), and evicting the exact
minimum instead (a scan of every key) moved the hit ratio by -0.15%, -0.05%
and +2.4% in three runs.  Mixed, so the O(K) approximation stays; position
classes (``position_classes``) narrow the spread of spatial factors in a queue.

Scores (lowest evicted first, ties to the deeper offset):
- ``paper``: p_w * (e^{-l t} - e^{-l (t+life)}), the authors' priority.
- ``weighted``: R * (w_r + w_s * spatial) + w_l * [t < W] (``spatial_mode:
  scale``, the default) or w_r * R + w_s * spatial + w_l * [t < W] (``add``),
  where R is the chance of a reuse within ``life`` given that none came in the
  first t seconds (the posterior of the p/exponential mixture), spatial =
  1 - offset/blocks (x boost for long prompts) and W = min(c/lambda, max) the
  lifetime window.

(lambda, p) per category are fitted online by ``ReuseModel`` from a
metadata-only history, so reuses after eviction are observed too.  A shadow
LRU of the same capacity runs beside the policy; when the policy trails it
for a sustained window the tier falls back to LRU order (rebuilt from the
keys' last-access times, so the switch needs no replay) and a metadata-only
clone of this policy decides when to switch back.

A child block is only ever hit through its parent (prefix semantics), so a
parent is worth at least what its children are.  LRU gets this for free (a
request touches the parent with the child and releases it later); categories
break it (a shared system prompt or file template may score below the private
blocks behind it).  ``protect_prefix: leaf`` restores it: a block with cached
children waits, out of the queues, until its last child is gone (leaf-only
eviction, as in a radix tree).  ``cascade`` (the earlier default) evicts any
block and its cached children right after it.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque

from engine.config import WorkloadAwareConfig
from engine.context import RequestContext
from engine.policies.base import EvictionPolicy, NoEvictableBlock
from engine.policies.reuse_model import ReuseModel
from engine.policies.rhythm import TopicSwitchDetector, TrafficRhythm
from engine.policies.shadow import ShadowLRU

log = logging.getLogger("kvgate.cache")

INF = math.inf
# Relative score discount per block of offset: among equal scores the deeper block
# goes first (the paper's -offset).  Relative, not additive, so that it only
# separates scores equal to ~9 digits: old blocks score 1e-20 and less, and an
# additive epsilon there would rank by offset instead of by reuse chance.
_TIE = 1e-9
# Added to every score before the discount, so that scores whose exponential
# underflowed to 0 (a block hundreds of lifetimes old) still go deepest first;
# far below any score that did not underflow.
_FLOOR = 1e-290
_exp = math.exp
_COUNTS = 6  # the windowed hit counts per bucket (see WorkloadAwarePolicy._cur)


def paper_priority(lam: float, p: float, t: float, life: float) -> float:
    """The paper's ReuseProb_w(t, life) = e^{-lam t} - e^{-lam (t+life)}, times p_w (authors' PR)."""
    return p * (math.exp(-lam * t) - math.exp(-lam * (t + life)))


def posterior_reuse(lam: float, p: float, t: float, life: float) -> float:
    """P(reuse within the next ``life`` s | no reuse in the t s since the last access)."""
    e = math.exp(-lam * t)
    q = p * e / (1.0 - p + p * e)
    return q * (1.0 - math.exp(-lam * life))


class CategoryTable:
    """Category ids and their current scoring constants, shared by the real queues and shadows."""

    def __init__(self, cfg: WorkloadAwareConfig, model: ReuseModel) -> None:
        self.cfg = cfg
        self.model = model
        self.paper = cfg.mode == "paper"
        self.index: dict[tuple, int] = {}
        self.names: list[tuple] = []
        self.to_b: list[bool] = []
        self.fifo: list[bool] = []
        self.penalty: list[float] = []
        # Scoring constants, refreshed after each refit.
        self.lam: list[float] = []
        self.p: list[float] = []
        self.one_minus: list[float] = []  # 1 - e^{-lambda life}
        self.window: list[float] = []  # lifetime window W
        self.coef_a: list[float] = []
        self.coef_b: list[float] = []
        self.coef_l: list[float] = []
        # Unified form of the paper and scaled scores: fa * e / (1 + fb * e) * w,
        # e = exp(-lambda t), w = the key's spatial factor (1 in paper mode).
        self.fa: list[float] = []
        self.fb: list[float] = []
        w = cfg.weights
        self.wr, self.ws, self.wl = w.reuse, w.spatial, w.lifetime
        self.scaled = w.spatial_mode == "scale" and not self.paper
        # Scores of this form are computed from cached head data, without the window term.
        self.fast = self.paper or (self.scaled and self.wl == 0.0)
        self.life = cfg.life_s if cfg.life_s is not None else 30.0
        self.relax = 1.0
        self.version = 0  # bumped whenever constants change (score caches drop)

    def __len__(self) -> int:
        return len(self.names)

    def get(self, name: tuple, workload: str, rtype: str, switch: bool) -> int:
        cat = self.index.get(name)
        if cat is not None:
            return cat
        if len(self.names) >= self.cfg.max_categories:
            overflow = ("overflow", workload)
            cat = self.index.get(overflow)
            if cat is None:
                cat = self._add(overflow, workload, rtype, False)
            self.index[name] = cat
            return cat
        return self._add(name, workload, rtype, switch)

    def _add(self, name: tuple, workload: str, rtype: str, switch: bool) -> int:
        cfg = self.cfg
        prior_lam = cfg.model.prior_lambda.get(workload, cfg.model.prior_lambda.get("to-c", 0.15))
        # Sub-classes of one (workload, type, turn) (signature slots, positions)
        # share a pooled fit while one of them lacks evidence.
        group = name[:3] if not self.paper and len(name) == 5 else None
        cat = self.model.add_category(prior_lam, cfg.model.prior_p, group)
        assert cat == len(self.names)
        self.index[name] = cat
        self.names.append(name)
        self.to_b.append(workload == "to-b")
        kind = cfg.overrides.get(rtype) or cfg.overrides.get(workload) or "wa"
        self.fifo.append(kind == "fifo")
        self.penalty.append(cfg.topic_switch.penalty if switch else 1.0)
        self.lam.append(0.0)
        self.p.append(0.0)
        self.one_minus.append(0.0)
        self.window.append(0.0)
        self.coef_a.append(0.0)
        self.coef_b.append(0.0)
        self.coef_l.append(0.0)
        self.fa.append(0.0)
        self.fb.append(0.0)
        self._refresh(cat)
        self.version += 1
        return cat

    def _refresh(self, cat: int) -> None:
        stats = self.model.stats[cat]
        lam = max(stats.lam, 1e-9)
        relax = self.relax if self.to_b[cat] else 1.0
        self.lam[cat] = lam
        self.p[cat] = min(max(stats.p, 1e-6), 1.0 - 1e-6)
        self.one_minus[cat] = 1.0 - math.exp(-lam * self.life * relax)
        self.window[cat] = min(self.cfg.lifetime_c / lam, self.cfg.lifetime_max_s) * relax
        # Folded constants of the weighted score: reuse = a e / (1 + b e), e = exp(-lambda t).
        p = self.p[cat]
        b = p / (1.0 - p)
        pen = self.penalty[cat]
        self.coef_a[cat] = (1.0 if self.scaled else self.wr) * self.one_minus[cat] * b * pen
        self.coef_b[cat] = b
        self.coef_l[cat] = self.wl * pen
        if self.paper:
            self.fa[cat] = self.p[cat] * self.one_minus[cat]
            self.fb[cat] = 0.0
        else:
            self.fa[cat] = self.coef_a[cat]
            self.fb[cat] = b

    def refresh(self) -> None:
        for cat in range(len(self.names)):
            self._refresh(cat)
        self.version += 1


class CategoryQueues:
    """The O(K) structure: per-category queues of evictable keys, scored at the heads.

    ``rec[key] = [category, last access, offset, spatial factor]`` for every
    key held.  A key is evictable iff it sits in a queue and is not in use, or
    sits in the orphan queue (cached children of a parent that went: they can
    no longer be hit as a prefix, so they go first).  In-use keys of ordinary
    classes are out of the queues, and so are idle keys with cached children
    in leaf mode (``pinned``); a FIFO class keeps its keys in insertion order,
    in use or not, and passes over the busy ones.
    """

    def __init__(self, table: CategoryTable, protect_prefix: str | bool) -> None:
        self.table = table
        self.fifo = table.fifo
        if protect_prefix is True:
            protect_prefix = "leaf"
        self.mode = protect_prefix or "off"
        self.protect = self.mode != "off"
        self.leaf = self.mode == "leaf"
        self.pinned: set[int] = set()  # idle keys with cached children (leaf mode): not evictable
        self.queues: list[OrderedDict[int, None]] = []
        self.nq = 0
        self.rec: dict[int, list] = {}
        self.orphans: OrderedDict[int, None] = OrderedDict()
        self.parent: dict[int, int] = {}
        self.children: dict[int, set[int]] = {}
        self.busy: set[int] = set()  # in-use keys still queued in a FIFO class
        self.heads: list[float] = []  # cached head score per queue
        # Cached head data per queue (fast scores): last access (None: empty),
        # spatial factor, offset tie-break; valid for every queue not in `dirty`
        # while heads_cached is true.
        self.head_t: list[float | None] = []
        self.head_w: list[float] = []
        self.head_tie: list[float] = []
        self.heads_cached = False
        self.heads_now: float | None = None
        self.heads_version = -1
        self.dirty: set[int] = set()
        self.evictable = 0

    def clone(self) -> "CategoryQueues":
        other = CategoryQueues(self.table, self.mode)
        other.pinned = set(self.pinned)
        other.queues = [OrderedDict(q) for q in self.queues]
        other.nq = self.nq
        other.heads = list(self.heads)
        other.head_t = list(self.head_t)
        other.head_w = list(self.head_w)
        other.head_tie = list(self.head_tie)
        other.rec = {k: list(v) for k, v in self.rec.items()}
        other.orphans = OrderedDict(self.orphans)
        other.parent = dict(self.parent)
        other.children = {k: set(v) for k, v in self.children.items()}
        other.busy = set(self.busy)
        other.evictable = self.evictable
        return other

    def __contains__(self, key: int) -> bool:
        return key in self.rec

    def __len__(self) -> int:
        return len(self.rec)

    def _grow(self) -> None:
        queues, heads = self.queues, self.heads
        while len(queues) < len(self.table):
            queues.append(OrderedDict())
            heads.append(INF)
            self.head_t.append(None)
            self.head_w.append(1.0)
            self.head_tie.append(1.0)
        self.nq = len(queues)
        self.heads_now = None

    def _link(self, key: int, parent: int) -> None:
        kids = self.children.get(parent)
        if kids is not None:
            kids.add(key)
            self.parent[key] = parent
        elif parent in self.rec:
            self.children[parent] = {key}
            self.parent[key] = parent

    def access(self, key: int, cat: int, now: float, offset: int, spatial: float, parent: int | None) -> None:
        """``key`` is hit or inserted: it is in use until ``release``."""
        if cat >= self.nq:
            self._grow()
        rec = self.rec.get(key)
        if rec is None:
            self.rec[key] = [cat, now, offset, spatial]
            if parent is not None and self.protect:
                self._link(key, parent)
            return
        old = rec[0]
        if self.orphans and self.orphans.pop(key, 0) is None:
            # An orphan hit again (its parent came back): in use, out of the orphan
            # queue, whatever its class; its release queues it afresh.
            self.evictable -= 1
        elif self.fifo[old]:
            q = self.queues[old]
            if old == cat:
                # A FIFO class keeps the key's place and its insertion time.
                if key in q and key not in self.busy:
                    self.busy.add(key)
                    self.evictable -= 1
                    # It may be the head whose score is cached: rescore (the scan passes over it).
                    self.dirty.add(old)
                rec[2] = offset
                rec[3] = spatial
                return
            if q.pop(key, 0) is None:
                self.dirty.add(old)
                if key in self.busy:
                    self.busy.discard(key)
                else:
                    self.evictable -= 1
        elif self.queues[old].pop(key, 0) is None:
            self.evictable -= 1
            self.dirty.add(old)
        elif self.pinned:
            self.pinned.discard(key)
        rec[0] = cat
        rec[1] = now
        rec[2] = offset
        rec[3] = spatial
        if parent is not None and self.protect and key not in self.parent:
            self._link(key, parent)

    def release(self, key: int, now: float) -> None:
        rec = self.rec.get(key)
        if rec is None:
            return
        cat = rec[0]
        q = self.queues[cat]
        if key in q:
            if key in self.busy:
                self.busy.discard(key)
                self.evictable += 1
                self.dirty.add(cat)
            return
        if key in self.orphans:
            return
        # A block is read on every step of the request that holds it: its last
        # use is now, not its admission.  (It also keeps each queue in last-use
        # order, which the head-only scoring needs: a block held through a long
        # decode would otherwise queue behind younger ones and never be scored.)
        if now > rec[1]:
            rec[1] = now
        if self.leaf and key in self.children and not self.fifo[cat]:
            # Leaf-only eviction: a block with cached children waits for them.
            self.pinned.add(key)
            return
        q[key] = None
        self.evictable += 1
        # A key joining the tail leaves the head's score as it was, unless the head
        # is a busy FIFO one: scored past it (INF while every key was busy), the
        # queue's score is this key's now.
        if len(q) == 1 or (self.fifo[cat] and self.busy):
            self.dirty.add(cat)

    def _score(self, cat: int, now: float) -> float:
        """Score of the head of ``cat`` (INF when empty); ties go to the deeper offset."""
        q = self.queues[cat]
        if not q:
            return INF
        key = next(iter(q))
        busy = self.busy
        if busy and key in busy:
            # A busy FIFO head is passed over (moved behind), as S3-FIFO's scan does.
            for _ in range(len(q)):
                q.move_to_end(key)
                key = next(iter(q))
                if key not in busy:
                    break
            else:
                return INF
        rec = self.rec[key]
        tab = self.table
        t = now - rec[1]
        if t < 0.0:
            t = 0.0
        e = _exp(-tab.lam[cat] * t)
        if tab.fast:
            # The same expression as the fast rescore, so both give identical scores.
            return (tab.fa[cat] * e / (1.0 + tab.fb[cat] * e) * (rec[3] if tab.scaled else 1.0) + _FLOOR) * (1.0 - rec[2] * _TIE)
        if tab.scaled:
            score = tab.coef_a[cat] * e / (1.0 + tab.coef_b[cat] * e) * rec[3]
        else:
            score = tab.coef_a[cat] * e / (1.0 + tab.coef_b[cat] * e) + tab.ws * rec[3]
        if t < tab.window[cat]:
            score += tab.coef_l[cat]
        return (score + _FLOOR) * (1.0 - rec[2] * _TIE)

    def _cache_heads(self, cats) -> None:
        """Refresh the cached head data of ``cats`` (queues whose head may have changed)."""
        queues, rec, scaled = self.queues, self.rec, self.table.scaled
        head_t, head_w, head_tie = self.head_t, self.head_w, self.head_tie
        for cat in cats:
            q = queues[cat]
            if q:
                r = rec[next(iter(q))]
                head_t[cat] = r[1]
                head_w[cat] = r[3] if scaled else 1.0
                head_tie[cat] = 1.0 - r[2] * _TIE
            else:
                head_t[cat] = None

    def _rescore_dirty(self, now: float) -> None:
        """Fast scores of the queues whose head changed, at an unchanged time (a burst)."""
        tab = self.table
        queues, rec, scaled, heads = self.queues, self.rec, tab.scaled, self.heads
        head_t, head_w, head_tie = self.head_t, self.head_w, self.head_tie
        for cat in self.dirty:
            q = queues[cat]
            if q:
                r = rec[next(iter(q))]
                h = head_t[cat] = r[1]
                w = head_w[cat] = r[3] if scaled else 1.0
                tie = head_tie[cat] = 1.0 - r[2] * _TIE
                # The expression of _rescore_all, so that both give identical scores.
                e = _exp(tab.lam[cat] * (h - now) if h < now else 0.0)
                heads[cat] = (tab.fa[cat] * e / (1.0 + tab.fb[cat] * e) * w + _FLOOR) * tie
            else:
                head_t[cat] = None
                heads[cat] = INF

    def _rescore_all(self, now: float) -> None:
        """``_score`` of every head, inlined: this loop is the O(K) part of an eviction."""
        tab = self.table
        if tab.fast and not self.busy:
            # Only the heads that changed are read again; every score is recomputed
            # (the time moved), in one comprehension over the cached head data.
            if self.heads_cached:
                if self.dirty:
                    self._cache_heads(self.dirty)
            else:
                self._cache_heads(range(self.nq))
                self.heads_cached = True
            self.heads = [
                INF if h is None else (a * (e := _exp(l * (h - now) if h < now else 0.0)) / (1.0 + b * e) * w + _FLOOR) * tie
                for a, b, l, h, w, tie in zip(tab.fa, tab.fb, tab.lam, self.head_t, self.head_w, self.head_tie)
            ]
            return
        self.heads_cached = False
        if self.busy or tab.fast or tab.scaled:
            score = self._score
            self.heads[:] = [score(cat, now) for cat in range(self.nq)]
            return
        rec_of = self.rec.__getitem__
        lams, coef_a, coef_b, coef_l, windows = tab.lam, tab.coef_a, tab.coef_b, tab.coef_l, tab.window
        ws = tab.ws
        heads = self.heads
        cat = 0
        for q in self.queues:
            if q:
                rec = rec_of(next(iter(q)))
                t = now - rec[1]
                e = _exp(-lams[cat] * t) if t > 0.0 else 1.0
                score = coef_a[cat] * e / (1.0 + coef_b[cat] * e) + ws * rec[3]
                if t < windows[cat]:
                    score += coef_l[cat]
                heads[cat] = (score + _FLOOR) * (1.0 - rec[2] * _TIE)
            else:
                heads[cat] = INF
            cat += 1

    def evict(self, now: float) -> tuple[int, float]:
        """Pop the lowest-scored evictable key; returns (key, its age)."""
        if self.orphans:
            key = self.orphans.popitem(last=False)[0]
        elif self.evictable <= 0 and self.pinned:
            # Nothing queued but idle parents (their children are in use or held
            # elsewhere): the least recently used goes, its children after it.
            rec = self.rec
            key = min(self.pinned, key=lambda k: rec[k][1])
            self.pinned.discard(key)
            self.evictable += 1  # balanced below
        else:
            if self.evictable <= 0:
                raise NoEvictableBlock("every cached block is in use")
            if now != self.heads_now or self.heads_version != self.table.version:
                if self.nq < len(self.table):
                    self._grow()
                self.heads_now = now
                self.heads_version = self.table.version
                self._rescore_all(now)
                self.dirty.clear()
                heads = self.heads
            else:
                heads = self.heads
                if self.dirty:
                    if self.heads_cached and not self.busy:
                        self._rescore_dirty(now)
                    else:
                        self.heads_cached = False
                        for cat in self.dirty:
                            heads[cat] = self._score(cat, now)
                    self.dirty.clear()
            best = min(heads)
            if best == INF:
                raise NoEvictableBlock("every cached block is in use")
            cat = heads.index(best)
            key = self.queues[cat].popitem(last=False)[0]
            self.dirty.add(cat)
        self.evictable -= 1
        rec = self.rec.pop(key)
        if self.protect:
            self._unlink(key)
        return key, now - rec[1]

    def _unlink(self, key: int) -> None:
        parent = self.parent.pop(key, None)
        if parent is not None:
            kids = self.children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self.children[parent]
                    if parent in self.pinned:
                        self._unpin(parent)
        kids = self.children.pop(key, None)
        if kids:
            for kid in kids:
                self.parent.pop(kid, None)
                rec = self.rec.get(kid)
                if rec is None:
                    continue
                q = self.queues[rec[0]]
                if kid in q and kid not in self.busy:
                    del q[kid]
                    self.dirty.add(rec[0])
                    self.orphans[kid] = None
                elif kid in self.pinned:
                    self.pinned.discard(kid)
                    self.orphans[kid] = None
                    self.evictable += 1

    def _unpin(self, key: int) -> None:
        """``key``'s last cached child left: it joins its queue, at its last-access place when it can."""
        self.pinned.discard(key)
        rec = self.rec[key]
        cat = rec[0]
        q = self.queues[cat]
        if q:
            head = next(iter(q))
            q[key] = None
            if rec[1] <= self.rec[head][1]:
                q.move_to_end(key, last=False)
                self.dirty.add(cat)
        else:
            q[key] = None
            self.dirty.add(cat)
        self.evictable += 1

    def remove(self, key: int) -> None:
        if key in self.pinned:
            self.pinned.discard(key)
            self.evictable += 1  # balanced by the decrement below
            self.queues[self.rec[key][0]][key] = None
        rec = self.rec.pop(key, None)
        if rec is None:
            return
        q = self.queues[rec[0]]
        if q.pop(key, 0) is None:
            self.dirty.add(rec[0])
            if key in self.busy:
                self.busy.discard(key)
            else:
                self.evictable -= 1
        elif self.orphans.pop(key, 0) is None:
            self.evictable -= 1
        if self.protect:
            self._unlink(key)

    def evictable_keys(self) -> list[int]:
        """Evictable keys in LRU order (last access, deeper offset first): the fallback's order."""
        keys = [k for q in self.queues for k in q if k not in self.busy]
        keys.extend(self.orphans)
        keys.extend(self.pinned)
        rec = self.rec
        keys.sort(key=lambda k: (rec[k][1], -rec[k][2]))
        return keys


class _SimCache:
    """A metadata-only cache of ``capacity`` keys evicting by ``CategoryQueues``."""

    def __init__(self, queues: CategoryQueues, capacity: int) -> None:
        self.q = queues
        self.capacity = max(int(capacity), 1)

    def access(self, key: int, cat: int, now: float, offset: int, spatial: float, parent: int | None) -> bool:
        q = self.q
        hit = key in q.rec
        if not hit and len(q.rec) >= self.capacity:
            try:
                q.evict(now)
            except NoEvictableBlock:
                return False
        q.access(key, cat, now, offset, spatial, parent)
        return hit


class WorkloadAwarePolicy(EvictionPolicy):
    name = "wa"

    def __init__(self, capacity: int, config: WorkloadAwareConfig | None = None, name: str = "wa") -> None:
        cfg = config or WorkloadAwareConfig()
        self.name = name  # type: ignore[misc]
        self.cfg = cfg
        self.capacity = capacity
        m = cfg.model
        self.model = ReuseModel(
            gap_floor_s=m.gap_floor_s,
            window_s=m.window_s,
            min_samples=m.min_samples,
            refit_interval_s=m.refit_interval_s,
            history_horizon_s=m.history_horizon_s,
            history_max_blocks=m.history_max_blocks,
            em_iterations=m.em_iterations,
        )
        self.table = CategoryTable(cfg, self.model)
        self.paper = cfg.mode == "paper"
        self.core = CategoryQueues(self.table, cfg.protect_prefix)
        # LRU order of the real evictable keys while the fallback is active.
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.lru_active = False
        self.active = "wa"
        self.fallbacks = 0
        self.shadow_lru = ShadowLRU(capacity) if cfg.fallback.enabled else None
        self._shadow_keys = self.shadow_lru.keys if self.shadow_lru is not None else None
        self._shared_on = cfg.shared_class and not self.paper
        scaled = self.table.scaled
        self._sp_a = self.table.wr if scaled else 0.0
        self._sp_b = self.table.ws if scaled else 1.0
        self._pclasses = 1 if self.paper else cfg.position_classes
        self.shadow_wa: _SimCache | None = None
        self.rhythm = (
            TrafficRhythm(
                cfg.rhythm.spike_factor,
                cfg.rhythm.rate_window_s,
                cfg.rhythm.min_baseline_minutes,
                cfg.rhythm.prearm,
                cfg.rhythm.prearm_lead_minutes,
            )
            if cfg.rhythm.enabled
            else None
        )
        self.topics = (
            TopicSwitchDetector(cfg.topic_switch.turns, cfg.topic_switch.max_gap_s)
            if cfg.topic_switch.enabled and not self.paper  # the paper's categories have no switch class
            else None
        )
        self.spiking = False
        self.reuse_alarm = False
        self._alarm_ratio: float | None = None  # the hit ratio the alarm last judged (None: no accesses)
        self._alarm_accesses = 0  # the block lookups it was judged on
        # False on the host tier: its state changes are not logged (see make_workload_aware).
        self.announce = True
        self.topic_switches = 0
        self.age_ewma: float | None = None
        # Per-request state.
        self._ctx: RequestContext | None = None
        self._offset = -1
        self._key: int | None = None
        self._session: object = None
        self._base: tuple = ()
        self._workload = "to-c"
        self._type = "text"
        self._switch = False
        self._blocks = 1
        self._boost = 1.0
        self._cat_cache: dict[tuple, int] = {}
        # id(ctx) -> [ctx, session, switch, base, last offset, last key, leads]: the
        # classification of recent requests, where each one's calls stopped, and
        # its prefix runs then (_lead, _lead_lru, _lead_wa, _alarm_lead).
        self._recent: OrderedDict[int, list] = OrderedDict()
        self._lead = self._lead_lru = self._lead_wa = False
        # The alarm's own prefix: prompt blocks only, and a block promoted from the
        # host tier is a hit (the device-only lead above calls it a miss).
        self._alarm_lead = False
        self._missed: int | None = None  # the key whose miss a promotion may turn into a hit
        self._requests = 0
        # Windowed hit accounting: [accesses, hits, shadow LRU hits, shadow wa hits] of
        # the device tier (the fallback compares these), then [prompt blocks, of them
        # prefix hits on either tier] (the alarm: prefix blocks reused / prompt blocks).
        self._cur = [0] * _COUNTS
        self._buckets: deque[list] = deque()
        self._bucket_end = -INF
        self._since_switch = 0  # evaluations since the last switch (or the start)
        self._strikes = 0  # consecutive evaluations that called for a switch
        fb = cfg.fallback
        self._nbuckets = max(1, math.ceil(fb.window_s / fb.check_interval_s))
        self._alarm_buckets = max(1, math.ceil(cfg.alarm.window_s / fb.check_interval_s))
        self._patience = max(1, math.ceil(fb.sustain_s / fb.check_interval_s))

    # ---- the pool's calls -------------------------------------------------

    def insert(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self._access(key, ctx, offset, now, False)

    def hit(self, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self._access(key, ctx, offset, now, True)

    def release(self, key: int, ctx: RequestContext, now: float) -> None:
        self.core.release(key, now)
        if key == self._key:
            # A later hit on this key (another choice of the request, or the
            # request back after preemption) is a new use, not the second half of
            # a promotion's insert-then-hit: _access must not skip it, or the
            # block would stay evictable while in use.
            self._key = None
        shadow = self._shadow_keys
        if shadow is not None:
            if key in shadow:
                shadow.move_to_end(key)
            if self.shadow_wa is not None:
                self.shadow_wa.q.release(key, now)
        if self.lru_active:
            self.lru[key] = None

    def evict(self, now: float) -> int:
        if not self.lru_active:
            key, age = self.core.evict(now)
        else:
            if not self.lru:
                raise NoEvictableBlock("every cached block is in use")
            key = self.lru.popitem(last=False)[0]
            rec = self.core.rec.get(key)
            age = now - rec[1] if rec is not None else 0.0
            self.core.remove(key)
        ewma = self.age_ewma
        self.age_ewma = age if ewma is None else ewma + 0.01 * (age - ewma)
        return key

    def remove(self, key: int) -> None:
        self.core.remove(key)
        self.lru.pop(key, None)

    def num_evictable(self) -> int:
        # Pinned parents count: they become evictable as their children go.
        return self.core.evictable + len(self.core.pinned)

    def state(self, now: float | None = None) -> dict:
        # The windows roll only when requests arrive.  Read-only here (a scrape
        # runs beside the engine's step), an idle policy's figures are what its
        # next arrival would find: windows that saw nothing since, no spike.
        window = self._window_sums(self._nbuckets)
        alarm, spiking = self.reuse_alarm, self.spiking
        if now is not None:
            if now >= self._bucket_end + self.cfg.fallback.window_s:
                window = [0] * _COUNTS
            if now >= self._bucket_end + self.cfg.alarm.window_s:
                alarm = False
            if self.rhythm is not None and now >= self._bucket_end + self.rhythm.rate_window:
                spiking = False
        acc = window[0]
        return {
            "active": self.active,
            "fallbacks": self.fallbacks,
            "reuse_alarm": alarm,
            "traffic_spike": spiking,
            "categories": len(self.table),
            "window_hit_ratio": window[1] / acc if acc else None,
            "shadow_lru_hit_ratio": window[2] / acc if acc and self.shadow_lru is not None else None,
            "life_s": self.table.life,
            "topic_switches": self.topic_switches,
            "model_refits": self.model.refits,
        }

    def categories(self) -> list[dict]:
        """Current fit per category (for reports and `kvgate replay` recommendations)."""
        return [
            {"category": list(name), "lambda": self.table.lam[c], "p": self.table.p[c],
             "fitted": self.model.stats[c].fitted}
            for c, name in enumerate(self.table.names)
        ]

    # ---- per access -------------------------------------------------------

    def _access(self, key: int, ctx: RequestContext, offset: int, now: float, cached: bool) -> None:
        # The hot path: the model's and the shadow's bookkeeping are inlined.
        if ctx is not self._ctx or offset <= self._offset:
            if ctx is self._ctx and offset == self._offset and key == self._key:
                # The pool's promotion calls insert then hit for the same block:
                # a miss on the device tier, a hit for the engine (no prefill).
                if self._missed == key:
                    self._missed = None
                    self._alarm_lead = True
                    self._cur[5] += 1
                return
            self._begin(ctx, key, offset, now)
        parent = self._key if offset == self._offset + 1 else None
        self._offset = offset
        self._key = key
        # Close the key's open episode: a reuse after `gap` seconds.
        model = self.model
        entry = model.observe(key, now)
        shared = False
        if entry is not None:
            if self._shared_on:
                shared = entry[3] or entry[2] != self._session
        blocks = self._blocks
        if self._pclasses > 1:
            pos = offset * self._pclasses // blocks if offset < blocks else self._pclasses - 1
            ck = (shared, pos)
        else:
            pos = 0
            ck = shared
        cat = self._cat_cache.get(ck)
        if cat is None:
            cat = self._cat_cache[ck] = self._category(shared, pos)
        # Open the episode of this access.
        model.open(key, entry, cat, self._session, shared, now)
        # Decode blocks of a live request lie past its prompt: no spatial credit.
        # Stored as the key's spatial factor: wr + ws * s when scaled, s when added.
        if offset < blocks:
            spatial = self._sp_a + self._sp_b * ((1.0 - offset / blocks) * self._boost)
        else:
            spatial = self._sp_a
        self.core.access(key, cat, now, offset, spatial, parent)
        if self.lru_active:
            self.lru.pop(key, None)
        cur = self._cur
        cur[0] += 1
        if offset < self._blocks:  # decode blocks of a live request are no prompt blocks
            cur[4] += 1
            if self._alarm_lead:
                if cached:
                    cur[5] += 1
                else:
                    self._alarm_lead = False
                    self._missed = key
        if self._lead:
            if cached:
                cur[1] += 1
            else:
                self._lead = False
        shadow = self._shadow_keys
        if shadow is not None:
            if key in shadow:
                shadow.move_to_end(key)
                if self._lead_lru:
                    cur[2] += 1
            else:
                self._lead_lru = False
                shadow[key] = None
                if len(shadow) > self.capacity:
                    shadow.popitem(last=False)
            sim = self.shadow_wa
            if sim is not None:
                if sim.access(key, cat, now, offset, spatial, parent):
                    if self._lead_wa:
                        cur[3] += 1
                else:
                    self._lead_wa = False

    def _category(self, shared: bool, pos: int) -> int:
        if self.paper:
            name = self._base
        elif shared:
            # Cross-session reuse (system prompts, templates) does not depend on
            # the turn or the session's fate: one class per type (and no
            # topic-switch penalty: the class outlives whichever request made it).
            name = (self._workload, self._type, "shared")
        elif self._switch:
            name = (self._workload, self._type, "switch")
            return self.table.get(name, self._workload, self._type, True)
        else:
            name = (*self._base, pos)
        return self.table.get(name, self._workload, self._type, False)

    def _begin(self, ctx: RequestContext, first_key: int, offset: int, now: float) -> None:
        """Calls for another request start: classify it (once), advance the clocks.

        The engine may interleave a request's calls with others' (hits at
        admission, inserts as blocks fill); a request seen recently resumes
        with its classification and without counting a second arrival.
        """
        cfg = self.cfg
        recent = self._recent
        left = self._ctx
        if left is not None:
            # Remember where the request we leave stopped, so that its next block
            # still links to its parent when its calls resume.
            entry = recent.get(id(left))
            if entry is not None and entry[0] is left:
                entry[4] = self._offset
                entry[5] = self._key
                entry[6] = (self._lead, self._lead_lru, self._lead_wa, self._alarm_lead)
        self._ctx = ctx
        self._offset = offset - 1
        self._key = None
        # At any offset: the n choices of one request, and a preempted request
        # admitted again, take its prefix from offset 0 once more.
        known = recent.get(id(ctx))
        if known is not None and known[0] is ctx:
            _, self._session, self._switch, self._base, last_offset, last_key, leads = known
            if last_offset == offset - 1:
                # Resumed where it stopped: the engine acquires a prompt's cached
                # prefix at admission and publishes the rest after a model step,
                # with other requests' calls between.  Its runs go on, or the
                # shadow LRU's hits past the real cache's would never count (and
                # the fallback could never find the policy losing).
                self._key = last_key
                self._lead, self._lead_lru, self._lead_wa, self._alarm_lead = leads
            else:
                self._lead = self._lead_lru = self._lead_wa = self._alarm_lead = False
        else:
            self._arrival(ctx, first_key, now)
        self._workload, self._type = ctx.workload, ctx.type
        self._blocks = max(ctx.prompt_blocks, offset + 1, 1)
        self._boost = cfg.long_prompt_boost if ctx.prompt_tokens > cfg.long_prompt_tokens else 1.0
        self._cat_cache = {}

    def _arrival(self, ctx: RequestContext, first_key: int, now: float) -> None:
        cfg = self.cfg
        self._requests += 1
        self._lead = self._lead_lru = self._lead_wa = self._alarm_lead = True
        if ctx.session is not None:
            session: object = ctx.session
        elif ctx.chat_id >= 0:
            session = ctx.chat_id
        else:
            session = -self._requests
        workload, rtype = ctx.workload, ctx.type
        if now >= self._bucket_end:
            self._roll(now)
        if self.rhythm is not None:
            if workload == "to-b":
                self.rhythm.arrival(now)
            else:
                self.rhythm.update(now)
            if self.rhythm.spiking != self.spiking:
                self._set_spike(self.rhythm.spiking)
        if self.model.maybe_refit(now):
            self._after_refit()
        switch = False
        if self.topics is not None and workload == "to-c" and ctx.session is not None:
            switch = self.topics.arrival(session, now)
            self.topic_switches += switch
        turn = min(max(ctx.turn, 1), cfg.turn_buckets)
        if self.paper:
            base: tuple = (workload, rtype, turn)
        else:
            slot = -1
            if cfg.signature.enabled and rtype == "file":
                signature = ctx.signature if ctx.signature is not None else first_key
                slot = hash(signature) % cfg.signature.slots
            base = (workload, rtype, turn, slot)
        self._session, self._switch, self._base = session, switch, base
        recent = self._recent
        recent[id(ctx)] = [ctx, session, switch, base, -1, None, (False,) * 4]
        if len(recent) > 1024:
            recent.popitem(last=False)

    def _after_refit(self) -> None:
        if self.cfg.life_s is None and not self.paper and self.age_ewma is not None:
            # Look as far ahead as blocks currently stay: the measured residency.
            self.table.life = min(max(self.age_ewma, 1.0), 3600.0)
        self.table.refresh()

    def _set_spike(self, spiking: bool) -> None:
        self.spiking = spiking
        self.table.relax = self.cfg.rhythm.relax_factor if spiking else 1.0
        self.table.refresh()
        if self.announce:
            log.info("to-B traffic spike %s (relax x%.1f)", "started" if spiking else "ended",
                     self.table.relax)

    # ---- shadow comparison, fallback and alarm ------------------------------

    def _window_sums(self, n: int) -> list[int]:
        buckets = self._buckets
        window = buckets if n >= len(buckets) else list(buckets)[-n:]
        return [sum(counts) for counts in zip(*window)] if window else [0] * _COUNTS

    def _roll(self, now: float) -> None:
        """Close the bucket that ended, and an empty one for every whole interval
        since with no arrival, so windows and sustain periods are spans of time."""
        interval = self.cfg.fallback.check_interval_s
        if self._bucket_end != -INF:
            keep = max(self._nbuckets, self._alarm_buckets)
            idle = int((now - self._bucket_end) // interval)
            alarm_before = self.reuse_alarm
            # Past `keep` empty intervals every window is empty, and each further
            # check finds nothing to judge: only the count since a switch moves on.
            for _ in range(1 + min(idle, keep)):
                self._buckets.append(self._cur)
                self._cur = [0] * _COUNTS
                while len(self._buckets) > keep:
                    self._buckets.popleft()
                self._evaluate(now)
            if idle > keep and self.shadow_lru is not None:
                self._since_switch += idle - keep
            # Said once, as things stand now: catching up on idle intervals may
            # raise the alarm at one and clear it at the next, all at this instant.
            if self.reuse_alarm != alarm_before and self.announce:
                alarm = self.cfg.alarm
                if self.reuse_alarm:
                    log.warning("reuse alarm raised: prefix hit ratio %.3f over %.0f s, under alarm.threshold %.2f "
                                "(a KV cache too small for the traffic's reuse, or traffic with little to reuse)",
                                self._alarm_ratio, alarm.window_s, alarm.threshold)
                elif self._alarm_ratio is None:
                    log.info("reuse alarm cleared: no prompt blocks looked up over %.0f s", alarm.window_s)
                elif self._alarm_accesses < alarm.min_accesses:
                    log.info("reuse alarm cleared: %d block lookups over %.0f s, fewer than alarm.min_accesses %d",
                             self._alarm_accesses, alarm.window_s, alarm.min_accesses)
                else:
                    log.info("reuse alarm cleared: prefix hit ratio %.3f over %.0f s (alarm.threshold %.2f)",
                             self._alarm_ratio, alarm.window_s, alarm.threshold)
        self._bucket_end = (math.floor(now / interval) + 1) * interval

    def _evaluate(self, now: float) -> None:
        cfg = self.cfg
        if len(self._buckets) >= self._alarm_buckets:
            *_, acc, hits = self._window_sums(self._alarm_buckets)
            self._alarm_ratio = hits / acc if acc else None
            self._alarm_accesses = acc
            self.reuse_alarm = acc >= cfg.alarm.min_accesses and hits / acc < cfg.alarm.threshold
        fb = cfg.fallback
        if self.shadow_lru is None:
            return
        self._since_switch += 1
        n = min(self._nbuckets, self._since_switch)
        acc, hits, lru_hits, wa_hits, _, _ = self._window_sums(n)
        if acc < fb.min_accesses:
            self._strikes = 0
            return
        if self.active == "wa":
            losing = hits < lru_hits * (1.0 - fb.margin)
        else:
            losing = n >= self._nbuckets and wa_hits > lru_hits * (1.0 + fb.switch_back_margin)
        # Only a sustained difference switches: one window's noise does not.
        self._strikes = self._strikes + 1 if losing else 0
        if self._strikes < self._patience:
            return
        self._strikes = 0
        self._since_switch = 0
        if self.active == "wa":
            self.active = "lru"
            self.lru_active = True
            self.lru = OrderedDict.fromkeys(self.core.evictable_keys())
            self.fallbacks += 1
            self.shadow_wa = _SimCache(self.core.clone(), self.capacity)
            log.warning("falling back to LRU (hit ratio %.4f vs shadow LRU %.4f over %d blocks)",
                        hits / acc, lru_hits / acc, acc)
        else:
            self.active = "wa"
            self.lru_active = False
            self.lru = OrderedDict()
            self.shadow_wa = None
            log.info("back to workload-aware order (shadow %.4f vs LRU %.4f over %d blocks)",
                     wa_hits / acc, lru_hits / acc, acc)


def make_workload_aware(
    name: str, capacity: int, cfg: WorkloadAwareConfig | None = None, *, tier: str = "device", **_: object
) -> WorkloadAwarePolicy:
    """``wa``: the configured policy; ``wa-paper``: the paper's algorithm on the same model knobs.

    The host tier only orders demoted blocks: it gets no LRU fallback and stays
    silent, so alarms and spikes are judged (and logged) once, on the device tier.
    Its calls are demotions, not requests, so it keeps no traffic rhythm and no
    topic-switch detector either (both would read demotion bursts as arrivals).
    """
    cfg = cfg or WorkloadAwareConfig()
    if name == "wa-paper":
        cfg = cfg.paper_variant()
    elif name != "wa":
        raise ValueError(f"unknown workload-aware policy {name!r}")
    if tier != "device":
        cfg = cfg.model_copy(update={
            "fallback": cfg.fallback.model_copy(update={"enabled": False}),
            "rhythm": cfg.rhythm.model_copy(update={"enabled": False}),
            "topic_switch": cfg.topic_switch.model_copy(update={"enabled": False}),
        })
    policy = WorkloadAwarePolicy(capacity, cfg, name)
    policy.announce = tier == "device"
    return policy
