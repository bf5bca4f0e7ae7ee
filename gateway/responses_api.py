"""OpenAI's Responses API (``POST /v1/responses``): its request read as the chat request it asks for.

Instructions become the system message, input items the messages (function
calls and their outputs an assistant's tool calls and tool messages),
function tools chat's tools, max_output_tokens max_tokens; so tokenising,
classification, routing and external servers (sent that chat request) are the
chat endpoint's own.  The answer is shaped by gateway/responses_shape.py.

kvgate keeps no state between requests: no stored responses, so
``previous_response_id`` and ``conversation`` are refused with a message that
says to send the whole conversation, and every response says ``store: false``.
Built-in tools, logprobs and truncation "auto" are refused rather than
answered as if honoured.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import ApiError, bad_request
from gateway.protocol import _type_msg, each_object

RESPONSES = "responses"

# Request fields read here; the rest are ignored and logged as the chat endpoint's are.
_ECHOED = ("instructions", "max_output_tokens", "metadata", "temperature", "top_p", "user", "parallel_tool_calls",
           "tool_choice", "text", "truncation", "store", "stream", "stream_options", "include", "reasoning",
           "service_tier", "safety_identifier", "prompt_cache_key", "max_tool_calls", "top_logprobs", "tools")
_READ = frozenset(("model", "input", *_ECHOED, "previous_response_id", "conversation", "background", "prompt"))
# Chat fields the translated request carries as they came.
_SAME_NAME = ("model", "stream", "temperature", "top_p", "user", "prompt_cache_key", "safety_identifier")
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
_SUMMARIES = ("auto", "concise", "detailed")
# OpenAI's values (the SDK's ReasoningEffort, ResponseTextConfig.verbosity, ResponseIncludable):
# another would be echoed in an answer its own types refuse.
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_VERBOSITIES = ("low", "medium", "high")
_INCLUDABLE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.output_text.logprobs",
})
_MAX_METADATA_KEYS = 16
_MAX_METADATA_KEY = 64
_MAX_METADATA_VALUE = 512


@dataclass(slots=True)
class ResponsesCall:
    """What a response echoes of its request, and how its errors name the chat request's fields."""

    echo: dict
    # How many system messages precede the input's (instructions): errors about
    # messages[k] name input[k - offset].
    offset: int = 0
    input_is_text: bool = False
    # Chat message k (after the instructions) -> its input index, where function
    # calls were folded into the assistant message before them; None: the same.
    index_map: list[int] | None = None
    input_items: int = 0
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
            if self.input_is_text:
                return "input"
            k -= self.offset
            return f"input[{self.index_map[k] if self.index_map is not None and k < len(self.index_map) else k}]"

        def too_many(match: re.Match) -> str:
            given, allowed = self.input_items or int(match.group(1)) - self.offset, int(match.group(2)) - self.offset
            return f"Too many input items: {given}. This server allows at most {allowed}" + (
                " with instructions" if self.offset else "")

        text = re.sub(r"Too many messages: (\d+)\. This server allows at most (\d+)", too_many, text)
        text = re.sub(r"\bmessages\[(\d+)\](?:\.content)?" if self.input_is_text else r"\bmessages\[(\d+)\]", item, text)
        text = re.sub(r"\bmessages\b", "input", text)
        text = re.sub(r"\bmax_(?:completion_)?tokens\b", "max_output_tokens", text)
        text = re.sub(r"(\bcontent\[\d+\]\.image_url)\.url\b", r"\1", text)  # a string here, not chat's object
        return re.sub(r"\bresponse_format\b", "text.format", text)


