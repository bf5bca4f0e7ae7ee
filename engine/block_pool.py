"""The KV block pool: two tiers of fixed capacity, reference counts, prefix lookup.

Physical block ids ``0 .. device_blocks-1`` are the device tier and
``device_blocks .. device_blocks+host_blocks-1`` the host tier; the engine
indexes its KV tensors with them.  The pool owns all bookkeeping; each tier's
eviction policy only decides which evictable block goes next.

Guarantees:
- a block with a reference (in use by a request) is never evicted;
- a released full block keeps its hash and stays matchable until evicted;
- unhashed free blocks (partial, aborted) are reused before any eviction;
- a block evicted from the device tier is demoted to the host tier when the
  host tier exists (the host evicts by its own policy to make room); a hit in
  the host tier is promoted back to a device block;
- data moves are recorded in ``copies`` as (src block, dst block) in the
  order they must run; the engine drains them before its next model step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from engine.config import CacheConfig
from engine.context import RequestContext
from engine.policies import EvictionPolicy, NoEvictableBlock, make_policy

DEVICE, HOST = "device", "host"

# on_event(kind, keys, tier): kind is "stored" or "removed".
EventSink = Callable[[str, list[int], str], None]


class NoFreeBlocks(RuntimeError):
    """The device tier cannot supply the blocks asked for right now."""


class PrefixMatch(NamedTuple):
    """Leading run of a prompt's block keys that the pool holds."""

    device: int  # how many of the run are on the device tier
    host: int  # how many are on the host tier (promotable)

    @property
    def total(self) -> int:
        return self.device + self.host


@dataclass(slots=True)
class PoolStats:
    device_evictions: int = 0
    host_evictions: int = 0
    demotions: int = 0
    promotions: int = 0


