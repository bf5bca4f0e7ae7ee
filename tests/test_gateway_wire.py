"""The OpenAI wire surface on a real loopback server over real engines (tiny model).

Framing, errors, auth, limits, routing accounting, disconnects and image
hashing, checked through the openai SDK and raw HTTP against two in-process
replicas of the tiny model.  ``ignore_eos`` (a kvgate/vLLM extension) fixes
output lengths so counts can be asserted exactly; greedy decoding makes the
streamed and plain answers comparable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import GATEWAY, create_app
from gateway.config import ApiKeyConfig, ReplicaConfig
from gateway.replicas import InProcessReplica
from gateway.server import start_server
from tests.gateway_helpers import serving
from tests.engine_procs import MODEL, count_aborts, engine_idle, record_requests, tiny_config, wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")

FIXED = {"ignore_eos": True}  # extra_body: exactly max_tokens tokens


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tiny_model_dir):
    config = tiny_config(tiny_model_dir)
    replicas = [InProcessReplica(f"r{i}", config) for i in range(2)]
    async with serving(create_app(config, replicas)) as (app, server, client):
        engines = [r.engine for r in replicas]
        seen = [record_requests(e) for e in engines]
        yield app, server, client, engines, seen


async def _settled(app):
    gw = app[GATEWAY]
    await wait_for(lambda: not any(gw.router.inflight_requests) and all(engine_idle(r.engine) for r in gw.replicas),
                   timeout=30, what="settled")


async def test_chat_plain_and_streamed(gw):
    app, server, client, engines, seen = gw
    msgs = [{"role": "user", "content": "hello from the wire test"}]
    resp = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, extra_body=FIXED)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 3
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    assert resp._request_id == resp.id  # the x-request-id header the SDK reads

    stream = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, n=2, temperature=0, extra_body=FIXED,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert stream.response.headers["x-request-id"] == chunks[0].id
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
    # Greedy: both choices and the plain answer agree.
    assert text == {0: resp.choices[0].message.content, 1: resp.choices[0].message.content}
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["length", "length"]
    # As OpenAI ends a choice: its own chunk, with an empty delta.
    assert all(ch.delta.content is None for c in chunks for ch in c.choices if ch.finish_reason)


async def test_raw_sse_framing(gw):
    app, server, client, engines, seen = gw
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "stream": True}
        async with s.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            raw = await r.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    first = json.loads(events[0][len(b"data: "):])
    assert first["object"] == "text_completion" and "usage" not in first


async def test_completions_models_and_logprobs(gw):
    app, server, client, engines, seen = gw
    resp = await client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=2, n=2, logprobs=2,
                                           extra_body=FIXED)
    assert resp.object == "text_completion" and [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 8
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 2 and lp.text_offset[0] == 0
    if not lp.tokens[0].startswith("bytes:"):  # a whole character or more (else it adds none yet)
        assert lp.text_offset[1] == len(lp.tokens[0])
    # The top 2 plus the sampled token when it is not among them (OpenAI: up to logprobs + 1).
    assert all(2 <= len(top) <= 3 and top[tok] == val for top, tok, val in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    zero = await client.completions.create(model=MODEL, prompt="one", max_tokens=2, logprobs=0, extra_body=FIXED)
    zero_lp = zero.choices[0].logprobs
    assert zero_lp.top_logprobs == [{t: v} for t, v in zip(zero_lp.tokens, zero_lp.token_logprobs)]
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True, top_logprobs=1,
        extra_body=FIXED,
    )
    assert isinstance(chat.choices[0].logprobs.content[0].token, str)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 1
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    # An id for support and logs on every response, as OpenAI's.
    assert (await client.models.with_raw_response.list()).headers["x-request-id"].startswith("req-")
    assert (await client.models.with_raw_response.retrieve(MODEL)).headers["x-request-id"].startswith("req-")
    # vLLM's context length field, which the gateway itself reads from external servers.
    assert models.data[0].model_extra["max_model_len"] == app[GATEWAY].max_model_len == 1024
    assert (await client.models.retrieve(MODEL)).model_extra["max_model_len"] == 1024
    # Token-id prompts are passed through without re-tokenising.
    await client.completions.create(model=MODEL, prompt=[65, 66, 67], max_tokens=1)
    assert any(r.prompt_token_ids == [65, 66, 67] for s in seen for r in s)


async def test_vllm_sampling_extensions(gw):
    """vLLM's extra sampling fields, sent as the SDK sends them (extra_body), do
    what they do on vLLM, and bad values are 400s naming the field."""
    app, server, client, engines, seen = gw
    tokenizer = engines[0].tokenizer
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    eos = next(iter(engines[0].eos_ids))
    base = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    # The forced token is a stop token: the choice ends on it, without its text unless asked.
    stopped = await client.completions.create(**base, logit_bias={str(a): 100}, extra_body={"stop_token_ids": [a]})
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("", "stop", 1)
    assert stopped.choices[0].model_extra["stop_reason"] == a  # vLLM's: what stopped it
    kept = await client.completions.create(**base, logit_bias={str(a): 100}, logprobs=0,
                                           extra_body={"stop_token_ids": [a], "include_stop_str_in_output": True})
    assert kept.choices[0].text == "a"
    # Logprobs cover the text's tokens: the stop token's too once its text is kept.
    assert kept.choices[0].logprobs.tokens == ["a"] and len(kept.choices[0].logprobs.token_logprobs) == 1
    dropped = await client.completions.create(**base, logit_bias={str(a): 100}, logprobs=0,
                                              extra_body={"stop_token_ids": [a]})
    assert dropped.choices[0].logprobs.tokens == []
    # EOS forced, but not before min_tokens tokens.
    short = await client.completions.create(**base, logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (5, "stop")
    assert short.choices[0].model_extra["stop_reason"] is None  # EOS
    # A stop string kept in the text.
    forced = await client.completions.create(**base, logit_bias={str(a): 100}, stop=["aa"],
                                             extra_body={"include_stop_str_in_output": True})
    assert (forced.choices[0].text, forced.choices[0].finish_reason) == ("aa", "stop")
    assert forced.choices[0].model_extra["stop_reason"] == "aa"
    streamed = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=6, temperature=0, logit_bias={str(a): 100},
                                                    stop=["aa"], stream=True)
    last = [c async for c in streamed][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == "aa"
    # repetition_penalty: a bias of +5 makes "a" the greedy choice every time; once
    # "a" has been generated, a penalty of 100 divides its (positive) logit below the rest.
    nudged = dict(base, logit_bias={str(a): 5}, logprobs=0)
    plain = await client.completions.create(**nudged, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs.tokens == ["a"] * 6
    penalised = await client.completions.create(**nudged, extra_body={"ignore_eos": True, "repetition_penalty": 100.0})
    assert penalised.choices[0].logprobs.tokens.count("a") == 1
    for body, param in [({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"stop_token_ids": ["a"]}, "stop_token_ids"), ({"stop_token_ids": [10**9]}, "stop_token_ids"),
                        ({"min_tokens": 7}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output")]:
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(**base, extra_body=body)
        assert info.value.body["param"] == param, body
    # The value, not its type, is what is wrong: the message says so.
    with pytest.raises(openai.BadRequestError, match=r"Invalid 'stop_token_ids': -1\. Token ids must be 0 or more"):
        await client.completions.create(**base, extra_body={"stop_token_ids": [3, -1]})
    with pytest.raises(openai.BadRequestError, match="you must provide a model parameter"):
        await client.completions.create(**dict(base, model=""))


async def test_logit_bias_and_echo(gw):
    app, server, client, engines, seen = gw
    tokenizer = engines[0].tokenizer
    (token,) = tokenizer.encode("a", add_special_tokens=False)
    base = dict(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, extra_body=FIXED)
    forced = await client.completions.create(**base, logit_bias={str(token): 100})
    assert forced.choices[0].text == "aaa"
    banned = await client.completions.create(**base, logit_bias={str(token): -100}, logprobs=0)
    assert "a" not in banned.choices[0].logprobs.tokens

    with_offsets = await client.completions.create(**base, logit_bias={str(token): 100}, logprobs=1)
    assert with_offsets.choices[0].logprobs.text_offset == [0, 1, 2]
    # A special token the text leaves out is listed but adds nothing to it (the
    # offsets ran past the text by its length), streamed or not.
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for stream in (False, True):
        answer = await client.completions.create(**base, logit_bias={str(special): 100}, logprobs=1, stream=stream)
        chunks = [c async for c in answer if c.choices[0].logprobs] if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == ""
        assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == ["<|im_start|>"] * 3
        assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == [0, 0, 0]

    # A token holding part of a character: OpenAI's "bytes:\\x.." with its real bytes.
    (partial,) = tokenizer.convert_tokens_to_ids([chr(0xE4)])  # byte 0xE4 in the byte-level alphabet
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, temperature=0, logprobs=True,
        top_logprobs=2, logit_bias={str(partial): 100}, extra_body=FIXED,
    )
    first = chat.choices[0].logprobs.content[0]
    assert (first.token, first.bytes) == ("bytes:\\xe4", [0xE4])
    # The character that byte starts was cut off by max_tokens: as vLLM, no U+FFFD stands for it.
    assert chat.choices[0].message.content == ""
    # The end token stops the choice but is not part of its text, nor of its logprobs.
    ended = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True,
        logit_bias={str(tokenizer.eos_token_id): 100},
    )
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].message.content == ""
    assert ended.choices[0].logprobs.content == [] and ended.usage.completion_tokens == 1
    assert all(bytes(t.bytes) == t.token.encode() for t in first.top_logprobs if not t.token.startswith("bytes:"))

    plain = await client.completions.create(**base)
    echoed = await client.completions.create(**base, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text
    assert echoed.usage.completion_tokens == 3
    stream = await client.completions.create(**base, echo=True, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == echoed.choices[0].text
    ids = tokenizer.encode("one two", add_special_tokens=False)
    by_ids = await client.completions.create(**{**base, "prompt": ids}, echo=True, n=2)
    assert all(c.text.startswith("one two") for c in by_ids.choices)


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "nonsense"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"functions": "f"}, "functions"),
])
async def test_chat_fields_the_engine_cannot_honour_are_refused(gw, fields, param):
    """Tools and JSON output need a tool-call parser and guided decoding, which the
    kvgate engine has not: a clear 400 instead of a plain-text answer."""
    app, server, client, engines, seen = gw
    msgs = [{"role": "user", "content": "add 1 and 2"}]
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **fields)
    assert err.value.body["param"] == param
    # What the engine can honour still answers.
    ok = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, response_format={"type": "text"},
                                              tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("fields, param", [
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
])
async def test_completion_fields_the_engine_cannot_honour_are_refused(gw, fields, param):
    app, server, client, engines, seen = gw
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2, **fields)
    assert err.value.body["param"] == param
    # Ranking extra samples needs them all finished: never streamed, whatever the server.
    with pytest.raises(openai.BadRequestError, match="cannot be used with stream"):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=3, stream=True)


@pytest.mark.parametrize("endpoint, fields", [
    ("chat", {"guided_choice": ["yes", "no"]}),
    ("chat", {"guided_json": {"type": "object"}}),
    ("chat", {"structured_outputs": {"regex": "[0-9]+"}}),
    ("chat", {"bad_words": ["Hello"]}),
    ("chat", {"allowed_token_ids": [1, 2]}),
    ("chat", {"add_generation_prompt": False}),
    ("chat", {"continue_final_message": True}),
    ("chat", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("chat", {"chat_template": "{{ messages[0].content }}"}),
    ("chat", {"modalities": ["text", "audio"]}),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("completions", {"guided_regex": "[0-9]+"}),
    ("completions", {"response_format": {"type": "json_object"}}),
    ("completions", {"prompt_logprobs": 1}),
    ("completions", {"truncate_prompt_tokens": 8}),
    ("completions", {"use_beam_search": True}),
    ("completions", {"skip_special_tokens": False}),
])
async def test_vllm_extensions_the_engine_cannot_honour_are_refused(gw, endpoint, fields):
    """vLLM's own request fields for guided decoding, banned words and prompt
    handling: answered in plain text they would look honoured, so a 400 naming
    the field; their default values change nothing and pass."""
    app, server, client, engines, seen = gw
    (field, value), = fields.items()
    if endpoint == "chat":
        create = lambda **kw: client.chat.completions.create(  # noqa: E731
            model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=2, **kw)
    else:
        create = lambda **kw: client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kw)  # noqa: E731
    with pytest.raises(openai.BadRequestError) as err:
        await create(extra_body=fields)
    assert err.value.body["param"] == field and "not supported by the kvgate engine" in err.value.message
    defaults = {"bad_words": [], "add_generation_prompt": True, "continue_final_message": False,
                "use_beam_search": False, "skip_special_tokens": True, "response_format": {"type": "text"},
                "chat_template_kwargs": {}, "modalities": ["text"]}
    ok = await create(extra_body={field: defaults.get(field)})
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_errors_are_sdk_exceptions_and_server_survives(gw):
    app, server, client, engines, seen = gw
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    # Errors carry x-request-id too, as OpenAI's do: once the request was read, the
    # completion id its replicas would be sent; before, one of its own.
    assert info.value.request_id.startswith("chatcmpl-")
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5)
    assert info.value.param == "temperature" and info.value.request_id.startswith("req-")
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4090)
    assert info.value.code == "context_length_exceeded"
    async with aiohttp.ClientSession() as s:
        for data, status in (
            (b"{trunc", 400),
            (b"\xff\xfe", 400),
            (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 2000}).encode(), 400),
            (b"x" * (9 * 1024 * 1024), 413),
            # Escaped lone surrogates: valid JSON, but no text; a 400, not a crash in a tokenizer or hash.
            (b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "user": "\\ud800"}' % MODEL.encode(), 400),
            (b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udc00"}]}' % MODEL.encode(), 400),
        ):
            async with s.post(server.url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}) as r:
                assert r.status == status
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"}
        async def refused() -> dict[str, float]:  # kvgate_http_refused_total by status
            async with s.get(server.url + "/metrics") as r:
                return {sample.labels["status"]: sample.value for family in text_string_to_metric_families(await r.text())
                        for sample in family.samples if sample.name == "kvgate_http_refused_total"}

        before = await refused()
        async with s.get(server.url + "/v1/nothing") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_url"
        # A known path with the wrong method: 405, still in OpenAI's error shape.
        async with s.get(server.url + "/v1/completions") as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
            assert r.headers["Allow"] == "POST"
        # Counted, as no endpoint counts them: a client with a typo in its base URL leaves a trace.
        after = await refused()
        assert (after["404"] - before["404"], after["405"] - before["405"]) == (1, 1)
        async with s.head(server.url + "/health") as r:
            assert r.status == 200
        async with s.get(server.url + "/health") as r:
            assert r.status == 200
        async with s.get(server.url + "/ready") as r:
            assert r.status == 200
    resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still here"}],
                                                max_tokens=1)
    assert resp.choices[0].finish_reason in ("stop", "length")
    # A history holding an earlier refusal, as the SDK hands it back.
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
               {"role": "user", "content": "y"}]
    resp = await client.chat.completions.create(model=MODEL, messages=history, max_tokens=1)
    assert resp.choices[0].finish_reason in ("stop", "length")


async def test_auth_from_config_and_env(monkeypatch, tiny_model_dir):
    # Spaces around the parts are the writer's, not the key's (a client cannot send them).
    monkeypatch.setenv("KVGATE_API_KEYS", "envkey:envtenant:to-b, spaced : team-s : to-c ")
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="inprocess")],
                         api_keys=[ApiKeyConfig(key="sk-good", tenant="acme")])
    app = create_app(config)
    server = await start_server(app)
    try:
        seen = record_requests(app[GATEWAY].replicas[0].engine)
        bad = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-bad", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await bad.close()
        # No key is not a wrong key: OpenAI's 401 for it has no code.
        async with aiohttp.ClientSession() as session:
            # Two credentials, the client's and a proxy's beside it: neither is taken (the first was).
            twice = CIMultiDict([("Authorization", "Bearer sk-good"), ("Authorization", "Bearer sk-x")])
            async with session.get(server.url + "/v1/models", headers=twice) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
            for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer   "}, {"Authorization": "sk-good"}):
                async with session.get(server.url + "/v1/models", headers=headers) as r:
                    error = (await r.json())["error"]
                    wanted = "invalid_api_key" if headers.get("Authorization") == "sk-good" else None
                    assert r.status == 401 and error["code"] == wanted and error["type"] == "invalid_request_error", error
                    assert error["message"].startswith("Incorrect" if wanted else "You didn't provide an API key")
        for key, tenant, workload in (("sk-good", "acme", "to-c"), ("envkey", "envtenant", "to-b"),
                                      ("spaced", "team-s", "to-c")):
            good = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            await good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
            await good.close()
            ctx = seen[-1].context
            assert (ctx.tenant, ctx.workload) == (tenant, workload)
    finally:
        await server.stop()


async def test_malformed_requests_and_odd_keys_are_refused_quietly(tiny_model_dir, caplog):
    """A request aiohttp cannot parse gets its 400 without an ERROR traceback that
    quotes its bytes (an API key with them); a key that is not ASCII is a 401."""
    config = tiny_config(tiny_model_dir, [ReplicaConfig(kind="inprocess")],
                         api_keys=[ApiKeyConfig(key="sk-good", tenant="acme")])
    app = create_app(config)
    server = await start_server(app)
    try:
        host, port = server.url.split("//")[1].split(":")
        with caplog.at_level(logging.DEBUG):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-SECRET-123\nX: y\r\n\r\n")
            await writer.drain()
            status_line = (await asyncio.wait_for(reader.read(1024), 10)).split(b"\r\n")[0]
            assert status_line.startswith(b"HTTP/1.") and b" 400 " in status_line
            writer.close()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not any("sk-SECRET" in r.getMessage() or r.exc_info for r in caplog.records)
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/v1/models", headers={"Authorization": "Bearer sk-\u00e9t\u00e9"}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        good = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-good", max_retries=0)
        assert [m.id for m in (await good.models.list()).data] == [MODEL]
        await good.close()
    finally:
        await server.stop()


async def test_shared_prefix_goes_where_cached_and_burst_spreads(gw):
    app, server, client, engines, seen = gw
    await _settled(app)
    system = "You are a careful assistant. Answer the question briefly and politely. " * 8
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    counts = [len(s) for s in seen]
    await client.chat.completions.create(model=MODEL, messages=msgs("q0"), max_tokens=1)
    owner = 0 if len(seen[0]) > counts[0] else 1
    for i in range(4):
        resp = await client.chat.completions.create(model=MODEL, messages=msgs(f"q{i + 1}"), max_tokens=1)
        assert resp.usage.prompt_tokens_details.cached_tokens > 0
    assert len(seen[owner]) - counts[owner] == 5 and len(seen[1 - owner]) == counts[1 - owner]
    await asyncio.gather(
        *(client.chat.completions.create(model=MODEL, messages=msgs(f"b{i}"), max_tokens=20, extra_body=FIXED)
          for i in range(8))
    )
    assert len(seen[1 - owner]) > counts[1 - owner], "a burst must spread over both replicas"
    router = app[GATEWAY].router
    assert router.inflight_tokens == [0, 0] and router.inflight_requests == [0, 0]


async def test_metrics_series(gw):
    app, server, client, engines, seen = gw
    turn = [{"role": "user", "content": "x"}]
    reply = await client.chat.completions.create(model=MODEL, messages=turn, max_tokens=1)
    # The second turn resends the first: its tokens come from the chat tokenizer's cache.
    turn += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "y"}]
    await client.chat.completions.create(model=MODEL, messages=turn, max_tokens=1)
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/metrics") as r:
            text = await r.text()
    hits = re.search(r'^kvgate_chat_tokenize_cache_tokens_total\{result="hit"\} (\S+)$', text, re.M)
    assert hits is not None and float(hits.group(1)) > 0, text
    for name in (
        'kvgate_requests_total{endpoint="chat",status="200",workload="to-c"}',
        "kvgate_time_to_first_token_seconds_bucket",
        "kvgate_e2e_request_latency_seconds_bucket",
        "kvgate_prefix_cache_queries_tokens_total",
        "kvgate_router_decisions_total",
        'kvgate_replica_healthy{replica="r0"} 1.0',
        'kvgate_replica_inflight{replica="r1"} 0.0',
    ):
        assert name in text, name


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_and_releases(gw, stream):
    app, server, client, engines, seen = gw
    await _settled(app)
    aborted = [count_aborts(e) for e in engines]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 500, "ignore_eos": True,
            "stream": stream}
    router = app[GATEWAY].router
    session = aiohttp.ClientSession()
    try:
        if stream:
            resp = await session.post(server.url + "/v1/chat/completions", json=body)
            await resp.content.readline()
            resp.close()
        else:
            # No headers come before the whole answer: give up while waiting for them.
            pending = asyncio.create_task(session.post(server.url + "/v1/chat/completions", json=body))
            await wait_for(lambda: any(router.inflight_requests), what="in flight")
            await asyncio.sleep(0.2)
            assert any(e.stats()["running"] for e in engines)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
    finally:
        await session.close()
    try:
        # 500 tokens take far longer than this: only an abort frees the blocks in time.
        await wait_for(lambda: all(engine_idle(e) for e in engines) and router.inflight_requests == [0, 0],
                       timeout=3, what="aborted and released")
        assert sum(len(a) for a in aborted) == 1
        assert router.inflight_tokens == [0, 0]
    finally:
        for e in engines:
            del e._abort


async def test_no_healthy_replica_is_503(gw):
    app, server, client, engines, seen = gw
    replicas = app[GATEWAY].replicas
    for r in replicas:
        r.healthy = False
    try:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
        assert info.value.status_code == 503
        # A retry hint for clients other than OpenAI's SDKs (which retry 503s anyway).
        assert info.value.response.headers["Retry-After"] == "1"
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/ready") as r:
                assert r.status == 503
        assert (await client.models.list()).data == []
    finally:
        for r in replicas:
            r.healthy = True


async def test_image_parts_are_hashed_by_content(gw):
    app, server, client, engines, seen = gw

    def msgs(data):
        return [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}},
        ]}]

    counts = [len(s) for s in seen]
    for data in ("AAAA", "BBBB"):
        await client.chat.completions.create(model=MODEL, messages=msgs(data), max_tokens=1)
    reqs = [r for s, c in zip(seen, counts) for r in s[c:]]
    assert len(reqs) == 2
    assert all(r.context.workload == "multimodal" and r.context.type == "image" for r in reqs)
    (off_a, hash_a), (off_b, hash_b) = reqs[0].mm_hashes[0], reqs[1].mm_hashes[0]
    assert off_a == off_b and hash_a != hash_b
    assert reqs[0].prompt_token_ids == reqs[1].prompt_token_ids


async def test_browser_pages_from_allowed_origins_may_call_the_api(tiny_model_dir):
    """server.cors_allow_origins: a browser's preflight is answered for the
    origins named, the responses carry Access-Control-Allow-Origin (and expose
    x-request-id), and other origins get neither; unset, a preflight is a 405.
    Every answer varies by Origin, also those without the allow header, so a
    shared cache never hands one origin's copy to another.  An origin written
    as no browser sends it (upper case, the default port) is still the page's."""
    page, other = "https://app.example.com", "https://evil.example"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    for origins in (["HTTPS://App.Example.com:443"], []):
        server = await start_server(create_app(tiny_config(tiny_model_dir, cors_allow_origins=origins)))
        url = server.url + "/v1/chat/completions"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.options(url, headers={"Origin": page, **preflight}) as r:
                    if not origins:
                        assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers
                        continue
                    assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == page
                    assert r.headers["Access-Control-Allow-Methods"] == "POST"
                    assert r.headers["Access-Control-Allow-Headers"] == preflight["Access-Control-Request-Headers"]
                async with s.post(url, json=body, headers={"Origin": page}) as r:
                    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == page
                    assert "x-request-id" in r.headers["Access-Control-Expose-Headers"]
                async with s.options(url, headers={"Origin": other, **preflight}) as r:
                    assert r.status == 403 and (await r.json())["error"]["code"] == "origin_not_allowed"
                    assert "Access-Control-Allow-Origin" not in r.headers
                async with s.post(url, json=body, headers={"Origin": other}) as r:
                    assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
                    assert r.headers["Vary"] == "Origin"
                async with s.get(server.url + "/v1/models") as r:  # no Origin at all
                    assert r.status == 200 and r.headers["Vary"] == "Origin"
                async with s.options(server.url + "/v1/models", headers={"Origin": page, **preflight}) as r:
                    assert r.status == 204 and r.headers["Access-Control-Allow-Methods"] == "GET, HEAD"
        finally:
            await server.stop()