def chat_request(body: dict) -> tuple[dict, ResponsesCall]:
    """The chat request a Responses request asks for, and what its answer echoes."""
    for name, why in _STATEFUL.items():
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported: {why}", name)
    if _typed(body, "background", bool, "a boolean"):
        raise bad_request("'background' is not supported: kvgate answers while the client waits (or streams).",
                          "background")
    tools = [_function_tool(tool, where) for where, tool in each_object(_list(body, "tools"), "tools")]
    choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = _typed(body, "parallel_tool_calls", bool, "a boolean")
    if body.get("max_tool_calls") is not None:
        raise bad_request("'max_tool_calls' is not supported: kvgate passes on the tool calls the server makes, as "
                          "many as it makes.", "max_tool_calls")
    include = _list(body, "include")
    for where, value in enumerate(include):
        if not isinstance(value, str) or value not in _INCLUDABLE:  # a list or object is no member, and unhashable
            raise bad_request(_one_of(f"include[{where}]", value, sorted(_INCLUDABLE)), f"include[{where}]")
    for name in ("prompt_cache_key", "safety_identifier"):
        _typed(body, name, str, "a string")
    if body.get("top_logprobs") or "message.output_text.logprobs" in include:
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
    if tools:
        chat["tools"] = tools
    if choice is not None and tools:  # chat allows it only with tools; without, auto and none say nothing
        chat["tool_choice"] = choice
    if parallel is not None and tools:
        chat["parallel_tool_calls"] = parallel
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
    if reasoning is None:
        return None
    summary = reasoning.get("summary")
    if summary is not None and summary not in _SUMMARIES:
        raise bad_request(f"Invalid value for 'reasoning.summary': {json.dumps(summary)[:60]}. Supported values are: "
                          "'auto', 'concise' and 'detailed'.", "reasoning.summary")
    effort = reasoning.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise bad_request(_one_of("reasoning.effort", effort, _EFFORTS), "reasoning.effort")
    return effort


def _one_of(name: str, value: Any, allowed) -> str:
    listed = ", ".join(f"'{v}'" for v in allowed)
    return f"Invalid value for '{name}': {json.dumps(value)[:60]}. Supported values are: {listed}."


def _list(body: dict, name: str, where: str = "") -> list:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(_type_msg(where + name, "an array", value), where + name)
    return value


def _echo(body: dict) -> dict:
    """The request's settings as the response states them, defaults filled in."""
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_request(_type_msg("metadata", "an object of strings", metadata), "metadata")
        for key, value in metadata.items():
            if not isinstance(value, str):  # named as OpenAI names it: the value, not the object
                raise bad_request(_type_msg(f"metadata.{key[:_MAX_METADATA_KEY]}", "a string", value),
                                  f"metadata.{key[:_MAX_METADATA_KEY]}")
        if len(metadata) > _MAX_METADATA_KEYS:
            raise bad_request(f"Invalid 'metadata': too many properties. Expected an object with at most "
                              f"{_MAX_METADATA_KEYS} properties, but got {len(metadata)} instead.", "metadata")
        # OpenAI's bounds: metadata is for labels, not payloads.
        for key, value in metadata.items():
            if len(key) > _MAX_METADATA_KEY or len(value) > _MAX_METADATA_VALUE:
                raise bad_request(f"Invalid 'metadata': keys may be at most {_MAX_METADATA_KEY} characters and values "
                                  f"at most {_MAX_METADATA_VALUE}.", f"metadata.{key[:_MAX_METADATA_KEY]}")
    reasoning = body.get("reasoning")
    reasoning = reasoning if isinstance(reasoning, dict) else {}
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "metadata": metadata or {},
        "parallel_tool_calls": _given(body, "parallel_tool_calls", True),
        "previous_response_id": None,
        "prompt_cache_key": body.get("prompt_cache_key"),
        # As sent (a summary is the model's to write: a server's reasoning comes whole, summary empty).
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": "default",
        "store": False,
        "temperature": _given(body, "temperature", 1.0),
        "text": _text_config(body.get("text")),
        "tool_choice": _given(body, "tool_choice", "auto"),
        "tools": body.get("tools") or [],
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
        verbosity = text.get("verbosity")
        if verbosity is not None:
            if verbosity not in _VERBOSITIES:
                raise bad_request(_one_of("text.verbosity", verbosity, _VERBOSITIES), "text.verbosity")
            stated["verbosity"] = verbosity
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
    messages: list[dict] = []
    indexes: list[int] = []  # the input item each chat message comes from
    thought: list[str] = []  # reasoning items' text, for the assistant output that follows them
    called: set[str] = set()  # the call_ids of the function calls so far
    for i, (where, item) in enumerate(each_object(given, "input")):
        kind = item.get("type")
        last = messages[-1] if messages else None
        if kind == "reasoning":
            thought.append(_reasoning_text(item, where))
            continue
        if kind == "function_call":
            tool_call = _function_call(item, where)
            called.add(tool_call["id"])
            if last is not None and last["role"] == "assistant":
                # A turn's text and calls, or calls made together: one assistant message.
                last.setdefault("tool_calls", []).append(tool_call)
                _give_reasoning(last, thought)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
        elif kind == "function_call_output":
            message = _function_output(item, where)
            if message["tool_call_id"] not in called:
                # OpenAI's check: an answer to no call is a conversation cut wrongly.
                raise bad_request(f"No tool call found for function call output with call_id "
                                  f"{message['tool_call_id'][:64]}.", "input")
        elif kind in (None, "message"):
            message = _message(item, where)
            if message["role"] == "assistant" and last is not None and last.get("tool_calls"):
                # Text a turn gave after its calls: in chat the tool messages must
                # follow the one message holding the turn's text and calls (text
                # before and after them joined, as the whole response lists it).
                if last["content"] is None:
                    last["content"] = message["content"]
                    indexes[-1] = i  # its content, what chat's errors about it name, is this item's
                else:
                    last["content"] = _text_parts(last["content"]) + _text_parts(message["content"])
                _give_reasoning(last, thought)
                continue
        else:
            raise bad_request(f"Input items of type {json.dumps(kind)[:60]} are not supported by kvgate: it takes "
                              "messages, reasoning, function calls and their outputs (no built-in tool or stored "
                              "items).", f"{where}.type")
        if message["role"] == "assistant":
            _give_reasoning(message, thought)
        elif thought and last is not None and last["role"] == "assistant":
            _give_reasoning(last, thought)  # reasoning listed after its turn's output (text that began first)
        else:
            thought.clear()  # reasoning no answer came with: nothing in chat holds it
        messages.append(message)
        indexes.append(i)
    if thought and messages and messages[-1]["role"] == "assistant":
        _give_reasoning(messages[-1], thought)
    for message in messages:
        parts = message.pop(_THOUGHT, None)
        if parts:
            message["reasoning"] = message["reasoning_content"] = "\n\n".join(parts)
    call.input_items = len(given)
    if len(indexes) != len(given):
        # Items folded into the message before them shift the later ones: errors
        # about chat's messages[k] name the item it came from.
        call.index_map = indexes
    return messages


