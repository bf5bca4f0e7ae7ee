"""OpenAI's response objects, built exactly as OpenAI returns them, so the
official SDKs parse them without complaint: chat.completion and
text_completion bodies, their stream chunks as SSE frames (``StreamFormatter``),
usage and logprobs.  gateway/respond.py drives them; gateway/protocol.py
parses the requests.
"""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps' own encoder for a str

from engine.request import TokenLogprob, Usage
from engine.token_pieces import token_bytes
from gateway.protocol import CHAT


def now_s() -> int:
    return int(time.time())


def usage_dict(usage: Usage | None) -> dict:
    if usage is None:
        usage = Usage(0, 0, 0)
    out = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        # null where a replica did not say (as vLLM without prompt token details)
        "prompt_tokens_details": None if usage.cached_tokens is None else {"cached_tokens": usage.cached_tokens},
    }
    if usage.reasoning_tokens is not None:  # as vLLM: only from a server with a reasoning parser
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return out


def chat_logprobs(items: list[TokenLogprob] | None) -> dict | None:
    if items is None:
        return None
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": token_bytes(lp.token),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": token_bytes(t)} for _, t, v in lp.top],
            }
            for lp in items
        ],
        "refusal": None,
    }


class TokenOffsets:
    """Where each logprobs token starts in its choice's text (the legacy
    ``text_offset``), in characters.  A token that holds part of a character
    (``bytes:\\x..``) adds nothing until the one that completes it adds the
    character, so the offsets index the text the client reads."""

    __slots__ = ("position", "_utf8")

    def __init__(self) -> None:
        self.position = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, token: str) -> int:
        data = bytes(token_bytes(token))
        start = self.position
        held = self._utf8.getstate()[0]
        if held and data and not _continues(held, data[0]):
            # Bytes held from earlier tokens that this one cannot complete: their
            # character (one U+FFFD: held bytes are a valid start) comes before this
            # token's text, in the same decode; the token starts after it.
            start += 1
        self.position += len(self._utf8.decode(data))
        return start


def _continues(held: bytes, byte: int) -> bool:
    """Whether ``byte`` goes on with the character ``held`` began (still valid UTF-8)."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(held + bytes((byte,)))
    except UnicodeDecodeError:
        return False
    return True


def completion_logprobs(items: list[TokenLogprob] | None, offsets: TokenOffsets, with_sampled: bool = True) -> dict | None:
    """The legacy shape; ``offsets`` carries the text position across a stream's
    chunks.  ``with_sampled``: each top_logprobs entry also holds the sampled
    token (up to logprobs + 1 entries), as OpenAI and vLLM return them."""
    if items is None:
        return None
    tokens, values, tops, starts = [], [], [], []
    for lp in items:
        tokens.append(lp.token)
        values.append(lp.logprob)
        top = {t: v for _, t, v in lp.top}
        if with_sampled and lp.logprob is not None:  # None: an echoed prompt's first token
            top.setdefault(lp.token, lp.logprob)
        tops.append(top or None)
        starts.append(offsets.advance(lp.token) if lp.in_text else offsets.position)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": starts}


@dataclass(slots=True)
class ChoiceState:
    """Accumulated output of one choice (non-streaming) or its stream position."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    offsets: TokenOffsets | None = None  # streamed completions with logprobs
    started: bool = False
    # An external server's other message fields (tool_calls, reasoning).
    extra: dict | None = None
    # The order a Responses answer lists its items in, as each began, noted from the
    # first extra field on: ("r", start) a run of reasoning, ("t", start) a run of
    # text (its first character's offset: a run after another item is an item of
    # its own, as streamed), ("x", start) a run of refusal, ("c", position) a tool
    # call.  Text before anything was noted is a run from 0; text alone is never noted.
    began: tuple = ()


def merge_delta_extra(acc: dict, delta: dict) -> None:
    """Fold one streamed delta's extra fields into a whole message's, as OpenAI's
    SDK accumulates a stream: tool call fragments by their index (id, type and
    name once, arguments appended), other strings appended, anything else
    replaced."""
    for key, value in delta.items():
        if key == "tool_calls" and isinstance(value, list):
            calls = acc.setdefault("tool_calls", [])
            for fragment in value:
                if not isinstance(fragment, dict):
                    continue
                position = fragment.get("index", len(calls))
                while len(calls) <= position:
                    calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call = calls[position]
                if fragment.get("id"):
                    call["id"] = fragment["id"]
                if fragment.get("type"):
                    call["type"] = fragment["type"]
                function = fragment.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
        elif key == "function_call" and isinstance(value, dict):
            # The deprecated single call: name once, arguments in fragments.
            call = acc.setdefault("function_call", {"name": "", "arguments": ""})
            call["name"] += value.get("name") or ""
            call["arguments"] += value.get("arguments") or ""
        elif isinstance(value, str) and isinstance(acc.get(key), str):
            acc[key] += value
        else:
            acc[key] = value


def chat_completion(rid: str, created: int, model: str, choices: list[ChoiceState], usage: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": _message(c),
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage,
        "system_fingerprint": None,
    }


def _message(choice: ChoiceState) -> dict:
    message = {"role": "assistant", "content": "".join(choice.text), "refusal": None}
    if choice.extra:
        message.update(choice.extra)
        calls = message.get("tool_calls")
        if calls:
            # Places no fragment filled are no calls: vLLM's named tool_choice streams
            # choice i's one call with index i, and choice 1 had an empty call 0.
            message["tool_calls"] = [call for call in calls if not isinstance(call, dict) or call.get("id")
                                     or call["function"]["name"] or call["function"]["arguments"]]
        if (message.get("tool_calls") or message.get("refusal")) and not message["content"]:
            message["content"] = None  # OpenAI's shape for a turn that only calls tools, or refuses
    return message


