"""A tiny random-init Llama model directory for fast engine and gateway tests.

Everything is built in-process (no downloads): a byte-level BPE tokenizer
trained on a small built-in corpus and a 2-layer Llama with fixed weights.
The result loads like any HF model directory via ``model.path``.
"""

from __future__ import annotations

import os

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

# Enough varied text for a ~512-token BPE; any fixed text works.
_CORPUS = """
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
A cache keeps recently used data close to the processor so that later reads are fast.
Large language models generate text one token at a time, attending to every earlier token.
The key and value tensors of earlier tokens are stored in a KV cache and reused by later steps.
When many users share a system prompt, its blocks are computed once and served from the cache.
You are a helpful assistant. Answer the question briefly and politely.
What is the weather like today? It is sunny with a light breeze from the west.
Please summarise the following document in three sentences for a busy reader.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048.
Unicode text: café, naïve, über, 東京, 北京, emoji 🙂 and symbols like → and ∑.
def main(): print("hello world"); return 0  # code also shows up in prompts
The quick brown fox jumps over the lazy dog while the cat sleeps by the fire.
""".strip()


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def make_tiny_tokenizer(vocab_size: int = 512):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(vocab_size),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model_dir(
    path: str | os.PathLike, vocab_size: int = 512, seed: int = 0, dtype=None, **config_overrides
) -> str:
    """Write a complete HF model directory (config, weights, tokenizer) to ``path``.

    ``config_overrides`` change the LlamaConfig (bench/gpu_check.sh builds a
    1B-class model this way); ``dtype`` is the dtype the weights are saved in.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tokenizer = make_tiny_tokenizer(vocab_size)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlamaConfig(**{**settings, **config_overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init with std 0.02 gives near-uniform logits; a larger head
    # spreads them so greedy decoding is decisive (ties would make tests flaky).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_model_dir(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvgate-tiny"))
