"""What a caller hands the engine and what it gets back.

The async engine's contract (engine/async_engine.py):

    async for out in engine.generate(request):   # GenerationRequest
        ...                                      # GenerationOutput per step

Each output carries the new token ids and text of *one* choice (``index``);
the last output of a choice has ``finish_reason`` set and ``usage`` filled.
Closing the iterator early (client gone) aborts the request and frees its
blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context: RequestContext = field(default_factory=RequestContext)
    # Content hashes of multimodal inputs: (token offset, hash) for block identity.
    mm_hashes: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


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
