"""The fleet-wide exact index: every replica's block keys in one map.

Each replica's ``ExactIndex`` is a slot in a shared ``FleetIndex``, so routing
reads every replica's matched prefix in one pass over a prompt's keys.  These
tests hold the shared map to what one map per replica would say (a plain model
written here), through any order of KV events, snapshots and clears, and check
that slots given up are swept out and reused rather than piling up.
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

import gateway.router as router
from gateway.app import GATEWAY, create_app
from gateway.config import ReplicaConfig, RouterConfig
from gateway.router import ExactIndex, FleetIndex, Router, match_each, share_fleet
from tests.engine_procs import tiny_config

TIERS = {"device": router.DEVICE_BIT, "host": router.HOST_BIT}


async def _swept(fleet: FleetIndex) -> None:
    """Let the fleet's sweeper run out (a bounded wait: a sweeper that never ends fails here)."""
    for _ in range(10_000):
        if fleet._sweeper is None or fleet._sweeper.done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the sweep did not finish")


class OneMapPerReplica:
    """What a replica holds, kept the obvious way (the model the fleet map must equal)."""

    def __init__(self) -> None:
        self.tiers: dict[int, int] = {}

    def apply(self, kind: str, keys: list[int], tier: str) -> None:
        bit = TIERS[tier]
        for key in keys:
            if kind == "stored":
                self.tiers[key] = self.tiers.get(key, 0) | bit
            elif self.tiers.get(key, 0) & ~bit:
                self.tiers[key] &= ~bit
            else:
                self.tiers.pop(key, None)

    def match(self, keys: list[int]) -> int:
        return next((n for n, key in enumerate(keys) if key not in self.tiers), len(keys))


# Few distinct keys, so that replicas share keys and events hit held ones; some
# keys far apart and some negative.
KEYS = st.sampled_from([0, 1, 2, 3, 1024, 1025, 2**63 + 5, 2**64 - 1, -7, 99])
OPS = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 3), st.sampled_from(["stored", "removed"]), st.lists(KEYS, max_size=6),
                  st.sampled_from(["device", "host"])),
        st.tuples(st.integers(0, 3), st.just("cleared"), st.just([]), st.just("device")),
        st.tuples(st.integers(0, 3), st.just("reset"), st.lists(KEYS, max_size=6), st.lists(KEYS, max_size=3)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, prompt=st.lists(KEYS, max_size=8))
def test_the_shared_map_answers_as_one_map_per_replica_would(ops, prompt):
    fleet = FleetIndex()
    views = [ExactIndex(fleet) for _ in range(4)]
    models = [OneMapPerReplica() for _ in range(4)]
    for replica, kind, keys, extra in ops:
        if kind == "reset":
            views[replica].reset({"device": keys, "host": extra})
            models[replica] = OneMapPerReplica()
            models[replica].apply("stored", keys, "device")
            models[replica].apply("stored", extra, "host")
        elif kind == "cleared":
            views[replica].apply("cleared", [], "device")
            models[replica] = OneMapPerReplica()
        else:
            views[replica].apply(kind, keys, extra)
            models[replica].apply(kind, keys, extra)
        for view, model in zip(views, models):
            assert view.tiers == model.tiers and len(view) == len(model.tiers)
    wanted = [model.match(prompt) for model in models]
    assert [view.match(prompt) for view in views] == wanted
    assert fleet.match_all(prompt, [view.slot for view in views]) == wanted
    assert fleet.match_all(prompt, [views[2].slot, views[0].slot]) == [wanted[2], wanted[0]]
    # No loop runs here, so every slot given up was swept at once: the map holds
    # the four replicas' keys, each with the bits of the replicas holding it, and
    # no more slots were taken than were ever needed at once.
    holders = {key: sum(1 << view.slot for view, model in zip(views, models) if key in model.tiers)
               for model in models for key in model.tiers}
    assert fleet.held == holders
    assert fleet._next_slot <= 5


def test_routing_reads_every_replica_in_one_pass_and_decides_as_before():
    """Router decisions over a shared map equal those over separate ones."""
    keys = list(range(1000, 1040))
    shared, separate = [ExactIndex() for _ in range(3)], [ExactIndex() for _ in range(3)]
    fleet = share_fleet(shared)
    assert all(index.fleet is fleet for index in shared)
    assert not any(isinstance(index.fleet, FleetIndex) for index in separate)  # alone, they mirror nothing
    assert share_fleet(separate[:1]) is None
    for indexes in (shared, separate):
        indexes[0].apply("stored", keys[:10], "device")
        indexes[1].apply("stored", keys[:25], "host")
        indexes[2].apply("stored", keys[:25] + keys[26:], "device")  # a gap: its run ends at 25
    assert match_each(keys, shared, [0, 1, 2]) == match_each(keys, separate, [0, 1, 2]) == [10, 25, 25]
    for indexes in (shared, separate):
        r = Router(RouterConfig(), ["a", "b", "c"], 16)
        decision = r.choose(keys, indexes, [True] * 3)
        assert decision.replica in (1, 2) and decision.matched_blocks == 25 and decision.reason == "prefix"


def test_share_fleet_carries_what_each_index_already_holds():
    a, b, approx = ExactIndex(), ExactIndex(), router.ApproxIndex(60.0, 100)
    a.reset({"device": [1, 2, 3], "host": [3, 4]})
    b.apply("stored", [9], "host")
    fleet = share_fleet([a, approx, b])
    assert a.fleet is b.fleet is fleet and a.slot != b.slot
    assert a.tiers == {1: 1, 2: 1, 3: 3, 4: 2} and b.tiers == {9: 2} and (len(a), len(b)) == (4, 1)
    # A mixed fleet (an external server's approximate index) is matched one index at a time.
    approx.record([1, 2])
    assert match_each([1, 2, 3], [a, approx, b], [0, 1, 2]) == [3, 2, 0]


