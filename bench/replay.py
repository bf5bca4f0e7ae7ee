"""Benchmark: every eviction policy on the shared Mooncake trace and one synth trace per profile.

    python bench/replay.py --json bench/replay.json [--policies ...] [--duration 1800]

Writes one `kvgate replay`-style JSON per trace under a single file and prints
a table per trace plus replay speed per policy.  Synth traces are generated
into a temporary directory (never committed).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository's packages before bench/ itself, whose engine.py would shadow the engine package.
sys.path.insert(0, str(ROOT))

from engine import synth  # noqa: E402
from engine.replay import future_accesses, replay  # noqa: E402
from engine.replay_report import capacity_answers, format_table, trace_summary  # noqa: E402
from engine.traces import load_trace  # noqa: E402

MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)


def run_trace(path: Path, policies: list[str]) -> dict:
    trace = load_trace(path)
    unique = trace.unique_blocks()
    summary = trace_summary(trace, unique, trace.ideal_hit_ratio())
    future = future_accesses(trace) if "belady" in policies else None
    results = [
        replay(trace, policy, max(1, round(f * unique)), unique_blocks=unique, future=future)
        for policy in policies
        for f in FRACTIONS
    ]
    print(format_table(summary, results), flush=True)
    print(flush=True)
    return {
        "trace": summary,
        "results": [r.to_json() for r in results],
        "capacity_planning": capacity_answers(results, summary["ideal_hit_ratio"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench/replay.json")
    parser.add_argument("--policies", default="lru,fifo,s3fifo,belady")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of synth traffic per profile")
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"mooncake": MOONCAKE}
        for profile in ("to-c", "to-b", "mixed"):
            path = Path(tmp) / f"{profile}-seed{args.seed}.jsonl"
            synth.write_trace(synth.synthesize(profile, args.duration, args.rate, args.seed), path)
            paths[f"synth-{profile}"] = path
        for name, path in paths.items():
            print(f"== {name}", flush=True)
            runs[name] = run_trace(path, policies)
    speed = {}
    for policy in policies:
        rows = [r for run in runs.values() for r in run["results"] if r["policy"] == policy]
        speed[policy] = sorted(r["accesses_per_s"] for r in rows)[len(rows) // 2]
    print("replay speed, median block accesses/s over all runs:")
    for policy, value in speed.items():
        print(f"  {policy:<10} {value:>12,.0f}  ({value / speed[policies[0]]:.2f}x {policies[0]})")
    payload = {
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "synth": {"duration_s": args.duration, "rate": args.rate, "seed": args.seed},
        "traces": runs,
        "accesses_per_s_median": speed,
    }
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
