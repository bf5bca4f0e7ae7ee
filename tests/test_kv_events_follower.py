"""How a gateway follows a `kvgate engine`'s /kv_events when the stream is not tidy.

Scripted engines (aiohttp apps on loopback answering /kvgate/info, /health and
/kv_events as `kvgate engine` does) drive a real ``RemoteReplica``: a snapshot
far larger than aiohttp's line limit, a stream that goes silent without closing
(a rebooted host or a proxy that dropped it leaves no FIN or RST), and an engine
that restarts behind the breaker.  The real engine's side (heartbeats on an idle
stream) is checked against its own app.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from unittest import mock

import aiohttp
import pytest
from aiohttp import web

import gateway.engine_endpoints as engine_endpoints
import gateway.kv_wire as kv_wire
import gateway.replicas as replicas
import gateway.router as router
import gateway.upstream as upstream
from gateway.app import GATEWAY, create_app
from gateway.config import LimitsConfig, ReplicaConfig, RouterConfig
from gateway.replicas import RemoteReplica, ReplicaInfo
from gateway.router import ExactIndex
from gateway.server import start_server
from tests.engine_procs import MODEL, tiny_config, wait_for

INFO = {"model": MODEL, "block_size": 16, "hash_salt": MODEL, "max_model_len": 1024}


class ScriptedEngine:
    """/kvgate/info, /health and /kv_events: a snapshot of ``keys``, then silence
    (the connection stays open and nothing more is sent, heartbeats included)."""

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.up = True
        self.hung = False  # its streams send nothing at all, not even the snapshot
        self.opened = 0
        self.server = None
        self.instance = "first"  # /kvgate/info's name for the engine process
        self.draining = False  # what its snapshots say
        self.streams: set = set()  # the transports of its open /kv_events
        self.responses: list = []  # its open /kv_events streams, to write to

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/kvgate/info", self._info)
        app.router.add_get("/health", self._health)
        app.router.add_get("/kv_events", self._kv_events)
        self.server = await start_server(app, port=port)
        return self.server.url

    async def _info(self, request):
        if self.instance is None:  # an engine before 0.2
            return web.json_response(INFO)
        return web.json_response({**INFO, "instance": self.instance})

    async def _health(self, request):
        if not self.up:
            return web.json_response({"error": {"message": "down"}}, status=503)
        return web.json_response({"status": "ok", "requests": 0, "kv_usage": 0.0})

    async def crash(self) -> None:
        """Gone as a killed process goes: its connections break, nothing listens."""
        for transport in self.streams:
            transport.close()
        await self.server.stop()
        self.server = None

    async def _kv_events(self, request):
        self.opened += 1
        self.streams.add(request.transport)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if not self.hung:
            snapshot = {"seq": 0, "model": MODEL, "keys": {"device": list(self.keys)}, "draining": self.draining}
            await resp.write(b"event: snapshot\ndata: " + json.dumps(snapshot).encode() + b"\n\n")
        self.responses.append(resp)
        await asyncio.sleep(3600)
        return resp

    async def say_draining(self) -> None:
        """The draining event on its open streams, which it keeps open (a real
        engine ends them next: a moment in which its probes still answer)."""
        for resp in self.responses:
            await resp.write(b"event: draining\ndata: {}\n\n")


@pytest.fixture
async def scripted():
    engine = ScriptedEngine()
    url = await engine.start()
    followers = []

    async def follow(**router) -> RemoteReplica:
        replica = RemoteReplica(ReplicaConfig(kind="engine", url=url, connect_timeout_s=2),
                                RouterConfig(**router), ReplicaInfo(MODEL, 16, MODEL, 1024))
        followers.append(replica)
        await replica.start()
        return replica

    yield engine, follow
    for replica in followers:
        await replica.close()
    if engine.server is not None:
        await engine.server.stop()


async def test_a_snapshot_far_past_aiohttps_line_limit_is_followed(scripted):
    """100,000 held blocks make a 2 MB snapshot line; aiohttp's readline stops at 512 KiB."""
    engine, follow = scripted
    engine.keys = [random.getrandbits(63) for _ in range(100_000)]
    replica = await follow(health_interval_s=0.2)
    await wait_for(lambda: replica.healthy, what="in routing")
    assert len(replica.index) == 100_000 and engine.opened == 1


