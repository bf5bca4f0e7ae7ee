"""A real gateway on loopback with the official SDK as its client, for tests."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Iterator

import aiohttp
import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.server import start_server


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[tuple[web.Application, object, openai.AsyncOpenAI]]:
    """Start ``app`` on a free loopback port; yield (app, server, AsyncOpenAI client); stop both."""
    server = await start_server(app)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield app, server, client
    finally:
        await client.close()
        await server.stop()


async def sse_events(resp: aiohttp.ClientResponse) -> list:
    """Every ``data:`` event of a raw SSE response, parsed; ``"[DONE]"`` as is.
    (For what the SDK hides: error events after the first byte, [DONE].)"""
    out = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def metric_by_replica(url: str, name: str) -> dict[str, float]:
    """The server's /metrics samples of series ``name``, summed by replica label."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["replica"]] = out.get(sample.labels["replica"], 0.0) + sample.value
    return out


@contextmanager
def hung_model_steps(engine) -> Iterator[threading.Event]:
    """``engine``'s model steps wait, as behind a stuck kernel, until the yielded
    event is set (at most 30 s, and always on leaving)."""
    release = threading.Event()
    step = engine._step

    def hung_step():
        release.wait(30)
        return step()

    engine._step = hung_step
    try:
        yield release
    finally:
        release.set()
        engine._step = step


@asynccontextmanager
async def a_request_in_a_hung_step(engine, session: aiohttp.ClientSession, url: str, model: str):
    """hung_model_steps(engine): yields (its event, a completions request posted
    to ``url`` once its step has run over 0.5 s)."""
    from tests.engine_procs import wait_for

    with hung_model_steps(engine) as release:
        post = asyncio.ensure_future(session.post(url + "/v1/completions", json={
            "model": model, "prompt": "hello", "max_tokens": 2}))
        await wait_for(lambda: engine.step_running_s() > 0.5, what="a step past its limit")
        yield release, post
