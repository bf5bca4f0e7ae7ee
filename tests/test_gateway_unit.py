"""Gateway pieces without a server: parsing, classification, router, indexes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_hash import block_hashes
from gateway.classify import Classifier, Principal
from gateway.config import ClassifierConfig, ClassifierRule, KvgateConfig, LimitsConfig, RouterConfig
from gateway.errors import ApiError
from gateway.prefix import PrefixHasher
from gateway.protocol import CHAT, COMPLETIONS, ParsedRequest, parse_json, parse_request
from gateway.shapes import StreamFormatter, merge_delta_extra
from gateway.router import ApproxIndex, ExactIndex, Router
from bench.instant_engine import ByteTokenizer  # a byte-per-token stub is all hashing tests need

LIMITS = LimitsConfig()


def chat(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return parse_request(CHAT, body, LIMITS)


def test_image_parts_must_be_fetchable_and_from_the_user():
    def image(url, role="user"):
        return chat(messages=[{"role": role, "content": [{"type": "image_url", "image_url": {"url": url}}]}])

    assert image("https://example.com/a.png").images == [b"https://example.com/a.png"]
    assert image("data:image/png;base64,iVBORw0KGgo=").images == [b"iVBORw0KGgo="]
    for url in ("not a url", "ftp://example.com/a.png", "data:image/png;base64,", "data:text/plain;base64,eA==",
                "data:image/png,raw", "https://", "data:image/png;base64,!!!!", "data:image/png;base64,iVBORw0KGgo"):
        with pytest.raises(ApiError) as info:
            image(url)
        assert info.value.param == "messages[0].content[0].image_url.url" and info.value.code == "invalid_value"
    for role in ("system", "developer", "assistant"):
        with pytest.raises(ApiError, match=r"only allowed in messages with role 'user' \(messages\[0\] is not one\)"):
            image("https://example.com/a.png", role)


def test_a_stop_list_with_a_non_string_names_the_element():
    """As OpenAI: "Invalid type for 'stop[1]'", not "expected ... an array of
    strings, but got an array instead"."""
    with pytest.raises(ApiError) as info:
        chat(stop=["a", 2])
    assert info.value.message == "Invalid type for 'stop[1]': expected a string, but got a number instead."
    assert info.value.param == "stop"


def test_fields_nothing_reads_are_named():
    assert chat().ignored is None
    assert chat(top_k=2, seed=1, cache_salt="s").ignored is None  # vLLM's, and read
    assert chat(store=True, temprature=1).ignored == {"store", "temprature"}
    # Refused fields are no ignored ones, default-valued or not.
    assert chat(guided_json=None, chat_template_kwargs={}).ignored is None
    # vLLM's per-chunk usage is not done: named too.
    assert chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}).ignored == {
        "stream_options.continuous_usage_stats"}
    # The other endpoint's own fields are read by neither: best_of on chat is no best-of.
    assert chat(best_of=3, echo=True, suffix="x", prompt="p").ignored == {"best_of", "echo", "suffix", "prompt"}
    completion = parse_request("completions", {"model": "m", "prompt": "p", "messages": [], "top_logprobs": 2,
                                               "tool_choice": "none"}, LimitsConfig())
    assert completion.ignored == {"messages", "top_logprobs", "tool_choice"}


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("temperature", 3, "temperature"),
        ("temperature", "hot", "temperature"),
        ("top_p", -0.1, "top_p"),
        ("n", 0, "n"),
        ("n", 99, "n"),
        ("n", True, "n"),
        ("max_tokens", -1, "max_tokens"),
        ("max_tokens", 10**30, "max_tokens"),
        ("max_completion_tokens", 5000, "max_completion_tokens"),
        ("stop", [1], "stop"),
        ("stop", ["a", "b", "c", "d", "e"], "stop"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("stream", "yes", "stream"),
        ("top_logprobs", 3, "top_logprobs"),
        ("seed", 1.5, "seed"),
        ("user", 5, "user"),
        ("messages", [], "messages"),
        ("messages", "hi", "messages"),
        ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
        ("messages", [{"role": "user"}], "messages[0].content"),
        ("messages", [{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type"),
        ("stream_options", {"include_usage": True}, "stream_options"),
    ],
)
def test_invalid_fields_name_the_param(field, value, param):
    with pytest.raises(ApiError) as info:
        chat(**{field: value})
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.type == "invalid_request_error"


def test_a_message_role_missing_or_unknown_is_said_in_json_terms():
    for message, said in (({"content": "x"}, "Missing required parameter: 'messages[0].role'."),
                          ({"role": None, "content": "x"}, "Missing required parameter: 'messages[0].role'."),
                          ({"role": "wizard", "content": "x"}, "Invalid value for 'messages[0].role': \"wizard\". "
                           "Supported values are: 'system', 'developer', 'user', 'assistant', 'tool' and 'function'.")):
        with pytest.raises(ApiError) as info:
            chat(messages=[message])
        assert info.value.message == said and info.value.param == "messages[0].role"


def test_valid_chat_fields_are_honoured_and_unknown_ignored():
    req = chat(
        temperature=0, top_p=0.5, n=2, stop="x", seed=7, max_completion_tokens=9, presence_penalty=1,
        frequency_penalty=-1, logprobs=True, top_logprobs=2, user="u1", stream=True,
        stream_options={"include_usage": True}, some_future_field={"x": 1},
        messages=[
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "again"},
        ],
    )
    s = req.sampling
    assert (s.temperature, s.top_p, s.n, s.stop, s.seed, s.logprobs) == (0, 0.5, 2, ["x"], 7, 2)
    assert req.max_tokens == 9 and req.include_usage and req.user == "u1"
    assert req.messages[0]["role"] == "system"
    assert req.images == [b"AAAA"] and req.user_turns == 2
    assert "<image>" in req.messages[1]["content"]
    # A tool's answer names the call it answers, as OpenAI requires.
    history = [{"role": "user", "content": "add"}, {"role": "assistant", "content": None}]
    answered = chat(messages=history + [{"role": "tool", "tool_call_id": "call_1", "content": "3"}])
    assert answered.messages[-1] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    with pytest.raises(ApiError) as info:
        chat(messages=history + [{"role": "tool", "content": "3"}])
    assert info.value.param == "messages[2].tool_call_id"


def test_streamed_call_fragments_add_up_to_the_whole_message():
    # As the OpenAI SDK accumulates a stream: ids and names once, arguments appended.
    message: dict = {}
    for delta in (
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1, '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"b": 2}'}}]},
        {"function_call": {"name": "legacy", "arguments": '{"x"'}},
        {"function_call": {"arguments": ": 3}"}},
        {"reasoning_content": "think"}, {"reasoning_content": "ing"},
    ):
        merge_delta_extra(message, delta)
    assert message == {
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
        "function_call": {"name": "legacy", "arguments": '{"x": 3}'},
        "reasoning_content": "thinking",
    }


