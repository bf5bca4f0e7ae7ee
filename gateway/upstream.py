"""Reading an OpenAI-compatible server's answers: its SSE stream, each chunk as
engine outputs, its error bodies in their several dialects, kvgate's answer
headers, and the load figures on its Prometheus page.

Pure functions over bytes and decoded JSON, so that `RemoteReplica` (gateway/
replicas.py) keeps only the connection's life: health, retries, the breaker.
"""

from __future__ import annotations

import json
import math
from typing import Any, AsyncIterator

import aiohttp

from engine.request import GenerationOutput, TokenLogprob, Usage

# Output index meaning "usage for the whole request" (remote replicas report one
# usage chunk for all choices rather than one per choice).
USAGE_ALL = -1

# An SSE line may be this long.  A `kvgate engine`'s snapshot lists every block
# key it holds on one line (~21 bytes a key: 2M blocks make ~42 MB); aiohttp's
# readline stops at twice its read buffer (512 KiB, ~24k keys).
SSE_MAX_LINE_BYTES = 256 * 1024 * 1024

# Delta fields the gateway writes itself; the rest of an external server's delta is relayed.
_DELTA_OWN = frozenset(("content", "role"))

# Vendor names of the two load figures: vLLM's (new and old), SGLang's, and a
# kvgate engine's (kvgate_engine_requests with state="waiting", one per replica
# on a gateway's page).
_WAITING_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                     "kvgate_kv_cache_usage_ratio")
KNOWN_LOAD_METRICS = (*_WAITING_METRICS, "kvgate_engine_requests", *_KV_USAGE_METRICS)


def parse_backend_metrics(text: str, model: str | None = None) -> tuple[float | None, float | None]:
    """(waiting requests, KV cache usage 0..1), each None when the page has no
    such series, from a Prometheus text page.

    A server may serve several models (label model_name) and run several
    engines (vLLM's data parallelism: label engine), one series each.  When
    ``model`` names one of the models only its series count; waiting requests
    are summed over engines (and models), usage is the fullest engine's.
    """
    from prometheus_client.parser import text_string_to_metric_families

    waiting: dict[str, list[float]] = {}
    usage: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _WAITING_METRICS or (sample.name == "kvgate_engine_requests"
                                                   and sample.labels.get("state") == "waiting"):
                target = waiting
            elif sample.name in _KV_USAGE_METRICS:
                target = usage
            else:
                continue
            if math.isfinite(sample.value):  # a NaN or Inf gauge says nothing of load (and broke the pricing)
                target.setdefault(sample.labels.get("model_name", ""), []).append(sample.value)
    if model is not None and model in waiting:
        waiting = {model: waiting[model]}
    if model is not None and model in usage:
        usage = {model: usage[model]}
    kv = max(v for values in usage.values() for v in values) if usage else None
    if kv is not None and kv > 1.0:
        kv /= 100.0  # a percentage, whatever the name says
    return (float(sum(v for values in waiting.values() for v in values)) if waiting else None), kv


def _chat_logprobs(lp: dict | None) -> list[TokenLogprob] | None:
    if not lp or lp.get("content") is None:
        return None
    return [
        TokenLogprob(-1, item["token"], item["logprob"], [(-1, t["token"], t["logprob"]) for t in item.get("top_logprobs") or ()])
        for item in lp["content"]
    ]


def _completion_logprobs(lp: dict | None) -> list[TokenLogprob] | None:
    if lp and lp.get("tokens") is None and isinstance(lp.get("content"), list):
        return _chat_logprobs(lp)  # llama.cpp's server answers completions in chat's shape
    if not lp or lp.get("tokens") is None:
        return None
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    # An echoed prompt's first token has no logprob (null, as vLLM and OpenAI send
    # it): kept so, not made a certainty (0.0).
    return [
        TokenLogprob(-1, tok, val, [(-1, t, v) for t, v in (top or {}).items()])
        for tok, val, top in zip(lp["tokens"], lp.get("token_logprobs") or [], tops)
    ]


def _mark_not_in_text(lps: list[TokenLogprob] | None, outside: object) -> None:
    """A `kvgate engine`'s special tokens, listed but outside the choice's text
    (shapes.StreamFormatter.delta): text_offset does not count them, as in-process."""
    if lps and isinstance(outside, list):
        for i in outside:
            if type(i) is int and 0 <= i < len(lps):
                lps[i].in_text = False


