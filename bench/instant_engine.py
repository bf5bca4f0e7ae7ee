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
from engine.request import GenerationOutput, GenerationRequest, TokenLogprob, Usage, one_at_a_time


class ByteTokenizer:
    """One token per UTF-8 byte; a chat template that marks roles."""

    eos_token_id = 0

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode(errors="replace")

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

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
        self._step_cache: dict[int, list] = {}
        self._whole_cache: dict[int, tuple[list[int], str]] = {}
        self._subscribers = []

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def apply_chat_template(self, messages, namespace: str = "") -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def subscribe_kv_events(self, callback) -> None:
        self._subscribers.append(callback)

    def cached_keys(self):
        return {"device": list(self.held)}

    def stats(self) -> dict:
        return {"running": len(self.active), "waiting": 0}

    def abort(self, request_id: str) -> None:
        self.active.pop(request_id, None)

    def generate(self, request: GenerationRequest):
        return one_at_a_time(self.generate_batches(request))

    async def generate_batches(self, request: GenerationRequest):
        """Like AsyncEngine.generate_batches: each list is what is ready at once,
        one output per choice.  Unpaced, everything is ready at once, so each
        choice comes as one output holding all its tokens (as AsyncEngine hands
        over a backlog); paced by ``token_delay_s``, one token per output."""
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
            steps = self._steps(s.max_tokens)
            usage = Usage(len(request.prompt_token_ids), s.max_tokens, hit * self.block_size)
            if not self.token_delay_s:
                token_ids, text = self._whole(s.max_tokens)
                yield [
                    GenerationOutput(rid, index, token_ids, text, self._logprobs(steps, s.logprobs), "length", usage, 0.0)
                    for index in range(s.n)
                ]
                return
            for index in range(s.n):
                for step, (token_ids, text, finish) in enumerate(steps):
                    await asyncio.sleep(self.token_delay_s)
                    yield [GenerationOutput(
                        rid, index, token_ids, text, self._logprobs(steps[step:step + 1], s.logprobs), finish,
                        usage if finish else None, 0.0 if step == 0 else None,
                    )]
        finally:
            self.active.pop(rid, None)

    @staticmethod
    def _logprobs(steps, k: int | None) -> list[TokenLogprob] | None:
        if k is None:
            return None
        return [TokenLogprob(ids[0], text, -0.5, [(1, "a", -1.0)] * k) for ids, text, _ in steps]

    def _whole(self, max_tokens: int) -> tuple[list[int], str]:
        whole = self._whole_cache.get(max_tokens)
        if whole is None:
            steps = self._steps(max_tokens)
            whole = self._whole_cache[max_tokens] = (
                [t for ids, _, _ in steps for t in ids], "".join(text for _, text, _ in steps)
            )
        return whole

    def _steps(self, max_tokens: int) -> list[tuple[list[int], str, str | None]]:
        """(token ids, text, finish reason) of each step, built once per length:
        the fixture should cost next to nothing, so the benchmark measures the gateway."""
        steps = self._step_cache.get(max_tokens)
        if steps is None:
            steps = self._step_cache[max_tokens] = [
                ([100 + i], f"t{i} ", "length" if i == max_tokens - 1 else None) for i in range(max_tokens)
            ]
        return steps
