"""Small in-process tokenizers shaped like the common model families' ones.

Each has its family's normalizer, pre-tokenizer, special tokens and the shape
of its chat template, over a ~600-token BPE trained on the tiny corpus: what
matters for the chat piece cache is how text is cut and normalised, not the
vocabulary. Qwen2, Gemma and Llama-2 use transformers' own tokenizer classes
(which build those pipelines in code); Llama 3 ships only a tokenizer.json,
so its pipeline is built here after that file.
"""

from __future__ import annotations

import json

from tests.tiny_model import _CORPUS

QWEN2_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %} {{ m['content'] | trim }} {{ eos_token }}"
    "{% else %}[INST] {{ m['content'] | trim }} [/INST]{% endif %}"
    "{% endfor %}"
)
# Llama 3's tokenizer.json splits with this expression before its byte-level step.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bpe(normalizer, pre_tokenizer, special_tokens, byte_level: bool, vocab_size: int = 600):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.normalizer = normalizer
    raw.pre_tokenizer = pre_tokenizer
    alphabet = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()} if byte_level else {}
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False, **alphabet)
    raw.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return raw


def _vocab_and_merges(raw) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(raw.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def qwen2_like():
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    vocab, merges = _vocab_and_merges(_bpe(normalizers.NFC(), pre, ["<|endoftext|>"], byte_level=True))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN2_TEMPLATE
    return tok


def gemma_like():
    from tokenizers import normalizers, pre_tokenizers
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    raw = _bpe(normalizers.Replace(" ", "▁"), pre_tokenizers.Split(" ", behavior="merged_with_previous"),
               ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], byte_level=False)
    vocab, merges = _vocab_and_merges(raw)
    for byte in range(256):  # byte fallback, as Gemma's vocabulary has
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_TEMPLATE
    return tok


def llama3_like():
    from tokenizers import Regex, decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    raw = _bpe(None, pre, special, byte_level=True)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def llama2_like():
    """SentencePiece-style: a Metaspace pre-tokenizer that marks only the start of the text."""
    from tokenizers import pre_tokenizers
    from transformers.models.llama.tokenization_llama import LlamaTokenizer

    raw = _bpe(None, pre_tokenizers.Metaspace(prepend_scheme="first", split=False), ["<unk>", "<s>", "</s>"],
               byte_level=False)
    vocab, merges = _vocab_and_merges(raw)
    tok = LlamaTokenizer(vocab=vocab, merges=merges)
    tok.chat_template = LLAMA2_TEMPLATE
    return tok


# name -> (builder, the chat markup's own tokens)
FAMILIES = {
    "qwen2": (qwen2_like, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
    "gemma": (gemma_like, ["<start_of_turn>", "<end_of_turn>", "<bos>"]),
    "llama3": (llama3_like, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"]),
    "llama2": (llama2_like, ["[INST]", "</s>", "<s>"]),
}
