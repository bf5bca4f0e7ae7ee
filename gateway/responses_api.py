"""OpenAI's Responses API (``POST /v1/responses``) over the chat pipeline.

A Responses request is read into the chat request it asks for (instructions
as the system message, input items as messages, max_output_tokens as
max_tokens), so tokenising, classification, routing and external servers
(sent that chat request) are the chat endpoint's own.  What differs is the
answer: a ``response`` object, or a stream of typed events (created,
in_progress, output item and content part added, text deltas, then the
done events and completed or incomplete).

kvgate keeps no state between requests: no stored responses, so
``previous_response_id`` and ``conversation`` are refused with a message that
says to send the whole conversation, and every response says ``store: false``.
Tool calls, logprobs and truncation "auto" are refused rather than answered as
if honoured.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import ApiError, bad_request
from gateway.protocol import _type_msg, new_id

RESPONSES = "responses"

# Request fields read here; the rest are ignored and logged as the chat endpoint's are.
_ECHOED = ("instructions", "max_output_tokens", "metadata", "temperature", "top_p", "user", "parallel_tool_calls",
           "tool_choice", "text", "truncation", "store", "stream", "stream_options", "include", "reasoning",
           "service_tier", "safety_identifier", "prompt_cache_key", "max_tool_calls", "top_logprobs", "tools")
_READ = frozenset(("model", "input", *_ECHOED, "previous_response_id", "conversation", "background", "prompt"))
# Chat fields the translated request carries as they came.
_SAME_NAME = ("model", "stream", "temperature", "top_p", "user")
# What no stateless server can do, each with why and what to send instead.
_STATEFUL = {
    "previous_response_id": "kvgate stores no responses: send the whole conversation in 'input' instead.",
    "conversation": "kvgate stores no conversations: send the whole conversation in 'input' instead.",
    "prompt": "kvgate stores no prompt templates: send the instructions and input themselves.",
}
_ROLES = ("user", "assistant", "system", "developer")
# A quoted span of an error message (a single quote inside a word, as in "model's", opens none).
_QUOTED = re.compile(r"""((?<!\w)'[^']*'(?!\w)|"[^"]*"|`[^`]*`)""")
# A quoted span that names a field of the chat request.
_FIELD_PATH = re.compile(r"messages(?:\[\d+\].*)?|max_(?:completion_)?tokens|response_format.*")
# The translated request's fields that the client sent under another name.
_SENT_AS = {"reasoning_effort": "reasoning"}
_MAX_METADATA_KEYS = 16
_MAX_METADATA_KEY = 64
_MAX_METADATA_VALUE = 512


@dataclass(slots=True)
class ResponsesCall:
    """What a response echoes of its request, and the id of its one output message."""

    echo: dict
    message_id: str = field(default_factory=lambda: new_id("msg_"))
    # How many system messages precede the input's (instructions): errors about
    # messages[k] name input[k - offset].
    offset: int = 0
    input_is_text: bool = False
    ignored: set = field(default_factory=set)

    def ignored_as_sent(self, chat_ignored: set | None) -> set | None:
        """The fields nothing reads, under the names the client sent: the chat
        request's (a field of its own translation among them) and this API's."""
        names = {_SENT_AS.get(name, name) for name in chat_ignored or ()} | self.ignored
        return names or None

    def rename(self, exc: ApiError) -> ApiError:
        """An error about the chat request, in this API's field names: its param, and
        the field names the gateway wrote in its message.  What is quoted there and
        names no field (a client's model name or role) stays as written, and so does
        a server's relayed message."""
        if isinstance(exc.param, str):
            exc.param = self._renamed(exc.param)
        if isinstance(exc.message, str) and not exc.relayed:
            parts = _QUOTED.split(exc.message)  # odd indexes: the quoted spans
            exc.message = "".join(part if i % 2 and not _FIELD_PATH.fullmatch(part[1:-1]) else self._renamed(part)
                                  for i, part in enumerate(parts))
        return exc

    def _renamed(self, text: str) -> str:
        def item(match: re.Match) -> str:
            k = int(match.group(1))
            if k < self.offset:
                return "instructions"
            return "input" if self.input_is_text else f"input[{k - self.offset}]"

        def too_many(match: re.Match) -> str:
            given, allowed = int(match.group(1)) - self.offset, int(match.group(2)) - self.offset
            return f"Too many input items: {given}. This server allows at most {allowed}" + (
                " with instructions" if self.offset else "")

        text = re.sub(r"Too many messages: (\d+)\. This server allows at most (\d+)", too_many, text)
        text = re.sub(r"\bmessages\[(\d+)\](?:\.content)?" if self.input_is_text else r"\bmessages\[(\d+)\]", item, text)
        text = re.sub(r"\bmessages\b", "input", text)
        text = re.sub(r"\bmax_(?:completion_)?tokens\b", "max_output_tokens", text)
        return re.sub(r"\bresponse_format\b", "text.format", text)