async def test_slots_given_up_are_swept_in_slices_and_reused():
    """Re-indexing from snapshots many times does not grow the map or the slots:
    the old slot is swept out with other tasks running between slices, then reused."""
    fleet = FleetIndex()
    a, b = ExactIndex(fleet), ExactIndex(fleet)
    b.reset({"device": [5, 6]})
    many = list(range(100, 100 + 3 * router._REBUILD_SLICE))
    turns = 0
    stop = asyncio.Event()

    async def other_task():
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_task())
    for round_ in range(6):
        await a.rebuild({"device": many if round_ % 2 == 0 else many[:10], "host": [7]})
    a.apply("cleared", [], "device")
    await _swept(fleet)
    stop.set()
    await ticker
    assert turns > 6 * 3  # the fills and the sweeps yielded
    assert len(a) == 0 and a.match([100]) == 0 and b.tiers == {5: 1, 6: 1}
    assert fleet.held == {5: 1 << b.slot, 6: 1 << b.slot}  # nothing of a's old slots
    # Seven re-indexings without reuse would have taken slots 2 to 8; at most a's,
    # b's, one being filled and two being swept are ever taken at once.
    assert fleet._next_slot <= 5 and not fleet._pending


async def test_a_rebuild_cancelled_halfway_leaves_the_index_as_it_was():
    fleet = FleetIndex()
    index = ExactIndex(fleet)
    index.reset({"device": [1, 2]})
    task = asyncio.create_task(index.rebuild({"device": list(range(10, 10 + 5 * router._REBUILD_SLICE))}))
    for _ in range(2):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await _swept(fleet)
    assert index.tiers == {1: 1, 2: 1} and len(index) == 2
    assert fleet.held == {1: 1 << index.slot, 2: 1 << index.slot}  # the half-built slot's keys are gone


def test_a_gateways_engine_replicas_share_one_map(tiny_model_dir):
    """`kvgate serve --replica ...`: the `kvgate engine` replicas' indexes are one
    fleet map; an external server keeps its approximate index."""
    specs = [ReplicaConfig(kind="engine", url=f"http://127.0.0.1:{port}") for port in (1, 2)]
    specs.append(ReplicaConfig(kind="openai", url="http://127.0.0.1:3"))
    app = create_app(tiny_config(tiny_model_dir, specs))
    replicas = app[GATEWAY].replicas
    assert replicas[0].index.fleet is replicas[1].index.fleet
    assert replicas[0].index.slot != replicas[1].index.slot
    assert isinstance(replicas[2].index, router.ApproxIndex)


async def test_an_index_shared_while_it_rebuilds_lands_whole_in_the_shared_map():
    """share_fleet after a replica started re-indexing (a replica list handed to a
    second app, say): the new map lands in a slot of the shared fleet, and no
    replica is reported holding another's blocks."""
    a, b = ExactIndex(), ExactIndex()
    b.reset({"device": [-9]})
    task = asyncio.create_task(a.rebuild({"device": list(range(1, 3 * router._REBUILD_SLICE))}))
    await asyncio.sleep(0)
    fleet = share_fleet([a, b])
    await task
    await _swept(fleet)
    assert a.fleet is b.fleet is fleet and a.slot != b.slot
    assert match_each([1, 2, 3], [a, b], [0, 1]) == [a.match([1, 2, 3]), b.match([1, 2, 3])] == [3, 0]
    assert match_each([-9], [a, b], [0, 1]) == [0, 1]
    assert sum(1 for bits in fleet.held.values() if bits & (1 << b.slot)) == 1


async def test_a_sweep_cut_short_is_finished_by_the_next_and_empty_slots_come_back_at_once():
    fleet = FleetIndex()
    a, b = ExactIndex(fleet), ExactIndex(fleet)
    a.reset({"device": list(range(5 * router._REBUILD_SLICE))})
    a.apply("cleared", [], "device")  # its old slot is being swept
    for _ in range(2):
        await asyncio.sleep(0)
    fleet._sweeper.cancel()
    await asyncio.gather(fleet._sweeper, return_exceptions=True)
    assert fleet._pending  # the cut sweep left the rest listed
    taken = fleet._next_slot
    for _ in range(5):
        b.apply("cleared", [], "device")  # an empty slot is free again at once
    assert fleet._next_slot <= taken + 1  # (a new slot is taken before the old one is given up)
    b.reset({"device": [1]})  # gives up b's empty slot; a new sweeper finishes the cut one
    a.reset({"device": [2]})
    await _swept(fleet)
    assert not fleet._pending and fleet.held == {1: 1 << b.slot, 2: 1 << a.slot}


def test_a_sweeper_left_on_a_closed_loop_does_not_stop_later_sweeps():
    fleet = FleetIndex()
    a = ExactIndex(fleet)
    ExactIndex(fleet)  # another replica's, empty

    async def resync(keys, settle=True):
        await a.rebuild({"device": keys})
        if settle:
            await _swept(fleet)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(resync(list(range(3 * router._REBUILD_SLICE))))
    loop.run_until_complete(resync([5], settle=False))  # the big slot's sweep is still under way...
    loop.close()  # ...when its loop closes without running it out
    asyncio.run(resync([6]))
    asyncio.run(resync([7]))
    assert a.tiers == {7: 1} and fleet.held == {7: 1 << a.slot}
    assert not fleet._pending and fleet._next_slot <= 4