async def test_a_page_in_chromium_calls_the_api_only_from_an_allowed_origin(tiny_model_dir, tmp_path):
    """The real client of CORS: a page in headless Chromium posts a chat request
    with an API key (a preflighted request) and reads the answer when its origin
    is allowed; the browser itself refuses it when not."""
    from tests.test_dashboard import run_chromium

    pages = web.Application()
    script = """<html><body><pre id="out">pending</pre><script>
      fetch(new URLSearchParams(location.search).get("api") + "/v1/chat/completions", {method: "POST",
        headers: {"Authorization": "Bearer sk-page", "Content-Type": "application/json"},
        body: JSON.stringify({model: "%s", messages: [{role: "user", content: "hi"}], max_tokens: 2})})
      .then(r => r.json().then(j => "answered " + j.object + " " + (r.headers.get("x-request-id") || "no-id")))
      .catch(e => "refused " + e.name)
      .then(text => { document.getElementById("out").textContent = text; });
    </script></body></html>""" % MODEL
    pages.router.add_get("/", lambda request: web.Response(text=script, content_type="text/html"))
    page_server = await start_server(pages)
    try:
        for origins, expected in (([page_server.url], "answered chat.completion chatcmpl-"), ([], "refused TypeError")):
            api = await start_server(create_app(tiny_config(tiny_model_dir, cors_allow_origins=origins)))
            try:
                dom = await run_chromium(tmp_path, f"{page_server.url}/?api={api.url}", "--dump-dom")
                assert expected in dom, dom[-500:]
            finally:
                await api.stop()
    finally:
        await page_server.stop()


