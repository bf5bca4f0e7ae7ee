"""A completions request without max_tokens in front of external servers: the
gateway's count of a text prompt may be an estimate (a file-less gateway counts
with SmolLM2's tokenizer, deploy/vllm.md), so a default past the room it counts is
sent without max_tokens, for the server's own default and exact count to judge,
rather than refused by the estimate."""
from __future__ import annotations

import json

from aiohttp import web

from gateway.app import GATEWAY, create_app
from gateway.config import ReplicaConfig, RouterConfig
from gateway.server import start_server
from tests.engine_procs import MODEL, tiny_config, wait_for
from tests.gateway_helpers import serving


async def test_a_default_past_the_estimated_room_is_the_external_servers_to_judge(tiny_model_dir):
    received = []

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 64}]})

    async def completions(request):
        received.append(await request.json())
        chunk = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
        return web.Response(body=b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n",
                            content_type="text/event-stream")

    stub = web.Application()
    stub.router.add_get("/v1/models", models)
    stub.router.add_post("/v1/completions", completions)
    upstream = await start_server(stub)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                                 router=RouterConfig(health_interval_s=0.1)))
    try:
        async with serving(app) as (app, _, client):
            gateway = app[GATEWAY]
            await wait_for(lambda: gateway.replicas[0].healthy and gateway.max_model_len == 64, what="healthy")
            prompt = "word " * 10
            while len(gateway.hasher.text(prompt).token_ids) < 56:
                prompt += "word "
            counted = len(gateway.hasher.text(prompt).token_ids)
            assert 48 < counted < 64  # by the gateway's count: room for fewer than 16
            out = await client.completions.create(model=MODEL, prompt=prompt)
            assert out.choices[0].text == "ok"
            assert "max_tokens" not in received[0]  # the server's own default, judged by its own count
    finally:
        await upstream.stop()