def chat_request(body: dict) -> tuple[dict, ResponsesCall]:
    """The chat request a Responses request asks for, and what its answer echoes."""
    for name, why in _STATEFUL.items():
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported: {why}", name)
    if _typed(body, "background", bool, "a boolean"):
        raise bad_request("'background' is not supported: kvgate answers while the client waits (or streams).",
                          "background")
    if _list(body, "tools"):
        raise bad_request("Tool calling is not supported on /v1/responses by kvgate; use /v1/chat/completions with "
                          "'tools' through a gateway in front of a server that parses tool calls (e.g. vLLM).", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        # With no tools there is nothing to require or name.
        raise bad_request(f"Invalid value for 'tool_choice': {json.dumps(choice)[:60]}. Without 'tools' (which kvgate "
                          "does not take here) only 'auto' and 'none' are allowed.", "tool_choice")
    _typed(body, "parallel_tool_calls", bool, "a boolean")
    if body.get("top_logprobs") or "message.output_text.logprobs" in _list(body, "include"):
        raise bad_request("Logprobs are not supported on /v1/responses by kvgate; use /v1/chat/completions with "
                          "'logprobs'.", "top_logprobs" if body.get("top_logprobs") else "include")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise bad_request(f"Invalid value: {json.dumps(truncation)[:60]}. Supported values are: 'auto' and 'disabled'.",
                          "truncation")
    if truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: kvgate refuses an input longer than the model's context "
                          "rather than dropping its oldest items (truncation 'disabled').", "truncation")
    chat = {name: body[name] for name in _SAME_NAME if name in body}
    call = ResponsesCall(echo=_echo(body))
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request(_type_msg("instructions", "a string", instructions), "instructions")
        messages.append({"role": "system", "content": instructions})
        call.offset = 1
    messages += _input_messages(body.get("input"), call)
    chat["messages"] = messages
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if type(max_output) is not int:
            raise bad_request(_type_msg("max_output_tokens", "an integer", max_output), "max_output_tokens")
        chat["max_tokens"] = max_output  # bounds checked as chat's, named as this API's
    fmt = _format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # the completed event carries usage
    effort = _reasoning_effort(body)
    if effort is not None:
        chat["reasoning_effort"] = effort  # chat's name for it, which vLLM's reasoning models read
    call.ignored = {name for name in body.keys() - _READ}
    return chat, call


def _typed(body: dict, key: str, kind: type, expected: str, where: str = "") -> Any:
    """``body[key]`` if given (None if not), refused unless of ``kind``; ``where`` names its object."""
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        name = where + key
        raise bad_request(_type_msg(name, expected, value), name)
    return value


def _reasoning_effort(body: dict) -> str | None:
    reasoning = _typed(body, "reasoning", dict, "an object")
    return None if reasoning is None else _typed(reasoning, "effort", str, "a string", "reasoning.")


def _list(body: dict, name: str) -> list:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(_type_msg(name, "an array", value), name)
    return value