def test_limits():
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}] * 5}, LimitsConfig(max_messages=4))
    assert info.value.status == 400 and info.value.param == "messages"
    # prompts x n: each is decoded on its own, so one request's share is capped.
    many = {"model": "m", "prompt": ["x"] * 16, "n": 8}
    with pytest.raises(ApiError) as info:
        parse_request(COMPLETIONS, many, LimitsConfig(max_choices=127))
    assert info.value.param == "n" and "16 prompts x n=8" in info.value.message
    assert len(parse_request(COMPLETIONS, many, LimitsConfig(max_choices=128)).prompts) == 16
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 8},
                      LimitsConfig(max_choices=4))
    assert info.value.param == "n"
    with pytest.raises(ApiError):
        parse_json(b"{not json")


def test_images_in_one_request_are_bounded():
    """Each image is hashed and spans prompt tokens of its own: with no bound, one
    request could carry hundreds of thousands (vLLM: --limit-mm-per-prompt)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    two_messages = [{"role": "user", "content": [image, image]}, {"role": "user", "content": [image]}]
    body = {"model": "m", "messages": two_messages}
    assert len(parse_request(CHAT, body, LimitsConfig(max_images=3)).images) == 3
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, body, LimitsConfig(max_images=2))
    assert info.value.status == 400 and info.value.param == "messages[1].content[0]"
    assert info.value.message == "Too many images: more than 2 in one request. This server allows at most 2."
    # OpenAI's bound by default.
    assert len(parse_request(CHAT, {"model": "m", "messages": [
        {"role": "user", "content": [image] * 500}]}, LimitsConfig()).images) == 500
    with pytest.raises(ApiError):
        parse_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": [image] * 501}]}, LimitsConfig())
    # 0: a text-only service refuses every image.
    with pytest.raises(ApiError):
        parse_request(CHAT, {"model": "m", "messages": two_messages[1:]}, LimitsConfig(max_images=0))
    with pytest.raises(ApiError):
        parse_json(b"\xff\xfe\xfa")
    with pytest.raises(ApiError):
        parse_json(b"[1, 2]")
    # UTF-8 only, a leading BOM tolerated; UTF-16 (which json's own sniffing would take) is refused.
    assert parse_json(b'\xef\xbb\xbf{"model": "m\xc3\xa9"}') == {"model": "m\u00e9"}
    with pytest.raises(ApiError):
        parse_json('{"model": "m"}'.encode("utf-16"))
    # Escaped characters (json.dumps' default for an emoji) are searched for lone
    # surrogates, however deep the body nests.
    deep = b'{"content": "\\ud83d\\ude00", "x": ' + b"[" * 900 + b'"\\udc00"' + b"]" * 900 + b"}"
    with pytest.raises(ApiError, match="lone surrogate"):
        parse_json(deep)
    assert parse_json(deep.replace(b'"\\udc00"', b"1"))["content"] == "\U0001f600"


def test_seed_minus_one_is_no_seed_as_in_vllm():
    assert chat(seed=-1).sampling.seed is None
    assert chat(seed=-2).sampling.seed == -2 and chat(seed=0).sampling.seed == 0


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out():
    defaults = {"temperature": 0.7, "top_k": 20}
    parse = lambda **kw: parse_request(  # noqa: E731
        CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}, LIMITS, False, defaults).sampling
    assert (parse().temperature, parse().top_k) == (0.7, 20)
    assert (parse(temperature=None).temperature, parse(temperature=0).temperature, parse(top_k=-1).top_k) == (0.7, 0, 0)
    assert chat().sampling.temperature == 1.0  # none given: OpenAI's


def test_earlier_tool_calls_reach_the_chat_template_as_vllm_hands_them_on():
    """An assistant turn's tool calls and a tool's answer were cut down to role and
    content: a template that writes them (Qwen2.5's, Llama 3.1's) got another
    prompt than under vLLM, silently.  Arguments go as an object (templates write
    ``arguments | tojson``), as vLLM turns them; text that is no object stays text."""
    from engine.chat_tokens import ChatTokenizer
    from tests.tiny_model import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
        "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "note", "arguments": "not json"}}]
    req = chat(messages=[{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "call_1", "content": "22C"}])
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert req.messages[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert req.messages[2]["tool_call_id"] == "call_1"
    hasher = PrefixHasher(tokenizer, 4, "salt", ChatTokenizer(tokenizer).encode_chat)
    ids = hasher.chat(req.messages).token_ids
    text = tokenizer.decode(ids)
    assert '<call>get_weather {"city": "Paris"}</call>' in text and "[call_1]" in text
    assert ids == tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    with pytest.raises(ApiError) as info:
        chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}])
    assert info.value.param == "messages[0].tool_calls[0].function.name"


def test_names_and_tools_reach_the_chat_template_as_vllm_hands_them_on():
    """vLLM gives the template every message's ``name`` and the request's ``tools``
    (with tool_choice "none" too): both were dropped, so a template that writes
    them (Qwen2.5's tools, a template's speaker names) got another prompt."""
    from engine.chat_tokens import ChatTokenizer
    from tests.tiny_model import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = chat(messages=[{"role": "user", "content": "Weather?", "name": "alice"}], tools=tools, tool_choice="none")
    assert req.engine_unsupported is None and req.messages[0]["name"] == "alice"
    hasher = PrefixHasher(tokenizer, 4, "salt", ChatTokenizer(tokenizer).encode_chat)
    ids = hasher.chat(req.messages, tools=tools).token_ids
    want = tokenizer.apply_chat_template(req.messages, tools=tools, add_generation_prompt=True, tokenize=True)
    assert ids == want["input_ids"] and "get_weather" in tokenizer.decode(ids) and "alice" in tokenizer.decode(ids)


def test_completions_prompt_forms():
    for prompt, count in (("hi", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1, 2], [3]], 2)):
        req = parse_request(COMPLETIONS, {"model": "m", "prompt": prompt}, LIMITS)
        assert len(req.prompts) == count
    for bad in ([], [1, "a"], 5, [[]], [-1]):
        with pytest.raises(ApiError):
            parse_request(COMPLETIONS, {"model": "m", "prompt": bad}, LIMITS)
    with pytest.raises(ApiError):
        parse_request(COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 6}, LIMITS)


def _with_specials(tok, single: str, token: str):
    """``tok`` with a post-processor adding ``token`` as ``single`` places it (real
    Llama 3 and Gemma tokenizers ship one that adds their BOS)."""
    from tokenizers import processors

    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(token, tok.convert_tokens_to_ids(token))])
    return tok


def test_completions_text_prompts_get_the_tokenizers_special_tokens_as_vllm_adds_them():
    from engine.chat_tokens import ChatTokenizer
    from tests.tokenizer_families import llama3_like, qwen2_like

    bos_first = _with_specials(llama3_like(), "<|begin_of_text|> $A", "<|begin_of_text|>")
    eos_last = _with_specials(llama3_like(), "$A <|eot_id|>", "<|eot_id|>")
    for tok in (bos_first, eos_last, qwen2_like()):
        # Through the piece cache too: a prompt written in the chat markup by the client.
        hasher = PrefixHasher(tok, 4, "salt", encoder=ChatTokenizer(tok).encode_text)
        for text in ("The capital of France is", "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", ""):
            assert hasher.text(text).token_ids == tok.encode(text, add_special_tokens=True)
            assert hasher.text(text, add_special_tokens=False).token_ids == tok.encode(text, add_special_tokens=False)
        assert hasher.text([5, 6, 7]).token_ids == [5, 6, 7]  # token ids are the client's, as they are
    assert PrefixHasher(bos_first, 4, "salt").text("hi").token_ids[0] == bos_first.convert_tokens_to_ids("<|begin_of_text|>")
    assert PrefixHasher(eos_last, 4, "salt").text("hi").token_ids[-1] == eos_last.convert_tokens_to_ids("<|eot_id|>")
    # The request's own say, as in vLLM: on completions, a boolean.
    parse = lambda **kw: parse_request(COMPLETIONS, {"model": "m", "prompt": "x", **kw}, LIMITS)  # noqa: E731
    assert parse().add_special_tokens and not parse(add_special_tokens=False).add_special_tokens
    assert parse(add_special_tokens=False).ignored is None
    with pytest.raises(ApiError) as info:
        parse(add_special_tokens="no")
    assert info.value.param == "add_special_tokens"


def test_stream_formatter_frames():
    fmt = StreamFormatter(CHAT, "chatcmpl-1", 5, "m", include_usage=True)
    frame = fmt.role(0)
    assert frame.startswith(b"data: {") and frame.endswith(b"\n\n")
    import json

    obj = json.loads(frame[6:])
    assert obj["object"] == "chat.completion.chunk" and obj["choices"][0]["delta"]["role"] == "assistant"
    assert obj["usage"] is None
    final = json.loads(fmt.usage({"prompt_tokens": 1})[6:])
    assert final["choices"] == [] and final["usage"] == {"prompt_tokens": 1}


@given(
    text=st.text(max_size=40),
    finish=st.sampled_from([None, "stop", "length"]),
    stop_reason=st.one_of(st.none(), st.text(max_size=8), st.integers(0, 200_000)),
    index=st.integers(0, 300),
    rid=st.text(max_size=12),
    model=st.text(max_size=12),
    include_usage=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_stream_formatter_fast_frames_are_json_dumps_bytes(text, finish, stop_reason, index, rid, model,
                                                           include_usage):
    """The string-built text frames must be byte for byte what json.dumps of the
    chunk gives; a choice's last chunk carries vLLM's stop_reason."""
    import json

    from gateway.shapes import ChoiceState

    for endpoint in (CHAT, COMPLETIONS):
        fmt = StreamFormatter(endpoint, rid, 1700000000, model, include_usage)
        chunk = {"id": rid, "object": "chat.completion.chunk" if endpoint == CHAT else "text_completion",
                 "created": 1700000000, "model": model, "system_fingerprint": None}
        if endpoint == CHAT:
            delta = {"content": text} if text or finish is None else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        chunk["choices"] = [choice]
        if include_usage:
            chunk["usage"] = None
        frame = fmt.delta(index, text, None, ChoiceState(), finish, stop_reason=stop_reason)
        assert frame == b"data: " + json.dumps(chunk).encode() + b"\n\n"
        if endpoint == CHAT:
            chunk["choices"] = [{"index": index, "delta": {"role": "assistant", "content": "", "refusal": None},
                                 "logprobs": None, "finish_reason": None}]
            assert fmt.role(index) == b"data: " + json.dumps(chunk).encode() + b"\n\n"


# ----------------------------------------------------------------------------- classification


def _hasher():
    return PrefixHasher(ByteTokenizer(), 4, "salt")


def test_classification_rules_first_match_wins():
    cfg = ClassifierConfig(file_min_tokens=100)
    clf = Classifier(cfg, _hasher())
    plain = chat()
    ctx = clf.classify(plain, Principal(), {}, 10, 2)
    assert (ctx.workload, ctx.type, ctx.turn) == ("to-c", "text", 1)
    # API key workload beats everything.
    ctx = clf.classify(plain, Principal("acme", "to-b"), {"X-KVGate-Workload": "multimodal"}, 10, 2)
    assert ctx.workload == "to-b" and ctx.tenant == "acme"
    # Header next.
    assert clf.classify(plain, Principal(), {"X-KVGate-Workload": "to-b"}, 10, 2).workload == "to-b"
    # Outcomes are remembered per combination of facts, never across them.
    assert clf.classify(plain, Principal(), {}, 10, 2).workload == "to-c"
    typed = clf.classify(plain, Principal(), {"X-KVGate-Type": " Search "}, 10, 2)
    assert (typed.workload, typed.type) == ("to-c", "search")
    assert clf.classify(plain, Principal(), {"X-KVGate-Type": "nonsense"}, 10, 2).type == "text"
    # Image parts.
    img = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])
    ctx = clf.classify(img, Principal(), {}, 10, 2)
    assert (ctx.workload, ctx.type) == ("multimodal", "image")
    # One long document.
    doc = chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "word " * 400}])
    ctx = clf.classify(doc, Principal(), {}, 2000, 500)
    # A document pasted into chat is a to-C file request (trace A's "file" type).
    assert (ctx.workload, ctx.type) == ("to-c", "file") and ctx.signature is not None
    # A long system prompt (an agent's instructions) or a long answer is no document.
    agent = chat(messages=[{"role": "system", "content": "rule " * 400}, {"role": "user", "content": "hi"}])
    assert clf.classify(agent, Principal(), {}, 2000, 500).type == "text"
    essay = chat(messages=[{"role": "user", "content": "an essay"}, {"role": "assistant", "content": "word " * 400},
                           {"role": "user", "content": "shorter"}])
    ctx = clf.classify(essay, Principal(), {}, 2000, 500)
    assert (ctx.type, ctx.turn) == ("text", 2)
    # Multi-turn chat.
    multi = chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    ctx = clf.classify(multi, Principal(), {}, 10, 2)
    assert (ctx.workload, ctx.turn) == ("to-c", 2)
    # Endpoint.
    comp = parse_request(COMPLETIONS, {"model": "m", "prompt": "x"}, LIMITS)
    ctx = clf.classify(comp, Principal(), {}, 10, 2)
    assert (ctx.workload, ctx.type) == ("to-b", "api")


def test_an_endpoint_rule_may_name_the_responses_api_alone():
    """A Responses request is a chat one to the rules (the defaults make both
    to-C), but a rule naming responses matches it alone; neither outcome is
    remembered for the other."""
    from gateway.responses_api import chat_request

    rules = [ClassifierRule(when="endpoint", endpoint="responses", workload="to-b", type="api"),
             ClassifierRule(when="endpoint", endpoint="chat", workload="to-c")]
    body, call = chat_request({"model": "m", "input": "hi"})
    via_responses = parse_request(CHAT, body, LIMITS)
    via_responses.responses = call
    for cfg, want in ((ClassifierConfig(rules=rules), ("to-b", "api")), (ClassifierConfig(), ("to-c", "text"))):
        clf = Classifier(cfg, _hasher())
        for _ in range(2):
            ctx = clf.classify(via_responses, Principal(), {}, 10, 2)
            assert (ctx.workload, ctx.type) == want
            assert clf.classify(chat(messages=[{"role": "user", "content": "hi"}]), Principal(), {}, 10, 2).workload == "to-c"


def test_tenant_rule_and_sessions():
    cfg = ClassifierConfig(rules=[ClassifierRule(when="tenant", tenant="acme", workload="to-b", type="search"), ClassifierRule(when="always", workload="to-c")])
    clf = Classifier(cfg, _hasher())
    ctx = clf.classify(chat(), Principal("acme"), {}, 10, 2)
    assert (ctx.workload, ctx.type) == ("to-b", "search")
    assert clf.classify(chat(), Principal("other"), {}, 10, 2).workload == "to-c"
    # A rule's own type is the operator's: a client's X-KVGate-Type sets the type only where
    # the rule that decided names none.
    assert clf.classify(chat(), Principal("acme"), {"X-KVGate-Type": "image"}, 10, 2).type == "search"
    assert clf.classify(chat(), Principal("other"), {"X-KVGate-Type": "image"}, 10, 2).type == "image"
    # Same opening messages -> same session; parent chat id chains turns.
    a = clf.classify(chat(messages=[{"role": "user", "content": "q1"}]), Principal(), {}, 5, 1)
    b = clf.classify(chat(messages=[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "r"}, {"role": "user", "content": "q2"}]), Principal(), {}, 5, 1)
    assert a.session == b.session and b.parent_chat_id == a.chat_id
    assert clf.classify(chat(user="alice"), Principal(), {}, 5, 1).session != a.session
    # A user's sessions span their chats, but a new chat is a first turn, not the
    # next turn of the last one (parent_chat_id as in Alibaba's traces).
    turn1 = chat(user="bob", messages=[{"role": "user", "content": "q1"}])
    turn2 = chat(user="bob", messages=[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "r"},
                                       {"role": "user", "content": "q2"}])
    other = chat(user="bob", messages=[{"role": "user", "content": "another chat"}])
    first, new_chat, second = (clf.classify(r, Principal(), {}, 5, 1) for r in (turn1, other, turn2))
    assert first.session == new_chat.session == second.session
    assert (first.parent_chat_id, new_chat.parent_chat_id, second.parent_chat_id) == (-1, -1, first.chat_id)
    # Completions are single calls: no parent, whatever template they share.
    comp = parse_request(COMPLETIONS, {"model": "m", "prompt": "template x"}, LIMITS)
    assert [clf.classify(comp, Principal(), {}, 5, 1).parent_chat_id for _ in range(2)] == [-1, -1]


def test_openais_successors_of_user_are_sessions_and_users():
    """prompt_cache_key (OpenAI's hint that requests share a prefix) and
    safety_identifier (its successor of `user`) were ignored: a client that moved
    to them, as the SDK's docs ask, lost its session."""
    clf = Classifier(ClassifierConfig(), _hasher())

    def session(principal=Principal(), **fields):
        return clf.classify(chat(**fields), principal, {}, 5, 1).session

    q1, q2 = [{"role": "user", "content": "q1"}], [{"role": "user", "content": "another chat"}]
    assert session(messages=q1, prompt_cache_key="k") == session(messages=q2, prompt_cache_key="k") != session(messages=q1)
    assert session(messages=q1, prompt_cache_key="k", user="alice") == session(messages=q2, prompt_cache_key="k")
    assert session(messages=q1, prompt_cache_key="k") != session(Principal("acme"), messages=q1, prompt_cache_key="k")
    assert session(messages=q1, safety_identifier="alice") == session(messages=q2, user="alice") != session(messages=q1)
    assert chat(prompt_cache_key="k", safety_identifier="s").ignored is None
    with pytest.raises(ApiError, match="prompt_cache_key"):
        chat(prompt_cache_key=5)


def test_a_document_signature_is_tokenised_within_the_requests_cache_salt():
    """The tokeniser's piece cache is per tenant (its salt): the file signature's
    tokenising too, or one tenant could time which documents another sent."""
    seen: list[str] = []

    def encoder(text: str, namespace: str = "") -> list[int]:
        seen.append(namespace)
        return list(text.encode())

    clf = Classifier(ClassifierConfig(file_min_tokens=100), PrefixHasher(ByteTokenizer(), 4, "salt", encoder=encoder))
    doc = chat(messages=[{"role": "user", "content": "word " * 400}])
    doc.cache_salt = "tenant:4:acme:"
    assert clf.classify(doc, Principal("acme"), {}, 2000, 500).type == "file"
    assert seen == ["tenant:4:acme:"]


def test_to_b_chat_requests_are_api_calls():
    """The paper's to-B traffic is all type "api": a chat request that an API key or
    the workload header puts in to-b is one too, unless it carries an image or a file."""
    clf = Classifier(ClassifierConfig(), _hasher())
    ctx = clf.classify(chat(), Principal(workload="to-b"), {}, 10, 2)
    assert (ctx.workload, ctx.type) == ("to-b", "api")
    ctx = clf.classify(chat(), Principal(), {"X-KVGate-Workload": "to-b"}, 10, 2)
    assert (ctx.workload, ctx.type) == ("to-b", "api")
    assert clf.classify(chat(), Principal(), {}, 10, 2).type == "text"  # to-c stays text


def test_parent_is_the_turn_whose_prompt_a_chat_resends():
    """Two people who open alike (no `user`) are not each other's next turn: a
    turn's parent is the request whose prompt it resends before its answer."""
    clf = Classifier(ClassifierConfig(), _hasher())
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]

    def turn(*pairs: tuple[str, str]) -> ParsedRequest:
        messages = list(opening)
        for answer, question in pairs:
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        return chat(messages=messages)

    def classify(req: ParsedRequest):
        return clf.classify(req, Principal(), {}, 5, 1)

    a1, b1 = classify(turn()), classify(turn())
    a2 = classify(turn(("hello A", "tell me more")))
    b2 = classify(turn(("hello B", "what time is it")))
    a3 = classify(turn(("hello A", "tell me more"), ("more for A", "thanks")))
    b3 = classify(turn(("hello B", "what time is it"), ("noon", "and in Paris?")))
    # Identical first prompts cannot be told apart: a second turn links to the latest.
    assert (a1.parent_chat_id, b1.parent_chat_id, a2.parent_chat_id, b2.parent_chat_id) == (-1, -1, b1.chat_id, b1.chat_id)
    assert (a3.parent_chat_id, b3.parent_chat_id) == (a2.chat_id, b2.chat_id)
    assert a1.session == b3.session  # the session is still the opening (same prefix, same replica)
    # A regenerated turn is its parent's child again; an edited history links to no turn it never had.
    assert classify(turn(("hello A", "tell me more"), ("more for A", "thanks"))).parent_chat_id == a2.chat_id
    assert classify(turn(("edited", "tell me more"), ("more for A", "thanks"))).parent_chat_id == -1
    # An agent's steps: the request sending a tool's result follows the one that called
    # the tool (same user turn); the next question follows the request with the result.
    agent = Classifier(ClassifierConfig(), _hasher())
    ask = [{"role": "user", "content": "what is 6 x 7?"}]
    tools = ask + [{"role": "assistant", "content": "calling"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    steps = [agent.classify(chat(messages=m), Principal(), {}, 5, 1) for m in (
        ask, tools, tools + [{"role": "assistant", "content": "it is 42"}, {"role": "user", "content": "why?"}])]
    assert [c.parent_chat_id for c in steps] == [-1, steps[0].chat_id, steps[1].chat_id]
    assert [c.turn for c in steps] == [1, 1, 2]


def test_chats_about_different_pictures_are_different_sessions():
    """An image is a placeholder in the message text: two people asking the same
    question about different photos were one session, and one's next turn was
    linked to the other's chat."""
    clf = Classifier(ClassifierConfig(), _hasher())

    def photo(data: str, *pairs: tuple[str, str]) -> ParsedRequest:
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "What is in this photo?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]
        for answer, question in pairs:
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        return chat(messages=messages)

    def classify(req: ParsedRequest):
        return clf.classify(req, Principal(), {}, 5, 1)

    x1, y1 = classify(photo("AAAA")), classify(photo("BBBB"))
    assert x1.session != y1.session
    x2 = classify(photo("AAAA", ("a cat", "what colour?")))
    assert x2.parent_chat_id == x1.chat_id and x2.session == x1.session
    # The same picture again is the same opening.
    assert classify(photo("AAAA")).session == x1.session


def test_config_rule_errors_name_the_key():
    from engine.config import ConfigError
    from gateway.config import load_config

    import tempfile, os

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("classifier:\n  rules:\n    - when: tenant\n")
    try:
        with pytest.raises(ConfigError) as info:
            load_config(f.name)
        assert "classifier.rules.0" in str(info.value)
    finally:
        os.unlink(f.name)


def test_prefix_hasher_matches_engine_hash_and_images():
    h = _hasher()
    msgs = [{"role": "user", "content": "hello <image> there"}]
    p = h.chat(msgs, [b"img1"])
    assert p.keys == block_hashes(p.token_ids, 4, "salt", p.mm_hashes)
    q = h.chat(msgs, [b"img2"])
    assert p.token_ids == q.token_ids and p.keys != q.keys  # image content changes identity
    assert p.mm_hashes[0][0] == len(ByteTokenizer().encode("<user>hello "))


def test_a_token_running_into_an_image_placeholder_counts_with_the_image():
    """Byte-level vocabularies hold " <" as one token: counted before the image, the
    block holding it was not told apart by the image (shared by requests whose
    images differ) when it ended a block."""
    class Spans:  # "look <image>": "look", " <", "image", ">"
        is_fast = True

        def __call__(self, text, add_special_tokens, return_offsets_mapping):
            return {"offset_mapping": [(0, 4), (4, 6), (6, 11), (11, 12)]}

    hasher = PrefixHasher(Spans(), 4, "salt", lambda messages, namespace: [], lambda text, namespace: [])
    assert hasher._tokens_before("look <image>", [5], "") == [1]


# ----------------------------------------------------------------------------- router


def _index(keys):
    idx = ExactIndex()
    idx.apply("stored", keys, "device")
    return idx


def test_exact_index_tiers():
    idx = ExactIndex()
    idx.apply("stored", [1, 2, 3], "device")
    idx.apply("stored", [2], "host")
    idx.apply("removed", [2], "device")
    assert idx.match([1, 2, 3]) == 3
    idx.apply("removed", [2], "host")
    assert idx.match([1, 2, 3]) == 1


def test_approx_index_ttl_and_capacity():
    now = [0.0]
    idx = ApproxIndex(ttl_s=10, capacity=3, clock=lambda: now[0])
    idx.record([1, 2, 3])
    assert idx.match([1, 2, 3]) == 3 and len(idx) == 3
    # Past capacity a prompt loses its tail first, as a server's prefix cache frees
    # it: the head kept, the prompt still matches in part (dropping the head first
    # made it a whole miss while its tail held the room).
    idx.record([4])
    assert idx.match([1, 2, 3]) == 2 and idx.match([4]) == 1
    idx.record([5, 6])
    assert idx.match([1]) == 0 and idx.match([4]) == 1 and idx.match([5, 6]) == 2 and len(idx) == 3
    now[0] = 11
    assert idx.match([5]) == 0
    assert len(idx) == 0  # what match no longer believes held is not counted (the index-blocks gauge)


def test_prefix_aware_prefers_cached_replica_but_load_spreads():
    keys = list(range(40))
    router = Router(RouterConfig(hot_prefix_inflight=100), ["a", "b"], block_size=16)
    idx = [_index(keys[:30]), ExactIndex()]
    d = router.choose(keys, idx, [True, True])
    assert (d.replica, d.reason, d.matched_blocks) == (0, "prefix", 30)
    tickets = []
    seen = set()
    for _ in range(8):
        d = router.choose(keys, idx, [True, True])
        seen.add(d.replica)
        tickets.append(router.acquire(d.replica, router.load_tokens(640, 64, 1), keys, d.matched_blocks))
    assert seen == {0, 1}
    for t in tickets:
        router.release(t)
        router.release(t)  # idempotent
    assert router.inflight_tokens == [0, 0] and router.inflight_requests == [0, 0]


def test_misses_spread_and_unhealthy_skipped():
    router = Router(RouterConfig(), ["a", "b", "c"], block_size=16)
    idx = [ExactIndex(), ExactIndex(), ExactIndex()]
    picks = [router.choose([1, 2], idx, [True, True, True]).replica for _ in range(6)]
    assert set(picks) == {0, 1, 2}
    assert router.choose([1], idx, [False, True, False]).replica == 1
    assert router.choose([1], idx, [False, False, False]) is None
    assert router.choose([1], idx, [True, True, False], exclude=[0]).replica == 1


def test_imbalance_valve_and_hot_spread():
    keys = list(range(200))
    router = Router(RouterConfig(imbalance_abs_tokens=100, hot_prefix_inflight=2, load_weight=0.0), ["a", "b"], block_size=16)
    idx = [_index(keys), ExactIndex()]
    t1 = router.acquire(0, 10, keys, 200)
    t2 = router.acquire(0, 10, keys, 200)
    d = router.choose(keys, idx, [True, True])
    assert d.reason == "hot-spread" and d.replica == 1
    router.release(t1)
    router.release(t2)
    router.acquire(0, 1000, [])
    d = router.choose(keys, idx, [True, True])
    assert (d.replica, d.reason) == (1, "imbalance")


def test_other_policies():
    idx = [ExactIndex(), ExactIndex()]
    rr = Router(RouterConfig(policy="round-robin"), ["a", "b"], 16)
    assert {rr.choose([], idx, [True, True]).replica for _ in range(2)} == {0, 1}
    ses = Router(RouterConfig(policy="session"), ["a", "b"], 16)
    first = ses.choose([], idx, [True, True], session="s1").replica
    assert all(ses.choose([], idx, [True, True], session="s1").replica == first for _ in range(5))
    assert ses.choose([], idx, [not first == 0, not first == 1], session="s1").replica != first
    ll = Router(RouterConfig(policy="least-load"), ["a", "b"], 16)
    ll.acquire(0, 50)
    assert ll.choose([], idx, [True, True]).replica == 1


def test_a_routers_rotation_starts_where_it_is_told():
    """Gateways over the same replicas start their rotations apart (see
    test_gateways_over_the_same_replicas_do_not_turn_in_step): the first new
    prompt, or round-robin's first turn, goes by the rotation given."""
    idx = [ExactIndex(), ExactIndex()]
    for policy in ("prefix-aware", "round-robin"):
        first = [Router(RouterConfig(policy=policy), ["a", "b"], 16, rotation=r).choose([7, 8], idx, [True, True])
                 for r in (0, 1)]
        assert {d.replica for d in first} == {0, 1}, policy


def test_misses_alternate_whatever_hits_come_between():
    """Each new prompt followed by its repeat (a hit): the rotation among equal
    misses advanced on the hit too, so with two replicas every miss found the
    same one and one replica cached everything."""
    router = Router(RouterConfig(), ["a", "b"], 16)
    idx = [ExactIndex(), ExactIndex()]
    misses = []
    for prompt in range(8):
        keys = [1000 * prompt + k for k in range(4)]
        d = router.choose(keys, idx, [True, True])
        assert d.reason == "load"
        misses.append(d.replica)
        idx[d.replica].apply("stored", keys, "device")  # its KV events arrive
        assert router.choose(keys, idx, [True, True]).reason == "prefix"
    assert misses.count(0) == misses.count(1) == 4


def test_session_routing_spills_on_two_replicas():
    """The bound counted the replica's own requests in the mean: with two
    replicas it was the whole fleet's load, so one session could take one
    replica while the other sat idle."""
    ses = Router(RouterConfig(policy="session", hot_prefix_inflight=4), ["a", "b"], 16)
    idx = [ExactIndex(), ExactIndex()]
    homes = []
    for _ in range(6):
        d = ses.choose([], idx, [True, True], session="alice")
        ses.acquire(d.replica, 100)
        homes.append(d.replica)
    assert homes[:4] == [homes[0]] * 4  # the floor: a few requests stay home
    assert homes[4] != homes[0] and homes[5] != homes[0]  # then the idle replica takes some
    # Home again once the other holds its share: at most twice (its 2 + 1).
    assert ses.choose([], idx, [True, True], session="alice").reason == "session"


def test_session_routing_is_sticky_within_bounded_loads():
    names = ["a", "b", "c", "d"]
    idx = [ExactIndex() for _ in names]
    ses = Router(RouterConfig(policy="session", hot_prefix_inflight=4), names, 16)
    home = ses.choose([], idx, [True] * 4, session="u0").replica
    # A few requests of its own (the floor) leave the session where it is ...
    for _ in range(3):
        ses.acquire(home, 100)
    assert ses.choose([], idx, [True] * 4, session="u0") == ses.choose([], idx, [True] * 4, session="u0")
    assert ses.choose([], idx, [True] * 4, session="u0").reason == "session"
    # ... but a replica holding over twice the mean takes no more: the session's next choice does.
    for _ in range(20):
        ses.acquire(home, 100)
    d = ses.choose([], idx, [True] * 4, session="u0")
    assert d.reason == "session-spill" and d.replica != home
    # Every session spills to its own next choice, so the spill spreads rather than piling up.
    spills = {ses.choose([], idx, [True] * 4, session=f"s{k}").replica for k in range(200)}
    assert home not in spills and len(spills) == 3
    # A retry away from the home replica (it failed), or the home out of routing, is a spill too.
    fresh = Router(RouterConfig(policy="session"), names, 16)
    assert fresh.choose([], idx, [True] * 4, session="u0", exclude=[home]).reason == "session-spill"
    assert fresh.choose([], idx, [i != home for i in range(4)], session="u0").reason == "session-spill"
    assert fresh.choose([], idx, [True] * 4, session="u0").reason == "session"


def test_past_the_valve_only_the_sessions_of_the_replica_it_trips_move():
    """One replica past the imbalance valve sent every session to the least loaded
    replica, turn by turn (reason "load"): conversations homed on the others were
    scattered too, and lost their caches."""
    names = ["a", "b", "c"]
    idx = [ExactIndex() for _ in names]
    homes = {f"s{k}": Router(RouterConfig(policy="session"), names, 16).choose([], idx, [True] * 3, session=f"s{k}")
             for k in range(30)}
    busy = Router(RouterConfig(policy="session"), names, 16)
    busy.inflight_tokens[0] = busy.cfg.imbalance_abs_tokens + 1000  # replica a past the valve
    for turn in range(3):
        for session, home in homes.items():
            d = busy.choose([], idx, [True] * 3, session=session)
            if home.replica != 0:
                assert (d.replica, d.reason) == (home.replica, "session")
            else:  # a's sessions go to their own next choice, the same each turn
                assert d.replica != 0 and d.reason == "session-spill"
                assert d == busy.choose([], idx, [True] * 3, session=session)
    assert {h.replica for h in homes.values()} == {0, 1, 2}


def test_ties_rotate_over_the_usable_replicas_only():
    # With b out of routing its turn must not fall to c: equal misses spread evenly over a, c, d.
    router = Router(RouterConfig(), ["a", "b", "c", "d"], block_size=16)
    idx = [ExactIndex() for _ in range(4)]
    picks = [router.choose([1, 2], idx, [True, False, True, True]).replica for _ in range(300)]
    assert {r: picks.count(r) for r in set(picks)} == {0: 100, 2: 100, 3: 100}


def test_default_config_still_loads():
    cfg = KvgateConfig()
    assert cfg.router.policy == "prefix-aware" and cfg.classifier.rules[0].when == "api_key"


# ----------------------------------------------------------------------------- fuzzing

def test_absent_and_null_fields_keep_the_sampling_defaults():
    # Parsing only validates the fields a body carries; absent and null ones
    # must come out exactly as SamplingParams' defaults (OpenAI's).
    from engine.request import SamplingParams

    defaults = SamplingParams()
    assert chat().sampling == defaults
    nulls = {k: None for k in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "seed",
                               "top_k", "ignore_eos", "stop", "logprobs", "top_logprobs", "max_tokens")}
    assert chat(**nulls).sampling == defaults
    assert chat(**nulls).max_tokens is None
    # The edge values that are rewritten rather than refused.
    assert chat(top_k=-1).sampling.top_k == 0
    assert chat(top_p=0).sampling.top_p == 1e-9
    assert chat(stop="").sampling.stop == []
    assert chat(logprobs=True).sampling.logprobs == 0
    assert chat(logprobs=False, top_logprobs=None).sampling.logprobs is None
    assert parse_request(COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 2}, LIMITS).sampling.logprobs == 2
    # max_completion_tokens wins over max_tokens, as OpenAI documents.
    assert chat(max_tokens=5, max_completion_tokens=7).max_tokens == 7


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_fields = st.sampled_from(
    ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
     "seed", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "user", "stream",
     "stream_options", "top_k", "ignore_eos"]
)


