"""What a caller hands the engine and what it gets back.

The async engine's contract (engine/async_engine.py):

    async for out in engine.generate(request):   # GenerationRequest
        ...                                      # GenerationOutput per step

Each output carries the new token ids and text of *one* choice (``index``);
the last output of a choice has ``finish_reason`` set and ``usage`` filled.
Closing the iterator early (client gone) aborts the request and frees its
blocks.  ``engine.generate_batches(request)`` yields the same outputs in
lists, one list per moment, each choice's ready deltas joined (``coalesce``):
what the gateway reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.context import RequestContext


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    # None: no logprobs; k >= 0: the chosen token's logprob plus the top k.
    logprobs: int | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # vLLM's extensions, with its semantics:
    # a token's probability must reach min_p x the likeliest one's (0: off);
    min_p: float = 0.0
    # logits of tokens in the prompt or the output so far are divided by it
    # when positive, multiplied when negative (1: off);
    repetition_penalty: float = 1.0
    # neither EOS nor a stop token id nor a stop string ends a sequence shorter than this;
    min_tokens: int = 0
    # the stop string (or stop token) that ended a sequence stays in its text.
    include_stop_str_in_output: bool = False


class EngineFailed(RuntimeError):
    """The engine failed a request for a reason of its own (its model step or its
    intake of the request raised), not the caller's: a ValueError is the
    caller's fault (400), this is a server error another replica may not have."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {cause}")
        self.what = what  # without the cause's text, which is for the log


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context: RequestContext = field(default_factory=RequestContext)
    # Content hashes of multimodal inputs: (token offset, hash) for block identity.
    mm_hashes: list[tuple[int, bytes]] = field(default_factory=list)
    # Joins the engine's salt in the request's block hashes (engine.block_hash.chain_salt).
    cache_salt: str | None = None
    # The sender's name for it (a gateway's X-Request-Id), by which a stopping
    # engine lists the requests it has not started (AsyncEngine.unstarted).
    sent_as: str | None = None
    # Set by an in-process engine as it schedules the prompt: the prompt tokens with KV
    # computed or in the step under way, cache hits included (None: not scheduled yet).
    # A request its client leaves before any output is recorded with these
    # (gateway/dispatch.py): the engine looked up its prefix and cached its blocks all the same.
    scheduled_prompt_tokens: int | None = None


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None: none exists (an external server's echoed first prompt token)
    top: list[tuple[int, str, float]] = field(default_factory=list)
    # False for a special token the text leaves out (decoded skipping them, as
    # vLLM's): listed with its own text, but adding none to the choice's text.
    in_text: bool = True


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: not reported (an external server that does not say)
    # Of the completion tokens, those a server's reasoning parser split off as
    # reasoning (vLLM's with one configured); None: not reported.
    reasoning_tokens: int | None = None


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    index: int  # which of the n choices
    token_ids: list[int]
    text: str  # detokenised delta, stop strings already cut
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None
    # Seconds the request waited before its first scheduled step.
    queue_time_s: float | None = None
    # An external server's delta fields besides its text (tool_calls,
    # reasoning_content, ...), relayed to the client as they came.
    extra: dict | None = None
    # Prompt tokens served from the prefix cache, on the request's first output
    # (its prefill is done then; vLLM's outputs carry num_cached_tokens too): what
    # a request cut short before its usage (client gone) hit.
    cached_tokens: int | None = None
    # vLLM's: what ended a "stop" choice other than EOS, the stop string or the
    # stop token id (None for EOS, a length, an abort).
    stop_reason: int | str | None = None


def coalesce(outputs: list[GenerationOutput]) -> list[GenerationOutput]:
    """A batch of outputs with each choice's deltas joined into one, in first-seen order.

    What a consumer that fell behind the engine wants (vLLM's output collector
    merges a slow reader's backlog the same way): one delta, hence one SSE
    frame, instead of one per token.  Text, token ids and logprobs keep their
    order; the merged delta carries the last finish reason and usage and the
    first queue time.  Outputs of different choices stay apart.
    """
    if len(outputs) < 2:
        return outputs
    for out in outputs:
        if out.extra is not None:
            return outputs  # fragments of tool calls and the like stay as they came
    index = outputs[0].index
    for out in outputs:
        if out.index != index:
            break
    else:
        return [_join(outputs)]
    groups: dict[int, list[GenerationOutput]] = {}
    for out in outputs:
        group = groups.get(out.index)
        if group is None:
            groups[out.index] = [out]
        else:
            group.append(out)
    if len(groups) == len(outputs):
        return outputs
    return [group[0] if len(group) == 1 else _join(group) for group in groups.values()]


def _join(group: list[GenerationOutput]) -> GenerationOutput:
    """One choice's deltas as one."""
    token_ids: list[int] = []
    texts = []
    logprobs = finish = stop_reason = usage = queue_time = cached = None
    for out in group:
        token_ids += out.token_ids
        texts.append(out.text)
        if out.logprobs is not None:
            logprobs = out.logprobs if logprobs is None else logprobs + out.logprobs
        if out.finish_reason is not None:
            finish, stop_reason = out.finish_reason, out.stop_reason
        if out.usage is not None:
            usage = out.usage
        if queue_time is None:
            queue_time = out.queue_time_s
        if cached is None:
            cached = out.cached_tokens
    first = group[0]
    return GenerationOutput(first.request_id, first.index, token_ids, "".join(texts), logprobs, finish, usage,
                            queue_time, cached_tokens=cached, stop_reason=stop_reason)


async def one_at_a_time(batches: AsyncIterator[list[GenerationOutput]]) -> AsyncIterator[GenerationOutput]:
    """The outputs of a batch iterator one by one; closing this closes that."""
    try:
        async for batch in batches:
            for out in batch:
                yield out
    finally:
        await batches.aclose()