def text_completion(
    rid: str, created: int, model: str, choices: list[ChoiceState], usage: dict, with_sampled: bool = True
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "text": "".join(c.text),
                "logprobs": completion_logprobs(c.logprobs, TokenOffsets(), with_sampled),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage,
        "system_fingerprint": None,
    }


class StreamFormatter:
    """Builds SSE frames for one streamed request.

    The static part of every chunk is encoded once.  The frames of plain text
    deltas (no logprobs), the bulk of a stream, are assembled from strings with
    json's own string encoder: the same bytes ``json.dumps`` gives (a test
    compares them), at a fifth of the cost, which matters at one frame per token.
    ``include_usage`` adds ``"usage": null`` to every chunk and a final chunk
    with empty choices, as OpenAI does.
    """

    __slots__ = ("endpoint", "include_usage", "with_sampled", "_head", "_tail", "_chat")

    def __init__(
        self, endpoint: str, rid: str, created: int, model: str, include_usage: bool, with_sampled: bool = True
    ) -> None:
        self.endpoint = endpoint
        self._chat = endpoint == CHAT
        self.include_usage = include_usage
        self.with_sampled = with_sampled
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = (
            f'data: {{"id": {_json_str(rid)}, "object": "{obj}", "created": {int(created)}, '
            f'"model": {_json_str(model)}, "system_fingerprint": null, "choices": ['
        ).encode()
        self._tail = b'], "usage": null}\n\n' if include_usage else b"]}\n\n"

    def _frame(self, choice: dict) -> bytes:
        return self._head + json.dumps(choice).encode() + self._tail

    def role(self, index: int) -> bytes:
        return self._head + _role_choice(index) + self._tail

    def delta(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        state: ChoiceState,
        finish: str | None = None,
        extra: dict | None = None,
        stop_reason: int | str | None = None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        """A choice's chunk; the one that finishes it (``finish``) also carries
        vLLM's ``stop_reason``, the others stay as OpenAI sends them.
        ``token_ids`` (a `kvgate engine`'s completions, for its gateway) adds them."""
        if extra and self._chat:
            delta = {"content": text} if text else {}
            delta.update(extra)
            return self._frame({"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                                "finish_reason": finish, **_ended(finish, stop_reason)})
        if logprobs is None:
            if finish is None:
                finish_json = "null"
            else:
                finish_json = f'{_json_str(finish)}, "stop_reason": {json.dumps(stop_reason)}'
            if self._chat:
                delta = f'{{"content": {_json_str(text)}}}' if text or finish is None else "{}"
                choice = f'{{"index": {index}, "delta": {delta}, "logprobs": null, "finish_reason": {finish_json}}}'
            elif token_ids is not None:
                choice = (f'{{"index": {index}, "text": {_json_str(text)}, "logprobs": null, '
                          f'"finish_reason": {finish_json}, "token_ids": {json.dumps(token_ids)}}}')
            else:
                choice = f'{{"index": {index}, "text": {_json_str(text)}, "logprobs": null, "finish_reason": {finish_json}}}'
            return self._head + choice.encode() + self._tail
        if self._chat:
            delta = {"content": text} if text or finish is None else {}
            return self._frame({"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                                "finish_reason": finish, **_ended(finish, stop_reason)})
        if state.offsets is None:
            state.offsets = TokenOffsets()
        lp = completion_logprobs(logprobs, state.offsets, self.with_sampled)
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, **_ended(finish, stop_reason)}
        if token_ids is not None:
            choice["token_ids"] = token_ids
            # Tokens whose text the choice's leaves out (special ones): its gateway
            # cannot tell them by their text, and must not count them in text_offset.
            outside = [i for i, item in enumerate(logprobs) if not item.in_text]
            if outside:
                choice["kvgate_not_in_text"] = outside
        return self._frame(choice)

    def usage(self, usage: dict, kv_seq: int | None = None) -> bytes:
        """The usage chunk; ``kv_seq``: a `kvgate engine`'s last KV event by then, for
        the calling gateway (its index has the request's blocks once it applied that)."""
        tail = b"}\n\n" if kv_seq is None else b', "kvgate_kv_seq": %d}\n\n' % kv_seq
        return self._head + b'], "usage": ' + json.dumps(usage).encode() + tail


def _ended(finish: str | None, stop_reason: int | str | None) -> dict:
    """vLLM's stop_reason, on the chunk that finishes a choice only."""
    return {} if finish is None else {"stop_reason": stop_reason}


_ROLE_CHOICES: dict[int, bytes] = {}


def _role_choice(index: int) -> bytes:
    choice = _ROLE_CHOICES.get(index)
    if choice is None:
        choice = json.dumps(
            {"index": index, "delta": {"role": "assistant", "content": "", "refusal": None}, "logprobs": None, "finish_reason": None}
        ).encode()
        if index < 1024:  # n is bounded by config; the cache stays small anyway
            _ROLE_CHOICES[index] = choice
    return choice


DONE = b"data: [DONE]\n\n"


def sse_error(err_body: dict) -> bytes:
    return b"data: " + json.dumps(err_body).encode() + b"\n\n"