def _text_parts(content: str | list) -> list:
    """A chat message's content as a list of parts."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _function_tool(tool: dict, where: str) -> dict:
    """A Responses function tool as chat's (its fields one level down, under "function")."""
    if tool.get("type") != "function":
        raise bad_request(f"Tools of type {json.dumps(tool.get('type'))[:60]} are not supported by kvgate: it passes "
                          "function tools to a server that parses tool calls (built-in tools are OpenAI's).",
                          f"{where}.type")
    if _typed(tool, "name", str, "a string", f"{where}.") is None:
        raise bad_request(f"Missing required parameter: '{where}.name'.", f"{where}.name")
    _typed(tool, "parameters", dict, "an object", f"{where}.")
    _typed(tool, "description", str, "a string", f"{where}.")
    _typed(tool, "strict", bool, "a boolean", f"{where}.")
    return {"type": "function",
            "function": {key: tool[key] for key in ("name", "description", "parameters", "strict")
                         if tool.get(key) is not None}}


def _tool_choice(choice: Any, tools: list[dict]) -> Any:
    """tool_choice as chat's: a mode, or one function by name."""
    if choice is None or choice in ("auto", "none"):
        return choice
    if not tools:
        raise bad_request(f"Invalid value for 'tool_choice': {json.dumps(choice)[:60]}. Without 'tools' only 'auto' and "
                          "'none' are allowed.", "tool_choice")
    if choice == "required":
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = _typed(choice, "name", str, "a string", "tool_choice.")
        if name is None:
            raise bad_request("Missing required parameter: 'tool_choice.name'.", "tool_choice.name")
        if name not in {tool["function"]["name"] for tool in tools}:
            raise bad_request(f"Invalid value for 'tool_choice.name': {json.dumps(name)[:60]} names none of 'tools'.",
                              "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise bad_request(f"Invalid value for 'tool_choice': {json.dumps(choice)[:60]}. Supported values are: 'auto', "
                      "'none', 'required' and {\"type\": \"function\", \"name\": ...}.", "tool_choice")


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text (its reasoning_text parts; a summary or OpenAI's
    encrypted content is nothing a chat template can show the model)."""
    texts = []
    for pwhere, part in each_object(_list(item, "content", f"{where}."), f"{where}.content"):
        if part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise bad_request(f"Invalid '{pwhere}': expected a reasoning_text part with a string 'text'.", pwhere)
        texts.append(part["text"])
    return "".join(texts)


# A message's reasoning parts while the input is read: joined once at its end
# (joined at each function call folded in, a long run of them copied the text so
# far each time, quadratic in the body).
_THOUGHT = "_kvgate_reasoning_parts"


def _give_reasoning(message: dict, thought: list[str]) -> None:
    """Hand a turn's reasoning to its assistant chat message, where chat templates
    that show a model its earlier thinking (between tool calls especially) find
    it: as ``reasoning`` (vLLM's name) and ``reasoning_content`` (SGLang's, and
    older vLLM's); a server reads the one it knows."""
    parts = [t for t in thought if t]
    thought.clear()
    if parts:
        message.setdefault(_THOUGHT, []).extend(parts)


def _function_call(item: dict, where: str) -> dict:
    """An earlier turn's function call item as chat's tool call."""
    for key in ("call_id", "name", "arguments"):
        if _typed(item, key, str, "a string", f"{where}.") is None:
            raise bad_request(f"Missing required parameter: '{where}.{key}'.", f"{where}.{key}")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}


