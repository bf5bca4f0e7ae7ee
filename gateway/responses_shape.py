"""A Responses API answer: the ``response`` object, or its stream of typed events.

The chat completion's outputs become output items, in the order they begin: a
``reasoning`` item for the reasoning text an external server's reasoning parser
split off (chat's ``reasoning``, or ``reasoning_content`` as older servers name
it), a message for the text, a ``function_call`` item for each tool call it
parsed (chat's ``tool_calls``).  A server's refusal (chat's ``refusal``, as
OpenAI and vLLM with structured outputs send it) is a ``refusal`` part of the
message, after its text, or of a message of its own.  Streamed, each item is
added when its first output arrives and grows by deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.refusal.delta``, ``response.function_call_arguments.delta``).
One item is in progress at a time, as OpenAI streams them: the next one
beginning makes it done (the reasoning once the answer starts, a call once the
next begins), the last is done at the end, before ``response.completed`` (or
``incomplete``, or ``failed``) with the whole response.  Text or reasoning that
comes after its item is done is a new item (a message after a call).  Items
done before the end are completed; the last one takes the response's status.
gateway/responses_api.py reads the request.
"""

from __future__ import annotations

import json
import logging

from gateway.errors import ApiError
from gateway.protocol import new_id
from gateway.responses_api import ResponsesCall

log = logging.getLogger(__name__)

# Finish reasons that leave a response incomplete, as incomplete_details names them.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_usage(chat_usage: dict | None) -> dict:
    """Chat's usage in this API's names (cached and reasoning tokens 0 where a replica did not say)."""
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    completion = chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        # kvgate caches prefixes by itself; nothing is written on request (OpenAI's cache writes).
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def reasoning_of(extra: dict) -> str:
    """The reasoning text in a chat message's or delta's extra fields: vLLM's
    ``reasoning``, or ``reasoning_content`` (vLLM's older name for it, and
    SGLang's); one of them, as a server sending both sends the same text twice."""
    for name in ("reasoning", "reasoning_content"):
        value = extra.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def refusal_of(extra: dict) -> str:
    """The refusal text in a chat message's or delta's extra fields."""
    value = extra.get("refusal")
    return value if isinstance(value, str) else ""


def began_order(began: tuple, out, text: list[str], thought: str, calls: int, refused: str = "") -> tuple:
    """``began`` (see ChoiceState) with what ``out`` begins, after ``text`` (the
    choice's pieces so far), ``thought`` (its reasoning so far), ``refused`` (its
    refusal so far) and ``calls`` tool calls: within one output, reasoning, then
    text, then refusal, then each call, the order a stream shows them in.
    Reasoning, text or refusal that follows another item is a run of its own (a
    new item, as streamed; a refusal right after text joins its message).  A
    call's position is its index, or, without one, the next (a call of its own,
    as shapes.merge_delta_extra reads it)."""
    if text and not began:
        began = (("t", 0),)  # text that came before anything noted
    if reasoning_of(out.extra or {}) and (not began or began[-1][0] != "r"):
        began += (("r", len(thought)),)
    if out.text and (not began or began[-1][0] != "t"):
        began += (("t", sum(map(len, text))),)
    if refusal_of(out.extra or {}) and (not began or began[-1][0] != "x"):
        began += (("x", len(refused)),)
    for fragment in (out.extra or {}).get("tool_calls") or ():
        if isinstance(fragment, dict):
            position = fragment.get("index", calls)
            if isinstance(position, int) and not isinstance(position, bool):
                if ("c", position) not in began:
                    began += (("c", position),)
                calls = max(calls, position + 1)
    return began


