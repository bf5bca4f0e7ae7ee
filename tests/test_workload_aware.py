"""The workload-aware policy: O(K) eviction, online model, paper mode, rhythm, topic switch, fallback."""

from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError

from engine.block_pool import BlockPool
from engine.config import CacheConfig, WorkloadAwareConfig, format_config_error
from engine.context import RequestContext
from engine.policies import NoEvictableBlock, make_policy
from engine.policies.reuse_model import ReuseModel, fit_lambda, fit_mixture
from engine.policies.rhythm import TopicSwitchDetector, TrafficRhythm
from engine.policies.workload_aware import WorkloadAwarePolicy, paper_priority, posterior_reuse
from engine.request import GenerationRequest
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def ctx(workload="to-c", rtype="text", turn=1, session=None, ts=0.0, blocks=1, tokens=100, chat_id=-1):
    return RequestContext(workload=workload, type=rtype, turn=turn, session=session, timestamp=ts,
                          prompt_blocks=blocks, prompt_tokens=tokens, chat_id=chat_id)


def request(pool: BlockPool, keys: list[int], context: RequestContext, now: float, hold: bool = False):
    """Replay semantics: touch or insert every key, then release tail first (unless held)."""
    blocks, hits = pool.touch_or_insert(keys, context, now)
    if not hold:
        pool.release(list(reversed(blocks)), context, now)
    return blocks, hits


def quiet(**update) -> WorkloadAwareConfig:
    base = {"rhythm": {"enabled": False}, "topic_switch": {"enabled": False}, "fallback": {"enabled": False}}
    base.update(update)
    return WorkloadAwareConfig.model_validate(base)


# ---- O(K) structure ----------------------------------------------------------


def test_eviction_skips_in_use_and_picks_the_lowest_scored_head():
    policy = WorkloadAwarePolicy(1000, quiet(model={"min_samples": 1, "refit_interval_s": 1.0}))
    rng = random.Random(7)
    types = ["text", "search", "image", "file"]
    in_use: set[int] = set()
    key = 0
    for i in range(300):
        c = ctx(rtype=types[i % 4], turn=1 + i % 3, session=f"s{i % 17}", blocks=3, tokens=48)
        now = i * 0.5
        keys = []
        for offset in range(3):
            key += 1
            keys.append(key)
            policy.insert(key, c, offset, now)
        if rng.random() < 0.2:
            in_use.update(keys)  # this request never releases: its keys stay in use
        else:
            for k in reversed(keys):
                policy.release(k, c, now)
    core = policy.core
    now = 200.0
    scored = []
    original = core._score

    def counting(cat, t):
        scored.append(cat)
        return original(cat, t)

    core._score = counting
    evicted = 0
    while True:
        heads = [core.queues[c] for c in range(core.nq) if core.queues[c]]
        expected = None
        if not core.orphans and heads:
            # Brute force over every queue head, scored independently.
            expected = min((original(c, now), c) for c in range(core.nq) if core.queues[c])[1]
            expected_key = next(iter(core.queues[expected]))
        scored.clear()
        try:
            victim = policy.evict(now)
        except NoEvictableBlock:
            break
        assert victim not in in_use
        assert len(scored) <= core.nq  # only heads are scored: O(K)
        if expected is not None:
            assert victim == expected_key
        evicted += 1
    assert evicted == 300 * 3 - len(in_use)
    assert policy.num_evictable() == 0


def test_prefix_children_go_before_their_parent_is_missed():
    # When a parent goes anyway (the pool dropped it, the LRU fallback evicted it),
    # its cached children go to the front, a pinned (leaf-mode) child included.
    policy = WorkloadAwarePolicy(100, quiet(weights={"reuse": 1.0, "spatial": 0.0, "lifetime": 0.0}))
    a = ctx(session="a", blocks=3)
    for offset, k in enumerate([1, 2, 3]):
        policy.insert(k, a, offset, 0.0)
    for k in (3, 2, 1):
        policy.release(k, a, 0.0)
    # Another session re-uses key 1 only; 1 becomes more recent than its children.
    b = ctx(session="b", blocks=1)
    policy.hit(1, b, 0, 5.0)
    policy.release(1, b, 5.0)
    core = policy.core
    core._unlink(1)  # as if 1 were evicted: its children are orphans now
    assert list(core.orphans) == [2]  # 2 is 1's child; 3 is 2's child and goes when 2 goes
    assert policy.evict(6.0) == 2
    assert 3 in core.orphans


def test_prefix_links_survive_interleaved_requests():
    # The engine publishes blocks step by step, mixing sequences: request a's
    # later blocks still link to its earlier ones when b's calls come between.
    policy = WorkloadAwarePolicy(100, quiet())
    a = ctx(session="a", blocks=4)
    b = ctx(session="b", blocks=1)
    policy.insert(10, a, 0, 0.0)
    policy.insert(11, a, 1, 0.0)
    policy.insert(20, b, 0, 0.0)
    policy.insert(12, a, 2, 0.1)
    policy.insert(13, a, 3, 0.1)
    core = policy.core
    assert [core.parent.get(k) for k in (11, 12, 13)] == [10, 11, 12]
    for k in (13, 12, 11, 10):
        policy.release(k, a, 1.0)
    policy.release(20, b, 1.0)
    order = [policy.evict(2.0) for _ in range(5)]
    # A parent never goes while its child is cached.
    assert order.index(13) < order.index(12) < order.index(11) < order.index(10)


def _shared_parent_setup(mode: str) -> WorkloadAwarePolicy:
    """Key 1 is a shared prefix (class "shared"), scored far below its private children."""
    policy = WorkloadAwarePolicy(100, quiet(protect_prefix=mode))
    a, b = ctx(session="a", blocks=3), ctx(session="b", blocks=2)
    for offset, k in enumerate([1, 2, 3]):
        policy.insert(k, a, offset, 0.0)
    for k in (3, 2, 1):
        policy.release(k, a, 0.0)
    policy.hit(1, b, 0, 5.0)  # another session: 1 moves to the shared class
    policy.insert(4, b, 1, 5.0)
    policy.release(4, b, 5.0)
    policy.release(1, b, 5.0)
    table = policy.table
    shared = table.index[("to-c", "text", "shared")]
    private = policy.core.rec[2][0]
    assert policy.core.rec[1][0] == shared and private != shared
    for cat, p in ((shared, 1e-4), (private, 0.9)):
        policy.model.stats[cat].lam, policy.model.stats[cat].p = 0.01, p
    table.refresh()
    return policy


def test_leaf_mode_never_evicts_a_parent_before_its_cached_children():
    # The shared prefix scores lowest, but its children are only reachable through it:
    # leaves go first (oldest first within their class), the parent last.
    policy = _shared_parent_setup("leaf")
    assert policy.num_evictable() == 4  # the pinned parents count: they go after their children
    assert policy.core.pinned == {1, 2}
    assert [policy.evict(10.0) for _ in range(4)] == [3, 2, 4, 1]
    with pytest.raises(NoEvictableBlock):
        policy.evict(10.0)


