"""The gateway on a real loopback server over real engines (tiny model), via the openai SDK.

One module-scoped gateway with two in-process replicas serves most tests
(loading two engines per test would dominate the run time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig, ModelConfig
from gateway.app import GATEWAY, create_app
from gateway.config import ApiKeyConfig, KvgateConfig, ReplicaConfig, RouterConfig, ServerConfig
from gateway.server import start_server
from tests.engine_procs import count_aborts, record_requests, wait_for
from tests.gateway_helpers import a_request_in_a_hung_step, hung_model_steps, metric_by_replica, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"


def _config(model_dir: str, replicas: int = 2, **server) -> KvgateConfig:
    return KvgateConfig(
        model=ModelConfig(path=model_dir, served_name=MODEL, device="cpu", max_model_len=1024),
        engine=EngineConfig(block_size=16, device_blocks=256, max_num_seqs=8, max_batched_tokens=1024, threads=1),
        server=ServerConfig(**server),
        # Default router settings: the burst test relies on hot-prefix spreading, not a tuned valve.
        router=RouterConfig(),
        replicas=[ReplicaConfig(kind="inprocess") for _ in range(replicas)],
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tiny_model_dir):
    async with serving(create_app(_config(tiny_model_dir))) as running:
        yield running


def _decisions(app) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in app[GATEWAY].metrics.registry.collect():
        if metric.name == "kvgate_router_decisions":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["replica"]] = out.get(sample.labels["replica"], 0) + sample.value
    return out


async def _settled(app, timeout=30.0):
    """Wait until no request is in flight anywhere: router counts and engine blocks."""
    gw = app[GATEWAY]
    for _ in range(int(timeout / 0.05)):
        busy = any(gw.router.inflight_requests) or any(_engine_busy(r.engine) for r in gw.replicas)
        if not busy:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"still busy: router={gw.router.inflight_requests} engines={[r.engine.stats() for r in gw.replicas]}")


def _engine_busy(engine) -> bool:
    stats = engine.stats()
    return bool(stats["running"] or stats["waiting"] or stats["blocks"]["device"]["in_use"])


async def test_chat_plain_and_streamed_with_usage(gw):
    app, server, client = gw
    resp = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=5, temperature=0
    )
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert resp.choices[0].message.role == "assistant" and isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason in ("stop", "length")
    u = resp.usage
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 5 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0

    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content  # greedy: same answer both ways


async def test_completions_and_models(gw):
    app, server, client = gw
    resp = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, n=2)
    assert resp.object == "text_completion" and len(resp.choices) == 2
    assert resp.usage.completion_tokens <= 8
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_a_templates_completions_calls_share_its_blocks_across_sessions(tiny_model_dir):
    """API calls that fill one template are sessions of their own, as single-turn
    chats are: the template's reuse is cross-session, which the workload-aware
    policy keeps in its shared class (its main gain over LRU on to-B traffic).
    One session per 256-byte opening put every call of a template in one session,
    and the class never formed."""
    template = "Tenant instructions: " + "Answer the question briefly and politely. " * 8  # over 256 bytes
    async with serving(create_app(_config(tiny_model_dir, replicas=1))) as (app, server, client):
        for job in ("the weather", "a cache", "Paris"):
            await client.completions.create(model=MODEL, prompt=f"{template}Input: {job}", max_tokens=1)
        again = await client.completions.create(model=MODEL, prompt=f"{template}Input: Paris", max_tokens=1)
        policy = app[GATEWAY].replicas[0].engine.pool.device_policy
        assert ("to-b", "api", "shared") in policy.table.names
    assert again.usage.prompt_tokens_details.cached_tokens > 0


async def test_a_safety_identifier_is_a_user_of_the_hit_share(tiny_model_dir):
    """OpenAI's successor of `user` counts its requests for their user, as `user` does
    (it was ignored: the traffic was anonymous, and the hit share empty)."""
    async with serving(create_app(_config(tiny_model_dir, replicas=1))) as (app, server, client):
        for who in ("alice", "alice", "bob"):
            await client.chat.completions.create(model=MODEL, max_tokens=1, safety_identifier=who,
                                                 messages=[{"role": "user", "content": "The same question " * 8}])
        shares = app[GATEWAY].observer.user_share.shares(time.monotonic())
    assert shares and max(shares.values()) > 0, shares


async def test_errors_surface_as_sdk_exceptions(gw):
    app, server, client = gw
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=100)
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt="word " * 2000, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert resp.choices


async def test_shared_system_prompt_lands_where_cached_and_burst_spreads(gw):
    app, server, client = gw
    await _settled(app)
    system = "You are a helpful assistant. Answer the question briefly and politely. " * 12
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    before = _decisions(app)
    await client.chat.completions.create(model=MODEL, messages=msgs("What is the weather like today?"), max_tokens=2)
    after = _decisions(app)
    owner = next(name for name in after if after[name] > before.get(name, 0))
    for q in ("What is the capital of Germany?", "Please summarise the document.", "Numbers: 1 2 3"):
        before = _decisions(app)
        resp = await client.chat.completions.create(model=MODEL, messages=msgs(q), max_tokens=2)
        after = _decisions(app)
        assert after[owner] == before.get(owner, 0) + 1, "sequential requests must follow the cached prefix"
        assert resp.usage.prompt_tokens_details.cached_tokens >= 16 * 8
    before = _decisions(app)
    await asyncio.gather(
        *(client.chat.completions.create(model=MODEL, messages=msgs(f"Burst question {i}?"), max_tokens=8) for i in range(8))
    )
    after = _decisions(app)
    spread = {name: after[name] - before.get(name, 0) for name in after}
    assert all(v > 0 for v in spread.values()) and len(spread) == 2, spread
    await _settled(app)


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_leaves_nothing_behind(gw, stream):
    app, server, client = gw
    await _settled(app)
    counts = [count_aborts(replica.engine) for replica in app[GATEWAY].replicas]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 900,
            "stream": stream, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        if stream:
            resp = await session.post(server.url + "/v1/chat/completions", json=body)
            await resp.content.readline()
            resp.close()
        else:
            task = asyncio.create_task(session.post(server.url + "/v1/chat/completions", json=body))
            for _ in range(100):
                if any(app[GATEWAY].router.inflight_requests):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    try:
        # 900 tokens take far longer than this: only an abort frees the blocks in time.
        await _settled(app, timeout=3)
        assert sum(len(aborted) for aborted in counts) == 1
    finally:
        for replica in app[GATEWAY].replicas:
            del replica.engine._abort


async def test_auth_required_when_keys_configured(tiny_model_dir):
    config = _config(tiny_model_dir, replicas=1, api_keys=[ApiKeyConfig(key="sk-test", tenant="acme", workload="to-b")])
    app = create_app(config)
    server = await start_server(app)
    try:
        bad = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
        await bad.close()
        good = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
        resp = await good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
        assert resp.choices
        await good.close()
    finally:
        await server.stop()


@pytest.mark.parametrize("where", ["inprocess", "remote engine", "engine alone"])
async def test_tenants_neither_share_nor_see_each_others_cache(tiny_model_dir, where):
    """A tenant's prompts get block keys of their own: another tenant sending the
    same prompt gets no cached tokens (which would tell it the prompt was sent);
    two keys of one tenant share; a request's cache_salt (vLLM's) splits further.
    A `kvgate engine` with tenants' keys, clients calling it directly, too."""
    keys = [ApiKeyConfig(key="sk-a1", tenant="acme"), ApiKeyConfig(key="sk-a2", tenant="acme"),
            ApiKeyConfig(key="sk-g", tenant="globex"), ApiKeyConfig(key="sk-trick", tenant="acme|x")]
    config = _config(tiny_model_dir, replicas=1, api_keys=keys)
    engine_server = None
    if where == "remote engine":
        engine_server = await start_server(create_app(_config(tiny_model_dir, replicas=0), engine_mode=True))
        config = config.model_copy(update={"replicas": [ReplicaConfig(kind="engine", url=engine_server.url)]})
    app = create_app(config, engine_mode=where == "engine alone")
    server = await start_server(app)
    clients = {k.key: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=k.key, max_retries=0, timeout=60)
               for k in keys}
    secret = [{"role": "system", "content": "Internal price list, do not share: widget 41 dollars. " * 4},
              {"role": "user", "content": "What does a widget cost?"}]

    async def cached(key: str, **extra) -> int:
        resp = await clients[key].chat.completions.create(model=MODEL, messages=secret, max_tokens=1, **extra)
        return resp.usage.prompt_tokens_details.cached_tokens

    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, timeout=20, what="replica healthy")
        assert await cached("sk-a1") == 0
        assert await cached("sk-a1") > 0
        assert await cached("sk-a2") > 0  # the same tenant, another key
        assert await cached("sk-g") == 0  # another tenant learns nothing
        assert await cached("sk-g") > 0  # and has its own cache
        assert await cached("sk-a1", extra_body={"cache_salt": "project-x"}) == 0
        # No tenant name and own salt spell another pair's salt.
        assert await cached("sk-a1", extra_body={"cache_salt": "x"}) == 0
        assert await cached("sk-trick") == 0
        # The longest salt a client may send still fits once the tenant is added (remote engines too).
        assert await cached("sk-a1", extra_body={"cache_salt": "s" * 1024}) == 0
        # The router predicted what the engine served: its keys are the engine's
        # (an engine alone does not route, and exports no router series).
        predicted = sum((await metric_by_replica(server.url, "kvgate_router_predicted_hit_tokens_total")).values())
        hits = sum((await metric_by_replica(server.url, "kvgate_prefix_cache_hits_tokens_total")).values())
        assert predicted == hits > 0 or (where == "engine alone" and hits > 0 and not predicted)
    finally:
        for client in clients.values():
            await client.close()
        await server.stop()
        if engine_server is not None:
            await engine_server.stop()

    # Shared on purpose: isolate_tenant_caches off.
    shared = _config(tiny_model_dir, replicas=1, api_keys=keys, isolate_tenant_caches=False)
    async with serving(create_app(shared)) as (app, server, _):
        clients = {k.key: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=k.key, max_retries=0, timeout=60)
                   for k in keys}
        try:
            assert await cached("sk-a1") == 0
            assert await cached("sk-g") > 0
        finally:
            for client in clients.values():
                await client.close()