def openai_error_body(body: object) -> dict | None:
    """An upstream server's error as OpenAI's ``{"error": {...}}``, from the shapes
    servers answer in: OpenAI's own; vLLM's before 0.10 and SGLang's, flat
    (``{"object": "error", "message": ..., "code": 400}``); ``{"error": "text"}``;
    FastAPI's validation errors (``{"detail": [...]}``).  None for anything else
    (a proxy's HTML page)."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        return body
    if isinstance(error, str):
        return {"error": {"message": error}}
    if isinstance(body.get("message"), str):
        return {"error": {key: body.get(key) for key in ("message", "type", "param", "code")}}
    detail = body.get("detail")
    if isinstance(detail, str):
        return {"error": {"message": detail}}
    if isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):
        # [{"loc": ["body", "max_tokens"], "msg": "...", "type": "..."}, ...]
        parts = [".".join(str(p) for p in d.get("loc") or () if p != "body") + ": " + str(d.get("msg", "invalid"))
                 for d in detail]
        return {"error": {"message": "; ".join(parts)}}
    return None


def _error_code(chunk: dict) -> object:
    error = chunk.get("error")
    return error.get("code") if isinstance(error, dict) else None


def is_stopping(body: dict) -> bool:
    """A `kvgate engine` that is shutting down said so (errors.shutting_down)."""
    return _error_code(body) == "server_shutting_down"


def in_stream_error_status(chunk: dict) -> int:
    """The HTTP status an error event stands for: its ``code`` when that is one
    (vLLM sends 400 for a request it refuses mid-stream), else 500."""
    code = _error_code(chunk)
    return code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else 500


def chunk_outputs(chunk: Any, rid: str, chat: bool) -> list[GenerationOutput]:
    """One OpenAI stream chunk as engine outputs; ValueError if it is not one."""
    try:
        batch = []
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            extra = None
            if chat:
                delta = choice.get("delta") or {}
                text = delta.get("content") or ""
                lps = _chat_logprobs(choice.get("logprobs"))
                # Tool calls, reasoning text and the like pass through as they came.
                extra = {k: v for k, v in delta.items() if v is not None and k not in _DELTA_OWN} or None
                if extra is not None and "tool_calls" in extra:
                    extra["tool_calls"] = _tool_call_fragments(extra["tool_calls"])
            else:
                text = choice.get("text") or ""
                lps = _completion_logprobs(choice.get("logprobs"))
                _mark_not_in_text(lps, choice.get("kvgate_not_in_text"))
            finish = choice.get("finish_reason")
            token_ids = choice.get("token_ids") or []  # a `kvgate engine`'s (kvgate_token_ids)
            if not text and finish is None and not lps and extra is None and not token_ids:
                continue  # the role chunk
            if not isinstance(index, int) or not isinstance(text, str):
                raise TypeError("index or text of the wrong type")
            if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
                raise TypeError("token_ids of the wrong type")
            stop_reason = choice.get("stop_reason") if finish is not None else None
            if isinstance(stop_reason, bool) or not isinstance(stop_reason, (int, str)):
                stop_reason = None  # vLLM's field, absent from other servers' chunks
            batch.append(GenerationOutput(rid, index, token_ids, text, lps, finish, extra=extra, stop_reason=stop_reason))
        usage = chunk.get("usage")
        if usage:
            batch.append(GenerationOutput(
                rid, USAGE_ALL, [], "", None, None,
                Usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), _cached_tokens(usage),
                      _reasoning_tokens(usage)),
            ))
    except (AttributeError, TypeError, KeyError) as exc:  # `data: null`, a choice that is a string, ...
        raise ValueError(f"not an OpenAI stream chunk: {exc}") from None
    return batch


# Tool calls one choice may hold (OpenAI caps a request's tools at 128).
MAX_TOOL_CALL_INDEX = 1024


def _tool_call_fragments(calls: object) -> list:
    """Tool call fragments in OpenAI's shape, whatever shape a server streamed them
    in: TGI 2.4 sends one object where OpenAI sends a list, llama.cpp and TGI have
    sent a call's arguments as an object (OpenAI's are a string of JSON), and an
    index that is no count says nothing (the fragment starts the next call)."""
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise TypeError("tool_calls of the wrong type")
    fragments = []
    for fragment in calls:
        if not isinstance(fragment, dict):
            raise TypeError("a tool call fragment of the wrong type")
        function = fragment.get("function")
        if isinstance(function, dict) and function.get("arguments") is not None \
                and not isinstance(function["arguments"], str):
            fragment = {**fragment, "function": {**function, "arguments": json.dumps(function["arguments"])}}
        if "index" in fragment and _count_or_none(fragment["index"]) is None:
            fragment = {k: v for k, v in fragment.items() if k != "index"}
        elif fragment.get("index", 0) >= MAX_TOOL_CALL_INDEX:
            # A whole answer keeps a place for every index below it: a server's index of
            # 3,000,000 held the event loop for 7 s and a gigabyte of empty calls.
            raise TypeError(f"a tool call index past {MAX_TOOL_CALL_INDEX:,}")
        fragments.append(fragment)
    return fragments


def _cached_tokens(usage: dict) -> int | None:
    """The prompt tokens an upstream's usage says its cache served; None when it
    does not say (vLLM without --enable-prompt-tokens-details sends null details):
    unknown, which the client is told as it came and the hit ratio leaves out,
    not a whole-prompt miss."""
    return _detail(usage, "prompt_tokens_details", "cached_tokens")


def _reasoning_tokens(usage: dict) -> int | None:
    """The completion tokens a server counts as reasoning: OpenAI's (and vLLM's)
    place, else SGLang's, which puts the count at usage's top level."""
    within = _detail(usage, "completion_tokens_details", "reasoning_tokens")
    return within if within is not None else _count_or_none(usage.get("reasoning_tokens"))


def _count(value: object) -> int:
    """A usage count as a server sent it; 0 for one it left null, or sent as no count
    (the prompt's is then the gateway's own count, gateway/usage.py)."""
    return _count_or_none(value) or 0


def _detail(usage: dict, details: str, name: str) -> int | None:
    """A count in one of usage's details objects; None where it is absent, null or no count."""
    within = usage.get(details)
    return _count_or_none(within.get(name) if isinstance(within, dict) else None)


