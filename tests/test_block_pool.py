import pytest

from engine.block_pool import BlockPool, NoFreeBlocks, PrefixMatch
from engine.context import RequestContext

CTX = RequestContext()


def fill(pool, keys, now=0.0):
    """Allocate and publish one block per key, as the engine does after a prefill."""
    blocks = pool.allocate(len(keys), now)
    for offset, (block, key) in enumerate(zip(blocks, keys)):
        assert pool.cache_block(block, key, CTX, offset, now)
    return blocks


def test_reference_counts_and_release():
    pool = BlockPool(4)
    blocks = fill(pool, [1, 2])
    assert [pool.ref_count[b] for b in blocks] == [1, 1]
    again = pool.acquire_prefix([1, 2, 3], CTX, 1.0)
    assert again == blocks
    assert [pool.ref_count[b] for b in blocks] == [2, 2]
    pool.release(list(reversed(blocks)), CTX, 2.0)
    pool.release(list(reversed(again)), CTX, 2.0)
    assert all(count == 0 for count in pool.ref_count)
    # Released full blocks keep their hash and still match.
    assert pool.match_prefix([1, 2, 3]) == PrefixMatch(2, 0)
    with pytest.raises(RuntimeError):
        pool.release([blocks[0]], CTX, 3.0)


def test_in_use_blocks_are_never_evicted():
    pool = BlockPool(3)
    held = fill(pool, [10, 11])
    freed = fill(pool, [20])
    pool.release(freed, CTX, 1.0)
    # One evictable block: it goes, the held ones stay.
    [block] = pool.allocate(1, 2.0)
    assert block == freed[0]
    assert pool.match_prefix([10, 11]).device == 2
    assert pool.match_prefix([20]).total == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1, 3.0)
    # All or nothing: a failed allocation changed nothing.
    assert pool.num_free_device() == 0
    pool.release([block, *held], CTX, 4.0)


def test_allocation_is_all_or_nothing():
    pool = BlockPool(4)
    fill(pool, [1])
    before = (list(pool.free_device), dict(pool.cached))
    with pytest.raises(NoFreeBlocks):
        pool.allocate(4)
    assert (list(pool.free_device), dict(pool.cached)) == before


def test_unhashed_blocks_are_reclaimed_before_cached_ones():
    pool = BlockPool(3)
    cached = fill(pool, [1, 2])
    partial = pool.allocate(1)  # a request's trailing partial block: never published
    pool.release([*partial, *reversed(cached)], CTX, 1.0)
    [block] = pool.allocate(1, 2.0)
    assert block == partial[0]
    assert pool.match_prefix([1, 2]).device == 2
    assert pool.stats.device_evictions == 0


def test_duplicate_publish_keeps_the_first_block():
    pool = BlockPool(4)
    first = fill(pool, [7])
    second = pool.allocate(1)
    assert not pool.cache_block(second[0], 7, CTX, 0, 0.0)
    assert pool.cached[7] == first[0]
    pool.release(second, CTX, 1.0)
    assert second[0] in pool.free_device  # private block went back unhashed


def test_demotion_then_promotion_with_copies_and_events():
    events = []
    pool = BlockPool(2, 2, record_copies=True, on_event=lambda kind, keys, tier: events.append((kind, keys[0], tier)))
    a = fill(pool, [1, 2])
    pool.release(list(reversed(a)), CTX, 1.0)
    b = fill(pool, [3], now=2.0)  # evicts key 2 (tail first) to host
    assert pool.match_prefix([1, 2]) == PrefixMatch(1, 1)
    host_block = pool.cached[2]
    assert not pool.is_device(host_block)
    assert pool.drain_copies() == [(a[1], host_block)]
    assert pool.stats.demotions == 1
    pool.release(b, CTX, 3.0)
    # A prompt that needs key 2 again promotes it back to a device block.
    got = pool.acquire_prefix([1, 2], CTX, 4.0)
    assert len(got) == 2 and all(pool.is_device(x) for x in got)
    copies = pool.drain_copies()
    # The device block for key 2 was freed by demoting key 3 first: that copy runs first.
    assert copies[-1] == (host_block, got[1])
    assert pool.stats.promotions == 1
    assert ("stored", 2, "host") in events and ("removed", 2, "host") in events
    assert events.count(("stored", 2, "device")) == 2
    pool.release(list(reversed(got)), CTX, 5.0)
    assert all(count == 0 for count in pool.ref_count)