def test_cascade_mode_evicts_the_low_parent_then_its_orphans():
    policy = _shared_parent_setup("cascade")
    assert policy.evict(10.0) == 1
    assert sorted(policy.evict(10.0) for _ in range(2)) == [2, 4]  # the orphans, before anything else
    assert policy.evict(10.0) == 3


def test_leaf_mode_evicts_an_idle_parent_whose_children_are_held():
    # Outside replay a child may be held without its parent: the parent is then
    # the only candidate and must still be evictable (the pool counts on it).
    policy = WorkloadAwarePolicy(100, quiet())
    a = ctx(session="a", blocks=2)
    policy.insert(1, a, 0, 0.0)
    policy.insert(2, a, 1, 0.0)
    policy.release(2, a, 0.0)
    policy.release(1, a, 0.0)
    policy.hit(2, ctx(session="a", blocks=2), 1, 1.0)  # 2 in use again, 1 idle with a cached child
    assert policy.num_evictable() == 1
    assert policy.evict(2.0) == 1
    assert policy.num_evictable() == 0


def test_protect_prefix_accepts_booleans():
    assert WorkloadAwareConfig(protect_prefix=True).protect_prefix == "leaf"
    assert WorkloadAwareConfig(protect_prefix=False).protect_prefix == "off"
    assert WorkloadAwareConfig().paper_variant().protect_prefix == "off"


@pytest.mark.parametrize("mode, first", [("scale", "old head"), ("add", "young tail")])
def test_scaled_spatial_does_not_keep_dead_head_blocks(mode, first):
    # An old head block (its R long decayed to ~0) against a young tail block of
    # another class with the same fit.  Scaled, spatial only reorders blocks of
    # similar R; added, it outweighs R and keeps the dead head block.
    policy = WorkloadAwarePolicy(100, quiet(weights={"spatial": 0.3, "spatial_mode": mode}))
    old, young = ctx(rtype="text", session="a", blocks=10), ctx(rtype="search", session="b", blocks=10)
    policy.insert(1, old, 0, 0.0)
    policy.release(1, old, 0.0)
    policy.insert(2, young, 9, 1000.0)
    policy.release(2, young, 1000.0)
    for stats in policy.model.stats:
        stats.lam, stats.p = 0.1, 0.5
    policy.table.refresh()
    assert policy.evict(1000.0) == (1 if first == "old head" else 2)


# ---- online model ----------------------------------------------------------------


def test_mle_recovers_lambda_from_exponential_gaps():
    rng = random.Random(1)
    lam, floor = 0.2, 0.3
    gaps = [floor + rng.expovariate(lam) for _ in range(20000)] + [rng.uniform(0, floor) for _ in range(500)]
    assert fit_lambda(gaps, floor) == pytest.approx(lam, rel=0.03)


def test_mixture_fit_recovers_lambda_and_p_under_censoring():
    # Episodes reused with p=0.6 after Exp(0.05); each observed only up to a random age.
    rng = random.Random(2)
    lam, p, floor = 0.05, 0.6, 0.3
    n_fast = n_slow = 0
    sum_slow = 0.0
    censored = []
    for _ in range(20000):
        horizon = rng.uniform(0.0, 200.0)
        gap = floor + rng.expovariate(lam) if rng.random() < p else math.inf
        if gap <= horizon:
            n_slow += 1
            sum_slow += gap - floor
        else:
            censored.append((horizon, 1))
    fitted_lam, fitted_p = 0.15, 0.5
    for _ in range(20):  # refits warm-start from the previous fit
        fitted_lam, fitted_p = fit_mixture(n_fast, n_slow, sum_slow, censored, floor, fitted_lam, fitted_p, 6)
    assert fitted_lam == pytest.approx(lam, rel=0.1)
    assert fitted_p == pytest.approx(p, rel=0.1)


def test_reuse_model_learns_from_history_not_cache_residency():
    # A tiny cache (2 blocks) never holds a key until its reuse 20 s later,
    # but the metadata history still observes the gap.
    rng = random.Random(3)
    events = []
    for i in range(400):
        events.append((i * 2.0, i, "first"))
        events.append((i * 2.0 + 0.3 + rng.expovariate(1 / 20), i, "second"))
    events.sort()
    policy = WorkloadAwarePolicy(2, quiet(model={"min_samples": 20, "refit_interval_s": 5.0}))
    pool = BlockPool(2, 0, policy="lru")
    pool.device_policy = policy
    for now, i, _ in events:
        request(pool, [10 + i], ctx(session=f"s{i}", ts=now), now)
    policy.model.refit(events[-1][0])
    cat = policy.table.index[("to-c", "text", 1, -1, 0)]
    assert policy.model.stats[cat].fitted
    assert policy.model.stats[cat].lam == pytest.approx(1 / 20, rel=0.3)
    assert policy.model.stats[cat].p == pytest.approx(0.5, abs=0.1)  # half the episodes are second visits


def test_the_reuse_alarm_counts_prompt_blocks_and_host_tier_hits():
    """The alarm is the engine's prefix hit ratio (prefix blocks reused / prompt
    blocks): the blocks an answer fills (published as they fill) are no prompt
    blocks, and a block brought back from the host tier is a hit.  Both used to
    count as misses and raise the alarm over a cache hitting 99%."""
    alarmed = {"fallback": {"check_interval_s": 10.0}, "alarm": {"window_s": 30.0, "min_accesses": 1}}
    # An answer 8 blocks long behind a 4-block prompt that always hits.
    pool = BlockPool(10_000, 0, "wa", CacheConfig(workload_aware=alarmed))
    answer_key = 10**6
    for i in range(200):
        now = i * 0.5
        c = ctx(session=f"s{i}", blocks=4, tokens=64, ts=now)
        blocks, _ = pool.touch_or_insert([1, 2, 3, 4], c, now)
        for j in range(8):
            answer_key += 1
            block = pool.allocate(1, now)[0]
            pool.cache_block(block, answer_key, c, 4 + j, now)
            blocks.append(block)
        pool.release(blocks[::-1], c, now)
    assert pool.device_policy.state(now)["reuse_alarm"] is False
    # Five prompts cycling through a 4-block device tier and a 40-block host tier.
    pool = BlockPool(4, 40, "wa", CacheConfig(workload_aware=alarmed))
    hits = 0
    for i in range(400):
        keys = [100 * (i % 5) + j for j in range(4)]
        hits += request(pool, keys, ctx(session=f"s{i}", blocks=4, tokens=64, ts=float(i)), float(i))[1]
    assert hits / 1600 > 0.95 and pool.stats.promotions > 1000
    assert pool.device_policy.state(399.0)["reuse_alarm"] is False
    # Prompts that never hit still raise it.
    pool = BlockPool(4, 40, "wa", CacheConfig(workload_aware=alarmed))
    for i in range(400):
        request(pool, [4 * i + j for j in range(4)], ctx(session=f"s{i}", blocks=4, tokens=64, ts=float(i)), float(i))
    assert pool.device_policy.state(399.0)["reuse_alarm"] is True