class BlockPool:
    def __init__(
        self,
        device_blocks: int,
        host_blocks: int = 0,
        policy: str = "lru",
        cache_config: CacheConfig | None = None,
        *,
        record_copies: bool = False,
        on_event: EventSink | None = None,
        policy_kwargs: dict | None = None,
    ) -> None:
        if device_blocks <= 0:
            raise ValueError(f"device_blocks must be positive, got {device_blocks}")
        if host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {host_blocks}")
        self.num_device = device_blocks
        self.num_host = host_blocks
        total = device_blocks + host_blocks
        self.ref_count = [0] * total
        self.block_key: list[int | None] = [None] * total
        self.block_ctx: list[RequestContext | None] = [None] * total
        self.block_offset = [0] * total
        self.cached: dict[int, int] = {}  # key -> block id, either tier
        # Stacks, lowest id on top so allocation order is predictable.
        self.free_device = list(range(device_blocks - 1, -1, -1))
        self.free_host = list(range(total - 1, device_blocks - 1, -1))
        kwargs = policy_kwargs or {}
        self.policy_name = policy
        self.device_policy: EvictionPolicy = make_policy(policy, device_blocks, cache_config, **kwargs)
        self.host_policy: EvictionPolicy | None = (
            make_policy(policy, host_blocks, cache_config, tier=HOST, **kwargs) if host_blocks else None
        )
        self.stats = PoolStats()
        self.record_copies = record_copies
        self.copies: list[tuple[int, int]] = []
        self.on_event = on_event

    # ---- queries -------------------------------------------------------

    def is_device(self, block: int) -> bool:
        return block < self.num_device

    def match_prefix(self, keys: Sequence[int]) -> PrefixMatch:
        """Length of the leading run of ``keys`` held in either tier; changes nothing."""
        device = host = 0
        cached = self.cached
        for key in keys:
            block = cached.get(key)
            if block is None:
                break
            if block < self.num_device:
                device += 1
            else:
                host += 1
        return PrefixMatch(device, host)

    def prefix_cost(self, keys: Sequence[int]) -> tuple[int, int]:
        """(length of the leading cached run of ``keys``, free or evictable device
        blocks that acquiring it would use up: one per host block promoted, and
        each unreferenced device block, which stops being evictable); changes nothing."""
        run = used = 0
        cached = self.cached
        for key in keys:
            block = cached.get(key)
            if block is None:
                break
            run += 1
            if block >= self.num_device or not self.ref_count[block]:
                used += 1
        return run, used

    def num_free_device(self) -> int:
        """Device blocks that an allocation could obtain now (free or evictable)."""
        return len(self.free_device) + self.device_policy.num_evictable()

    def num_cached(self, tier: str = DEVICE) -> int:
        if tier == DEVICE:
            return sum(1 for block in self.cached.values() if block < self.num_device)
        return sum(1 for block in self.cached.values() if block >= self.num_device)

    def num_in_use(self) -> int:
        """Device blocks held by requests: neither free nor idle in the cache.  O(1),
        for every health probe (an H200's pool holds ~300k blocks)."""
        return self.num_device - self.num_free_device()

    # ---- request lifecycle ---------------------------------------------

    def acquire_prefix(self, keys: Sequence[int], ctx: RequestContext, now: float) -> list[int]:
        """Take a reference on the leading cached run of ``keys``.

        Host-tier blocks are promoted (a device block is taken for each).  The
        run stops early when promotion finds no device block.  Returns the
        device block ids, one per matched key.
        """
        blocks: list[int] = []
        for offset, key in enumerate(keys):
            block = self.cached.get(key)
            if block is None:
                break
            if block >= self.num_device:
                block = self._promote(block, key, ctx, offset, now)
                if block is None:
                    break
            else:
                self._hit(block, key, ctx, offset, now)
            blocks.append(block)
        return blocks

    def allocate(self, count: int, now: float = 0.0) -> list[int]:
        """``count`` fresh, unhashed device blocks, each with one reference.

        All or nothing: raises NoFreeBlocks and changes nothing when the tier
        cannot supply them.
        """
        if count > self.num_free_device():
            raise NoFreeBlocks(f"need {count} blocks, {self.num_free_device()} obtainable")
        blocks = [self._take_device_block(now) for _ in range(count)]
        for block in blocks:
            self.ref_count[block] = 1
        return blocks

    def cache_block(self, block: int, key: int, ctx: RequestContext, offset: int, now: float) -> bool:
        """Publish a full in-use device block under ``key`` so later prompts match it.

        Returns False (and leaves the block private) when another device block
        already holds ``key``, e.g. two requests computed the same prefix at once.
        A host-tier copy gives way instead: the prompt's cached run stopped
        before it, so it was computed again here, and keeping the host copy
        would leave this one unshared and the next prompt promoting the old one.
        """
        if self.block_key[block] is not None:
            return False
        held = self.cached.get(key)
        if held is not None:
            if held < self.num_device:
                return False
            self._drop_host_copy(held, key, emit=False)
            self.free_host.append(held)
        self.block_key[block] = key
        self.block_ctx[block] = ctx
        self.block_offset[block] = offset
        self.cached[key] = block
        self.device_policy.insert(key, ctx, offset, now)
        self._emit("stored", key, DEVICE)
        if held is not None:
            # Stored on the device before removed from the host: a follower applying
            # the events one at a time never sees the key held nowhere.
            self._emit("removed", key, HOST)
        return True

    def release(self, blocks: Sequence[int], ctx: RequestContext, now: float) -> None:
        """Drop one reference from each block, in the order given.

        Pass a request's blocks tail first (as vLLM does) so that its tail
        becomes evictable before its head.
        """
        ref_count = self.ref_count
        policy = self.device_policy
        for block in blocks:
            count = ref_count[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} released more often than acquired")
            ref_count[block] = count
            if count == 0:
                key = self.block_key[block]
                if key is None:
                    self.free_device.append(block)
                else:
                    policy.release(key, ctx, now)

    def touch_or_insert(self, keys: Sequence[int], ctx: RequestContext, now: float) -> tuple[list[int], int]:
        """Trace replay's access: every key is touched if cached, else inserted.

        Returns (device blocks held, leading hits).  A key that cannot get a
        block (all in use) is left uncached, as are the keys after it.
        This is the replay hot loop, hence the local bindings.
        """
        cached = self.cached
        num_device = self.num_device
        ref_count = self.ref_count
        block_ctx = self.block_ctx
        block_offset = self.block_offset
        policy = self.device_policy
        policy_hit = policy.hit
        blocks: list[int] = []
        hits = 0
        leading = True
        for offset, key in enumerate(keys):
            block = cached.get(key)
            if block is not None:
                if block < num_device:
                    ref_count[block] += 1
                    block_ctx[block] = ctx
                    block_offset[block] = offset
                    policy_hit(key, ctx, offset, now)
                else:
                    block = self._promote(block, key, ctx, offset, now)
                if block is not None:
                    if leading:
                        hits += 1
                    blocks.append(block)
                    continue
            leading = False
            if not self.free_device and policy.num_evictable() == 0:
                break
            block = self._take_device_block(now)
            ref_count[block] = 1
            self.cache_block(block, key, ctx, offset, now)
            blocks.append(block)
        return blocks, hits

    # ---- internals -----------------------------------------------------

    def _hit(self, block: int, key: int, ctx: RequestContext, offset: int, now: float) -> None:
        self.ref_count[block] += 1
        self.block_ctx[block] = ctx
        self.block_offset[block] = offset
        self.device_policy.hit(key, ctx, offset, now)

    def _take_device_block(self, now: float) -> int:
        if self.free_device:
            return self.free_device.pop()
        key = self.device_policy.evict(now)
        block = self.cached.pop(key)
        self.block_key[block] = None
        self.stats.device_evictions += 1
        if self.host_policy is not None:
            self._demote(block, key, now)
        # After the host copy's "stored": between a demotion's two events the key is
        # on both tiers, never on neither (a router would see the prompt cut there).
        self._emit("removed", key, DEVICE)
        return block

    def _demote(self, block: int, key: int, now: float) -> None:
        host_block = self._take_host_block(now)
        if host_block is None:
            return
        ctx = self.block_ctx[block] or RequestContext()
        offset = self.block_offset[block]
        if self.record_copies:
            self.copies.append((block, host_block))
        self.block_key[host_block] = key
        self.block_ctx[host_block] = ctx
        self.block_offset[host_block] = offset
        self.cached[key] = host_block
        self.host_policy.insert(key, ctx, offset, now)
        self.host_policy.release(key, ctx, now)
        self.stats.demotions += 1
        self._emit("stored", key, HOST)

    def _take_host_block(self, now: float) -> int | None:
        if self.free_host:
            return self.free_host.pop()
        try:
            key = self.host_policy.evict(now)
        except NoEvictableBlock:
            return None
        block = self.cached.pop(key)
        self.block_key[block] = None
        self.stats.host_evictions += 1
        self._emit("removed", key, HOST)
        return block

    def _promote(self, host_block: int, key: int, ctx: RequestContext, offset: int, now: float) -> int | None:
        if not self.free_device and self.device_policy.num_evictable() == 0:
            return None
        # Leave the host tier first so the demotion this may cause cannot pick it,
        # and free the host block only after: a demotion into it now would be
        # copied before the promotion copies out of it.
        self._drop_host_copy(host_block, key, emit=False)
        block = self._take_device_block(now)
        if self.record_copies:
            self.copies.append((host_block, block))
        self.free_host.append(host_block)
        self.ref_count[block] = 1
        self.stats.promotions += 1
        self.cache_block(block, key, ctx, offset, now)
        self._emit("removed", key, HOST)  # after the device copy's "stored" (see cache_block)
        self.device_policy.hit(key, ctx, offset, now)
        return block

    def _drop_host_copy(self, host_block: int, key: int, emit: bool = True) -> None:
        self.host_policy.remove(key)
        del self.cached[key]
        self.block_key[host_block] = None
        if emit:
            self._emit("removed", key, HOST)

    def _emit(self, kind: str, key: int, tier: str) -> None:
        if self.on_event is not None:
            self.on_event(kind, [key], tier)

    def drain_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies
