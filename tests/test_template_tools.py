"""Tools a chat template is given (tool_choice "none", as vLLM gives them) are prompt
text like the messages: they count toward the prompt-size checks (refused before
rendering when they cannot fit, tokenised off the event loop when big) and toward
an image's token offset (its blocks keyed where its placeholder really is)."""
from __future__ import annotations

import threading

import openai
import pytest

from engine.chat_tokens import ChatTokenizer
from gateway.app import GATEWAY, create_app
from gateway.prefix import PrefixHasher
from gateway.replicas import InProcessReplica
from tests.engine_procs import MODEL, tiny_config
from tests.gateway_helpers import serving
from tests.tiny_model import make_tiny_tokenizer


# A template that writes the tools, the names and earlier answers' tool calls, as
# Qwen2.5's and Llama 3.1's write tools and calls.
TEMPLATE = ("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}\n{{ m.content }}"
            "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tools(chars: int) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "description": "word " * (chars // 5),
                                              "parameters": {"type": "object"}}}]


async def test_tools_count_toward_the_prompt_size_checks(tiny_model_dir, monkeypatch):
    """A tools array that cannot fit is refused before it is rendered; a big one is
    tokenised off the event loop (an 8 MB one held the loop 9.7 s)."""
    config = tiny_config(tiny_model_dir)
    replica = InProcessReplica("r0", config)
    async with serving(create_app(config, [replica])) as (app, server, client):
        gateway = app[GATEWAY]
        hasher = gateway.hasher
        hasher.tokenizer.chat_template = TEMPLATE
        messages = [{"role": "user", "content": "hi"}]
        real_chat = hasher.chat
        calls = []

        def chat(*args, **kwargs):
            calls.append(threading.current_thread() is threading.main_thread())
            return real_chat(*args, **kwargs)

        monkeypatch.setattr(hasher, "chat", chat)
        # 1. Past what the context could hold: refused before it is tokenised.
        longest = max(len(piece) for piece in hasher.tokenizer.get_vocab())
        bound = gateway.max_model_len * 2 * longest
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                 tools=_tools(bound + 10), tool_choice="none")
        assert info.value.code == "context_length_exceeded"
        assert calls == [], "a tools array that cannot fit was rendered and tokenised"
        # 2. Past offload_tokenize_chars but within the bound: tokenised off the event loop.
        calls.clear()
        gateway.config.server.offload_tokenize_chars = 4096
        size = 4096 + 1000
        assert size < bound
        with pytest.raises(openai.BadRequestError):  # too long in tokens: a 400 all the same
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                 tools=_tools(size), tool_choice="none")
        assert calls == [False], "a big tools array was tokenised on the event loop"


def _a_long_name(chars: int) -> list[dict]:
    return [{"role": "user", "content": "hi", "name": "a" * chars}]


def _a_long_call(chars: int) -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * chars}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


@pytest.mark.parametrize("messages", [_a_long_name, _a_long_call], ids=["name", "earlier tool call"])
async def test_what_the_template_writes_beside_the_contents_counts_toward_the_prompt_size_checks(
        tiny_model_dir, monkeypatch, messages):
    """Every message's name and an earlier answer's tool calls reach the template
    too: megabytes of them are refused before rendering and tokenising, as megabytes
    of content are."""
    config = tiny_config(tiny_model_dir)
    async with serving(create_app(config, [InProcessReplica("r0", config)])) as (app, server, client):
        gateway = app[GATEWAY]
        hasher = gateway.hasher
        hasher.tokenizer.chat_template = TEMPLATE

        def never(*args, **kwargs):
            raise AssertionError("tokenised")

        monkeypatch.setattr(hasher, "chat", never)
        longest = max(len(piece) for piece in hasher.tokenizer.get_vocab())
        bound = gateway.max_model_len * 2 * longest
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, max_tokens=1, messages=messages(bound + 1))
        assert info.value.code == "context_length_exceeded", info.value


def test_image_offsets_count_the_tools_the_template_writes():
    """The offset fell inside the tools block (rendered without them): every block
    from there on was keyed by the image, so requests with the same tools and
    different images shared none of the tools."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    hasher = PrefixHasher(tokenizer, 4, "salt", ChatTokenizer(tokenizer).encode_chat)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather " * 40,
                                               "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "What is in this picture?\n<image>"}]
    a = hasher.chat(messages, [b"image-a"], None, tools)
    b = hasher.chat(messages, [b"image-b"], None, tools)
    # Where the placeholder really starts in the ids the engine is given.
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    before = text.index("<image>")
    real = len(tokenizer(text[:before], add_special_tokens=False)["input_ids"])
    (offset, _), = a.mm_hashes
    assert offset >= real - 1, f"image offset {offset}, its placeholder at token {real}"
    # The blocks before the image's are the same for any image: shared.
    common = next(i for i, (x, y) in enumerate(zip(a.keys, b.keys)) if x != y)
    assert common >= (real - 1) // 4
