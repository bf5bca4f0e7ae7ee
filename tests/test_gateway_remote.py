"""A gateway in front of `kvgate engine` servers over loopback, on the real tiny engine.

Covers the remote path end to end: the engine server's /kv_events stream keeps
the gateway's index exact (stored and removed), requests travel as token ids
with the gateway's classification, disconnects abort upstream, a dead replica
is retried before the first byte, and an external OpenAI-compatible server
(a real `kvgate engine` process addressed as kind=openai) works with the
approximate index and feeds its Prometheus load figures to the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import types

import aiohttp
import openai
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

import gateway.observe as observe
from gateway.app import GATEWAY, create_app
from gateway.config import ApiKeyConfig, KvgateConfig, ReplicaConfig, RouterConfig
from gateway.metrics import GatewayMetrics
from gateway.replicas import RemoteReplica, ReplicaInfo, ReplicaUnavailable
from gateway.router import ExactIndex
from gateway.upstream import parse_backend_metrics
from gateway.server import start_server
from tests.engine_procs import (
    MODEL,
    EngineProcess,
    count_aborts,
    engine_idle,
    free_port,
    record_requests,
    tiny_config,
    wait_for,
)
from tests.gateway_helpers import a_request_in_a_hung_step, hung_model_steps, metric_by_replica, serving, sse_events


async def _engine_server(model_dir, **kw):
    app = create_app(tiny_config(model_dir, **kw), engine_mode=True)
    server = await start_server(app)
    return app[GATEWAY].replicas[0].engine, server


RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)


async def _append(into: list, item) -> None:
    into.append(item)


def _client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


async def _scripted_upstream(models, chat, port: int = 0):
    """A scripted OpenAI-compatible server (for failures and answers a `kvgate engine`
    cannot produce on cue): ``models`` and ``chat`` are its two handlers."""
    stub = web.Application()
    stub.router.add_get("/v1/models", models)
    stub.router.add_post("/v1/chat/completions", chat)
    return await start_server(stub, port=port)


async def _completions_upstream(models, completions):
    """A scripted server of /v1/models and /v1/completions (as _scripted_upstream is of chat)."""
    stub = web.Application()
    stub.router.add_get("/v1/models", models)
    stub.router.add_post("/v1/completions", completions)
    return await start_server(stub)


async def _answer_fine(request):
    """A scripted upstream's chat handler: one streamed "Fine" and [DONE]."""
    await request.read()
    chunk = {"choices": [{"index": 0, "delta": {"content": "Fine"}, "finish_reason": "stop"}]}
    return web.Response(body=b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n",
                        content_type="text/event-stream")


def _models_while(state: dict):
    """A /v1/models handler that lists MODEL while ``state["healthy"]``, else fails."""
    async def models(request):
        if not state["healthy"]:
            return web.json_response({"error": {"message": "down"}}, status=500)
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return models


async def test_openais_session_and_user_fields_reach_an_external_server(tiny_model_dir):
    """prompt_cache_key and safety_identifier, read as the session and the user,
    also reach a `kind: openai` server as they came (as `user` does), from the
    Responses API too: the README said they were not sent on."""
    got = []

    async def chat(request):
        got.append(await request.json())
        return await _answer_fine(request)

    upstream = await _scripted_upstream(_models_while({"healthy": True}), chat)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url + "/v1")])
    try:
        async with serving(create_app(config)) as (app, server, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="the server in routing")
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, prompt_cache_key="k1", safety_identifier="alice")
            await client.responses.create(model=MODEL, input="hi", prompt_cache_key="k2", safety_identifier="bob")
    finally:
        await upstream.stop()
    assert [(body.get("prompt_cache_key"), body.get("safety_identifier")) for body in got] == [
        ("k1", "alice"), ("k2", "bob")]


async def test_gateway_follows_remote_engine_kv_events(tiny_model_dir):
    # A small pool with no host tier, so that later prompts evict earlier ones.
    (e1, s1), (e2, s2) = [await _engine_server(tiny_model_dir, device_blocks=48, host_multiplier=0) for _ in range(2)]
    seen = [record_requests(e1), record_requests(e2)]
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=s1.url),
                                          ReplicaConfig(kind="engine", url=s2.url + "/v1")])
    app = create_app(config)
    gw = await start_server(app)
    client = _client(gw.url)
    try:
        replicas = app[GATEWAY].replicas
        await wait_for(lambda: all(r.healthy for r in replicas), what="replicas healthy")
        system = "You are a helpful assistant. Answer the question briefly and politely. " * 4
        msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
        resp = await client.chat.completions.create(model=MODEL, messages=msgs("first"), max_tokens=2)
        assert isinstance(resp.choices[0].message.content, str) and resp.usage.completion_tokens <= 2
        owner = 0 if seen[0] else 1
        engine = (e1, e2)[owner]
        held = lambda: set(engine.cached_keys()["device"])  # noqa: E731
        # The stored events reach the gateway's index of that replica, exactly.
        await wait_for(lambda: set(replicas[owner].index.tiers) == held() and held(), what="index == cache")
        ctx = seen[owner][0].context
        assert (ctx.workload, ctx.type, ctx.turn) == ("to-c", "text", 1)
        stream = await client.chat.completions.create(
            model=MODEL, messages=msgs("second"), max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        assert len(seen[owner]) == 2
        # Removal events too: 10 distinct 19-block prompts overflow 2 x 48 blocks.
        before = set(replicas[owner].index.tiers)
        for i in range(10):
            await client.completions.create(model=MODEL, prompt=[(7 * i + j) % 300 + 10 for j in range(300)],
                                            max_tokens=1)
        await wait_for(lambda: all(engine_idle(e) for e in (e1, e2)), what="engines idle")
        for r, e in zip(replicas, (e1, e2)):
            await wait_for(lambda r=r, e=e: set(r.index.tiers) == set(e.cached_keys()["device"]),
                           what="index follows removals")
        assert e1.stats()["evictions"]["device"] + e2.stats()["evictions"]["device"] > 0
        assert before - set(replicas[owner].index.tiers) or engine.stats()["evictions"]["device"] == 0
        # vLLM's sampling fields travel to the remote engine: EOS forced, but not before
        # min_tokens; a stop token id kept in the text on request.
        eos = next(iter(e1.eos_ids))
        (a,) = e1.tokenizer.encode("a", add_special_tokens=False)
        base = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
        short = await client.completions.create(**base, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
        assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (4, "stop")
        kept = await client.completions.create(**base, logit_bias={str(a): 100}, extra_body={
            "stop_token_ids": [a], "include_stop_str_in_output": True, "min_p": 0.5, "repetition_penalty": 1.1})
        assert (kept.choices[0].text, kept.usage.completion_tokens) == ("a", 1)
    finally:
        await client.close()
        await gw.stop()
        await s1.stop()
        await s2.stop()


async def test_remote_disconnect_aborts_upstream(tiny_model_dir):
    engine, server = await _engine_server(tiny_model_dir, max_model_len=2048)
    aborted = count_aborts(engine)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=server.url)], max_model_len=2048))
    gw = await start_server(app)
    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:
            resp = await session.post(gw.url + "/v1/chat/completions", json=body)
            await resp.content.readline()
            resp.close()
        # 2,000 tokens take ~3 s on one thread: the abort is what frees the blocks (counted below).
        await wait_for(lambda: engine_idle(engine) and app[GATEWAY].router.inflight_requests == [0], timeout=5,
                       what="upstream aborted")
        assert len(aborted) == 1
    finally:
        await gw.stop()
        await server.stop()


@pytest.mark.parametrize("bound", ["_BACKLOG", "_BACKLOG_KEYS"])
async def test_a_kv_events_follower_that_stops_reading_is_cut_off(tiny_model_dir, monkeypatch, bound):
    """A follower that stops reading leaves the engine's writer waiting on a send
    that never drains (here: every event write waits forever, a stand-in for a full
    socket).  Once its backlog is full, in events or in the keys they carry (an
    eviction burst is one event of thousands), the engine cuts the connection, the
    writer and its listener go, and the engine keeps serving."""
    import gateway.engine_endpoints as endpoints

    # The other bound far out of reach: this one alone must cut.
    monkeypatch.setattr(endpoints, "_BACKLOG", 5 if bound == "_BACKLOG" else 10**6)
    monkeypatch.setattr(endpoints, "_BACKLOG_KEYS", 30 if bound == "_BACKLOG_KEYS" else 10**9)
    real_write = web.StreamResponse.write

    async def write_stalled_on_events(self, data):
        if self._req is not None and self._req.path == "/kv_events" and bytes(data).startswith(b"data: "):
            await asyncio.Event().wait()  # the follower's socket never drains
        return await real_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write_stalled_on_events)
    engine, server = await _engine_server(tiny_model_dir, device_blocks=48, host_multiplier=0)
    app_replica = server.runner.app[GATEWAY].replicas[0]
    listeners = len(app_replica._listeners)
    client = _client(server.url)
    try:
        async with aiohttp.ClientSession() as session:
            follower = await session.get(server.url + "/kv_events")
            assert (await follower.content.readline()).startswith(b"event: snapshot")
            assert len(app_replica._listeners) == listeners + 1
            for i in range(8):  # distinct prompts: stored blocks, then removals
                await client.completions.create(model=MODEL, prompt=[(5 * i + j) % 300 + 10 for j in range(200)],
                                                max_tokens=1)
            # Cut mid-stream (an unfinished chunked body), not left hanging.
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(follower.content.read(), 10)
        await wait_for(lambda: len(app_replica._listeners) == listeners, what="listener detached")
        again = await client.completions.create(model=MODEL, prompt="Still serving", max_tokens=1)
        assert again.usage.completion_tokens == 1
    finally:
        await client.close()
        await server.stop()


async def test_dead_replica_is_retried_before_first_byte_and_leaves_routing(tiny_model_dir):
    (e1, s1), (e2, s2) = [await _engine_server(tiny_model_dir) for _ in range(2)]
    seen = record_requests(e1)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=s1.url),
                                          ReplicaConfig(kind="engine", url=s2.url)],
                         router=RouterConfig(health_interval_s=0.1, breaker_failures=1))
    app = create_app(config)
    gw = await start_server(app)
    client = _client(gw.url)
    try:
        replicas = app[GATEWAY].replicas
        await wait_for(lambda: all(r.healthy for r in replicas), what="replicas healthy")
        assert set(await _engine_series(gw.url)) == {replicas[0].name, replicas[1].name}
        await s2.stop()
        for i in range(6):
            resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                                        max_tokens=1)
            assert resp.choices[0].finish_reason in ("stop", "length")
        await wait_for(lambda: not replicas[1].healthy, what="dead replica out")
        assert len(seen) == 6
        # Its engine figures go with it, not stay at their last values (autoscalers read them).
        assert set(await _engine_series(gw.url)) == {replicas[0].name}
        # The engines said how long each request queued (their streams' header): one per request.
        async with aiohttp.ClientSession() as session:
            async with session.get(gw.url + "/metrics") as resp:
                text = await resp.text()
        assert sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == "kvgate_queue_time_seconds_count") == 6
        # Time to first token and end-to-end latency go to the replica that answered, not the one retried away from.
        for name in ("kvgate_time_to_first_token_seconds_count", "kvgate_e2e_request_latency_seconds_count"):
            by_replica = {sample.labels["replica"]: sample.value for family in text_string_to_metric_families(text)
                          for sample in family.samples if sample.name == name and sample.labels["workload"] == "to-c"}
            assert by_replica == {replicas[0].name: 6, replicas[1].name: 0}, name
        assert app[GATEWAY].router.inflight_requests == [0, 0]
        assert [m.id for m in (await client.models.list()).data] == [MODEL]  # one replica is enough
    finally:
        await client.close()
        await gw.stop()
        await s1.stop()


async def test_a_failed_attempt_predicts_no_hits_on_the_replica_it_left(tiny_model_dir):
    """Predicted and served cached tokens are compared per replica to spot index
    drift: an attempt that fails over before its first output counts on neither."""
    (e1, s1), (e2, s2) = [await _engine_server(tiny_model_dir) for _ in range(2)]
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=s1.url),
                                          ReplicaConfig(kind="engine", url=s2.url)],
                         router=RouterConfig(health_interval_s=0.1))
    app = create_app(config)
    gw = await start_server(app)
    client = _client(gw.url)
    predicted_name = "kvgate_router_predicted_hit_tokens_total"
    try:
        replicas = app[GATEWAY].replicas
        await wait_for(lambda: all(r.healthy for r in replicas), what="replicas healthy")
        messages = [{"role": "user", "content": "A long question about the history of the Roman empire. " * 6}]
        for _ in range(2):
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        before = await metric_by_replica(gw.url, predicted_name)
        holder = next(r for r in replicas if before.get(r.name, 0) > 0)
        other = next(r for r in replicas if r is not holder)

        async def refuse(job):
            raise ReplicaUnavailable("refused for the test")
            yield  # an async generator, as the real one

        holder.generate = refuse
        resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        assert resp.usage.prompt_tokens_details.cached_tokens == 0  # served by the other replica, cold
        after = await metric_by_replica(gw.url, predicted_name)
        assert after.get(holder.name, 0) == before[holder.name]
        assert after.get(other.name, 0) == 0
    finally:
        await client.close()
        await gw.stop()
        await s1.stop()
        await s2.stop()


async def test_a_stream_cut_short_counts_what_the_remote_engine_did(tiny_model_dir):
    """A stream the client leaves counts its prompt, tokens and cache hits, and the
    router's prediction with them, through a `kvgate engine` too: the engine says
    its prefix-cache hit in a header, as its usage would have at the end."""
    engine, server = await _engine_server(tiny_model_dir)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=server.url, name="remote")]))
    gw = await start_server(app)
    client = _client(gw.url)
    names = ("kvgate_prompt_tokens_total", "kvgate_generation_tokens_total", "kvgate_prefix_cache_queries_tokens_total",
             "kvgate_prefix_cache_hits_tokens_total", "kvgate_router_predicted_hit_tokens_total")
    try:
        replica = app[GATEWAY].replicas[0]
        await wait_for(lambda: replica.healthy, what="healthy")
        messages = [{"role": "system", "content": "You are a helpful assistant who answers briefly. " * 8},
                    {"role": "user", "content": "Tell me a long story."}]
        seen = replica.events_seen
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        await wait_for(lambda: replica.events_seen > seen, what="the prompt's blocks in the index")
        before = {name: (await metric_by_replica(gw.url, name)).get("remote", 0) for name in names}
        hits_before = engine.stats()["prefix_cache"]["hit_tokens"]
        async with aiohttp.ClientSession() as session:
            resp = await session.post(gw.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": 400, "ignore_eos": True, "stream": True})
            await resp.content.readline()
            resp.close()
        await wait_for(lambda: engine_idle(engine) and app[GATEWAY].router.inflight_requests == [0],
                       what="upstream aborted")
        grew = {name: (await metric_by_replica(gw.url, name)).get("remote", 0) - before[name] for name in names}
        hits = engine.stats()["prefix_cache"]["hit_tokens"] - hits_before
        assert grew["kvgate_prefix_cache_hits_tokens_total"] == hits > 0
        assert grew["kvgate_router_predicted_hit_tokens_total"] == hits
        assert grew["kvgate_prompt_tokens_total"] == grew["kvgate_prefix_cache_queries_tokens_total"] > hits
        assert grew["kvgate_generation_tokens_total"] >= 1
    finally:
        await client.close()
        await gw.stop()
        await server.stop()


async def test_credentials_in_a_replica_url_stay_out_of_its_name_and_logs(tiny_model_dir, unused_tcp_port_factory,
                                                                          caplog):
    """user:password@ in a replica's URL reach the replica (as basic auth) and
    nothing else: not the replica's name, a label on /metrics, /stats and the
    dashboard, nor the log."""
    auth: list[str | None] = []

    async def models(request):
        auth.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request):
        auth.append(request.headers.get("Authorization"))
        return await _answer_fine(request)

    upstream = await _scripted_upstream(models, chat)
    port = int(upstream.url.rsplit(":", 1)[1])
    closed_port = unused_tcp_port_factory()  # nothing listens there: its start-up warning names the replica
    config = tiny_config(tiny_model_dir, [
        ReplicaConfig(kind="openai", url=f"http://alice:s3cret@127.0.0.1:{port}/v1"),
        ReplicaConfig(kind="openai", url=f"http://alice:s3cret@127.0.0.1:{closed_port}"),
    ])
    caplog.set_level(logging.INFO)
    app = create_app(config)
    gw = await start_server(app)
    client = _client(gw.url)
    try:
        assert [r.name for r in app[GATEWAY].replicas] == [f"127.0.0.1:{port}", f"127.0.0.1:{closed_port}"]
        out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content == "Fine"
        assert auth and set(auth) == {"Basic YWxpY2U6czNjcmV0"}  # alice:s3cret
        async with aiohttp.ClientSession() as session:
            for path in ("/metrics", "/stats", "/dashboard"):
                async with session.get(gw.url + path) as resp:
                    assert resp.status == 200
                    assert "s3cret" not in await resp.text(), path
        # With its reason (it gave none): nothing listens there.
        assert any(f"127.0.0.1:{closed_port}) is not answering (cannot connect (" in r.getMessage()
                   for r in caplog.records)
        assert not [r.getMessage() for r in caplog.records if "s3cret" in r.getMessage()]
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()


async def test_a_gateway_started_before_its_engines_serves_at_once(tiny_model_dir, unused_tcp_port_factory):
    """Nothing listens where the engine will be: the gateway does not wait out
    connect_timeout_s before it answers anything (its probes, /metrics and
    clients hung for those seconds); it answers 503 until the engine joins."""
    port = unused_tcp_port_factory()
    replica = ReplicaConfig(kind="engine", url=f"http://127.0.0.1:{port}", connect_timeout_s=30)
    began = time.monotonic()
    gw = await start_server(create_app(tiny_config(tiny_model_dir, [replica])))
    try:
        assert time.monotonic() - began < 10
        async with aiohttp.ClientSession() as session:
            async with session.get(gw.url + "/ready") as resp:
                assert resp.status == 503
            async with session.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_healthy_replica"
    finally:
        await gw.stop()


async def test_gateways_over_the_same_replicas_do_not_turn_in_step(tiny_model_dir):
    """Every router started its rotation among equal replicas at 0: two gateways
    given new prompts at once (a client-side load balancer's pairs) sent both to
    the same engine, 12 pairs in 12, while the other idled.  Each gateway starts
    its own rotation."""
    rotations = set()
    for _ in range(2):
        async with serving(create_app(tiny_config(tiny_model_dir))) as (app, _, _):
            rotations.add(app[GATEWAY].router._spread)
    assert len(rotations) == 2


async def test_an_engines_in_flight_limits_are_for_its_direct_clients_not_its_gateways(tiny_model_dir):
    """Engines and gateways read one config (the manifests' ConfigMap): an engine
    applied server.limits' in-flight bounds to every gateway's requests together,
    all under the gateway's one key, so tenants under their own limit got 429s
    (README: the bounds are each gateway's own).  A client calling the engine
    directly is still held to them."""
    from gateway.config import LimitsConfig

    limits = LimitsConfig(max_inflight_requests=1, max_inflight_per_tenant=1)
    engine_app = create_app(tiny_config(tiny_model_dir, limits=limits), engine_mode=True)
    engine_server = await start_server(engine_app)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=engine_server.url)],
                                 router=RouterConfig(health_interval_s=60)))
    gw = await start_server(app)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}

    async def status(url: str, sent: dict = body, path: str = "/v1/completions") -> int:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, json=sent) as resp:
                await resp.read()
                return resp.status

    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="in routing")
        assert await asyncio.gather(*(status(gw.url) for _ in range(4))) == [200] * 4
        assert 429 in await asyncio.gather(*(status(engine_server.url) for _ in range(4)))
        # No gateway sends a null context, nor calls an engine's /v1/responses.
        assert 429 in await asyncio.gather(*(status(engine_server.url, {**body, "kvgate_context": None})
                                             for _ in range(4)))
        responses = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 48, "kvgate_context": {}}
        assert 429 in await asyncio.gather(*(status(engine_server.url, responses, "/v1/responses") for _ in range(4)))
    finally:
        await gw.stop()
        await engine_server.stop()


async def test_an_engine_that_takes_the_connection_and_never_answers_holds_the_start_connect_timeout_s():
    """config.yaml: connect_timeout_s is also how long a starting gateway waits for
    an engine that accepts connections but does not answer yet.  Each try of
    /kvgate/info had a fixed 5 s of its own: 0.5 s held the start for 5.35 s."""
    silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    replica = RemoteReplica(ReplicaConfig(kind="engine", url=f"http://127.0.0.1:{port}", connect_timeout_s=0.5),
                            RouterConfig(health_interval_s=60), ReplicaInfo(MODEL, 16, MODEL, 1024))
    try:
        began = time.monotonic()
        await replica.start()
        assert time.monotonic() - began < 2 and not replica.healthy
    finally:
        await replica.close()
        silent.close()


async def test_an_external_server_gets_no_client_kvgate_fields_and_shared_tenants_are_warned(tiny_model_dir,
                                                                                               caplog):
    """kvgate_context is the gateway's to set for its engines: a client's (a forged
    tenant or workload) reaches no external server.  And tenants share an external
    server's prefix cache unless the gateway sends it their salt: said at start."""
    from gateway.config import ApiKeyConfig

    bodies: list[dict] = []

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request):
        bodies.append(await request.json())
        return await _answer_fine(request)

    upstream = await _scripted_upstream(models, chat)
    keys = [ApiKeyConfig(key="sk-a", tenant="acme"), ApiKeyConfig(key="sk-g", tenant="globex")]
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="ext")], api_keys=keys)
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        app = create_app(config)
    assert [r.getMessage() for r in caplog.records if "send_cache_salt" in r.getMessage()] == [
        "replica ext is an external server without send_cache_salt: tenants share its prefix cache "
        "(server.isolate_tenant_caches holds on kvgate engines only); set send_cache_salt: true for a vLLM V1 server"]
    gw = await start_server(app)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-a", max_retries=0, timeout=60)
    try:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            extra_body={"kvgate_context": {"tenant": "globex", "workload": "to-b"}, "kvgate_mm_hashes": [],
                        "kvgate_token_ids": True, "priority": -1000, "vllm_xargs": {"x": 1},
                        "kv_transfer_params": {"remote_host": "10.0.0.9", "remote_block_ids": [1]}, "top_k": 5})
        assert bodies and not {"kvgate_context", "kvgate_mm_hashes", "kvgate_token_ids", "priority", "vllm_xargs",
                               "kv_transfer_params"} & set(bodies[0])
        assert bodies[0]["top_k"] == 5  # what shapes the answer still goes
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()
    caplog.clear()
    config.replicas[0].send_cache_salt = True
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        create_app(config)
    assert not [r for r in caplog.records if "send_cache_salt" in r.getMessage()]
    # A kvgate engine reached without a key is the tenants' boundary no longer: whoever
    # reaches it may send a tenant's (guessable) cache salt.  Said at start, as above.
    for key, warned in ((None, True), ("sk-engine", False)):
        caplog.clear()
        engine = ReplicaConfig(kind="engine", url="http://127.0.0.1:9", name="eng", api_key=key)
        with caplog.at_level(logging.WARNING, logger="gateway.app"):
            create_app(config.model_copy(update={"replicas": [engine]}))
        said = [r.getMessage() for r in caplog.records if "reached without a key" in r.getMessage()]
        assert len(said) == warned and (not said or said[0].startswith("replica eng is a kvgate engine"))


