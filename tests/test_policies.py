import random

import pytest

from engine.block_pool import BlockPool
from engine.config import CacheConfig
from engine.context import RequestContext
from engine.policies import NoEvictableBlock, make_policy
from engine.policies.belady import BeladyPolicy
from engine.policies.classic import FIFOPolicy, LRUPolicy, S3FIFOPolicy

CTX = RequestContext()


def run_request(pool, keys, now):
    blocks, hits = pool.touch_or_insert(keys, CTX, now)
    pool.release(list(reversed(blocks)), CTX, now)  # tail first, as vLLM frees
    return hits


class VllmFreeQueue:
    """vLLM v1's FreeKVCacheBlockQueue semantics, written out for the test.

    All free blocks sit in one doubly linked queue; a finished request's
    blocks are appended in reverse order; a prefix hit takes a block out of
    the queue; an allocation pops the head, and a popped block that carries
    a hash is evicted.  Returns the order in which hashes are evicted.
    """

    def __init__(self, num_blocks):
        self.queue = list(range(num_blocks))
        self.hash_of = {}
        self.block_of = {}
        self.evicted = []

    def request(self, keys):
        held = []
        for key in keys:
            block = self.block_of.get(key)
            if block is not None:
                if block in self.queue:
                    self.queue.remove(block)
            else:
                block = self.queue.pop(0)
                old = self.hash_of.pop(block, None)
                if old is not None:
                    del self.block_of[old]
                    self.evicted.append(old)
                self.hash_of[block] = key
                self.block_of[key] = block
            held.append(block)
        self.queue.extend(reversed(held))


def test_lru_evicts_in_vllm_free_queue_order():
    requests = [
        ["a1", "a2", "a3"],
        ["b1", "b2"],
        ["a1", "a2", "c3"],  # shares a prefix with A, then diverges
        ["d1"],
        ["b1", "e2", "e3", "e4"],
        ["a1", "f2"],
        ["g1", "g2", "g3"],
    ]
    ids = {name: i for i, name in enumerate(sorted({k for r in requests for k in r}))}
    vllm = VllmFreeQueue(6)
    evicted = []
    pool = BlockPool(6, on_event=lambda kind, keys, tier: kind == "removed" and evicted.extend(keys))
    for t, names in enumerate(requests):
        vllm.request(names)
        run_request(pool, [ids[n] for n in names], float(t))
    assert len(vllm.evicted) >= 6
    assert evicted == [ids[n] for n in vllm.evicted]


def test_lru_releases_tail_first_so_tails_go_first():
    policy = LRUPolicy()
    for key in (1, 2, 3):
        policy.insert(key, CTX, key - 1, 0.0)
    for key in (3, 2, 1):
        policy.release(key, CTX, 1.0)
    assert policy.order() == [3, 2, 1]
    policy.hit(2, CTX, 1, 2.0)
    assert policy.order() == [3, 1]
    assert [policy.evict(3.0), policy.evict(3.0)] == [3, 1]
    with pytest.raises(NoEvictableBlock):
        policy.evict(4.0)


def test_fifo_ignores_hits():
    policy = FIFOPolicy()
    for key in (1, 2, 3):
        policy.insert(key, CTX, 0, 0.0)
        policy.release(key, CTX, 0.0)
    policy.hit(1, CTX, 0, 1.0)
    policy.release(1, CTX, 1.0)
    assert [policy.evict(2.0) for _ in range(3)] == [1, 2, 3]


def test_fifo_skips_in_use_keys():
    policy = FIFOPolicy()
    for key in (1, 2):
        policy.insert(key, CTX, 0, 0.0)
    policy.release(2, CTX, 0.0)
    assert policy.evict(1.0) == 2
    with pytest.raises(NoEvictableBlock):
        policy.evict(1.0)
    policy.release(1, CTX, 2.0)
    assert policy.evict(3.0) == 1