def test_recomputed_block_replaces_its_host_copy():
    """A prompt whose cached run breaks before a block the host tier holds
    computes that block again on the device: the device copy is published and
    the host copy dropped, rather than the new block staying private."""
    events = []
    pool = BlockPool(6, 2, on_event=lambda kind, keys, tier: events.append((kind, keys[0], tier)))
    a = fill(pool, [1, 2])
    pool.release(list(reversed(a)), CTX, 1.0)
    b = fill(pool, [3, 4, 5, 6], now=2.0)
    pool.release(list(reversed(b)), CTX, 3.0)
    spare = pool.allocate(1, 4.0)  # the device's least recent block, key 2, goes to the host
    pool.release(spare, CTX, 4.0)
    assert pool.match_prefix([2]) == PrefixMatch(0, 1)
    # A prompt [7, 2]: its run breaks at once (7 was never cached), so both are computed.
    fresh = pool.allocate(2, 5.0)
    assert pool.cache_block(fresh[0], 7, CTX, 0, 5.0)
    assert pool.cache_block(fresh[1], 2, CTX, 1, 5.0)
    assert pool.cached[2] == fresh[1] and pool.match_prefix([7, 2]) == PrefixMatch(2, 0)
    # Stored on the device before removed from the host: never held nowhere in between.
    assert events[-2:] == [("stored", 2, "device"), ("removed", 2, "host")]
    assert pool.match_prefix([1]) == PrefixMatch(0, 1) and len(pool.free_host) == 1
    pool.release(list(reversed(fresh)), CTX, 6.0)
    assert pool.match_prefix([7, 2]) == PrefixMatch(2, 0)


def test_host_tier_evicts_its_own_victims():
    pool = BlockPool(1, 1)
    for t, key in enumerate([1, 2, 3]):
        blocks, _ = pool.touch_or_insert([key], CTX, float(t))
        pool.release(blocks, CTX, float(t))
    # device holds 3, host holds 2, key 1 fell out of both tiers.
    assert pool.match_prefix([3]).device == 1
    assert pool.match_prefix([2]).host == 1
    assert pool.match_prefix([1]).total == 0
    assert pool.stats.host_evictions == 1


def test_touch_or_insert_counts_leading_hits_only():
    pool = BlockPool(8)
    blocks, hits = pool.touch_or_insert([1, 2, 3], CTX, 0.0)
    assert hits == 0
    pool.release(list(reversed(blocks)), CTX, 0.0)
    blocks, hits = pool.touch_or_insert([1, 9, 3], CTX, 1.0)
    assert hits == 1  # key 3 is cached but follows a miss: not a prefix hit
    assert pool.ref_count[pool.cached[3]] == 1
    pool.release(list(reversed(blocks)), CTX, 1.0)


def test_request_larger_than_the_cache_is_cut_not_crashed():
    pool = BlockPool(2)
    blocks, hits = pool.touch_or_insert([1, 2, 3, 4], CTX, 0.0)
    assert len(blocks) == 2 and hits == 0
    pool.release(list(reversed(blocks)), CTX, 0.0)
    assert pool.num_free_device() == 2


def test_a_request_waiting_for_blocks_leaves_its_cached_prefix_untouched():
    """Admission checks capacity before taking the prefix: a request that must
    wait does not count as a reuse of its prefix (nor refresh it in LRU) on every
    step it waits, as acquiring and releasing it each time would."""
    from engine.request import GenerationRequest
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    bs = 4
    pool = BlockPool(8, 0, "lru")
    hits = []
    real_hit = pool.device_policy.hit
    pool.device_policy.hit = lambda key, ctx, offset, now: (hits.append(key), real_hit(key, ctx, offset, now))
    clock = [0.0]
    scheduler = Scheduler(pool, bs, max_num_seqs=4, max_batched_tokens=64, clock=lambda: clock[0])

    def step():
        batch = scheduler.schedule()
        scheduler.after_step(batch)
        for seq, _ in batch:
            if seq.num_computed == seq.num_tokens:
                seq.append(7)
        clock[0] += 1.0

    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    first = Sequence(0, GenerationRequest("first", prefix + [9]), 0, bs, "x")
    scheduler.add(first)
    step()
    scheduler.finish(first, "stop")  # the prefix's two blocks stay cached, evictable
    big = Sequence(1, GenerationRequest("big", list(range(100, 120))), 0, bs, "x")
    scheduler.add(big)
    step()
    waiting = Sequence(2, GenerationRequest("waiting", prefix + list(range(200, 212))), 0, bs, "x")
    scheduler.add(waiting)
    hits.clear()
    for _ in range(5):
        step()
    assert waiting in scheduler.waiting and hits == []
    scheduler.finish(big, "stop")
    step()
    # Admitted once blocks are free: now its prefix counts, once per block it reuses.
    assert waiting not in scheduler.waiting and len(hits) == waiting.cached_tokens // bs > 0