def _function_output(item: dict, where: str) -> dict:
    """A function call's output item as chat's tool message (text parts joined)."""
    if _typed(item, "call_id", str, "a string", f"{where}.") is None:
        raise bad_request(f"Missing required parameter: '{where}.call_id'.", f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        texts = [part.get("text") for part in output if isinstance(part, dict) and part.get("type") == "input_text"]
        if len(texts) != len(output) or not all(isinstance(text, str) for text in texts):
            raise bad_request(f"Invalid '{where}.output': kvgate takes a string or input_text parts.", f"{where}.output")
        output = "".join(texts)
    elif not isinstance(output, str):
        raise bad_request(_type_msg(f"{where}.output", "a string or an array of input_text parts", output),
                          f"{where}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        if role is None:
            raise bad_request(f"Missing required parameter: '{where}.role'.", f"{where}.role")
        raise bad_request(f"Invalid value for '{where}.role': {json.dumps(role)[:60]}. Supported values are: 'user', "
                          "'assistant', 'system' and 'developer'.", f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        content = [_part(part, pwhere, role) for pwhere, part in each_object(content, f"{where}.content")]
    elif not isinstance(content, str):
        if content is None:
            raise bad_request(f"Missing required parameter: '{where}.content'.", f"{where}.content")
        raise bad_request(_type_msg(f"{where}.content", "a string or an array of content parts", content),
                          f"{where}.content")
    return {"role": role, "content": content}


def _part(part: dict, where: str, role: str) -> dict:
    """A Responses content part as chat's: text, or an image by URL."""
    kind = part.get("type")
    # Checked here, named by this item: an assistant message's parts may be joined
    # to an earlier item's message (_input_messages), whose index chat's errors would name.
    # output_text and refusal are an earlier answer's, as the SDK hands the history back.
    if kind in ("input_text", "output_text"):
        if not isinstance(part.get("text"), str):
            raise bad_request(_type_msg(f"{where}.text", "a string", part.get("text")), f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and role == "assistant":
        if not isinstance(part.get("refusal"), str):
            raise bad_request(_type_msg(f"{where}.refusal", "a string", part.get("refusal")), f"{where}.refusal")
        return {"type": "refusal", "refusal": part["refusal"]}
    if kind == "input_image" and role != "user":
        raise bad_request(f"Images are only allowed in messages with role 'user' ({where.rsplit('.content', 1)[0]} "
                          "is not one).", where)
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