async def test_fields_nothing_reads_are_logged_once_each(gw, caplog):
    """Ignored as vLLM ignores them (OpenAI would refuse them), but named once in the
    log: a misspelt option (``temprature``) would otherwise go unnoticed."""
    app, server, client, engines, seen = gw
    msgs = [{"role": "user", "content": "x"}]
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        for _ in range(2):
            ok = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                                      extra_body={"temprature": 0.2, "store": True, "top_k": 3})
            assert ok.choices[0].finish_reason in ("stop", "length")
        await client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"temprature": 1})
    logged = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert logged == ["requests carry fields the kvgate engine does not read, ignored: 'store', 'temprature'"]


async def test_the_completions_default_max_tokens_counts_against_the_context(gw):
    """Completions without max_tokens get 16, OpenAI's and vLLM's default, and it
    counts against the context as a max_tokens sent does: a prompt that leaves
    less room is a 400 (as from OpenAI and vLLM), not a shorter answer.  Each
    prompt is judged by its own length: a long neighbour that fits does not
    shorten a short prompt's answer."""
    app, server, client, engines, seen = gw
    context = app[GATEWAY].max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt=[[7, 8], [7] * (context - 5)], temperature=0, extra_body=FIXED)
    assert info.value.code == "context_length_exceeded"
    assert f"you requested {context + 11} tokens ({context - 5} in the prompt, 16 in the completion)" in info.value.message
    long_prompt = [7] * (context - 16)  # room for the default exactly
    resp = await client.completions.create(model=MODEL, prompt=[[7, 8], long_prompt], temperature=0, extra_body=FIXED)
    by_index = {c.index: c for c in resp.choices}
    assert resp.usage.completion_tokens == 16 + 16
    assert by_index[0].finish_reason == by_index[1].finish_reason == "length"
    alone = await client.completions.create(model=MODEL, prompt=[[7, 8]], temperature=0, extra_body=FIXED)
    assert by_index[0].text == alone.choices[0].text and alone.usage.completion_tokens == 16
    # min_tokens must fit every prompt's answer.
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt=[[7, 8], long_prompt], extra_body={"min_tokens": 17})
    assert info.value.param == "min_tokens" and "at most max_tokens (16)" in info.value.message
    await _settled(app)


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenised(gw, monkeypatch):
    """Any key holder could send a prompt of megabytes: tokenised whole before its
    length was checked, it took seconds of CPU and gigabytes of memory for a
    400.  Past what the context's tokens could hold at the tokenizer's longest
    piece per token, it is refused at once (the tokenizer is never called); a
    token list, by its length."""
    app, _, client, _, _ = gw
    gateway = app[GATEWAY]
    hasher = gateway.hasher

    def never(*args, **kwargs):
        raise AssertionError("tokenised")

    longest = max(len(piece) for piece in hasher.tokenizer.get_vocab())
    bound = gateway.max_model_len * 2 * longest
    monkeypatch.setattr(hasher, "chat", never)
    monkeypatch.setattr(hasher, "text", never)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a" * (bound + 1)}])
    assert info.value.code == "context_length_exceeded"
    assert (f"your messages ran to {bound + 1} characters, more than {gateway.max_model_len} tokens can hold"
            in info.value.message)
    for prompt in ("a" * (bound + 1), [5] * (gateway.max_model_len + 1)):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert info.value.code == "context_length_exceeded"
    monkeypatch.undo()
    # Within the bound, a prompt is tokenised and judged by its tokens, as before.
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt="word " * gateway.max_model_len, max_tokens=1)
    assert "However, you requested" in info.value.message
    # A tokenizer that cannot list its vocabulary sets no bound (it failed every request).
    def no_vocab():
        raise NotImplementedError

    monkeypatch.setattr(hasher.tokenizer, "get_vocab", no_vocab)
    monkeypatch.setattr(gateway, "_token_chars", None)
    assert (await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)).choices
    monkeypatch.undo()
