"""Single tokens as logprobs show them, including tokens that hold part of a character.

A byte-level BPE (GPT-2, SmolLM2, Qwen2, Llama 3) or a SentencePiece model
with byte fallback (Llama 2, Mistral, Gemma) splits a character outside ASCII
across tokens.  Decoded alone, such a token is U+FFFD, and the replacement
character's own bytes would be all a client got.  OpenAI writes these tokens
as ``bytes:\\xe4\\xbd`` and gives their real bytes in ``bytes``, so that a
client can join the bytes of consecutive tokens back into the text; so does
kvgate.
"""

from __future__ import annotations

import json
import re

_BYTES_PREFIX = "bytes:"
# SentencePiece's byte-fallback tokens: one byte each.
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for.

    GPT-2's scheme: printable Latin-1 bytes stand for themselves; the other 68
    (controls, space, a few more) map to U+0100 onwards, in byte order.
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in char_of.items()}


class TokenPieces:
    """``text(token_id)``: the token's text for logprobs; ``bytes:\\x..`` when it
    holds part of a character.  Cached per id (a vocabulary's worth at most)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoders = _decoder_types(tokenizer)
        self._alphabet = byte_level_alphabet() if "ByteLevel" in decoders else None
        # SentencePiece's word mark; decoding a token alone strips it at the start
        # of the text, but mid-text (where generated tokens are) it is a space.
        self._word_mark = "▁" if decoders & {"Metaspace", "Replace"} else None
        self._texts: dict[int, str] = {}
        # What a decode with skip_special_tokens leaves out (the tokenizer's added
        # tokens marked special), as the choice's text is decoded.
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special_ids = frozenset(int(i) for i, token in decoder.items() if getattr(token, "special", False))

    def text(self, token_id: int) -> str:
        """The text the token adds to the text around it (so a choice's token texts
        join into its text), or ``bytes:\\x..`` for part of a character."""
        text = self._texts.get(token_id)
        if text is None:
            raw = self.raw(token_id)
            if raw is None:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            elif _is_utf8(raw):
                text = raw.decode()
            else:
                text = _BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)
            self._texts[token_id] = text
        return text

    def raw(self, token_id: int) -> bytes | None:
        """The token's bytes, where the vocabulary entry says them (None otherwise)."""
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None else None
        if not isinstance(piece, str):
            return None
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._alphabet is not None:
            try:
                return bytes(self._alphabet[c] for c in piece)
            except KeyError:  # an added token, written as itself
                return None
        if self._word_mark is not None and self._word_mark in piece:
            return piece.replace(self._word_mark, " ").encode()
        return None


def token_bytes(token: str) -> list[int]:
    """The ``bytes`` of a logprobs token: the real bytes of a ``bytes:\\x..`` token,
    else the text's UTF-8."""
    if token.startswith(_BYTES_PREFIX + "\\x"):
        try:
            return list(bytes.fromhex(token[len(_BYTES_PREFIX):].replace("\\x", "")))
        except ValueError:
            pass
    return list(token.encode("utf-8", "surrogatepass"))


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _decoder_types(tokenizer) -> set[str]:
    """The types of the fast tokenizer's decoder steps (ByteLevel, Metaspace, Replace, ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return set()
    found = set()
    stack = [decoder]
    while stack:  # steps may sit inside a Sequence
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "Replace" and (node.get("pattern") or {}).get("String") != "▁":
                continue  # another replacement: not the word mark
            found.add(node.get("type"))
            stack.extend(node.get("decoders") or [])
    return found