async def test_after_the_breaker_an_engine_rejoins_on_a_fresh_snapshot(scripted):
    """The old stream never ends (no FIN reached the gateway); the engine that answers
    the probes again is a restarted one with other blocks.  It must rejoin with
    those, never with the dead stream's view."""
    engine, follow = scripted
    engine.keys = [111, 222, 333]
    replica = await follow(health_interval_s=0.1, breaker_failures=2, breaker_reset_s=0.5)
    await wait_for(lambda: replica.healthy, what="in routing")
    assert sorted(replica.index.tiers) == [111, 222, 333]
    engine.up = False
    await wait_for(lambda: not replica.healthy, what="breaker open")
    engine.keys, engine.up = [777, 888], True
    await wait_for(lambda: replica.healthy, what="back in routing")
    assert sorted(replica.index.tiers) == [777, 888] and engine.opened == 2


@pytest.mark.parametrize("before, after", [("first", "second"), (None, "second"), ("first", "first")])
async def test_a_restarted_engine_rejoins_without_waiting_out_its_predecessors_breaker(scripted, before, after, caplog):
    """Probes fail while an engine restarts (a rolling upgrade), which opens its
    breaker.  The process that comes back, another instance by /kvgate/info (or
    the first to name one: an engine upgraded from 0.1), rejoins on its first
    snapshot; the same process (one that flaps) still sits out breaker_reset_s."""
    engine, follow = scripted
    engine.keys, engine.instance = [111], before
    replica = await follow(health_interval_s=0.1, breaker_failures=2, breaker_reset_s=60)
    await wait_for(lambda: replica.healthy, what="in routing")
    engine.up = False
    await wait_for(lambda: not replica.healthy, what="breaker open")
    assert replica.breaker_open
    engine.keys, engine.up, engine.instance = [222], True, after
    if before != after:
        await wait_for(lambda: replica.healthy, what="back in routing")
        assert sorted(replica.index.tiers) == [222] and not replica.breaker_open
    else:
        caplog.set_level(logging.INFO, logger="gateway.replicas")
        await wait_for(lambda: engine.opened == 2 and replica._following, what="resynced")
        await asyncio.sleep(0.5)  # several good probes
        assert not replica.healthy and replica.breaker_open
        # Said once, so that an operator does not take it for forgotten.
        said = [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
        assert len(said) == 1 and "back in routing in 6" in said[0] and "(router.breaker_reset_s)" in said[0]


async def test_an_engine_first_seen_after_its_breaker_opened_rejoins_on_its_first_snapshot(unused_tcp_port_factory):
    """The gateway started first: probes of an engine not up yet opened its breaker.
    That is no failure of the process that then answers, which joins at once
    rather than after breaker_reset_s (503s meanwhile, with the engine ready)."""
    port = unused_tcp_port_factory()
    replica = RemoteReplica(ReplicaConfig(kind="engine", url=f"http://127.0.0.1:{port}", connect_timeout_s=0.2),
                            RouterConfig(health_interval_s=0.05, breaker_failures=2, breaker_reset_s=60),
                            ReplicaInfo(MODEL, 16, MODEL, 1024))
    engine = ScriptedEngine()
    try:
        await replica.start()
        await wait_for(lambda: replica.breaker_open, what="breaker open while nothing answers")
        engine.keys = [111]
        await engine.start(port)
        await wait_for(lambda: replica.healthy, 5, what="in routing")
        assert sorted(replica.index.tiers) == [111]
    finally:
        await replica.close()
        if engine.server is not None:
            await engine.server.stop()


async def test_an_engine_that_says_it_stops_stays_out_though_its_probes_answer(scripted):
    """Between an engine's draining event and the end of its stream, a probe it
    answers (its /health is fine while it drains) must not put it back in routing."""
    engine, follow = scripted
    replica = await follow(health_interval_s=0.02)
    await wait_for(lambda: replica.healthy, what="in routing")
    await engine.say_draining()
    await wait_for(lambda: replica.draining, what="draining")
    seen_healthy = False
    for _ in range(25):  # 0.5 s: many probes
        await asyncio.sleep(0.02)
        seen_healthy |= replica.healthy
    assert not seen_healthy and replica.draining


async def test_an_engine_gone_says_so_without_its_address_and_a_drained_one_is_down(scripted, caplog):
    """An engine that disappears leaves routing for a reason clients may read (the
    streams it cuts carry it): no address in it.  One that drained and exited is
    down, not draining for ever, and the log says it stopped."""
    engine, follow = scripted
    replica = await follow(health_interval_s=30)
    await wait_for(lambda: replica.healthy, what="in routing")
    port = int(engine.server.url.rsplit(":", 1)[1])
    await engine.crash()
    await wait_for(lambda: not replica.healthy, what="left routing")
    assert replica._trip_reason == "cannot connect (Connection refused)"

    engine.draining = True  # back, and stopping
    await engine.start(port)
    await wait_for(lambda: replica.draining, what="draining")
    caplog.set_level(logging.INFO, logger="gateway.replicas")
    await engine.crash()
    await wait_for(lambda: not replica.draining, what="down")
    assert not replica.healthy
    assert f"replica {replica.name} has stopped (cannot connect (Connection refused))" in caplog.messages


async def test_a_breaker_that_opens_while_a_restarted_engine_resyncs_stands(scripted, monkeypatch):
    """The breaker opens on the new process itself while its snapshot is being
    indexed: that stream is closed, and the replica stays out (it was let back
    in on a closed stream, its breaker cleared)."""
    engine, follow = scripted
    engine.keys = [111]
    replica = await follow(health_interval_s=30, breaker_failures=2, breaker_reset_s=60)
    await wait_for(lambda: replica.healthy, what="in routing")
    rebuild = ExactIndex.rebuild
    tripping = {"armed": True}

    async def rebuild_while_tripped(index, held):
        if tripping["armed"]:
            tripping["armed"] = False
            asyncio.get_running_loop().call_soon(replica._trip, "2 probes failed in a row")
        await rebuild(index, held)

    monkeypatch.setattr(ExactIndex, "rebuild", rebuild_while_tripped)
    engine.instance, engine.keys = "second", list(range(100, 100_100))
    replica._events_resp.close()  # the old process's stream ends
    await wait_for(lambda: engine.opened >= 3, what="resynced after the trip")
    await asyncio.sleep(0.3)
    assert replica.trips == 1 and not replica.healthy and replica.breaker_open


async def test_a_silent_stream_is_given_up_and_resynced(scripted, monkeypatch):
    """Probes pass, but the stream carries nothing, not even a heartbeat: after
    _KV_EVENTS_SILENT_S the follower reopens it and takes the engine's state anew."""
    monkeypatch.setattr(replicas, "_KV_EVENTS_SILENT_S", 0.5)
    engine, follow = scripted
    engine.keys = [1, 2]
    replica = await follow(health_interval_s=0.1)
    await wait_for(lambda: replica.healthy, what="in routing")
    engine.keys = [3]
    await wait_for(lambda: engine.opened >= 2 and sorted(replica.index.tiers) == [3], timeout=5, what="resynced")


async def test_an_idle_engine_keeps_its_followers(tiny_model_dir, monkeypatch, caplog):
    """A `kvgate engine` with nothing to report sends heartbeats, so a follower with a
    read deadline of a few heartbeats stays on one stream, in routing."""
    monkeypatch.setattr(engine_endpoints, "KV_EVENTS_HEARTBEAT_S", 0.1)
    monkeypatch.setattr(replicas, "_KV_EVENTS_SILENT_S", 0.5)
    async with _gateway_over_an_engine(tiny_model_dir, RouterConfig(health_interval_s=0.1)) as (
            _, engine_server, app, gw):
        replica = app[GATEWAY].replicas[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(engine_server.url + "/kv_events") as resp:
                assert (await resp.content.readline()).startswith(b"event: snapshot")
                await resp.content.readline()  # the snapshot's data line
                await resp.content.readline()
                assert await asyncio.wait_for(resp.content.readline(), 2) == b": idle\n"
        caplog.set_level(logging.INFO, logger="gateway.replicas")
        caplog.clear()
        await asyncio.sleep(1.5)  # three read deadlines
        assert replica.healthy and replica._following and replica.trips == 0
        assert not [r for r in caplog.records if "kv event stream lost" in r.getMessage()]
        out = await _chat(gw.url)
        assert out["usage"]["completion_tokens"] == 1


async def test_kv_event_followers_past_the_limit_are_told_to_retry(tiny_model_dir, monkeypatch):
    """Each /kv_events stream holds a snapshot of the engine's cache while it is
    read (100 readers that never read held 50-130 MB): past
    limits.max_kv_event_followers a follower gets a 503 with Retry-After, and a
    place freed is taken again; the gateway already following stays in routing."""
    monkeypatch.setattr(engine_endpoints, "KV_EVENTS_HEARTBEAT_S", 0.1)  # a closed stream is seen at a heartbeat
    limits = LimitsConfig(max_kv_event_followers=2)
    async with _gateway_over_an_engine(tiny_model_dir, RouterConfig(health_interval_s=0.1), limits=limits) as (
            _, engine_server, app, gw):
        async with aiohttp.ClientSession() as session:
            second = await session.get(engine_server.url + "/kv_events")  # the gateway's is the first
            assert second.status == 200
            async with session.get(engine_server.url + "/kv_events") as third:
                assert third.status == 503 and third.headers["Retry-After"] == "1"
                assert (await third.json())["error"]["code"] == "too_many_followers"
            second.close()  # its place frees once the engine sees the connection gone
            for _ in range(100):
                async with session.get(engine_server.url + "/kv_events") as again:
                    if again.status == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the freed place was never taken")
        assert app[GATEWAY].replicas[0].healthy and app[GATEWAY].replicas[0]._following
        assert (await _chat(gw.url))["usage"]["completion_tokens"] == 1


async def test_a_gateway_refused_for_the_follower_limit_says_so_once_and_joins_when_a_place_frees(tiny_model_dir,
                                                                                                      caplog):
    """A gateway whose engine's limits.max_kv_event_followers were all taken stayed
    out of routing with one INFO line, "kv event stream lost (/kv_events answered
    503); resyncing", of a stream it never had, and nothing after: the operator was
    not told of the limit.  It is a warning now, once, and the follower retries no
    sooner than the engine's Retry-After."""
    caplog.set_level(logging.DEBUG, logger="gateway.replicas")
    engine_app = create_app(tiny_config(tiny_model_dir, limits=LimitsConfig(max_kv_event_followers=1)), engine_mode=True)
    engine_server = await start_server(engine_app)
    session = aiohttp.ClientSession()
    try:
        other = await session.get(engine_server.url + "/kv_events")  # another gateway's: the one place
        assert other.status == 200
        asked = []
        real_get = aiohttp.ClientSession.get

        def counted_get(self, url, *args, **kwargs):
            if str(url).endswith("/kv_events"):
                asked.append(asyncio.get_running_loop().time())
            return real_get(self, url, *args, **kwargs)

        with mock.patch.object(aiohttp.ClientSession, "get", counted_get):
            app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=engine_server.url)],
                                         router=RouterConfig(health_interval_s=0.1)))
            gw = await start_server(app)
            try:
                replica = app[GATEWAY].replicas[0]
                await asyncio.sleep(3.5)
                assert not replica.healthy
                said = [r for r in caplog.records if "max_kv_event_followers" in r.getMessage()]
                assert [r.levelno for r in said] == [logging.WARNING], [r.getMessage() for r in caplog.records]
                assert not any("stream lost" in r.getMessage() for r in caplog.records), caplog.text
                # Retry-After: 1 (then the follower's 2 s): 0.2, 0.4, 0.8 s apart no more.
                gaps = [b - a for a, b in zip(asked, asked[1:])]
                assert gaps and min(gaps) >= 0.9, gaps
                other.close()  # a place frees
                await wait_for(lambda: replica.healthy, what="in routing")
                assert (await _chat(gw.url))["usage"]["completion_tokens"] == 1
            finally:
                await gw.stop()
    finally:
        await session.close()
        await engine_server.stop()


