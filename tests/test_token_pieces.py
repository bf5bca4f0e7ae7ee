"""Logprobs tokens that hold part of a character: OpenAI's ``bytes:\\x..`` form,
their real bytes, and text offsets that index the text the client reads."""

from __future__ import annotations

import pytest
from tokenizers import pre_tokenizers

from engine.request import TokenLogprob
from engine.token_pieces import TokenPieces, byte_level_alphabet, token_bytes
from gateway.shapes import TokenOffsets, chat_logprobs, completion_logprobs
from tests.tiny_model import make_tiny_tokenizer
from tests.tokenizer_families import FAMILIES

TEXT = "price 价格 is 你好! ünïcödé"


def test_byte_level_alphabet_is_the_tokenizers_one():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())


# Llama 2's real vocabulary has byte-fallback entries; the in-process one lacks them.
@pytest.mark.parametrize("family", ["tiny", "qwen2", "gemma", "llama3"])
def test_token_bytes_join_back_into_the_text(family):
    tokenizer = make_tiny_tokenizer() if family == "tiny" else FAMILIES[family][0]()
    pieces = TokenPieces(tokenizer)
    texts = [pieces.text(i) for i in tokenizer.encode(TEXT, add_special_tokens=False)]
    assert b"".join(bytes(token_bytes(t)) for t in texts) == TEXT.encode()
    partial = [t for t in texts if t.startswith("bytes:")]
    assert partial and all("\ufffd" not in t for t in texts)
    # Whole characters keep their plain text.
    assert "!" in texts


def test_text_offsets_count_characters_across_split_tokens():
    tokens = ["a", "bytes:\\xe4\\xbd", "bytes:\\xa0", "b", " c"]
    items = [TokenLogprob(i, t, -1.0) for i, t in enumerate(tokens)]
    whole = completion_logprobs(items, TokenOffsets())
    assert whole["text_offset"] == [0, 1, 1, 2, 3]  # in "a你b c"
    # Streamed in two chunks, the character split across them still counts once.
    offsets = TokenOffsets()
    first = completion_logprobs(items[:2], offsets)["text_offset"]
    second = completion_logprobs(items[2:], offsets)["text_offset"]
    assert first + second == whole["text_offset"]


def test_a_token_after_bytes_that_make_no_character_starts_where_its_text_does():
    """Two lone lead bytes (each a U+FFFD in the text), then " 1": the decoder gives
    the second one's U+FFFD only with " 1", whose offset pointed at it (8, not 9)."""
    tokens = ["ire", "bytes:\\xcd", "bytes:\\xd9", " 1", "x"]
    offsets = completion_logprobs([TokenLogprob(i, t, -1.0) for i, t in enumerate(tokens)], TokenOffsets())["text_offset"]
    text = "ire\ufffd\ufffd 1x"  # as the engine's detokenizer gives it
    assert offsets == [0, 3, 4, 5, 7]
    assert text[offsets[3]:].startswith(" 1") and text[offsets[4]] == "x"


def test_chat_logprobs_give_real_bytes():
    items = [TokenLogprob(1, "bytes:\\xe4\\xbd", -0.5, [(1, "bytes:\\xe4\\xbd", -0.5), (2, "é", -1.0)])]
    entry = chat_logprobs(items)["content"][0]
    assert entry["bytes"] == [0xE4, 0xBD]
    assert [t["bytes"] for t in entry["top_logprobs"]] == [[0xE4, 0xBD], list("é".encode())]


def test_sentencepiece_tokens_keep_their_word_mark_as_a_space():
    # Decoded alone, "▁world" loses its space (the decoder strips the text's
    # first one); mid-text, where generated tokens are, it adds " world".
    tokenizer = FAMILIES["llama2"][0]()
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode("ello world there", add_special_tokens=False)
    texts = [pieces.text(i) for i in ids]
    assert "".join(texts) == " " + tokenizer.decode(ids)
    offsets = completion_logprobs([TokenLogprob(i, t, -1.0) for i, t in zip(ids, texts)], TokenOffsets())["text_offset"]
    joined = "".join(texts)
    assert all(joined.startswith(t, at) for t, at in zip(texts, offsets))
