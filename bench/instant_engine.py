"""A benchmark fixture: an engine that answers instantly, for measuring the gateway alone.

``InstantBenchEngine`` keeps engine.async_engine.AsyncEngine's contract
(per-choice GenerationOutputs, usage on the last output of a choice, closing
the iterator aborts, KV events on store) with a byte tokenizer and a set of
block keys instead of a model, so that bench/gateway.py measures what the
gateway adds per request and nothing else.  It is not a test double: tests
use the real engine with the tiny model (tests/tiny_model.py).
"""

from __future__ import annotations

import asyncio

from engine.block_hash import block_hashes
from engine.request import GenerationOutput, GenerationRequest, TokenLogprob, Usage


class ByteTokenizer:
    """One token per UTF-8 byte; a chat template that marks roles."""

    eos_token_id = 0

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


class InstantBenchEngine:
    """Answers ``max_tokens`` tokens "t0 t1 ..." per choice without computing anything.

    ``token_delay_s`` > 0 paces the tokens (a slow engine); 0 yields them as
    fast as the consumer takes them.  ``track_blocks`` keeps a block set and
    publishes KV events like an engine; off by default, so that the benchmark
    charges no hashing to the engine side.
    """

    def __init__(self, name: str = "bench-model", block_size: int = 16, token_delay_s: float = 0.0,
                 max_model_len: int = 4096, track_blocks: bool = False) -> None:
        self.track_blocks = track_blocks
        self.tokenizer = ByteTokenizer()
        self.model_name = name
        self.block_size = block_size
        self.hash_salt = name
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.held: set[int] = set()
        self.active: dict[str, int] = {}
        self.served = 0
        self._subscribers = []

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def apply_chat_template(self, messages) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def subscribe_kv_events(self, callback) -> None:
        self._subscribers.append(callback)

    def cached_keys(self):
        return {"device": list(self.held)}

    def stats(self) -> dict:
        return {"running": len(self.active), "waiting": 0}

    def abort(self, request_id: str) -> None:
        self.active.pop(request_id, None)

    async def generate(self, request: GenerationRequest):
        self.served += 1
        rid = request.request_id
        hit = 0
        if self.track_blocks:
            keys = block_hashes(request.prompt_token_ids, self.block_size, self.hash_salt, request.mm_hashes)
            for key in keys:
                if key not in self.held:
                    break
                hit += 1
            new = [k for k in keys if k not in self.held]
            if new:
                self.held.update(new)
                for cb in self._subscribers:
                    cb("stored", new, "device")
        s = request.sampling
        self.active[rid] = s.n
        try:
            for index in range(s.n):
                for step in range(s.max_tokens):
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    last = step == s.max_tokens - 1
                    text = f"t{step} "
                    lps = None
                    if s.logprobs is not None:
                        lps = [TokenLogprob(100 + step, text, -0.5, [(1, "a", -1.0)] * s.logprobs)]
                    yield GenerationOutput(
                        rid, index, [100 + step], text, lps,
                        "length" if last else None,
                        Usage(len(request.prompt_token_ids), s.max_tokens, hit * self.block_size) if last else None,
                        0.0 if step == 0 else None,
                    )
        finally:
            self.active.pop(rid, None)
