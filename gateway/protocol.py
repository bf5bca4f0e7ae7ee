"""OpenAI request parsing and validation (responses: gateway/shapes.py).

Parsing turns a JSON body into a ``ParsedRequest`` or raises an ``ApiError``
naming the offending field, with OpenAI's wording where clients may match on it.
Fields that ask for what the kvgate engine cannot do are refused (or left to an
external server); other unknown fields are ignored, as vLLM does (OpenAI refuses
them), and ``ParsedRequest.ignored`` names them for a log line.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from random import getrandbits as _random_bits
from typing import TYPE_CHECKING, Any

from engine.request import SamplingParams
from gateway.config import LimitsConfig
from gateway.errors import bad_request

if TYPE_CHECKING:
    from gateway.responses_api import ResponsesCall

CHAT, COMPLETIONS = "chat", "completions"

# Roles the chat template is given; developer is OpenAI's newer name for system.
_ROLE_MAP = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool", "function": "tool"}
IMAGE_PLACEHOLDER = "<image>"
# OpenAI's own bounds.
_MAX_STOP = 4
_MAX_STOP_TOKEN_IDS = 256
_MAX_CACHE_SALT = 1024
# What a gateway sends an engine: "tenant:LEN:NAME:" (a name of at most
# gateway.config.MAX_TENANT_NAME) before the client's own salt.
_MAX_ENGINE_CACHE_SALT = 8 * _MAX_CACHE_SALT
_MAX_TOP_LOGPROBS_CHAT = 20
_MAX_LOGPROBS_COMPLETIONS = 5


@dataclass(slots=True)
class ParsedRequest:
    endpoint: str
    model: str
    body: dict
    # The completion's id, also its x-request-id: what a client quotes, so the log says it too.
    id: str = ""
    # `kvgate engine`: the X-Request-Id its sender gave, by which it lists the
    # requests it has not started when it stops (AsyncEngine.unstarted).
    sent_as: str | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    # OpenAI's successors of `user`: the key of requests that share a prefix (its
    # cache routing hint) and the end user's id.  Read as kvgate's session and user.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # None: the default for the endpoint, resolved once the prompt length is known.
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # chat: messages as the chat template wants them (role, content text).
    messages: list[dict] | None = None
    # chat: image sources in placeholder order (data: URL payload bytes or the URL).
    images: list[bytes] = field(default_factory=list)
    user_turns: int = 0
    # chat: the index of the longest user message and its share of all content
    # chars (the classifier's "single very long document" test without
    # re-tokenising; a long system prompt or answer is no uploaded document).
    longest_message: int = -1
    longest_share: float = 0.0
    content_chars: int = 0  # chat: what the template writes beside its markup (contents, names, calls, tools)
    # chat: the tools its template is given (tool_choice "none" on the kvgate engine, as vLLM gives them)
    template_tools: list | None = None
    # Fields of the body that nothing here reads (a typo, another API's option).
    ignored: set | None = None
    # completions: one entry per prompt, text or token ids.
    prompts: list[str | list[int]] | None = None
    # chat logprobs use the chat shape; completions the legacy shape.
    logprobs: bool = False
    # completions: the legacy top_logprobs also hold the sampled token (OpenAI
    # and vLLM); not for a gateway's requests to its engines, which read chat's shape from them.
    top_with_sampled: bool = False
    # completions: echo the prompt before the completion; echo_texts are the
    # prompts' texts when the gateway does it itself (not an external server).
    echo: bool = False
    echo_texts: list[str] | None = None
    # completions: a text prompt gets the tokenizer's special tokens (a BOS for
    # Llama, Gemma, Mistral), as vLLM's add_special_tokens does by default.
    add_special_tokens: bool = True
    # (message, param) of the first field the kvgate engine cannot honour
    # (tools, JSON output, ...): such requests are for external servers only.
    engine_unsupported: tuple[str, str] | None = None
    # vLLM's cache_salt as sent; the gateway then folds in the tenant (app.prepare).
    cache_salt: str | None = None
    # chat: len(images) once each message is read (message i's images are
    # images[image_ends[i-1]:image_ends[i]]), for the classifier's session digest.
    image_ends: list[int] = field(default_factory=list)
    # `kvgate engine`: each streamed choice chunk carries its token ids (the
    # calling gateway's kvgate_token_ids), for exact counts and output blocks.
    token_ids_out: bool = False
    # POST /v1/responses: read as the chat request it asks for; this shapes the answer.
    responses: ResponsesCall | None = None

    @property
    def prompt_param(self) -> str:
        """The field an error about the prompt names."""
        return "messages" if self.endpoint == CHAT else "prompt"


def parse_json(raw: bytes) -> dict:
    try:
        # UTF-8 (RFC 8259 for JSON on the wire; a BOM is tolerated), decoded here
        # rather than by json's encoding sniffing.  Invalid bytes are a ValueError.
        # (The plain utf-8 codec is C; utf-8-sig is Python, ~1 us a request.)
        if isinstance(raw, (bytes, bytearray)):
            raw = (raw[3:] if raw[:3] == b"\xef\xbb\xbf" else raw).decode()
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
            "HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was not valid JSON.)"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    # json.loads turns an escaped lone surrogate ("\\ud800") into a str no encoder or
    # tokenizer takes; only a body holding such an escape is searched.
    if ("\\ud" in raw or "\\uD" in raw) and _holds_lone_surrogate(body):
        raise bad_request("The request body holds invalid Unicode: an escaped lone surrogate (such as \\ud800) "
                          "is not a character.")
    return body


def _holds_lone_surrogate(body: dict) -> bool:
    # A stack, not recursion: json.loads takes nesting deeper than Python's
    # recursion limit allows a recursive walk.
    stack: list = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def parse_request(endpoint: str, body: dict, limits: LimitsConfig, engine_mode: bool = False,
                  sampling_defaults: dict | None = None) -> ParsedRequest:
    """Validate a request body; ``engine_mode``: for a `kvgate engine`, where a
    gateway's completions (its kvgate_context says so) carry chat's top_logprobs
    range and shape, since a gateway forwards chat as token ids.  A client
    calling the engine directly gets OpenAI's completions, as from a gateway.
    ``sampling_defaults``: the model's own (engine.model_loader.sampling_defaults),
    for the sampling fields a request leaves out or sends as null, as vLLM does."""
    from_gateway = engine_mode and "kvgate_context" in body
    model = body.get("model")
    if model is None or model == "":
        raise bad_request("you must provide a model parameter", "model")
    if not isinstance(model, str) or not model:
        raise bad_request(_type_msg("model", "a string", model), "model")
    req = ParsedRequest(endpoint=endpoint, model=model, body=body, id=new_id("chatcmpl-" if endpoint == CHAT else "cmpl-"))
    req.stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(_type_msg("stream_options", "an object", options), "stream_options")
        if not req.stream:
            raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        req.include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise bad_request(_type_msg(name, "a string", value), name)
        setattr(req, name, value or None)
    salt = body.get("cache_salt")
    if salt is not None:
        # A `kvgate engine` gets the gateway's salt, the tenant's name included: a
        # longer cap, but one (each salt is held in the engine's hash cache).
        most = _MAX_ENGINE_CACHE_SALT if engine_mode else _MAX_CACHE_SALT
        if not isinstance(salt, str) or not salt or len(salt) > most:
            raise bad_request(f"'cache_salt' must be a non-empty string of at most {most} characters.", "cache_salt")
        req.cache_salt = salt
    _parse_sampling(req, body, limits, _MAX_TOP_LOGPROBS_CHAT if from_gateway else _MAX_LOGPROBS_COMPLETIONS)
    if sampling_defaults:
        for name, value in sampling_defaults.items():
            if body.get(name) is None:
                setattr(req.sampling, name, value)
    if body.get("prompt_logprobs") is not None:
        # No replica honours it through a gateway, external ones included: the gateway
        # streams from its replicas, and vLLM gives prompt logprobs to non-streaming requests only.
        raise bad_request("'prompt_logprobs' is not supported by the kvgate engine, nor through a kvgate gateway (it "
                          "streams every request from its replicas, and vLLM returns prompt logprobs to non-streaming "
                          "requests only): ask the server directly.", "prompt_logprobs")
    if endpoint == CHAT:
        _parse_messages(req, body, limits)
        if "tools" in body or "tool_choice" in body or "response_format" in body or "functions" in body:
            _parse_chat_extras(req, body)
    else:
        _parse_prompt(req, body, limits)
        req.top_with_sampled = not from_gateway
        req.token_ids_out = engine_mode and body.get("kvgate_token_ids") is True
        if "echo" in body or "suffix" in body or "best_of" in body:
            _parse_completion_extras(req, body)
    unsupported = _ENGINE_UNSUPPORTED_CHAT if endpoint == CHAT else _ENGINE_UNSUPPORTED_COMPLETIONS
    if not unsupported.keys().isdisjoint(body) and req.engine_unsupported is None:
        _check_engine_unsupported(req, body, unsupported)
    if endpoint == CHAT and req.engine_unsupported is None and body.get("tools"):
        req.template_tools = body["tools"]
        req.content_chars += len(json.dumps(req.template_tools))  # prompt text like the messages
    req.ignored = body.keys() - _READ_FIELDS[endpoint] - unsupported.keys() or None
    if options and options.keys() - _READ_STREAM_OPTIONS:
        # vLLM's continuous_usage_stats (usage in every chunk) among them: the final usage chunk only, here.
        req.ignored = (req.ignored or set()) | {f"stream_options.{name}" for name in options.keys() - _READ_STREAM_OPTIONS}
    # Each prompt's n choices are decoded on their own: cap one request's share.
    n, prompts = req.sampling.n, len(req.prompts) if req.prompts is not None else 1
    if prompts * n > limits.max_choices:
        asked = f"{prompts} prompts x n={n}" if req.prompts is not None else f"n={n}"
        raise bad_request(f"Too many choices: {asked}. This server allows at most {limits.max_choices} "
                          "(server.limits.max_choices).", "n")
    return req


_RESPONSE_FORMATS = ("text", "json_object", "json_schema")

# Every field parse_request reads, by endpoint; the rest are ignored (and named in
# the log), the other endpoint's own fields too: best_of on chat is no best-of.
_READ_BY_BOTH = frozenset({
    "model", "stream", "stream_options", "user", "prompt_cache_key", "safety_identifier", "cache_salt", "n",
    "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "logit_bias", "logprobs",
    # vLLM's sampling extensions, which the engine does.
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
    "prompt_logprobs",  # refused, with the reason
    # What a gateway sends its `kvgate engine` replicas.
    "kvgate_context", "kvgate_mm_hashes", "kvgate_token_ids",
})
_READ_STREAM_OPTIONS = frozenset({"include_usage"})
_READ_FIELDS = {
    CHAT: _READ_BY_BOTH | {"messages", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
                           "response_format"},
    COMPLETIONS: _READ_BY_BOTH | {"prompt", "echo", "suffix", "best_of", "add_special_tokens"},
}

# Request fields the kvgate engine does not do (vLLM's extensions, OpenAI's audio
# output), each with the test for a value that asks for something (a default
# value changes nothing).  Answered in plain text they would look honoured: a 400
# instead, or an external server.
_ENGINE_UNSUPPORTED = {
    "guided_json": lambda v: v is not None,
    "guided_regex": lambda v: v is not None,
    "guided_choice": lambda v: v is not None,
    "guided_grammar": lambda v: v is not None,
    "structured_outputs": lambda v: v is not None,
    "allowed_token_ids": lambda v: v is not None,
    "bad_words": lambda v: bool(v),
    "logits_processors": lambda v: bool(v),
    "truncate_prompt_tokens": lambda v: v is not None,
    "use_beam_search": lambda v: bool(v),
    "skip_special_tokens": lambda v: v is False,
}
_ENGINE_UNSUPPORTED_CHAT = {
    **_ENGINE_UNSUPPORTED,
    "add_generation_prompt": lambda v: v is False,
    "continue_final_message": lambda v: bool(v),
    # The model's own template is the one the gateway hashes prompts with.
    "chat_template": lambda v: v is not None,
    "chat_template_kwargs": lambda v: bool(v),  # e.g. {"enable_thinking": false}
    "modalities": lambda v: isinstance(v, list) and any(m != "text" for m in v),
    "audio": lambda v: v is not None,
}
# (Chat's response_format is OpenAI's own: _parse_chat_extras.)
_ENGINE_UNSUPPORTED_COMPLETIONS = {
    **_ENGINE_UNSUPPORTED,
    "response_format": lambda v: isinstance(v, dict) and v.get("type", "text") != "text",
}


def _check_engine_unsupported(req: ParsedRequest, body: dict, unsupported: dict) -> None:
    for name, asks in unsupported.items():
        if name in body and asks(body[name]):
            req.engine_unsupported = (f"'{name}' is not supported by the kvgate engine; send it to a gateway in front "
                                      "of a server that supports it (e.g. vLLM).", name)
            return


def _parse_chat_extras(req: ParsedRequest, body: dict) -> None:
    """tools, tool_choice and response_format: checked here, forwarded as they are
    to external servers; the kvgate engine has no tool-call parser or guided
    decoding, so it refuses them rather than quietly answering in plain text."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad_request(_type_msg("tools", "an array of objects", tools), "tools")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, (str, dict)):
            raise bad_request(_type_msg("tool_choice", "a string or an object", choice), "tool_choice")
        if not tools:
            raise bad_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                              "tool_choice")
    if tools and choice != "none":
        req.engine_unsupported = ("Tool calling is not supported by the kvgate engine; send 'tools' to a gateway in "
                                  "front of a server that parses tool calls (e.g. vLLM), or set tool_choice to 'none'.",
                                  "tools")
    # The deprecated form of tools, refused (or passed on) alike.
    functions = body.get("functions")
    if functions is not None and not (isinstance(functions, list) and all(isinstance(f, dict) for f in functions)):
        raise bad_request(_type_msg("functions", "an array of objects", functions), "functions")
    if functions and body.get("function_call") != "none" and req.engine_unsupported is None:
        req.engine_unsupported = ("Function calling is not supported by the kvgate engine; use 'tools' (which "
                                  "replaced 'functions') through a gateway in front of a server that parses tool "
                                  "calls (e.g. vLLM).", "functions")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if not isinstance(fmt, dict):
            raise bad_request(_type_msg("response_format", "an object", fmt), "response_format")
        if kind not in _RESPONSE_FORMATS:
            raise bad_request(f"Invalid value: {kind!r}. Supported values are: 'json_object', 'json_schema', and 'text'.",
                              "response_format.type")
        if kind == "json_schema" and not isinstance(fmt.get("json_schema"), dict):
            raise bad_request("Missing required parameter: 'response_format.json_schema'.", "response_format.json_schema")
        if kind != "text" and req.engine_unsupported is None:
            req.engine_unsupported = (f"response_format {kind!r} is not supported by the kvgate engine (it has no guided "
                                      "decoding); use an external server such as vLLM for structured output.",
                                      "response_format")