@pytest.mark.parametrize("mean_gap", [10.0, 100.0, 300.0])
def test_reuse_model_recovers_p_and_lambda_of_a_steady_stream(mean_gap):
    """Keys arrive steadily; half are reused once, 0.3 s + Exp(1/mean_gap) later,
    and an episode opened by a reuse never is: a third of all episodes end in a
    reuse.  With the window equal to the history horizon, the fit recovers both
    (p came out about 40% low when episodes were windowed by when they ended:
    the never-reused ones of a window earlier counted, the reused ones not)."""
    rng = random.Random(1)
    model = ReuseModel(gap_floor_s=0.3, window_s=600.0, min_samples=50, refit_interval_s=10.0,
                       history_horizon_s=600.0, history_max_blocks=10**7)
    cat = model.add_category(0.15, 0.5)
    events, now, key = [], 0.0, 0
    while now < 3000.0:
        now += rng.expovariate(10.0)
        key += 1
        events.append((now, key))
        if rng.random() < 0.5:
            events.append((now + 0.3 + rng.expovariate(1 / mean_gap), key))
    for now, key in sorted(e for e in events if e[0] < 3000.0):
        model.open(key, model.observe(key, now), cat, None, False, now)
        model.maybe_refit(now)
    model.refit(3000.0)
    stats = model.stats[cat]
    assert stats.fitted
    assert stats.p == pytest.approx(1 / 3, abs=0.03)
    assert stats.lam == pytest.approx(1 / mean_gap, rel=0.2)


def test_sparse_member_takes_its_groups_pooled_fit_not_the_prior():
    # Two sub-classes of one group (signature slots): the busy one has reuses 100 s
    # apart, the sparse one too few episodes of its own.  The sparse one must take
    # the pooled rate (about 1/100 s), not the prior 0.15/s (a 7 s mean gap).
    model = ReuseModel(gap_floor_s=0.3, window_s=3600.0, min_samples=20, refit_interval_s=10.0,
                       history_horizon_s=3600.0, history_max_blocks=100000)
    busy = model.add_category(0.15, 0.5, group="g")
    sparse = model.add_category(0.15, 0.5, group="g")
    alone = model.add_category(0.15, 0.5)
    rng = random.Random(4)
    events = []
    for i in range(300):
        events.append((i * 5.0, 1000 + i, busy))
        events.append((i * 5.0 + rng.expovariate(1 / 100), 1000 + i, busy))
    for i in range(5):
        events.append((i * 7.0, 5000 + i, sparse))
        events.append((i * 7.0, 6000 + i, alone))
    for now, key, cat in sorted(events):
        entry = model.observe(key, now)
        model.open(key, entry, cat, None, False, now)
    model.refit(1600.0)
    assert model.stats[busy].lam == pytest.approx(1 / 100, rel=0.35)
    assert not model.stats[sparse].fitted
    assert model.stats[sparse].lam == pytest.approx(model.stats[busy].lam, rel=0.2)
    assert model.stats[alone].lam == 0.15  # no group: the prior


# ---- no peeking ----------------------------------------------------------------------


def _run_decisions(trace: list[tuple[float, list[int], RequestContext]], prefix: int) -> list[int]:
    pool = BlockPool(40, 0, "wa", CacheConfig())
    victims: list[int] = []
    evict = pool.device_policy.evict

    def record(now):
        key = evict(now)
        victims.append(key)
        return key

    pool.device_policy.evict = record
    marks = []
    for i, (now, keys, c) in enumerate(trace):
        request(pool, keys, c, now)
        if i == prefix - 1:
            marks = list(victims)
    return marks


def test_no_peeking_prefix_decisions_do_not_depend_on_the_future():
    rng = random.Random(5)

    def make(seed_offset: int, n: int, start: float):
        r = random.Random(seed_offset)
        out = []
        for i in range(n):
            now = start + i * 0.7
            length = r.randint(1, 6)
            base = r.randint(0, 30) * 100
            c = ctx(rtype=r.choice(["text", "search"]), turn=r.randint(1, 3), session=f"s{r.randint(0, 9)}",
                    ts=now, blocks=length, tokens=length * 16)
            out.append((now, [base + j for j in range(length)], c))
        return out

    prefix = make(11, 300, 0.0)
    suffix_a = make(12, 200, 300 * 0.7)
    suffix_b = make(13, 200, 300 * 0.7)
    assert rng  # deterministic inputs
    first = _run_decisions(prefix + suffix_a, len(prefix))
    second = _run_decisions(prefix + suffix_b, len(prefix))
    assert first and first == second


# ---- scoring ---------------------------------------------------------------------------


def test_paper_priority_formula_and_paper_mode_order():
    lam, p, t, life = 0.15, 0.4, 3.0, 5.0
    assert paper_priority(lam, p, t, life) == pytest.approx(p * (math.exp(-lam * t) - math.exp(-lam * (t + life))))
    # The posterior is the paper's unconditional probability over the survival.
    e = math.exp(-lam * t)
    assert posterior_reuse(lam, p, t, life) == pytest.approx(paper_priority(lam, p, t, life) / (1 - p + p * e))

    policy = make_policy("wa-paper", 100, CacheConfig())
    assert policy.cfg.mode == "paper" and policy.table.life == 5.0
    assert not policy.cfg.fallback.enabled and not policy.cfg.rhythm.enabled
    # Two categories with hand-set fits: the one with the lower priority goes first.
    c1 = ctx(rtype="text", turn=1, blocks=2)
    c2 = ctx(rtype="search", turn=2, blocks=2)
    for offset, k in enumerate([1, 2]):
        policy.insert(k, c1, offset, 0.0)
    for offset, k in enumerate([11, 12]):
        policy.insert(k, c2, offset, 1.0)
    for k in (2, 1):
        policy.release(k, c1, 0.0)
    for k in (12, 11):
        policy.release(k, c2, 1.0)
    tab = policy.table
    cat1 = tab.index[("to-c", "text", 1)]
    cat2 = tab.index[("to-c", "search", 2)]
    tab.model.stats[cat1].lam, tab.model.stats[cat1].p = 0.05, 0.9
    tab.model.stats[cat2].lam, tab.model.stats[cat2].p = 0.8, 0.9
    tab.refresh()
    now = 4.0
    expected = sorted(
        [(paper_priority(0.05, 0.9, now - 0.0, 5.0), -off, k) for off, k in enumerate([1, 2])]
        + [(paper_priority(0.8, 0.9, now - 1.0, 5.0), -off, k) for off, k in enumerate([11, 12])]
    )
    assert [policy.evict(now) for _ in range(4)] == [k for _, _, k in expected]


