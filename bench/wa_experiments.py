"""Measurement matrix of the workload-aware policy (issue 3, item 8).

    python bench/wa_experiments.py --json /tmp/wa_results.json [--jobs 2]
        [--duration 7200 --rate 1.0 --seeds 1,2] [--parts matrix,ablation,spikes]

* matrix: lru, fifo, s3fifo, belady, wa, wa-paper on the shared Mooncake trace
  and on `kvgate synth` traces of each profile (two seeds), at 1, 2, 5, 10 and
  20% of the unique blocks, through ``engine.replay.replay`` (what
  `kvgate replay` runs), default config;
* ablation: wa with one addition turned off (or one knob changed) at a time,
  at ``--ablation-fractions`` (default 1% and 10%: a small and a large cache);
* spikes: on to-B traces, hit ratio inside the spike minutes (arrivals over
  twice the median minute), lru against wa.

Synth traces are generated with ``engine.synth`` (never tuned here) into
``--trace-dir``.  Prints markdown tables and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import CacheConfig, WorkloadAwareConfig  # noqa: E402

MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)
POLICIES = ("lru", "fifo", "s3fifo", "belady", "wa", "wa-paper")
BASELINES = ("lru", "fifo", "s3fifo")

# Each ablation turns one addition off (or changes one knob) against the defaults.
ABLATIONS: dict[str, dict] = {
    "default": {},
    # The defaults before issue 3's large-cache fix (spatial added at 0.05, prefix
    # cascade, signature slots on), to show what the fix changed.
    "previous-defaults": {"weights": {"spatial": 0.05, "spatial_mode": "add"}, "protect_prefix": "cascade",
                          "signature": {"enabled": True}},
    "no-rhythm": {"rhythm": {"enabled": False}},
    "no-topic-switch": {"topic_switch": {"enabled": False}},
    "signature-on": {"signature": {"enabled": True}},
    "no-shared-class": {"shared_class": False},
    "prefix-cascade": {"protect_prefix": "cascade"},
    "prefix-off": {"protect_prefix": "off"},
    "no-spatial": {"weights": {"spatial": 0.0}},
    "spatial-add-0.05": {"weights": {"spatial": 0.05, "spatial_mode": "add"}},
    "spatial-0.1": {"weights": {"spatial": 0.1}},
    "spatial-1.0": {"weights": {"spatial": 1.0}},
    "lifetime-0.2": {"weights": {"lifetime": 0.2}},
    "issue-weights-0.5/0.3/0.2": {"weights": {"reuse": 0.5, "spatial": 0.3, "lifetime": 0.2}},
    "position-classes-2": {"position_classes": 2},
    "no-fallback": {"fallback": {"enabled": False}},
    "life-auto": {"life_s": None},
    # The blog's advice for multimodal batches: a FIFO class for image requests.
    "fifo-image": {"overrides": {"image": "fifo"}},
}


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def make_traces(trace_dir: Path, duration: float, rate: float, seeds: list[int]) -> list[Path]:
    from engine import synth

    trace_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for profile in ("to-c", "to-b", "mixed"):
        for seed in seeds:
            path = trace_dir / f"{profile}_d{int(duration)}_r{rate:g}_s{seed}.jsonl"
            if not path.exists():
                synth.write_trace(synth.synthesize(profile, duration, rate, seed), path)
            paths.append(path)
    return paths


_TRACES: dict[str, object] = {}


def _trace(path: str):
    from engine.replay import future_accesses
    from engine.traces import load_trace

    if path not in _TRACES:
        trace = load_trace(path)
        _TRACES[path] = (trace, trace.unique_blocks(), future_accesses(trace))
    return _TRACES[path]


def run_one(job: tuple) -> dict:
    """One replay: (trace path, policy, fraction, config update, label)."""
    from engine.replay import replay

    path, policy, fraction, update, label = job
    trace, unique, future = _trace(path)
    capacity = max(1, round(fraction * unique))
    cache = CacheConfig(workload_aware=WorkloadAwareConfig.model_validate(update))
    start = time.perf_counter()
    result = replay(trace, policy, capacity, cache, unique_blocks=unique,
                    future=future if policy == "belady" else None)
    return {
        "trace": Path(path).name, "policy": policy, "label": label, "fraction": fraction,
        "capacity": capacity, "hit_ratio": result.hit_ratio, "accesses": result.accesses,
        "accesses_per_s": result.accesses_per_s, "eviction_us_p50": result.eviction_us_p50,
        "seconds": time.perf_counter() - start,
    }


def spike_minutes(job: tuple) -> dict:
    """Hit ratio inside and outside the spike minutes of a trace, for one policy."""
    from engine.block_pool import BlockPool

    path, policy, fraction, update, label = job
    trace, unique, _ = _trace(path)
    capacity = max(1, round(fraction * unique))
    cache = CacheConfig(workload_aware=WorkloadAwareConfig.model_validate(update))
    arrivals: dict[int, int] = {}
    for request in trace.requests:
        minute = int(request.timestamp // 60)
        arrivals[minute] = arrivals.get(minute, 0) + 1
    median = statistics.median(arrivals.values())
    spikes = {m for m, n in arrivals.items() if n > 2 * median}
    pool = BlockPool(capacity, 0, policy, cache)
    counts = {"spike": [0, 0], "other": [0, 0]}
    for request in trace.requests:
        ctx, now = request.context, request.timestamp
        blocks, hits = pool.touch_or_insert(request.keys, ctx, now)
        bucket = counts["spike" if int(now // 60) in spikes else "other"]
        bucket[0] += hits
        bucket[1] += len(request.keys)
        blocks.reverse()
        pool.release(blocks, ctx, now)
    state = pool.device_policy.state()
    return {
        "trace": Path(path).name, "policy": policy, "label": label, "fraction": fraction,
        "spike_minutes": len(spikes), "minutes": len(arrivals),
        "spike_hit_ratio": counts["spike"][0] / counts["spike"][1] if counts["spike"][1] else None,
        "other_hit_ratio": counts["other"][0] / counts["other"][1] if counts["other"][1] else None,
        "state": {k: v for k, v in state.items() if isinstance(v, (int, float, str, bool)) or v is None},
    }


def _pmap(fn, jobs: list, workers: int) -> list:
    if workers <= 1:
        out = []
        for job in jobs:
            out.append(fn(job))
            print(f"  {out[-1]['trace']} {job[1]} {job[4]} {job[2]}: done", file=sys.stderr, flush=True)
        return out
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(fn, jobs, chunksize=1))


def matrix_tables(rows: list[dict]) -> str:
    lines = []
    by_trace: dict[str, dict] = {}
    for row in rows:
        by_trace.setdefault(row["trace"], {}).setdefault(row["fraction"], {})[row["policy"]] = row
    for trace, fracs in by_trace.items():
        lines.append(f"\n**{trace}**\n")
        lines.append("| capacity | " + " | ".join(POLICIES) + " | wa vs best baseline | wa vs lru |")
        lines.append("|---" * (len(POLICIES) + 3) + "|")
        for fraction in sorted(fracs):
            cells = fracs[fraction]
            values = [cells[p]["hit_ratio"] if p in cells else None for p in POLICIES]
            best = max((cells[p]["hit_ratio"] for p in BASELINES if p in cells), default=None)
            wa = cells.get("wa", {}).get("hit_ratio")
            lru = cells.get("lru", {}).get("hit_ratio")
            gain_best = f"{(wa / best - 1) * 100:+.1f}%" if wa is not None and best else "-"
            gain_lru = f"{(wa / lru - 1) * 100:+.1f}%" if wa is not None and lru else "-"
            cap = next(iter(cells.values()))["capacity"]
            lines.append(f"| {fraction:.0%} ({cap}) | " + " | ".join("-" if v is None else f"{v:.4f}" for v in values)
                         + f" | {gain_best} | {gain_lru} |")
    return "\n".join(lines)


def ablation_table(rows: list[dict]) -> str:
    cells: dict[tuple, dict] = {}
    labels: list[str] = []
    for row in rows:
        cells.setdefault((row["trace"], row["fraction"]), {})[row["label"]] = row["hit_ratio"]
        if row["label"] not in labels:
            labels.append(row["label"])
    lines = ["| trace @ capacity | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for (trace, fraction), values in cells.items():
        base = values.get("default")
        out = []
        for label in labels:
            v = values.get(label)
            if v is None:
                out.append("-")
            elif label == "default" or not base:
                out.append(f"{v:.4f}")
            else:
                out.append(f"{v:.4f} ({(v / base - 1) * 100:+.1f}%)")
        lines.append(f"| {trace} @ {fraction:.0%} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="/tmp/wa_results.json")
    parser.add_argument("--trace-dir", default="/tmp/wa_traces")
    parser.add_argument("--duration", type=float, default=7200.0)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--parts", default="matrix,ablation,spikes")
    parser.add_argument("--ablations", default=",".join(ABLATIONS))
    parser.add_argument("--ablation-fractions", default="0.01,0.1")
    parser.add_argument("--ablation-seeds", default="1")
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--profiles", default="to-c,to-b,mixed")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()

    seeds = [int(s) for s in args.seeds.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    policies = args.policies.split(",")
    parts = set(args.parts.split(","))
    profiles = args.profiles.split(",")
    synth_paths = [p for p in make_traces(Path(args.trace_dir), args.duration, args.rate, seeds)
                   if p.name.split("_d")[0] in profiles]
    traces = ([] if args.no_mooncake else [MOONCAKE]) + synth_paths
    out: dict = {"args": vars(args), "matrix": [], "ablation": [], "spikes": []}
    start = time.perf_counter()
    if "matrix" in parts:
        jobs = [(str(t), p, f, {}, "default") for t in traces for f in fractions for p in policies]
        out["matrix"] = _pmap(run_one, jobs, args.jobs)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print("## Hit ratio matrix (default config)\n" + matrix_tables(out["matrix"]), flush=True)
    if "ablation" in parts:
        ab_seeds = {int(s) for s in args.ablation_seeds.split(",")}
        ab_traces = ([] if args.no_mooncake else [MOONCAKE]) + [
            p for p in synth_paths if int(p.stem.rsplit("_s", 1)[1]) in ab_seeds]
        ab_fracs = [float(f) for f in args.ablation_fractions.split(",")]
        names = args.ablations.split(",")
        jobs = [(str(t), "wa", f, ABLATIONS[n], n) for t in ab_traces for f in ab_fracs for n in names]
        out["ablation"] = _pmap(run_one, jobs, args.jobs)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print("\n## Ablation (wa, one change at a time; relative to default)\n" + ablation_table(out["ablation"]),
              flush=True)
    if "spikes" in parts:
        tob = [p for p in synth_paths if p.name.startswith("to-b")]
        jobs = [(str(t), pol, f, upd, label) for t in tob for f in (0.01, 0.02)
                for pol, upd, label in (("lru", {}, "lru"), ("wa", {}, "wa"),
                                        ("wa", {"rhythm": {"enabled": False}}, "wa-no-rhythm"))]
        out["spikes"] = _pmap(spike_minutes, jobs, args.jobs)
        print("\n## to-B spike minutes\n\n| trace @ capacity | policy | spike minutes | hit ratio in spikes | elsewhere |")
        print("|---|---|---|---|---|")
        def ratio(value: float | None) -> str:
            return "-" if value is None else f"{value:.4f}"  # no block looked up in such minutes

        for row in out["spikes"]:
            print(f"| {row['trace']} @ {row['fraction']:.0%} | {row['label']} | {row['spike_minutes']}/{row['minutes']}"
                  f" | {ratio(row['spike_hit_ratio'])} | {ratio(row['other_hit_ratio'])} |")
    out["seconds"] = time.perf_counter() - start
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
