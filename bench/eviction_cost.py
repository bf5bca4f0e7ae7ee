"""Micro-benchmark: cost of one workload-aware eviction against K and against cached blocks.

    python bench/eviction_cost.py [--json OUT] [--ks 1,5,10,20,30,50] [--blocks 1000,10000,100000,500000]

For each (K categories, N evictable blocks) the policy's O(K) structure is
filled with N released keys spread over K categories (each with its own
fitted lambda and p), then timed in steady state: evict one key, insert and
release a fresh one, repeat.  Two clocks:

* ``new_now``: every eviction at a new time, so all K heads are rescored
  (the worst case, as when each eviction belongs to a different request);
* ``same_now``: evictions in bursts at one time (replay: the misses of one
  request), where only the queue that lost its head is rescored.

The cost must grow with K and stay flat in N.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import WorkloadAwareConfig  # noqa: E402
from engine.context import RequestContext  # noqa: E402
from engine.policies.workload_aware import WorkloadAwarePolicy  # noqa: E402


def build(k: int, n: int, seed: int = 0) -> tuple[WorkloadAwarePolicy, list[RequestContext]]:
    cfg = WorkloadAwareConfig.model_validate({
        "max_categories": max(k, 1), "turn_buckets": 16, "position_classes": 1, "shared_class": False,
        "fallback": {"enabled": False}, "rhythm": {"enabled": False}, "topic_switch": {"enabled": False},
        "signature": {"enabled": False},
    })
    policy = WorkloadAwarePolicy(n + 1, cfg)
    rng = random.Random(seed)
    types = ("text", "search", "image", "file", "api")
    contexts = []
    for i in range(k):
        rtype = types[i % len(types)]
        workload = "to-b" if rtype == "api" else "multimodal" if rtype == "image" else "to-c"
        contexts.append(RequestContext(workload=workload, type=rtype, turn=1 + i // len(types),
                                       session=f"s{i}", prompt_blocks=1, prompt_tokens=16))
    # One access per category first so that all K exist, then fit each one.
    key = 0
    for c in contexts:
        key += 1
        policy.insert(key, c, 0, 0.0)
        policy.release(key, c, 0.0)
    for cat, stats in enumerate(policy.model.stats):
        stats.lam, stats.p = rng.uniform(0.005, 1.0), rng.uniform(0.05, 0.95)
    policy.table.refresh()
    now = 0.0
    while key < n:
        key += 1
        now += 0.001
        c = contexts[key % k]
        policy.insert(key, c, 0, now)
        policy.release(key, c, now)
    policy.model.next_refit = float("inf")  # keep the fits fixed while timing
    return policy, contexts


def measure(k: int, n: int, evictions: int) -> dict:
    policy, contexts = build(k, n)
    key = n + 10
    now = 1000.0
    results = {}
    for mode in ("new_now", "same_now"):
        samples = []
        clock = time.perf_counter_ns
        for i in range(evictions):
            if mode == "new_now" or i % 32 == 0:
                now += 0.01
            start = clock()
            policy.evict(now)
            samples.append(clock() - start)
            key += 1
            c = contexts[key % k]
            policy.insert(key, c, 0, now)
            policy.release(key, c, now)
        samples.sort()
        results[mode] = {"median_us": samples[len(samples) // 2] / 1000, "p90_us": samples[int(len(samples) * 0.9)] / 1000,
                         "mean_us": statistics.fmean(samples) / 1000}
    assert policy.num_evictable() == n
    return {"k": len(policy.table), "blocks": n, **results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,5,10,20,30,50")
    parser.add_argument("--blocks", default="1000,10000,100000,500000")
    parser.add_argument("--evictions", type=int, default=20000)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    print("| K | cached blocks | median us (new time) | p90 us | median us (same time) |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.blocks.split(",")):
        for k in (int(x) for x in args.ks.split(",")):
            row = measure(k, n, args.evictions)
            rows.append(row)
            print(f"| {row['k']} | {n:,} | {row['new_now']['median_us']:.2f} | {row['new_now']['p90_us']:.2f} "
                  f"| {row['same_now']['median_us']:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
