"""Engine memory on CPU: torch's default kernel caches against the engine's limits.

    python bench/engine_memory.py --json OUT [--model PATH] [--phases 3] [--requests 40]

On a CPU with native bf16 kernels torch's matmuls go through oneDNN, which
compiles a kernel per input shape and keeps up to 1,024 of them in each of two
caches (ideep's LRU_CACHE_CAPACITY, oneDNN's ONEDNN_PRIMITIVE_CACHE_CAPACITY).
An engine step packs every token of the step into one row, so its shape
changes with nearly every new prompt length.  Each contender runs in a process
of its own (the variables are read once, at the first such kernel), with the
same requests: 16 at a time, random prompts of 3 to 300 tokens, 1 to 64 new
tokens, greedy.  It prints the resident memory after loading and after each
phase (after a malloc_trim, so freed memory does not count) and the generated
tokens per second, and the ratios of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What torch uses when nothing is set, and what kvgate's engine sets unless the
# operator did (engine/async_engine.py).
CONTENDERS = {
    "torch defaults": {"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"},
    "kvgate engine": {},
}


def _resident_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _run(model: str | None, phases: int, requests: int, threads: int) -> dict:
    sys.path.insert(0, ROOT)
    from engine.async_engine import AsyncEngine
    from engine.config import CacheConfig, EngineConfig, ModelConfig
    from engine.request import GenerationRequest, SamplingParams

    engine = AsyncEngine.from_config(ModelConfig(path=model, device="cpu"),
                                     EngineConfig(threads=threads, device_blocks=512, host_blocks_multiplier=0),
                                     CacheConfig(policy="lru"))
    await engine.start()
    vocab = len(engine.tokenizer)
    rng = random.Random(1)
    result = {"dtype": str(engine.loaded.dtype), "loaded_mb": round(_resident_mb(), 1), "phases": []}
    gate = asyncio.Semaphore(16)
    for phase in range(phases):
        generated = 0

        async def one(i: int) -> None:
            nonlocal generated
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(3, 300))]
            params = SamplingParams(max_tokens=rng.randint(1, 64), temperature=0.0, ignore_eos=True)
            async with gate:
                async for out in engine.generate(GenerationRequest(f"p{phase}-{i}", prompt, params)):
                    generated += len(out.token_ids)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        seconds = time.perf_counter() - start
        result["phases"].append({"resident_mb": round(_resident_mb(), 1), "seconds": round(seconds, 2),
                                 "tokens_per_s": round(generated / seconds, 1)})
    await engine.shutdown()
    return result


def _contender(name: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    env.update(CONTENDERS[name])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--phases", str(args.phases),
           "--requests", str(args.requests), "--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--phases", type=int, default=3)
    parser.add_argument("--requests", type=int, default=40, help="requests per phase")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", metavar="OUT", help="write results as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phases < 2:
        parser.error("--phases: give 2 or more (the first warms up; speeds are compared after it)")
    if args.child:
        print(json.dumps(asyncio.run(_run(args.model, args.phases, args.requests, args.threads))))
        return
    results = {name: _contender(name, args) for name in CONTENDERS}
    for name, r in results.items():
        phases = ", ".join(f"{p['resident_mb']:.0f} MB ({p['tokens_per_s']:.0f} tok/s)" for p in r["phases"])
        print(f"{name:15s} {r['dtype']}: loaded {r['loaded_mb']:.0f} MB; after each phase: {phases}")
    base, ours = results["torch defaults"], results["kvgate engine"]
    grown = [r["phases"][-1]["resident_mb"] - r["loaded_mb"] for r in (base, ours)]
    speed = [sum(p["tokens_per_s"] for p in r["phases"][1:]) / max(1, len(r["phases"]) - 1) for r in (base, ours)]
    print(f"memory grown after loading: {grown[0]:.0f} MB vs {grown[1]:.0f} MB; "
          f"final resident ratio kvgate/defaults {ours['phases'][-1]['resident_mb'] / base['phases'][-1]['resident_mb']:.2f}; "
          f"tokens/s ratio (phases after the first) {speed[1] / speed[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "engine resident memory and speed, torch's kernel caches vs kvgate's limits",
                       "args": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
