"""Prompt tokens and block keys, exactly as the engine will see them.

The router is only as good as its agreement with the engine's cache: it must
tokenise with the same tokenizer and chat template and hash with the same
function, block size and salt.  The token ids computed here
are handed to the engine with the request, so a prompt is tokenised once.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from typing import Any, Callable, NamedTuple, Sequence

from engine.block_hash import block_hashes, chain_salt, content_hash
from engine.chat_tokens import ChatTokenizer
from gateway.protocol import IMAGE_PLACEHOLDER

log = logging.getLogger(__name__)


class Prompt(NamedTuple):
    token_ids: list[int]
    # (token offset, content hash) of each image, in the engine's mm_hashes form.
    mm_hashes: list[tuple[int, bytes]]
    keys: list[int]


class PrefixHasher:
    """Tokenises requests and computes their chained block keys.

    ``template`` turns chat messages into token ids: the engine's own
    ``apply_chat_template`` for in-process replicas, so both sides agree by
    construction, else a ``ChatTokenizer`` over the same tokenizer.
    ``encoder`` (default: the tokenizer's ``encode``) does the same for text
    prompts; kvgate passes ``ChatTokenizer.encode_text``.  Both take the
    request's cache salt as a second argument: its tokeniser cache namespace.
    """

    def __init__(
        self,
        tokenizer: Any,
        block_size: int,
        salt: str | bytes,
        template: Callable[[list[dict], str], list[int]] | None = None,
        encoder: Callable[[str, str], list[int]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.salt = salt
        # Default: the tokenizer's own template, tokenised whole (no piece cache).
        self._template = template or ChatTokenizer(tokenizer, cache_tokens=0).whole
        self._encoder = encoder
        # What encode(text, add_special_tokens=True) puts around a completions
        # prompt's own ids (vLLM's default): None when nothing, as for SmolLM2 or Qwen.
        self._specials = special_tokens_around(tokenizer)
        try:
            self.vocab_size = len(tokenizer)
        except TypeError:
            self.vocab_size = getattr(tokenizer, "vocab_size", 1 << 31)

    def chat(self, messages: list[dict], images: Sequence[bytes] = (), cache_salt: str | None = None,
             tools: list[dict] | None = None) -> Prompt:
        if tools:
            # The template is given the tools, as vLLM gives them (tool_choice "none" too):
            # rendered whole, the piece cache knows no tools.
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = self._template(messages, cache_salt or "")
        mm = self._image_offsets(messages, images, cache_salt or "", tools) if images else []
        return Prompt(ids, mm, block_hashes(ids, self.block_size, chain_salt(self.salt, cache_salt), mm))

    def text(self, prompt: str | list[int], cache_salt: str | None = None, add_special_tokens: bool = True) -> Prompt:
        """A completions prompt: text gets the tokenizer's special tokens unless
        ``add_special_tokens`` is false; token ids are taken as they are (vLLM's rules)."""
        if isinstance(prompt, str):
            ids = self.encode(prompt, cache_salt or "")
            if add_special_tokens and self._specials is not None:
                before, after = self._specials
                ids = before + ids + after
        else:
            ids = prompt
        return Prompt(ids, [], block_hashes(ids, self.block_size, chain_salt(self.salt, cache_salt)))

    def encode(self, text: str, namespace: str = "") -> list[int]:
        if self._encoder is not None:
            return self._encoder(text, namespace)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _image_offsets(self, messages: list[dict], images: Sequence[bytes], namespace: str,
                       tools: list[dict] | None = None) -> list[tuple[int, bytes]]:
        """Token offset of each image placeholder, paired with the image's content hash.
        ``namespace``: the request's, as for its prompt (its text is no other tenant's to time).

        The offset is where the placeholder's tokens start in the tokenised
        template text (a token running into it included): deterministic, which is
        all block identity needs, since the engine receives these pairs rather
        than recomputing them.  Found in one
        pass over the text (tokenising it up to each image in turn made a request
        of thousands of tiny images cost seconds to minutes of the event loop).
        """
        try:
            # With the tools the prompt's ids were rendered with: an image comes after them.
            kwargs = {"tools": tools} if tools else {}
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception:
            rendered = "".join(m["content"] for m in messages)
        places = []
        pos = 0
        for _ in images:
            found = rendered.find(IMAGE_PLACEHOLDER, pos)
            if found < 0:
                found = len(rendered)
            places.append(found)
            pos = found + len(IMAGE_PLACEHOLDER)
        return list(zip(self._tokens_before(rendered, places, namespace), map(content_hash, images)))

    def _tokens_before(self, text: str, places: list[int], namespace: str) -> list[int]:
        """How many of ``text``'s tokens end at or before each of ``places`` (ascending):
        a token that runs into the placeholder (" <" in byte-level vocabularies)
        counts with the image, so that the block holding it is told apart by it too."""
        if getattr(self.tokenizer, "is_fast", False):
            # One tokenisation, its character spans read (not cached: no piece of it is shared).
            spans = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            ends = [end for _, end in spans]
            return [bisect_right(ends, place) for place in places]
        # A tokenizer without spans (slow or remote-code ones): the text up to each
        # image, tokenised whole (in pieces, merges across them would be lost and
        # each image drift a token later), at a cost that grows with their number.
        return [len(self.encode(text[:place], namespace)) for place in places]

    def signature(self, token_ids: Sequence[int]) -> int:
        """The prefix signature of a file request: a hash of its first tokens."""
        data = b"".join(t.to_bytes(4, "little") for t in token_ids)
        return int.from_bytes(content_hash(data)[:8], "little")


def special_tokens_around(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer adds before and after a text's own when asked for
    its special tokens (Llama's and Gemma's BOS), or None when it adds none.

    Found once by encoding a probe both ways, so that the piece cache, which
    tokenises without them, can serve completions prompts too.
    """
    probe = "Hello world"
    try:
        bare = list(tokenizer.encode(probe, add_special_tokens=False))
        full = list(tokenizer.encode(probe, add_special_tokens=True))
    except Exception:  # noqa: BLE001 - a tokenizer without the option adds nothing
        return None
    if full == bare:
        return None
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    # Special tokens merged into the text's own: no tokenizer known does this.
    log.warning("the tokenizer's special tokens cannot be told apart from a text's (%r encodes as %s alone and %s "
                "with them): completions prompts are tokenised without them", probe, bare, full)
    return None
