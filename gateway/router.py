"""Replica choice: cached prefix blocks against load.

The router is a plain object over per-replica indexes and its own in-flight
accounting; it never touches the network, so a trace simulation can drive it
with N simulated caches (anything with ``match(keys) -> int``) exactly as the
gateway drives it with live replicas.

Cost of sending a request to replica r (prefix-aware):

    uncached prefill blocks on r  +  load_weight * in-flight blocks on r

in blocks, not fractions (fractions over-reward short prompts).  In-flight
blocks are the gateway's own requests plus the load replicas report
(``set_external_load``): other gateways' requests on a shared `kvgate engine`,
and an external backend's queue when it has a metrics endpoint.  Two guards keep
a hot prefix or a run of misses from piling onto one replica: the imbalance
valve (route by load alone while max-min in-flight is large) and hot-prefix
spreading (past ``hot_prefix_inflight`` concurrent requests on one replica
sharing the same cached run, named by its last block, the next may go to a less
loaded replica).  Session routing is sticky within bounds: the valve, and no
replica takes more than twice the others' mean number of in-flight requests (plus one).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from itertools import islice
from typing import Collection, Iterable, Iterator, NamedTuple, Protocol, Sequence

import xxhash

from gateway.config import RouterConfig

DEVICE_BIT, HOST_BIT = 1, 2
# Pricing of backend-reported load (Router.set_external_load).
_PRIOR_REQUEST_TOKENS = 1024
_MEAN_DECAY = 0.01
_KV_PRESSURE_START = 0.9
_KV_FULL_REQUESTS = 4.0
_TIER_BITS = {"device": DEVICE_BIT, "host": HOST_BIT}
# Keys indexed (or swept) between two yields to the event loop in ExactIndex.rebuild
# and in FleetIndex's sweep (a few ms).
_REBUILD_SLICE = 20_000
# Session routing's bound (after consistent hashing with bounded loads): a
# replica takes a session's request while it would hold at most this times one
# more than the other candidates' mean in-flight requests, or at most
# hot_prefix_inflight (a few requests are no imbalance); else the session's next
# choice does.
_SESSION_LOAD_FACTOR = 2.0


class BackendLoad(NamedTuple):
    """Load a replica reports about itself (Router.set_external_load)."""

    waiting: float  # requests queued on an external server (vLLM's num_requests_waiting)
    kv_usage: float | None  # device KV blocks held by requests, 0..1; None: not reported
    # A `kvgate engine`'s every request, running or waiting, this gateway's included
    # (other gateways sharing the engine send the rest); None: an external server.
    held: int | None = None


class PrefixIndex(Protocol):
    def match(self, keys: Sequence[int]) -> int:
        """Length of the leading run of ``keys`` the replica holds."""


class FleetIndex:
    """Which exact replicas hold each block key: key -> one bit per replica slot.

    Routing asks every replica at once how much of a prompt it holds.  Each
    replica's own map (``ExactIndex.tiers``) answers for that replica alone, one
    probe per block per replica: a 2,048-block prompt held by 32 replicas of a
    million keys took 28-42 ms of the event loop.  This map answers for all of them
    in one probe per block (``match_all``).  The replicas' own maps stay the
    record of which tier holds what; this one mirrors only presence.

    A replica re-indexed from a snapshot (or cleared) moves to a fresh slot at
    once; its old slot's bits are swept out afterwards, a slice at a time with
    other tasks running between, by walking the old map it no longer changes,
    and the slot is reused once swept.
    """

    __slots__ = ("held", "_next_slot", "_free", "_pending", "_sweeper")

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self._next_slot = 0
        self._free: list[int] = []  # swept slots, lowest reused first (keeps the masks small ints)
        # Slots given up and not yet swept: [slot, keys left, an iterator over them].
        self._pending: list[list] = []
        self._sweeper: asyncio.Task | None = None

    def take_slot(self) -> int:
        if self._free:
            self._free.sort()
            return self._free.pop(0)
        self._next_slot += 1
        return self._next_slot - 1

    def add(self, keys: Iterable[int], bit: int) -> None:
        held = self.held
        for key in keys:
            other = held.get(key)
            # A key no other slot holds shares the slot's own bit object (no int per key).
            held[key] = bit if other is None else other | bit

    def discard(self, keys: Iterable[int], bit: int) -> None:
        held, clear = self.held, ~bit
        for key in keys:
            left = held.get(key, 0) & clear
            if left:
                held[key] = left
            else:
                held.pop(key, None)

    def give_up(self, slot: int, keys: Collection[int]) -> None:
        """Forget ``slot``, which held ``keys`` (a collection nobody changes any more):
        swept in slices when a loop runs, else at once; the slot is reused after."""
        if keys:
            self._pending.append([slot, len(keys), iter(keys)])
        else:
            self._free.append(slot)  # nothing to sweep (a replica cleared, or re-indexed empty)
        if not self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            for _ in self._sweep():
                pass
            return
        # A sweeper left on a loop that has since closed never finishes: start another.
        if self._sweeper is None or self._sweeper.done() or self._sweeper.get_loop() is not loop:
            self._sweeper = asyncio.create_task(self._sweep_in_slices(), name="kvgate-index-sweep")

    async def _sweep_in_slices(self) -> None:
        for _ in self._sweep():
            await asyncio.sleep(0)

    def _sweep(self) -> Iterator[None]:
        """Clear given-up slots' bits, yielding every _REBUILD_SLICE keys; the
        smallest first, so that a resync of many replicas at once frees slots
        (and keeps the masks short) soonest.  An entry stays listed until it is
        swept whole, so a sweep cancelled half-way is taken up by the next."""
        pending = self._pending
        while pending:
            entry = min(pending, key=lambda e: e[1])
            slot, _, keys = entry
            while part := list(islice(keys, _REBUILD_SLICE)):
                self.discard(part, 1 << slot)
                entry[1] -= len(part)
                yield
            pending.remove(entry)
            self._free.append(slot)

    def match_all(self, keys: Sequence[int], slots: Sequence[int]) -> list[int]:
        """For each slot, the length of the leading run of ``keys`` it holds, in one pass."""
        alive = 0
        for slot in slots:
            alive |= 1 << slot
        held = self.held
        drops: list[tuple[int, int]] = []  # (slots' bits that missed, at this block)
        n = 0
        for key in keys:
            here = held.get(key, 0) & alive
            if here != alive:
                drops.append((alive ^ here, n))
                alive = here
                if not alive:
                    break
            n += 1
        if not drops:
            return [n] * len(slots)
        if not alive and len(drops) == 1:  # all missed at the same block (a new prompt: the first)
            return [drops[0][1]] * len(slots)
        out = []
        for slot in slots:
            bit = 1 << slot
            for gone, at in drops:
                if gone & bit:
                    out.append(at)
                    break
            else:  # never dropped out: it holds every key (then n == len(keys))
                out.append(n)
        return out


class _Unshared:
    """The fleet of an index alone, which mirrors nothing: one replica needs no
    fleet-wide map (a lone `kvgate serve` or `kvgate engine` pays nothing for it)."""

    __slots__ = ()

    def take_slot(self) -> int:
        return 0

    def add(self, keys: Iterable[int], bit: int) -> None:
        pass

    def discard(self, keys: Iterable[int], bit: int) -> None:
        pass

    def give_up(self, slot: int, keys: Collection[int]) -> None:
        pass


_UNSHARED = _Unshared()


class ExactIndex:
    """The block keys a replica holds, kept exactly from its KV events, with its
    presence mirrored in a ``FleetIndex`` slot once ``share_fleet`` has put it
    on one with other replicas' indexes.

    A key can sit on the device tier, the host tier or (briefly, between a
    demotion's two events) both; it is held while any tier holds it.
    """

    __slots__ = ("tiers", "fleet", "slot")

    def __init__(self, fleet: FleetIndex | None = None) -> None:
        self.tiers: dict[int, int] = {}
        self.fleet: FleetIndex | _Unshared = fleet if fleet is not None else _UNSHARED
        self.slot = self.fleet.take_slot()

    def match(self, keys: Sequence[int]) -> int:
        tiers = self.tiers
        n = 0
        for key in keys:
            if key not in tiers:
                break
            n += 1
        return n

    def apply(self, kind: str, keys: Sequence[int], tier: str) -> None:
        bit = _TIER_BITS.get(tier, DEVICE_BIT)
        tiers = self.tiers
        if kind == "stored":
            new = []
            for key in keys:
                had = tiers.get(key, 0)
                if not had:
                    new.append(key)
                tiers[key] = had | bit
            if new:
                self.fleet.add(new, 1 << self.slot)
        elif kind == "removed":
            gone = []
            for key in keys:
                left = tiers.get(key, 0) & ~bit
                if left:
                    tiers[key] = left
                elif tiers.pop(key, None) is not None:
                    gone.append(key)
            if gone:
                self.fleet.discard(gone, 1 << self.slot)
        elif kind == "cleared":
            self.reset({})

    def reset(self, held: dict[str, Sequence[int]]) -> None:
        """Hold exactly ``held`` (tier -> keys) from now on."""
        for _ in self._build(held):
            pass

    async def rebuild(self, held: dict[str, Sequence[int]]) -> None:
        """reset() without holding the event loop: a snapshot of a million keys
        takes a few hundred milliseconds to index, so the new map (and a new
        slot in the fleet's) is built a slice at a time, other tasks running
        between slices, and replaces the old one (still routed on meanwhile) at the end."""
        building = self._build(held)
        try:
            for _ in building:
                await asyncio.sleep(0)
        finally:
            building.close()  # cancelled half-way: the half-built slot is given up now

    def _build(self, held: dict[str, Sequence[int]]) -> Iterator[None]:
        tiers: dict[int, int] = {}
        fleet = self.fleet
        slot = fleet.take_slot()
        try:
            yield from self._fill(tiers, fleet, slot, held)
        except BaseException:
            fleet.give_up(slot, tiers)  # cancelled (or failed) half-built: its bits go with it
            raise
        if fleet is not self.fleet:
            # Moved to another fleet meanwhile (share_fleet after the replicas
            # started): the new map goes there, in a slot of that fleet's.
            fleet.give_up(slot, list(tiers))  # a copy: this map goes on changing
            slot = self.fleet.take_slot()
            self.fleet.add(tiers, 1 << slot)
        old_tiers, old_slot = self.tiers, self.slot
        self.tiers, self.slot = tiers, slot
        self.fleet.give_up(old_slot, old_tiers)

    @staticmethod
    def _fill(tiers: dict[int, int], fleet: FleetIndex | _Unshared, slot: int,
              held: dict[str, Sequence[int]]) -> Iterator[None]:
        """Build ``tiers`` from ``held`` and mark its keys in ``slot``, yielding every _REBUILD_SLICE keys."""
        for n, (tier, keys) in enumerate(held.items()):
            bit = _TIER_BITS.get(tier, DEVICE_BIT)
            for start in range(0, len(keys), _REBUILD_SLICE):
                part = keys[start:start + _REBUILD_SLICE]
                # A key on two tiers at once (between a demotion's two events) keeps both bits.
                both = {key: tiers[key] | bit for key in tiers.keys() & part} if n else None
                tiers.update(dict.fromkeys(part, bit))
                if both:
                    tiers.update(both)
                fleet.add(part, 1 << slot)
                yield

    def move_to(self, fleet: FleetIndex) -> None:
        """Mirror this index in ``fleet`` from now on (a rebuild under way lands there too)."""
        if fleet is not self.fleet:
            if isinstance(self.fleet, FleetIndex):
                self.fleet.give_up(self.slot, list(self.tiers))  # a copy: this map goes on changing
            self.fleet, self.slot = fleet, fleet.take_slot()
            fleet.add(self.tiers, 1 << self.slot)

    def __len__(self) -> int:
        return len(self.tiers)


def share_fleet(indexes: Sequence[object]) -> FleetIndex | None:
    """Mirror the ExactIndexes among ``indexes``, if there are two or more, in one
    FleetIndex, so the router matches them all in one pass."""
    exact = [index for index in indexes if isinstance(index, ExactIndex)]
    if len(exact) < 2:
        return None
    fleet = FleetIndex()
    for index in exact:
        index.move_to(fleet)
    return fleet


def match_each(keys: Sequence[int], indexes: Sequence[PrefixIndex], cands: Sequence[int]) -> list[int]:
    """Each candidate's matched blocks: one pass over ``keys`` for those whose
    indexes share a FleetIndex, one per candidate for the others (external
    servers' approximate indexes)."""
    first = indexes[cands[0]]
    fleet = first.fleet if isinstance(first, ExactIndex) else None
    if isinstance(fleet, FleetIndex):  # the usual case: every candidate on it
        slots = []
        for i in cands:
            index = indexes[i]
            if not isinstance(index, ExactIndex) or index.fleet is not fleet:
                break
            slots.append(index.slot)
        else:
            return fleet.match_all(keys, slots)
    fleet = None
    slots = []
    shared: list[int] = []  # positions in cands of the indexes on ``fleet``
    for pos, i in enumerate(cands):
        index = indexes[i]
        if isinstance(index, ExactIndex) and isinstance(index.fleet, FleetIndex):
            if fleet is None:
                fleet = index.fleet
            if index.fleet is fleet:
                slots.append(index.slot)
                shared.append(pos)
    if fleet is None:
        return [indexes[i].match(keys) for i in cands]
    matched = fleet.match_all(keys, slots)
    if len(shared) == len(cands):
        return matched
    out = [-1] * len(cands)
    for pos, m in zip(shared, matched):
        out[pos] = m
    return [m if m >= 0 else indexes[cands[pos]].match(keys) for pos, m in enumerate(out)]


class ApproxIndex:
    """What an external replica probably holds: what we sent it, recently.

    Without KV events the best guess is that the blocks of a routed prompt stay
    cached for ``ttl_s`` and that the cache holds at most ``capacity`` blocks,
    oldest dropped first (an LRU model of the remote cache), and of one prompt
    its tail first, as the servers' prefix caches free them: a lost head would
    make the whole prompt a miss while its tail held the room.
    """

    __slots__ = ("ttl_s", "capacity", "_seen", "_clock")

    def __init__(self, ttl_s: float, capacity: int, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._seen: OrderedDict[int, float] = OrderedDict()
        self._clock = clock

    def match(self, keys: Sequence[int]) -> int:
        cutoff = self._clock() - self.ttl_s
        seen = self._seen
        n = 0
        for key in keys:
            stamp = seen.get(key)
            if stamp is None or stamp < cutoff:
                break
            n += 1
        return n

    def record(self, keys: Sequence[int]) -> None:
        now = self._clock()
        seen = self._seen
        for key in reversed(keys):  # the head the most recent
            seen[key] = now
            seen.move_to_end(key)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        self._expire(now)

    def _expire(self, now: float) -> None:
        """Entries past ttl_s leave (oldest first: the order is by time), so that
        the count is of what match() still believes held."""
        cutoff = now - self.ttl_s
        seen = self._seen
        while seen and next(iter(seen.values())) < cutoff:
            seen.popitem(last=False)

    def clear(self) -> None:
        self._seen.clear()

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._seen)


# Every reason a Decision may give (metrics export each from zero).
DECISION_REASONS = ("prefix", "load", "imbalance", "hot-spread", "round-robin", "session", "session-spill", "only")


class Decision(NamedTuple):
    replica: int
    reason: str  # one of DECISION_REASONS
    matched_blocks: int


class Ticket:
    """One request's share of a replica's load; ``Router.release`` is idempotent."""

    __slots__ = ("replica", "tokens", "hot_key", "released")

    def __init__(self, replica: int, tokens: int, hot_key: int | None) -> None:
        self.replica = replica
        self.tokens = tokens
        self.hot_key = hot_key
        self.released = False


class Router:
    def __init__(self, cfg: RouterConfig, names: Sequence[str], block_size: int, rotation: int = 0) -> None:
        """``rotation``: where round-robin and the tie-breaks among equal replicas
        start.  Gateways in front of the same replicas each start elsewhere: all
        from 0, they turned in step, and new prompts sent to two gateways at once
        went to the same replica each time while another idled."""
        self.cfg = cfg
        self.names = list(names)
        self.block_size = max(1, block_size)
        n = len(self.names)
        self.inflight_tokens = [0] * n
        self.inflight_requests = [0] * n
        # Load a backend reports that the gateway did not send or cannot see
        # (other gateways and clients, queueing): tokens added to the load term.
        # Remote engines and external replicas with a metrics_url set it (set_external_load).
        self.external_tokens = [0] * n
        # Mean tokens charged per request, to price a reported waiting request.
        self._mean_request_tokens = float(_PRIOR_REQUEST_TOKENS)
        self._hot: dict[tuple[int, int], int] = {}
        self._turn = rotation  # round-robin's position
        # Rotation among equal candidates, advanced only by decisions that used it
        # (misses, least-load): advanced by every decision, a miss followed by an
        # even number of hits found the same parity each time, and with 2
        # replicas every new prompt went to the same one.
        self._spread = rotation
        self._everyone = list(range(n))
        self._name_seeds = [name.encode() for name in self.names]

    # -- decisions

    def choose(
        self,
        keys: Sequence[int],
        indexes: Sequence[PrefixIndex],
        healthy: Sequence[bool],
        session: str | None = None,
        exclude: Sequence[int] = (),
    ) -> Decision | None:
        """Pick a replica for a prompt with block ``keys``; None when none is usable."""
        if not exclude and all(healthy):
            cands = self._everyone  # the usual case, without building a list per request
        else:
            cands = [i for i in self._everyone if healthy[i] and i not in exclude]
            if not cands:
                return None
        policy = self.cfg.policy
        if len(cands) == 1:
            i = cands[0]
            return Decision(i, "only", indexes[i].match(keys) if policy == "prefix-aware" else 0)
        if policy == "round-robin":
            self._turn += 1
            return Decision(cands[self._turn % len(cands)], "round-robin", 0)
        loads = self._loads()
        if policy == "session" and session is not None:
            if self._imbalanced(cands, loads):
                # Past the valve the busiest replica is passed over: its sessions go
                # to their next choice, every other one stays home (all went to the
                # least loaded, turn by turn, losing their caches; passing over every
                # replica past the valve kept fewer hits in kvgate replay).
                busiest = max(cands, key=loads.__getitem__)
                cands = [i for i in cands if i != busiest]
            return self._session(session, cands)
        if policy != "prefix-aware" or self._imbalanced(cands, loads):
            reason = "imbalance" if policy == "prefix-aware" else "load"
            i = self._least_loaded(cands, loads)
            return Decision(i, reason, indexes[i].match(keys) if policy == "prefix-aware" else 0)
        return self._prefix_aware(keys, indexes, cands, loads)

    def _prefix_aware(
        self, keys: Sequence[int], indexes: Sequence[PrefixIndex], cands: Sequence[int], loads: Sequence[int]
    ) -> Decision:
        nblocks = len(keys)
        weight = self.cfg.load_weight / self.block_size
        n = len(cands)
        turn = self._spread
        best = best_matched = -1
        best_rank = None
        matched = match_each(keys, indexes, cands) if nblocks else [0] * n
        for pos, i in enumerate(cands):
            m = matched[pos]
            # Ties break by load, then by a rotating order over the candidates so
            # equal misses spread (a replica out of routing passes no extra share on).
            rank = ((nblocks - m) + weight * loads[i], loads[i], (pos - turn) % n)
            if best_rank is None or rank < best_rank:
                best, best_matched, best_rank = i, m, rank
        if not best_matched:
            self._spread += 1
            return Decision(best, "load", 0)
        # The hot prefix is the cached run this request shares (e.g. a system prompt),
        # named by its last block's key.
        key = keys[best_matched - 1]
        hot = self._hot.get((best, key), 0)
        if hot >= self.cfg.hot_prefix_inflight:
            # Replicate a hot prefix rather than queueing everyone on its holder.
            alt_pos = min(
                (pos for pos, i in enumerate(cands) if i != best),
                key=lambda pos: (self._hot.get((cands[pos], key), 0), loads[cands[pos]], (pos - turn) % n),
            )
            alt = cands[alt_pos]
            if loads[alt] < loads[best] and self._hot.get((alt, key), 0) < hot:
                return Decision(alt, "hot-spread", matched[alt_pos])
        return Decision(best, "prefix", best_matched)

    def _loads(self) -> list[int]:
        ext = self.external_tokens
        if not any(ext):
            return self.inflight_tokens
        return [a + b for a, b in zip(self.inflight_tokens, ext)]

    def _imbalanced(self, cands: Sequence[int], all_loads: Sequence[int]) -> bool:
        loads = all_loads if cands is self._everyone else [all_loads[i] for i in cands]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.cfg.imbalance_abs_tokens and hi > self.cfg.imbalance_rel * lo

    def _least_loaded(self, cands: Sequence[int], loads: Sequence[int]) -> int:
        self._spread += 1
        n, turn, reqs = len(cands), self._spread, self.inflight_requests
        return cands[min(range(n), key=lambda pos: (loads[cands[pos]], reqs[cands[pos]], (pos - turn) % n))]

    def _session(self, session: str, cands: Sequence[int]) -> Decision:
        """The session's replica by rendezvous hashing (a replica leaving moves only
        its own sessions), passed over while it holds more than its bounded share."""
        s = session.encode()
        # The order over every replica: the session's home is its first whether or not
        # it can take the request now (a retry away from it, or its home out of
        # routing, is a spill).
        order = sorted(self._everyone, reverse=True,
                       key=lambda i: xxhash.xxh3_64_intdigest(s, seed=xxhash.xxh3_64_intdigest(self._name_seeds[i])))
        home = order[0]
        if cands is not self._everyone:
            order = [i for i in order if i in cands]
        if len(order) == 1:  # one replica left below the valve
            return Decision(order[0], "session" if order[0] == home else "session-spill", 0)
        reqs = self.inflight_requests
        total, others, floor = sum(reqs[i] for i in cands), len(cands) - 1, self.cfg.hot_prefix_inflight
        # Against the others' mean: with the replica's own requests in the mean,
        # two replicas' bound was the whole fleet's load, so it never applied.
        i = next((i for i in order
                  if reqs[i] + 1 <= max(_SESSION_LOAD_FACTOR * ((total - reqs[i]) / others + 1), floor)),
                 order[-1])
        return Decision(i, "session" if i == home else "session-spill", 0)

    # -- in-flight accounting

    def acquire(self, replica: int, tokens: int, keys: Sequence[int] = (), matched: int = 0) -> Ticket:
        """Count a request against ``replica`` *before* it is sent.

        ``matched`` is how many leading ``keys`` the replica holds (the decision's
        ``matched_blocks``); the request then counts towards that prefix's heat.
        """
        hot_key = keys[matched - 1] if 0 < matched <= len(keys) else None
        self._mean_request_tokens += (tokens - self._mean_request_tokens) * _MEAN_DECAY
        self.inflight_tokens[replica] += tokens
        self.inflight_requests[replica] += 1
        if hot_key is not None:
            slot = (replica, hot_key)
            self._hot[slot] = self._hot.get(slot, 0) + 1
        return Ticket(replica, tokens, hot_key)

    def release(self, ticket: Ticket) -> None:
        """Undo ``acquire``; safe to call more than once (every path calls it in ``finally``)."""
        if ticket.released:
            return
        ticket.released = True
        r = ticket.replica
        self.inflight_tokens[r] -= ticket.tokens
        self.inflight_requests[r] -= 1
        if ticket.hot_key is not None:
            slot = (r, ticket.hot_key)
            left = self._hot.get(slot, 0) - 1
            if left > 0:
                self._hot[slot] = left
            else:
                self._hot.pop(slot, None)

    def set_external_load(self, replica: int, load: BackendLoad) -> None:
        """A backend's own load figures (vLLM: num_requests_waiting, kv_cache_usage_perc;
        a `kvgate engine`: the requests it holds, from its health probe).

        Each request the gateway did not send counts as an average request of
        this gateway's traffic: a `kvgate engine`'s requests beyond this
        gateway's in-flight ones (other gateways'), an external server's
        waiting ones.  KV usage past ``_KV_PRESSURE_START`` means the next
        request will wait for blocks or evict cached prefixes: it ramps up to
        ``_KV_FULL_REQUESTS`` more requests at 100% (for a `kvgate engine`, in
        proportion to the others' share of its requests).  (An external server's
        waiting requests include this gateway's own queued ones, which so
        count twice; that only happens when the backend is already queueing,
        where leaning away from it is the right direction anyway.)
        """
        kv_usage = load.kv_usage
        pressure = 0.0
        if kv_usage is not None and kv_usage > _KV_PRESSURE_START:
            pressure = _KV_FULL_REQUESTS * min(1.0, (kv_usage - _KV_PRESSURE_START) / (1.0 - _KV_PRESSURE_START))
        if load.held is not None:
            # Ours are counted already; requests in transit either way make the
            # difference briefly small or negative, never a lasting error.
            extra = float(max(0, load.held - self.inflight_requests[replica]))
            # Our own requests' share of the KV pressure is in their in-flight
            # tokens already: only the others' share is added.
            if extra:
                extra += pressure * extra / load.held
        else:
            extra = max(0.0, load.waiting) + pressure
        self.external_tokens[replica] = int(extra * self._mean_request_tokens)

    def load_tokens(self, prompt_tokens: int, max_tokens: int, n: int) -> int:
        """In-flight tokens charged for a request: its prompt plus expected decode."""
        return prompt_tokens + n * min(max_tokens, self.cfg.decode_tokens_estimate)
