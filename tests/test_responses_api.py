"""POST /v1/responses over a real engine (tiny model), through the official SDK.

The answer must be the chat endpoint's answer to the same conversation (the
instructions as its system message), shaped as OpenAI's Responses API shapes it.
"""

from __future__ import annotations

import json
import logging

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.app import GATEWAY, create_app
from gateway.config import LimitsConfig, ReplicaConfig, RouterConfig
from gateway.errors import ApiError
from gateway.protocol import CHAT, parse_request
from gateway.responses_api import chat_request
from gateway.server import start_server
from tests.engine_procs import tiny_config, wait_for
from tests.gateway_helpers import serving
from tests.test_gateway_engine import _config

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
EVENT = TypeAdapter(ResponseStreamEvent)
INSTRUCTIONS = "Answer in one word."
HISTORY = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]},
]
# The same conversation as chat messages.
CHAT_MESSAGES = [
    {"role": "system", "content": INSTRUCTIONS},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tiny_model_dir):
    async with serving(create_app(_config(tiny_model_dir, replicas=1))) as running:
        yield running


async def _chat_answer(client, max_tokens: int):
    return await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=max_tokens,
                                                temperature=0)


async def test_a_response_is_the_chat_answer_to_the_same_conversation(gw):
    _, _, client = gw
    chat = await _chat_answer(client, 6)
    resp = await client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=HISTORY, max_output_tokens=6,
                                         temperature=0, metadata={"team": "search"})
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.output_text == chat.choices[0].message.content
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    if chat.choices[0].finish_reason == "length":  # a random tiny model rarely ends by itself
        assert resp.status == message.status == "incomplete"
        assert resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == message.status == "completed" and resp.incomplete_details is None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.input_tokens_details.cached_tokens > 0  # the chat request just left its blocks
    # What the request asked for, as the response states it; nothing was stored.
    assert resp.instructions == INSTRUCTIONS and resp.max_output_tokens == 6 and resp.temperature == 0
    assert resp.metadata == {"team": "search"} and resp.to_dict()["store"] is False
    assert resp.error is None
    # OpenAI's: a completion time once completed, none while incomplete.
    assert (resp.completed_at is None) == (resp.status != "completed")
    assert resp.completed_at is None or resp.completed_at >= resp.created_at
    Response.model_validate(resp.to_dict())  # every field the SDK's type requires, of its type