async def test_a_stream_left_before_an_external_servers_usage_is_no_miss_on_the_dashboard(tiny_model_dir):
    """An external server says its cache hit only in its usage, at the end: a
    stream the client leaves before then has no known hit, and counts in neither
    the metrics' lookups nor /stats' hit ratio (not as a whole-prompt miss)."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            for _ in range(200):
                chunk = {"choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0.02)
        return resp

    upstream = await _scripted_upstream(models, chat)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="ext")]))
    gw = await start_server(app)
    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
        async with aiohttp.ClientSession() as session:
            resp = await session.post(gw.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 300,
                "stream": True})
            for _ in range(3):
                await resp.content.readline()
            resp.close()
            await wait_for(lambda: app[GATEWAY].router.inflight_requests == [0], what="the stream's end")
            async with session.get(gw.url + "/stats") as r:
                totals = (await r.json())["totals"]
        assert (await metric_by_replica(gw.url, "kvgate_prompt_tokens_total"))["ext"] > 0
        assert (await metric_by_replica(gw.url, "kvgate_prefix_cache_queries_tokens_total")).get("ext", 0) == 0
        assert totals["prompt_tokens"] == 0 and totals["requests"] == 0
    finally:
        await gw.stop()
        await upstream.stop()


async def test_engines_restarted_with_another_block_size_are_followed(tiny_model_dir, unused_tcp_port_factory, caplog):
    """A rolling restart onto another engine.block_size: while the engines
    disagree the gateway keeps its hashes and says which engine's index cannot
    match; once every engine hashes the new way, so does the gateway (it kept the
    old identity for good, and no prompt ever matched an index again)."""
    ports = [unused_tcp_port_factory() for _ in range(2)]
    engines = [await start_server(create_app(tiny_config(tiny_model_dir), engine_mode=True), port=p) for p in ports]
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=e.url) for e in engines],
                         router=RouterConfig(health_interval_s=0.1, breaker_reset_s=0.2))
    app = create_app(config)
    gw = await start_server(app)
    gateway = app[GATEWAY]
    client = _client(gw.url)
    try:
        replicas = gateway.replicas
        await wait_for(lambda: all(r.healthy and r.info.block_size == 16 for r in replicas), what="engines joined")
        other = tiny_config(tiny_model_dir)
        other.engine.block_size = 32
        caplog.set_level(logging.INFO, logger="gateway.app")
        for i, port in enumerate(ports):
            await engines[i].stop()
            engines[i] = await start_server(create_app(other, engine_mode=True), port=port)
            await wait_for(lambda: replicas[i].healthy and replicas[i].info.block_size == 32, timeout=20,
                           what="new identity learnt")
            if i == 0:  # the engines disagree: the gateway keeps 16 and names the odd one out
                assert gateway.hasher.block_size == 16
                said = [r for r in caplog.records if "blocks of 32 tokens" in r.getMessage()]
                assert said and said[-1].levelname == "ERROR" and replicas[0].name in said[-1].getMessage()
        assert gateway.hasher.block_size == gateway.router.block_size == 32
        assert any(r.levelname == "WARNING" and "every engine now hashes blocks of 32 tokens" in r.getMessage()
                   for r in caplog.records)
        # Prompts match the engines' indexes again: a repeat is predicted to hit.
        messages = [{"role": "user", "content": "Tell me about caches and their blocks. " * 12}]
        for _ in range(2):
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        async with aiohttp.ClientSession() as session:
            async with session.get(gw.url + "/metrics") as resp:
                scrape = await resp.text()
        predicted = sum(float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines()
                        if line.startswith("kvgate_router_predicted_hit_tokens_total{"))
        assert predicted >= 64
    finally:
        await client.close()
        await gw.stop()
        for engine in engines:
            await engine.stop()


@contextlib.asynccontextmanager
async def _recording_behind_an_engine(model_dir, engine_config, path):
    """A `kvgate engine` on ``engine_config`` and a gateway recording to ``path``
    in front of it: (engine server, gateway app, client)."""
    engine = await start_server(create_app(engine_config, engine_mode=True))
    app = create_app(tiny_config(model_dir, [ReplicaConfig(kind="engine", url=engine.url)], record_trace=str(path)))
    gw = await start_server(app)
    client = _client(gw.url)
    try:
        yield engine, app, client
    finally:
        await client.close()
        await gw.stop()
        await engine.stop()


async def test_an_engine_sharing_the_gateways_config_does_not_record(tiny_model_dir, tmp_path):
    """server.record_trace is the gateway's: engines on the same config (as the
    manifests' ConfigMap) each wrote the same file too, overwriting one another
    (moved aside, lines cut mid-way: replay refused it)."""
    path, engines = tmp_path / "served.jsonl", tmp_path / "engine.jsonl"
    async with _recording_behind_an_engine(tiny_model_dir, tiny_config(tiny_model_dir, record_trace=str(engines)),
                                           path) as (engine, app, client):
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="engine joined")
        for i in range(3):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Question {i} about caches."}], max_tokens=2)
    assert [json.loads(text)["turn"] for text in path.read_text().splitlines()] == [1, 1, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["served.jsonl"]


async def test_a_recording_takes_the_block_size_the_engines_report(tiny_model_dir, tmp_path):
    """The gateway assumed 16-token blocks at start; an engine of 32 joins: the
    recording's ids are per 32 tokens, and its lines say so."""
    engine_config = tiny_config(tiny_model_dir)
    engine_config.engine.block_size = 32
    path = tmp_path / "served.jsonl"
    async with _recording_behind_an_engine(tiny_model_dir, engine_config, path) as (_, app, client):
        replica = app[GATEWAY].replicas[0]
        await wait_for(lambda: replica.healthy and app[GATEWAY].hasher.block_size == 32, what="engine joined")
        out = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me about caches. " * 6}], max_tokens=2)
    (line,) = [json.loads(text) for text in path.read_text().splitlines()]
    assert line["block_tokens"] == 32 and line["input_length"] == out.usage.prompt_tokens > 32
    assert len(line["hash_ids"]) == -(-line["input_length"] // 32)


async def test_a_remote_engine_streams_token_ids_for_its_gateway(tiny_model_dir, tmp_path):
    """Its chunks carried text only: a cut-short stream's coalesced deltas counted
    one token each, and a recording behind remote engines named no output blocks
    (a next turn's hits on the answer were lost to replay)."""
    path = tmp_path / "served.jsonl"
    async with _recording_behind_an_engine(tiny_model_dir, tiny_config(tiny_model_dir), path) as (engine, app, client):
        # What the engine sends its gateway: every generated token's id, held-back ones included.
        async with aiohttp.ClientSession() as session:
            resp = await session.post(engine.url + "/v1/completions", json={
                "model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 24, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "kvgate_token_ids": True})
            events = await sse_events(resp)
        ids = [t for e in events if e != "[DONE]" for c in e["choices"] for t in c.get("token_ids", [])]
        assert len(ids) == events[-2]["usage"]["completion_tokens"] == 24
        replica = app[GATEWAY].replicas[0]
        await wait_for(lambda: replica.healthy, what="healthy")
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me about caches."}], max_tokens=48,
            extra_body={"ignore_eos": True})
    (line,) = [json.loads(text) for text in path.read_text().splitlines()]
    # 48 generated tokens fill at least two 16-token blocks past the prompt.
    assert len(line.get("output_hash_ids", [])) >= 2, line


VLLM_METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="other"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.95
"""


def test_parse_backend_metrics():
    assert parse_backend_metrics(VLLM_METRICS, "tiny") == (3.0, 0.95)
    assert parse_backend_metrics(VLLM_METRICS, None) == (10.0, 0.95)
    # Data parallelism: one series per engine; queues add up, the fullest engine's KV counts.
    dp = ('vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0\n'
          'vllm:num_requests_waiting{engine="1",model_name="tiny"} 5.0\n'
          'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.95\n'
          'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.10\n')
    assert parse_backend_metrics(dp, "tiny") == (12.0, 0.95)
    old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n"
    assert parse_backend_metrics(old) == (None, 0.5)
    assert parse_backend_metrics("# nothing here\n") == (None, None)
    # A kvgate engine's own page (or a gateway's, a series per replica).
    kvgate = ('kvgate_engine_requests{replica="engine",state="running"} 4.0\n'
              'kvgate_engine_requests{replica="engine",state="waiting"} 37.0\n'
              'kvgate_kv_cache_usage_ratio{replica="engine"} 0.97\n')
    assert parse_backend_metrics(kvgate, "tiny") == (37.0, 0.97)
    # A gauge a server left NaN or Inf is no figure: +Inf waiting requests, priced, raised
    # an OverflowError that ended the metrics poll for good.
    odd = ('vllm:num_requests_waiting{model_name="tiny"} +Inf\n'
           'vllm:kv_cache_usage_perc{model_name="tiny"} NaN\n')
    assert parse_backend_metrics(odd, "tiny") == (None, None)


async def test_a_metrics_page_with_no_load_figures_is_named_once(tiny_model_dir, caplog):
    """A metrics_url whose page has none of the series the gateway knows would
    read as an idle server for ever: one warning says so."""
    async def metrics(request):
        return web.Response(text="# HELP other_total Something else.\n# TYPE other_total counter\nother_total 3.0\n",
                            content_type="text/plain")

    async def chat(request):
        return web.Response(status=500)

    stub = web.Application()
    stub.router.add_get("/v1/models", _models_while({"healthy": True}))
    stub.router.add_post("/v1/chat/completions", chat)
    stub.router.add_get("/metrics", metrics)
    upstream = await start_server(stub)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="ext",
                                                                metrics_url=upstream.url + "/metrics")],
                                 router=RouterConfig(health_interval_s=0.1)))
    gw = await start_server(app)
    try:
        await wait_for(lambda: any("have none of" in r.message for r in caplog.records), what="the warning")
        await asyncio.sleep(0.5)  # several polls later
        warned = [r for r in caplog.records if "have none of" in r.message]
        assert len(warned) == 1 and "vllm:num_requests_waiting" in warned[0].message
        assert app[GATEWAY].replicas[0].waiting == 0.0
    finally:
        await gw.stop()
        await upstream.stop()


async def test_external_openai_replica_process_with_approximate_index_and_metrics(tiny_model_dir, tmp_path):
    """A real second server process (`kvgate engine`, used as a plain OpenAI server)."""
    proc = EngineProcess(tiny_config(tiny_model_dir), str(tmp_path))
    proc.start()

    metrics_state = {"up": True}

    async def metrics(request):
        if not metrics_state["up"]:
            return web.Response(status=500, text="saturated")
        return web.Response(text=VLLM_METRICS, content_type="text/plain")

    stub = web.Application()
    stub.router.add_get("/metrics", metrics)
    metrics_server = await start_server(stub)
    gw = None
    try:
        await proc.wait_ready()
        config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=proc.url + "/v1", name="ext",
                                                            metrics_url=metrics_server.url + "/metrics")],
                             router=RouterConfig(health_interval_s=0.2))
        app = create_app(config)
        gw = await start_server(app)
        client = _client(gw.url)
        replica = app[GATEWAY].replicas[0]
        await wait_for(lambda: replica.healthy, what="healthy")
        resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                                    max_tokens=2)
        assert isinstance(resp.choices[0].message.content, str) and resp.usage.completion_tokens <= 2
        assert len(replica.index) > 0
        keys = app[GATEWAY].hasher.chat([{"role": "user", "content": "hello there"}]).keys
        assert replica.index.match(keys) == len(keys)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=9)
        stream = await client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, stream=True)
        texts = {}
        async for c in stream:
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert set(texts) == {0, 1}
        # The backend's Prometheus figures reach the router's load term.
        await wait_for(lambda: replica.kv_usage == 0.95 and replica.waiting == 3.0, what="metrics polled")
        router = app[GATEWAY].router
        await wait_for(lambda: router.external_tokens[0] > 0, what="external load")
        assert router.external_tokens[0] >= 3 * 0.9 * router._mean_request_tokens
        # A saturated server's /metrics fails: its last figures hold for a few polls
        # (it is not read as idle at once), then go.
        metrics_state["up"] = False
        await asyncio.sleep(0.45)  # two polls
        assert replica.waiting == 3.0 and replica.kv_usage == 0.95
        await wait_for(lambda: replica.waiting == 0.0 and replica.kv_usage is None, what="stale figures dropped")
        await client.close()
    finally:
        if gw is not None:
            await gw.stop()
        await metrics_server.stop()
        proc.stop()


async def test_gateways_sharing_engines_see_each_others_load(tiny_model_dir):
    """Another gateway's requests hold one of two shared engines (its decoding is
    held at a gate): this gateway learns so from the engine's health probe, counts
    requests rather than their choices, and sends its own fresh prompts to the
    other engine."""
    import threading

    (e1, s1), (e2, s2) = [await _engine_server(tiny_model_dir) for _ in range(2)]
    gate = threading.Event()
    run = e1.runner.run

    def held_run(batch):
        # Decoding waits once all eight sequences (four requests, two choices each)
        # are in the batch with their prompts computed.  Under load the requests
        # arrive spread out: a step held before the last one joined kept it out
        # (CI saw fewer than eight running), so the early ones decode meanwhile,
        # with room to spare (max_tokens 400, no EOS) before the last joins.
        if len(batch) == 8 and all(seq.num_computed >= seq.num_prompt_tokens for seq, _ in batch):
            gate.wait(30)
        return run(batch)

    e1.runner.run = held_run
    on_e2 = record_requests(e2)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=s1.url, name="e1"),
                                          ReplicaConfig(kind="engine", url=s2.url, name="e2")],
                         router=RouterConfig(health_interval_s=0.1))
    app = create_app(config)
    gw = await start_server(app)
    ours, theirs = _client(gw.url), _client(s1.url)
    others = []
    try:
        replicas = app[GATEWAY].replicas
        await wait_for(lambda: all(r.healthy for r in replicas), what="replicas healthy")
        # The other gateway's four requests of two choices each, straight to e1 (as a
        # gateway sends them): four requests, not eight.
        others = [asyncio.create_task(theirs.completions.create(model=MODEL, prompt=f"elsewhere {i}", max_tokens=400,
                                                                n=2, extra_body={"ignore_eos": True}))
                  for i in range(4)]
        router = app[GATEWAY].router
        mean = router._mean_request_tokens
        await wait_for(lambda: e1.stats()["running"] == 8, what="both choices of each running on e1")
        await wait_for(lambda: router.external_tokens[0] >= 4 * mean * 0.99, what="e1's load seen")
        await asyncio.sleep(0.3)  # a few more probes
        assert router.external_tokens[0] <= 4 * mean * 1.01 and router.external_tokens[1] == 0
        # Operators see it too.
        seen = await metric_by_replica(gw.url, "kvgate_router_external_load_tokens")
        assert seen["e1"] >= 4 * 0.99 * router._mean_request_tokens and seen["e2"] == 0
        answers = await asyncio.wait_for(asyncio.gather(*(
            ours.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"question {i}"}],
                                         max_tokens=2) for i in range(4))), 30)
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
        assert len(on_e2) == 4
        gate.set()
        await asyncio.wait_for(asyncio.gather(*others), 30)
        await wait_for(lambda: router.external_tokens[0] == 0, what="e1's load gone")
    finally:
        gate.set()
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await ours.close()
        await theirs.close()
        await gw.stop()
        await s1.stop()
        await s2.stop()


async def _engine_series(url: str) -> set[str]:
    """The replicas that kvgate_engine_requests has series for."""
    return set(await metric_by_replica(url, "kvgate_engine_requests"))


@contextlib.asynccontextmanager
async def _observer_of_one_engine(stats):
    """A gateway's Observer following one `kvgate engine` whose /kvgate/stats is
    ``stats`` (an aiohttp handler); yields the observer and the replica it reads."""
    stub = web.Application()
    stub.router.add_get("/kvgate/stats", stats)
    server = await start_server(stub)
    observer = observe.Observer(KvgateConfig(), GatewayMetrics())
    replica = types.SimpleNamespace(name="e0", kind="engine", base=server.url, healthy=True, auth_headers=dict)
    observer.start([replica], lambda i: 0, 16)
    try:
        yield observer, replica
    finally:
        await observer.close()
        await server.stop()


async def test_engine_figures_outlive_one_failed_fetch_but_not_an_outage(monkeypatch):
    """A `kvgate engine`'s /kvgate/stats answering 500 once (a busy moment) keeps its
    last figures a little; failing for longer, or leaving routing, drops them."""
    state = {"ok": True, "fetches": 0}

    async def stats(request):
        state["fetches"] += 1
        if not state["ok"]:
            return web.json_response({"error": "busy"}, status=500)
        return web.json_response({"running": 3, "waiting": 1})

    monkeypatch.setattr(observe, "_REMOTE_MIN_AGE_S", 0.0)  # every refresh fetches
    async with _observer_of_one_engine(stats) as (observer, replica):
        await observer.refresh()
        assert dict(observer.replica_stats()) == {"e0": {"running": 3, "waiting": 1}}
        state["ok"] = False
        await observer.refresh()
        assert dict(observer.replica_stats())["e0"] == {"running": 3, "waiting": 1}
        monkeypatch.setattr(observe, "_REMOTE_KEEP_S", 0.0)  # failing past the grace
        await observer.refresh()
        assert dict(observer.replica_stats())["e0"] is None
        state["ok"] = True
        await observer.refresh()
        replica.healthy = False  # out of routing: no figures, whatever was fetched
        assert dict(observer.replica_stats())["e0"] is None
        # Nor asked for any: a hung engine's took every other scrape its whole timeout.
        fetches = state["fetches"]
        await observer.refresh()
        assert state["fetches"] == fetches
        replica.healthy = True
        await observer.refresh()
        assert state["fetches"] == fetches + 1 and dict(observer.replica_stats())["e0"] == {"running": 3, "waiting": 1}


async def test_concurrent_scrapes_share_one_fetch_of_engine_stats():
    """/metrics and /stats are open: each scrape that came while an engine's
    /kvgate/stats fetch was running sent one of its own (300 concurrent scrapes
    asked a single engine 232 times).  They wait for the one fetch, and a scrape
    whose client leaves does not cancel it for the others."""
    fetches = []

    async def stats(request):
        fetches.append(request)
        await asyncio.sleep(0.3)  # a busy engine
        return web.json_response({"running": 2, "waiting": 0})

    async with _observer_of_one_engine(stats) as (observer, _):
        left = asyncio.ensure_future(observer.refresh())  # the first scrape, whose client then leaves
        await asyncio.sleep(0.05)
        left.cancel()
        await asyncio.wait_for(asyncio.gather(*(observer.refresh() for _ in range(20))), 10)
        assert len(fetches) == 1, len(fetches)
        assert dict(observer.replica_stats()) == {"e0": {"running": 2, "waiting": 0}}


def _requests_by_status(metrics_text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "kvgate_requests_total" and sample.value:
                counts[sample.labels["status"]] = counts.get(sample.labels["status"], 0) + sample.value
    return counts


async def test_upstream_cut_or_hung_mid_stream_ends_with_error_event_then_rejoins(tiny_model_dir):
    """An upstream that drops a stream (no [DONE]) or hangs after its first token.

    The upstream here is a scripted aiohttp server, because the failure must
    happen at an exact point of the stream; the gateway side is the real one.
    """
    state = {"healthy": True, "mode": "cut"}

    models = _models_while(state)

    async def chat(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if state["mode"] == "hang":
            await asyncio.sleep(20)  # bounded: the gateway must cut it well before
        else:
            await asyncio.sleep(0.3)  # after the gateway relayed the first token
            if state["mode"] == "die":
                state["healthy"] = False  # the server goes with the connection
            request.transport.close()  # dropped: no [DONE]
        return resp

    upstream = await _scripted_upstream(models, chat)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                         router=RouterConfig(health_interval_s=0.1, breaker_failures=2, breaker_reset_s=0.5))
    app = create_app(config)
    gw = await start_server(app)
    replica = app[GATEWAY].replicas[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}

    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        async with aiohttp.ClientSession() as session:
            # Cut: error event then [DONE].  The server still answers its probe: one
            # connection was lost (a proxy's timeout), not the replica, which stays.
            async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                events = await asyncio.wait_for(sse_events(resp), 10)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "upstream_error"
            # In words, not aiohttp's internals ("TransferEncodingError: 400" reads as the client's fault).
            message = events[-2]["error"]["message"]
            assert "closed" in message and "400" not in message and "Error" not in message, message
            assert message.startswith("The model server ") and replica.name not in message, message
            assert any(c.get("choices") and c["choices"][0]["delta"].get("content") == "Hello" for c in events[:-2])
            await asyncio.sleep(0.3)  # the probe the loss sent has answered
            assert replica.healthy and replica.trips == 0
            # Cut by a server that died: the probe the loss sends fails, and it leaves
            # routing at once (before its health loop's own two failed probes).
            state["mode"] = "die"
            async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                events = await asyncio.wait_for(sse_events(resp), 10)
            assert events[-2]["error"]["code"] == "upstream_error"
            await wait_for(lambda: not replica.healthy, timeout=2, what="out of routing")
            assert replica._trip_reason.startswith("failed mid-request: the connection closed")
            async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 503  # nothing else to route to
            state["healthy"] = True
            # Back after the reset time, on a good probe.
            await wait_for(lambda: replica.healthy, timeout=5, what="rejoined")
            # Hung: the health probes fail, the breaker opens and cuts the live stream.
            state["mode"] = "hang"
            async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                await resp.content.readline()
                state["healthy"] = False
                events = await asyncio.wait_for(sse_events(resp), 10)
            assert events[-1] == "[DONE]" and "error" in events[-2]
            # Why, as the breaker saw it (its probes), not the connection it closed.
            assert "taken out of routing (2 probes failed in a row)" in events[-2]["error"]["message"], events[-2]
            assert not replica.healthy
            # Non-streaming through a cut upstream: it would start over on another
            # replica, but this is the only one, now out of routing: a 503.
            state.update(healthy=True, mode="cut")
            await wait_for(lambda: replica.healthy, timeout=5, what="rejoined again")
            async with session.post(gw.url + "/v1/chat/completions", json={**body, "stream": False}) as resp:
                assert resp.status == 503
                assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
            # The two streams went out as HTTP 200 but failed: the metrics count them as failures.
            async with session.get(gw.url + "/metrics") as resp:
                counts = _requests_by_status(await resp.text())
            assert counts == {"502": 3, "503": 2}, counts
        assert app[GATEWAY].router.inflight_requests == [0]
    finally:
        await gw.stop()
        await upstream.stop()


async def test_external_server_features_pass_through(tiny_model_dir):
    """Tools, JSON output, logit_bias and echo are the external server's to honour:
    the gateway forwards them as sent and relays tool calls and reasoning text,
    streamed and whole; the server's own context length bounds prompts.

    The upstream is a scripted aiohttp server that answers with vLLM's tool-call
    stream (a `kvgate engine` has no tool calls to send); the gateway is real.
    """
    seen: list[dict] = []
    arguments = ['{"a": ', '1, "b": ', "2}"]

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 32768}]})

    async def chat(request):
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        deltas = [
            {"role": "assistant", "content": ""},
            {"reasoning_content": "The user wants a sum.", "content": None},
            {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}]},
            *({"tool_calls": [{"index": 0, "function": {"arguments": part}}]} for part in arguments),
        ]
        for delta in deltas:
            chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 3000, "completion_tokens": 9, "total_tokens": 3009}}
        for chunk in (end, usage):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    upstream = await _scripted_upstream(models, chat)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)]))
    gw = await start_server(app)
    client = _client(gw.url)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    # Longer than the gateway config's max_model_len (2048), within the server's 32768.
    long_question = "Add one and two. " * 600
    request = dict(model=MODEL, messages=[{"role": "user", "content": long_question}], tools=tools, tool_choice="auto",
                   response_format={"type": "json_object"}, logit_bias={"5": 10}, max_tokens=20)
    try:
        whole = await client.chat.completions.create(**request)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
        call = message.tool_calls[0]
        assert (call.id, call.type, call.function.name, call.function.arguments) == ("call_1", "function", "add", '{"a": 1, "b": 2}')
        assert message.model_extra["reasoning_content"] == "The user wants a sum."
        assert seen[-1]["tools"] == tools and seen[-1]["tool_choice"] == "auto"
        assert seen[-1]["response_format"] == {"type": "json_object"} and seen[-1]["logit_bias"] == {"5": 10}

        stream = await client.chat.completions.create(**request, stream=True)
        fragments, reasons = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                fragments += choice.delta.tool_calls or []
                reasons.append(choice.finish_reason)
        assert "".join(f.function.arguments or "" for f in fragments) == '{"a": 1, "b": 2}'
        assert fragments[0].id == "call_1" and fragments[0].function.name == "add"
        assert reasons[-1] == "tool_calls"
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()


async def test_a_tool_call_numbered_by_its_choice_is_that_choices_one_call(tiny_model_dir):
    """vLLM streams a named tool_choice's call with the choice's index for the
    call's (choice 1's one call is index 1).  Gathered into a whole answer, choice 1
    had an empty call (no id, no name) before its own, where vLLM's whole answer,
    and the stream the gateway relays, have one call."""
    def call(index, fragment, finish=None):
        return {"choices": [{"index": index, "delta": {"tool_calls": [fragment]}, "logprobs": None,
                             "finish_reason": finish}]}

    async def chat(request):
        await request.read()
        first = {"type": "function", "function": {"name": "pick", "arguments": '{"n": '}}
        return _event_stream(_sse(call(0, {"id": "chatcmpl-tool-a", "index": 0, **first}),
                                  call(1, {"id": "chatcmpl-tool-b", "index": 1, **first}),
                                  call(0, {"index": 0, "function": {"arguments": "1}"}}, "stop"),
                                  call(1, {"index": 1, "function": {"arguments": "2}"}}, "stop"), b"[DONE]"))

    tools = [{"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}}}]
    async with _gateway_over_one(tiny_model_dir, chat, RouterConfig(health_interval_s=60)) as (gateway, _, client, _):
        whole = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}], n=2,
                                                     tools=tools, tool_choice={"type": "function",
                                                                               "function": {"name": "pick"}})
        assert [[(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
                for choice in whole.choices] == [[("chatcmpl-tool-a", "pick", '{"n": 1}')],
                                                 [("chatcmpl-tool-b", "pick", '{"n": 2}')]]
        assert gateway.router.inflight_requests == [0]


async def test_a_tool_call_index_past_any_answer_is_a_broken_answer(tiny_model_dir):
    """A whole answer keeps a place for every tool call index below the highest: a
    server's index of 3,000,000 held the gateway's event loop for 7 s while it
    made a gigabyte of empty calls.  Such an index is now a malformed answer,
    refused at once, and the gateway serves on."""
    async def chat(request):
        body = await request.json()
        index = 3_000_000 if body["messages"][0]["content"] == "far" else 0
        fragment = {"index": index, "id": "call-1", "type": "function", "function": {"name": "pick", "arguments": "{}"}}
        return _event_stream(_sse({"choices": [{"index": 0, "delta": {"tool_calls": [fragment]}, "logprobs": None,
                                                "finish_reason": "tool_calls"}]}, b"[DONE]"))

    async with _gateway_over_one(tiny_model_dir, chat, RouterConfig(health_interval_s=60)) as (gateway, _, client, _):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            await client.with_options(max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "far"}])
        assert time.monotonic() - started < 2
        assert refused.value.status_code == 503  # a malformed answer, as any other, said so
        assert "(the last one tried: the model server failed mid-request: it sent a malformed response)" \
            in refused.value.message and "127.0.0.1" not in refused.value.message
        whole = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "near"}])
        assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["pick"]
        assert gateway.router.inflight_requests == [0]


async def test_a_malformed_http_head_is_said_without_the_replicas_address(tiny_model_dir):
    """A replica (or a proxy before it) whose answer's HTTP head does not parse: the
    503 the client got quoted aiohttp's text, which ends with the request's URL (the
    replica's address, by default also its name) and calls the head a "400"."""
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    async def answer(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if not head.startswith(b"POST"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(models), models))
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nNot A Header\r\n\r\n")
                await writer.drain()
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    listener = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", name="gpu-a", url=f"http://127.0.0.1:{port}")],
                         router=RouterConfig(health_interval_s=60, breaker_failures=100))
    try:
        async with serving(create_app(config)) as (app, _, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    finally:
        listener.close()
    message = refused.value.message
    assert refused.value.status_code == 503 and "(the last one tried: the model server: it sent a malformed " \
        "response)" in message, message
    assert "127.0.0.1" not in message and str(port) not in message and "400" not in message, message


@contextlib.asynccontextmanager
async def _gateway_over_one(model_dir, chat, router: RouterConfig, name: str | None = None):
    """A real gateway in front of one scripted upstream, always healthy, that answers
    chat with ``chat``: the gateway, an SDK client and its one replica, once in routing."""
    upstream = await _scripted_upstream(_models_while({"healthy": True}), chat)
    app = create_app(tiny_config(model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name=name)], router=router))
    gw = await start_server(app)
    client = _client(gw.url)
    replica = app[GATEWAY].replicas[0]
    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        yield app[GATEWAY], gw.url, client, replica
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()