class _Item:
    """One output item as it grows: the reasoning's or the message's text (and a
    message's refusal), or a call's name and arguments."""

    __slots__ = ("index", "id", "kind", "call_id", "name", "parts", "refusal", "status")

    def __init__(self, index: int, item_id: str, kind: str, call_id: str | None = None, name: str = "") -> None:
        self.index = index
        self.id = item_id
        self.kind = kind  # "message", "reasoning" or "function_call"
        self.call_id = call_id
        self.name = name
        self.parts: list[str] = []
        # A message's refusal, a part after its text (the only part where no text came before it).
        self.refusal: list[str] | None = None
        self.status: str | None = None  # set once done

    def final(self, status: str) -> dict:
        """Its shape in the finished response: as it was done, or ``status`` (the last item)."""
        return self.shape(self.status or status)

    def shape(self, status: str) -> dict:
        if self.kind == "message":
            content = self.content() if status != "in_progress" else []
            return {"id": self.id, "type": "message", "status": status, "role": "assistant", "content": content}
        if self.kind == "reasoning":
            content = [_reasoning_part("".join(self.parts))] if status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "status": status, "summary": [], "content": content}
        return {"id": self.id, "type": "function_call", "status": status, "call_id": self.call_id, "name": self.name,
                "arguments": "".join(self.parts)}

    def part(self) -> dict:
        """The text part a message or reasoning item holds, whole so far."""
        whole = "".join(self.parts)
        return _text_part(whole) if self.kind == "message" else _reasoning_part(whole)

    def content(self) -> list[dict]:
        """A message's parts: its text (empty in a message of nothing), then its refusal."""
        if self.refusal is None:
            return [self.part()]
        return [*([self.part()] if self.parts else []), _refusal_part("".join(self.refusal))]

    def refusal_index(self) -> int:
        """Its refusal part's place: after its text part, where it has one."""
        return 1 if self.parts else 0