def test_a_failed_allocation_gives_the_acquired_prefix_back():
    """Allocating the first chunk may fail for more than a lack of blocks (an
    eviction's device-to-host copy can run out of memory); the prefix blocks
    admission took must go back or they stay held for the engine's life."""
    from engine.request import GenerationRequest
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    bs = 4
    pool = BlockPool(8, 0, "lru")
    scheduler = Scheduler(pool, bs, max_num_seqs=4, max_batched_tokens=64, clock=lambda: 0.0)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    first = Sequence(0, GenerationRequest("first", prefix + [9]), 0, bs, "x")
    scheduler.add(first)
    scheduler.after_step(scheduler.schedule())
    scheduler.finish(first, "stop")
    assert pool.num_in_use() == 0 and pool.num_cached() == 2

    def out_of_memory(count, now):
        raise RuntimeError("CUDA out of memory")

    pool.allocate = out_of_memory
    scheduler.add(Sequence(1, GenerationRequest("second", prefix + [10, 11]), 0, bs, "x"))
    with pytest.raises(RuntimeError, match="out of memory"):
        scheduler.schedule()
    assert pool.num_in_use() == 0


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo", "wa", "wa-paper"])
def test_a_block_taken_again_after_release_is_in_use(policy):
    """Another choice of the same request (same context, same offset) takes the
    block its sibling just released: it must leave the evictable set, or a second
    request could evict it and write into it while it is read."""
    ctx = RequestContext(workload="to-c", type="text", session="s")
    pool = BlockPool(2, policy=policy)
    [block] = pool.allocate(1, 0.0)
    assert pool.cache_block(block, 7, ctx, 0, 0.0)
    pool.release([block], ctx, 1.0)
    assert pool.acquire_prefix([7], ctx, 2.0) == [block]
    assert pool.num_free_device() == 1  # the one free block, not the one in use
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2, 3.0)
    other = pool.allocate(1, 3.0)
    assert other != [block] and pool.cached[7] == block
    pool.release([block, *other], ctx, 4.0)


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo", "wa", "wa-paper"])
def test_blocks_in_use_are_counted_in_constant_time_and_exactly(policy):
    """num_in_use (every health probe reports it) is the device blocks requests hold,
    whatever the policy keeps cached, pinned or ready to evict."""
    import random

    rng = random.Random(3)
    pool = BlockPool(24, host_blocks=8, policy=policy)
    held: list[tuple[list[int], RequestContext]] = []
    for step in range(400):
        now = float(step)
        if held and (rng.random() < 0.45 or pool.num_free_device() < 6):
            blocks, ctx = held.pop(rng.randrange(len(held)))
            pool.release(blocks, ctx, now)
        else:
            ctx = RequestContext(workload=rng.choice(("to-c", "to-b")), session=f"s{rng.randrange(5)}")
            base = rng.randrange(6) * 100
            keys = [base + i for i in range(rng.randint(1, 5))]
            blocks = pool.acquire_prefix(keys, ctx, now)
            fresh = pool.allocate(len(keys) - len(blocks), now)
            for offset, (block, key) in enumerate(zip(fresh, keys[len(blocks):]), len(blocks)):
                pool.cache_block(block, key, ctx, offset, now)
            held.append((blocks + fresh, ctx))
        assert pool.num_in_use() == sum(1 for count in pool.ref_count[: pool.num_device] if count)


def test_a_key_moving_between_tiers_is_held_throughout_its_events():
    """A gateway's index follows these events one at a time and routes between
    them: a demotion (device -> host) or a promotion (host -> device) must say
    "stored" on the new tier before "removed" on the old one, or the key (and
    every block after it in a prompt) looks uncached in between."""
    held: dict[int, set] = {}
    gaps = []

    def on_event(kind, keys, tier):
        for key in keys:
            tiers = held.setdefault(key, set())
            if kind == "stored":
                if key in emptied:
                    gaps.append(key)  # went unheld, then came back: a gap a router could see
                tiers.add(tier)
            else:
                tiers.discard(tier)
                if not tiers:
                    emptied.add(key)

    emptied: set = set()
    pool = BlockPool(2, 2, on_event=on_event)
    a = fill(pool, [1, 2])
    pool.release(list(reversed(a)), CTX, 1.0)
    emptied.clear()
    b = fill(pool, [3], now=2.0)  # demotes key 2
    assert pool.match_prefix([1, 2]) == PrefixMatch(1, 1)
    assert gaps == []
    pool.release(b, CTX, 3.0)
    emptied.clear()
    got = pool.acquire_prefix([1, 2], CTX, 4.0)  # promotes key 2 (demoting key 3)
    assert pool.match_prefix([1, 2]) == PrefixMatch(2, 0)
    assert gaps == []
    pool.release(list(reversed(got)), CTX, 5.0)