def _parse_completion_extras(req: ParsedRequest, body: dict) -> None:
    req.echo = _bool(body, "echo", False)
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request(_type_msg("suffix", "a string", suffix), "suffix")
    best_of = _int(body, "best_of", None, 1, 20)
    n = req.sampling.n
    if best_of is not None and best_of < n:
        raise bad_request(f"best_of must be greater than or equal to n, but got best_of={best_of} and n={n}.", "best_of")
    # The kvgate engine computes no prompt logprobs, no insertion, no ranking of extra samples.
    if req.echo and req.logprobs:
        req.engine_unsupported = ("echo with logprobs (prompt logprobs) is not supported by the kvgate engine.", "echo")
    elif suffix:
        req.engine_unsupported = ("suffix is not supported by the kvgate engine.", "suffix")
    elif best_of is not None and best_of > n:
        # Ranking needs every sample finished first (OpenAI: "Results cannot be streamed"),
        # and kvgate streams from every server, external ones too: refused whatever the fleet.
        if req.stream:
            raise bad_request("best_of greater than n cannot be used with stream.", "best_of")
        raise bad_request("best_of greater than n is not supported here: kvgate streams from its model servers, "
                          "and best_of results cannot be streamed.", "best_of")


def _parse_sampling(req: ParsedRequest, body: dict, limits: LimitsConfig, max_logprobs: int) -> None:
    # An absent field keeps SamplingParams' default (OpenAI's); most requests set
    # two or three fields, so presence is checked before calling a validator.
    s = req.sampling
    max_tokens = _int(body, "max_completion_tokens", None, 1, None) if "max_completion_tokens" in body else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1, None) if "max_tokens" in body else None
        param = "max_tokens"
    else:
        param = "max_completion_tokens"
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise bad_request(f"{param} is too large: {max_tokens}. This server allows at most {limits.max_tokens}.", param)
    req.max_tokens = max_tokens
    if "temperature" in body:
        s.temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    if "top_p" in body:
        top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
        # top_p = 0 means "only the most likely token"; a tiny nucleus does exactly that.
        s.top_p = top_p if top_p > 0 else 1e-9
    if "n" in body:
        s.n = _int(body, "n", 1, 1, None)
        if s.n > limits.max_n:
            raise bad_request(f"n is too large: {s.n}. This server allows at most {limits.max_n}.", "n")
    if "presence_penalty" in body:
        s.presence_penalty = _float(body, "presence_penalty", 0.0, -2.0, 2.0)
    if "frequency_penalty" in body:
        s.frequency_penalty = _float(body, "frequency_penalty", 0.0, -2.0, 2.0)
    if "seed" in body:
        s.seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
        if s.seed == -1:  # vLLM's "no seed" (SamplingParams: -1 is None): a random one, not a fixed one
            s.seed = None
    # vLLM's extensions, which clients of vLLM-style servers already send.
    if "top_k" in body:
        # -1 is vLLM's "off", as is 0.
        s.top_k = max(0, _int(body, "top_k", 0, -1, None) or 0)
    if "ignore_eos" in body:
        s.ignore_eos = _bool(body, "ignore_eos", False)
    if "min_p" in body:
        s.min_p = _float(body, "min_p", 0.0, 0.0, 1.0)
    if "repetition_penalty" in body:
        s.repetition_penalty = _float(body, "repetition_penalty", 1.0, 0.0, 100.0)
        if s.repetition_penalty == 0:
            raise bad_request("Invalid 'repetition_penalty': it must be above 0 (1 is off).", "repetition_penalty")
    if "min_tokens" in body:
        s.min_tokens = _int(body, "min_tokens", 0, 0, None)  # at most max_tokens: checked once that is known
    if "include_stop_str_in_output" in body:
        s.include_stop_str_in_output = _bool(body, "include_stop_str_in_output", False)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(type(x) is int for x in stop_ids):
            raise bad_request(_type_msg("stop_token_ids", "an array of token ids (integers)", stop_ids),
                              "stop_token_ids")
        if any(x < 0 for x in stop_ids):
            raise bad_request(f"Invalid 'stop_token_ids': {min(stop_ids)}. Token ids must be 0 or more.", "stop_token_ids")
        if len(stop_ids) > _MAX_STOP_TOKEN_IDS:
            raise bad_request(f"'stop_token_ids' may hold at most {_MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}.",
                              "stop_token_ids")
        s.stop_token_ids = stop_ids
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            s.stop = [stop] if stop else []
        elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
            if len(stop) > _MAX_STOP:
                raise bad_request(f"'stop' may hold at most {_MAX_STOP} sequences, got {len(stop)}.", "stop")
            s.stop = [x for x in stop if x]
        elif isinstance(stop, list):  # OpenAI names the element: 'stop[1]'
            i, bad = next((i, x) for i, x in enumerate(stop) if not isinstance(x, str))
            raise bad_request(_type_msg(f"stop[{i}]", "a string", bad), "stop")
        else:
            raise bad_request(_type_msg("stop", "a string or an array of strings", stop), "stop")
    if req.endpoint == CHAT:
        if "logprobs" in body or "top_logprobs" in body:
            want = _bool(body, "logprobs", False)
            top = _int(body, "top_logprobs", None, 0, _MAX_TOP_LOGPROBS_CHAT)
            if top is not None and not want:
                raise bad_request("top_logprobs requires logprobs to be set to true.", "top_logprobs")
            s.logprobs = (top or 0) if want else None
            req.logprobs = want
    elif "logprobs" in body:
        lp = _int(body, "logprobs", None, 0, max_logprobs)
        s.logprobs = lp
        req.logprobs = lp is not None
    bias = body.get("logit_bias")
    if bias is not None:
        s.logit_bias = _logit_bias(bias) or None


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys) to a bias in [-100, 100].
    Ids beyond the vocabulary are refused once the tokenizer is known."""
    if not isinstance(bias, dict):
        raise bad_request(_type_msg("logit_bias", "an object", bias), "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            raise bad_request(f"Invalid key in 'logit_bias': {key!r}. Keys must be token ids.", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"Invalid value for 'logit_bias' key {key}: expected a number between -100 and 100, "
                              f"but got {json.dumps(value)} instead.", "logit_bias")
        out[int(key)] = float(value)
    return out


def _parse_messages(req: ParsedRequest, body: dict, limits: LimitsConfig) -> None:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("Missing required parameter: 'messages'.", "messages")
    if not isinstance(messages, list):
        raise bad_request(_type_msg("messages", "an array", messages), "messages")
    if not messages:
        raise bad_request("'messages' must contain at least one message.", "messages")
    if len(messages) > limits.max_messages:
        raise bad_request(
            f"Too many messages: {len(messages)}. This server allows at most {limits.max_messages}.", "messages"
        )
    out = []
    lengths = []
    beside = 0  # characters beside the contents the template writes too: names, earlier tool calls
    for where, msg in each_object(messages, "messages"):
        role = msg.get("role")
        if role is None:
            raise bad_request(f"Missing required parameter: '{where}.role'.", f"{where}.role")
        mapped = _ROLE_MAP.get(role) if isinstance(role, str) else None
        if mapped is None:
            raise bad_request(
                f"Invalid value for '{where}.role': {json.dumps(role)[:60]}. Supported values are: 'system', 'developer', "
                "'user', 'assistant', 'tool' and 'function'.",
                f"{where}.role",
            )
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            # A tool's answer names the call it answers; OpenAI refuses one that does not.
            raise bad_request(f"Missing required parameter: '{where}.tool_call_id'.", f"{where}.tool_call_id")
        text = _content_text(req, msg.get("content"), where, mapped, limits)
        entry = {"role": mapped, "content": text}
        if mapped == "user":
            req.user_turns += 1
        elif mapped == "assistant":
            if msg.get("tool_calls"):
                entry["tool_calls"] = _template_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
                beside += len(json.dumps(entry["tool_calls"]))
        elif mapped == "tool":
            # What chat templates name a tool's answer by (vLLM hands both on).
            if isinstance(msg.get("tool_call_id"), str):
                entry["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            entry["name"] = msg["name"]  # any message's, as vLLM hands it to the template
            beside += len(msg["name"])
        out.append(entry)
        req.image_ends.append(len(req.images))
        lengths.append(len(text))
    req.messages = out
    total = sum(lengths)
    req.content_chars = total + beside  # what the prompt's size checks count (app.py)
    user = [i for i, msg in enumerate(out) if msg["role"] == "user" and lengths[i]]
    if user:
        longest = max(user, key=lengths.__getitem__)
        req.longest_message = longest
        req.longest_share = lengths[longest] / total


def _template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An earlier answer's tool calls as chat templates take them (and vLLM hands
    them on): each call's arguments as an object, not the JSON text of one
    (templates write ``arguments | tojson``).  Arguments that are no JSON object
    stay text, as OpenAI takes any string there."""
    if not isinstance(calls, list):
        raise bad_request(_type_msg(where, "an array", calls), where)
    out = []
    for cwhere, call in each_object(calls, where):
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"Missing required parameter: '{cwhere}.function.name'.", f"{cwhere}.function.name")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        elif arguments is None:
            arguments = {}
        out.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"],
                                                                          "arguments": arguments}})
    return out