def _count_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


# What sse_events yields for ``data: [DONE]`` (then it stops).
DONE_EVENT: Any = object()


def header_seconds(header: str | None) -> float | None:
    try:
        value = float(header) if header is not None else None
    except ValueError:
        return None
    return value if value is not None and 0 <= value < float("inf") else None


def header_count(header: str | None) -> int | None:
    """A header's non-negative integer, or None."""
    return int(header) if header is not None and header.isdigit() and header.isascii() else None


async def sse_lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytearray]:
    """The body's lines (without their ``\n``), each up to SSE_MAX_LINE_BYTES (ValueError past it)."""
    pending = bytearray()
    async for chunk in stream.iter_any():
        pending += chunk
        if b"\n" in chunk:
            lines = pending.split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield line
        if len(pending) > SSE_MAX_LINE_BYTES:  # the line still open: a broken or endless frame
            raise ValueError(f"an SSE line longer than {SSE_MAX_LINE_BYTES} bytes")
    if pending:
        yield pending


async def sse_events(stream: aiohttp.StreamReader) -> AsyncIterator[tuple[str, Any]]:
    """(event name, decoded data) of each SSE event until ``[DONE]`` (yielded as
    ``DONE_EVENT``, so callers can tell a finished stream from a cut one) or EOF."""
    event = "message"
    data: list[bytearray] = []
    async for line in sse_lines(stream):
        line = line.rstrip(b"\r")
        if not line:
            if data:
                payload = b"\n".join(data)
                data = []
                if payload == b"[DONE]":
                    yield event, DONE_EVENT
                    return
                yield event, _as_event(event, json.loads(payload))
            event = "message"
            continue
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        elif line.startswith(b"event:"):
            event = line[6:].strip().decode()
        elif line.startswith(b"error:"):
            # No SSE field, but llama.cpp's server (before late 2025) streams its
            # errors so, then [DONE]: skipped, the answer read as whole and empty.
            data.append(line[6:].lstrip(b" "))
            event = "error"
    if data:  # the last event, its blank line cut off by EOF
        payload = b"\n".join(data)
        yield event, DONE_EVENT if payload == b"[DONE]" else _as_event(event, json.loads(payload))


async def answer_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, Any]]:
    """A 200's events: its SSE stream, or a server's whole JSON answer read as
    the same events (a server that ignored ``stream``, or put its error in a 200):
    the completion as one chunk, then ``[DONE]``; an error as an error event."""
    if resp.content_type != "application/json":
        async for item in sse_events(resp.content):
            yield item
        return
    body = bytearray()
    async for piece in resp.content.iter_any():
        body += piece
        if len(body) > SSE_MAX_LINE_BYTES:
            raise ValueError(f"a JSON answer longer than {SSE_MAX_LINE_BYTES} bytes")
    answer = json.loads(body)
    if isinstance(answer, dict) and isinstance(answer.get("choices"), list):
        answer = {**answer, "choices": [_as_chunk_choice(choice) for choice in answer["choices"]]}
        yield "message", answer
        yield "message", DONE_EVENT
        return
    yield "message", answer  # an error, read as one; anything else is no chunk


def _as_chunk_choice(choice: Any) -> Any:
    """A whole answer's choice as a stream chunk's: a chat message is the delta,
    whole, its tool calls numbered as a stream numbers them (a whole message's
    carry no index; vLLM's list is there, empty, when there are none)."""
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        return choice
    delta = dict(choice["message"])
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        if calls:
            delta["tool_calls"] = [{"index": i, **call} if isinstance(call, dict) and "index" not in call else call
                                   for i, call in enumerate(calls)]
        else:
            del delta["tool_calls"]
    return {**{k: v for k, v in choice.items() if k != "message"}, "delta": delta}


def _as_event(event: str, data: Any) -> Any:
    """An ``error:`` line's flat {"code", "message", "type"} as OpenAI's error event."""
    if event == "error" and isinstance(data, dict) and "error" not in data:
        return {"error": data}
    return data