@contextlib.asynccontextmanager
async def _gateway_over_pair(model_dir, first, second, names: tuple[str, str], router: RouterConfig):
    """A real gateway in front of two scripted upstreams, always healthy, that
    answer chat with ``first`` and ``second`` (replicas named ``names``): the
    gateway, its URL, an SDK client and the upstream servers, once both are in
    routing."""
    healthy = _models_while({"healthy": True})
    servers = [await _scripted_upstream(healthy, first), await _scripted_upstream(healthy, second)]
    replicas = [ReplicaConfig(kind="openai", url=server.url, name=name) for server, name in zip(servers, names)]
    app = create_app(tiny_config(model_dir, replicas, router=router))
    gw = await start_server(app)
    client = _client(gw.url)
    try:
        await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="healthy")
        yield app[GATEWAY], gw.url, client, servers
    finally:
        await client.close()
        await gw.stop()
        for server in servers:
            await server.stop()


async def test_the_access_line_names_the_replica_that_answered(tiny_model_dir, caplog):
    """server.access_log ends with the replica that served the request (nginx's
    $upstream_addr): which engine a slow or uncached answer came from, without a
    DEBUG log.  A retried request names the one that answered; a refusal, none."""
    state = {"down": False}

    async def flaky(request):
        if state["down"]:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        return await _answer_fine(request)

    healthy = _models_while({"healthy": True})
    servers = [await _scripted_upstream(healthy, flaky), await _scripted_upstream(healthy, _answer_fine)]
    replicas = [ReplicaConfig(kind="openai", url=s.url, name=name) for s, name in zip(servers, ("left", "right"))]
    app = create_app(tiny_config(tiny_model_dir, replicas, router=RouterConfig(policy="round-robin")))
    gw = await start_server(app, access_log=logging.getLogger("test.access.gateway"))
    client = _client(gw.url)
    messages = [{"role": "user", "content": "hi"}]
    try:
        await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="healthy")
        with caplog.at_level(logging.INFO, logger="test.access.gateway"):
            for stream in (False, True):  # round-robin: one to each
                await client.chat.completions.create(model=MODEL, messages=messages, stream=stream)
            state["down"] = True
            for _ in range(2):  # whichever comes first, "right" answers
                await client.chat.completions.create(model=MODEL, messages=messages)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="nope", messages=messages)
            lines = lambda: [r.getMessage() for r in caplog.records if r.name == "test.access.gateway"]  # noqa: E731
            await wait_for(lambda: len(lines()) == 5, what="five access lines")
        ends = [(line.split('HTTP/1.1" ')[1].split()[0], line.rsplit(" ", 1)[1]) for line in lines()]
        assert sorted(ends[:2]) == [("200", "left"), ("200", "right")]
        assert ends[2:] == [("200", "right"), ("200", "right"), ("404", "-")]
    finally:
        await client.close()
        await gw.stop()
        for server in servers:
            await server.stop()


async def test_a_replica_at_capacity_passes_the_request_on(tiny_model_dir):
    """A 429 before any output (a replica shedding load) sends the request to
    another replica, without counting against the first; when every replica
    refuses, the client gets the 429, with the replica's Retry-After."""
    state = {"busy": 0}

    async def refuse(request):
        await request.read()
        state["busy"] += 1
        body = {"error": {"message": "at capacity", "type": "rate_limit_error", "param": None, "code": "server_overloaded"}}
        return web.json_response(body, status=429, headers={"Retry-After": "7"})

    router = RouterConfig(policy="round-robin", health_interval_s=0.1, breaker_failures=1)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, refuse, _answer_fine, ("busy", "good"), router) as (
            gateway, _, client, (_, good)):
        for _ in range(2):  # one of the two reaches the busy replica first
            out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
            assert out.choices[0].message.content == "Fine"
        assert state["busy"] == 1 and all(r.healthy for r in gateway.replicas)
        await good.stop()
        await wait_for(lambda: not gateway.replicas[1].healthy, what="good replica out")
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
        assert info.value.code == "server_overloaded"
        assert info.value.response.headers["Retry-After"] == "7"  # the server's own (the gateway's is 1)


async def test_a_servers_503_keeps_its_retry_after(tiny_model_dir):
    """A server that fails a request with a 503 and says when to come back: its
    Retry-After reaches the client, as a 429's does (it was the gateway's 1 s, and
    the SDK retried sooner than the server asked)."""
    async def unavailable(request):
        await request.read()
        body = {"error": {"message": "loading", "type": "service_unavailable", "param": None, "code": None}}
        return web.json_response(body, status=503, headers={"Retry-After": "7"})

    async with _gateway_over_one(tiny_model_dir, unavailable, RouterConfig(health_interval_s=60)) as (_, _, client, _):
        with pytest.raises(openai.InternalServerError) as info:
            await client.with_options(max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert info.value.status_code == 503 and info.value.message.endswith("loading")
        assert info.value.response.headers["Retry-After"] == "7"


async def test_long_sse_frames_pass_and_endless_ones_go_to_another_replica(tiny_model_dir):
    """A frame longer than aiohttp's readline allows (512 KiB: an echoed long prompt,
    many logprobs) reaches the client; one that never ends is a broken answer once
    past the gateway's bound, retried on another replica before the first byte
    rather than a 500 or a wait without end."""
    import gateway.upstream as upstream

    state = {"endless": False}

    def answer(size: int):
        async def chat(request):
            await request.read()
            if state["endless"] and size > 4:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b"data: " + b"x" * 150_000)
                await asyncio.sleep(30)
                return resp
            chunk = {"choices": [{"index": 0, "delta": {"content": "x" * size}, "finish_reason": "stop"}]}
            return web.Response(body=b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n",
                                content_type="text/event-stream")
        return chat

    healthy = _models_while({"healthy": True})
    long, short = await _scripted_upstream(healthy, answer(600_000)), await _scripted_upstream(healthy, answer(4))
    replicas = [ReplicaConfig(kind="openai", url=long.url, name="long"),
                ReplicaConfig(kind="openai", url=short.url, name="short")]
    app = create_app(tiny_config(tiny_model_dir, replicas, router=RouterConfig(policy="round-robin")))
    gw = await start_server(app)
    client = _client(gw.url)
    messages = [{"role": "user", "content": "hi"}]
    try:
        await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="healthy")
        sizes = {len((await client.chat.completions.create(model=MODEL, messages=messages)).choices[0].message.content)
                 for _ in range(2)}
        assert sizes == {600_000, 4}
        state["endless"] = True
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(upstream, "SSE_MAX_LINE_BYTES", 100_000)
            for _ in range(2):  # one of the two meets the endless replica first
                out = await asyncio.wait_for(client.chat.completions.create(model=MODEL, messages=messages), 10)
                assert out.choices[0].message.content == "xxxx"
        assert app[GATEWAY].router.inflight_requests == [0, 0]
    finally:
        await client.close()
        await gw.stop()
        await long.stop()
        await short.stop()


async def test_mixed_fleet_sends_tool_requests_to_the_external_server(tiny_model_dir):
    """A kvgate engine beside an external server: requests with tools or JSON output
    go to the external server only (the engine would ignore them); the rest go
    anywhere; with the external server out of routing they get a 503, not a
    plain-text answer from the engine."""
    state = {"healthy": True, "calls": 0}

    async def chat(request):
        await request.json()
        state["calls"] += 1
        delta = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                 "function": {"name": "add", "arguments": "{}"}}]}
        chunks = [{"choices": [{"index": 0, "delta": delta, "finish_reason": "tool_calls"}]}]
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        return web.Response(body=body, content_type="text/event-stream")

    upstream = await _scripted_upstream(_models_while(state), chat)
    replicas = [ReplicaConfig(kind="inprocess"), ReplicaConfig(kind="openai", url=upstream.url, name="vllm")]
    router = RouterConfig(policy="round-robin", health_interval_s=0.1, breaker_failures=1, breaker_reset_s=60)
    app = create_app(tiny_config(tiny_model_dir, replicas, router=router))
    gw = await start_server(app)
    client = _client(gw.url)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Add one and two."}]
    try:
        await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="healthy")
        for _ in range(3):
            out = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=5)
            assert out.choices[0].message.tool_calls[0].function.name == "add"
        assert state["calls"] == 3
        # Plain requests still use the engine (round-robin alternates over both).
        for _ in range(2):
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert state["calls"] == 4

        state["healthy"] = False
        await wait_for(lambda: not app[GATEWAY].replicas[1].healthy, what="external server out")
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=5)
        assert info.value.status_code == 503
        plain = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                     extra_body={"ignore_eos": True})
        assert plain.choices[0].finish_reason == "length"
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()


async def test_engine_shutting_down_finishes_its_streams_and_leaves_routing(tiny_model_dir):
    """A rolling restart: the engine stops listening and drains.  Its streams
    through the gateway run to [DONE] (they are not cut as a dead replica's
    would be) and it takes no new requests meanwhile."""
    engine, server = await _engine_server(tiny_model_dir)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=server.url)],
                         router=RouterConfig(health_interval_s=0.1, breaker_failures=1))
    app = create_app(config)
    gw = await start_server(app)
    replica = app[GATEWAY].replicas[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                await resp.content.readline()
                stopping = asyncio.create_task(server.stop())  # what SIGTERM does
                await wait_for(lambda: replica.draining and not replica.healthy, timeout=5, what="draining")
                rest = (await asyncio.wait_for(resp.content.read(), 60)).decode()
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        await stopping
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json={**body, "stream": False}) as resp:
                assert resp.status == 503
        assert app[GATEWAY].router.inflight_requests == [0]
    finally:
        await gw.stop()


async def test_a_stopping_engine_s_streams_run_on_after_its_port_closes(tiny_model_dir):
    """A `kvgate engine` that stops closes its port at once (server.shutdown_delay_s
    0) and serves what it holds for up to drain_timeout_s.  The gateway's probes
    and its /kv_events reconnects then fail, refused: no reason to cut the streams
    still open there.  The first refused reconnect (2 s on) was read as the engine
    gone, and the next failed probe cut a stream with no output since the failures
    began (a long step, a request queued there): an error for a drain in progress."""
    engine, server = await _engine_server(tiny_model_dir)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=server.url)],
                         router=RouterConfig(health_interval_s=0.1, breaker_failures=1))
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 40, "ignore_eos": True, "stream": True}
    async with serving(create_app(config)) as (app, gw, _):
        replica = app[GATEWAY].replicas[0]
        await wait_for(lambda: replica.healthy, what="healthy")
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/completions", json=body) as resp:
                await resp.content.readline()
                with hung_model_steps(engine) as release:
                    stopping = asyncio.create_task(server.stop())  # what SIGTERM does
                    await wait_for(lambda: replica.draining, timeout=5, what="draining")
                    await asyncio.sleep(3)  # past a refused reconnect, and many refused probes
                    assert replica.draining
                    release.set()
                    rest = (await asyncio.wait_for(resp.content.read(), 30)).decode()
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-2:]
        await stopping
        # Gone now, nothing of its left open: down, no longer draining.
        await wait_for(lambda: not replica.draining, timeout=10, what="stopped")


async def _one_engine_behind_a_gateway(model_dir, **router):
    """A `kvgate engine` server and a gateway over it, started: (engine, its server, the gateway's app and server)."""
    engine, server = await _engine_server(model_dir)
    app = create_app(tiny_config(model_dir, [ReplicaConfig(kind="engine", url=server.url)], router=RouterConfig(**router)))
    return engine, server, app, await start_server(app)


async def _every_engine_begins_to_stop(gateway_app, engine_apps) -> None:
    """Once every engine is in the gateway's routing, each begins to stop (SIGTERM's
    first act: still taking requests); back when the gateway knows them all draining."""
    replicas = gateway_app[GATEWAY].replicas
    await wait_for(lambda: all(r.healthy for r in replicas), what="every engine in routing")
    for engine_app in engine_apps:
        engine_app[GATEWAY].begin_drain()
    await wait_for(lambda: all(r.draining for r in replicas), what="every engine draining")


async def _two_engines_behind_a_gateway(model_dir):
    """Two `kvgate engine` servers (their apps, their servers) and a gateway config
    that alternates between them (round-robin: two of four requests on each)."""
    apps = [create_app(tiny_config(model_dir), engine_mode=True) for _ in range(2)]
    servers = [await start_server(app) for app in apps]
    config = tiny_config(model_dir, [ReplicaConfig(kind="engine", url=s.url) for s in servers],
                         router=RouterConfig(policy="round-robin"))
    return apps, servers, config


async def test_requests_queued_on_a_stopping_engine_go_to_another(tiny_model_dir, caplog):
    """A rolling update: the requests queued on a `kvgate engine` that begins to
    stop, which it would start only after the ones it runs (up to its whole
    drain), are served by another engine at once.  The one it has started runs
    to its end there, and a client's own request (no gateway's) stays queued."""
    caplog.set_level(logging.INFO)
    apps, servers, config = await _two_engines_behind_a_gateway(tiny_model_dir)
    engines = [a[GATEWAY].replicas[0].engine for a in apps]
    direct_client = None
    try:
        async with serving(create_app(config)) as (app, server, client):
            await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="both engines in routing")
            # Started on the engine that is to stop: a long answer under way.
            running = await client.completions.create(model=MODEL, prompt="a long one", max_tokens=200,
                                                      extra_body={"ignore_eos": True}, stream=True)
            await anext(running)
            which = next(i for i, e in enumerate(engines) if e._requests)
            stopping = engines[which]
            direct_client = _client(servers[which].url)
            aborted = count_aborts(stopping)
            with hung_model_steps(stopping):
                direct = asyncio.ensure_future(direct_client.completions.create(model=MODEL, prompt="mine", max_tokens=2))
                asked = [asyncio.ensure_future(client.completions.create(model=MODEL, prompt=f"question {i}", max_tokens=2))
                         for i in range(4)]
                await wait_for(lambda: len(stopping._requests) == 4, what="two of the gateway's and the client's own queued")
                assert len(stopping.unstarted()) == 2  # the gateway's two (the client sent no X-Request-Id)
                apps[which][GATEWAY].begin_drain()  # SIGTERM's first act
                # Served by the other engine while this one's step is still stuck.
                answers = await asyncio.wait_for(asyncio.gather(*asked), 10)
                assert all(answer.usage.completion_tokens == 2 for answer in answers)
                # Given up on the stopping engine once the other answered (its connection closed).
                await wait_for(lambda: len(aborted) == 2, what="the two offered requests withdrawn")
                assert not direct.done()
            assert (await asyncio.wait_for(direct, 30)).usage.completion_tokens >= 1
            rest = [chunk async for chunk in running]
            assert rest[-1].choices[0].finish_reason == "length"
            assert app[GATEWAY].router.inflight_requests == [0, 0]
    finally:
        if direct_client is not None:
            await direct_client.close()
        for s in servers:
            await s.stop()
    said = [r.getMessage() for r in caplog.records if r.name == "gateway.replicas"]
    assert any("2 queued requests offered to other replicas" in m for m in said), said


async def test_a_request_offered_elsewhere_is_answered_by_the_stopping_engine_that_starts_it_first(tiny_model_dir):
    """A queued request offered from a stopping engine to another that is busy
    too: the stopping engine, its running request done, starts it in its drain
    and answers at once.  That answer was never read: the client waited until
    the other engine got round to it (here as long as its step stays stuck).  The
    first to answer serves it, and the other gives it up."""
    apps, servers, config = await _two_engines_behind_a_gateway(tiny_model_dir)
    engines = [a[GATEWAY].replicas[0].engine for a in apps]
    directs = [_client(s.url) for s in servers]
    try:
        async with serving(create_app(config)) as (app, server, client):
            await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="both engines in routing")
            # Each engine busy with a client's own stream (another gateway's, say).
            busy = [await d.completions.create(model=MODEL, prompt="busy", max_tokens=20, stream=True,
                                               extra_body={"ignore_eos": True}) for d in directs]
            for stream in busy:
                await anext(stream)
            with hung_model_steps(engines[0]) as release0, hung_model_steps(engines[1]) as release1:
                asked = asyncio.ensure_future(client.completions.create(model=MODEL, prompt="a question", max_tokens=2))
                await wait_for(lambda: any(e.unstarted() for e in engines), what="queued on one engine")
                stopping = next(i for i, e in enumerate(engines) if e.unstarted())
                other = engines[1 - stopping]
                aborted = count_aborts(other)
                apps[stopping][GATEWAY].begin_drain()
                await wait_for(lambda: other.unstarted(), what="offered to the other engine, queued there")
                (release0, release1)[stopping].set()  # its running request ends, and it reaches this one
                answer = await asyncio.wait_for(asyncio.shield(asked), 10)
                assert answer.usage.completion_tokens == 2
                await wait_for(lambda: len(aborted) == 1, what="given up on the engine it was offered to")
            for stream in busy:
                assert [chunk async for chunk in stream][-1].choices[0].finish_reason == "length"
            assert app[GATEWAY].router.inflight_requests == [0, 0]
    finally:
        for d in directs:
            await d.close()
        for s in servers:
            await s.stop()


async def test_requests_queued_when_every_engine_stops_are_served_where_they_were_sent(tiny_model_dir):
    """Every engine stops at once (a node drain, a scale to zero): a queued request
    offered elsewhere finds no taker (the other engine refuses it, stopping too,
    before this gateway has heard so) and is served by the engine it was sent to,
    in that engine's drain: none fails."""
    apps, servers, config = await _two_engines_behind_a_gateway(tiny_model_dir)
    engines = [a[GATEWAY].replicas[0].engine for a in apps]
    try:
        async with serving(create_app(config)) as (app, server, client):
            await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="both engines in routing")
            with hung_model_steps(engines[0]), hung_model_steps(engines[1]):
                asked = [asyncio.ensure_future(client.completions.create(model=MODEL, prompt=f"question {i}", max_tokens=2))
                         for i in range(4)]
                await wait_for(lambda: [len(e._requests) for e in engines] == [2, 2], what="two queued on each")
                apps[1][GATEWAY].refusing = True  # stopped taking requests, and not yet said so
                apps[0][GATEWAY].begin_drain()
                replicas = app[GATEWAY].replicas
                await wait_for(lambda: replicas[0].draining, what="the first engine draining")
                await asyncio.sleep(0.5)  # its two offered to the second, refused there, taken back
                assert [len(e._requests) for e in engines] == [2, 2]
                apps[1][GATEWAY].begin_drain()
                await wait_for(lambda: replicas[1].draining, what="the second engine draining")
                assert not any(a.done() for a in asked)
            answers = await asyncio.wait_for(asyncio.gather(*asked), 30)
            assert all(answer.usage.completion_tokens == 2 for answer in answers)
            assert app[GATEWAY].router.inflight_requests == [0, 0]
    finally:
        for s in servers:
            await s.stop()


async def test_when_every_engine_stops_requests_go_to_them_while_they_take_requests(tiny_model_dir):
    """A node drain or a lone engine's restart: every engine says it stops, and for
    its server.shutdown_delay_s still takes requests, to serve in its drain.  The
    gateway sends them there rather than answer 503 (OpenAI's SDKs retry a 503 for
    ~2 s only); once they refuse (or their ports close), 503, and no replica failure."""
    apps, servers, config = await _two_engines_behind_a_gateway(tiny_model_dir)
    messages = [{"role": "user", "content": "Still there?"}]
    try:
        async with serving(create_app(config)) as (app, server, client):
            await _every_engine_begins_to_stop(app, apps)
            for _ in range(4):
                answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
                assert answer.usage.completion_tokens == 2
            apps[0][GATEWAY].refusing = True  # past its delay: taking no new request
            await servers[1].stop()  # its port closed
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            assert refused.value.status_code == 503
            failures = await metric_by_replica(server.url, "kvgate_replica_failures_total")
            assert sum(failures.values()) == 0, failures
    finally:
        for s in servers:
            await s.stop()


async def test_a_stopping_engine_is_no_last_resort_while_a_replica_is_in_routing(tiny_model_dir):
    """A rolling restart beside a replica at capacity: the request it refuses (429)
    is the client's 429, not one more request for the stopping engine to serve in
    its drain (the last resort is for when every engine stops)."""
    async def refuse(request):
        await request.read()
        body = {"error": {"message": "at capacity", "type": "rate_limit_error", "param": None, "code": "server_overloaded"}}
        return web.json_response(body, status=429, headers={"Retry-After": "7"})

    engine_app = create_app(tiny_config(tiny_model_dir), engine_mode=True)
    engine_server = await start_server(engine_app)
    busy = await _scripted_upstream(_models_while({"healthy": True}), refuse)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=engine_server.url),
                                          ReplicaConfig(kind="openai", url=busy.url, name="busy")],
                         router=RouterConfig(policy="round-robin"))
    engine = engine_app[GATEWAY].replicas[0].engine
    started = record_requests(engine)
    try:
        async with serving(create_app(config)) as (app, server, client):
            replicas = app[GATEWAY].replicas
            await wait_for(lambda: all(r.healthy for r in replicas), what="both in routing")
            engine_app[GATEWAY].begin_drain()
            await wait_for(lambda: replicas[0].draining, what="draining")
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2)
            assert refused.value.response.headers["Retry-After"] == "7"
            assert started == []
    finally:
        await busy.stop()
        await engine_server.stop()


async def test_stopping_engines_whose_ports_closed_are_tried_no_more(tiny_model_dir, caplog):
    """Every engine stopping, their ports closed while they still serve a stream each
    (drain_timeout_s): a refused connection says each is past taking requests.  The
    requests that follow are a 503 at once, rather than one try of each engine per
    request, each a routing decision and a log line ("stopping, trying another")."""
    apps, servers, config = await _two_engines_behind_a_gateway(tiny_model_dir)
    engines = [a[GATEWAY].replicas[0].engine for a in apps]
    try:
        async with serving(create_app(config)) as (app, server, client):
            replicas = app[GATEWAY].replicas
            await wait_for(lambda: all(r.healthy for r in replicas), what="both engines in routing")
            streams = []
            for _ in replicas:  # one on each (round-robin)
                stream = await client.completions.create(model=MODEL, prompt="a long one", max_tokens=200,
                                                         stream=True, extra_body={"ignore_eos": True})
                await anext(stream)
                streams.append(stream)
            with hung_model_steps(engines[0]), hung_model_steps(engines[1]):
                for engine_app, engine_server in zip(apps, servers):
                    engine_app[GATEWAY].begin_drain()
                    for site in list(engine_server.runner.sites):
                        await site.stop()  # its port closed: what server.shutdown_delay_s 0 does
                    engine_app[GATEWAY].refusing = True  # nor new requests on open connections
                await wait_for(lambda: all(r.draining for r in replicas), what="both draining")

                async def refused() -> None:
                    with pytest.raises(openai.APIStatusError) as info:
                        await client.completions.create(model=MODEL, prompt="q", max_tokens=2)
                    assert info.value.status_code == 503

                for _ in range(4):  # the connections the gateway had open answer 503, then refused
                    await refused()
                decided = await metric_by_replica(server.url, "kvgate_router_decisions_total")
                caplog.clear()
                caplog.set_level(logging.INFO, logger="gateway")
                for _ in range(5):
                    await refused()
                assert await metric_by_replica(server.url, "kvgate_router_decisions_total") == decided
                assert not [r for r in caplog.records if "trying another" in r.getMessage()]
                assert all(r.draining for r in replicas)  # still serving their streams
    finally:
        for s in servers:
            await s.stop()