_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "audio", 3])},
    optional={"text": _json, "image_url": st.one_of(_json, st.fixed_dictionaries({"url": _json}))},
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", None])},
    optional={"content": st.one_of(st.text(max_size=8), st.none(), st.lists(_part, max_size=3), _json)},
)
_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", 1, None])},
    optional={"messages": st.one_of(st.lists(_message, max_size=3), _json), "prompt": _json},
).flatmap(lambda base: st.dictionaries(_fields, _json, max_size=6).map(lambda extra: {**extra, **base}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_body, st.sampled_from([CHAT, COMPLETIONS]))
def test_fuzzed_bodies_parse_or_raise_api_error(body, endpoint):
    """Any JSON object either parses or is refused with a 4xx ApiError; nothing else escapes."""
    try:
        parse_request(endpoint, body, LIMITS)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.message


async def test_cli_servers_freeze_startup_objects_out_of_gc_scans():
    """`kvgate serve`/`engine` move what startup built out of the collector's full
    scans (a full collection walked ~390k objects, 210 ms, with the default model)."""
    import gc

    from aiohttp import web

    from gateway.server import freeze_startup_objects

    # Not 0 on Python 3.12: its collector keeps the immortal objects it tracks (the
    # deep-frozen modules' tuples, 375 on 3.12.1) in the permanent generation.
    gc.collect()
    already = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # alive at startup
    try:
        await freeze_startup_objects(web.Application())
        assert gc.get_freeze_count() >= already + len(kept)
    finally:
        gc.unfreeze()



async def test_in_flight_load_is_released_when_a_second_cancel_lands_during_close():
    """A client leaves while its stream is being written (first cancel) and the
    server's stop cancels again while the replica's stream closes: the request's
    load on the replica must still be released."""
    import asyncio

    from engine.context import RequestContext
    from engine.request import GenerationOutput
    from gateway.dispatch import Dispatcher, Sub, aclose
    from gateway.metrics import GatewayMetrics
    from gateway.observe import Observer
    from gateway.prefix import Prompt

    class SlowToCloseReplicaFixture:
        name, kind, healthy = "slow", "engine", True

        def __init__(self) -> None:
            self.index = ExactIndex()

        async def generate(self, job):
            try:
                while True:
                    yield [GenerationOutput(job.request.request_id, 0, [1], "a")]
                    await asyncio.sleep(0.01)
            finally:
                await asyncio.sleep(0.05)  # a remote stream's close awaits its connection

    router = Router(RouterConfig(), ["slow"], block_size=16)
    metrics = GatewayMetrics()
    dispatcher = Dispatcher(router, [SlowToCloseReplicaFixture()], metrics, Observer(KvgateConfig(), metrics))
    parsed = parse_request(COMPLETIONS, {"model": "m", "prompt": "hi"}, LimitsConfig())
    gen, _ = dispatcher.run([Sub(Prompt(list(range(40)), [], [1, 2]), "hi", RequestContext(), 0, 16)], parsed)

    async def writer() -> None:
        try:
            async for _ in gen:
                await asyncio.sleep(1)  # writing to a slow client when the cancel lands
        finally:
            await aclose(gen)

    task = asyncio.ensure_future(writer())
    await asyncio.sleep(0.03)
    assert router.inflight_requests == [1]
    task.cancel()
    await asyncio.sleep(0.01)
    task.cancel()  # lands while the replica's stream is still closing
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert router.inflight_requests == [0] and router.inflight_tokens == [0]


def test_the_access_line_says_a_failed_stream_its_id_and_its_time(caplog):
    """server.access_log: a stream that failed after its first byte reads as its
    error's status (as kvgate_requests_total counts it), with its request id and
    duration; a client's header cannot break the line."""
    import logging

    from aiohttp.test_utils import make_mocked_request

    from gateway.access_log import AccessLine
    from gateway.replicas import GATEWAY_USER_AGENT

    request = make_mocked_request("POST", "/v1/chat/completions",
                                  headers={"User-Agent": 'evil"\n2026-01-01 forged line'})

    class FailedStream:
        status, failed_status, body_length = 200, 502, 1234
        headers = {"x-request-id": "chatcmpl-abc"}

    line = AccessLine(logging.getLogger("test.access"), "")
    with caplog.at_level(logging.INFO, logger="test.access"):
        line.log(request, FailedStream(), 0.4123)
    (record,) = caplog.records
    assert record.getMessage().split(" ", 1)[1] == \
        '"POST /v1/chat/completions HTTP/1.1" 502 1234 0.412s chatcmpl-abc "evil\\"\\n2026-01-01 forged line" -'
    # Monitoring that succeeds is no client traffic: probes and polls every few seconds buried it.

    class Answer:
        body_length, headers = 10, {}

        def __init__(self, status):
            self.status = status

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="test.access"):
        for path in ("/health", "/ready", "/metrics", "/stats", "/kvgate/stats", "/kv_events"):
            line.log(make_mocked_request("GET", path), Answer(200), 0.001)
        line.log(make_mocked_request("GET", "/health"), Answer(503), 0.001)  # a failing probe is said
        line.log(make_mocked_request("GET", "/v1/models"), Answer(200), 0.001)  # a client's call
        # A gateway in front probing this one's /v1/models (replicas send GATEWAY_USER_AGENT).
        line.log(make_mocked_request("GET", "/v1/models", headers={"User-Agent": GATEWAY_USER_AGENT}), Answer(200),
                 0.001)
    assert [r.getMessage().split('"')[1] for r in caplog.records] == ["GET /health HTTP/1.1", "GET /v1/models HTTP/1.1"]


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_stream_cut_in_its_last_send_gets_nothing_after_its_end(monkeypatch, api):
    """The server stopping cancels a stream while its last frames and end (handed
    to write_eof together) wait for a slow reader: nothing may be written after
    them (an error event after the chunked body's end corrupts the connection)."""
    import asyncio
    import types

    from aiohttp import web

    from engine.request import GenerationOutput
    from gateway import respond
    from gateway.responses_api import chat_request

    sent = []

    async def prepare(self, request):
        sent.append("headers")

    async def write(self, data):
        sent.append(bytes(data))

    async def write_eof_cut(self, data=b""):
        sent.append(bytes(data))
        raise asyncio.CancelledError()  # the drain of the last send, cut by cut_live()

    monkeypatch.setattr(web.StreamResponse, "prepare", prepare)
    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof_cut)

    async def outputs():
        yield [GenerationOutput("x", 0, [5], "Hel")]
        yield [GenerationOutput("x", 0, [6], "lo", finish_reason="stop")]

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    call = None
    if api == "responses":
        body, call = chat_request({"model": "m", "input": "hi", "stream": True})
    parsed = parse_request(CHAT, body, LIMITS)
    parsed.responses = call
    observer = types.SimpleNamespace(first_token=lambda *a: None)
    sub = types.SimpleNamespace(context=types.SimpleNamespace(workload="to-c"), replica="r",
                                prompt=types.SimpleNamespace(token_ids=[1, 2]))
    responder = respond.Responder("m", observer)
    responder.cutting = True
    stream = responder.stream if call is None else responder.stream_events
    resp = await stream(None, outputs(), True, parsed, [sub], 0.0)
    last = b"data: [DONE]" if call is None else b"event: response.completed"
    assert last in sent[-1]  # the end was the last thing handed over
    assert resp.failed_status is None  # what was cut was the wait for the client to read it