async def test_engine_server_behind_gateway_end_to_end(tiny_model_dir):
    """`kvgate engine` (engine_mode app) + a gateway following it as a remote replica."""
    config = _config(tiny_model_dir, replicas=0)
    engine_server = await start_server(create_app(config, engine_mode=True))
    gw_config = config.model_copy(update={"replicas": [ReplicaConfig(kind="engine", url=engine_server.url)]})
    app = create_app(gw_config)
    gateway = await start_server(app)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        replica = app[GATEWAY].replicas[0]
        for _ in range(200):
            if replica.healthy:
                break
            await asyncio.sleep(0.05)
        assert replica.healthy
        system = "You are a helpful assistant. Answer the question briefly and politely. " * 6
        msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
        first = await client.chat.completions.create(model=MODEL, messages=msgs("Hi?"), max_tokens=3)
        assert first.choices[0].message.content is not None
        # Stored events arrive over /kv_events and match the gateway's own block keys.
        keys = app[GATEWAY].hasher.chat(msgs("Hello?")).keys
        for _ in range(100):
            if replica.index.match(keys) > 0:
                break
            await asyncio.sleep(0.05)
        assert replica.index.match(keys) >= len(system) // 16 // 4
        stream = await client.chat.completions.create(
            model=MODEL, messages=msgs("Hello?"), max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    finally:
        await client.close()
        await gateway.stop()
        await engine_server.stop()


async def test_a_client_calling_an_engine_directly_gets_what_a_gateway_would_answer(tiny_model_dir):
    """A `kvgate engine` serves its gateways' forwarded requests (kvgate_context) and
    clients calling it directly: those get OpenAI's completions logprobs, as
    through a gateway (the sampled token among top_logprobs, logprobs at most 5)."""
    config = _config(tiny_model_dir, replicas=0)
    engine_server = await start_server(create_app(config, engine_mode=True))
    app = create_app(config.model_copy(update={"replicas": [ReplicaConfig(kind="engine", url=engine_server.url)]}))
    gateway = await start_server(app)
    direct = openai.AsyncOpenAI(base_url=engine_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    through = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        await wait_for(lambda: app[GATEWAY].replicas[0].healthy, 10)
        answers = []
        for client in (direct, through):
            for logprobs in (0, 2):
                resp = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                       temperature=0, logprobs=logprobs)
                lp = resp.choices[0].logprobs
                for token, top in zip(lp.tokens, lp.top_logprobs):
                    assert top is not None and token in top and len(top) <= logprobs + 1
                answers.append((resp.choices[0].text, lp.tokens, lp.top_logprobs))
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=6)
            assert info.value.param == "logprobs"
        assert answers[:2] == answers[2:]
        # An engine takes a gateway's longer salt (the tenant's name before the client's),
        # but not any length: each one is held in its hash cache (4 MB salts grew it for good).
        await direct.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": "s" * 2048})
        with pytest.raises(openai.BadRequestError) as info:
            await direct.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": "s" * 8193})
        assert info.value.param == "cache_salt"
    finally:
        await direct.close()
        await through.close()
        await gateway.stop()
        await engine_server.stop()


