"""Fault suite: clients that vanish mid-stream, a replica process killed mid-run and restarted.

Bounded: 40 streams for the disconnect case; one `kvgate engine` process
killed (SIGKILL) and restarted on the same port; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp

from gateway.app import GATEWAY, create_app
from gateway.config import ReplicaConfig, RouterConfig
from gateway.server import start_server
from tests.engine_procs import MODEL, EngineProcess, engine_idle, tiny_config, wait_for


async def _sse(resp) -> list:
    """Decoded data of each SSE event, [DONE] as the string."""
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


async def test_clients_disconnecting_mid_stream_leak_nothing(tiny_model_dir):
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="inprocess"), ReplicaConfig(kind="inprocess")]))
    server = await start_server(app)
    rng = random.Random(7)
    leavers = set(rng.sample(range(40), 4))  # 10% of the clients go away mid-stream
    sem = asyncio.Semaphore(16)

    async def one(session, i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Question number {i}: tell me more."}],
                "max_tokens": 40 if i in leavers else 4, "ignore_eos": i in leavers, "stream": True}
        async with sem:
            resp = await session.post(server.url + "/v1/chat/completions", json=body)
            try:
                assert resp.status == 200
                if i in leavers:
                    await resp.content.readline()
                    resp.close()  # gone mid-stream
                    return None
                return await _sse(resp)
            finally:
                resp.release()

    try:
        async with aiohttp.ClientSession() as session:
            results = await asyncio.wait_for(asyncio.gather(*(one(session, i) for i in range(40))), 120)
        for i, events in enumerate(results):
            if i not in leavers:
                assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
        gw = app[GATEWAY]
        await wait_for(lambda: all(engine_idle(r.engine) for r in gw.replicas)
                       and gw.router.inflight_requests == [0, 0], timeout=10, what="nothing in flight")
        assert gw.router.inflight_tokens == [0, 0]
        for r in gw.replicas:
            blocks = r.engine.stats()["blocks"]["device"]
            assert blocks["in_use"] == 0 and blocks["free"] + blocks["cached"] == blocks["total"]
    finally:
        await server.stop()


async def test_replica_killed_mid_run_then_restarted_rejoins(tiny_model_dir, tmp_path):
    base = tiny_config(tiny_model_dir)
    # The survivor: a `kvgate engine` app in this process; the victim: a real process.
    survivor = await start_server(create_app(base, engine_mode=True))
    victim = EngineProcess(base, str(tmp_path))
    victim.start()
    gateway = None
    try:
        await victim.wait_ready()
        config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=survivor.url, name="survivor"),
                                              ReplicaConfig(kind="engine", url=victim.url, name="victim")],
                             router=RouterConfig(health_interval_s=0.2, breaker_failures=2, breaker_reset_s=1.0))
        app = create_app(config)
        gateway = await start_server(app)
        gw = app[GATEWAY]
        survivor_r, victim_r = gw.replicas
        await wait_for(lambda: survivor_r.healthy and victim_r.healthy, timeout=20, what="both healthy")
        picks = [0, 0]
        real_acquire = gw.router.acquire

        def acquire(replica, *a, **kw):
            picks[replica] += 1
            return real_acquire(replica, *a, **kw)

        gw.router.acquire = acquire
        # Which requests the victim has produced output for (before that, a
        # failure is retried elsewhere, invisibly: not what this test is about).
        started: set[str] = set()
        real_generate = victim_r.generate

        async def generate(job):
            async for out in real_generate(job):
                started.add(job.request.request_id)
                yield out

        victim_r.generate = generate

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            # Pin two long requests onto the victim: hold the survivor out of routing a moment.
            survivor_r.healthy = False
            long = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
                    "max_tokens": 600, "ignore_eos": True}
            stream = await session.post(gateway.url + "/v1/chat/completions", json={**long, "stream": True})
            assert stream.status == 200
            await stream.content.readline()
            plain = asyncio.create_task(session.post(gateway.url + "/v1/chat/completions", json=long))
            await wait_for(lambda: len(started) == 2, what="both producing on the victim")
            survivor_r.healthy = True
            assert picks == [0, 2]

            victim.kill()
            # The stream ends with an OpenAI error event and [DONE], promptly; no hang.
            events = await asyncio.wait_for(_sse(stream), 10)
            assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
            assert set(events[-2]["error"]) == {"message", "type", "param", "code"}
            # Nothing of the non-streaming one had reached its client: it starts over
            # on the survivor and gets a whole answer.
            resp = await asyncio.wait_for(plain, 60)
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["finish_reason"] in ("length", "stop")
            assert not victim_r.healthy, "a replica that died mid-stream leaves routing"

            # Every later request succeeds, on the survivor.
            before = list(picks)
            for i in range(12):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"after the crash {i}"}],
                        "max_tokens": 2, "stream": i % 2 == 0}
                async with session.post(gateway.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    if body["stream"]:
                        got = await _sse(r)
                        assert got[-1] == "[DONE]" and not any("error" in e for e in got[:-1])
                    else:
                        assert (await r.json())["choices"]
            assert picks[0] - before[0] >= 12

            # Restarted on the same port, it rejoins routing.
            victim.start()
            await victim.wait_ready()
            await wait_for(lambda: victim_r.healthy, timeout=20, what="victim rejoined")
            before = list(picks)
            bodies = [{"model": MODEL, "messages": [{"role": "user", "content": f"rejoin {i} " * 20}], "max_tokens": 8,
                       "ignore_eos": True} for i in range(8)]
            replies = await asyncio.gather(*(session.post(gateway.url + "/v1/chat/completions", json=b) for b in bodies))
            for r in replies:
                assert r.status == 200
                r.release()
            assert picks[1] > before[1], "the restarted replica takes requests again"
        await wait_for(lambda: gw.router.inflight_requests == [0, 0], what="no in-flight leak")
    finally:
        if gateway is not None:
            await gateway.stop()
        victim.stop()
        await survivor.stop()