def test_offset_only_breaks_ties_it_does_not_outrank_the_priority():
    # An old head block (reuse chance ~1e-20) goes before a younger deep block
    # (~1e-12): the paper orders by priority first, offset second.
    policy = make_policy("wa-paper", 100, CacheConfig())
    a = ctx(turn=1, blocks=1)
    b = ctx(turn=2, blocks=40)
    policy.insert(1, a, 0, 0.0)
    policy.release(1, a, 0.0)
    for offset in range(31):
        policy.insert(100 + offset, b, offset, 130.0)
    for offset in reversed(range(31)):
        policy.release(100 + offset, b, 130.0)
    assert paper_priority(0.15, 0.5, 300.0, 5.0) < paper_priority(0.15, 0.5, 170.0, 5.0) * 1e-6
    assert policy.evict(300.0) == 1
    # Equal priorities: the deeper block first.
    assert policy.evict(300.0) == 130
    # Priorities that underflowed to 0 (blocks hundreds of lifetimes old) still go deepest first.
    old_policy = make_policy("wa-paper", 100, CacheConfig())
    for turn, offset, key in ((1, 0, 7), (2, 5, 8)):
        c = ctx(workload="to-b", rtype="api", turn=turn, blocks=6)
        old_policy.insert(key, c, offset, 0.0)
        old_policy.release(key, c, 0.0)
    assert paper_priority(0.8, 0.5, 5000.0, 5.0) == 0.0
    assert old_policy.evict(5000.0) == 8


def test_weighted_score_uses_configured_weights():
    cfg = quiet(weights={"reuse": 0.0, "spatial": 1.0, "lifetime": 0.0})
    policy = WorkloadAwarePolicy(100, cfg)
    c = ctx(blocks=4, tokens=64)
    for offset, k in enumerate([1, 2, 3, 4]):
        policy.insert(k, c, offset, 0.0)
    for k in (4, 3, 2, 1):
        policy.release(k, c, 0.0)
    # Spatial only: the tail goes first, the head last.
    assert [policy.evict(1.0) for _ in range(4)] == [4, 3, 2, 1]


# ---- traffic rhythm and topic switches ----------------------------------------------------