async def test_a_streamed_response_sends_openais_events_in_order(gw):
    _, _, client = gw
    whole = await client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=HISTORY, max_output_tokens=8,
                                          temperature=0)
    events = [e async for e in await client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=HISTORY, max_output_tokens=8, temperature=0, stream=True)]
    kinds = [e.type for e in events]
    for event in events:
        EVENT.validate_python(event.to_dict())
    ending = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", ending]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == whole.status and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == item_id

    # The SDK's own accumulator takes the events as OpenAI's (it checks ids and order).
    async with client.responses.stream(model=MODEL, instructions=INSTRUCTIONS, input=HISTORY, max_output_tokens=8,
                                       temperature=0) as stream:
        seen = [event async for event in stream]
    assert seen[-1].type == ending and seen[-1].response.output_text == text


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "tools", "Tool calling is not supported"),
    ({"input": "hi", "background": True}, "background", "'background' is not supported"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "truncation 'auto' is not supported"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs", "Logprobs are not supported"),
    ({}, "input", "Missing required parameter: 'input'"),
    ({"input": 5}, "input", "expected a string or an array of input items"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "not supported by kvgate"),
    ({"input": "hi", "reasoning": {"summary": "brief"}}, "reasoning.summary", "Supported values are: 'auto'"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "summary_text", "text": "x"}]}]},
     "input[0].content[0]", "expected a reasoning_text part"),
    ({"input": [{"type": "reasoning", "summary": [], "content": "x"}]}, "input[0].content", "expected an array"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "built-in tools are OpenAI's"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name", "Missing required parameter"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name", "names none of 'tools'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments",
     "Missing required parameter"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output",
     "expected a string or an array of input_text parts"),
    ({"input": "hi", "max_tool_calls": 1}, "max_tool_calls", "'max_tool_calls' is not supported"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
     "tool_choice.name", "Missing required parameter: 'tool_choice.name'"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}] * 600}, "input",
     "Too many input items: 1800."),
    # A call folded into the assistant message before it: later errors still name their own input index.
    ({"instructions": "x", "input": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
        {"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[4].content[0].text", "'input[4].content[0].text': expected a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type",
     "Supported values are"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0].image_url",
     "no Files API"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x/a.png"}]}]},
     "input[0].content[0].image_url", "Invalid 'input[0].content[0].image_url': expected an http(s) URL"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": ""}]}]},
     "input[0].content[0].image_url", "Missing required parameter: 'input[0].content[0].image_url'."),
    # Text a turn gave after its call, folded into the call's message: its errors name its own item.
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"role": "assistant", "content": [{"type": "output_text", "text": 5}]}]},
     "input[2].content[0].text", "'input[2].content[0].text': expected a string"),
    # Errors of the chat parsing, in this API's names: the instructions shift chat's message indexes.
    ({"instructions": "x", "input": [{"role": "user", "content": "a"},
                                     {"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[1].content[0].text", "'input[1].content[0].text': expected a string"),
    ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens", "max_output_tokens is too large"),
    ({"input": "hi", "max_output_tokens": "5"}, "max_output_tokens", "expected an integer"),
    ({"input": "hi " * 3000}, "input", "maximum context length is 1024 tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
     "text.format", "text.format 'json_schema' is not supported by the kvgate engine"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata.k", "'metadata.k': expected a string, but got a number"),
    ({"input": "hi", "metadata": ["k"]}, "metadata", "expected an object of strings"),
    # Values OpenAI's own types refuse, which the answer would have echoed back.
    ({"input": "hi", "reasoning": {"effort": "ultra"}}, "reasoning.effort", "Supported values are: 'none', 'minimal'"),
    ({"input": "hi", "text": {"verbosity": "loud"}}, "text.verbosity", "Supported values are: 'low', 'medium', 'high'"),
    ({"input": "hi", "include": ["bogus.thing"]}, "include[0]", "Invalid value for 'include[0]': \"bogus.thing\""),
    # Not a string at all: a 400 naming it, not a 500 (the SDK retries a 500 twice).
    ({"input": "hi", "include": [{"a": 1}]}, "include[0]", "Invalid value for 'include[0]': {\"a\": 1}"),
    ({"input": "hi", "include": [["x"]]}, "include[0]", "Invalid value for 'include[0]': [\"x\"]"),
    ({"input": "hi", "prompt_cache_key": 5}, "prompt_cache_key", "expected a string"),
    ({"input": "hi", "safety_identifier": 5}, "safety_identifier", "expected a string"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata.k", "values at most 512"),
    ({"input": "hi", "tools": "x"}, "tools", "expected an array"),
    ({"input": "hi", "background": "no"}, "background", "expected a boolean"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "only 'auto' and 'none' are allowed"),
    ({"input": "hi", "tool_choice": 123}, "tool_choice", "only 'auto' and 'none' are allowed"),
    ({"input": "hi", "parallel_tool_calls": "x"}, "parallel_tool_calls", "expected a boolean"),
    ({"input": "hi", "reasoning": {"effort": 3}}, "reasoning.effort", "Invalid value for 'reasoning.effort': 3"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": 5}]}]},
     "input[0].content[0].image_url", "expected a string"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name",
     "Missing required parameter: 'text.format.name'"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": "s"}}}, "text.format.schema",
     "expected an object"),
    ({"instructions": "x", "input": [{"role": "user", "content": "a"}] * 2000}, "input",
     "Too many input items: 2000. This server allows at most 1023 with instructions"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png", "detail": 1}]}]},
     "input[0].content[0].detail", "expected a string"),
    # An output of no call in the input before it (OpenAI's check).
    ({"input": [{"role": "user", "content": "w?"}, {"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
     "input", "No tool call found for function call output with call_id call_9."),
    # What the client wrote stays as written, field-like words and all.
    ({"input": [{"role": "messages", "content": "x"}]}, "input[0].role", "'input[0].role': \"messages\""),
])
async def test_requests_a_stateless_engine_cannot_honour_are_refused_by_name(gw, body, param, words):
    _, server, _ = gw
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/responses", json={"model": MODEL, **body}) as resp:
            error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == param and words in error["message"], error


async def test_an_input_item_typed_null_is_a_message_and_a_model_name_is_quoted_as_sent(gw):
    _, server, client = gw
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "input": [{"type": None, "role": "user", "content": "hi"}], "max_output_tokens": 1}
        async with session.post(server.url + "/v1/responses", json=body) as resp:
            assert resp.status == 200, await resp.text()
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="acme-messages-max_tokens", input="hi")
    assert "`acme-messages-max_tokens`" in info.value.message


async def test_a_refusal_reaches_the_sdk_and_the_request_id_names_the_response(gw):
    _, server, client = gw
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input="hi", previous_response_id="resp_earlier")
    assert info.value.param == "previous_response_id"
    named = await client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2,
                                                            extra_headers={"X-Request-Id": "trace-42"})
    assert named.headers["x-request-id"] == "resp_trace-42" and named.parse().id == "resp_trace-42"
    # Nothing is stored, so nothing can be fetched back.
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.retrieve("resp_trace-42")
    assert "kvgate stores no responses" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:  # another endpoint, not a response's id
        await client.responses.input_tokens.count(model=MODEL, input="hi")
    assert "Unknown request URL" in info.value.message
    async with aiohttp.ClientSession() as session:
        async with session.get(server.url + "/metrics") as resp:
            metrics = await resp.text()
    assert 'kvgate_requests_total{endpoint="responses",status="200",workload="to-c"}' in metrics
    assert 'kvgate_requests_total{endpoint="responses",status="400"' in metrics


async def test_fields_sent_as_null_read_as_unset(gw):
    """Agent frameworks send every field, null where unset: each reads as absent,
    and the response states the defaults, as OpenAI's does."""
    _, server, _ = gw
    nulls = dict.fromkeys(("instructions", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "text",
                           "truncation", "reasoning", "metadata", "previous_response_id", "conversation", "prompt",
                           "top_logprobs", "user", "background", "max_tool_calls", "service_tier"))
    body = {**nulls, "model": MODEL, "input": "hi", "max_output_tokens": 2, "tools": [], "include": [], "store": False}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/responses", json=body) as resp:
            answer = await resp.json()
    assert resp.status == 200, answer
    stated = {name: answer[name] for name in ("instructions", "tool_choice", "parallel_tool_calls", "temperature",
                                              "top_p", "text", "truncation", "metadata", "tools", "store")}
    assert stated == {"instructions": None, "tool_choice": "auto", "parallel_tool_calls": True, "temperature": 1.0,
                      "top_p": 1.0, "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
                      "tools": [], "store": False}


async def test_a_response_states_the_sampling_the_models_generation_config_gave_it(tiny_model_dir, tmp_path):
    """A request that leaves temperature and top_p out is sampled with the model's
    generation_config defaults (as vLLM's): the response states those, as OpenAI's
    states what it sampled with, not 1.0; a value the request gave is stated as given."""
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    given = model_dir / "generation_config.json"
    config = json.loads(given.read_text()) if given.exists() else {}
    given.write_text(json.dumps({**config, "temperature": 0.2, "top_p": 0.5}))
    async with serving(create_app(_config(str(model_dir), replicas=1))) as (_, _, client):
        resp = await client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
        assert (resp.temperature, resp.top_p) == (0.2, 0.5)
        events = [e async for e in await client.responses.create(model=MODEL, input="hi", max_output_tokens=1,
                                                                 stream=True)]
        assert (events[0].response.temperature, events[-1].response.top_p) == (0.2, 0.5)
        resp = await client.responses.create(model=MODEL, input="hi", max_output_tokens=1, temperature=0.7)
        assert (resp.temperature, resp.top_p) == (0.7, 0.5)


@pytest.mark.parametrize("choice", ["auto", "none"])
async def test_a_tool_choice_that_asks_nothing_needs_no_tools(gw, choice):
    """The Agents SDK sends tools: [] with its tool_choice setting; chat would refuse
    a tool_choice without tools, so auto and none are not passed on."""
    _, server, _ = gw
    body = {"model": MODEL, "input": "hi", "tools": [], "tool_choice": choice, "max_output_tokens": 1}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/responses", json=body) as resp:
            answer = await resp.json()
    assert resp.status == 200 and answer["tool_choice"] == choice, answer


async def test_fields_the_engine_does_not_read_are_logged_as_the_client_sent_them(gw, caplog):
    """reasoning goes to chat as reasoning_effort, which the kvgate engine does not
    read: the log names what the client sent (and this API's own unread fields)."""
    _, _, client = gw
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        await client.responses.create(model=MODEL, input="hi", max_output_tokens=1, reasoning={"effort": "low"},
                                      extra_body={"temprature": 0.2})
    logged = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert logged == ["requests carry fields the kvgate engine does not read, ignored: 'reasoning', 'temprature'"]


async def test_reasoning_between_folded_calls_joins_in_order_on_its_turns_message():
    """Each reasoning item before a function call folded into the turn's message
    adds to that message's reasoning, in order, joined once the input is read (it
    was re-joined at each call: 27,000 such pairs took 146 s of one core)."""

    def thought(text):
        return {"type": "reasoning", "content": [{"type": "reasoning_text", "text": text}]}

    def call(i):
        return {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}

    items = [{"role": "user", "content": "go"}, thought("first"), call(0), thought(""), call(1), thought("second"),
             call(2), {"type": "function_call_output", "call_id": "c0", "output": "done"}]
    chat, _ = chat_request({"model": "m", "input": items})
    turn = chat["messages"][1]
    assert [c["id"] for c in turn["tool_calls"]] == ["c0", "c1", "c2"]
    assert turn["reasoning"] == turn["reasoning_content"] == "first\n\nsecond"
    assert all(key.startswith(("role", "content", "tool", "reasoning")) for m in chat["messages"] for key in m)


async def test_text_before_and_after_a_call_stays_with_the_call_so_its_output_follows_it():
    """A streamed answer of text, a call, more text is three items (as OpenAI streams
    them); handed back with the call's output (the SDK's documented round trip), the
    tool message must follow the one assistant message holding the turn's calls,
    not a second assistant message that chat templates and servers take as a new turn."""

    items = [{"role": "user", "content": "Weather?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check. "}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
             {"type": "function_call_output", "call_id": "c1", "output": "18 C"}]
    chat, _ = chat_request({"model": "m", "input": items})
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool"]
    turn = chat["messages"][1]
    assert [c["id"] for c in turn["tool_calls"]] == ["c1"]
    assert turn["content"] == [{"type": "text", "text": "Let me check. "}, {"type": "text", "text": "Done."}]


async def test_an_error_in_text_joined_after_a_call_names_its_own_item():
    """Text a turn gave before and after its calls joins one message: an error in
    the later text names that item (input[3]), not the earlier one's part 1."""
    items = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "Let me check."},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
             {"role": "assistant", "content": [{"type": "output_text", "text": 5}]}]
    with pytest.raises(ApiError) as info:  # refused by the translation or by chat's parsing, renamed
        chat, call = chat_request({"model": "m", "input": items})
        try:
            parse_request(CHAT, chat, LimitsConfig())
        except ApiError as exc:
            raise call.rename(exc)
    assert info.value.param == "input[3].content[0].text", info.value.param
    assert "'input[3].content[0].text': expected a string" in info.value.message


