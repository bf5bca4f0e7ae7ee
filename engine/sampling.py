"""Token sampling, stop conditions and incremental detokenisation, per sequence."""

from __future__ import annotations

import random
from collections import Counter

import torch

from engine.request import SamplingParams, TokenLogprob
from engine.token_pieces import TokenPieces

GREEDY_BELOW_TEMPERATURE = 1e-5  # temperatures under this sample greedily

# Prompt tokens the detokeniser starts from: tokenizers that merge a leading
# space into the first piece decode a lone continuation token differently.
_DETOK_CONTEXT = 6


_MASK_64 = 2**64 - 1


def generator_seed(seed: int) -> int:
    """The seed to give torch's CPU generator for a request's 64-bit ``seed``.

    That generator's Mersenne Twister starts from the seed's low 32 bits alone, so
    1 and 1 + 2**32 (or -1 and 2**63 - 1) would sample alike.  A seed that fits in
    32 bits is used as it is (its samples stay what they were); a wider one is
    mixed (splitmix64's finaliser) so that every bit changes the result.  32 bits
    of state remain: two random seeds collide with probability 2**-32."""
    seed &= _MASK_64  # a negative seed wraps, as torch wraps it
    if seed < 2**32:
        return seed
    seed = ((seed ^ (seed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    seed = ((seed ^ (seed >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (seed ^ (seed >> 31)) & 0xFFFFFFFF


class IncrementalDetokenizer:
    """Text deltas for one token at a time; holds bytes back until they form whole characters."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_DETOK_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._take(ended=False)

    def flush(self) -> str:
        """The text still held back when the sequence ends, less a character the
        end cut off (its first bytes decode to U+FFFD): as vLLM, whose
        detokenizer never emits one, the text has no character the model did
        not finish.  Its token keeps its logprob and ``bytes``."""
        return self._take(ended=True).rstrip("\ufffd") if self.read_offset < len(self.ids) else ""

    def _take(self, ended: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        # U+FFFD at the end: a multi-byte character split across tokens; wait for
        # the rest, unless the sequence has ended.
        if len(full) > len(prefix) and (ended or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""


class SequenceSampler:
    """Sampling state of one choice: generator, penalties, stop checks, emitted text."""

    def __init__(
        self,
        params: SamplingParams,
        tokenizer,
        prompt_ids: list[int],
        eos_ids: set[int],
        index: int = 0,
        pieces: TokenPieces | None = None,
        unseeded: int | None = None,
    ) -> None:
        """``unseeded``: the seed of a request that gives none (the engine draws it
        from engine.seed); None: a random one."""
        self.params = params
        self.tokenizer = tokenizer
        self.pieces = pieces or TokenPieces(tokenizer)
        self.eos_ids = set() if params.ignore_eos else eos_ids
        self.stop_ids = set(params.stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        # repetition_penalty: a vocabulary mask of the tokens seen (prompt and output).
        self._prompt_ids = prompt_ids if params.repetition_penalty != 1.0 else None
        self._seen: torch.Tensor | None = None
        self._end_ids: torch.Tensor | None = None  # min_tokens: EOS and stop ids, masked while short
        if params.seed is not None:
            seed = params.seed + index
        else:
            seed = (unseeded if unseeded is not None else random.getrandbits(63)) + index
        self.generator = torch.Generator(device="cpu").manual_seed(generator_seed(seed))
        self.counts: Counter[int] = Counter()
        self.text = ""
        self.emitted = 0
        self.num_generated = 0
        self.stop_reason: int | str | None = None  # the stop string or stop token id that ended it
        # A stop string may start this many characters before new text ...
        self.stop_reach = max((len(s) for s in params.stop), default=1) - 1
        # ... so that much is held back, unless the stop string is to be kept anyway.
        self.holdback = 0 if params.include_stop_str_in_output else self.stop_reach
        self.stop_floor = 0  # the first min_tokens tokens' text: no stop string ends in it
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def greedy(self) -> bool:
        # As vLLM's _SAMPLING_EPS: dividing by a temperature this small
        # overflows the logits to inf and the probabilities to NaN.
        return self.params.temperature < GREEDY_BELOW_TEMPERATURE or self.params.top_k == 1

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits suffices (batched fast path)."""
        p = self.params
        return (self.greedy and not (p.presence_penalty or p.frequency_penalty or p.logit_bias) and p.logprobs is None
                and p.repetition_penalty == 1.0 and self.num_generated >= p.min_tokens)

    def sample(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """One token from a float32 [vocab] row of raw logits."""
        p = self.params
        raw = logits
        if p.logit_bias:
            if self._bias is None:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
                self._bias = (ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype))
            logits = logits.clone()
            logits[self._bias[0]] += self._bias[1]
        # vLLM's order: repetition, then frequency, then presence (the results differ otherwise).
        if p.repetition_penalty != 1.0:
            seen = self._seen_mask(logits.shape[-1])
            rp = p.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            counts = torch.tensor(list(self.counts.values()), dtype=logits.dtype)
            logits = logits.clone()
            logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
        if self.num_generated < p.min_tokens:
            if self._end_ids is None:
                ends = [t for t in self.eos_ids | self.stop_ids if 0 <= t < logits.shape[-1]]
                self._end_ids = torch.tensor(sorted(ends), dtype=torch.long)
            if len(self._end_ids):
                logits = logits.clone()
                logits[self._end_ids] = float("-inf")
        if self.greedy:
            token = int(torch.argmax(logits))
        else:
            token = self._draw(logits / p.temperature)
        return token, self._logprob(raw, token) if p.logprobs is not None else None

    def _seen_mask(self, vocab: int) -> torch.Tensor:
        if self._seen is None:
            self._seen = torch.zeros(vocab, dtype=torch.bool)
            ids = [t for t in self._prompt_ids if 0 <= t < vocab]
            if ids:
                self._seen[torch.tensor(ids, dtype=torch.long)] = True
            for token in self.counts:  # tokens generated before this sampler's first penalty
                if 0 <= token < vocab:
                    self._seen[token] = True
        return self._seen

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.min_p > 0:
            probs = torch.softmax(logits, -1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            # Drop a token when the ones before it already reach top_p (the first always stays:
            # a top_p that rounds to 0 in float32 would otherwise drop every token).
            drop = cum - torch.softmax(sorted_logits, -1) >= p.top_p
            drop[0] = False
            logits = logits.clone()
            logits[order[drop]] = float("-inf")
        probs = torch.softmax(logits, -1)
        try:
            return int(torch.multinomial(probs, 1, generator=self.generator))
        except RuntimeError:
            # NaN probabilities: extreme settings (repetition_penalty near 0) took
            # logits to inf.  The likeliest token, rather than failing the batch.
            return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))

    def _logprob(self, raw: torch.Tensor, token: int) -> TokenLogprob:
        logprobs = torch.log_softmax(raw.float(), -1)
        top = []
        k = self.params.logprobs or 0
        if k > 0:
            values, _ = torch.topk(logprobs, min(k, logprobs.shape[-1]))
            # Equal values in ascending id order, as argmax takes the lowest: topk's own
            # order among ties is arbitrary, and a greedy token tied for the top was
            # often not listed first (exact ties are common in bf16).
            ids = torch.nonzero(logprobs >= values[-1]).squeeze(1)
            ids = ids[torch.sort(logprobs[ids], descending=True, stable=True).indices[:k]]
            top = [(int(i), self.pieces.text(int(i)), float(logprobs[i])) for i in ids]
        return TokenLogprob(token, self.pieces.text(token), float(logprobs[token]), top,
                            token not in self.pieces.special_ids)

    def accept(self, token: int, num_tokens: int, max_model_len: int) -> tuple[str, str | None]:
        """Record a sampled token; returns (text delta to emit, finish reason or None)."""
        p = self.params
        self.num_generated += 1
        self.counts[token] += 1
        if self._seen is not None and token < len(self._seen):
            self._seen[token] = True
        finish = None
        start = len(self.text)
        if self.is_end_token(token):
            finish = "stop"
            if token not in self.eos_ids:  # a stop token id (EOS wins where it is both, as in vLLM)
                self.stop_reason = token
            # As vLLM: the ending token's own text is kept only on request.
            self.text += (self.detok.add(token) if p.include_stop_str_in_output else "") + self.detok.flush()
        else:
            self.text += self.detok.add(token)
        if finish is None and (self.num_generated >= p.max_tokens or num_tokens >= max_model_len):
            finish = "length"
            self.text += self.detok.flush()
        if self.num_generated <= p.min_tokens:
            # Stop strings only count in text that comes after the first min_tokens tokens.
            self.stop_floor = len(self.text)
        # Text that came with this token, flushed at the end included, may complete a stop string.
        elif p.stop and len(self.text) > start and (matched := self._cut_stop(start)) is not None:
            finish = "stop"
            self.stop_reason = matched
        return self._emit(finish is not None), finish

    def is_end_token(self, token: int) -> bool:
        """EOS or a stop token id: it ends the sequence and is not part of its text."""
        return token in self.eos_ids or token in self.stop_ids

    def _cut_stop(self, new_from: int) -> str | None:
        # A stop string may begin in earlier text only within its reach, and must
        # end past the text of the first min_tokens tokens (as vLLM's check).
        search_from = max(0, new_from - self.stop_reach)
        floor = self.stop_floor + 1
        hits = [(i, -len(s), s) for s in self.params.stop
                if (i := self.text.find(s, max(search_from, floor - len(s)))) >= 0]
        if not hits:
            return None
        at, minus_len, matched = min(hits)  # the earliest, the longest of those starting there
        self.text = self.text[: at - minus_len if self.params.include_stop_str_in_output else at]
        return matched

    def _emit(self, finished: bool) -> str:
        # Hold back what could still turn out to be the start of a stop string.
        upto = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted : upto], upto
        return delta


def sample_batch(logits: torch.Tensor, samplers: list[SequenceSampler]) -> list[tuple[int, TokenLogprob | None]]:
    """Sample one token per row; greedy rows without extras share one argmax."""
    logits = logits.float().cpu()
    argmax = torch.argmax(logits, -1).tolist() if any(s.plain_greedy for s in samplers) else None
    results = []
    for row, sampler in enumerate(samplers):
        if sampler.plain_greedy:
            results.append((argmax[row], None))
        else:
            results.append(sampler.sample(logits[row]))
    return results
