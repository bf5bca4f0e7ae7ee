"""Engine benchmark: throughput against plain transformers, and TTFT with a cached prefix.

    python bench/engine.py --json OUT [--model PATH] [--device cpu|cuda] [--dtype ...]

1. Throughput: 16 concurrent requests, 256-token prompts, 64 new tokens each
   (EOS ignored, greedy).  Output tokens/s of the engine, of HF ``generate``
   run once per request (sequential), and of transformers' own continuous
   batching (``generate_batch``), all with the same weights and dtype.
2. TTFT of a 1024-token prompt cold, then of a 1024-token prompt whose first
   960 tokens are cached.

Prompts are random token ids (fixed seed) so no two requests share a prefix:
the throughput figures measure batching, not caching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.request import GenerationRequest, SamplingParams  # noqa: E402


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the low ids, where small vocabularies keep their special tokens.
    return [torch.randint(min(100, vocab // 4), vocab, (length,), generator=g).tolist() for _ in range(count)]


async def engine_throughput(engine: AsyncEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> int:
        count = 0
        async for out in engine.generate(GenerationRequest(f"tp{i}", prompt, params)):
            count += len(out.token_ids)
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts) / (time.perf_counter() - start)


def hf_sequential(model, prompts: list[list[int]], new_tokens: int) -> float:
    model.generation_config.eos_token_id = None
    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
            produced += out.shape[1] - ids.shape[1]
    return produced / (time.perf_counter() - start)


def hf_generate_batch(model, prompts: list[list[int]], new_tokens: int, max_batched_tokens: int) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    # Same budget as the engine.  Left to itself on CPU it sizes its cache from
    # free RAM (tens of GB here) and spends most of the run allocating it.
    page = 256
    pages = len(prompts) * -(-(max(map(len, prompts)) + new_tokens) // page) + 4
    cb = ContinuousBatchingConfig(
        page_size=page, num_blocks=pages, max_batch_tokens=max_batched_tokens, max_requests_per_batch=16
    )
    # A short warm-up so one-time setup is not charged to the run.
    model.generate_batch(inputs=prompts[:1], generation_config=config, continuous_batching_config=cb, max_new_tokens=2)
    start = time.perf_counter()
    with torch.inference_mode():
        results = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    if produced < len(prompts) * new_tokens:
        print(f"warning: generate_batch produced {produced} of {len(prompts) * new_tokens} tokens", file=sys.stderr)
    return produced / elapsed


async def ttft(engine: AsyncEngine, prompt: list[int], request_id: str) -> tuple[float, int]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first = None
    cached = -1
    async for out in engine.generate(GenerationRequest(request_id, prompt, params)):
        if first is None:
            first = time.perf_counter() - start
        if out.usage is not None:
            cached = out.usage.cached_tokens
    return first, cached


async def run(args) -> dict:
    model_cfg = ModelConfig(path=args.model, device=args.device, dtype=args.dtype, max_model_len=2048)
    engine_cfg = EngineConfig(max_num_seqs=16, max_batched_tokens=args.max_batched_tokens, threads=args.threads)
    engine = AsyncEngine.from_config(model_cfg, engine_cfg)
    vocab = engine.loaded.model.config.vocab_size
    prompts = random_prompts(args.requests, args.prompt_tokens, vocab, seed=0)
    warm = random_prompts(2, 32, vocab, seed=99)
    result: dict = {
        "model": engine.model_name,
        "device": str(engine.loaded.device),
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
    }
    try:
        await engine_throughput(engine, warm, 4)  # warm-up
        engine_tok_s = await engine_throughput(engine, prompts, args.new_tokens)
        print(f"engine:              {engine_tok_s:8.1f} output tok/s", flush=True)
        long_prompt = random_prompts(1, 1024, vocab, seed=1)[0]
        cold_s, cold_cached = await ttft(engine, long_prompt, "ttft-cold")
        warm_prompt = long_prompt[:960] + random_prompts(1, 64, vocab, seed=2)[0]
        warm_s, warm_cached = await ttft(engine, warm_prompt, "ttft-warm")
        print(f"ttft cold {cold_s:.3f} s (cached {cold_cached}), warm {warm_s:.3f} s (cached {warm_cached})", flush=True)
    finally:
        await engine.shutdown()
    # The engine switched its model to paged attention; the HF runs get their own copy.
    hf = load_model(model_cfg).model
    seq_tok_s = hf_sequential(hf, prompts, args.new_tokens)
    print(f"hf sequential:       {seq_tok_s:8.1f} output tok/s", flush=True)
    batch_tok_s = hf_generate_batch(hf, prompts, args.new_tokens, args.max_batched_tokens)
    print(f"hf generate_batch:   {batch_tok_s:8.1f} output tok/s", flush=True)
    result["throughput"] = {
        "engine_tok_s": round(engine_tok_s, 2),
        "hf_sequential_tok_s": round(seq_tok_s, 2),
        "hf_generate_batch_tok_s": round(batch_tok_s, 2),
    }
    result["ttft"] = {
        "prompt_tokens": 1024,
        "cached_tokens": warm_cached,
        "cold_s": round(cold_s, 4),
        "warm_s": round(warm_s, 4),
    }
    print(
        f"engine / sequential = {engine_tok_s / seq_tok_s:.2f}x, engine / generate_batch = "
        f"{engine_tok_s / batch_tok_s:.2f}x, warm / cold TTFT = {warm_s / cold_s:.1%}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--model", default=None, help="model.path (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