async def test_a_request_sent_to_a_stopping_engine_as_a_last_resort_is_not_offered_elsewhere(tiny_model_dir, caplog):
    """Sent while every engine stops, queued there: the engine lists it as unstarted
    at each of the gateway's reconnects during its drain (every 2 s), and it was
    offered elsewhere each time, to no one, with a line in the log."""
    caplog.set_level(logging.INFO, logger="gateway.replicas")
    apps, servers, config = await _two_engines_behind_a_gateway(tiny_model_dir)
    engines = [a[GATEWAY].replicas[0].engine for a in apps]
    try:
        async with serving(create_app(config)) as (app, server, client):
            await _every_engine_begins_to_stop(app, apps)
            with hung_model_steps(engines[0]), hung_model_steps(engines[1]):
                asked = asyncio.ensure_future(client.completions.create(model=MODEL, prompt="late", max_tokens=2))
                await wait_for(lambda: any(e.unstarted() for e in engines), what="queued on a stopping engine")
                await asyncio.sleep(2.5)  # past the gateway's reconnect to it
            assert (await asyncio.wait_for(asked, 10)).usage.completion_tokens == 2
    finally:
        for s in servers:
            await s.stop()
    assert not [m for m in caplog.messages if "offered to other replicas" in m]


async def test_a_draining_engine_stays_out_of_routing_across_reconnects(tiny_model_dir, caplog):
    """While an engine drains (SIGTERM's first stage: still serving its streams),
    a gateway that reopens /kv_events gets a snapshot marked draining: the engine
    stays out of routing, quietly, instead of rejoining and leaving again."""
    caplog.set_level(logging.INFO, logger="gateway.replicas")
    engine, server, app, gw = await _one_engine_behind_a_gateway(tiny_model_dir, health_interval_s=0.1)
    replica = app[GATEWAY].replicas[0]
    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        server.runner.app[GATEWAY].begin_drain()
        await wait_for(lambda: replica.draining and not replica.healthy, timeout=5, what="draining")
        seen_healthy = False
        for _ in range(150):  # 3 s: past the gateway's reconnect
            seen_healthy |= replica.healthy
            await asyncio.sleep(0.02)
        assert not seen_healthy and replica.draining
        assert not any("back in routing" in r.getMessage() or "resyncing" in r.getMessage() for r in caplog.records)
    finally:
        await gw.stop()
        await server.stop()


async def test_a_draining_engines_blocks_are_neither_sent_nor_indexed_on_reconnect(tiny_model_dir, monkeypatch):
    """A gateway reopens /kv_events every 2 s while an engine drains (up to
    drain_timeout_s): the draining snapshot carries no keys, and the gateway
    indexes none, rather than a whole snapshot (a million keys: ~10 MB and
    ~0.7 s of the gateway's loop) at each reconnect, dropped at once, for an
    engine it never routes to again."""
    engine, server, app, gw = await _one_engine_behind_a_gateway(tiny_model_dir, health_interval_s=0.1)
    replica = app[GATEWAY].replicas[0]
    indexed_while_draining: list[int] = []
    rebuild = ExactIndex.rebuild

    async def counting(index, held):
        if index is replica.index and replica.draining:
            indexed_while_draining.append(sum(len(keys) for keys in held.values()))
        await rebuild(index, held)

    monkeypatch.setattr(ExactIndex, "rebuild", counting)
    client = _client(gw.url)
    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        await client.completions.create(model=MODEL, prompt="The quick brown fox " * 20, max_tokens=2)
        assert len(replica.index) > 0
        server.runner.app[GATEWAY].begin_drain()
        await wait_for(lambda: replica.draining and not replica.healthy, timeout=5, what="draining")
        await asyncio.sleep(2.5)  # past the gateway's reconnect (every 2 s while draining)
        assert sum(indexed_while_draining) == 0 and len(replica.index) == 0
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/kv_events") as resp:
                assert (await resp.content.readline()) == b"event: snapshot\n"
                snapshot = json.loads((await resp.content.readline()).removeprefix(b"data: "))
        assert snapshot["draining"] and not any(snapshot["keys"].values())
    finally:
        await client.close()
        await gw.stop()
        await server.stop()


async def test_request_waiting_for_headers_gives_up_when_the_breaker_opens(tiny_model_dir):
    """A server that accepts the connection but never answers (a stopped process,
    a hung prefill): the request must not wait forever.  When the health probes
    fail and the breaker opens, the waiting request ends (503 here, with no other
    replica; another replica would get it, since nothing was sent yet)."""
    state = {"healthy": True}

    models = _models_while(state)

    async def chat(request):
        await request.read()
        state["healthy"] = False
        await asyncio.sleep(30)  # bounded: the gateway must give up well before
        return web.json_response({})

    upstream = await _scripted_upstream(models, chat)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                         router=RouterConfig(health_interval_s=0.1, breaker_failures=2, breaker_reset_s=5))
    app = create_app(config)
    gw = await start_server(app)
    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                status = resp.status
                error = (await asyncio.wait_for(resp.json(), 10))["error"]
        assert status == 503 and error["code"] == "no_healthy_replica"
        assert app[GATEWAY].router.inflight_requests == [0]
    finally:
        await gw.stop()
        await upstream.stop()


async def test_a_replica_that_stops_answering_probes_leaves_after_their_timeouts(tiny_model_dir, caplog):
    """A hung replica's probes time out (health_timeout_s) rather than fail: with
    short timeouts it leaves routing within a second, not after 3 x 5 s, and the
    log says how the last probe failed."""
    state = {"hung": False}

    async def models(request):
        if state["hung"]:
            await asyncio.sleep(30)  # bounded: the probes give up well before
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    upstream = await _scripted_upstream(models, _answer_fine)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                         router=RouterConfig(health_interval_s=0.1, health_timeout_s=0.2, breaker_failures=2))
    app = create_app(config)
    gw = await start_server(app)
    replica = app[GATEWAY].replicas[0]
    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        state["hung"] = True
        hung_at = asyncio.get_running_loop().time()
        await wait_for(lambda: not replica.healthy, timeout=5, what="out of routing")
        assert asyncio.get_running_loop().time() - hung_at < 2
        assert any(r.getMessage() == f"replica {replica.name} leaves routing: 2 probes failed in a row "
                   "(last probe: it did not answer in time)" for r in caplog.records)
    finally:
        await gw.stop()
        await upstream.stop()


async def test_request_stuck_in_a_healthy_replica_times_out(tiny_model_dir):
    """A replica that passes its health checks but leaves one request without an
    answer (read_timeout_s): before the first token the request goes to another
    replica; after it, the stream ends with an error event, and the replica,
    still healthy, stays in routing (one stuck request is not a dead server)."""
    state = {"stall": "headers", "stalled": 0}

    async def chat(request):
        await request.read()
        if state["stall"] == "headers":
            state["stalled"] += 1
            await asyncio.sleep(20)  # bounded: the gateway must give up well before
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if state["stall"] == "stream":
            state["stalled"] += 1
            await asyncio.sleep(20)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    healthy = _models_while({"healthy": True})
    stuck = await _scripted_upstream(healthy, chat)
    good = await _scripted_upstream(healthy, _answer_fine)
    timeout = 0.5
    replicas = [ReplicaConfig(kind="openai", url=stuck.url, name="stuck", read_timeout_s=timeout),
                ReplicaConfig(kind="openai", url=good.url, name="good", read_timeout_s=timeout)]
    # Two failures would open the breaker: one silent request is no dead server.
    router = RouterConfig(policy="round-robin", health_interval_s=0.1, breaker_failures=2)
    app = create_app(tiny_config(tiny_model_dir, replicas, router=router))
    gw = await start_server(app)
    stuck_replica = app[GATEWAY].replicas[0]
    client = _client(gw.url)
    messages = [{"role": "user", "content": "hi"}]
    try:
        await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="healthy")
        # Round-robin sends one of these two to the stuck replica: both get answers.
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(2):
            out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
            assert out.choices[0].message.content == "Fine"
        assert state["stalled"] == 1 and loop.time() - started < 5
        assert stuck_replica.healthy

        state["stall"] = "stream"
        texts, failure = [], None
        for _ in range(2):  # one of the two streams reaches the stuck replica
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True)
            try:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        texts.append(chunk.choices[0].delta.content)
            except openai.APIError as exc:
                failure = exc
        assert state["stalled"] == 2
        assert "Hello" in texts and "Fine" in texts
        assert failure is not None and "sent nothing for 0.5 s" in str(failure)
        assert stuck_replica.healthy  # a stuck request does not cut the replica's other streams
        assert app[GATEWAY].router.inflight_requests == [0, 0]
        async with aiohttp.ClientSession() as session:
            async with session.get(gw.url + "/metrics") as resp:
                scrape = await resp.text()
        for stage in ("before_first_token", "mid_stream"):
            assert f'kvgate_replica_failures_total{{replica="stuck",stage="{stage}"}} 1.0' in scrape
    finally:
        await client.close()
        await gw.stop()
        await stuck.stop()
        await good.stop()


async def test_silence_from_the_whole_replica_opens_its_breaker(tiny_model_dir):
    """A hung model step leaves a replica's HTTP server answering its health checks
    while no request gets a token: requests that time out (read_timeout_s) with
    nothing from the replica meanwhile count toward its breaker.  One that times
    out while the replica serves others (a deep queue) does not."""
    state = {"stall": True}

    async def chat(request):
        body = await request.json()
        if state["stall"] and body["messages"][0]["content"] == "stall":
            await asyncio.sleep(20)  # bounded: the gateway gives up well before
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(10):  # a slow answer: a token every 0.1 s
            chunk = {"choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.1)
        done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await resp.write(b"data: " + json.dumps(done).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    upstream = await _scripted_upstream(_models_while({"healthy": True}), chat)
    replicas = [ReplicaConfig(kind="openai", url=upstream.url, name="hung", read_timeout_s=0.5)]
    router = RouterConfig(health_interval_s=0.1, breaker_failures=1, breaker_reset_s=60)
    app = create_app(tiny_config(tiny_model_dir, replicas, router=router))
    gw = await start_server(app)
    replica = app[GATEWAY].replicas[0]
    client = _client(gw.url)

    async def ask(content: str):
        return await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                    max_tokens=10)

    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        # A silent request beside one the replica answers token by token: a queue, not a hang.
        stalled, served = await asyncio.gather(ask("stall"), ask("serve"), return_exceptions=True)
        assert isinstance(stalled, openai.APIError) and served.choices[0].message.content == "tok" * 10
        assert replica.healthy and not replica.breaker_open
        # The same silence with nothing else coming: the replica leaves routing.
        with pytest.raises(openai.APIError):
            await ask("stall")
        assert replica.breaker_open and not replica.healthy
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()


async def test_an_engine_whose_model_step_hangs_fails_its_health_checks(tiny_model_dir):
    """A step running past engine.step_timeout_s (a stuck kernel, say) makes a
    `kvgate engine`'s /health a 503, though its event loop still answers: the
    gateway takes it out of routing at once, not after read_timeout_s per request."""
    engine_config = tiny_config(tiny_model_dir)
    engine_config.engine.step_timeout_s = 0.3
    engine_app = create_app(engine_config, engine_mode=True)
    engine_server = await start_server(engine_app)
    engine = engine_app[GATEWAY].replicas[0].engine
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=engine_server.url, name="e")],
                         router=RouterConfig(health_interval_s=0.1, breaker_failures=2, breaker_reset_s=0.2))
    app = create_app(config)
    gw = await start_server(app)
    replica = app[GATEWAY].replicas[0]
    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        async with aiohttp.ClientSession() as session:
            async with a_request_in_a_hung_step(engine, session, engine_server.url, MODEL) as (release, post):
                async with session.get(engine_server.url + "/health") as resp:
                    body = await resp.json()
                    assert resp.status == 503 and body["status"] == "stalled" and body["step_running_s"] > 0.3
                await wait_for(lambda: not replica.healthy, timeout=10, what="the gateway took it out of routing")
                release.set()
                async with await post as resp:
                    assert resp.status == 200
                async with session.get(engine_server.url + "/health") as resp:
                    assert resp.status == 200
        await wait_for(lambda: replica.healthy, timeout=20, what="back in routing")
    finally:
        await gw.stop()
        await engine_server.stop()


async def test_replicas_that_answer_after_the_gateway_started(tiny_model_dir, unused_tcp_port_factory):
    """Kubernetes starts the gateway and its engines together: a `kvgate engine`
    that comes up late still gets prefix matches (its block identity is the
    config's, and the gateway adopts what the engine says), and an external
    server down at start is served under its own model name once it is up."""
    engine_port, external_port = unused_tcp_port_factory(), unused_tcp_port_factory()
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=f"http://127.0.0.1:{engine_port}",
                                                        connect_timeout_s=0.5)],
                         router=RouterConfig(health_interval_s=0.1, breaker_reset_s=0.2))
    app = create_app(config)
    gw = await start_server(app)
    engine_app = create_app(tiny_config(tiny_model_dir), engine_mode=True)
    engine_server = None
    client = _client(gw.url)
    try:
        replica = app[GATEWAY].replicas[0]
        assert not replica.info_known
        engine_server = await start_server(engine_app, port=engine_port)
        await wait_for(lambda: replica.healthy and replica.info_known, timeout=10, what="engine joined")
        messages = [{"role": "user", "content": "The same question, asked twice, about the capital of France. " * 4}]
        for _ in range(2):
            resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        cached = resp.usage.prompt_tokens_details.cached_tokens
        assert cached > 0
        async with aiohttp.ClientSession() as session:
            async with session.get(gw.url + "/metrics") as metrics:
                text = await metrics.text()
        predicted = sum(float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith("kvgate_router_predicted_hit_tokens_total"))
        assert predicted == cached
    finally:
        await client.close()
        await gw.stop()
        if engine_server is not None:
            await engine_server.stop()

    # An external server that is down when the gateway starts.
    served = {"name": "upstream-model"}

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": served["name"], "object": "model", "max_model_len": 4096}]})

    async def chat(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": body["model"]}, "finish_reason": "stop"}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async with _gateway_before_its_external_server(tiny_model_dir, external_port) as (app, client, upstream_up):
        assert not app[GATEWAY].replicas[0].healthy
        await upstream_up(models, chat)
        await wait_for(lambda: app[GATEWAY].model_name == "upstream-model", timeout=10, what="name learnt")
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, timeout=10, what="healthy")
        assert [m.id for m in (await client.models.list()).data] == ["upstream-model"]
        resp = await client.chat.completions.create(model="upstream-model", messages=[{"role": "user", "content": "hi"}])
        assert resp.choices[0].message.content == "upstream-model" and resp.model == "upstream-model"
        assert app[GATEWAY].max_model_len == 4096


@contextlib.asynccontextmanager
async def _gateway_before_its_external_server(model_dir: str, port: int):
    """A gateway serving under its one external server's model name, that server
    not up yet: yields (gateway app, client, ``up(models, chat)``, which starts the
    server on ``port`` with those handlers)."""
    config = tiny_config(model_dir, [ReplicaConfig(kind="openai", url=f"http://127.0.0.1:{port}")],
                         router=RouterConfig(health_interval_s=0.1))
    config.model.served_name = None  # serve under the upstream's name
    app = create_app(config)
    gw = await start_server(app)
    upstreams = []

    async def up(models, chat):
        upstreams.append(await _scripted_upstream(models, chat, port=port))

    client = _client(gw.url)
    try:
        yield app, client, up
    finally:
        await client.close()
        await gw.stop()
        for upstream in upstreams:
            await upstream.stop()


async def test_a_model_not_named_yet_is_a_503_not_a_404(tiny_model_dir, unused_tcp_port_factory):
    """Gateway and vLLM started together: until the external server first answers, the
    gateway does not know the name it serves, so a request for it (what every client
    sends) gets a 503 that OpenAI's SDK retries, not a NotFoundError that it does not."""
    port = unused_tcp_port_factory()

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "org/upstream-model", "object": "model"}]})

    async with _gateway_before_its_external_server(tiny_model_dir, port) as (app, client, upstream_up):
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="org/upstream-model", messages=messages)
        assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"] == "1"
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(model="org/upstream-model", input="hi")
        await upstream_up(models, _answer_fine)
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy and app[GATEWAY].model_name == "org/upstream-model",
                       timeout=10, what="name learnt")
        resp = await client.chat.completions.create(model="org/upstream-model", messages=messages)
        assert resp.choices[0].message.content == "Fine"
        with pytest.raises(openai.NotFoundError):  # once known, another name is no model of this gateway's
            await client.chat.completions.create(model="other-model", messages=messages)


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


async def test_an_answer_that_fails_before_its_first_token_goes_to_another_replica(tiny_model_dir):
    """vLLM and SGLang answer 200 and then an error event when generation fails;
    a server in trouble may send a frame that is no chunk at all.  Before the first
    token either is retried elsewhere and counts toward the replica's breaker (a
    200 alone is no success); an in-stream 4xx is the client's and is relayed."""
    answers = iter([
        _sse(None),  # `data: null`
        _sse({"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError", "code": 500}}),
        _sse({"choices": "broken"}),
    ])
    state = {"client_error": False}

    async def failing(request):
        await request.read()
        if state["client_error"]:
            body = _sse({"error": {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}})
        else:
            body = next(answers)
        return web.Response(body=body + b"data: [DONE]\n\n", content_type="text/event-stream")

    # Probes far apart: a good probe between the failures would forgive them.
    router = RouterConfig(policy="round-robin", health_interval_s=60, breaker_failures=3)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, failing, _answer_fine, ("bad", "good"), router) as (
            gateway, _, client, _):
        bad_replica = gateway.replicas[0]
        for stream in (False, True, False, True, False, True):
            if stream:
                parts = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
                text = "".join([c.choices[0].delta.content or "" async for c in parts if c.choices])
            else:
                text = (await client.chat.completions.create(model=MODEL, messages=messages)).choices[0].message.content
            assert text == "Fine"
        assert not bad_replica.healthy and bad_replica.trips == 1  # three failures in a row
        assert gateway.router.inflight_requests == [0, 0]
    state["client_error"] = True
    async with _gateway_over_pair(tiny_model_dir, failing, _answer_fine, ("bad", "good"), router) as (
            gateway, _, client, _):
        outcomes = set()
        for _ in range(2):  # one to each replica
            try:
                outcomes.add((await client.chat.completions.create(model=MODEL, messages=messages)).choices[0].message.content)
            except openai.BadRequestError as exc:
                outcomes.add(exc.body["message"])
        assert outcomes == {"Fine", "prompt too long"}
        assert all(r.healthy for r in gateway.replicas)


async def test_a_stream_that_ends_without_an_answer_goes_to_another_replica(tiny_model_dir):
    """A server that ends its stream with [DONE] and no choice (at most usage)
    answered nothing: it was an empty 200, passed off as the model's answer.  It
    is retried elsewhere and counts toward the server's breaker."""
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}}
    empties = []

    async def empty(request):
        await request.read()
        empties.append(b"" if len(empties) % 2 == 0 else _sse(usage))
        return web.Response(body=empties[-1] + b"data: [DONE]\n\n", content_type="text/event-stream")

    router = RouterConfig(policy="round-robin", health_interval_s=60, breaker_failures=2)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, empty, _answer_fine, ("empty", "good"), router) as (
            gateway, _, client, _):
        for stream in (False, True, False, True):
            if stream:
                parts = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
                chunks = [c async for c in parts]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert chunks[-1].choices[0].finish_reason == "stop"
            else:
                answer = await client.chat.completions.create(model=MODEL, messages=messages)
                text = answer.choices[0].message.content
                assert answer.choices[0].finish_reason == "stop"
            assert text == "Fine"
        assert len(empties) == 2 and gateway.replicas[0].trips == 1  # both empty answers counted
        assert gateway.router.inflight_requests == [0, 0]


async def test_a_whole_json_answer_to_a_streamed_request_is_read(tiny_model_dir):
    """A server that ignores ``stream`` answers 200 with the whole completion as
    JSON, and some put an error in a 200 JSON body: both were read as a stream
    without events, a 503 "no healthy replica" to the client, counted toward the
    server's breaker.  The completion is the answer (streamed to a client that
    asked so); the error is the client's (4xx) or retried elsewhere (5xx)."""
    state = {"answer": "whole"}
    whole = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "Whole."}, "finish_reason": "stop",
                          "logprobs": None}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
    errors = {"client": ({"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}),
              "server": ({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})}

    # A whole message's tool calls carry no index (a stream's do); vLLM lists none as [].
    calls = [{"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": "{}"}}
             for name in ("f", "g")]
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in ("f", "g")]
    answers = {"whole": whole,
               "tools": {**whole, "choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                                                        "tool_calls": calls},
                                               "finish_reason": "tool_calls"}]},
               "no tools": {**whole, "choices": [{"index": 0, "message": {"role": "assistant", "content": "Whole.",
                                                                           "tool_calls": []},
                                                  "finish_reason": "stop"}]}, **errors}

    async def json_answers(request):
        await request.read()
        return web.json_response(answers[state["answer"]])

    router = RouterConfig(policy="round-robin", health_interval_s=60, breaker_failures=100)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, json_answers, json_answers, ("a", "b"), router) as (
            gateway, _, client, _):
        answer = await client.chat.completions.create(model=MODEL, messages=messages)
        assert answer.choices[0].message.content == "Whole." and answer.choices[0].finish_reason == "stop"
        assert answer.usage.completion_tokens == 2
        parts = [c async for c in await client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                                      stream_options={"include_usage": True})]
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == "Whole."
        assert parts[-1].usage.completion_tokens == 2
        state["answer"] = "tools"
        async with client.chat.completions.stream(model=MODEL, messages=messages, tools=tools) as stream:
            final = await stream.get_final_completion()  # the SDK's accumulator wants each call's index
        assert [call.function.name for call in final.choices[0].message.tool_calls] == ["f", "g"]
        state["answer"] = "no tools"
        parts = [c async for c in await client.chat.completions.create(model=MODEL, messages=messages, stream=True)]
        assert not any(c.choices[0].delta.tool_calls is not None for c in parts if c.choices)
        state["answer"] = "client"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=messages)
        assert info.value.body["message"] == "prompt too long"
        state["answer"] = "server"
        with pytest.raises(openai.InternalServerError) as failed:
            await client.with_options(max_retries=0).chat.completions.create(model=MODEL, messages=messages)
        assert failed.value.body["message"] == "engine died"  # both tried, the last one's words
        assert all(r.healthy and r.trips == 0 for r in gateway.replicas)


async def test_a_non_streamed_answer_failed_mid_way_goes_to_another_replica(tiny_model_dir):
    """A server's error event after some tokens was relayed as a 500 to a client
    that had had nothing yet (README: such requests go to another replica); a
    stream already under way ends with the error.  An error answer's x-request-id
    is the completion id its replicas were sent (it was a fresh req- id, in no
    replica's log)."""
    seen = []

    async def failing(request):
        await request.read()
        seen.append(request.headers.get("X-Request-Id"))
        token = {"choices": [{"index": 0, "delta": {"content": "Fi"}, "finish_reason": None}]}
        failure = {"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError", "code": 500}}
        return web.Response(body=_sse(token, failure, b"[DONE]"), content_type="text/event-stream")

    router = RouterConfig(policy="round-robin", health_interval_s=60, breaker_failures=100)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, failing, _answer_fine, ("bad", "good"), router) as (
            gateway, url, client, _):
        for _ in range(4):  # two of them to the failing replica first
            assert (await client.chat.completions.create(model=MODEL, messages=messages)).choices[0].message.content \
                == "Fine"
        assert len(seen) == 2
        failed_streams = 0
        for _ in range(2):
            parts = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
            try:
                text = "".join([c.choices[0].delta.content or "" async for c in parts if c.choices])
            except openai.APIError:
                failed_streams += 1
            else:
                assert text == "Fine"
        assert failed_streams == 1
        assert gateway.router.inflight_requests == [0, 0]
    async with _gateway_over_one(tiny_model_dir, failing, router) as (_, url, _, _):
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}) as resp:
                assert resp.status == 500 and resp.headers["x-request-id"] == seen[-1]
                assert seen[-1].startswith("chatcmpl-")


async def test_a_finished_answer_without_done_is_whole_and_leaves_the_replica_in(tiny_model_dir):
    """A server that closes the stream after every choice's finish_reason but
    without [DONE] (or with a [DONE] whose blank line EOF cut off) gave a whole
    answer: no 502, no error event, no breaker cutting its other streams."""
    endings = {"none": b"", "no blank line": b"data: [DONE]\n"}
    state = {"ending": "none"}

    async def chat(request):
        await request.read()
        chunk = {"choices": [{"index": 0, "delta": {"content": "Fine"}, "finish_reason": "stop"}]}
        return web.Response(body=_sse(chunk) + endings[state["ending"]], content_type="text/event-stream")

    upstream = await _scripted_upstream(_models_while({"healthy": True}), chat)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="x")]))
    gw = await start_server(app)
    client = _client(gw.url)
    messages = [{"role": "user", "content": "hi"}]
    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
        for ending in endings:
            state["ending"] = ending
            assert (await client.chat.completions.create(model=MODEL, messages=messages)).choices[0].message.content == "Fine"
            async with aiohttp.ClientSession() as session:
                async with session.post(gw.url + "/v1/chat/completions",
                                        json={"model": MODEL, "messages": messages, "stream": True}) as resp:
                    events = await sse_events(resp)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), ending
        replica = app[GATEWAY].replicas[0]
        assert replica.healthy and replica.trips == 0
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()