def _content_text(req: ParsedRequest, content: Any, where: str, role: str, limits: LimitsConfig) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        # Assistant turns that only called tools have no content.
        if role in ("assistant", "tool"):
            return ""
        raise bad_request(f"Missing required parameter: '{where}.content'.", f"{where}.content")
    if not isinstance(content, list):
        raise bad_request(_type_msg(f"{where}.content", "a string or an array of content parts", content), f"{where}.content")
    pieces = []
    for pwhere, part in each_object(content, f"{where}.content"):
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(_type_msg(f"{pwhere}.text", "a string", text), f"{pwhere}.text")
            pieces.append(text)
        elif kind == "refusal" and role == "assistant":
            # An earlier answer that declined, as the SDK hands it back in the history.
            refusal = part.get("refusal")
            if not isinstance(refusal, str):
                raise bad_request(_type_msg(f"{pwhere}.refusal", "a string", refusal), f"{pwhere}.refusal")
            pieces.append(refusal)
        elif kind == "image_url":
            if role != "user":  # as OpenAI: a system prompt or an answer holds no picture
                raise bad_request(f"Images are only allowed in messages with role 'user' ({where} is not one).", pwhere)
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise bad_request(f"Missing required parameter: '{pwhere}.image_url.url'.", f"{pwhere}.image_url.url")
            if not _is_image_url(url):
                raise bad_request(f"Invalid '{pwhere}.image_url.url': expected an http(s) URL or a base64 data URL of "
                                  "an image (data:image/png;base64,...).", f"{pwhere}.image_url.url", "invalid_value")
            if len(req.images) == limits.max_images:
                # Each image is hashed and, in the prompt, spans tokens of its own: a
                # bound on one request's cost, as vLLM's --limit-mm-per-prompt.
                raise bad_request(f"Too many images: more than {limits.max_images} in one request. "
                                  f"This server allows at most {limits.max_images}.", pwhere)
            req.images.append(_image_source(url))
            pieces.append(IMAGE_PLACEHOLDER)
        else:
            raise bad_request(
                f"Invalid value for '{pwhere}.type': {kind!r}. Supported values are: 'text' and 'image_url'.",
                f"{pwhere}.type",
            )
    return "\n".join(pieces)


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _is_image_url(url: str) -> bool:
    """What a server can fetch or decode: http(s), or a data URL with an image type and a base64 payload."""
    if url[:11].lower() == "data:image/":
        meta, comma, payload = url.partition(",")
        # Base64's alphabet and padding, checked without decoding (an image may be megabytes).
        return (bool(comma and payload) and meta.lower().endswith(";base64") and len(payload) % 4 == 0
                and _BASE64.fullmatch(payload) is not None)
    scheme, sep, rest = url[:16].partition("://")
    return bool(sep and rest) and scheme.lower() in ("http", "https")