def test_fifo_holds_an_entry_per_key_however_often_a_hot_key_is_read():
    """Each hit and release of a cached key pushed one more heap entry, dropped only
    when an eviction reached it: a hot system prompt in a cache that seldom evicts
    grew the heap without bound (300,003 entries for 3 keys after 100k requests)."""
    policy = FIFOPolicy()
    for key in (1, 2, 3):
        policy.insert(key, CTX, 0, 0.0)
        policy.release(key, CTX, 0.0)
    for n in range(10_000):
        for key in (1, 2, 3):
            policy.hit(key, CTX, 0, float(n))
            policy.release(key, CTX, float(n))
    assert len(policy._heap) == 3
    # A key removed and cached again goes behind the others, as a new one.
    policy.remove(1)
    policy.insert(1, CTX, 0, 1e5)
    policy.release(1, CTX, 1e5)
    assert [policy.evict(2e5) for _ in range(3)] == [2, 3, 1] and not policy._heap


def test_fifo_drops_the_entries_of_keys_removed_before_an_eviction_reached_them():
    """A host tier that never fills: its blocks are promoted (removed) and demoted
    (cached again) over and over, each demotion one more heap entry, dropped only
    when an eviction reached it (319,936 entries for 64 cached keys after 20k
    requests).  The order of the live keys is kept."""
    policy = FIFOPolicy()
    for key in range(64):
        policy.insert(key, CTX, 0, 0.0)
        policy.release(key, CTX, 0.0)
    for n in range(1, 10_001):
        key = n % 64
        policy.remove(key)  # promoted to the device tier
        policy.insert(key, CTX, 0, float(n))  # demoted back
        policy.release(key, CTX, float(n))
    assert len(policy._heap) <= 2 * 64 + 64
    # Cached last: 10,000 % 64 = 16, so 17..63 then 0..16.
    assert [policy.evict(1e5) for _ in range(64)] == [*range(17, 64), *range(17)]


def test_s3fifo_keeps_reread_keys_over_one_hit_wonders():
    pool = BlockPool(10, policy="s3fifo")
    hot = [1, 2, 3]
    for t in range(3):
        for key in hot:
            run_request(pool, [key], float(t))
    for key in range(100, 130):  # a scan of one-hit wonders
        run_request(pool, [key], 10.0)
    assert all(pool.match_prefix([key]).total == 1 for key in hot)


def test_s3fifo_ghost_hit_goes_to_main():
    policy = S3FIFOPolicy(10)
    for key in range(10):
        policy.insert(key, CTX, 0, 0.0)
        policy.release(key, CTX, 0.0)
    victim = policy.evict(1.0)
    assert victim == 0  # the small queue's unread key
    assert victim in policy._ghost
    policy.insert(victim, CTX, 0, 2.0)  # re-requested soon after: admitted to main
    assert victim in policy._main and victim not in policy._ghost


def test_s3fifo_evicts_from_small_when_every_main_key_is_in_use():
    # Main is over its share and every key in it is held by a running
    # request; the only evictable key waits in the small queue.  The CLOCK
    # over main must give up after one pass instead of spinning forever.
    policy = S3FIFOPolicy(10)  # small 1, main 9
    for key in range(11):
        policy.insert(key, CTX, 0, 0.0)  # key 0 fills small, the rest go to main
    policy.release(0, CTX, 0.0)
    assert len(policy._main) > policy._main_size and 0 in policy._small
    assert policy.evict(1.0) == 0
    with pytest.raises(NoEvictableBlock):
        policy.evict(1.0)


def test_belady_beats_or_ties_every_online_policy():
    rng = random.Random(7)
    stream = [[rng.randrange(40)] for _ in range(3000)]
    hits = {}
    future = {}
    for index, keys in enumerate(stream):
        future.setdefault(keys[0], []).append(index)
    for name in ("lru", "fifo", "s3fifo", "belady"):
        pool = BlockPool(10, policy=name, policy_kwargs={"future": future} if name == "belady" else None)
        total = 0
        for index, keys in enumerate(stream):
            ctx = RequestContext(request_index=index)
            blocks, hit = pool.touch_or_insert(keys, ctx, float(index))
            pool.release(blocks, ctx, float(index))
            total += hit
        hits[name] = total
    assert hits["belady"] >= max(hits.values())
    assert hits["belady"] > hits["lru"] * 1.2


def test_belady_refuses_to_run_without_the_future():
    with pytest.raises(ValueError, match="replay"):
        BeladyPolicy(10)


def test_make_policy_by_name():
    assert isinstance(make_policy("lru", 8), LRUPolicy)
    assert isinstance(make_policy("s3fifo", 8, CacheConfig()), S3FIFOPolicy)
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("lfu", 8)
