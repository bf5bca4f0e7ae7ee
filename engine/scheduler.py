"""Continuous batching over the block pool.

Each step runs every running sequence first (a decode token, or the next
chunk of a long prompt), then admits waiting ones while the token budget
(``max_batched_tokens``) and ``max_num_seqs`` allow.  Admission takes the
cached prefix from the pool and computes only the rest.  While several tenants
wait, a free slot goes to the one with the fewest sequences running (its
earliest waiting sequence), or, when that one lacks blocks, to the earliest of
all; with every slot taken, a tenant waiting with two or more fewer sequences
running than another gets a slot by preempting that one's newest; with one
tenant, and with ``tenant_fair`` off, waiting sequences are taken in order.  When blocks run out
the newest running sequence is preempted: its blocks are released (the full
ones stay cached, so the recompute usually hits them) and it waits again.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable, NamedTuple

from engine.block_pool import BlockPool, NoFreeBlocks
from engine.sequence import Sequence, Status

# Tenants' heads whose cached prefix one admission (or one step's fairness
# preemption) looks up, at most: the _FAIR_FIRST fairest always, the others a few
# at a time, a window that moves along them from one try to the next, so that
# each is tried within a few steps.
_FAIR_TRIES = 8
_FAIR_FIRST = 4


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int  # new tokens computed for it this step


def _tenant(seq: Sequence) -> object:
    return seq.request.context.tenant


class WaitQueue:
    """Waiting sequences: one queue per tenant, each in arrival order (a
    preempted sequence, or a request's later choices, at the front).  Each
    sequence gets an order number as it is added, so the earliest of all is
    a question of the tenants' heads, not of every sequence waiting."""

    __slots__ = ("_queues", "_back", "_front", "_len")

    def __init__(self) -> None:
        self._queues: dict[object, deque[Sequence]] = {}
        self._back = 0  # the next order number at the back
        self._front = 0  # the last one given at the front
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, seq: Sequence) -> bool:
        queue = self._queues.get(_tenant(seq))
        return queue is not None and seq in queue

    @property
    def tenants(self) -> int:
        return len(self._queues)

    def add(self, seq: Sequence, front: bool = False) -> None:
        tenant = _tenant(seq)
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        if front:
            self._front -= 1
            seq.wait_order = self._front
            queue.appendleft(seq)
        else:
            seq.wait_order = self._back
            self._back += 1
            queue.append(seq)
        self._len += 1

    def head(self) -> Sequence:
        """The earliest sequence waiting (first come, first served)."""
        if len(self._queues) == 1:
            return next(iter(self._queues.values()))[0]
        return min((queue[0] for queue in self._queues.values()), key=lambda seq: seq.wait_order)

    def heads(self) -> list[Sequence]:
        """Each tenant's earliest waiting sequence."""
        return [queue[0] for queue in self._queues.values()]

    def by_fairness(self, running: Counter) -> list[Sequence]:
        """Each tenant's earliest sequence, the tenants with the fewest sequences
        ``running`` first (the earliest first among equals)."""
        return sorted((queue[0] for queue in self._queues.values()),
                      key=lambda seq: (running[_tenant(seq)], seq.wait_order))

    def remove(self, seq: Sequence) -> None:
        tenant = _tenant(seq)
        queue = self._queues[tenant]
        if queue[0] is seq:
            queue.popleft()
        else:
            queue.remove(seq)
        if not queue:
            del self._queues[tenant]
        self._len -= 1


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        tenant_fair: bool = True,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.clock = clock
        self.tenant_fair = tenant_fair
        self._fair_turn = 0  # where the window of tenants' heads tried (_some) is
        self.waiting = WaitQueue()
        self.running: list[Sequence] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        self.waiting.add(seq, front)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        now = self.clock()
        if self.tenant_fair and self.waiting and len(self.running) >= self.max_num_seqs:
            self._preempt_for_fairness(now)
        budget = self.max_batched_tokens
        scheduled: list[ScheduledSeq] = []
        queue = deque(self.running)
        self.running = []
        preempted = False
        while queue and budget > 0:
            seq = queue.popleft()
            count = min(seq.num_tokens - seq.num_computed, budget)
            if not self._grow(seq, count, queue, now):
                preempted = True
                continue
            scheduled.append(ScheduledSeq(seq, count))
            self.running.append(seq)
            budget -= count
        # Out of budget: the rest stay running and go first next step.
        self.running.extend(queue)
        # Admitting while others were just preempted would only thrash.
        if not preempted:
            self._admit_waiting(budget, scheduled, now)
        return scheduled

    def _preempt_for_fairness(self, now: float) -> None:
        """Every slot taken while a tenant waits that runs at least two fewer
        sequences than another: that one's newest sequence is preempted, and the
        admission that follows gives its slot to the tenant with the fewest.
        Admission alone would leave the waiting tenant to wait until the other's
        sequences end, minutes for long answers (16 prompts x n=8 held every slot).
        The preempted sequence's full blocks stay cached, so its recompute is
        mostly hits.  Only when the waiting one's first chunk would then find its
        blocks: otherwise the slot would go back to the preempted sequence, each step."""
        running = Counter(_tenant(seq) for seq in self.running)
        most = max(running.values())
        behind = [head for head in self.waiting.heads() if most - running[_tenant(head)] >= 2]
        for head in self._some(behind, _FAIR_TRIES):
            tenant = _tenant(head)
            top, most = running.most_common(1)[0]
            if most - running[tenant] < 2:
                continue
            victim = next(seq for seq in reversed(self.running) if _tenant(seq) == top)
            run, used = self.pool.prefix_cost(head.cacheable_prefix_keys())
            need = self._first_chunk(head, run, self.max_batched_tokens)[1]
            # Only the victim's own blocks come free: those it shares (its siblings'
            # prompt, its tenant's system prompt) stay held by the others.
            ref_count = self.pool.ref_count
            freed = sum(1 for block in victim.block_table if ref_count[block] == 1)
            if need + used > self.pool.num_free_device() + freed:
                continue
            self.running.remove(victim)
            self.preempt(victim, now)
            running[top] -= 1
            running[tenant] += 1  # the slot it is about to take

    def _some(self, heads: list[Sequence], tries: int) -> list[Sequence]:
        """At most ``tries`` of ``heads``, in their order: the first _FAIR_FIRST, then
        a window of the others that moves on at each call."""
        if len(heads) <= tries:
            return heads
        rest = heads[_FAIR_FIRST:]
        span = tries - _FAIR_FIRST
        start = self._fair_turn % len(rest)
        self._fair_turn += span
        return heads[:_FAIR_FIRST] + [rest[i] for i in sorted((start + j) % len(rest) for j in range(span))]

    def _grow(self, seq: Sequence, count: int, queue: deque[Sequence], now: float) -> bool:
        """Give ``seq`` blocks for ``count`` more tokens, preempting the newest others if needed."""
        need = seq.blocks_needed(count)
        while True:
            try:
                seq.block_table.extend(self.pool.allocate(need, now))
                return True
            except NoFreeBlocks:
                if queue:
                    self.preempt(queue.pop(), now)
                else:
                    self.preempt(seq, now)
                    return False

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq], now: float) -> None:
        waiting = self.waiting
        running: Counter | None = None  # sequences running per tenant, counted once tenants compete
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            earliest = waiting.head()
            if self.tenant_fair and waiting.tenants > 1:
                if running is None:
                    running = Counter(_tenant(s) for s in self.running)
                # Each tenant's head, the fewest running first, up to the earliest of
                # all: one that lacks blocks must not keep out the next tenant's that
                # fits (tenant-fair would be first come, first served whenever one
                # large request waits), and none after the earliest goes before it
                # (so that it cannot starve behind later ones).
                candidates = waiting.by_fairness(running)
                # Each try looks up a prompt's cached prefix: with hundreds of tenants
                # waiting on a full pool, every step would look up all of theirs.
                candidates = self._some(candidates[:candidates.index(earliest)], _FAIR_TRIES - 1) + [earliest]
            else:
                candidates = [earliest]
            for seq in candidates:
                count = self._admit(seq, budget, now)
                if count is not None:
                    break
            else:
                break
            waiting.remove(seq)
            if running is not None:
                running[_tenant(seq)] += 1
            seq.status = Status.RUNNING
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, count))
            budget -= count

    def _admit(self, seq: Sequence, budget: int, now: float) -> int | None:
        """Take the cached prefix and blocks for the first chunk; None if blocks are short."""
        ctx = seq.request.context
        keys = seq.cacheable_prefix_keys()
        # Check first, acquire after: acquiring touches the prefix (a hit for the
        # eviction policy, host blocks promoted), which a request that then waits
        # for blocks must not do on every step (vLLM checks before touching too).
        run, used = self.pool.prefix_cost(keys)
        if self._first_chunk(seq, run, budget)[1] + used > self.pool.num_free_device():
            return None
        blocks = self.pool.acquire_prefix(keys, ctx, now)
        cached = len(blocks) * self.block_size
        count, need = self._first_chunk(seq, len(blocks), budget)
        try:
            fresh = self.pool.allocate(need, now)
        except NoFreeBlocks:
            self.pool.release(blocks[::-1], ctx, now)
            return None
        except BaseException:
            # No sequence owns the prefix yet: give it back, or it stays held for good.
            self.pool.release(blocks[::-1], ctx, now)
            raise
        seq.block_table = blocks + fresh
        seq.num_computed = cached
        seq.num_published = len(blocks)
        if seq.cached_tokens is None:
            seq.cached_tokens = cached
            if seq.index == 0:
                # The request's lookup, once, as its usage reports it: a sibling
                # choice's "hit" is the prompt its first choice has just computed.
                self.prefix_query_tokens += seq.num_tokens
                self.prefix_hit_tokens += cached
        return count

    def _first_chunk(self, seq: Sequence, cached_blocks: int, budget: int) -> tuple[int, int]:
        """(tokens of the first chunk, fresh blocks it needs) when ``cached_blocks``
        of the prompt come from the cache."""
        cached = cached_blocks * self.block_size
        count = min(seq.num_tokens - cached, budget)
        return count, -(-(cached + count) // self.block_size) - cached_blocks

    def after_step(self, scheduled: list[ScheduledSeq]) -> None:
        """The step's KV is in the pool: advance and publish blocks that filled up."""
        now = self.clock()
        for seq, count in scheduled:
            seq.num_computed += count
            self._publish(seq, now)

    def _publish(self, seq: Sequence, now: float) -> None:
        full = min(seq.num_computed // self.block_size, len(seq.block_keys))
        ctx = seq.request.context
        for index in range(seq.num_published, full):
            self.pool.cache_block(seq.block_table[index], seq.block_keys[index], ctx, index, now)
        seq.num_published = max(seq.num_published, full)

    # ---- leaving ---------------------------------------------------------

    def preempt(self, seq: Sequence, now: float) -> None:
        self._release(seq, now)
        seq.reset_for_recompute()
        self.add(seq, front=True)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove ``seq`` wherever it is and free its blocks at once."""
        if seq.status is Status.FINISHED:
            return
        # After a step that failed half-way a sequence may be marked running
        # without being in the list: finishing it must still work.
        if seq.status is Status.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq, self.clock())
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence, now: float) -> None:
        # Tail first, as vLLM frees: the tail becomes evictable before the head.
        if seq.block_table:
            self.pool.release(seq.block_table[::-1], seq.request.context, now)
        seq.block_table = []
