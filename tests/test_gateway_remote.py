"""A gateway in front of `kvgate engine`-style servers over loopback (fake engine).

Covers the remote path end to end: the engine server's /kv_events stream keeps
the gateway's index exact, requests travel as token ids with the gateway's
classification, and an external OpenAI-compatible server (the same engine
server, addressed as kind=openai) works with the approximate index.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from gateway.app import GATEWAY, create_app
from gateway.config import KvgateConfig, ReplicaConfig
from gateway.replicas import InProcessReplica
from gateway.server import start_server
from tests.gateway_fake_engine import ByteTokenizer, FakeEngine

MODEL = "fake-model"


async def _engine_server():
    engine = FakeEngine()
    app = create_app(KvgateConfig(), [InProcessReplica("engine", engine=engine)], engine_mode=True)
    return engine, await start_server(app)


async def _wait(cond, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    assert cond()


async def test_gateway_follows_remote_engine_kv_events():
    (e1, s1), (e2, s2) = await _engine_server(), await _engine_server()
    config = KvgateConfig(replicas=[ReplicaConfig(kind="engine", url=s1.url), ReplicaConfig(kind="engine", url=s2.url + "/v1")])
    app = create_app(config, tokenizer=ByteTokenizer())
    gw = await start_server(app)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        replicas = app[GATEWAY].replicas
        await _wait(lambda: all(r.healthy for r in replicas))
        system = "Shared system prompt for everyone. " * 10
        msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
        resp = await client.chat.completions.create(model=MODEL, messages=msgs("first"), max_tokens=2)
        assert resp.choices[0].message.content == "t0 t1 "
        owner = 0 if e1.requests else 1
        engine = (e1, e2)[owner]
        # The stored events reach the gateway's index of that replica.
        await _wait(lambda: len(replicas[owner].index) == len(engine.held))
        ctx = engine.requests[0].context
        assert (ctx.workload, ctx.type, ctx.turn) == ("to-c", "text", 1)
        stream = await client.chat.completions.create(
            model=MODEL, messages=msgs("second"), max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        assert len(engine.requests) == 2
        # Removal events too.
        engine.evict_all()
        await _wait(lambda: len(replicas[owner].index) == 0)
        comp = await client.completions.create(model=MODEL, prompt="abc", max_tokens=1)
        assert comp.choices[0].text == "t0 "
    finally:
        await client.close()
        await gw.stop()
        await s1.stop()
        await s2.stop()


async def test_external_openai_replica_with_approximate_index():
    engine, server = await _engine_server()
    config = KvgateConfig(replicas=[ReplicaConfig(kind="openai", url=server.url + "/v1", name="ext")])
    app = create_app(config, tokenizer=ByteTokenizer())
    gw = await start_server(app)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        await _wait(lambda: app[GATEWAY].replicas[0].healthy)
        resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=2)
        assert resp.choices[0].message.content == "t0 t1 "
        assert len(app[GATEWAY].replicas[0].index) > 0
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=9)
        stream = await client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, stream=True)
        texts = {}
        async for c in stream:
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert texts == {0: "t0 t1 ", 1: "t0 t1 "}
    finally:
        await client.close()
        await gw.stop()
        await server.stop()


async def test_remote_disconnect_aborts_upstream():
    engine, server = await _engine_server()
    engine.token_delay_s = 0.02
    config = KvgateConfig(replicas=[ReplicaConfig(kind="engine", url=server.url)])
    app = create_app(config, tokenizer=ByteTokenizer())
    gw = await start_server(app)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        await _wait(lambda: app[GATEWAY].replicas[0].healthy)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=400, stream=True
        )
        async for _ in stream:
            break
        await stream.close()
        await _wait(lambda: not engine.active and app[GATEWAY].router.inflight_requests == [0])
        assert engine.aborted
    finally:
        await client.close()
        await gw.stop()
        await server.stop()


async def test_dead_replica_is_retried_before_first_byte_and_leaves_routing():
    (e1, s1), (e2, s2) = await _engine_server(), await _engine_server()
    config = KvgateConfig(replicas=[ReplicaConfig(kind="engine", url=s1.url), ReplicaConfig(kind="engine", url=s2.url)])
    config.router.health_interval_s = 0.1
    config.router.breaker_failures = 1
    app = create_app(config, tokenizer=ByteTokenizer())
    gw = await start_server(app)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        replicas = app[GATEWAY].replicas
        await _wait(lambda: all(r.healthy for r in replicas))
        await s2.stop()
        for i in range(6):
            resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=1)
            assert resp.choices[0].message.content == "t0 "
        await _wait(lambda: not replicas[1].healthy)
        assert len(e1.requests) == 6
        assert app[GATEWAY].router.inflight_requests == [0, 0]
    finally:
        await client.close()
        await gw.stop()
        await s1.stop()