class ResponseShaper:
    """One response's object and, streamed, its events (each with its sequence number)."""

    def __init__(self, rid: str, created: int, model: str, call: ResponsesCall) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self.call = call
        self.sequence = 0
        self.items: list[_Item] = []
        self._message: _Item | None = None
        self._reasoning: _Item | None = None
        self._calls: dict[int, _Item] = {}  # by chat's tool call index
        self._next_call = 0  # one past the highest index so far: where a call without one goes
        self._current: _Item | None = None  # streamed: the item in progress

    def response(self, status: str, output: list, usage: dict | None = None, finish: str | None = None,
                 error: dict | None = None, completed_at: int | None = None) -> dict:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "completed_at": completed_at if status == "completed" else None,  # OpenAI's: only once completed
            "error": error,
            "incomplete_details": {"reason": _INCOMPLETE[finish]} if finish in _INCOMPLETE else None,
            "model": self.model,
            "output": output,
            **self.call.echo,
            "usage": usage,
        }

    def whole(self, text: str, extra: dict | None, finish: str | None, chat_usage: dict, completed_at: int,
              began: tuple = ()) -> dict:
        """The response to a completion gathered whole (its message's extra fields:
        reasoning, tool calls), its items in the order they began (``began``, as
        ChoiceState notes it), each run of text or reasoning an item, as streamed
        (a refusal a part of its text's message)."""
        extra = extra or {}
        calls, thought, refused = extra.get("tool_calls") or [], reasoning_of(extra), refusal_of(extra)
        # Text never noted is one run.  Every call a server began is noted; the others
        # are the blanks chat's gathering puts in an index a server skipped (its first
        # call at index 1): no call, and not in the stream.
        order = began or (("t", 0),)
        # Each run of text, reasoning or refusal ends where the next of its kind starts.
        ends = {}
        for kind, joined in (("t", text), ("r", thought), ("x", refused)):
            starts = [start for k, start in order if k == kind]
            ends.update({(kind, start): end for start, end in zip(starts, [*starts[1:], len(joined)])})
        message = None  # the message of the run of text just before
        for kind, where in order:
            before, message = message, None
            if kind == "c":
                if 0 <= where < len(calls):
                    function = calls[where].get("function") or {}
                    self._call_item(calls[where].get("id"), function.get("name") or "").parts.append(
                        function.get("arguments") or "")
                continue
            if kind == "x":
                # A refusal right after text is a part of its message, else a message of its
                # own; text after it is another message (as streamed).
                run = refused[where:ends[kind, where]]
                if run:
                    (before or self._new_item(new_id("msg_"), "message")).refusal = [run]
                continue
            run = (text if kind == "t" else thought)[where:ends[kind, where]]
            if run:
                prefix, item_kind = ("msg_", "message") if kind == "t" else ("rs_", "reasoning")
                item = self._new_item(new_id(prefix), item_kind)
                item.parts.append(run)
                if kind == "t":
                    message = item
        if not self.items:  # no output at all: an empty message
            self._text_item()
        for item in self.items[:-1]:  # as streamed: done as the next began
            item.status = "completed"
        status = _status(finish)
        return self.response(status, [item.final(status) for item in self.items], response_usage(chat_usage), finish,
                             completed_at=completed_at)

    def _text_item(self) -> _Item:
        if self._message is None:
            self._message = self._new_item(new_id("msg_"), "message")
        return self._message

    def _reasoning_item(self) -> _Item:
        if self._reasoning is None:
            self._reasoning = self._new_item(new_id("rs_"), "reasoning")
        return self._reasoning

    def _call_item(self, call_id: str | None, name: str) -> _Item:
        return self._new_item(new_id("fc_"), "function_call", call_id or new_id("call_"), name)

    def _new_item(self, item_id: str, kind: str, call_id: str | None = None, name: str = "") -> _Item:
        item = _Item(len(self.items), item_id, kind, call_id, name)
        self.items.append(item)
        return item

    # -- streamed

    def _event(self, kind: str, fields: dict) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"

    def opening(self) -> bytes:
        """created and in_progress; items are added as their first output comes."""
        begun = self.response("in_progress", [])
        return self._event("response.created", {"response": begun}) + self._event("response.in_progress",
                                                                                   {"response": begun})

    def delta(self, text: str) -> bytes:
        frames = b"" if self._message is not None and self._message is self._current else self._open_message()
        item = self._message
        item.parts.append(text)
        return frames + self._event("response.output_text.delta", {**_where(item), "delta": text, "logprobs": []})

    def _open_message(self) -> bytes:
        self._message = None  # a message after the one done (text after a call) is an item of its own
        item = self._text_item()
        return self._begin(item) + self._event("response.content_part.added", {**_where(item), "part": item.part()})

    def reasoning(self, text: str) -> bytes:
        frames = b""
        if self._reasoning is None or self._reasoning is not self._current:
            self._reasoning = None
            item = self._reasoning_item()
            frames = self._begin(item) + self._event("response.content_part.added", {**_where(item), "part": item.part()})
        item = self._reasoning
        item.parts.append(text)
        return frames + self._event("response.reasoning_text.delta", {**_where(item), "delta": text})

    def refusal(self, text: str) -> bytes:
        """Chat's refusal: a part of the message in progress, after its text (done as the
        refusal begins), or of a message of its own (after reasoning or a call)."""
        item = self._current
        frames = b""
        if item is None or item.kind != "message":
            item = self._new_item(new_id("msg_"), "message")
            frames = self._begin(item)
        if item.refusal is None:
            if item.parts:
                frames += self._text_done(item)
            item.refusal = []
            frames += self._event("response.content_part.added", {**_where(item, item.refusal_index()),
                                                                   "part": _refusal_part("")})
            # Text after the refusal is a message of its own, so delta()'s own check (no cost
            # per token) opens it.
            self._message = None
        item.refusal.append(text)
        return frames + self._event("response.refusal.delta", {**_where(item, item.refusal_index()), "delta": text})

    def tool_calls(self, fragments: list) -> bytes:
        """Chat's streamed tool call fragments (id and name first, then pieces of the arguments)."""
        frames = []
        for fragment in fragments:
            if not isinstance(fragment, dict):
                continue
            function = fragment.get("function") or {}
            # No index: a call of its own, as chat's accumulation (shapes.merge_delta_extra) reads it:
            # one past the highest index so far (not the count of calls, which a skipped index makes
            # smaller: the fragment then joined the call at that index).
            position = fragment.get("index", self._next_call)
            if isinstance(position, int):
                self._next_call = max(self._next_call, position + 1)
            item = self._calls.get(position)
            if item is None:
                item = self._calls[position] = self._call_item(fragment.get("id"), function.get("name") or "")
                frames.append(self._begin(item))
            elif function.get("name"):
                item.name += function["name"]
            arguments = function.get("arguments")
            if not arguments:
                continue
            item.parts.append(arguments)
            if item.status is None:
                frames.append(self._event("response.function_call_arguments.delta",
                                          {"item_id": item.id, "output_index": item.index, "delta": arguments}))
            else:
                # Servers stream each call's arguments before the next call begins; one
                # that did not: the final response has them whole, its done event did not.
                log.warning("response %s: arguments for tool call %s came after it was done (another output began "
                            "after it); the final response holds them", self.rid, item.call_id)
        return b"".join(frames)

    def _begin(self, item: _Item) -> bytes:
        """``item`` added, and in progress in place of the one before, which is done."""
        frames = self._done(self._current, "completed") if self._current is not None else b""
        self._current = item
        return frames + self._event("response.output_item.added",
                                    {"output_index": item.index, "item": item.shape("in_progress")})

    def _done(self, item: _Item, status: str) -> bytes:
        item.status = status
        if item.kind == "message" and item.refusal is not None:  # its text part, if any, was done before it
            where = _where(item, item.refusal_index())
            refused = "".join(item.refusal)
            frames = (self._event("response.refusal.done", {**where, "refusal": refused})
                      + self._event("response.content_part.done", {**where, "part": _refusal_part(refused)}))
        elif item.kind == "message":
            frames = self._text_done(item)
        elif item.kind == "reasoning":
            frames = (self._event("response.reasoning_text.done", {**_where(item), "text": "".join(item.parts)})
                      + self._event("response.content_part.done", {**_where(item), "part": item.part()}))
        else:
            frames = self._event("response.function_call_arguments.done",
                                 {"item_id": item.id, "output_index": item.index, "arguments": "".join(item.parts)})
        return frames + self._event("response.output_item.done", {"output_index": item.index, "item": item.shape(status)})

    def _text_done(self, item: _Item) -> bytes:
        return (self._event("response.output_text.done", {**_where(item), "text": "".join(item.parts), "logprobs": []})
                + self._event("response.content_part.done", {**_where(item), "part": item.part()}))

    def closing(self, finish: str | None, chat_usage: dict, completed_at: int) -> bytes:
        """The last item done, then completed (or incomplete: max_output_tokens reached)."""
        # No output at all: an empty message, as the whole response has.
        frames = [self._open_message()] if not self.items else []
        status = _status(finish)
        if self._current is not None:
            frames.append(self._done(self._current, status))
            self._current = None
        final = self.response(status, [item.final(status) for item in self.items], response_usage(chat_usage), finish,
                              completed_at=completed_at)
        frames.append(self._event("response.completed" if status == "completed" else "response.incomplete",
                                  {"response": final}))
        return b"".join(frames)

    def failed(self, exc: ApiError) -> bytes:
        """The stream's end after a failure once under way (the HTTP status already sent)."""
        output = [item.final("incomplete") for item in self.items]
        error = {"code": "rate_limit_exceeded" if exc.status == 429 else "server_error", "message": exc.message}
        return self._event("response.failed", {"response": self.response("failed", output, error=error)})


def _where(item: _Item, content_index: int = 0) -> dict:
    return {"item_id": item.id, "output_index": item.index, "content_index": content_index}


def _status(finish: str | None) -> str:
    return "incomplete" if finish in _INCOMPLETE else "completed"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _refusal_part(text: str) -> dict:
    return {"type": "refusal", "refusal": text}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}