async def test_an_answer_leaves_once_the_index_holds_its_prompt(tiny_model_dir, monkeypatch):
    """The KV events of the step that ends a request travel on their own stream:
    a busy gateway answered first, and the client's next request with the same
    prompt, sent at once, was routed on an index without its blocks (a review saw
    19 to 57 of 60 such repeats sent to the other engine).  The engine says its
    last event with the usage; the gateway waits (briefly) until it applied it.
    Here the follower takes 10 ms an event, as a gateway busy with other streams."""
    real_events = replicas.sse_events

    async def lagging(stream):
        async for event, data in real_events(stream):
            if event != "snapshot":
                await asyncio.sleep(0.01)
            yield event, data

    monkeypatch.setattr(replicas, "sse_events", lagging)  # the follower's; answers are read apart
    async with _gateway_over_an_engine(tiny_model_dir, RouterConfig(health_interval_s=60)) as (
            engine_app, _, app, gw):
        replica = app[GATEWAY].replicas[0]
        engine = engine_app[GATEWAY].replicas[0]
        for turn in range(3):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"turn {turn} " + "hi " * 60}],
                    "max_tokens": 1}
            async with aiohttp.ClientSession() as session:
                async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            held = {key for keys in engine.held_keys().values() for key in keys}
            assert len(held) >= 4 * (turn + 1) and set(replica.index.tiers) == held, turn