async def test_an_external_server_gets_its_own_model_name_and_a_mixed_fleet_keeps_the_gateways(
        tiny_model_dir, unused_tcp_port_factory):
    """The gateway may serve a model under another name (model.served_name, or
    its in-process engine's): an external server is sent the name it gave in
    /v1/models, and one that joins late does not rename what clients already use."""
    seen = []

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "org/real-model", "object": "model",
                                                              "max_model_len": 32768}]})

    async def chat(request):
        seen.append((await request.json())["model"])
        return await _answer_fine(request)

    port = unused_tcp_port_factory()
    router = RouterConfig(policy="round-robin", health_interval_s=0.2)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="inprocess", name="local"),
                                                  ReplicaConfig(kind="openai", url=f"http://127.0.0.1:{port}")],
                                 router=router))
    gw = await start_server(app)
    gateway = app[GATEWAY]
    client = _client(gw.url)
    upstream = None
    try:
        await wait_for(lambda: gateway.replicas[0].healthy, what="in-process replica")
        assert (gateway.model_name, gateway.max_model_len) == (MODEL, 1024)
        upstream = await _scripted_upstream(models, chat, port=port)
        await wait_for(lambda: gateway.replicas[1].healthy, what="late external server")
        assert (gateway.model_name, gateway.max_model_len) == (MODEL, 1024)
        for _ in range(2):  # one to each replica
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert seen == ["org/real-model"]
    finally:
        await client.close()
        await gw.stop()
        if upstream is not None:
            await upstream.stop()


async def test_a_replica_that_answers_probes_but_fails_every_request_leaves_routing(tiny_model_dir):
    """Its good probes used to wipe the count of failed requests: at a few
    requests per probe interval the breaker never opened, and every request
    it got paid for a retry elsewhere."""
    async def broken(request):
        await request.read()
        return web.json_response({"error": {"message": "engine dead"}}, status=500)

    router = RouterConfig(policy="round-robin", health_interval_s=0.05, breaker_failures=3, breaker_reset_s=60)
    async with _gateway_over_pair(tiny_model_dir, broken, _answer_fine, ("bad", "good"), router) as (
            gateway, _, client, _):
        for _ in range(12):
            out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert out.choices[0].message.content == "Fine"
            await asyncio.sleep(0.2)  # several good probes between requests
        assert gateway.replicas[0].trips == 1 and not gateway.replicas[0].healthy


async def test_a_non_streaming_request_whose_replica_dies_mid_answer_starts_over_on_another(tiny_model_dir, caplog):
    """Nothing of a non-streaming answer has reached the client when its replica
    dies after some tokens: it is asked again of another replica, and the client
    gets that one's whole answer (and usage), not a 502.  A stream cannot start
    over: it still ends with an error event."""
    async def dying(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}],
                               "usage": {"prompt_tokens": 99, "completion_tokens": 1}}))
        await asyncio.sleep(0.2)
        request.transport.close()  # gone mid-answer: no [DONE]
        return resp

    router = RouterConfig(policy="round-robin", health_interval_s=0.1, breaker_reset_s=1.0)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, dying, _answer_fine, ("dying", "good"), router) as (
            gateway, url, client, _):
        ids = []
        for _ in range(2):  # round-robin: one of the two meets the dying replica first
            out = await client.chat.completions.create(model=MODEL, messages=messages)
            assert out.choices[0].message.content == "Fine" and out.choices[0].finish_reason == "stop"
            assert out.usage.prompt_tokens != 99  # a dead attempt's usage is dropped
            ids.append(out.id)
        # The log line names the id the client has (its x-request-id), not an internal one.
        (retried,) = [r.getMessage() for r in caplog.records if "trying another" in r.getMessage()]
        assert retried.split(":")[0] in ids, retried
        # Its server still answers probes: the loss is the connection's, and it stays in routing.
        assert gateway.replicas[0].trips == 0 and gateway.replicas[0].healthy
        assert await metric_by_replica(url, "kvgate_replica_failures_total") == {"dying": 1.0, "good": 0.0}
        # A stream cannot start over once its first bytes are out.
        endings = []
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(url + "/v1/chat/completions",
                                        json={"model": MODEL, "messages": messages, "stream": True}) as resp:
                    events = await sse_events(resp)
                assert events[-1] == "[DONE]"
                endings.append(events[-2].get("error", {}).get("code"))
                if endings[-1] is not None:
                    assert any(r.getMessage().startswith(f"{events[0]['id']} failed mid-response")
                               for r in caplog.records)
        assert sorted(endings, key=str) == [None, "upstream_error"]


async def test_an_error_event_after_output_is_relayed_and_counted_as_the_replicas_failure(tiny_model_dir):
    """vLLM ends a stream whose generation fails with an error event after the
    tokens so far: the client gets that error, and the replica's failure shows in
    kvgate_replica_failures_total{stage="mid_stream"}, as a cut stream's does.  An
    in-stream 4xx is the client's: not counted."""
    state = {"code": 500}

    async def failing_midway(request):
        await request.read()
        token = {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
        error = {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": state["code"]}}
        return web.Response(body=_sse(token, error) + b"data: [DONE]\n\n", content_type="text/event-stream")

    router = RouterConfig(policy="round-robin", health_interval_s=60)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, failing_midway, _answer_fine, ("failing", "good"), router) as (
            gateway, url, client, _):
        for code, counted in ((500, 1.0), (400, 1.0)):
            state["code"] = code
            texts, failures = [], []
            for _ in range(2):  # round-robin: one of the two streams meets the failing replica
                stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
                try:
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            texts.append(chunk.choices[0].delta.content)
                except openai.APIError as exc:
                    failures.append(str(exc))
            assert sorted(texts) == ["Fine", "Hel"] and len(failures) == 1 and "EngineCore died" in failures[0]
            counts = await metric_by_replica(url, "kvgate_replica_failures_total")
            assert counts == {"failing": counted, "good": 0.0}, (code, counts)
        assert gateway.router.inflight_requests == [0, 0]


async def test_a_kvgate_engine_refuses_a_session_no_gateway_would_send(tiny_model_dir):
    """The engine's policy keeps sessions as keys, up to 200k of them: a client
    talking to an engine directly must not fill them with megabytes each."""
    _, server = await _engine_server(tiny_model_dir)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1,
            "kvgate_context": {"workload": "to-c", "type": "text", "session": "s" * 256}}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            body["kvgate_context"]["session"] = "s" * 100_000
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "kvgate_context.session", error
            body["kvgate_context"] = {"workload": "to-c", "type": "text", "endpoint": "embeddings"}
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "kvgate_context.endpoint", error
    finally:
        await server.stop()


async def test_a_request_every_replica_fails_leaves_the_fleet_in_routing(tiny_model_dir):
    """One request that makes every server answer 500 (a poison prompt), sent
    with the SDK's retries: each replica's failure is counted only once another
    replica has served the same request, so the fleet stays in routing, other
    clients' streams run on, and the client gets the servers' own error."""
    async def poisoned(request):
        body = await request.json()
        if body["messages"][-1]["content"].startswith("poison"):
            if body["messages"][-1]["content"] == "poison-event":  # vLLM's way: 200, then an error event
                return web.Response(body=_sse({"error": {"message": "EngineCore hit NaN", "type": "InternalServerError",
                                                         "code": 500}}) + b"data: [DONE]\n\n",
                                    content_type="text/event-stream")
            return web.json_response({"error": {"message": "EngineCore hit NaN", "type": "InternalServerError",
                                                "param": None, "code": None}}, status=500)
        return await _answer_fine(request)

    router = RouterConfig(policy="round-robin", health_interval_s=60, breaker_failures=3)
    async with _gateway_over_pair(tiny_model_dir, poisoned, poisoned, ("a", "b"), router) as (gateway, _, client, _):
        retrying = openai.AsyncOpenAI(base_url=client.base_url, api_key="x", max_retries=2, timeout=60)
        try:
            for stream, prompt in ((False, "poison-http"), (True, "poison-http"), (False, "poison-event"),
                                   (True, "poison-event")):
                with pytest.raises(openai.InternalServerError) as info:
                    await retrying.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                           stream=stream)
                assert info.value.status_code == 500 and "EngineCore hit NaN" in info.value.message
        finally:
            await retrying.close()
        assert all(r.healthy for r in gateway.replicas) and [r.trips for r in gateway.replicas] == [0, 0]
        fine = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert fine.choices[0].message.content == "Fine"
        assert gateway.router.inflight_requests == [0, 0]


def _late_models(state: dict, key: str, seconds: float):
    """A /v1/models handler that answers ``seconds`` late while ``state[key]``."""
    async def models(request):
        if state[key]:
            await asyncio.sleep(seconds)
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return models


async def _count_to(request, tokens: int) -> web.StreamResponse:
    """A chat stream of "0 1 2 ...", one token every 0.1 s."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(tokens):
        chunk = {"choices": [{"index": 0, "delta": {"content": f"{i} "},
                              "finish_reason": None if i < tokens - 1 else "length"}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(0.1)
    await resp.write(b"data: [DONE]\n\n")
    return resp


@contextlib.asynccontextmanager
async def _probed_quickly(model_dir, models, chat, interval: float, read_timeout_s: float = 300.0):
    """A gateway over one scripted upstream, probing it every ``interval`` with 0.3 s
    timeouts, two failures opening the breaker: its replica and a function that
    streams "count" through the SDK and returns the text."""
    upstream = await _scripted_upstream(models, chat)
    config = tiny_config(model_dir, [ReplicaConfig(kind="openai", url=upstream.url, read_timeout_s=read_timeout_s)],
                         router=RouterConfig(health_interval_s=interval, health_timeout_s=0.3, breaker_failures=2))
    app = create_app(config)
    gw = await start_server(app)
    client = _client(gw.url)

    async def count() -> str:
        parts = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                                     stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in parts if c.choices])

    try:
        replica = app[GATEWAY].replicas[0]
        await wait_for(lambda: replica.healthy, what="healthy")
        yield replica, count
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()


async def test_a_replica_too_busy_for_its_probes_stays_in_routing_while_its_answers_flow(tiny_model_dir):
    """Probes that time out while the replica's streams keep producing tokens
    are a busy replica's, not a dead one's: it stays in routing and new requests
    are served.  It left routing, and with every replica of an overloaded fleet
    late on its probes together, every new request was a 503.  Once its answers
    stop, the same late probes take it out.  (A hung replica's streams, silent
    since its probes began failing, are cut:
    test_upstream_cut_or_hung_mid_stream_ends_with_error_event_then_rejoins.)"""
    state = {"slow": False}

    async def chat(request):
        await request.read()
        state["slow"] = True
        return await _count_to(request, 30)

    async with _probed_quickly(tiny_model_dir, _late_models(state, "slow", 2), chat, 0.1) as (replica, count):
        first = asyncio.create_task(count())
        await asyncio.sleep(1.5)  # ~5 probes late by now, the stream half done
        second = await count()  # sent while the probes fail: served, not a 503
        assert await first == second == "".join(f"{i} " for i in range(30))
        assert replica.trips == 0 and replica.healthy
        # Its answers over, the late probes are a failure again.
        await wait_for(lambda: not replica.healthy, timeout=5, what="out of routing once silent")
        assert replica.trips == 1


async def test_a_replica_that_takes_no_new_work_leaves_routing_though_one_stream_flows(tiny_model_dir):
    """Late probes are excused while the replica's answers flow (a busy replica's), but
    not while a request sent there waits without output past the breaker's own time
    to notice a hung replica: a server taking no new work, with one old stream still
    flowing, stayed in routing and every request sent there waited read_timeout_s
    for nothing (uncounted: others' output flowed).  Its flowing stream is spared."""
    state = {"wedged": False}

    async def chat(request):
        await request.read()
        if state["wedged"]:
            await asyncio.sleep(3600)  # its server takes nothing new
        state["wedged"] = True  # from now on only this stream goes on
        return await _count_to(request, 120)  # 12 s of output

    async with _probed_quickly(tiny_model_dir, _late_models(state, "wedged", 3600), chat, 0.2,
                               read_timeout_s=1.5) as (replica, count):
        flowing = asyncio.create_task(count())
        await wait_for(lambda: state["wedged"], what="wedged")
        began = time.monotonic()
        # New requests meanwhile: each waits out read_timeout_s on a replica that takes none.
        for _ in range(2):
            with pytest.raises(openai.APIStatusError):
                await count()
        # It leaves routing (its flowing stream is spared).
        await wait_for(lambda: not replica.healthy, timeout=8 - (time.monotonic() - began),
                       what="out of routing though one stream flows")
        assert await flowing == "".join(f"{i} " for i in range(120))


async def test_a_busy_replica_whose_queue_outlasts_the_breaker_time_but_keeps_starting_requests_stays(tiny_model_dir):
    """A deep queue (each request waiting longer than the breaker takes to notice a
    hung replica) while the replica keeps starting requests is a busy replica's:
    its late probes are excused and nothing is cut or retried."""
    slot = asyncio.Semaphore(1)  # one request served at a time: the rest queue, FIFO
    state = {"busy": False}

    async def chat(request):
        await request.read()
        async with slot:
            state["busy"] = True
            return await _count_to(request, 6)  # 0.6 s of output each

    # Threshold: 2 x (0.1 + 0.3) = 0.8 s; the 5th request queues ~2.4 s while output flows all along.
    async with _probed_quickly(tiny_model_dir, _late_models(state, "busy", 2), chat, 0.1) as (replica, count):
        got = await asyncio.gather(*(count() for _ in range(5)), return_exceptions=True)
        assert got == ["0 1 2 3 4 5 "] * 5, got
        assert replica.trips == 0, "a busy replica that keeps starting its queued requests left routing"


async def test_more_than_a_hundred_streams_on_one_replica_all_reach_it_and_its_probes_stay_on_time(tiny_model_dir):
    """Every request in flight holds a connection to its replica, and the gateway's
    connections to a replica were capped at aiohttp's default 100 a session: the
    101st request on one replica (a vLLM server batches 256 and more) waited in the
    gateway, unseen by the server's scheduler, and so did the health probes behind
    it: a replica busy with long streams, flowing all along, timed out its probes,
    left routing, and the requests waiting in the gateway were cut (503s)."""
    state = {"open": 0, "most": 0}

    async def chat(request):
        await request.read()
        state["open"] += 1
        state["most"] = max(state["most"], state["open"])
        try:
            return await _count_to(request, 20)  # 2 s of output
        finally:
            state["open"] -= 1

    upstream = await _scripted_upstream(_late_models({"late": False}, "late", 0), chat)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                         router=RouterConfig(health_interval_s=0.1, health_timeout_s=0.3, breaker_failures=2))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "stream": True}
    try:
        async with serving(create_app(config)) as (app, gw, _):
            replica = app[GATEWAY].replicas[0]
            await wait_for(lambda: replica.healthy, what="healthy")

            async def count(session):
                async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        return resp.status
                    events = await sse_events(resp)
                    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                                   if isinstance(e, dict) and e.get("choices"))

            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                got = await asyncio.wait_for(asyncio.gather(*(count(session) for _ in range(120))), 30)
            assert got == ["".join(f"{i} " for i in range(20))] * 120, sorted(set(map(str, got)))
            assert state["most"] == 120, f"the replica saw at most {state['most']} of 120 requests at once"
            assert replica.trips == 0, "a replica whose answers flowed left routing"
    finally:
        await upstream.stop()


class _TwoProbesSession:
    """The replica's HTTP session, for its probes: the first GET waits for
    ``release`` and answers 500; the next one times out."""

    def __init__(self):
        self.release = asyncio.Event()
        self.calls = 0

    @contextlib.asynccontextmanager
    async def get(self, *args, **kwargs):
        self.calls += 1
        if self.calls > 1:
            raise asyncio.TimeoutError()
        await self.release.wait()
        yield web.Response(status=500)


async def test_a_probe_answered_500_is_not_excused_by_another_probes_timeout():
    """The health loop's probe and a loss check's can overlap: a probe answered 500
    read the timeout the other one set meanwhile, and with output flowing was
    excused as a busy replica's late probe."""
    replica = RemoteReplica(ReplicaConfig(kind="openai", url="http://127.0.0.1:9"), RouterConfig(),
                            ReplicaInfo("m", 16, "m", 2048))
    replica._session = _TwoProbesSession()
    asked = time.monotonic()
    health = asyncio.create_task(replica._probe())  # the health loop's, waiting for its answer
    await asyncio.sleep(0)
    assert not await replica._probe()  # a loss check's, timed out
    replica._last_output = time.monotonic()  # a stream's output meanwhile
    replica._session.release.set()
    assert not await health  # answered 500
    assert not replica._busy_since(asked), "a 500 from the probe was excused as a busy replica's late probe"


async def test_a_non_streaming_answer_cut_by_a_stopping_engine_starts_over_on_another(tiny_model_dir):
    """A `kvgate engine` past its drain time ends its streams with a 503
    server_shutting_down event: a non-streaming answer (nothing sent yet) starts
    over on another replica, and the stopping one is not counted as failing."""
    error = {"error": {"message": "The server is shutting down; retry the request.", "type": "service_unavailable",
                       "param": None, "code": "server_shutting_down"}}
    state = {"mode": "cut", "cut": 0, "refuse": 0}

    async def stopping(request):
        await request.read()
        state[state["mode"]] += 1
        if state["mode"] == "refuse":  # refusing new work (its server stopping): a 503 before any output
            return web.json_response(error, status=503)
        chunk = {"choices": [{"index": 0, "delta": {"content": "Half"}, "finish_reason": None}]}
        return web.Response(body=_sse(chunk, error) + b"data: [DONE]\n\n", content_type="text/event-stream")

    router = RouterConfig(policy="round-robin", health_interval_s=60, breaker_failures=1)
    async with _gateway_over_pair(tiny_model_dir, stopping, _answer_fine, ("stopping", "good"), router) as (
            gateway, url, client, _):
        for mode in ("cut", "refuse"):
            state["mode"] = mode
            for _ in range(3):  # round-robin: some start on the stopping replica
                out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
                assert out.choices[0].message.content == "Fine"
            assert state[mode] >= 1
        state["mode"], ended = "cut", []
        for _ in range(3):  # a stream already under way says why it ended
            try:
                parts = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                             stream=True)
                async for _ in parts:
                    pass
            except openai.APIError as exc:
                ended.append((exc.code, exc.message))
        # The code a client can act on (retry elsewhere), not a generic upstream error.
        assert ended and all(code == "server_shutting_down" and "shutting down" in message
                             and "incomplete" in message for code, message in ended)
        assert gateway.replicas[0].trips == 0
        # A rolling restart is not a replica failure on the dashboards either.
        assert await metric_by_replica(url, "kvgate_replica_failures_total") == {"stopping": 0.0, "good": 0.0}


async def test_an_engine_that_refuses_the_gateways_key_is_named_once(tiny_model_dir, caplog):
    """An engine with API keys answers /health without one, so only its KV
    events refuse a gateway that has the wrong key: a warning naming the
    setting, once, not an INFO resync line every two seconds."""
    caplog.set_level(logging.INFO, logger="gateway.replicas")
    engine, server = await _engine_server(tiny_model_dir, api_keys=[ApiKeyConfig(key="sk-engine")])
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=server.url, api_key="sk-wrong")]))
    gw = await start_server(app)
    try:
        await wait_for(lambda: any("refuses the gateway's key" in r.message for r in caplog.records),
                       what="the warning")
        await asyncio.sleep(2.5)  # a retry or two later
        refused = [r for r in caplog.records if "refuses the gateway's key" in r.message]
        assert len(refused) == 1 and refused[0].levelname == "WARNING" and "api_key" in refused[0].message
        assert not [r for r in caplog.records if "resyncing" in r.message]
        assert not app[GATEWAY].replicas[0].healthy
    finally:
        await gw.stop()
        await server.stop()


async def test_an_openai_server_given_as_an_engine_is_named_once(tiny_model_dir, caplog):
    """vLLM behind `--replica http://...` (no openai+): it has no /kv_events, so
    it never joins; a warning says what it is and what to write instead, once,
    not an INFO resync line every two seconds."""
    caplog.set_level(logging.INFO, logger="gateway.replicas")
    upstream = await _scripted_upstream(_models_while({"healthy": True}), _answer_fine)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=upstream.url, connect_timeout_s=0.5)]))
    gw = await start_server(app)
    try:
        await wait_for(lambda: any("no /kv_events" in r.message for r in caplog.records), what="the warning")
        await asyncio.sleep(2.5)  # a retry or two later
        named = [r for r in caplog.records if "no /kv_events" in r.message]
        assert len(named) == 1 and named[0].levelname == "WARNING", named
        assert "kind: openai" in named[0].message and "--replica openai+http://127.0.0.1:" in named[0].message
        assert not [r for r in caplog.records if "resyncing" in r.message]
        assert not app[GATEWAY].replicas[0].healthy
    finally:
        await gw.stop()
        await upstream.stop()


async def test_an_engine_key_from_the_environment_is_sent_to_the_engine(tiny_model_dir, monkeypatch):
    """replicas[].api_key_env: the gateway reads the engine's key from the
    variable (as the Kubernetes manifests give it from a Secret) and sends it
    with its requests, stats polls and KV event stream: the engine joins routing
    and serves."""
    monkeypatch.setenv("KVGATE_TEST_ENGINE_KEY", "sk-engine")
    engine, server = await _engine_server(tiny_model_dir, api_keys=[ApiKeyConfig(key="sk-engine")])
    replicas = [ReplicaConfig(kind="engine", url=server.url, api_key_env="KVGATE_TEST_ENGINE_KEY")]
    try:
        async with serving(create_app(tiny_config(tiny_model_dir, replicas))) as (app, gw, client):
            replica = app[GATEWAY].replicas[0]
            await wait_for(lambda: replica.healthy, what="the keyed engine in routing")
            out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=3)
            assert out.usage.completion_tokens >= 1 and replica.healthy
            # Its figures, polled from /kvgate/stats with the key (the dashboards' KV panels, the alarms).
            async with aiohttp.ClientSession() as session:
                async with session.get(gw.url + "/metrics") as resp:
                    scrape = await resp.text()
            assert f'kvgate_kv_cache_blocks{{replica="{replica.name}",state="cached",tier="device"}}' in scrape
            assert f'kvgate_reuse_alarm{{replica="{replica.name}"}}' in scrape
    finally:
        await server.stop()


async def test_a_non_streaming_answer_cut_with_nowhere_to_restart_is_still_recorded(tiny_model_dir, tmp_path):
    """A non-streaming answer whose replica dies mid-answer starts over
    elsewhere, and that restart is the request's one record; with no replica left
    the client gets the error, and the recording still has the request, whose
    prompt the first replica cached (a next turn's parent must be there)."""
    async def dying(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}))
        await asyncio.sleep(0.1)
        request.transport.close()  # gone mid-answer: no [DONE]
        return resp

    upstream = await _scripted_upstream(_models_while({"healthy": True}), dying)
    path = tmp_path / "served.jsonl"
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="dying")],
                         router=RouterConfig(health_interval_s=60), record_trace=str(path))
    try:
        async with serving(create_app(config)) as (app, _, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 40}])
            assert info.value.status_code == 503
    finally:
        await upstream.stop()
    (line,) = [json.loads(text) for text in path.read_text().splitlines()]
    assert line["input_length"] > 40 and line["hash_ids"]


async def test_a_restart_that_ends_empty_leaves_one_record(tiny_model_dir, tmp_path):
    """The first replica is cut mid-answer, the restart's replica ends its
    stream at once (an empty choice's finish, then [DONE]): one request, one record."""
    calls = []

    async def scripted(request):
        await request.read()
        calls.append(1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if len(calls) == 1:  # cut mid-answer
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}))
            await asyncio.sleep(0.1)
            request.transport.close()
            return resp
        await resp.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, b"[DONE]"))
        return resp

    path = tmp_path / "served.jsonl"
    async with _recording_over_two(tiny_model_dir, scripted, path) as (_, _, client):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 40}])
        assert len(calls) == 2
    assert len(path.read_text().splitlines()) == 1


async def test_a_recording_counts_the_prompt_as_its_block_ids_do(tiny_model_dir, tmp_path):
    """An external server counts the prompt with its own tokenizer and template:
    its count as input_length, beside block ids from the gateway's tokens, made
    lines replay warned about (14,023 of 51,293 in a soak).  The gateway's count
    is what the ids count."""
    async def chat(request):
        await request.read()
        answer = {"choices": [{"index": 0, "delta": {"content": "Fine"}, "finish_reason": "stop"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        return web.Response(body=_sse(answer, usage, b"[DONE]"), content_type="text/event-stream")

    path = tmp_path / "served.jsonl"
    async with _recording_over_two(tiny_model_dir, chat, path) as (_, _, client):
        answer = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 40}])
        assert answer.usage.prompt_tokens == 3  # the client is told the server's count
    (line,) = [json.loads(text) for text in path.read_text().splitlines()]
    assert line["input_length"] > 40 and len(line["hash_ids"]) == -(-line["input_length"] // 16)


@contextlib.asynccontextmanager
async def _recording_over_two(model_dir, chat, path):
    """A gateway recording to ``path`` over two scripted upstreams answering with
    ``chat``, both in routing: (app, gateway server, client)."""
    upstreams = [await _scripted_upstream(_models_while({"healthy": True}), chat) for _ in range(2)]
    config = tiny_config(model_dir, [ReplicaConfig(kind="openai", url=u.url, name=f"r{i}")
                                     for i, u in enumerate(upstreams)],
                         router=RouterConfig(health_interval_s=60), record_trace=str(path))
    try:
        async with serving(create_app(config)) as (app, gw, client):
            await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="healthy")
            yield app, gw, client
    finally:
        for upstream in upstreams:
            await upstream.stop()