def _delta(**fields):
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def _call(index, name, arguments="{}"):
    return _delta(tool_calls=[{"index": index, "id": f"call_{name}", "type": "function",
                               "function": {"name": name, "arguments": arguments}}])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def external(tiny_model_dir):
    """A gateway in front of one scripted OpenAI-compatible server (a vLLM that
    parses tool calls and reasoning): it streams the chunks of the list yielded
    with the client, then the finish and usage."""
    script = []

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request):
        await request.read()
        chunks = [*script, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}}]
        body = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"
        return web.Response(body=body, content_type="text/event-stream")

    stub = web.Application()
    stub.router.add_get("/v1/models", models)
    stub.router.add_post("/v1/chat/completions", chat)
    upstream = await start_server(stub)
    app = create_app(tiny_config(tiny_model_dir, [ReplicaConfig(kind="openai", url=upstream.url, name="ext")],
                                 router=RouterConfig(health_interval_s=60)))
    try:
        async with serving(app) as (_, _, client):
            await wait_for(lambda: all(r.healthy for r in app[GATEWAY].replicas), what="healthy")
            yield client, script
    finally:
        await upstream.stop()


def _as_compared(response) -> dict:
    """A response as the whole and the streamed one must agree on: all but ids and
    times (each request has its own), and the SDK's parse of a stream's text and calls."""
    shown = response.to_dict()
    for key in ("id", "created_at", "completed_at"):
        shown.pop(key, None)
    for item in shown["output"]:
        item.pop("id")
        item.pop("parsed_arguments", None)
        for part in item.get("content") or ():
            part.pop("parsed", None)
    return shown


