"""A test double of engine.async_engine.AsyncEngine for fast gateway tests.

It keeps the engine's contract (per-choice GenerationOutputs, usage on the last
output of a choice, closing the iterator aborts, KV events on store) with a
byte tokenizer and a block-key set instead of a model, so wire-format, routing
and disconnect tests run in milliseconds.  Tests that need the real engine use
the tiny model instead.
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


class FakeEngine:
    def __init__(self, name: str = "fake-model", block_size: int = 4, token_delay_s: float = 0.0, max_model_len: int = 4096):
        self.tokenizer = ByteTokenizer()
        self.model_name = name
        self.block_size = block_size
        self.hash_salt = name
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.held: set[int] = set()
        self.active: dict[str, int] = {}  # request id -> live choices
        self.aborted: list[str] = []
        self.requests: list[GenerationRequest] = []
        self._subscribers = []
        self.started = False

    def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

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

    def _store(self, keys: list[int]) -> None:
        new = [k for k in keys if k not in self.held]
        self.held.update(new)
        if new:
            for cb in self._subscribers:
                cb("stored", new, "device")

    def evict_all(self) -> None:
        keys = list(self.held)
        self.held.clear()
        for cb in self._subscribers:
            cb("removed", keys, "device")

    async def generate(self, request: GenerationRequest):
        self.requests.append(request)
        rid = request.request_id
        keys = block_hashes(request.prompt_token_ids, self.block_size, self.hash_salt, request.mm_hashes)
        hit = 0
        for key in keys:
            if key not in self.held:
                break
            hit += 1
        self._store(keys)
        s = request.sampling
        self.active[rid] = s.n
        finished = False
        try:
            for index in range(s.n):
                for step in range(s.max_tokens):
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    else:
                        await asyncio.sleep(0)
                    last = step == s.max_tokens - 1
                    text = f"t{step} "
                    lps = None
                    if s.logprobs is not None:
                        lps = [TokenLogprob(100 + step, text, -0.5, [(1, "a", -1.0)] * s.logprobs)]
                    yield GenerationOutput(
                        rid, index, [100 + step], text, lps,
                        "length" if last else None,
                        Usage(len(request.prompt_token_ids), s.max_tokens, hit * self.block_size) if last else None,
                        0.001 if step == 0 else None,
                    )
            finished = True
        finally:
            self.active.pop(rid, None)
            if not finished:
                self.aborted.append(rid)