def _echo(body: dict) -> dict:
    """The request's settings as the response states them, defaults filled in."""
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise bad_request(_type_msg("metadata", "an object of strings", metadata), "metadata")
        if len(metadata) > _MAX_METADATA_KEYS:
            raise bad_request(f"Invalid 'metadata': too many properties. Expected an object with at most "
                              f"{_MAX_METADATA_KEYS} properties, but got {len(metadata)} instead.", "metadata")
        # OpenAI's bounds: metadata is for labels, not payloads.
        for key, value in metadata.items():
            if len(key) > _MAX_METADATA_KEY or len(value) > _MAX_METADATA_VALUE:
                raise bad_request(f"Invalid 'metadata': keys may be at most {_MAX_METADATA_KEY} characters and values "
                                  f"at most {_MAX_METADATA_VALUE}.", f"metadata.{key[:_MAX_METADATA_KEY]}")
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "metadata": metadata or {},
        "parallel_tool_calls": _given(body, "parallel_tool_calls", True),
        "previous_response_id": None,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": effort, "summary": None},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": "default",
        "store": False,
        "temperature": _given(body, "temperature", 1.0),
        "text": _text_config(body.get("text")),
        "tool_choice": _given(body, "tool_choice", "auto"),
        "tools": [],
        "top_logprobs": 0,
        "top_p": _given(body, "top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }


def _text_config(text: Any) -> dict:
    """The text settings as the response states them: the format (text by default), and a verbosity if given."""
    stated = {"format": {"type": "text"}}
    if isinstance(text, dict):
        if isinstance(text.get("format"), dict):
            stated["format"] = text["format"]
        if text.get("verbosity") is not None:
            stated["verbosity"] = text["verbosity"]
    return stated


def _given(body: dict, name: str, default: Any) -> Any:
    """A field's value, or its default where absent or null (clients send null for "unset")."""
    value = body.get(name)
    return default if value is None else value


def _input_messages(given: Any, call: ResponsesCall) -> list[dict]:
    if given is None:
        raise bad_request("Missing required parameter: 'input'.", "input")
    if isinstance(given, str):
        call.input_is_text = True
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise bad_request(_type_msg("input", "a string or an array of input items", given), "input")
    return [_message(item, f"input[{i}]") for i, item in enumerate(given)]


def _message(item: Any, where: str) -> dict:
    if not isinstance(item, dict):
        raise bad_request(_type_msg(where, "an object", item), where)
    kind = item.get("type")
    if kind not in (None, "message"):
        raise bad_request(f"Input items of type {json.dumps(kind)[:60]} are not supported by kvgate: it serves messages "
                          "only (no tool calls, reasoning or stored items).", f"{where}.type")
    role = item.get("role")
    if role not in _ROLES:
        if role is None:
            raise bad_request(f"Missing required parameter: '{where}.role'.", f"{where}.role")
        raise bad_request(f"Invalid value for '{where}.role': {json.dumps(role)[:60]}. Supported values are: 'user', "
                          "'assistant', 'system' and 'developer'.", f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        content = [_part(part, f"{where}.content[{j}]", role) for j, part in enumerate(content)]
    elif not isinstance(content, str):
        if content is None:
            raise bad_request(f"Missing required parameter: '{where}.content'.", f"{where}.content")
        raise bad_request(_type_msg(f"{where}.content", "a string or an array of content parts", content),
                          f"{where}.content")
    return {"role": role, "content": content}


def _part(part: Any, where: str, role: str) -> dict:
    """A Responses content part as chat's: text, or an image by URL."""
    if not isinstance(part, dict):
        raise bad_request(_type_msg(where, "an object", part), where)
    kind = part.get("type")
    # output_text and refusal are an earlier answer's, as the SDK hands the history back.
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "refusal" and role == "assistant":
        return {"type": "refusal", "refusal": part.get("refusal")}
    if kind == "input_image":
        url = part.get("image_url")
        if url is None:
            raise bad_request(f"'{where}': kvgate has no Files API; give the image as 'image_url' (an http(s) URL or a "
                              "base64 data URL).", f"{where}.image_url")
        if not isinstance(url, str):
            raise bad_request(_type_msg(f"{where}.image_url", "a string", url), f"{where}.image_url")
        image = {"url": url}
        if _typed(part, "detail", str, "a string", f"{where}.") is not None:
            image["detail"] = part["detail"]  # what an external server reads; the bundled model has no images
        return {"type": "image_url", "image_url": image}
    raise bad_request(f"Invalid value for '{where}.type': {json.dumps(kind)[:60]}. Supported values are: 'input_text', "
                      "'output_text' and 'input_image'.", f"{where}.type")


def _format(body: dict) -> dict | None:
    """text.format as chat's response_format (json_schema's fields sit one level up here)."""
    text = _typed(body, "text", dict, "an object")
    if text is None:
        return None
    fmt = _typed(text, "format", dict, "an object", "text.")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        return fmt  # text and json_object read alike; anything else is refused by chat's check
    for key, kind, expected in (("name", str, "a string"), ("schema", dict, "an object")):
        if _typed(fmt, key, kind, expected, "text.format.") is None:
            raise bad_request(f"Missing required parameter: 'text.format.{key}'.", f"text.format.{key}")
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": schema}


# -- the answer


def response_usage(chat_usage: dict | None) -> dict:
    """Chat's usage in this API's names (cached tokens 0 where a replica did not say)."""
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    completion = chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt,
        # kvgate caches prefixes by itself; nothing is written on request (OpenAI's cache writes).
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class ResponseShaper:
    """One response's object and, streamed, its events (each with its sequence number)."""

    def __init__(self, rid: str, created: int, model: str, call: ResponsesCall) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self.call = call
        self.sequence = 0
        self.text: list[str] = []

    def response(self, status: str, output: list, usage: dict | None = None, finish: str | None = None,
                 error: dict | None = None, completed_at: int | None = None) -> dict:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "completed_at": completed_at,
            "error": error,
            "incomplete_details": {"reason": _INCOMPLETE[finish]} if finish in _INCOMPLETE else None,
            "model": self.model,
            "output": output,
            **self.call.echo,
            "usage": usage,
        }

    def message(self, text: str | None, finish: str | None = None) -> dict:
        """The output message: in progress (no text yet), then completed or incomplete."""
        if text is None:
            return {"id": self.call.message_id, "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        return {"id": self.call.message_id, "type": "message", "status": _status(finish), "role": "assistant",
                "content": [_text_part(text)]}

    def whole(self, text: str, finish: str | None, chat_usage: dict, completed_at: int) -> dict:
        return self.response(_status(finish), [self.message(text, finish)], response_usage(chat_usage), finish,
                             completed_at=completed_at)

    # -- streamed

    def _event(self, kind: str, fields: dict) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"

    def opening(self) -> bytes:
        """created, in_progress, and the output message and its text part begun."""
        begun = self.response("in_progress", [])
        where = {"item_id": self.call.message_id, "output_index": 0, "content_index": 0}
        return b"".join((
            self._event("response.created", {"response": begun}),
            self._event("response.in_progress", {"response": begun}),
            self._event("response.output_item.added", {"output_index": 0, "item": self.message(None)}),
            self._event("response.content_part.added", {**where, "part": _text_part("")}),
        ))

    def delta(self, text: str) -> bytes:
        self.text.append(text)
        return self._event("response.output_text.delta", {"item_id": self.call.message_id, "output_index": 0,
                                                          "content_index": 0, "delta": text, "logprobs": []})

    def closing(self, finish: str | None, chat_usage: dict, completed_at: int) -> bytes:
        """The text, part and message done, then completed (or incomplete: max_output_tokens reached)."""
        text = "".join(self.text)
        where = {"item_id": self.call.message_id, "output_index": 0, "content_index": 0}
        item = self.message(text, finish)
        final = self.response(_status(finish), [item], response_usage(chat_usage), finish, completed_at=completed_at)
        return b"".join((
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
            self._event("response.content_part.done", {**where, "part": _text_part(text)}),
            self._event("response.output_item.done", {"output_index": 0, "item": item}),
            self._event("response.completed" if final["status"] == "completed" else "response.incomplete",
                        {"response": final}),
        ))

    def failed(self, exc: ApiError) -> bytes:
        """The stream's end after a failure once under way (the HTTP status already sent)."""
        text = "".join(self.text)
        output = [{**self.message(text), "status": "incomplete"}] if text else []
        error = {"code": "rate_limit_exceeded" if exc.status == 429 else "server_error", "message": exc.message}
        return self._event("response.failed", {"response": self.response("failed", output, error=error)})


# Finish reasons that leave a response incomplete, as incomplete_details names them.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _status(finish: str | None) -> str:
    return "incomplete" if finish in _INCOMPLETE else "completed"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