@pytest.mark.parametrize("script, items", [
    ([_delta(content="Hi "), _delta(content="there.")], [("message", "Hi there.")]),
    ([_call(0, "get_weather", '{"city": "Paris"}')], [("function_call", "get_weather")]),
    ([_delta(content="Let me check. "), _call(0, "get_weather")], [("message", "Let me check. "),
                                                                  ("function_call", "get_weather")]),
    ([_call(0, "get_weather"), _delta(content="Done.")], [("function_call", "get_weather"), ("message", "Done.")]),
    ([_delta(content="Let me check. "), _call(0, "get_weather"), _delta(content="Done.")],
     [("message", "Let me check. "), ("function_call", "get_weather"), ("message", "Done.")]),
    ([_call(0, "get_weather"), _delta(content="And "), _call(1, "get_time")],
     [("function_call", "get_weather"), ("message", "And "), ("function_call", "get_time")]),
    ([_delta(reasoning="Weather: "), _delta(reasoning="a tool."), _delta(content="Checking. "), _call(0, "get_weather")],
     [("reasoning", "Weather: a tool."), ("message", "Checking. "), ("function_call", "get_weather")]),
    # Interleaved thinking: each run of reasoning is an item of its own, as streamed.
    ([_delta(reasoning="First the weather."), _call(0, "get_weather"), _delta(reasoning="Now the time."),
      _call(1, "get_time")],
     [("reasoning", "First the weather."), ("function_call", "get_weather"), ("reasoning", "Now the time."),
      ("function_call", "get_time")]),
    # A server that skipped an index (its one call at 1): no nameless call at 0, whole.
    ([_call(1, "get_weather")], [("function_call", "get_weather")]),
    # Then a call without an index: the next after the highest (as chat gathers it), not the
    # count of calls so far (1, the index of get_weather: the stream joined the two into one).
    ([_call(1, "get_weather"), _delta(tool_calls=[{"id": "call_get_time", "type": "function",
                                                   "function": {"name": "get_time", "arguments": "{}"}}])],
     [("function_call", "get_weather"), ("function_call", "get_time")]),
    # A refusal (chat's delta.refusal) is its message's refusal part, after the text before it.
    ([_delta(refusal="I can't "), _delta(refusal="help with that.")],
     [("message", ("refusal", "I can't help with that."))]),
    ([_delta(content="Let me see. "), _delta(refusal="No.")], [("message", "Let me see. ", ("refusal", "No."))]),
], ids=["text", "call", "text, call", "call, text", "text, call, text", "call, text, call", "reasoning, text, call",
        "reasoning, call, reasoning, call", "a call at index 1", "a call at index 1, then one without an index",
        "refusal", "text, refusal"])