def test_a_breaker_trip_spares_streams_by_the_run_of_failures_that_tripped_it(monkeypatch):
    """A request that failed long ago, with none since to forgive it, used to date a
    later run of probe failures: every stream with output in the hour between was
    spared, hung ones included."""
    import gateway.replicas as replicas

    now = [1000.0]
    monkeypatch.setattr(replicas.time, "monotonic", lambda: now[0])
    replica = RemoteReplica(ReplicaConfig(url="http://127.0.0.1:9", kind="openai"), RouterConfig(breaker_failures=2),
                            ReplicaInfo("m", 16, "m", 4096))

    class Stream:
        closed = False

        def close(self):
            self.closed = True

    hung, served = Stream(), Stream()
    replica.note_request_failure()  # one failed request at t=1000; the breaker needs two
    now[0] = 4600.0
    replica._note_failure(probe=True)  # the replica stops answering probes an hour later
    replica._live.update({hung: 1100.0, served: 4600.5})  # hung since 1100; output after the probes began failing
    now[0] = 4601.0
    replica._note_failure(probe=True)
    assert replica.breaker_open and not replica.healthy
    assert hung.closed and not served.closed


async def test_engines_of_different_context_lengths_hold_requests_to_the_shortest(tiny_model_dir, caplog):
    """An engine on a smaller KV pool (or model.max_model_len) serves shorter
    contexts: the gateway holds every request to what all its engines serve, and
    says so, instead of keeping the first engine's length and routing a request
    that fits one engine only to the other, which answers 400."""
    (_, long_server), (_, short_server) = [await _engine_server(tiny_model_dir, max_model_len=length)
                                           for length in (1024, 256)]
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=s.url) for s in (long_server, short_server)],
                         router=RouterConfig(policy="round-robin", health_interval_s=0.1))
    try:
        await _requests_held_to(config, 256, prompt=[5] * 300, max_tokens=2, caplog=caplog)
    finally:
        await long_server.stop()
        await short_server.stop()


async def test_a_short_context_engine_restarted_longer_raises_the_limit_again(tiny_model_dir):
    """The limit is the shortest each engine last said, not the shortest ever
    seen: after one rolling restart with a smaller KV pool it stayed down until
    the gateway itself restarted."""
    _, long_server = await _engine_server(tiny_model_dir, max_model_len=1024)
    _, short_server = await _engine_server(tiny_model_dir, max_model_len=256)
    port = int(short_server.url.rsplit(":", 1)[1])
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=s.url) for s in (long_server, short_server)],
                         router=RouterConfig(health_interval_s=0.1))
    app = create_app(config)
    gw = await start_server(app)
    client = _client(gw.url)
    restarted = None
    try:
        gateway = app[GATEWAY]
        await wait_for(lambda: all(r.healthy for r in gateway.replicas), what="every replica in routing")
        assert gateway.max_model_len == 256
        await short_server.stop()
        await wait_for(lambda: not gateway.replicas[1].healthy, what="the short engine out of routing")
        restarted = await start_server(create_app(tiny_config(tiny_model_dir, max_model_len=1024), engine_mode=True),
                                       port=port)
        await wait_for(lambda: gateway.replicas[1].healthy, timeout=30, what="the restarted engine back")
        assert gateway.max_model_len == 1024
        assert (await client.models.list()).data[0].model_extra["max_model_len"] == 1024
        assert (await client.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=2)).choices
    finally:
        await client.close()
        await gw.stop()
        await long_server.stop()
        if restarted is not None:
            await restarted.stop()


async def _requests_held_to(config, shortest: int, prompt: list[int], max_tokens: int, caplog) -> None:
    """A gateway over replicas of different context lengths says it serves
    ``shortest``, refuses a request past it (twice: round-robin would have
    reached each replica) and has logged why."""
    app = create_app(config)
    gw = await start_server(app)
    client = _client(gw.url)
    try:
        gateway = app[GATEWAY]
        await wait_for(lambda: all(r.healthy for r in gateway.replicas), what="every replica in routing")
        assert gateway.max_model_len == shortest
        assert (await client.models.list()).data[0].model_extra["max_model_len"] == shortest
        for _ in range(2):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
            assert f"maximum context length is {shortest} tokens" in info.value.message
        assert any(f"requests are held to {shortest}, what every replica serves" in r.getMessage()
                   for r in caplog.records)
    finally:
        await client.close()
        await gw.stop()


@pytest.mark.parametrize("lengths", [(1800, 1024), (1024, 1800)])
async def test_external_servers_of_different_context_lengths_hold_requests_to_the_shortest(tiny_model_dir, caplog,
                                                                                           lengths):
    """An all-external fleet (vLLM servers of different --max-model-len) serves
    what every server serves, whichever answered first, and says so: the
    gateway used to take one server's length, and a request longer than the
    other's went there and got its 400."""
    def upstream(length):
        async def models(request):
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                                  "max_model_len": length}]})
        return _scripted_upstream(models, _answer_fine)

    servers = [await upstream(length) for length in lengths]
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=s.url) for s in servers],
                         router=RouterConfig(policy="round-robin", health_interval_s=0.1))
    try:
        await _requests_held_to(config, 1024, prompt=[5] * 100, max_tokens=1000, caplog=caplog)
    finally:
        for server in servers:
            await server.stop()


_REFUSALS = {
    # vLLM before 0.10 and SGLang: the error's fields at the top level.
    "flat": (400, {"object": "error", "message": "This model's maximum context length is 2048 tokens.",
                   "type": "BadRequestError", "param": None, "code": 400},
             "This model's maximum context length is 2048 tokens."),
    # FastAPI's own validation error, before the server's handler runs.
    "fastapi": (422, {"detail": [{"loc": ["body", "top_logprobs"], "msg": "less than or equal to 20",
                                  "type": "value_error"}]}, "top_logprobs: less than or equal to 20"),
    # An ingress in front of the server, with its HTML page.
    "html": (413, "<html><body><h1>413 Request Entity Too Large</h1></body></html>",
             "The model server refused the request: 413 Request Entity Too Large."),
}


@pytest.mark.parametrize("shape", sorted(_REFUSALS))
async def test_a_refusal_in_another_shape_is_the_requests_not_the_replicas(tiny_model_dir, shape):
    """A 4xx whose body is not OpenAI's {"error": {...}} (older vLLM, SGLang,
    FastAPI, a proxy) is still the request's fault: the client gets it, in
    OpenAI's shape, at once, and no replica is blamed.  It used to count as the
    replica failing: a few such requests took every replica out of routing and
    every client got 503s."""
    status, body, message = _REFUSALS[shape]
    calls = []

    async def refuse(request):
        await request.read()
        calls.append(request.url.port)
        if isinstance(body, str):
            # The proxy's own status line, as nginx words it: not aiohttp's default, which
            # is Python's phrase for the status (413 "Content Too Large" from Python 3.13).
            return web.Response(text=body, status=status, reason="Request Entity Too Large", content_type="text/html")
        return web.json_response(body, status=status)

    router = RouterConfig(policy="round-robin", health_interval_s=0.1, breaker_failures=2)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, refuse, refuse, ("a", "b"), router) as (gateway, _, client, _):
        for _ in range(5):
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
            assert info.value.status_code == status and info.value.body["message"] == message
            assert info.value.type in ("BadRequestError", "invalid_request_error")
        assert len(calls) == 5  # none retried on the other replica
        assert all(r.healthy for r in gateway.replicas) and not any(r.trips for r in gateway.replicas)


async def test_a_flat_error_event_mid_stream_reaches_the_client(tiny_model_dir):
    """An error event in the flat shape (older vLLM) after some output: the
    client's stream ends with it, rather than as a short answer that looks whole."""
    async def fail_mid_stream(request):
        await request.read()
        first = {"choices": [{"index": 0, "delta": {"content": "Par"}, "finish_reason": None}]}
        error = {"object": "error", "message": "generation failed", "type": "BadRequestError", "param": None,
                 "code": 400}
        return web.Response(body=_sse(first, error, b"[DONE]"), content_type="text/event-stream")

    router = RouterConfig(policy="round-robin", health_interval_s=0.1)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, fail_mid_stream, fail_mid_stream, ("a", "b"), router) as (
            gateway, _, client, _):
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True)
        text = ""
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        assert text == "Par" and "generation failed" in info.value.message


async def test_one_dropped_connection_cuts_only_its_own_stream(tiny_model_dir):
    """A replica's connection for one stream breaks mid-answer (a proxy's timeout,
    a reset) while its other streams keep producing: that stream ends with an
    error event; the replica, answering the probe the loss sends, stays in
    routing, and its other streams run to their end.  They used to be cut with
    it (all those whose last token came before the failed stream's last), and the
    replica left routing."""
    async def chat(request):
        body = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        failing = b"FAIL" in body
        for i in range(2 if failing else 20):
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": f"{i} "}, "finish_reason": None}]}))
            await asyncio.sleep(0.05)
        if failing:
            request.transport.close()  # this connection only
            return resp
        await resp.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, b"[DONE]"))
        return resp

    async with _gateway_over_one(tiny_model_dir, chat, RouterConfig(health_interval_s=0.1)) as (_, _, client, replica):
        async def read(content):
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                          max_tokens=30, stream=True)
            text, finish = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            return text, finish

        served = asyncio.create_task(read("a long answer"))
        await asyncio.sleep(0.2)  # it is producing
        with pytest.raises(openai.APIError) as info:
            await read("FAIL")
        assert "failed mid-request" in info.value.message
        assert await served == ("".join(f"{i} " for i in range(20)), "stop")
        assert replica.trips == 0 and replica.healthy


async def test_an_external_servers_token_ids_are_its_own_to_judge(tiny_model_dir):
    """An all-external fleet serves a model whose vocabulary the gateway does not
    know (a file-less gateway tokenises with the bundled model's, 49,152 ids):
    token ids past it (Qwen's <|im_end|>, 151645) go to the server as sent.
    They used to be refused with a 400 no vLLM would give."""
    received = []

    async def chat(request):
        received.append(await request.json())
        return await _answer_fine(request)

    router = RouterConfig(health_interval_s=0.1)
    async with _gateway_over_pair(tiny_model_dir, chat, chat, ("a", "b"), router) as (gateway, _, client, _):
        assert gateway.hasher.vocab_size < 151645
        out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   logit_bias={"151643": -100},
                                                   extra_body={"stop_token_ids": [151645]})
        assert out.choices[0].message.content == "Fine"
        assert received[0]["logit_bias"] == {"151643": -100} and received[0]["stop_token_ids"] == [151645]


async def test_an_echoed_prompts_first_token_keeps_its_null_logprob(tiny_model_dir):
    """echo with logprobs on an external server: the prompt's first token has no
    logprob (null, as vLLM and OpenAI send it); it used to reach the client as
    0.0, a certainty, with itself as its one top alternative."""
    async def completions(request):
        await request.read()
        logprobs = {"tokens": ["hell", "o", " there"], "token_logprobs": [None, -0.5, -1.25],
                    "top_logprobs": [None, {"o": -0.5}, {" there": -1.25}], "text_offset": [0, 4, 5]}
        chunk = {"choices": [{"index": 0, "text": "hello there", "logprobs": logprobs, "finish_reason": "length"}]}
        return web.Response(body=_sse(chunk, b"[DONE]"), content_type="text/event-stream")

    upstream = await _completions_upstream(_models_while({"healthy": True}), completions)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                                 router=RouterConfig(health_interval_s=0.1)))
    try:
        async with serving(app) as (app, _, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
            out = await client.completions.create(model=MODEL, prompt="hell", max_tokens=1, echo=True, logprobs=1)
            lp = out.choices[0].logprobs
            assert lp.tokens == ["hell", "o", " there"]
            assert lp.token_logprobs == [None, -0.5, -1.25]
            assert lp.top_logprobs == [None, {"o": -0.5}, {" there": -1.25}]
    finally:
        await upstream.stop()


async def test_a_plain_text_500_is_a_failed_answer_not_a_missing_replica(tiny_model_dir):
    """A server that answers a bare "Internal Server Error" (no JSON) for one
    request: it is tried on the other replica, and, failed everywhere, the
    client gets that 500, not a 503 saying no replica is healthy; no replica
    leaves routing over a request that fails everywhere."""
    async def fail(request):
        await request.read()
        return web.Response(status=500, text="Internal Server Error")

    router = RouterConfig(policy="round-robin", health_interval_s=0.1, breaker_failures=2)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, fail, fail, ("a", "b"), router) as (gateway, _, client, _):
        for _ in range(3):
            with pytest.raises(openai.InternalServerError) as info:
                await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
            assert info.value.status_code == 500
            assert info.value.body["message"] == "The model server failed the request: 500 Internal Server Error."
        assert all(r.healthy for r in gateway.replicas) and not any(r.trips for r in gateway.replicas)


def _models_of_length(length: int):
    """A /v1/models handler listing MODEL with vLLM's max_model_len."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": length}]})

    return models


async def test_a_default_max_tokens_leaves_room_for_the_tools(tiny_model_dir):
    """Tools are rendered into the server's prompt, but the gateway counts the
    messages only: a default max_tokens that filled the rest of the context by
    that count overflowed it, and vLLM answered 400 to a request it would have
    served without kvgate.  The gateway's limit is sent only where it leaves room
    for the tools' tokens too; past that the server fills the room itself."""
    received = []

    async def chat(request):
        received.append(await request.json())
        return await _answer_fine(request)

    upstream = await _scripted_upstream(_models_of_length(2048), chat)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                         router=RouterConfig(health_interval_s=0.1))
    config.server.limits.max_tokens = 1500
    app = create_app(config)
    tool = {"type": "function", "function": {"name": "lookup", "description": "a long manual " * 150,
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        async with serving(app) as (app, _, client):
            gateway = app[GATEWAY]
            await wait_for(lambda: gateway.replicas[0].healthy and gateway.max_model_len == 2048, what="learnt")
            tool_tokens = len(gateway.hasher.tokenizer.encode(str(tool)))
            assert 2048 - tool_tokens < 1500
            messages = [{"role": "user", "content": "hi"}]
            await client.chat.completions.create(model=MODEL, messages=messages, tools=[tool])
            assert "max_tokens" not in received[0]  # the limit would overflow: the server's own default
            await client.chat.completions.create(model=MODEL, messages=messages)  # no tools: the limit fits
            assert received[1]["max_tokens"] == 1500
    finally:
        await upstream.stop()


async def test_a_default_past_the_estimated_room_is_the_external_servers_to_judge(tiny_model_dir):
    """A completions request without max_tokens in front of external servers: the
    gateway's count of a text prompt may be an estimate (a file-less gateway counts
    with SmolLM2's tokenizer, deploy/vllm.md), so a default past the room it counts is
    sent without max_tokens, for the server's own default and exact count to judge,
    rather than refused by the estimate."""
    received = []

    async def completions(request):
        received.append(await request.json())
        chunk = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
        return web.Response(body=b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n",
                            content_type="text/event-stream")

    upstream = await _completions_upstream(_models_of_length(64), completions)
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


async def test_an_external_servers_stop_reason_reaches_the_client(tiny_model_dir):
    """vLLM's stop_reason (the stop string or token id that ended a choice) passes
    through, streamed and not; it used to be dropped."""
    async def chat(request):
        await request.read()
        first = {"choices": [{"index": 0, "delta": {"content": "Thought: done"}, "finish_reason": None}]}
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "Observation:"}]}
        return web.Response(body=_sse(first, end, b"[DONE]"), content_type="text/event-stream")

    router = RouterConfig(health_interval_s=0.1)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, chat, chat, ("a", "b"), router) as (gateway, _, client, _):
        whole = await client.chat.completions.create(model=MODEL, messages=messages, stop=["Observation:"])
        assert whole.choices[0].model_extra["stop_reason"] == "Observation:"
        stream = await client.chat.completions.create(model=MODEL, messages=messages, stop=["Observation:"],
                                                      stream=True)
        last = [c async for c in stream][-1].choices[0]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == "Observation:"


async def test_prompt_logprobs_are_refused_with_the_reason_and_a_refusal_has_null_content(tiny_model_dir):
    """prompt_logprobs: the gateway streams every request from its replicas, and
    vLLM refuses them to streams, so the client got vLLM's 400 about a stream it
    never asked for; now the gateway's own 400 says why.  And a turn that only
    refuses has null content, as OpenAI's."""
    calls = []

    async def chat(request):
        calls.append(await request.json())
        chunk = {"choices": [{"index": 0, "delta": {"refusal": "I can't help with that."}, "finish_reason": "stop"}]}
        return web.Response(body=_sse(chunk, b"[DONE]"), content_type="text/event-stream")

    router = RouterConfig(health_interval_s=0.1)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, chat, chat, ("a", "b"), router) as (gateway, _, client, _):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=messages, extra_body={"prompt_logprobs": 1})
        assert info.value.param == "prompt_logprobs" and "non-streaming requests only" in info.value.message
        assert not calls
        out = await client.chat.completions.create(model=MODEL, messages=messages)
        assert out.choices[0].message.refusal == "I can't help with that."
        assert out.choices[0].message.content is None


async def test_best_of_is_refused_in_front_of_external_servers_too(tiny_model_dir):
    """best_of > n went to the external servers, streamed as every request is, and
    came back as their 400 "cannot be used with stream", which the client never
    asked for; the gateway now refuses it itself, saying why."""
    calls = []

    async def chat(request):
        calls.append(await request.read())
        return await _answer_fine(request)

    async with _gateway_over_pair(tiny_model_dir, chat, chat, ("a", "b"), RouterConfig(health_interval_s=0.1)) as (
            _, _, client, _):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=3)
        assert info.value.param == "best_of" and "best_of results cannot be streamed" in info.value.message
        assert not calls


async def test_an_external_server_that_does_not_say_its_cache_hits_leaves_them_unknown(tiny_model_dir):
    """vLLM reports cached prompt tokens only with --enable-prompt-tokens-details
    (its usage otherwise has null details): the client gets null details as vLLM
    sends them, and the hit-ratio series count no lookup, where both used to read
    a whole-prompt miss (cached_tokens 0)."""
    async def chat(request):
        await request.read()
        answer = {"choices": [{"index": 0, "delta": {"content": "Fine"}, "finish_reason": "stop"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
                                          "prompt_tokens_details": None}}
        return web.Response(body=_sse(answer, usage, b"[DONE]"), content_type="text/event-stream")

    router = RouterConfig(health_interval_s=0.1)
    messages = [{"role": "user", "content": "hi"}]
    async with _gateway_over_pair(tiny_model_dir, chat, chat, ("a", "b"), router) as (gateway, url, client, _):
        whole = await client.chat.completions.create(model=MODEL, messages=messages)
        assert whole.usage.prompt_tokens == 9 and whole.usage.prompt_tokens_details is None
        stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                      stream_options={"include_usage": True})
        last = [c async for c in stream][-1]
        assert last.usage.prompt_tokens == 9 and last.usage.prompt_tokens_details is None
        queries = await metric_by_replica(url, "kvgate_prefix_cache_queries_tokens_total")
        assert sum(queries.values()) == 0
        assert sum((await metric_by_replica(url, "kvgate_prompt_tokens_total")).values()) == 18
        async with aiohttp.ClientSession() as session, session.get(url + "/stats") as r:
            stats = await r.json()
        # Both answered, and each the load of its replica, but in neither side of the hit ratio.
        assert (stats["totals"]["requests"], stats["totals"]["engine_requests"]) == (2, 2)
        assert (stats["totals"]["prompt_tokens"], stats["totals"]["cached_tokens"]) == (0, 0)
        assert sum(sum(p["rps"].values()) for p in stats["history"]) > 0


async def test_a_model_list_of_another_shape_is_said_once_and_requests_still_go(tiny_model_dir, caplog):
    """An external server whose /v1/models cannot be read (here: cards without
    an id) still serves, under the configured name, and the log says why the
    gateway could not learn the server's own name: once, not at every probe."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"object": "model", "name": MODEL}]})

    upstream = await _scripted_upstream(models, _answer_fine)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="ext")],
                         router=RouterConfig(health_interval_s=0.1))
    with caplog.at_level(logging.WARNING, logger="gateway.replicas"):
        gw = await start_server(create_app(config))
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        try:
            reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content == "Fine"
            await asyncio.sleep(0.5)  # several probes, each trying the model list again
        finally:
            await client.close()
            await gw.stop()
            await upstream.stop()
    said = [r.getMessage() for r in caplog.records if "/v1/models" in r.getMessage()]
    assert said == [f"replica ext: cannot read its model name from /v1/models (an answer of another shape); the "
                    f"gateway serves '{MODEL}' meanwhile (set replicas[].model or model.served_name)"], said


async def test_a_failed_attempt_counts_on_the_dashboard_as_on_metrics(tiny_model_dir, tmp_path):
    """A non-streaming answer cut mid-answer starts over elsewhere.  The first
    replica did its prefill and said its hits (vLLM's continuous usage stats),
    and /metrics counts that work; the
    dashboard's totals left it out (its figures drifted from Prometheus's after a
    failover), while the recording keeps one record for the one request."""
    calls = []

    async def scripted(request):
        await request.read()
        calls.append(1)
        first = len(calls) == 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # vLLM's continuous usage stats: the hits come with the first chunk.
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}],
                               "usage": {"prompt_tokens": 48, "completion_tokens": 1,
                                         "prompt_tokens_details": {"cached_tokens": 32 if first else 16}}}))
        if first:  # cut mid-answer
            await asyncio.sleep(0.1)
            request.transport.close()
            return resp
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 48, "completion_tokens": 2,
                                         "prompt_tokens_details": {"cached_tokens": 16}}}, b"[DONE]"))
        return resp

    path = tmp_path / "served.jsonl"
    async with _recording_over_two(tiny_model_dir, scripted, path) as (_, gw, client):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 40}])
        assert len(calls) == 2
        async with aiohttp.ClientSession() as session:
            async with session.get(gw.url + "/stats") as resp:
                totals = (await resp.json())["totals"]
            async with session.get(gw.url + "/metrics") as resp:
                scrape = await resp.text()

    def summed(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines() if line.startswith(name + "{"))

    queries, hits = summed("kvgate_prefix_cache_queries_tokens_total"), summed("kvgate_prefix_cache_hits_tokens_total")
    assert (queries, hits) == (48 + 48, 32 + 16)
    assert (totals["prompt_tokens"], totals["cached_tokens"]) == (queries, hits)
    assert totals["engine_requests"] == 2 and totals["requests"] == 1
    assert len(path.read_text().splitlines()) == 1


async def test_an_external_server_fills_the_room_a_request_without_max_tokens_leaves(tiny_model_dir):
    """A client that sets no max_tokens gets up to the context's end.  The
    gateway sent an external server the room by its own count of the prompt,
    which another tokenizer (vLLM's model, not the bundled one) may put past the
    server's count: a 400 for a request the server takes sent directly.  Now the
    server is sent no max_tokens then; the gateway's own limit, where it is the
    smaller, and the client's are sent as before."""
    bodies: list[dict] = []

    async def chat(request):
        bodies.append(await request.json())
        return await _answer_fine(request)

    upstream = await _scripted_upstream(_models_while({"healthy": True}), chat)
    replicas = [ReplicaConfig(kind="openai", url=upstream.url, name="ext")]
    long_prompt = [{"role": "user", "content": "word " * 300}]  # ~900 of the 1024 tokens: the room binds
    try:
        async with serving(create_app(tiny_config(tiny_model_dir, replicas))) as (app, _, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
            await client.chat.completions.create(model=MODEL, messages=long_prompt)
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
            await client.chat.completions.create(model=MODEL, messages=long_prompt, max_completion_tokens=7)
        limited = tiny_config(tiny_model_dir, replicas)
        limited.server.limits.max_tokens = 64  # the gateway's limit binds: sent, as the server's bound
        async with serving(create_app(limited)) as (app, _, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
            await client.chat.completions.create(model=MODEL, messages=long_prompt)
    finally:
        await upstream.stop()
    assert "max_tokens" not in bodies[0] and "max_completion_tokens" not in bodies[0]
    assert [b.get("max_tokens") for b in bodies[1:]] == [5, 7, 64]


async def test_a_server_that_lists_no_model_leaves_routing_until_it_lists_one(tiny_model_dir):
    """A kvgate gateway in front of another: the one behind, with no engine left,
    answers /v1/models with an empty list and every request with a 503, but
    stayed healthy in front (its /ready and model list said all was well)."""
    state = {"models": [MODEL]}

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in state["models"]]})

    upstream = await _scripted_upstream(models, _answer_fine)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="behind")],
                         router=RouterConfig(health_interval_s=0.1, breaker_failures=1, breaker_reset_s=0.2))
    try:
        async with serving(create_app(config)) as (app, gw, client):
            replica = app[GATEWAY].replicas[0]
            await wait_for(lambda: replica.healthy, what="healthy")
            state["models"] = []
            await wait_for(lambda: not replica.healthy, what="out of routing")
            async with aiohttp.ClientSession() as session:
                async with session.get(gw.url + "/ready") as resp:
                    assert resp.status == 503
            state["models"] = [MODEL]
            await wait_for(lambda: replica.healthy, what="back in routing")
            out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert out.choices[0].message.content == "Fine"
    finally:
        await upstream.stop()