# ----------------------------------------------------------------------------- Responses events


def test_a_streamed_response_has_one_item_in_progress_at_a_time(caplog):
    """As OpenAI streams: each item is done as the next begins (the reasoning when
    the answer starts, a call when the next does), not all at the end; text after a
    call is a message of its own; items done early are completed, the last takes
    the response's status, whole as streamed."""
    import json

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from gateway.responses_api import chat_request
    from gateway.responses_shape import ResponseShaper

    _, call = chat_request({"model": "m", "input": "hi"})
    shaper = ResponseShaper("resp_1", 1, "m", call)
    frames = [shaper.opening(), shaper.reasoning("Think"), shaper.reasoning("ing."), shaper.delta("Let me look."),
              shaper.tool_calls([{"index": 0, "id": "c0", "function": {"name": "find", "arguments": '{"q": '}}]),
              shaper.tool_calls([{"index": 1, "id": "c1", "function": {"name": "time", "arguments": "{}"}}])]
    with caplog.at_level("WARNING", logger="gateway.responses_shape"):
        frames.append(shaper.tool_calls([{"index": 0, "function": {"arguments": '"x"}'}}]))  # after c1 began
    frames += [shaper.delta("Done"), shaper.closing("length", {"prompt_tokens": 3, "completion_tokens": 9}, 2)]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(block.split(b"data: ", 1)[1]))
              for block in b"".join(frames).split(b"\n\n") if block]
    # Every item added after the one before it is done.
    lifecycle = [(e.type.rsplit(".", 1)[1], e.output_index) for e in events
                 if e.type in ("response.output_item.added", "response.output_item.done")]
    assert lifecycle == [("added", 0), ("done", 0), ("added", 1), ("done", 1), ("added", 2), ("done", 2),
                         ("added", 3), ("done", 3), ("added", 4), ("done", 4)]
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    assert [(item.type, item.status) for item in done.values()] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"),
        ("function_call", "completed"), ("message", "incomplete")]
    assert done[0].content[0].text == "Thinking." and done[2].arguments == '{"q": '
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and [i.status for i in final.output] == [
        "completed", "completed", "completed", "completed", "incomplete"]
    assert final.output[2].arguments == '{"q": "x"}'  # the late piece is kept, and said
    assert "arguments for tool call c0 came after it was done" in caplog.text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    whole = ResponseShaper("resp_2", 1, "m", call).whole(
        "Done", {"reasoning": "Thinking."}, "length", {"prompt_tokens": 3, "completion_tokens": 2}, 2,
        (("r", 0), ("t", 0)))
    assert [(i["type"], i["status"]) for i in whole["output"]] == [("reasoning", "completed"), ("message", "incomplete")]