async def test_a_whole_response_is_what_the_sdk_gathers_from_its_stream(external, script, items):
    """However a server interleaves reasoning, text and calls in one choice, the
    whole response's output is the stream's, item for item, in the order the model
    produced them: a run of text or reasoning after another item is an item of its
    own (text, a call, more text was one message then the call, whole)."""
    client, scripted = external
    scripted[:] = script
    tools = [{"type": "function", "name": "get_weather"}, {"type": "function", "name": "get_time"}]
    whole = await client.responses.create(model=MODEL, input="Weather?", tools=tools)
    async with client.responses.stream(model=MODEL, input="Weather?", tools=tools) as stream:
        gathered = await stream.get_final_response()  # the SDK's own accumulator of the events
    assert _as_compared(whole) == _as_compared(gathered)
    assert [_shown_item(item) for item in whole.output] == items
    assert [item.status for item in whole.output] == ["completed"] * len(items)
    assert whole.output_text == gathered.output_text == "".join(  # a refusal is no output_text
        part for kind, *parts in items if kind == "message" for part in parts if isinstance(part, str))


def _shown_item(item) -> tuple:
    """A call's type and name; a message's or reasoning's type and parts: a text as
    itself, a refusal as ("refusal", its text)."""
    if item.type == "function_call":
        return item.type, item.name
    return item.type, *(("refusal", part.refusal) if part.type == "refusal" else part.text for part in item.content)


