"""Chat prompts to token ids, re-using the tokens of text seen before.

A multi-turn conversation resends its whole history every turn, so
tokenising the rendered prompt from scratch costs more each turn: with
SmolLM2's tokenizer, 0.16 ms for a two-message chat but 33 ms for a
40-message, 8k-token one (bench/chat_tokenize.py), on the event loop of the
gateway and the engine alike.

HuggingFace fast tokenizers cut the text at their added tokens
(``<|im_start|>``, ``<|im_end|>``, ...) before anything else and tokenise
each piece between them on its own, so a prompt's ids are the pieces' ids
joined, with each added token's id between them.  A chat template puts those
tokens around every message, so the pieces are the messages (with their role
headers), and every piece but the newest turn's was tokenised in an earlier
turn.  ``ChatTokenizer`` renders the template as text, cuts it the same way,
and takes each piece's ids from a bounded LRU cache, tokenising only the
pieces it has not seen.

That equality is a property of the tokenizer, not a law: an added token that
strips the whitespace beside it or a normaliser that runs before the cut
breaks it.  A SentencePiece-style pre-tokenizer that marks only the start of
the text (Metaspace with ``prepend_scheme="first"``: Llama 2, Mistral) marks
only the piece at offset 0, so the other pieces are tokenised by a copy of the
tokenizer that marks none.  The cache is only used when the tokenizer's added
tokens are plain, when a set
of probe conversations tokenise identically both ways at start-up, and while
a sample of live prompts keeps agreeing (one in ``verify_every``); otherwise
every prompt is tokenised whole, as before.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any, Callable

import xxhash

log = logging.getLogger(__name__)

# Conversations the two ways must agree on before the cache is trusted: edge
# whitespace, non-ASCII text, empty turns, code, and an added token's text
# inside a message (which the whole-prompt tokenizer also cuts at).
_PROBES: list[list[dict]] = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "  What is the capital of France?  "},
        {"role": "assistant", "content": "Paris.\n"},
        {"role": "user", "content": "\nAnd of Japan — 日本? Écrivez-le en français."},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "def f(x):\n\treturn x ** 2  # 😀\n\n\n"},
        {"role": "assistant", "content": " "},
        {"role": "user", "content": "ends with spaces and a tab \t"},
    ],
]


# Pieces up to this many characters (role headers, the newlines between
# messages, short turns) are keyed by their text: cheaper than hashing it.
_KEEP_TEXT_KEY = 64
# What an entry costs besides its ids (a dict node, a key of up to 64 characters
# or a 128-bit hash, a list header: ~250 bytes), in tokens of 8 bytes.  Charged
# against the capacity, so that many short pieces (every new chat adds a few)
# cannot hold far more memory than tokenize_cache_tokens x 8 bytes.
_ENTRY_TOKENS = 32


def piece_key(piece: str, namespace: str = "") -> int | str:
    """A piece's cache key.  Long pieces are keyed by a 128-bit hash, so that
    the cache does not hold the conversation's text as well as its tokens.

    A ``namespace`` (a tenant's cache salt) keys every piece apart: a cached
    piece is tokenised faster, and one tenant must not learn by timing what
    text another sent, as it cannot from the KV cache's hits.
    """
    if namespace:
        return xxhash.xxh3_128_intdigest(f"{len(namespace)}:{namespace}{piece}".encode("utf-8", "surrogatepass"))
    if len(piece) <= _KEEP_TEXT_KEY:
        return piece
    # "0:" as a namespace of length 0: no text is keyed as another namespace's
    # piece (hashed bare, "5:alice" + P was alice's key for P, to be read or
    # overwritten by anyone sending that text).
    return xxhash.xxh3_128_intdigest(f"0:{piece}".encode("utf-8", "surrogatepass"))


def _vocab_size(tokenizer: Any) -> int:
    try:
        return len(tokenizer)
    except TypeError:
        return int(getattr(tokenizer, "vocab_size", 0))


def _without_limits(backend: Any) -> Any:
    """``backend``, or a copy of it without the truncation or padding its
    tokenizer.json may carry (saved after enable_truncation, say).  transformers
    turns both off for each call of its own; a piece tokenised straight by the
    backend would be cut at max_length (a long message lost its end)."""
    if getattr(backend, "truncation", None) is None and getattr(backend, "padding", None) is None:
        return backend
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def _piece_backend(backend: Any) -> tuple[Any, bool]:
    """The tokenizer for pieces that do not start the text, and whether that
    differs from ``backend``.  A Metaspace pre-tokenizer with
    ``prepend_scheme="first"`` puts its word mark only before the split at
    offset 0 of the whole text: in a prompt cut at added tokens, every other
    piece goes unmarked, as a copy with ``prepend_scheme="never"`` tokenises it."""
    from tokenizers import Tokenizer

    config = json.loads(backend.to_str())
    marked = False
    stack = [config.get("pre_tokenizer")]
    while stack:  # Metaspace may sit inside a Sequence
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                marked = True
            stack.extend(node.get("pretokenizers") or [])
    if not marked:
        return backend, False
    return Tokenizer.from_str(json.dumps(config)), True


def _cut_at(tokens: list[str]) -> re.Pattern:
    """A pattern that splits text at ``tokens``, keeping them.  Longest first: at
    each position the longest added token wins, as in the tokenizer's own matching."""
    alternatives = sorted(tokens, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")


class ChatTokenizer:
    """``encode_chat(messages)``: the ids ``tokenizer.apply_chat_template`` gives
    (with the generation prompt), from cached pieces where it can.

    ``cache_tokens`` bounds the cache by the tokens it holds (8 bytes each);
    0 turns it off.  Safe to call from several threads (the gateway tokenises
    huge prompts off the event loop).
    """

    def __init__(self, tokenizer: Any, cache_tokens: int = 2_000_000, verify_every: int = 1000) -> None:
        self.tokenizer = tokenizer
        self.capacity = cache_tokens
        self.verify_every = verify_every
        self.hit_tokens = 0
        self.miss_tokens = 0
        self._pieces: OrderedDict[int | str, list[int]] = OrderedDict()
        self._ints: list[int] = []
        self._held = 0
        self._calls = 0
        self._lock = threading.Lock()
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        # What tokenises pieces that do not start the text (see _piece_backend).
        self._inner = self._backend
        self._marks_start = False
        self._added: dict[str, int] = {}
        self._cut: re.Pattern | None = None
        # Added tokens matched after normalisation, when there are both kinds: the
        # tokenizer cuts at the others first, then at these inside what is left.
        self._cut_normalized: re.Pattern | None = None
        self._render = self._template_text
        why = self._unsupported() if cache_tokens > 0 else "cache_tokens is 0"
        if why is None:
            self._ints = list(range(_vocab_size(tokenizer)))
            self._render = self._direct_renderer() or self._template_text
            why = self._probe()
        self.enabled = why is None
        self.hit_tokens = self.miss_tokens = 0  # count served prompts, not the probes
        if why is not None:
            self._pieces.clear()
            self._held = 0
            self._ints = []
            if cache_tokens > 0:
                log.info("chat prompts are tokenised whole (no piece cache): %s", why)

    # -- the two ways

    def encode_chat(self, messages: list[dict], namespace: str = "") -> list[int]:
        """``namespace``: pieces are shared only within it (see ``piece_key``)."""
        if not self.enabled:
            return self.whole(messages)
        return self._sampled(self._from_pieces(self._render(messages), namespace), lambda: self.whole(messages))

    def encode_text(self, text: str, namespace: str = "") -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=False)``, from cached pieces
        when the text carries added tokens (a completions prompt formatted with
        the chat markup by the client).  Plain text is one piece, most often
        unique, so it is tokenised as it is and kept out of the cache."""
        if not self.enabled or (self._cut.search(text) is None
                                and (self._cut_normalized is None or self._cut_normalized.search(text) is None)):
            return self.plain(text)
        return self._sampled(self._from_pieces(text, namespace), lambda: self.plain(text))

    def plain(self, text: str) -> list[int]:
        """``text`` tokenised in one go (what ``encode_text`` must reproduce)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def whole(self, messages: list[dict], namespace: str = "") -> list[int]:
        """The template tokenised in one go (what the cache must reproduce; no
        cache, so ``namespace`` does not matter)."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def _template_text(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _direct_renderer(self) -> Callable[[list[dict]], str] | None:
        """The template's text by the call apply_chat_template makes itself, with
        the template and its arguments resolved once: ~15-20 us less per prompt
        (of ~55 us for a short chat).  None, and the plain call is used, when
        transformers does not offer it or it renders a probe differently."""
        try:
            from transformers.utils.chat_template_utils import render_jinja_template

            template = self.tokenizer.get_chat_template()
            arguments = dict(self.tokenizer.special_tokens_map)
        except Exception:  # noqa: BLE001 - an older or newer transformers: use the plain call
            return None

        def render(messages: list[dict]) -> str:
            return render_jinja_template([messages], chat_template=template, add_generation_prompt=True, **arguments)[0][0]

        for messages in _PROBES:
            try:
                expected = self._template_text(messages)
            except Exception:  # noqa: BLE001 - a template that rejects a probe
                continue
            try:
                if render(messages) != expected:
                    return None
            except Exception:  # noqa: BLE001
                return None
        return render

    def _from_pieces(self, text: str, namespace: str = "") -> list[int]:
        ids: list[int] = []
        added = self._added
        pieces = self._pieces
        lock = self._lock
        hit = 0
        # re.split with one group alternates: piece, added token, piece, ...
        parts = self._cut.split(text)
        if self._cut_normalized is not None:
            parts = [sub for i, part in enumerate(parts)
                     for sub in (self._cut_normalized.split(part) if i % 2 == 0 else (part,))]
        if self._marks_start and parts[0]:
            # Text before the first added token is the one piece the tokenizer
            # marks as the start: tokenised as it is, not from the cache.
            first = self._backend.encode_batch([parts[0]], add_special_tokens=False)[0].ids
            ids.extend(first)
            parts[0] = ""
            with lock:
                self.miss_tokens += len(first)
        # (Inlined hit path: a long conversation has ~4 pieces a turn.)
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(added[part])
                continue
            if not part:
                continue
            key = piece_key(part, namespace)
            with lock:
                cached = pieces.get(key)
                if cached is not None:
                    pieces.move_to_end(key)
            if cached is None:
                cached = self._tokenise(key, part)
            else:
                hit += len(cached)
            ids.extend(cached)
        if hit:
            with lock:
                self.hit_tokens += hit
        return ids

    def _tokenise(self, key: int | str, piece: str) -> list[int]:
        # Outside the lock: a long piece takes milliseconds.  encode_batch, not
        # encode: only the batch call lets go of the GIL while it works, which
        # is what keeps the event loop serving while the gateway tokenises a
        # huge prompt on a worker thread (encode held it: the loop stalled).
        # The ids are stored as references to one shared int per vocabulary
        # entry: 8 bytes a token, and a hit is a plain list.extend (an array of
        # 4-byte ids would make a new int object per token on every hit).
        encoded = self._inner.encode_batch([piece], add_special_tokens=False)[0].ids
        shared = self._ints
        ids = [shared[t] if t < len(shared) else t for t in encoded]
        with self._lock:
            self.miss_tokens += len(ids)
            if len(ids) + _ENTRY_TOKENS <= self.capacity and key not in self._pieces:
                self._pieces[key] = ids
                self._held += len(ids) + _ENTRY_TOKENS
                while self._held > self.capacity:
                    _, old = self._pieces.popitem(last=False)
                    self._held -= len(old) + _ENTRY_TOKENS
        return ids

    # -- when to trust it

    def _unsupported(self) -> str | None:
        """Why this tokenizer cannot be cut at its added tokens, or None."""
        if self._backend is None:
            return "not a fast (tokenizers) tokenizer"
        if getattr(self.tokenizer, "chat_template", None) is None:
            return "no chat template"
        decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        raw: list[str] = []
        normalized: list[str] = []
        for token_id, token in decoder.items():
            flags = (getattr(token, "lstrip", False), getattr(token, "rstrip", False), getattr(token, "single_word", False))
            if any(flags):
                return f"added token {str(token)!r} strips or matches whole words"
            # Normalised added tokens are matched after normalisation, so a cut
            # on the raw text could differ; harmless without a normaliser.
            if getattr(token, "normalized", False) and self._backend.normalizer is not None:
                return f"added token {str(token)!r} is matched after normalisation"
            self._added[getattr(token, "content", str(token))] = int(token_id)
            (normalized if getattr(token, "normalized", False) else raw).append(getattr(token, "content", str(token)))
        if not self._added:
            return "no added tokens to cut at"
        self._backend = _without_limits(self._backend)
        self._inner, self._marks_start = _piece_backend(self._backend)
        if raw and normalized:
            self._cut, self._cut_normalized = _cut_at(raw), _cut_at(normalized)
        else:
            self._cut = _cut_at(raw or normalized)
        return None

    def _probe(self) -> str | None:
        specials = list(self._added)[:2]
        probes = _PROBES + [[{"role": "user", "content": f"quote {' and '.join(specials)} inside"}]]
        for messages in probes:
            try:
                expected = self.whole(messages)
            except Exception:  # noqa: BLE001 - a template that rejects a probe (e.g. no system role)
                continue
            if self._from_pieces(self._render(messages)) != expected:
                return "a probe conversation tokenises differently in pieces"
        # Text that starts outside the markup (a completions prompt).
        text = f"Start here {specials[0]} then  more{specials[-1]}\nend "
        if self._from_pieces(text) != self.plain(text):
            return "a probe text tokenises differently in pieces"
        return None

    def _sampled(self, ids: list[int], whole: Callable[[], list[int]]) -> list[int]:
        """``ids``, except on one call in ``verify_every``: then the whole prompt's
        ids (``whole()``), and if ``ids`` differ from them the cache is off from
        then on."""
        self._calls += 1
        if self._calls % self.verify_every:
            return ids
        expected = whole()
        if ids != expected:
            self.enabled = False
            with self._lock:
                self._pieces.clear()
                self._held = 0
            log.warning("a prompt tokenised in pieces differed from the whole prompt; piece cache turned off")
        return expected

    def stats(self) -> dict:
        return {
            "enabled": self.enabled,
            "cached_pieces": len(self._pieces),
            "cached_tokens": self._held,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
        }