def _bos_model_dir(tiny_model_dir: str, tmp_path) -> str:
    """The tiny model with a tokenizer that puts a BOS before a text, as Llama's and Gemma's do."""
    import shutil

    from tokenizers import Tokenizer, processors

    path = shutil.copytree(tiny_model_dir, tmp_path / "bos-model")
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", raw.token_to_id("<|endoftext|>"))])
    raw.save(str(path / "tokenizer.json"))
    return str(path)


async def test_completions_prompts_get_the_models_bos_as_in_vllm(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    model_dir = _bos_model_dir(tiny_model_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = "The capital of France is"
    with_bos = tokenizer.encode(prompt, add_special_tokens=True)
    bare = tokenizer.encode(prompt, add_special_tokens=False)
    assert with_bos == [tokenizer.convert_tokens_to_ids("<|endoftext|>")] + bare
    async with serving(create_app(_config(model_dir, replicas=1))) as (app, server, client):
        async def complete(prompt, **extra):
            resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                   extra_body=extra or None)
            return resp.choices[0].text, resp.usage.prompt_tokens

        assert await complete(prompt) == await complete(with_bos) == ((await complete(with_bos))[0], len(with_bos))
        assert await complete(prompt, add_special_tokens=False) == await complete(bare) == (
            (await complete(bare))[0], len(bare))
        # Chat is its template's alone (which writes its own BOS where the model wants one).
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1)
        assert chat.usage.prompt_tokens == len(tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)["input_ids"])