def test_rhythm_detects_hourly_spikes_and_prearms():
    rhythm = TrafficRhythm(spike_factor=2.0, rate_window_s=10.0, min_baseline_minutes=10, prearm=True,
                           prearm_lead_minutes=1)
    states: dict[float, bool] = {}
    t = 0.0
    end = 3.5 * 3600
    while t < end:
        minute = int(t // 60) % 60
        gap = 0.6 if minute == 5 else 6.0  # 100/min at minute 5 of every hour, else 10/min
        rhythm.arrival(t)
        states[t] = rhythm.spiking
        t += gap
    assert rhythm.baseline == pytest.approx(10, rel=0.2)
    second_hour = 3600.0

    def state_at(when: float) -> bool:
        return states[max(k for k in states if k <= when)]

    assert state_at(second_hour + 5 * 60 + 30)  # inside the spike
    assert not state_at(second_hour + 30 * 60)  # quiet half hour
    assert rhythm.recurring == {5}
    # The first hour's spike came before a baseline existed; one more spike is
    # no rhythm yet (the third hour is not pre-armed), the third's makes one,
    # so the fourth hour is pre-armed a minute ahead.
    third_hour, fourth_hour = 7200.0, 10800.0
    assert not state_at(third_hour + 4 * 60 + 5)
    assert not state_at(fourth_hour + 2 * 60 + 30)
    assert rhythm.prearm and state_at(fourth_hour + 4 * 60 + 5)
    quiet_rates = [t for t in states if fourth_hour + 4 * 60 <= t < fourth_hour + 5 * 60]
    assert all(states[t] for t in quiet_rates)  # rate is still low there: pre-armed, not measured


def test_rhythm_takes_a_one_off_burst_for_no_rhythm():
    """A burst at minute 17 of one hour only: measured as a spike while it
    lasts, never a minute to pre-arm for; a minute that spiked twice and then
    stopped is forgotten once it is quiet in most hours."""
    rhythm = TrafficRhythm(spike_factor=2.0, rate_window_s=10.0, min_baseline_minutes=10, prearm=True,
                           prearm_lead_minutes=1)
    t = 0.0
    while t < 6 * 3600:
        hour, minute = divmod(int(t // 60), 60)
        burst = (hour == 1 and minute == 17) or (hour in (1, 2) and minute == 40)
        rhythm.arrival(t)
        if hour == 2 and minute == 16:
            assert 17 not in rhythm.recurring and not rhythm.spiking
        if hour == 3 and minute == 39:
            assert 40 in rhythm.recurring and rhythm.spiking  # two hours in a row: pre-armed
        t += 0.6 if burst else 6.0
    assert rhythm.recurring == set()


def test_rhythm_spike_state_does_not_flap_at_the_threshold():
    """Traffic hovering at spike_factor x baseline: the state changes a few
    times, not on every arrival that tips the trailing window either way."""
    rhythm = TrafficRhythm(spike_factor=2.0, rate_window_s=10.0, min_baseline_minutes=10, prearm=False)
    t = 0.0
    while t < 20 * 60:  # the baseline: 10 a minute
        rhythm.arrival(t)
        t += 6.0
    flips, state = 0, rhythm.spiking
    rng = random.Random(5)
    end = t + 300
    while t < end:  # ~20 a minute, the threshold, in Poisson arrivals
        rhythm.arrival(t)
        flips += rhythm.spiking != state
        state = rhythm.spiking
        t += rng.expovariate(20 / 60)
    assert 1 <= flips <= 4, flips
    # And once the traffic is back to its baseline, the spike ends after its minute's hold.
    while t < end + 90:
        rhythm.arrival(t)
        t += 6.0
    assert not rhythm.spiking


def test_rhythm_finds_spikes_of_traffic_that_comes_only_on_the_hour():
    """Cron-like API traffic, 100 requests a minute at :00 and :01 and none
    between: the median minute is empty, yet those minutes are the spikes."""
    rhythm = TrafficRhythm(spike_factor=2.0, rate_window_s=10.0, min_baseline_minutes=10, prearm=True,
                           prearm_lead_minutes=1)
    flagged = []
    for minute in range(4 * 60):
        if minute % 60 in (0, 1):
            for i in range(100):
                rhythm.arrival(minute * 60 + (i + 0.5) * 0.6)
                if minute >= 60:
                    flagged.append(rhythm.spiking)
        else:
            rhythm.update(minute * 60 + 30.0)
    assert rhythm.baseline > 0 and rhythm.recurring == {0, 1}
    assert sum(flagged) / len(flagged) > 0.95


def test_policy_relaxes_to_b_window_while_spiking():
    policy = WorkloadAwarePolicy(100, WorkloadAwareConfig(fallback={"enabled": False}))
    c = ctx(workload="to-b", rtype="api", blocks=1)
    policy.insert(1, c, 0, 0.0)
    cat = policy.core.rec[1][0]
    normal = policy.table.window[cat]
    policy._set_spike(True)
    assert policy.state()["traffic_spike"] is True
    assert policy.table.window[cat] == pytest.approx(min(normal * 3.0, 300.0 * 3.0))


def test_topic_switch_detector_keeps_only_recent_sessions_and_flags_the_same():
    """Sessions quiet for max_gap_s are forgotten, without changing any flag."""
    import random

    rng = random.Random(7)
    pruned = TopicSwitchDetector(turns=3, max_gap_s=15.0)
    now, flags, kept = 0.0, [], []
    history: dict[int, list[float]] = {}
    for _ in range(20_000):
        now += rng.expovariate(2.0)  # ~2 arrivals a second over ~3 hours
        session = rng.randrange(300)
        times = history.setdefault(session, [])
        times.append(now)
        last = times[-3:]
        expected = len(last) == 3 and all(b - a < 15.0 for a, b in zip(last, last[1:]))
        flags.append((pruned.arrival(session, now), expected))
        kept.append(len(pruned.sessions))
    assert all(got == want for got, want in flags)
    assert sum(want for _, want in flags) > 50  # quick runs do happen
    assert max(kept) < 80  # sessions active in the last 15 s (~30), not the 300 seen


def test_topic_switch_after_three_quick_turns():
    detector = TopicSwitchDetector(turns=3, max_gap_s=15.0)
    assert not detector.arrival("a", 0.0)
    assert not detector.arrival("a", 5.0)
    assert detector.arrival("a", 12.0)
    assert not detector.arrival("b", 0.0)
    assert not detector.arrival("b", 30.0)
    assert not detector.arrival("b", 40.0)  # 30 s gap inside the last three

    policy = WorkloadAwarePolicy(100, WorkloadAwareConfig(fallback={"enabled": False}))
    names = []
    for turn, now in enumerate([0.0, 5.0, 12.0], 1):
        c = ctx(session="quick", turn=turn, ts=now, blocks=1)
        policy.insert(100 + turn, c, 0, now)
        policy.release(100 + turn, c, now)
        names.append(policy.table.names[policy.core.rec[100 + turn][0]])
    assert [n[2] for n in names[:2]] == [1, 2]
    assert names[2] == ("to-c", "text", "switch")
    assert policy.table.penalty[policy.table.index[names[2]]] == 0.5
    assert policy.state()["topic_switches"] == 1

    # Paper mode scores the paper's (workload, type, turn) categories: no switch
    # class, so no switch is counted as if it had been acted on.
    paper = WorkloadAwarePolicy(100, WorkloadAwareConfig(mode="paper", fallback={"enabled": False}))
    for turn, now in enumerate([0.0, 5.0, 12.0], 1):
        c = ctx(session="quick", turn=turn, ts=now, blocks=1)
        paper.insert(100 + turn, c, 0, now)
        paper.release(100 + turn, c, now)
    assert paper.table.names == [("to-c", "text", 1), ("to-c", "text", 2), ("to-c", "text", 3)]
    assert paper.state()["topic_switches"] == 0


def test_paper_policy_gives_every_turn_its_own_category():
    # The paper's categories are (type, turn): turn 20 of a chat is not turn 3's,
    # although `wa` by default shares one bucket from turn 3 on.
    paper = make_policy("wa-paper", 100, CacheConfig())
    for turn in range(1, 21):
        c = ctx(session=f"s{turn}", turn=turn, ts=float(turn), blocks=1)
        paper.insert(100 + turn, c, 0, float(turn))
        paper.release(100 + turn, c, float(turn))
    assert [name[2] for name in paper.table.names] == list(range(1, 21))
    weighted = WorkloadAwarePolicy(100, quiet())
    for turn in (1, 2, 3, 20):
        c = ctx(session=f"s{turn}", turn=turn, ts=float(turn), blocks=1)
        weighted.insert(100 + turn, c, 0, float(turn))
        weighted.release(100 + turn, c, float(turn))
    assert sorted({name[2] for name in weighted.table.names}) == [1, 2, 3]


def test_shared_class_takes_no_topic_switch_penalty():
    # The shared class is created by whichever request first reuses another
    # session's block; a topic switch of that request must not mark the class.
    policy = WorkloadAwarePolicy(1000, WorkloadAwareConfig(fallback={"enabled": False}))
    first = ctx(session="s0", blocks=1)
    policy.insert(1, first, 0, 0.0)
    policy.release(1, first, 0.0)
    for turn, now in enumerate([10.0, 15.0, 20.0], 1):
        c = ctx(session="s1", turn=turn, ts=now, blocks=2)
        if turn == 3:  # the predicted switch reuses s0's block: the shared class is born here
            policy.hit(1, c, 0, now)
        policy.insert(100 + turn, c, 1, now)
        policy.release(100 + turn, c, now)
        if turn == 3:
            policy.release(1, c, now)
    tab = policy.table
    assert policy.topic_switches == 1
    assert tab.penalty[tab.index[("to-c", "text", "shared")]] == 1.0
    assert tab.penalty[tab.index[("to-c", "text", "switch")]] == 0.5


def test_file_signature_joins_the_category():
    policy = WorkloadAwarePolicy(100, WorkloadAwareConfig(fallback={"enabled": False},
                                                         signature={"enabled": True, "slots": 64}))
    c1 = RequestContext(type="file", signature=3, session="x", prompt_blocks=1)
    c2 = RequestContext(type="file", signature=4, session="y", prompt_blocks=1)
    policy.insert(1, c1, 0, 0.0)
    policy.insert(2, c2, 0, 0.0)
    assert policy.core.rec[1][0] != policy.core.rec[2][0]


# ---- shadow LRU fallback ----------------------------------------------------------------


# A deliberately bad score (spatial only, head and tail classes: every tail goes
# before any head), and a fallback that judges within a minute.
_ADVERSARIAL = {
    "weights": {"reuse": 0.0, "spatial": 1.0, "lifetime": 0.0}, "position_classes": 2,
    "rhythm": {"enabled": False}, "topic_switch": {"enabled": False}, "shared_class": False,
    "fallback": {"window_s": 60.0, "check_interval_s": 10.0, "min_accesses": 100, "margin": 0.05, "sustain_s": 30.0},
    "alarm": {"window_s": 60.0, "min_accesses": 1},
}


def test_fallback_to_lru_on_an_adversarial_stream_and_back():
    # A deliberately bad score (spatial only, head and tail classes: every tail
    # goes before any head) loses to LRU on a small working set mixed with
    # one-off requests, then wins on a loop larger than the cache (LRU's worst case).
    cfg = WorkloadAwareConfig.model_validate(_ADVERSARIAL)
    capacity = 40
    pool = BlockPool(capacity, 0, "wa", CacheConfig(workload_aware=cfg))
    policy = pool.device_policy
    now = 0.0
    one_off = 10_000
    # Phase 1: 8 hot two-block requests cycled, each followed by a one-off request.
    while now < 200.0:
        for i in range(8):
            now += 0.5
            request(pool, [i * 2 + 1, i * 2 + 2], ctx(blocks=2, ts=now, chat_id=i), now)
            one_off += 2
            request(pool, [one_off, one_off + 1], ctx(blocks=2, ts=now, chat_id=one_off), now)
    assert policy.state()["active"] == "lru"
    assert policy.state()["fallbacks"] >= 1
    # Phase 2: a loop of 30 two-block requests (60 keys > 40 blocks).
    while now < 600.0 and policy.state()["active"] == "lru":
        for i in range(30):
            now += 0.5
            request(pool, [50_000 + i * 2, 50_001 + i * 2], ctx(blocks=2, ts=now, chat_id=50_000 + i), now)
    assert policy.state()["active"] == "wa"
    state = policy.state()
    assert set(state) >= {"active", "fallbacks", "reuse_alarm", "traffic_spike"}


def test_fallback_to_lru_in_the_engines_call_order():
    """The engine acquires a prompt's cached prefix at admission and publishes its
    other blocks after the model step, with other requests' calls between: the
    shadow LRU's hits past the real cache's were never counted, so it could never
    be seen ahead and the fallback never fired in a live engine (only in replay,
    which touches a request's blocks in one go).  The stream of the test above,
    through the real scheduler, two requests admitted per step."""
    cfg = WorkloadAwareConfig.model_validate(_ADVERSARIAL)
    bs = 4
    pool = BlockPool(40, 0, "wa", CacheConfig(workload_aware=cfg))
    clock = [0.0]
    scheduler = Scheduler(pool, bs, max_num_seqs=8, max_batched_tokens=256, clock=lambda: clock[0], tenant_fair=False)
    seq_id, one_off = 0, 10_000
    while clock[0] < 200.0:
        for i in range(8):
            clock[0] += 0.5
            admitted = []
            # A one-off prompt, then a hot one: two full blocks and a token each.
            for tokens, chat_id in (([one_off * 10 + j for j in range(9)], one_off),
                                    ([1000 + 10 * i + j for j in range(9)], i)):
                context = RequestContext(prompt_blocks=2, prompt_tokens=9, timestamp=clock[0], chat_id=chat_id)
                admitted.append(Sequence(seq_id, GenerationRequest(f"r{seq_id}", tokens, context=context), 0, bs, "x"))
                scheduler.add(admitted[-1])
                seq_id += 1
            one_off += 2
            scheduler.after_step(scheduler.schedule())  # prefix acquired, then the computed blocks published
            for seq in admitted:
                scheduler.finish(seq, "stop")
    assert pool.device_policy.state()["fallbacks"] >= 1


def test_checks_per_window_are_bounded_and_an_idle_spell_costs_one_window(monkeypatch):
    """Each check sums its windows' intervals and an arrival after an idle spell
    made a window's worth of checks and more: check_interval_s 1e-4 s (accepted)
    took over 20 s for 4 requests, in the engine's pool calls.  Intervals that cut
    a window into more than 300 checks are refused; after an idle spell longer
    than the windows, the checks past the first window's are skipped (each would
    find every window empty)."""
    with pytest.raises(ValidationError, match=r"check_interval_s 0.0001 s cuts a 300 s window into more than 300 "
                                              r"checks; give at least 1 s"):
        WorkloadAwareConfig.model_validate({"fallback": {"check_interval_s": 1e-4}})
    with pytest.raises(ValidationError, match="cuts a 600 s window"):  # the alarm's window counts too
        WorkloadAwareConfig.model_validate({"fallback": {"check_interval_s": 1}, "alarm": {"window_s": 600}})
    # The interval it says to give is itself accepted (rounded up, not to the nearest).
    with pytest.raises(ValidationError, match=r"give at least 3\.334 s"):
        WorkloadAwareConfig.model_validate({"fallback": {"window_s": 1000, "check_interval_s": 1}})
    WorkloadAwareConfig.model_validate({"fallback": {"window_s": 1000, "check_interval_s": 3.334}})
    cfg = WorkloadAwareConfig.model_validate({"fallback": {"check_interval_s": 1.0}})  # 300 checks: the most
    policy = WorkloadAwarePolicy(100, cfg)
    checks = []
    evaluate = policy._evaluate
    monkeypatch.setattr(policy, "_evaluate", lambda now: checks.append(now) or evaluate(now))
    for i, now in enumerate((0.0, 0.5, 100_000.0)):
        policy.insert(i + 1, ctx(ts=now, chat_id=i), 0, now)
        policy.release(i + 1, ctx(ts=now, chat_id=i), now)
    assert len(checks) == 301  # the bucket that ended, then one window of empty ones (not 100,000)
    assert policy.state()["reuse_alarm"] is False


def test_reuse_alarm_raised_and_logged(caplog):
    cfg = WorkloadAwareConfig.model_validate({
        "fallback": {"enabled": False, "check_interval_s": 10.0},
        "alarm": {"window_s": 30.0, "threshold": 0.4, "min_accesses": 1}})
    pool = BlockPool(50, 0, "wa", CacheConfig(workload_aware=cfg))
    with caplog.at_level("INFO", logger="kvgate.cache"):
        for i in range(200):
            now = i * 0.5
            request(pool, [i * 10 + 1, i * 10 + 2], ctx(blocks=2, ts=now, chat_id=i), now)
        assert pool.device_policy.state()["reuse_alarm"] is True
        # Idle past the window: cleared, at INFO, for lack of lookups, not for a ratio recovered.
        request(pool, [1, 2], ctx(blocks=2, ts=500.0, chat_id=999), 500.0)
    assert pool.device_policy.state()["reuse_alarm"] is False
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "reuse alarm" in r.getMessage()]
    assert said == [("WARNING", "reuse alarm raised: prefix hit ratio 0.000 over 30 s, under alarm.threshold 0.40 "
                                "(a KV cache too small for the traffic's reuse, or traffic with little to reuse)"),
                    ("INFO", "reuse alarm cleared: no prompt blocks looked up over 30 s")]


def test_a_nearly_idle_cache_raises_no_reuse_alarm(caplog):
    """A handful of unique prompts hit nothing, but say nothing of the cache's size:
    an alert on the alarm paged on idle replicas.  A window is judged from
    alarm.min_accesses block lookups; below it the alarm clears, and says why."""
    cfg = WorkloadAwareConfig.model_validate({
        "fallback": {"enabled": False, "check_interval_s": 10.0},
        "alarm": {"window_s": 30.0, "threshold": 0.4, "min_accesses": 100}})
    assert WorkloadAwareConfig().alarm.min_accesses == 1000
    pool = BlockPool(400, 0, "wa", CacheConfig(workload_aware=cfg))
    with caplog.at_level("INFO", logger="kvgate.cache"):
        for i in range(40):  # 80 lookups in 20 s, all misses: too few to judge
            request(pool, [i * 10 + 1, i * 10 + 2], ctx(blocks=2, ts=i * 0.5, chat_id=i), i * 0.5)
        assert pool.device_policy.state()["reuse_alarm"] is False
        for i in range(40, 100):  # busier: 120 lookups within the window, still all misses
            now = 20.0 + (i - 40) * 0.25
            request(pool, [i * 10 + 1, i * 10 + 2], ctx(blocks=2, ts=now, chat_id=i), now)
        assert pool.device_policy.state()["reuse_alarm"] is True
        for i in range(100, 110):  # quiet again: a few lookups a window
            now = 60.0 + (i - 100) * 5.0
            request(pool, [i * 10 + 1, i * 10 + 2], ctx(blocks=2, ts=now, chat_id=i), now)
    assert pool.device_policy.state()["reuse_alarm"] is False
    cleared = [r.getMessage() for r in caplog.records if "reuse alarm cleared" in r.getMessage()]
    assert len(cleared) == 1 and "block lookups over 30 s, fewer than alarm.min_accesses 100" in cleared[0]


def test_reuse_alarm_catching_up_after_idle_time_logs_only_a_change_that_stands(caplog):
    """Hits, then a burst of misses, then idle: the first request after the idle
    stretch closes the windows it missed one by one, which raised the alarm (the
    burst's window) and cleared it (the empty ones) in the same millisecond, two
    log lines about the past.  What stands now is logged, and here nothing changed."""
    cfg = WorkloadAwareConfig.model_validate({
        "fallback": {"enabled": False, "check_interval_s": 10.0},
        "alarm": {"window_s": 30.0, "threshold": 0.4, "min_accesses": 1}})
    pool = BlockPool(1000, 0, "wa", CacheConfig(workload_aware=cfg))
    with caplog.at_level("INFO", logger="kvgate.cache"):
        for i in range(60):  # 0-30 s: one prompt again and again, all hits
            request(pool, [1, 2], ctx(blocks=2, ts=i * 0.5, chat_id=i), i * 0.5)
        for i in range(100):  # 30-40 s: new prompts, all misses
            now = 30.0 + i * 0.1
            request(pool, [100 + 2 * i, 101 + 2 * i], ctx(blocks=2, ts=now, chat_id=100 + i), now)
        assert not pool.device_policy.state()["reuse_alarm"]
        request(pool, [1, 2], ctx(blocks=2, ts=100.0, chat_id=999), 100.0)
    assert not pool.device_policy.state()["reuse_alarm"]
    assert [r.getMessage() for r in caplog.records if "reuse alarm" in r.getMessage()] == []


def test_reuse_alarm_windows_are_spans_of_time_not_arrivals(caplog):
    # One request every 120 s, all misses: the 300 s alarm window fills in
    # 300 s of time, however few requests came (not after ten arrivals).
    cfg = WorkloadAwareConfig.model_validate({"fallback": {"enabled": False}, "alarm": {"min_accesses": 1}})
    pool = BlockPool(100_000, 0, "wa", CacheConfig(workload_aware=cfg))
    raised_at = None
    for i in range(12):
        now = i * 120.0
        request(pool, [10**6 + i * 10 + j for j in range(10)], ctx(workload="to-b", rtype="api", blocks=10,
                                                                 ts=now, chat_id=i), now)
        if raised_at is None and pool.device_policy.state()["reuse_alarm"]:
            raised_at = now
    assert raised_at is not None and raised_at <= 480.0


# ---- config -----------------------------------------------------------------------------------


def test_config_section_validates():
    cfg = WorkloadAwareConfig()
    assert (cfg.weights.reuse, cfg.model.gap_floor_s, cfg.model.prior_lambda["to-b"]) == (cfg.weights.reuse, 0.3, 0.8)
    with pytest.raises(ValidationError):
        WorkloadAwareConfig.model_validate({"weigths": {}})
    with pytest.raises(ValidationError):
        WorkloadAwareConfig.model_validate({"mode": "greedy"})
    with pytest.raises(ValidationError):
        WorkloadAwareConfig.model_validate({"overrides": {"video": "fifo"}})
    with pytest.raises(ValidationError):
        WorkloadAwareConfig.model_validate({"weights": {"reuse": -1}})
    with pytest.raises(ValidationError, match="all 0"):
        WorkloadAwareConfig.model_validate({"weights": {"reuse": 0, "spatial": 0, "lifetime": 0}})
    with pytest.raises(ValidationError, match="prior_lambda.to-b"):
        WorkloadAwareConfig.model_validate({"model": {"prior_lambda": {"to-b": -1.0}}})
    # A workload left out keeps its default, as any key left out does (it took to-c's rate).
    partial = WorkloadAwareConfig.model_validate({"model": {"prior_lambda": {"to-c": 0.3}}}).model.prior_lambda
    assert partial == {"to-c": 0.3, "to-b": 0.8, "multimodal": 0.15}
    with pytest.raises(ValidationError) as info:
        CacheConfig.model_validate({"workload_aware": {"rhythm": {"spike_factr": 2}}})
    message = format_config_error(info.value, "config.yaml", CacheConfig)
    assert "workload_aware.rhythm.spike_factr" in message and "spike_factor" in message
    assert WorkloadAwareConfig.model_validate({"overrides": {"multimodal": "fifo"}}).overrides == {"multimodal": "fifo"}


def test_multimodal_fifo_override_keeps_insertion_order():
    policy = WorkloadAwarePolicy(100, quiet(overrides={"multimodal": "fifo"}))
    c = ctx(workload="multimodal", rtype="image", blocks=1)
    for k in (1, 2, 3):
        policy.insert(k, c, 0, float(k))
        policy.release(k, c, float(k))
    policy.hit(1, c, 0, 10.0)  # a hit does not move a FIFO key, but holds it
    assert policy.num_evictable() == 2
    assert policy.evict(11.0) == 2
    policy.release(1, c, 11.0)
    # The busy head was passed over (moved behind 3), as S3-FIFO's scan does.
    assert policy.evict(12.0) == 3
    assert policy.evict(12.0) == 1


def test_a_key_released_behind_a_busy_fifo_head_can_be_evicted_at_once():
    """A FIFO class whose head is held scores INF; a key released behind it at the
    same instant as the eviction that scored it left that score cached, so the
    next eviction raised NoEvictableBlock with an idle block there (through the
    pool, not the NoFreeBlocks the scheduler preempts on: a crashed step)."""
    pool = BlockPool(3, 0, "wa", CacheConfig.model_validate({"workload_aware": {"overrides": {"multimodal": "fifo"}}}))

    def run(keys, image: bool, now: float, hold: bool = False) -> None:
        c = RequestContext(workload="multimodal" if image else "to-c", type="image" if image else "text", turn=1,
                           timestamp=now, prompt_tokens=16, prompt_blocks=1, session="s1" if image else None)
        blocks, _ = pool.touch_or_insert(keys, c, now)
        if not hold:
            pool.release(blocks[::-1], c, now)

    run([101], True, 0.0)
    run([102], False, 0.0)
    run([101], True, 1.0, hold=True)  # the FIFO class's head, held
    run([103, 104], False, 1.0)  # evicts 102, scoring the FIFO class INF (its head is busy)
    run([105], True, 1.0)  # evicts 104; 105 goes behind the busy head, idle
    assert pool.num_free_device() == 2
    assert len(pool.allocate(2, 1.0)) == 2  # 103 and 105
    assert set(pool.cached) == {101}


def test_an_orphan_hit_again_is_in_use_in_a_fifo_class_too():
    # A FIFO-class child orphaned by its parent's eviction, then hit again, must
    # not be evicted while in use (it used to stay in the orphan queue).
    policy = WorkloadAwarePolicy(100, quiet(overrides={"image": "fifo"}))
    c = ctx(workload="multimodal", rtype="image", blocks=2)
    policy.insert(1, c, 0, 0.0)
    policy.insert(2, c, 1, 0.0)
    policy.release(1, c, 0.0)
    policy.release(2, c, 0.0)
    assert policy.evict(1.0) == 1  # queue order; 2 is orphaned
    assert list(policy.core.orphans) == [2]
    policy.hit(2, c, 0, 2.0)
    assert policy.num_evictable() == 0
    with pytest.raises(NoEvictableBlock):
        policy.evict(3.0)
    policy.release(2, c, 3.0)
    assert policy.evict(4.0) == 2


def test_host_tier_policy_logs_nothing_and_never_falls_back(caplog):
    import logging

    from engine.block_pool import BlockPool
    from engine.config import CacheConfig, WorkloadAwareConfig
    from engine.context import RequestContext

    cfg = WorkloadAwareConfig.model_validate({"alarm": {"window_s": 30.0, "threshold": 0.4, "min_accesses": 1},
                                              "fallback": {"check_interval_s": 10.0}})
    pool = BlockPool(50, 50, "wa", CacheConfig(workload_aware=cfg))
    with caplog.at_level(logging.INFO, logger="kvgate.cache"):
        for i in range(200):
            now = i * 0.5
            ctx = RequestContext(timestamp=now, prompt_blocks=2, prompt_tokens=100, chat_id=i)
            blocks, _ = pool.touch_or_insert([i * 10 + 1, i * 10 + 2], ctx, now)
            pool.release(list(reversed(blocks)), ctx, now)
    alarms = [r for r in caplog.records if "reuse alarm raised" in r.getMessage()]
    assert len(alarms) == 1  # the device tier's, once
    assert pool.device_policy.state()["reuse_alarm"] is True
    assert pool.host_policy.shadow_lru is None
    # Its calls are demotions, not requests: no rhythm, no topic switches.
    assert pool.host_policy.rhythm is None and pool.host_policy.topics is None


def test_the_choices_of_one_request_and_its_readmission_are_one_arrival():
    """The scheduler takes a request's cached prefix once per choice (n > 1) and
    again when a preempted request is admitted anew, each time from offset 0 with
    the same context: one arrival, not a topic switch on a session's first turn
    nor a to-B burst counted n times."""
    pool = BlockPool(64, 0, "wa", CacheConfig())
    policy = pool.device_policy
    warm = ctx(session="old", blocks=2, tokens=32)
    request(pool, [1, 2], warm, 0.0)
    arrivals = policy._requests
    fresh = ctx(session="brand-new", blocks=3, tokens=48)
    held = [pool.acquire_prefix([1, 2, 3], fresh, 100.0) for _ in range(3)]
    assert policy._requests == arrivals + 1
    assert policy.topic_switches == 0 and list(policy.topics.sessions["brand-new"]) == [100.0]
    for blocks in held:
        pool.release(blocks[::-1], fresh, 101.0)
    api = ctx(workload="to-b", rtype="api", blocks=2, tokens=32)
    counted = policy.rhythm.count
    for _ in range(4):
        pool.release(pool.acquire_prefix([1, 2], api, 102.0)[::-1], api, 102.0)
    assert policy._requests == arrivals + 2 and policy.rhythm.count == counted + 1


@pytest.mark.parametrize("policy", ["wa", "wa-paper"])
def test_a_block_held_through_a_long_decode_is_last_used_at_its_release(policy):
    """The engine reads a running request's blocks on every step.  Scored by
    their admission time instead, a block held long would sit in its queue behind
    younger ones (queues are in release order) and the head-only scan would
    never see that it is the oldest; each queue must stay in last-use order."""
    cache = CacheConfig(workload_aware=quiet())
    pool = BlockPool(400, 0, policy, cache)
    core = pool.device_policy.core
    rng = random.Random(5)
    held = []
    now = 0.0
    for step in range(300):
        now += rng.random()
        if held and rng.random() < 0.5:
            blocks, context = held.pop(rng.randrange(len(held)))
            pool.release(blocks[::-1], context, now)
        else:
            context = ctx(session=f"s{step}", blocks=2, tokens=32)
            held.append((request(pool, [2 * step + 1, 2 * step + 2], context, now, hold=True)[0], context))
    for q in core.queues:
        last_use = [core.rec[key][1] for key in q]
        assert last_use == sorted(last_use)


def test_an_idle_policy_reports_no_alarm_and_no_spike():
    """Windows roll as requests arrive; the engine's /metrics reads state() on
    every scrape, and an idle engine must not report the last busy minute's
    alarm for ever (an alert on it would never clear)."""
    pool = BlockPool(100, 0, "wa", CacheConfig())
    policy = pool.device_policy
    now = 0.0
    for i in range(3000):  # ten minutes of prompts that never hit
        now = i * 0.2
        request(pool, [4 * i + j for j in range(4)], ctx(session=f"s{i}", blocks=4, tokens=64), now)
    busy = policy.state(now)
    assert busy["reuse_alarm"] and busy["window_hit_ratio"] == 0.0
    idle = policy.state(now + 3600)
    assert not idle["reuse_alarm"] and idle["window_hit_ratio"] is None and not idle["traffic_spike"]
    assert policy.state(now + 1) == busy  # not yet idle for a window
    assert policy.state() == busy  # replay's read, no clock