async def test_a_replica_model_its_server_does_not_list_is_said_once(tiny_model_dir, caplog):
    """replicas[].model is the name the server is sent: one it does not list made
    every request a 404 for a model the gateway itself lists, without a word."""
    caplog.set_level(logging.WARNING, logger="gateway.replicas")
    upstream = await _scripted_upstream(_models_while({"healthy": True}), _answer_fine)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="ext", model="other")],
                         router=RouterConfig(health_interval_s=0.1))
    try:
        async with serving(create_app(config)) as (app, _, _):
            await wait_for(lambda: any("not 'other'" in r.getMessage() for r in caplog.records), what="the warning")
            await asyncio.sleep(0.5)  # probes later
    finally:
        await upstream.stop()
    said = [r.getMessage() for r in caplog.records if "not 'other'" in r.getMessage()]
    assert said == [f"replica ext: its /v1/models lists '{MODEL}', not 'other' (replicas[].model), so requests sent "
                    "to it as 'other' will fail"]


async def test_a_request_id_is_the_same_in_every_hop(tiny_model_dir):
    """A client's X-Request-Id names its completion (as vLLM takes it), and the
    gateway sends its completion id on to the server as X-Request-Id (each of
    several prompts its own): a request is found by one id in every hop's log.
    The servers got none, and a client's was ignored."""
    seen: list[str | None] = []

    async def chat(request):
        seen.append(request.headers.get("X-Request-Id"))
        assert request.headers["User-Agent"].startswith("kvgate-gateway/")  # a server's logs tell it from clients
        return await _answer_fine(request)

    async def completions(request):
        seen.append(request.headers.get("X-Request-Id"))
        await request.read()
        chunk = {"choices": [{"index": 0, "text": "Fine", "finish_reason": "stop"}]}
        return web.Response(body=_sse(chunk, b"[DONE]"), content_type="text/event-stream")

    stub = web.Application()
    stub.router.add_get("/v1/models", _models_while({"healthy": True}))
    stub.router.add_post("/v1/chat/completions", chat)
    stub.router.add_post("/v1/completions", completions)
    upstream = await start_server(stub)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="ext")])
    messages = [{"role": "user", "content": "hi"}]
    try:
        async with serving(create_app(config)) as (app, _, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, extra_headers={"X-Request-Id": "trace-42"})
            assert raw.headers["x-request-id"] == raw.parse().id == "chatcmpl-trace-42" == seen[-1]
            # A gateway in front sends its own completion id: its prefix is not doubled.
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt=["a", "b"], max_tokens=2, extra_headers={"X-Request-Id": "chatcmpl-abc"})
            assert raw.parse().id == "cmpl-abc" and sorted(seen[-2:]) == ["cmpl-abc", "cmpl-abc-1"]
            # No id, or one unfit for a log line: the gateway's own, sent on.
            for headers in ({}, {"X-Request-Id": "has space"}, {"X-Request-Id": "x" * 129}):
                out = await client.chat.completions.create(model=MODEL, messages=messages, extra_headers=headers)
                assert out.id.startswith("chatcmpl-") and len(out.id) < 60 and " " not in out.id and out.id == seen[-1]
            # A refused request's answer carries the client's id as sent (it had a random one).
            with pytest.raises(openai.NotFoundError) as info:
                await client.chat.completions.create(model="nope", messages=messages,
                                                     extra_headers={"X-Request-Id": "trace-bad-1"})
            assert info.value.response.headers["x-request-id"] == "trace-bad-1"
    finally:
        await upstream.stop()


async def test_a_gateway_says_what_it_serves_over_which_replicas(tiny_model_dir, caplog):
    """An engine says what it runs once loaded; a gateway over remote replicas said
    only "listening": nothing of its model, context, replicas or keys."""
    from gateway.config import ApiKeyConfig

    caplog.set_level(logging.INFO, logger="gateway.app")
    upstream = await _scripted_upstream(_models_while({"healthy": True}), _answer_fine)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="ext"),
                                          ReplicaConfig(kind="openai", url="http://127.0.0.1:9", name="gone",
                                                        connect_timeout_s=0.5)],
                         api_keys=[ApiKeyConfig(key="sk-a")])
    try:
        async with serving(create_app(config)):
            pass
    finally:
        await upstream.stop()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
    assert said == [f"serving '{MODEL}' (context 1024 tokens) over 2 replicas: ext (openai, in routing), "
                    "gone (openai, not in routing yet); routing prefix-aware; client API keys on (1)"]


async def test_a_response_reaches_an_external_server_as_the_chat_request_it_asks_for(tiny_model_dir):
    """POST /v1/responses in front of OpenAI servers: each gets the chat request
    the response asks for (instructions as the system message, max_output_tokens
    as max_tokens, text.format as response_format), its answer and usage come
    back as a response, and a failure after the first token ends the stream with
    response.failed holding the text so far."""
    seen, state = [], {"fail": False, "finish": "stop", "refuse": False}

    async def answer(request):
        seen.append(await request.json())
        if state["refuse"]:  # a server's own error, in its own words and shape
            return web.json_response({"error": {"message": "'max_tokens' or 'max_completion_tokens' is too large",
                                                 "type": "BadRequestError", "param": ["messages", 0], "code": 400}},
                                     status=400)
        first = {"choices": [{"index": 0, "delta": {"content": "Fi"}, "finish_reason": None}]}
        if state["fail"]:
            error = {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}
            return web.Response(body=_sse(first, error) + b"data: [DONE]\n\n", content_type="text/event-stream")
        last = {"choices": [{"index": 0, "delta": {"content": "ne"}, "finish_reason": state["finish"]}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14,
                                          "prompt_tokens_details": {"cached_tokens": 8}}}
        return web.Response(body=_sse(first, last, usage) + b"data: [DONE]\n\n", content_type="text/event-stream")

    router = RouterConfig(policy="round-robin", health_interval_s=60)
    async with _gateway_over_pair(tiny_model_dir, answer, answer, ("a", "b"), router) as (gateway, _, client, _):
        fmt = {"type": "json_schema", "name": "colour", "schema": {"type": "object"}, "strict": True}
        resp = await client.responses.create(model=MODEL, instructions="Be brief.", input="Name a colour.",
                                             max_output_tokens=20, temperature=0.5, text={"format": fmt},
                                             reasoning={"effort": "low", "summary": "auto"})
        assert resp.status == "completed" and resp.output_text == "Fine" and resp.text.format.type == "json_schema"
        assert (resp.reasoning.effort, resp.reasoning.summary) == ("low", "auto")  # as sent
        assert (resp.usage.input_tokens, resp.usage.input_tokens_details.cached_tokens, resp.usage.output_tokens) == (
            12, 8, 2)
        sent = seen[-1]
        assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Name a colour."}]
        assert (sent["max_tokens"], sent["temperature"], sent["stream"]) == (20, 0.5, True)
        assert sent["response_format"] == {"type": "json_schema", "json_schema": {
            "name": "colour", "schema": {"type": "object"}, "strict": True}}
        assert sent["reasoning_effort"] == "low"  # chat's name, which vLLM's reasoning models read
        assert sent.keys().isdisjoint({"input", "instructions", "text", "max_output_tokens", "reasoning"})
        image = {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"}
        await client.responses.create(model=MODEL, input=[{"role": "user", "content": [image]}])
        assert seen[-1]["messages"][0]["content"] == [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}]

        async with client.responses.stream(model=MODEL, input="Name a colour.") as stream:
            final = await stream.get_final_response()
        assert final.status == "completed" and final.output_text == "Fine"

        state["finish"] = "content_filter"  # the server withheld the rest: incomplete, and why
        filtered = await client.responses.create(model=MODEL, input="Name a colour.")
        assert filtered.status == "incomplete" and filtered.incomplete_details.reason == "content_filter"
        events = [e async for e in await client.responses.create(model=MODEL, input="Name a colour.", stream=True)]
        assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "content_filter"

        state["refuse"] = True  # relayed as the server said it, whatever its param's shape
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model=MODEL, input="Name a colour.")
        assert info.value.body["message"] == "'max_tokens' or 'max_completion_tokens' is too large"
        state["refuse"] = False

        state["fail"] = True
        events = [e async for e in await client.responses.create(model=MODEL, input="Name a colour.", stream=True)]
        assert [e.type for e in events][-2:] == ["response.output_text.delta", "response.failed"]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert "EngineCore died" in failed.error.message
        assert failed.output[0].status == "incomplete" and failed.output[0].content[0].text == "Fi"
        assert gateway.router.inflight_requests == [0, 0]


async def test_function_tools_through_the_responses_api_reach_the_server_as_chat_tools(tiny_model_dir):
    """/v1/responses with function tools in front of a server that parses tool
    calls: the server gets chat's tools, tool_choice and the earlier turns' calls
    and outputs as an assistant's tool_calls and tool messages; its tool calls come
    back as function_call items, whole or streamed as OpenAI's events, in the
    order they began (the text's message first when the answer has text)."""
    seen, state = [], {"text": ""}

    async def calls_a_tool(request):
        seen.append(await request.json())
        begin = {"index": 0, "id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        chunks = [{"choices": [{"index": 0, "delta": {"content": state["text"]}, "finish_reason": None}]}] if state[
            "text"] else []
        chunks += [
            {"choices": [{"index": 0, "delta": {"tool_calls": [begin]}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                          "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                          "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39}},
        ]
        return web.Response(body=_sse(*chunks) + b"data: [DONE]\n\n", content_type="text/event-stream")

    weather = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    router = RouterConfig(policy="round-robin", health_interval_s=60)
    async with _gateway_over_pair(tiny_model_dir, calls_a_tool, calls_a_tool, ("a", "b"), router) as (
            gateway, _, client, _):
        resp = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[weather],
                                             tool_choice={"type": "function", "name": "get_weather"})
        Response.model_validate(resp.to_dict())
        [call] = resp.output
        assert (call.type, call.name, call.arguments, call.call_id) == (
            "function_call", "get_weather", '{"city": "Paris"}', "call_7")
        assert resp.status == "completed" and resp.tools[0].name == "get_weather"
        # A server that counts no reasoning tokens: none said on chat, 0 here (OpenAI's field is required).
        assert resp.usage.output_tokens_details.reasoning_tokens == 0
        sent = seen[-1]
        assert sent["tools"] == [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city.", "parameters": weather["parameters"]}}]
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}

        # The next turn: the call and its output, as the SDK documents for stateless use.
        history = ["Weather in Paris?", *[item.model_dump(exclude_none=True) for item in resp.output],
                   {"type": "function_call_output", "call_id": "call_7", "output": "18 C, sunny"}]
        history[0] = {"role": "user", "content": history[0]}
        state["text"] = "Checking. "
        events = [e async for e in await client.responses.create(model=MODEL, input=history, tools=[weather],
                                                                 stream=True)]
        assert seen[-1]["messages"] == [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "18 C, sunny"},
        ]
        for event in events:
            RESPONSE_EVENT.validate_python(event.to_dict())
        assert [e.type for e in events] == [
            "response.created", "response.in_progress",
            "response.output_item.added", "response.content_part.added", "response.output_text.delta",
            # The message is done as the call begins (one item in progress at a time, as OpenAI streams).
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        assert [item.type for item in final.output] == ["message", "function_call"]
        assert final.output_text == "Checking. " and final.output[1].arguments == '{"city": "Paris"}'
        assert events[11].arguments == '{"city": "Paris"}' and events[11].item_id == final.output[1].id

        async with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[weather]) as stream:
            whole = await stream.get_final_response()  # the SDK's own accumulator takes the events
        assert whole.output[1].arguments == '{"city": "Paris"}'
        assert gateway.router.inflight_requests == [0, 0]


@pytest.mark.parametrize("answer", ["call then text", "calls without index"])
async def test_tool_calls_keep_their_order_and_identity_whole_and_streamed(tiny_model_dir, answer):
    """Output items are listed in the order they began, whole as streamed; calls
    sent without an index are each their own (as chat gathers them); and a streamed
    answer's items handed back in the next turn make a history chat accepts: the
    tool messages right after the one message with the turn's text and calls."""
    seen = []

    def call(name, arguments, **where):
        return {"choices": [{"index": 0, "delta": {"tool_calls": [{**where, "id": f"call_{name}", "type": "function",
                                                                   "function": {"name": name, "arguments": arguments}}]},
                             "finish_reason": None}]}

    async def server(request):
        seen.append(await request.json())
        if answer == "call then text":
            chunks = [call("get_weather", '{"city": "Paris"}', index=0),
                      {"choices": [{"index": 0, "delta": {"content": "Done."}, "finish_reason": None}]}]
        else:
            chunks = [call("get_weather", '{"city": "Paris"}'), call("get_time", "{}")]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        return web.Response(body=_sse(*chunks) + b"data: [DONE]\n\n", content_type="text/event-stream")

    tools = [{"type": "function", "name": "get_weather"}, {"type": "function", "name": "get_time"}]
    router = RouterConfig(policy="round-robin", health_interval_s=60)
    async with _gateway_over_pair(tiny_model_dir, server, server, ("a", "b"), router) as (_, _, client, _):
        whole = await client.responses.create(model=MODEL, input="Weather?", tools=tools)
        events = [e async for e in await client.responses.create(model=MODEL, input="Weather?", tools=tools,
                                                                 stream=True)]
        streamed = events[-1].response
        shape = [(item.type, getattr(item, "name", None), getattr(item, "arguments", None)) for item in whole.output]
        assert shape == [(item.type, getattr(item, "name", None), getattr(item, "arguments", None))
                         for item in streamed.output]
        if answer == "call then text":
            assert shape == [("function_call", "get_weather", '{"city": "Paris"}'), ("message", None, None)]
            history = [{"role": "user", "content": "Weather?"}, *[i.model_dump(exclude_none=True) for i in streamed.output],
                       {"type": "function_call_output", "call_id": "call_get_weather", "output": "18 C"}]
            await client.responses.create(model=MODEL, input=history, tools=tools)
            assert [(m["role"], m["content"]) for m in seen[-1]["messages"]] == [
                ("user", "Weather?"), ("assistant", [{"type": "text", "text": "Done."}]), ("tool", "18 C")]
            assert [c["id"] for c in seen[-1]["messages"][1]["tool_calls"]] == ["call_get_weather"]
        else:
            assert shape == [("function_call", "get_weather", '{"city": "Paris"}'), ("function_call", "get_time", "{}")]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
async def test_reasoning_through_the_responses_api_is_a_reasoning_item_and_goes_back_in_the_next_turn(
        tiny_model_dir, field):
    """A server with a reasoning parser splits a model's thinking off as chat's
    ``reasoning`` (``reasoning_content`` in older vLLM and in SGLang): /v1/responses
    answers it as a reasoning item ahead of the message, whole or streamed as
    OpenAI's reasoning_text events; handed back in the next turn (as the SDK
    documents for stateless use) it reaches the server as the assistant message's
    ``reasoning`` and ``reasoning_content``, before a tool call too, where chat
    templates show a model its earlier thinking."""
    seen = []
    # vLLM counts reasoning tokens where OpenAI does; SGLang at usage's top level.
    counted = ({"completion_tokens_details": {"reasoning_tokens": 5}} if field == "reasoning"
               else {"reasoning_tokens": 5})

    async def thinks(request):
        seen.append(await request.json())
        chunks = [{"choices": [{"index": 0, "delta": {field: piece}, "finish_reason": None}]}
                  for piece in ("The user asks ", "for a colour.")]
        chunks += [{"choices": [{"index": 0, "delta": {"content": "Blue."}, "finish_reason": None}]},
                   {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                   {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
                                             **counted}}]
        return web.Response(body=_sse(*chunks) + b"data: [DONE]\n\n", content_type="text/event-stream")

    router = RouterConfig(policy="round-robin", health_interval_s=60)
    async with _gateway_over_pair(tiny_model_dir, thinks, thinks, ("a", "b"), router) as (gateway, _, client, _):
        whole = await client.responses.create(model=MODEL, input="Name a colour.")
        Response.model_validate(whole.to_dict())
        # The server's count of reasoning tokens (with a reasoning parser) is passed on.
        assert whole.usage.output_tokens_details.reasoning_tokens == 5 and whole.usage.output_tokens == 7
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Colour?"}])
        assert chat.usage.completion_tokens_details.reasoning_tokens == 5
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        assert whole.output[0].content[0].text == "The user asks for a colour." and whole.output_text == "Blue."
        assert whole.output[0].summary == [] and whole.output[0].status == "completed"

        events = [e async for e in await client.responses.create(model=MODEL, input="Name a colour.", stream=True)]
        for event in events:
            RESPONSE_EVENT.validate_python(event.to_dict())
        assert [e.type for e in events] == [
            "response.created", "response.in_progress",
            "response.output_item.added", "response.content_part.added",
            "response.reasoning_text.delta", "response.reasoning_text.delta",
            # The reasoning is done as the answer begins, not at the end.
            "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
            "response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
        assert events[3].part.type == "reasoning_text" and events[6].text == "The user asks for a colour."
        assert events[8].item.status == "completed"
        streamed = events[-1].response
        assert streamed.usage.output_tokens_details.reasoning_tokens == 5
        assert [(i.type, i.model_dump(exclude={"id"})) for i in streamed.output] == [
            (i.type, i.model_dump(exclude={"id"})) for i in whole.output]
        async with client.responses.stream(model=MODEL, input="Name a colour.") as stream:
            accumulated = await stream.get_final_response()  # the SDK's own accumulator takes the events
        assert accumulated.output[0].content[0].text == "The user asks for a colour."

        # The next turn: the SDK hands the reasoning item back with the rest.
        history = [{"role": "user", "content": "Name a colour."}, *[i.model_dump(exclude_none=True) for i in streamed.output],
                   {"role": "user", "content": "Another?"}]
        await client.responses.create(model=MODEL, input=history)
        assert seen[-1]["messages"] == [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": [{"type": "text", "text": "Blue."}],
             "reasoning": "The user asks for a colour.", "reasoning_content": "The user asks for a colour."},
            {"role": "user", "content": "Another?"},
        ]
        # Interleaved with tool calls: the thinking before a call goes with the call's message;
        # reasoning that no answer follows has nowhere to go in chat.
        tools = [{"type": "function", "name": "pick"}]
        history = [{"role": "user", "content": "Pick one."},
                   {"type": "reasoning", "id": "rs_1", "summary": [],
                    "content": [{"type": "reasoning_text", "text": "I should call pick."}]},
                   {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1", "output": "red"},
                   {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "A summary."}]},
                   {"role": "user", "content": "Thanks."}]
        await client.responses.create(model=MODEL, input=history, tools=tools)
        assert seen[-1]["messages"] == [
            {"role": "user", "content": "Pick one."},
            {"role": "assistant", "content": None, "reasoning": "I should call pick.",
             "reasoning_content": "I should call pick.", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "pick", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "red"},
            {"role": "user", "content": "Thanks."},
        ]
        assert gateway.router.inflight_requests == [0, 0]



@pytest.mark.parametrize("answer, items", [
    ("call, text, call", [("function_call", "a"), ("message", "Then "), ("function_call", "b")]),
    ("text, reasoning", [("message", "Hi. "), ("reasoning", "Hmm.")]),
    ("reasoning only", [("reasoning", "Hmm.")]),
    ("reasoning and text at once, then a call", [("reasoning", "Hmm."), ("message", "Hi. "), ("function_call", "a")]),
])
async def test_responses_items_keep_the_order_they_began_in_whole_and_streamed(tiny_model_dir, answer, items):
    """However a server interleaves reasoning, text and tool calls, the whole
    response lists its items as the stream added them; handed back, a turn's
    reasoning listed after its message still goes with that message."""
    seen = []

    def delta(**fields):
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    def call(index, name):
        return delta(tool_calls=[{"index": index, "id": f"call_{name}", "type": "function",
                                  "function": {"name": name, "arguments": "{}"}}])

    script = {
        "call, text, call": [call(0, "a"), delta(content="Then "), call(1, "b")],
        "text, reasoning": [delta(content="Hi. "), delta(reasoning="Hmm.")],
        "reasoning only": [delta(reasoning="Hmm.")],
        "reasoning and text at once, then a call": [delta(reasoning="Hmm.", content="Hi. "), call(0, "a")],
    }[answer]

    async def server(request):
        seen.append(await request.json())
        chunks = [*script, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        return web.Response(body=_sse(*chunks) + b"data: [DONE]\n\n", content_type="text/event-stream")

    def shape(output):
        return [(item.type, getattr(item, "name", None) or (item.content[0].text if item.content else None))
                for item in output]

    tools = [{"type": "function", "name": "a"}, {"type": "function", "name": "b"}]
    router = RouterConfig(policy="round-robin", health_interval_s=60)
    async with _gateway_over_pair(tiny_model_dir, server, server, ("a", "b"), router) as (_, _, client, _):
        whole = await client.responses.create(model=MODEL, input="Go.", tools=tools)
        events = [e async for e in await client.responses.create(model=MODEL, input="Go.", tools=tools, stream=True)]
        for event in events:
            RESPONSE_EVENT.validate_python(event.to_dict())
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert shape(whole.output) == shape(events[-1].response.output) == items
        assert added == [kind for kind, _ in items]
        if answer == "text, reasoning":
            history = [{"role": "user", "content": "Go."}, *[i.model_dump(exclude_none=True) for i in whole.output],
                       {"role": "user", "content": "Again."}]
            await client.responses.create(model=MODEL, input=history)
            assert seen[-1]["messages"][1]["reasoning"] == "Hmm." and seen[-1]["messages"][1]["role"] == "assistant"


@pytest.mark.parametrize("when", ["before its answer", "mid-answer"])
async def test_a_prompt_that_brings_replicas_down_is_not_passed_along_the_fleet(tiny_model_dir, when):
    """A "query of death": the replica running a prompt dies of it (its connection
    breaks while it has the request).  The prompt is tried on at most
    router.lost_attempts replicas, then fails with a 502 naming why, and is refused
    for lost_quarantine_s without reaching a replica, so neither the fleet nor the
    client's retries feed it more replicas; other prompts are served as before."""
    hit = {"a": 0, "b": 0}

    def dies_of_poison(name):
        async def handler(request):
            body = await request.json()
            if "poison" not in body["messages"][-1]["content"]:
                return await _answer_fine(request)
            hit[name] += 1
            if when == "mid-answer":
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}))
            request.transport.close()  # the process is gone: its connections break
            return web.Response()
        return handler

    poison = [{"role": "user", "content": "poison"}]
    router = RouterConfig(policy="round-robin", health_interval_s=60, lost_attempts=1, lost_quarantine_s=60)
    async with _gateway_over_pair(tiny_model_dir, dies_of_poison("a"), dies_of_poison("b"), ("a", "b"), router) as (
            gateway, url, client, _):
        with pytest.raises(openai.APIStatusError) as lost:
            await client.chat.completions.create(model=MODEL, messages=poison, max_tokens=5)
        assert lost.value.status_code == 502 and lost.value.body["code"] == "request_lost"
        assert sum(hit.values()) == 1  # not passed on to the other replica
        for _ in range(2):  # the client's retries
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model=MODEL, messages=poison, max_tokens=5)
            assert refused.value.status_code == 502 and refused.value.body["code"] == "request_quarantined"
            assert "refused for the next" in refused.value.body["message"]
        assert sum(hit.values()) == 1
        # Told not to retry (x-should-retry): an SDK with retries asks once, not three times.
        sent = []
        retrying = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=2, http_client=openai.DefaultAsyncHttpxClient(
            event_hooks={"request": [lambda request: _append(sent, request)]}))
        with pytest.raises(openai.APIStatusError) as refused:
            await retrying.chat.completions.create(model=MODEL, messages=poison, max_tokens=5)
        await retrying.close()
        assert refused.value.body["code"] == "request_quarantined" and len(sent) == 1
        fine = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=5)
        assert fine.choices[0].message.content == "Fine"
        assert gateway.router.inflight_requests == [0, 0]
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as resp:
                scrape = await resp.text()
        assert 'kvgate_requests_lost_total{outcome="failed"} 1.0' in scrape
        assert 'kvgate_requests_lost_total{outcome="refused"} 3.0' in scrape

        # The default (2): one more replica may take it, since a replica can die of
        # something else; the quarantine off: each request tries it anew.
        gateway.router.cfg = gateway.router.cfg.model_copy(update={"lost_attempts": 2, "lost_quarantine_s": 0})
        for r in gateway.replicas:
            r.healthy = True  # back in routing, as if their pods had restarted
        hit.update(a=0, b=0)
        with pytest.raises(openai.APIStatusError) as lost:
            await client.chat.completions.create(model=MODEL, messages=poison + [{"role": "user", "content": "poison 2"}],
                                                 max_tokens=5)
        assert lost.value.body["code"] == "request_lost" and hit == {"a": 1, "b": 1}