async def _long_streams_under_way(client, count: int) -> list:
    """``count`` streamed completions of 400 tokens, each past its first chunk (in flight)."""
    body = dict(model=MODEL, prompt="Count:", max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    streams = [await client.completions.create(**body) for _ in range(count)]
    for stream in streams:
        await stream.__anext__()
    return streams


async def test_requests_over_the_inflight_limit_get_429(tiny_model_dir):
    """limits.max_inflight_requests sheds load: beyond it a 429 with Retry-After
    (which OpenAI's SDKs wait for and retry), and the limit frees as requests end."""
    config = _config(tiny_model_dir, replicas=1, limits={"max_inflight_requests": 2})
    async with serving(create_app(config)) as (app, server, client):
        streams = await _long_streams_under_way(client, 2)
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.code == "server_overloaded" and info.value.response.headers["Retry-After"] == "1"
        for stream in streams:
            await stream.close()
        await wait_for(lambda: not app[GATEWAY].live, what="the streams' ends")
        done = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert done.usage.completion_tokens >= 1


async def test_a_request_the_drain_ends_answers_under_its_completion_id(tiny_model_dir):
    """A request still running when the drain ends (SIGTERM's last stage, or a
    second signal) answers 503 server_shutting_down named as every error once the
    request was read: by its completion id (in the SDK's error.request_id and the
    access line, the id a remote engine's log names), not a random req- id."""
    async with serving(create_app(_config(tiny_model_dir, replicas=1))) as (app, server, client):
        engine = app[GATEWAY].replicas[0].engine
        sent = record_requests(engine)
        with hung_model_steps(engine):
            whole = asyncio.create_task(client.completions.create(model=MODEL, prompt="hi", max_tokens=4))
            await wait_for(lambda: sent, what="the request at its engine")
            app[GATEWAY].cut_live()
            with pytest.raises(openai.APIStatusError) as info:
                await whole
    assert info.value.status_code == 503 and info.value.code == "server_shutting_down"
    assert info.value.request_id.startswith("cmpl-"), info.value.request_id


async def test_slow_uploads_hold_no_slot_and_time_out(tiny_model_dir):
    """A body still arriving is not counted against max_inflight_requests (a
    client trickling bodies cannot lock others out), and it gets a 408 once
    limits.body_timeout_s has passed."""
    config = _config(tiny_model_dir, replicas=1, limits={"max_inflight_requests": 2, "body_timeout_s": 5.0})
    async with serving(create_app(config)) as (app, server, client):
        host, port = server.url.split("//")[1].split(":")
        slow = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            await writer.drain()
            slow.append((reader, writer))
        await asyncio.sleep(0.2)
        started = asyncio.get_running_loop().time()
        done = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert done.usage.completion_tokens >= 1
        # Served while the three bodies were still arriving, not after they timed out.
        assert asyncio.get_running_loop().time() - started < 4.5
        for reader, writer in slow:
            head = await asyncio.wait_for(reader.read(2048), 10)
            assert head.startswith(b"HTTP/1.1 408") and b"request_timeout" in head
            # The rest of that body cannot be told from a next request: the server says it
            # closes (RFC 9110's 408), after aiohttp's lingering read of what still comes.
            assert b"\r\nConnection: close\r\n" in head, head
            writer.close()
        assert app[GATEWAY].admitted == 0


async def test_bodies_still_arriving_are_bounded_in_bytes(tiny_model_dir):
    """limits.max_pending_body_bytes: stalled uploads count the bytes they have
    sent; past the budget a body gets 429 and is not buffered further, small
    requests are still served, and the budget frees when the uploads end."""
    mib = 1024 * 1024
    limits = {"max_body_bytes": mib, "max_pending_body_bytes": 2 * mib, "body_timeout_s": 30.0}
    config = _config(tiny_model_dir, replicas=1, limits=limits)
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\n\r\n")
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    async with serving(create_app(config)) as (app, server, client):
        gateway = app[GATEWAY]
        host, port = server.url.split("//")[1].split(":")

        async def connect(first: bytes):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(first)
            await writer.drain()
            return reader, writer

        # Each a byte short of its declared length: all but 2 bytes of the budget held.
        stalled = [await connect(head.format(mib).encode() + b"{" * (mib - 1)) for _ in range(2)]
        await wait_for(lambda: gateway.pending_body_bytes == 2 * mib - 2, what="two uploads held")
        refused = [await connect(head.format(1000).encode() + b"{" * 3),
                   await connect(chunked + b"3\r\n{{{\r\n")]
        for reader, writer in refused:
            answer = await asyncio.wait_for(reader.read(4096), 10)
            assert answer.startswith(b"HTTP/1.1 429") and b"Retry-After: 1" in answer
            assert b'"code": "server_overloaded"' in answer and b"request bodies" in answer
            writer.close()
        # A small request arrives with its headers and needs no reservation.
        done = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert done.usage.completion_tokens >= 1
        for reader, writer in stalled:
            writer.close()
        await wait_for(lambda: gateway.pending_body_bytes == 0, what="the stalled uploads' release")
        # A chunked body is counted as it arrives and served in full once the room is back.
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        reader, writer = await connect(chunked + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        answer = await asyncio.wait_for(reader.read(65536), 60)
        assert answer.startswith(b"HTTP/1.1 200") and b'"completion_tokens"' in answer
        writer.close()
        assert gateway.pending_body_bytes == 0


async def test_declared_lengths_alone_do_not_hold_the_body_budget(tiny_model_dir):
    """Connections that send only headers declaring max_body_bytes (32 of them
    fill the default 256 MiB budget, a few bytes each) reserved it all for
    body_timeout_s: every other body not in its first read got a 429 meanwhile."""
    mib = 1024 * 1024
    limits = {"max_body_bytes": mib, "max_pending_body_bytes": 2 * mib, "body_timeout_s": 30.0}
    config = _config(tiny_model_dir, replicas=1, limits=limits)
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\n\r\n")
    async with serving(create_app(config)) as (app, server, client):
        host, port = server.url.split("//")[1].split(":")
        stalled = []
        for _ in range(4):  # twice the budget, declared
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head.format(mib).encode() + b"{")
            await writer.drain()
            stalled.append(writer)
        await asyncio.sleep(0.3)  # their handlers are waiting for the rest
        # A body sent in two parts, so that its handler finds it still arriving.
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode() + b" " * 100_000
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head.format(len(body)).encode() + body[:1000])
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(body[1000:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(65536), 30)
        writer.close()
        for w in stalled:
            w.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"completion_tokens"' in answer, answer[:400]


async def _requests_by_labels(url: str, status: str) -> dict[tuple[str, str], float]:
    """kvgate_requests_total's non-zero samples of one status, by (endpoint, workload)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {(s.labels["endpoint"], s.labels["workload"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "kvgate_requests_total" and s.labels["status"] == status and s.value}


async def test_a_tenant_limit_without_api_keys_is_said_to_limit_nothing(tiny_model_dir, caplog):
    """max_inflight_per_tenant counts API keys' tenants: with no keys every request is
    anonymous and none is refused, which start-up now says rather than leave to be found."""
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        create_app(_config(tiny_model_dir, replicas=1, limits={"max_inflight_per_tenant": 1}))
        create_app(_config(tiny_model_dir, replicas=1, limits={"max_inflight_per_tenant": 1},
                           api_keys=[ApiKeyConfig(key="sk-a", tenant="acme")]))
    said = [r.getMessage() for r in caplog.records if "max_inflight_per_tenant" in r.getMessage()]
    assert len(said) == 1 and "no API keys" in said[0] and "limits nothing" in said[0], said


async def test_one_tenant_cannot_hold_more_than_its_share_in_flight(tiny_model_dir):
    """limits.max_inflight_per_tenant: a tenant past its share gets a 429 while
    another tenant is served, and its count frees as its requests end.  The 429
    counts under the workload its key fixes (it read "unknown")."""
    keys = [ApiKeyConfig(key="sk-a", tenant="acme", workload="to-b"), ApiKeyConfig(key="sk-g", tenant="globex")]
    config = _config(tiny_model_dir, replicas=1, api_keys=keys, limits={"max_inflight_per_tenant": 2})
    async with serving(create_app(config)) as (app, server, _):
        acme, globex = (openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
                        for key in ("sk-a", "sk-g"))
        try:
            streams = await _long_streams_under_way(acme, 2)
            with pytest.raises(openai.RateLimitError) as info:
                await acme.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert info.value.code == "rate_limit_exceeded" and info.value.response.headers["Retry-After"] == "1"
            refused = await _requests_by_labels(server.url, status="429")
            assert refused == {("completions", "to-b"): 1.0}, refused
            assert (await globex.completions.create(model=MODEL, prompt="hi", max_tokens=2)).choices
            for stream in streams:
                await stream.close()
            await wait_for(lambda: not app[GATEWAY].live, what="the streams' ends")
            assert app[GATEWAY].tenant_admitted == {}
            assert (await acme.completions.create(model=MODEL, prompt="hi", max_tokens=2)).choices
        finally:
            await acme.close()
            await globex.close()


async def test_a_hung_in_process_model_step_fails_health_and_readiness(tiny_model_dir, caplog):
    """`kvgate serve` with its engines in-process (the image's default): a model
    step running past engine.step_timeout_s is a hung engine that only a restart
    frees, so /health (the image's HEALTHCHECK, a liveness probe) answers 503,
    and /ready drops that replica, until the step ends.  The log says so, and
    when it ends (it said nothing: a pod restarted by its liveness probe left
    no reason in its log)."""
    caplog.set_level(logging.WARNING, logger="engine.async_engine")
    config = _config(tiny_model_dir, replicas=1)
    config.engine.step_timeout_s = 0.3
    async with serving(create_app(config)) as (app, server, _):
        engine = app[GATEWAY].replicas[0].engine
        async with aiohttp.ClientSession() as session:
            async with a_request_in_a_hung_step(engine, session, server.url, MODEL) as (release, post):
                async with session.get(server.url + "/health") as resp:
                    body = await resp.json()
                    assert resp.status == 503 and body["status"] == "stalled", body
                    assert list(body["stalled_replicas"].values())[0] > 0.3
                async with session.get(server.url + "/ready") as resp:
                    assert resp.status == 503 and (await resp.json())["healthy_replicas"] == []
                said = [r for r in caplog.records if "past engine.step_timeout_s" in r.getMessage()]
                assert len(said) == 1 and said[0].levelname == "ERROR", said
                release.set()
                async with await post as resp:
                    assert resp.status == 200
                for path in ("/health", "/ready"):
                    async with session.get(server.url + path) as resp:
                        assert resp.status == 200, path
        assert any(r.getMessage().startswith("the stalled model step ended after") for r in caplog.records)


async def test_a_hung_in_process_replica_leaves_routing_until_its_step_ends(tiny_model_dir):
    """Two in-process engines, one hung mid-step: requests go to the other (the
    hung one would hold them for as long as it hangs), and its healthy series
    says 0, until the step ends."""
    config = _config(tiny_model_dir, replicas=2)
    config.engine.step_timeout_s = 0.3
    config.router = RouterConfig(policy="round-robin")
    async with serving(create_app(config)) as (app, server, client):
        hung = app[GATEWAY].replicas[0]
        with hung_model_steps(hung.engine) as release:
            first = [asyncio.ensure_future(client.completions.create(model=MODEL, prompt="hello", max_tokens=2))
                     for _ in range(2)]  # round-robin: one of them to each
            await wait_for(lambda: hung.engine.step_running_s() > 0.5, what="a step past its limit")
            assert not hung.healthy
            for _ in range(3):
                out = await asyncio.wait_for(client.completions.create(model=MODEL, prompt="hi", max_tokens=2), 30)
                assert out.choices[0].finish_reason
            healthy = await metric_by_replica(server.url, "kvgate_replica_healthy")
            assert healthy[hung.name] == 0 and sum(healthy.values()) == 1
            release.set()
            await asyncio.gather(*first)
        await wait_for(lambda: hung.healthy, what="back in routing")


async def test_an_in_process_engine_whose_steps_fail_is_tried_no_more_until_its_breaker_closes(tiny_model_dir,
                                                                                                 monkeypatch):
    """An engine whose model step raises (a device error) fails what it holds before
    any output: the other replica serves those requests, as it does a `kvgate engine`'s
    500 (each was a 500 to its client), and router.breaker_failures of them in a row
    take the failing one out of routing for router.breaker_reset_s (it stayed in)."""
    config = _config(tiny_model_dir, replicas=2)
    config.router = RouterConfig(policy="round-robin", breaker_failures=2, breaker_reset_s=1.0)
    async with serving(create_app(config)) as (app, server, client):
        broken = app[GATEWAY].replicas[0]

        def failing_step():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(broken.engine, "_step", failing_step)
        for stream in (False, True, False, True):
            if stream:
                chunks = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2, stream=True)
                assert [c async for c in chunks][-1].choices[0].finish_reason == "length"
            else:
                out = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
                assert out.choices[0].finish_reason == "length"
        assert (await metric_by_replica(server.url, "kvgate_replica_failures_total"))[broken.name] == 2
        assert (await metric_by_replica(server.url, "kvgate_replica_healthy"))[broken.name] == 0
        monkeypatch.undo()  # the device is back
        await wait_for(lambda: broken.healthy, what="back in routing after breaker_reset_s")
        before = _decisions(app).get(broken.name, 0)
        for _ in range(2):
            await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert _decisions(app)[broken.name] == before + 1
        await _settled(app)


async def test_defaults_stay_within_the_servers_max_tokens(tiny_model_dir):
    """limits.max_tokens bounds every answer: a completion without max_tokens
    takes OpenAI's default of 16 only where the bound allows it, as a chat one
    takes the bound itself (16 used to pass a bound of 8)."""
    config = _config(tiny_model_dir, replicas=1, limits={"max_tokens": 8})
    async with serving(create_app(config)) as (app, server, client):
        fixed = {"ignore_eos": True}
        done = await client.completions.create(model=MODEL, prompt="hi", extra_body=fixed)
        assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    extra_body=fixed)
        assert chat.usage.completion_tokens == 8


async def test_the_models_generation_config_sets_the_sampling_a_request_leaves_out(tiny_model_dir, tmp_path, caplog):
    """vLLM's --generation-config auto: a model whose generation_config.json sets
    temperature 0 answers greedily a request that gives none, whatever its seed;
    a request's own temperature still wins.  Its max_new_tokens is the max_tokens
    of a chat request that gives none (completions keep OpenAI's 16)."""
    import shutil

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "greedy-model")
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 3}))
    caplog.set_level(logging.INFO, logger="gateway.app")
    async with serving(create_app(_config(str(model_dir), replicas=1))) as (app, server, client):
        async def text(**kw):
            out = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, **kw)
            return out.choices[0].text

        left_out = {await text(seed=seed) for seed in range(4)}
        assert left_out == {await text(temperature=0)}
        assert len({await text(seed=seed, temperature=1.5) for seed in range(4)}) > 1

        async def chat_tokens(**kw):
            out = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       extra_body={"ignore_eos": True}, **kw)
            return out.usage.completion_tokens, out.choices[0].finish_reason

        assert await chat_tokens() == (3, "length")
        assert await chat_tokens(max_tokens=5) == (5, "length")
        response = await client.responses.create(model=MODEL, input="hi", extra_body={"ignore_eos": True})
        assert response.usage.output_tokens == 3 and response.incomplete_details.reason == "max_output_tokens"
        plain = await client.completions.create(model=MODEL, prompt="hi", extra_body={"ignore_eos": True})
        assert plain.usage.completion_tokens == 16
    assert any("generation_config sets temperature=0, max_tokens=3 for requests that leave them out" in m
               for m in caplog.messages)


async def test_stored_chat_completions_endpoints_say_nothing_is_stored(gw):
    """`store` is ignored, so the SDK's stored-completion calls find nothing: the list
    is empty (not a 405 APIStatusError), and an id is a NotFoundError that says why."""
    _, _, client = gw
    created = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, store=True)
    page = await client.chat.completions.list()
    assert page.data == [] and not page.has_more
    for call in (lambda: client.chat.completions.retrieve(created.id),
                 lambda: client.chat.completions.update(created.id, metadata={"k": "v"}),
                 lambda: client.chat.completions.delete(created.id),
                 lambda: client.chat.completions.messages.list(created.id)):
        with pytest.raises(openai.NotFoundError) as info:
            await call()
        assert info.value.code == "chat_completion_not_found" and "stores no chat completions" in info.value.message