@pytest.mark.parametrize("script, parts", [
    ([_delta(refusal="I can't "), _delta(refusal="help with that.")], [("refusal", "I can't help with that.")]),
    ([_delta(content="Let me "), _delta(content="see. "), _delta(refusal="No "), _delta(refusal="way.")],
     [("output_text", "Let me see. "), ("refusal", "No way.")]),
], ids=["refusal", "text, refusal"])
async def test_a_servers_refusal_is_a_refusal_part_streamed_as_openais_refusal_events(external, script, parts):
    """A server's refusal (chat's delta.refusal, as OpenAI and vLLM with structured
    outputs send it) is a refusal part of the message, not an empty output_text:
    streamed as OpenAI streams one, a part of its own (after the text part, done
    before it begins) that grows by response.refusal.delta events."""
    client, scripted = external
    scripted[:] = script
    whole = await client.responses.create(model=MODEL, input="Help?")
    [message] = whole.output
    assert message.type == "message" and message.content[-1].type == "refusal"
    assert [(part.type, getattr(part, "text", None) or part.refusal) for part in message.content] == parts
    assert whole.output_text == "".join(text for kind, text in parts if kind == "output_text")

    events = [e async for e in await client.responses.create(model=MODEL, input="Help?", stream=True)]
    for event in events:
        EVENT.validate_python(event.to_dict())
    kinds = [e.type for e in events]
    runs = [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]  # a run of deltas as one
    expected = ["response.created", "response.in_progress", "response.output_item.added"]
    for kind, _ in parts:
        named = "response.output_text" if kind == "output_text" else "response.refusal"
        expected += ["response.content_part.added", f"{named}.delta", f"{named}.done", "response.content_part.done"]
    assert runs == [*expected, "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for index, (kind, text) in enumerate(parts):
        added, done = [e for e in events if e.type.startswith("response.content_part.") and e.content_index == index]
        assert added.part.type == done.part.type == kind and added.item_id == events[2].item.id
        assert (done.part.text if kind == "output_text" else done.part.refusal) == text
    refused = [e for e in events if e.type == "response.refusal.delta"]
    [refusal_done] = [e for e in events if e.type == "response.refusal.done"]
    assert "".join(e.delta for e in refused) == refusal_done.refusal == parts[-1][1]
    assert {e.content_index for e in [*refused, refusal_done]} == {len(parts) - 1}
    assert _as_compared(events[-1].response) == _as_compared(whole)


@pytest.mark.parametrize("max_output_tokens", [1, 8])
async def test_the_engines_whole_response_is_what_the_sdk_gathers_from_its_stream(gw, max_output_tokens):
    """The kvgate engine's answer (text only), whole and streamed: one output, its
    status (incomplete at max_output_tokens), usage and text alike."""
    _, _, client = gw
    asked = dict(model=MODEL, instructions=INSTRUCTIONS, input=HISTORY, max_output_tokens=max_output_tokens,
                 temperature=0)
    whole = await client.responses.create(**asked)
    events = [e async for e in await client.responses.create(**asked, stream=True)]
    final = events[-1].response  # the SDK gathers a stream only up to response.completed
    if final.status == "completed":
        async with client.responses.stream(**asked) as stream:
            final = await stream.get_final_response()
    compared = [_as_compared(whole), _as_compared(final)]
    for shown in compared:
        shown["usage"]["input_tokens_details"].pop("cached_tokens")  # the first request leaves its blocks
    assert compared[0] == compared[1]
    if max_output_tokens == 1:
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