async def test_a_prompt_answered_elsewhere_after_its_replica_died_is_never_refused(tiny_model_dir):
    """Replicas dying of something else (out of memory, a node lost) while a canary
    runs, one after the other: each time its request is answered by the other
    replica, which shows the prompt is not what kills them.  It stays served."""
    dies_next = [False]

    def replica(name):
        async def handler(request):
            await request.read()
            if dies_next[0]:  # whichever replica has the request dies
                dies_next[0] = False
                request.transport.close()
                return web.Response()
            return await _answer_fine(request)
        return handler

    router = RouterConfig(policy="round-robin", health_interval_s=60, breaker_failures=1000)
    async with _gateway_over_pair(tiny_model_dir, replica("a"), replica("b"), ("a", "b"), router) as (
            gateway, url, client, _):
        canary = [{"role": "user", "content": "canary"}]
        for _ in range(3):
            dies_next[0] = True
            out = await client.chat.completions.create(model=MODEL, messages=canary, max_tokens=5)
            assert out.choices[0].message.content == "Fine" and not dies_next[0]
            await asyncio.sleep(1.1)  # a replica's losses within a second are one
        out = await client.chat.completions.create(model=MODEL, messages=canary, max_tokens=5)
        assert out.choices[0].message.content == "Fine"
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as resp:
                scrape = await resp.text()
        assert 'kvgate_requests_lost_total{outcome="refused"} 0.0' in scrape


async def test_requests_lost_beside_a_prompt_of_death_are_not_refused(tiny_model_dir):
    """A replica that dies of a prompt takes every request it held with it; those
    move on with the prompt and may die with it again.  Only the prompt common to
    every loss is refused: the others' retries are served."""
    live: dict[str, set] = {"a": set(), "b": set()}
    hits = {"poison": 0}

    def replica(name):
        async def handler(request):
            body = await request.json()
            live[name].add(request.transport)
            try:
                if "poison" in body["messages"][-1]["content"]:
                    hits["poison"] += 1
                    await asyncio.sleep(0.3)  # its prefill; then the process dies:
                    for transport in list(live[name]):  # every connection it holds breaks
                        transport.close()
                    return web.Response()
                await asyncio.sleep(1.0)  # a slow innocent answer
                return await _answer_fine(request)
            finally:
                live[name].discard(request.transport)
        return handler

    async def ask(content):
        try:
            out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                       max_tokens=5)
            return out.choices[0].message.content
        except openai.APIStatusError as exc:
            return exc.body["code"]

    # The scripted servers come straight back: no breaker wait between the rounds.
    router = RouterConfig(policy="round-robin", health_interval_s=60, breaker_failures=1000)
    async with _gateway_over_pair(tiny_model_dir, replica("a"), replica("b"), ("a", "b"), router) as (
            gateway, _, client, _):
        innocents = [asyncio.create_task(ask(f"innocent question {i}")) for i in range(6)]
        await asyncio.sleep(0.1)
        assert await ask("poison") == "request_lost"
        first = await asyncio.gather(*innocents)
        assert set(first) <= {"Fine", "request_lost"}
        answers = []
        for _ in range(4):  # the poison's client retries: refused once singled out
            answers.append(await ask("poison"))
            if answers[-1] == "request_quarantined":
                break
        assert answers[-1] == "request_quarantined" and hits["poison"] <= 4
        for i in range(6):  # the innocents' retries are served
            assert await ask(f"innocent question {i}") == "Fine"
        assert gateway.router.inflight_requests == [0, 0]


async def test_a_dropped_connection_spares_the_streams_the_replica_decodes_beside_it(tiny_model_dir):
    """Six streams decoded in lock-step, a token each per step; one connection is
    reset between two steps.  Only that stream fails: the others, whose last tokens
    came a moment before the reset one's, used to be cut with it (every stream
    whose last output was no later than the failed one's), about half of a busy
    replica's streams for one dropped connection."""
    streams, everyone_in = {}, asyncio.Event()

    async def chat(request):
        order = int((await request.json())["messages"][0]["content"].split()[-1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        streams[order] = (resp, request.transport)
        if len(streams) == 6:
            everyone_in.set()
        with contextlib.suppress(Exception):
            await asyncio.sleep(60)  # the decode loop below writes; this keeps the request open
        return resp

    async def decode_steps():
        await everyone_in.wait()
        for step in range(12):
            last = step == 11
            for resp, transport in streams.values():
                if not transport.is_closing():
                    token = {"choices": [{"index": 0, "delta": {"content": f"t{step} "},
                                          "finish_reason": "stop" if last else None}]}
                    await resp.write(_sse(token, *((b"[DONE]",) if last else ())))
            await asyncio.sleep(0.03)
            if step == 4:
                streams[2][1].abort()  # one connection reset, between two steps
            await asyncio.sleep(0.03)
        for resp, _ in streams.values():
            with contextlib.suppress(Exception):
                await resp.write_eof()

    upstream = await _scripted_upstream(_models_while({"healthy": True}), chat)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                                 router=RouterConfig(health_interval_s=60)))
    gw = await start_server(app)
    replica = app[GATEWAY].replicas[0]
    steps = asyncio.create_task(decode_steps())
    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        async with aiohttp.ClientSession() as session:
            async def read(i):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"stream {i}"}], "stream": True}
                async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    events = await sse_events(resp)
                return "error" if any(isinstance(e, dict) and "error" in e for e in events) else "whole"

            readers = []
            for i in range(6):  # in order, so that the server's order is the clients'
                readers.append(asyncio.create_task(read(i)))
                await wait_for(lambda: len(streams) == i + 1, what=f"stream {i} open")
            assert await asyncio.wait_for(asyncio.gather(*readers), 20) == [
                "whole", "whole", "error", "whole", "whole", "whole"]
        await steps
        assert replica.healthy and replica.trips == 0
    finally:
        steps.cancel()
        await gw.stop()
        await upstream.stop()


async def test_an_answer_whose_connection_breaks_after_its_last_token_is_whole(tiny_model_dir):
    """Every choice finished (and usage sent), then the connection was reset before
    [DONE]: the answer is whole, and the client gets it, streamed or not, with
    nothing counted against the replica.  It used to be a failure mid-request: a
    503 (or an error event after the whole answer), the breaker tripped."""
    async def chat(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "The answer is 42."},
                                            "finish_reason": "stop"}]},
                              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}}))
        await asyncio.sleep(0.05)
        request.transport.abort()  # reset before [DONE]
        return resp

    router = RouterConfig(health_interval_s=60, breaker_failures=1)
    async with _gateway_over_one(tiny_model_dir, chat, router, "ext") as (_, url, client, replica):
        whole = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert whole.choices[0].message.content == "The answer is 42." and whole.usage.completion_tokens == 5
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "The answer is 42."
        assert replica.healthy and replica.trips == 0
        assert await metric_by_replica(url, "kvgate_replica_failures_total") == {"ext": 0.0}


async def test_streams_the_breaker_cuts_do_not_count_against_the_replica_again(tiny_model_dir):
    """Two streams silent after their headers (a hung step) when the probes fail:
    the breaker trips and cuts them.  Each cut stream used to count as one more
    failed request, after the trip had forgiven the count, so the replica carried
    two failures into its rejoin and one failed request then tripped it again
    (breaker_failures 3)."""
    state = {"healthy": True, "chat_fails": False}
    hung, release = [], asyncio.Event()

    async def chat(request):
        await request.read()
        if state["chat_fails"]:
            return web.Response(status=502, text="bad gateway")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        hung.append(request)
        with contextlib.suppress(Exception):
            await release.wait()
        return resp

    upstream = await _scripted_upstream(_models_while(state), chat)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)],
                                 router=RouterConfig(breaker_failures=3, health_interval_s=0.1, breaker_reset_s=0.5)))
    gw = await start_server(app)
    replica = app[GATEWAY].replicas[0]
    try:
        await wait_for(lambda: replica.healthy, what="healthy")
        async with aiohttp.ClientSession() as session:
            async def one():
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
                async with session.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    return resp.status
            silent = [asyncio.create_task(one()) for _ in range(2)]
            await wait_for(lambda: len(hung) == 2, what="two silent streams")
            state["healthy"] = False  # the probes fail: the breaker trips and cuts both
            await wait_for(lambda: replica.trips == 1, what="tripped")
            assert await asyncio.wait_for(asyncio.gather(*silent), 10) == [503, 503]
            assert replica._request_failures == 0
            state["healthy"] = True
            await wait_for(lambda: replica.healthy, timeout=5, what="rejoined")
            state["chat_fails"] = True
            # One failed request is one of three, not a trip.
            async with session.post(gw.url + "/v1/chat/completions",
                                    json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}) as resp:
                assert resp.status == 503
            assert replica._request_failures == 1 and replica.trips == 1 and replica.healthy
    finally:
        release.set()
        await gw.stop()
        await upstream.stop()


async def test_a_usage_count_sent_as_null_is_no_failure(tiny_model_dir):
    """A server (or a proxy before it) that sends a usage count as null: the answer
    is whole and its usage reads 0 where the server gave no count (the prompt's is
    the gateway's own).  A null completion_tokens was a 500 after the whole answer."""
    async def chat(request):
        await request.read()
        return web.Response(body=_sse({"choices": [{"index": 0, "delta": {"content": "Fine"}, "finish_reason": "stop"}]},
                                      {"choices": [], "usage": {"prompt_tokens": None, "completion_tokens": None}},
                                      b"[DONE]"), content_type="text/event-stream")

    async with _gateway_over_one(tiny_model_dir, chat, RouterConfig(health_interval_s=60)) as (_, _, client, _):
        out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content == "Fine" and out.usage.completion_tokens == 0
        assert out.usage.prompt_tokens > 0  # the gateway's count of the prompt it sent
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage.completion_tokens == 0


def _event_stream(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="text/event-stream")


async def _other_servers_ways(request):
    """A scripted upstream that streams as servers other than vLLM do, chosen by
    the user's message: llama.cpp's error field, TGI's tool calls, Ollama's lack of usage."""
    body = await request.json()
    ask = body["messages"][-1]["content"]
    if ask == "too long":  # llama.cpp's server before its late-2025 rewrite: an `error:` field, then [DONE]
        return _event_stream(b'error: {"code": 400, "message": "the request exceeds the available context size", '
                             b'"type": "invalid_request_error"}\n\n' + _sse(b"[DONE]"))
    if ask == "weather":  # TGI 2.4: delta.tool_calls one object; llama.cpp and TGI: arguments an object
        fragments = [{"index": 0, "id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": fragments[0]}}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
        return _event_stream(_sse(*chunks, b"[DONE]"))
    words = ["The", " sky", " is", " blue", "."]  # Ollama before 0.5.2: no usage, whatever was asked
    chunks = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in words]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    return _event_stream(_sse(*chunks, b"[DONE]"))


async def test_what_other_servers_stream_is_read_as_they_meant_it(tiny_model_dir):
    """llama.cpp's in-stream error was skipped (a 200, empty); a tool call streamed
    as one object, or with its arguments as an object, was a 500 or lost its
    arguments; a stream without usage told the client 0 completion tokens."""
    async with _gateway_over_one(tiny_model_dir, _other_servers_ways, RouterConfig()) as (_, url, client, _):
        def ask(content, **kw):
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)

        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
                answer = await ask("too long", stream=stream)
                if stream:
                    [chunk async for chunk in answer]
        called = await ask("weather", tools=[{"type": "function", "function": {"name": "get_weather"}}])
        (call,) = called.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"location": "Paris"})
        plain = await ask("hi")
        assert plain.choices[0].message.content == "The sky is blue."
        assert plain.usage.completion_tokens == 5  # its deltas, a token each at least
        streamed = [c async for c in await ask("hi", stream=True, stream_options={"include_usage": True})]
        assert streamed[-1].usage.completion_tokens == 5
        answer = await client.responses.create(model=MODEL, input="hi")
        assert answer.output_text == "The sky is blue." and answer.usage.output_tokens == 5


async def test_completions_logprobs_in_chats_shape_are_read(tiny_model_dir):
    """llama.cpp's server streams completions logprobs in chat's shape ({"content":
    [...]}); they were dropped: logprobs null on every chunk, empty lists whole."""
    async def completions(request):
        await request.read()
        chunks = [{"choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": {"content": [
            {"id": 1, "token": text, "bytes": list(text.encode()), "logprob": value,
             "top_logprobs": [{"id": 1, "token": text, "bytes": list(text.encode()), "logprob": value}]}]}}]}
            for text, value, finish in (("Hello", -0.1, None), (" world", -0.3, "length"))]
        return _event_stream(_sse(*chunks, b"[DONE]"))

    upstream = await _completions_upstream(_models_while({"healthy": True}), completions)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url)]))
    gw = await start_server(app)
    client = _client(gw.url)
    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="healthy")
        whole = await client.completions.create(model=MODEL, prompt="Say", max_tokens=2, logprobs=1)
        lp = whole.choices[0].logprobs
        assert (lp.tokens, lp.token_logprobs, lp.text_offset) == (["Hello", " world"], [-0.1, -0.3], [0, 5])
        chunks = [c async for c in await client.completions.create(model=MODEL, prompt="Say", max_tokens=2,
                                                                    logprobs=1, stream=True)]
        assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] \
            == ["Hello", " world"]
    finally:
        await client.close()
        await gw.stop()
        await upstream.stop()


async def test_a_choice_that_speaks_first_keeps_its_place_in_the_sdks_accumulation(tiny_model_dir):
    """vLLM sends every choice's role chunk first, in index order; the gateway sent
    each with its choice's first output, so a choice 1 that spoke before choice 0
    (whose first tokens a tool or reasoning parser held back) came first, and the
    SDK's stream accumulator, which files a choice it has not seen in the next place
    of its list, gave choice 0's text to choice 1 and then raised an IndexError."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}

    def chunk(index, delta, finish=None):
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    async def chat(request):
        await request.read()
        usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        return _event_stream(_sse(*(chunk(i, {"role": "assistant", "content": ""}) for i in range(2)),
                                  chunk(1, {"content": "B1"}), chunk(0, {"content": "A1"}),
                                  chunk(1, {"content": "B2"}, "stop"), chunk(0, {"content": "A2"}, "stop"),
                                  {**head, "choices": [], "usage": usage}, b"[DONE]"))

    async with _gateway_over_one(tiny_model_dir, chat, RouterConfig(health_interval_s=60)) as (gateway, _, client, _):
        async with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                  stream_options={"include_usage": True}) as stream:
            whole = await stream.get_final_completion()
        assert [(c.index, c.message.content, c.finish_reason) for c in whole.choices] == [
            (0, "A1A2", "stop"), (1, "B1B2", "stop")]
        assert whole.usage.completion_tokens == 4
        assert gateway.router.inflight_requests == [0]

@contextlib.contextmanager
def stand_in_dns(monkeypatch, suffix: str):
    """A name service for host names ending ``suffix`` (a test's own pods): a name
    resolves to its address in the yielded dict while it is there, else does not
    exist, as a headless Service's pod names come and go.  Other names resolve as ever."""
    import socket

    real = socket.getaddrinfo
    pods: dict[str, str] = {}

    def getaddrinfo(host, *args, **kwargs):
        if isinstance(host, str) and host.endswith(suffix):
            if host not in pods:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            host = pods[host]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield pods


@contextlib.asynccontextmanager
async def _slots_with_pod_0(monkeypatch, config):
    """A gateway over ``config``'s slots named pod-{i}.kvgate.test where only pod 0's
    name resolves (to 127.0.0.1), once pod 0 is in routing: (the names that resolve,
    the replicas)."""
    with stand_in_dns(monkeypatch, ".kvgate.test") as pods:
        pods["pod-0.kvgate.test"] = "127.0.0.1"
        async with serving(create_app(config)) as (app, server, client):
            replicas = app[GATEWAY].replicas
            await wait_for(lambda: replicas[0].healthy, what="pod 0 in routing")
            yield pods, replicas


async def test_absent_openai_slots_say_nothing_of_their_metrics(tiny_model_dir, monkeypatch, caplog):
    """vLLM pods as slots with a metrics_url each (deploy/vllm.md): a slot with no
    pod is absent, said once at INFO, not a warning.  Its metrics poll warned
    "cannot read its metrics" for each such slot all the same (6 warnings at every
    start of a gateway over 2 pods in 8 slots)."""
    caplog.set_level(logging.INFO)
    stub = web.Application()
    stub.router.add_get("/v1/models", _models_while({"healthy": True}))
    stub.router.add_get("/metrics", lambda request: web.Response(text="vllm:num_requests_waiting 0\n"))
    upstream = await start_server(stub)
    port = int(upstream.url.rsplit(":", 1)[1])
    config = tiny_config(tiny_model_dir, [ReplicaConfig(
        kind="openai", url=f"http://pod-{{i}}.kvgate.test:{port}/v1", metrics_url=f"http://pod-{{i}}.kvgate.test:{port}/metrics",
        count=3, connect_timeout_s=2)], router=RouterConfig(health_interval_s=0.2, health_timeout_s=1.0))
    try:
        async with _slots_with_pod_0(monkeypatch, config) as (pods, replicas):
            await asyncio.sleep(0.6)  # a few metrics polls
            assert [observe._state(r) for r in replicas] == ["up", "absent", "absent"]
    finally:
        await upstream.stop()
    warned = [r.getMessage() for r in caplog.records if r.name == "gateway.replicas" and r.levelno >= logging.WARNING]
    assert warned == [], warned


async def test_a_vllm_slot_joins_as_soon_as_its_pod_answers(tiny_model_dir, monkeypatch):
    """An absent slot's probes of no such server opened its breaker again and again,
    so a vLLM pod that came up waited out router.breaker_reset_s before it took
    traffic (a `kvgate engine` is a new process and skips it)."""
    servers = []
    for host in ("127.0.0.1", "127.0.0.2"):
        stub = web.Application()
        stub.router.add_get("/v1/models", _models_while({"healthy": True}))
        servers.append(await start_server(stub, host=host, port=int(servers[0].url.rsplit(":", 1)[1]) if servers else 0))
    port = int(servers[0].url.rsplit(":", 1)[1])
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=f"http://pod-{{i}}.kvgate.test:{port}/v1",
                                                        count=2, connect_timeout_s=2)],
                         router=RouterConfig(health_interval_s=0.1, health_timeout_s=1.0, breaker_reset_s=60))
    try:
        async with _slots_with_pod_0(monkeypatch, config) as (pods, replicas):
            await asyncio.sleep(1.0)  # ten probes of no such server
            pods["pod-1.kvgate.test"] = "127.0.0.2"
            await wait_for(lambda: replicas[1].healthy, timeout=5.0, what="pod 1 in routing")
    finally:
        for s in servers:
            await s.stop()


async def test_replica_slots_of_a_count_are_absent_until_their_pods_exist(tiny_model_dir, monkeypatch, caplog):
    """An entry with a count stands for a StatefulSet's pods, numbered in its url:
    the engines scale within it without the gateways being told.  A slot whose name
    does not resolve (no such pod) is absent: out of routing, but neither down in
    the metrics, the status line and /stats, nor a warning; it joins once its name
    resolves, and is absent again once its pod is gone."""
    caplog.set_level(logging.INFO)
    port = free_port()
    engines = [await _engine_server_at(tiny_model_dir, f"127.0.0.{n}", port) for n in (1, 2)]
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=f"http://pod-{{i}}.kvgate.test:{port}",
                                                        count=3, connect_timeout_s=2)],
                         router=RouterConfig(health_interval_s=0.2, health_timeout_s=1.0))
    names = [f"pod-{i}.kvgate.test:{port}" for i in range(3)]
    with stand_in_dns(monkeypatch, ".kvgate.test") as pods:
        pods["pod-0.kvgate.test"] = "127.0.0.1"
        async with serving(create_app(config)) as (app, server, client):
            replicas = app[GATEWAY].replicas
            assert [r.name for r in replicas] == names
            await wait_for(lambda: replicas[0].healthy, what="pod 0 in routing")
            assert [r.absent for r in replicas] == [False, True, True]
            assert await metric_by_replica(server.url, "kvgate_replica_absent") == dict(zip(names, (0.0, 1.0, 1.0)))
            assert await metric_by_replica(server.url, "kvgate_replica_healthy") == dict(zip(names, (1.0, 0.0, 0.0)))
            async with aiohttp.ClientSession() as session:
                async with session.get(server.url + "/stats") as resp:
                    shown = [(r["name"], r["healthy"], r["absent"]) for r in (await resp.json())["replicas"]]
            assert shown == [(names[0], True, False), (names[1], False, True), (names[2], False, True)]
            assert [observe._state(r) for r in replicas] == ["up", "absent", "absent"]
            for _ in range(3):
                done = await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2)
                assert done.usage.completion_tokens >= 1

            pods["pod-1.kvgate.test"] = "127.0.0.2"  # scaled up: the second pod is ready
            await wait_for(lambda: replicas[1].healthy, what="pod 1 joins routing")
            assert not replicas[1].absent and replicas[2].absent

            await engines[1][1].stop()  # scaled down again: it drains and goes, its name with it
            del pods["pod-1.kvgate.test"]
            await wait_for(lambda: replicas[1].absent, what="pod 1 absent again")
            assert await metric_by_replica(server.url, "kvgate_replica_absent") == dict(zip(names, (0.0, 1.0, 1.0)))
    await engines[0][1].stop()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gateway.replicas"]
    assert not [m for level, m in said if level >= logging.WARNING and ("pod-1" in m or "pod-2" in m)], said
    assert any("pod-2" in m and "is absent" in m for _, m in said), said


async def test_a_slot_whose_lookup_fails_is_down_not_absent(tiny_model_dir, monkeypatch):
    """Absent is a name that does not exist (no such pod).  A lookup that fails
    (EAI_AGAIN: the cluster's DNS unreachable or timing out) is an outage: read as
    absent, every slot left routing silently, the dashboard said 0 down and the
    README's alert stayed quiet while every request was a 503."""
    import socket

    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if isinstance(host, str) and host.endswith(".kvgate.test"):
            if host.startswith("pod-0."):
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    port = free_port()
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=f"http://pod-{{i}}.kvgate.test:{port}",
                                                        count=2, connect_timeout_s=1)],
                         router=RouterConfig(health_interval_s=0.2, health_timeout_s=1.0))
    async with serving(create_app(config)) as (app, server, client):
        replicas = app[GATEWAY].replicas
        await asyncio.sleep(0.5)  # a few probes
        assert [observe._state(r) for r in replicas] == ["absent", "down"]
        names = [r.name for r in replicas]
        assert await metric_by_replica(server.url, "kvgate_replica_absent") == dict(zip(names, (1.0, 0.0)))


async def _engine_server_at(model_dir, host: str, port: int):
    app = create_app(tiny_config(model_dir), engine_mode=True)
    server = await start_server(app, host=host, port=port)
    return app[GATEWAY].replicas[0].engine, server


async def test_done_before_every_choice_finished_is_an_incomplete_answer_not_a_whole_one(tiny_model_dir):
    """[DONE] while choice 1 of n=2 had no finish_reason (cut upstream, or a server
    that ignores n) was read as a whole answer: choice 1 came back with a null
    finish_reason (streamed or not) and its text cut short.  It is an incomplete
    answer, as a stream closed before [DONE] is; the server, which talks fine, is
    not counted toward its breaker (concurrent n=2 requests would trip it)."""
    def chunk(index, text, finish=None):
        return {"choices": [{"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish}]}

    async def one_choice_unfinished(request):
        await request.read()
        body = b"".join(_sse(c) for c in (chunk(0, "Hello"), chunk(1, "Hi th"), chunk(0, "", "stop")))
        return web.Response(body=body + b"data: [DONE]\n\n", content_type="text/event-stream")

    upstream = await _scripted_upstream(_models_while({"healthy": True}), one_choice_unfinished)
    router = RouterConfig(health_interval_s=60, breaker_failures=2)
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url + "/v1")], router=router)
    messages = [{"role": "user", "content": "hi"}]
    try:
        async with serving(create_app(config)) as (app, _, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="the server in routing")
            for stream in (False, True, False):
                with pytest.raises(openai.APIError, match="sent \\[DONE\\] with choice 1 of 2 unfinished"):
                    answer = await client.chat.completions.create(model=MODEL, messages=messages, n=2, stream=stream)
                    if stream:
                        [c async for c in answer]
            assert app[GATEWAY].replicas[0].healthy and app[GATEWAY].replicas[0].trips == 0
    finally:
        await upstream.stop()


async def test_special_tokens_add_nothing_to_text_offset_behind_an_engine_as_in_process(tiny_model_dir):
    """A special token a `kvgate engine` lists in a choice's logprobs is outside its
    text: text_offset indexes the text the client reads, as an in-process engine's
    does (it ran past the text by the token's length, 0, 12, 24)."""
    engine, server = await _engine_server(tiny_model_dir)
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    base = dict(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=1,
                logit_bias={str(special): 100}, extra_body={"ignore_eos": True})
    try:
        config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="engine", url=server.url)])
        async with serving(create_app(config)) as (app, gw, client):
            await wait_for(lambda: app[GATEWAY].replicas[0].healthy, what="the engine in routing")
            for stream in (False, True):
                answer = await client.completions.create(**base, stream=stream)
                chunks = [c async for c in answer if c.choices[0].logprobs] if stream else [answer]
                assert "".join(c.choices[0].text for c in chunks) == ""
                assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == ["<|im_start|>"] * 3
                assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == [0, 0, 0]
    finally:
        await server.stop()