async def test_an_offered_requests_failure_as_its_client_leaves_is_no_unretrieved_error():
    """A request offered from a stopping engine waits on another replica, whose
    answer fails in the same loop turn as the client leaves: that failure is
    read, not left to asyncio's "Task exception was never retrieved" (an ERROR
    with its traceback in the gateway's log)."""
    import asyncio
    import gc

    from gateway.dispatch import _unless_answered_first
    from gateway.replicas import OfferedElsewhere, ReplicaUnavailable

    loop = asyncio.get_running_loop()
    said: list[str] = []
    loop.set_exception_handler(lambda _, context: said.append(context["message"]))
    fails = loop.create_future()

    async def other_replica():
        await fails
        raise ReplicaUnavailable("replica b: connection reset")
        yield []

    sent = loop.create_future()  # the stopping engine's POST, unanswered
    offered = OfferedElsewhere("replica a is shutting down", sent)

    async def client() -> None:
        async for _ in _unless_answered_first(other_replica(), offered):
            pass

    task = asyncio.ensure_future(client())
    await asyncio.sleep(0.01)
    fails.set_result(None)
    await asyncio.sleep(0)  # the other replica's answer fails...
    task.cancel()  # ...as its client leaves
    with pytest.raises(asyncio.CancelledError):
        await task
    sent.cancel()
    gc.collect()
    await asyncio.sleep(0.01)
    assert said == []
