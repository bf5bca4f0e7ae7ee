"""Load suite: 2,000 mixed valid requests at concurrency 64, two real engine replicas, zero errors.

Mix (deterministic): chat and completions, streamed and not, some with n=2;
max_tokens stays small so the run is bounded (about a minute on 2 cores).
Every response is checked for shape, and at the end nothing is left in
flight: router counts and engine blocks are back to zero.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from gateway.app import GATEWAY, create_app
from gateway.config import ReplicaConfig
from gateway.server import start_server
from tests.engine_procs import MODEL, engine_idle, tiny_config, wait_for

REQUESTS = 2000
CONCURRENCY = 64
TIME_LIMIT_S = 600

SYSTEMS = ["You are a helpful assistant. Answer briefly.", "You are a careful translator of short texts."]


def _request(i: int) -> tuple[str, dict]:
    stream = i % 2 == 0
    n = 2 if i % 5 == 0 else 1
    if i % 3 == 0:
        body = {"model": MODEL, "prompt": f"The capital of France is {i}", "max_tokens": 2, "n": n, "stream": stream}
        return "/v1/completions", body
    messages = [{"role": "system", "content": SYSTEMS[i % 2]}, {"role": "user", "content": f"Question {i}?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "n": n, "stream": stream}
    if stream and i % 4 == 0:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions", body


async def _check(resp: aiohttp.ClientResponse, body: dict) -> None:
    assert resp.status == 200, await resp.text()
    n = body.get("n", 1)
    if not body["stream"]:
        data = await resp.json()
        assert len(data["choices"]) == n and data["usage"]["completion_tokens"] <= 2 * n
        return
    finishes = set()
    done = False
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            if choice.get("finish_reason"):
                finishes.add(choice["index"])
    assert done and finishes == set(range(n))


async def test_two_thousand_mixed_requests_at_concurrency_64(tiny_model_dir):
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="inprocess"), ReplicaConfig(kind="inprocess")])
    app = create_app(config)
    server = await start_server(app)
    next_index = iter(range(REQUESTS))
    errors: list[str] = []
    done = 0
    deadline = time.monotonic() + TIME_LIMIT_S

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        for i in next_index:
            if time.monotonic() > deadline:
                return
            path, body = _request(i)
            try:
                async with session.post(server.url + path, json=body) as resp:
                    await _check(resp, body)
                done += 1
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                errors.append(f"{i}: {type(exc).__name__}: {exc}"[:300])

    try:
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
        assert not errors, errors[:5]
        assert done == REQUESTS
        gw = app[GATEWAY]
        await wait_for(lambda: all(engine_idle(r.engine) for r in gw.replicas)
                       and gw.router.inflight_requests == [0, 0], timeout=10, what="all settled")
        assert gw.router.inflight_tokens == [0, 0]
    finally:
        await server.stop()