def _image_source(url: str) -> bytes:
    """What identifies an image's content: the payload of a data: URL, else the URL.

    Hashing the decoded payload would cost a base64 decode per request; the
    encoded payload identifies the same bytes just as well.
    """
    if url.startswith("data:"):
        comma = url.find(",")
        return url[comma + 1 :].encode() if comma >= 0 else url.encode()
    return url.encode()


def _parse_prompt(req: ParsedRequest, body: dict, limits: LimitsConfig) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("Missing required parameter: 'prompt'.", "prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(x, str) for x in prompt):
            prompts = list(prompt)
        elif _is_token_list(prompt):
            prompts = [prompt]
        elif all(isinstance(x, list) and x and _is_token_list(x) for x in prompt):
            prompts = list(prompt)
        else:
            raise bad_request(
                "Invalid prompt: expected a string, an array of strings, an array of token ids or an array of "
                "arrays of token ids.",
                "prompt",
            )
    else:
        raise bad_request("Invalid prompt: must be a non-empty string or array.", "prompt")
    if len(prompts) > limits.max_prompts:
        raise bad_request(f"Too many prompts: {len(prompts)}. This server allows at most {limits.max_prompts}.", "prompt")
    req.prompts = prompts
    req.user_turns = 1
    req.add_special_tokens = _bool(body, "add_special_tokens", True)


def _is_token_list(x: list) -> bool:
    return all(type(t) is int and t >= 0 for t in x)


def each_object(items: list, where: str):
    """(``where[i]``, item) for each item of a request's array, refused unless an object."""
    for i, item in enumerate(items):
        name = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(_type_msg(name, "an object", item), name)
        yield name, item


def _type_msg(name: str, expected: str, value: Any) -> str:
    return f"Invalid type for '{name}': expected {expected}, but got {_json_type(value)} instead."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _bool(body: dict, key: str, default: bool, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(_type_msg(name or key, "a boolean", value), name or key)
    return value


def _int(body: dict, key: str, default: int | None, lo: int | None, hi: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    # JSON has one number type; 3.0 is an integer to most clients, 3.5 is not.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int:
        raise bad_request(_type_msg(key, "an integer", value), key)
    if lo is not None and value < lo:
        raise bad_request(f"Invalid '{key}': integer below minimum value. Expected a value >= {lo}, but got {value} instead.", key)
    if hi is not None and value > hi:
        raise bad_request(f"Invalid '{key}': integer above maximum value. Expected a value <= {hi}, but got {value} instead.", key)
    return value


def _float(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(_type_msg(key, "a number", value), key)
    value = float(value)
    if not math.isfinite(value) or value < lo or value > hi:
        raise bad_request(f"Invalid '{key}': expected a number between {lo:g} and {hi:g}, but got {value:g} instead.", key)
    return value


def new_id(prefix: str) -> str:
    # 96 random bits: unique enough for logs and for the engine's request table.
    # The random module, not os.urandom: no system call per id (it reseeds itself
    # in forked children, so ids stay distinct across processes).
    return f"{prefix}{_random_bits(96):024x}"