@contextlib.asynccontextmanager
async def _gateway_over_an_engine(model_dir: str, router: RouterConfig, **engine_server):
    """A `kvgate engine` (``engine_server``: its server settings) and a gateway
    following it, on loopback, once the engine is in routing: (engine app, engine
    server, gateway app, gateway server)."""
    engine_app = create_app(tiny_config(model_dir, **engine_server), engine_mode=True)
    engine_server = await start_server(engine_app)
    app = create_app(tiny_config(model_dir, [ReplicaConfig(kind="engine", url=engine_server.url)], router=router))
    gw = await start_server(app)
    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="in routing")
        yield engine_app, engine_server, app, gw
    finally:
        await gw.stop()
        await engine_server.stop()


async def _chat(url: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            return await resp.json()


async def test_sse_lines_of_any_length_and_split_anywhere():
    """The SSE reader takes lines split across reads and longer than aiohttp's
    readline allows, and refuses one past SSE_MAX_LINE_BYTES (a broken frame)."""
    async def lines(chunks: list[bytes]) -> list[bytes]:
        return [bytes(line) async for line in upstream.sse_lines(_fed(chunks))]

    big = b"x" * 3_000_000
    assert await lines([b"da", b"ta: 1\r\n\r", b"\n", big[:10], big[10:] + b"\nlast"]) == \
        [b"data: 1\r", b"\r", big, b"last"]
    events = [e async for e in upstream.sse_events(_fed([b'event: a\ndata: {"k":\ndata: 1}\n\ndata: [DONE]\n\n']))]
    assert events == [("a", {"k": 1}), ("message", upstream.DONE_EVENT)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(upstream, "SSE_MAX_LINE_BYTES", 1000)
        with pytest.raises(ValueError, match="longer than 1000 bytes"):
            await lines([b"a" * 600, b"b" * 600])
        with pytest.raises(ValueError, match="longer than 1000 bytes"):
            await lines([b"ok\n" + b"a" * 1001])


def _fed(chunks: list[bytes]) -> aiohttp.StreamReader:
    """A response body as aiohttp's client hands it over, these chunks then EOF
    (the protocol, which only sees flow control, is a mock)."""
    stream = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    for chunk in chunks:
        stream.feed_data(chunk)
    stream.feed_eof()
    return stream


async def test_a_stream_that_keeps_going_silent_is_said_lost_once_an_outage(scripted, monkeypatch, caplog):
    """A hung engine's stream goes silent again and again (a SIGSTOPped process
    keeps its port): "kv event stream lost" was logged at every reopening, every
    20 s for as long as it lasted.  Once at INFO, then at DEBUG until a snapshot
    is followed again, after which a new loss is said again."""
    monkeypatch.setattr(replicas, "_KV_EVENTS_SILENT_S", 0.3)
    monkeypatch.setattr(replicas, "_KV_EVENTS_MAX_BACKOFF_S", 0.1)
    engine, follow = scripted
    caplog.set_level(logging.DEBUG, logger="gateway.replicas")
    replica = await follow(health_interval_s=0.1)
    await wait_for(lambda: replica._following, what="following")
    engine.hung = True
    await wait_for(lambda: engine.opened >= 5, timeout=10, what="four silent reopenings")
    lost = [r.levelname for r in caplog.records if "kv event stream lost" in r.getMessage()]
    assert lost[0] == "INFO" and set(lost[1:]) == {"DEBUG"} and len(lost) >= 3, lost
    engine.hung = False
    await wait_for(lambda: replica._following, timeout=5, what="following again")
    caplog.clear()
    engine.hung = True
    await wait_for(lambda: any("kv event stream lost" in r.getMessage() for r in caplog.records), timeout=5,
                   what="the next loss")
    assert [r.levelname for r in caplog.records if "kv event stream lost" in r.getMessage()][0] == "INFO"


def test_packed_snapshot_keys_read_as_the_arrays_they_replace():
    """A snapshot packed for a gateway that asks, and an older engine's arrays,
    give the same keys; a damaged packing is refused (the follower resyncs)."""
    keys = [0, 1, 2**63, 2**64 - 1] + [random.getrandbits(64) for _ in range(1000)]
    packed = {"seq": 3, "keys": {"device": kv_wire.pack_keys(keys), "host": kv_wire.pack_keys([])},
              "keys_format": kv_wire.PACKED_KEYS}
    held = kv_wire.held_from_snapshot(packed)
    assert list(held["device"]) == keys and list(held["host"]) == []
    arrays = {"seq": 3, "keys": {"device": keys}}
    assert kv_wire.held_from_snapshot(arrays) == {"device": keys}
    for damaged in (kv_wire.pack_keys(keys)[:-4], "not base64!"):
        with pytest.raises(ValueError):
            kv_wire.unpack_keys(damaged)


async def test_a_snapshot_is_indexed_without_holding_the_event_loop():
    """Indexing a snapshot of 300,000 keys lets other tasks run between slices;
    until it is done, routing sees the previous index, then the new one whole,
    a key on both tiers with both bits."""
    index = ExactIndex()
    index.reset({"device": [1, 2, 3]})
    device = list(range(10, 300_010))
    host = [7, 10]  # 10 on both tiers, as between a demotion's two events
    seen_while_building = []
    done = asyncio.Event()

    async def routing():
        while not done.is_set():
            seen_while_building.append(index.match([1, 2, 3]))
            await asyncio.sleep(0)

    ticker = asyncio.create_task(routing())
    await index.rebuild({"device": device, "host": host})
    done.set()
    await ticker
    assert len(seen_while_building) >= len(device) // router._REBUILD_SLICE
    assert set(seen_while_building) == {3}  # the old index whole until the swap
    assert len(index) == len(device) + 1 and index.match([1]) == 0 and index.match(device[:5]) == 5
    assert index.tiers[10] == router.DEVICE_BIT | router.HOST_BIT and index.tiers[7] == router.HOST_BIT
    rebuilt = index.tiers
    index.reset({"device": device, "host": host})
    assert index.tiers == rebuilt  # the same map reset() builds at once


async def test_an_engine_packs_its_snapshot_for_a_gateway_that_asks(tiny_model_dir):
    """The real engine: /kv_events?keys=packed holds the very keys its arrays do."""
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="inprocess")]), engine_mode=True)
    server = await start_server(app)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": list(range(10, 90)), "max_tokens": 1}) as resp:
                assert resp.status == 200
            snapshots = []
            for params in ({}, kv_wire.PACKED_QUERY):
                async with session.get(server.url + "/kv_events", params=params) as resp:
                    assert (await resp.content.readline()) == b"event: snapshot\n"
                    snapshots.append(json.loads((await resp.content.readline())[len(b"data: "):]))
        arrays, packed = snapshots
        assert packed["keys_format"] == kv_wire.PACKED_KEYS and "keys_format" not in arrays
        assert len(arrays["keys"]["device"]) >= 5
        assert {tier: list(keys) for tier, keys in kv_wire.held_from_snapshot(packed).items()} == arrays["keys"]
    finally:
        await server.stop()
