"""Routing on the exact index at scale: one map per replica against one fleet-wide map.

    python bench/router_index.py [--replicas 8,32] [--keys 100000,1000000] [--prompt 256,2048] [--json OUT]

A gateway in front of many `kvgate engine` replicas keeps every block key each
one holds, from its KV events, and asks all of them, for every request, how
much of the prompt they hold.  Two layouts, side by side, each fleet size built
in a child process per contender (so that its memory growth is its own):

* per-replica maps (``PerReplicaMapsBaseline``, a benchmark fixture: the layout
  the gateway had before the fleet map, one dict of key -> tier bits per
  replica, each matched in turn);
* the fleet map (the gateway's ``ExactIndex`` slots on one ``FleetIndex``,
  matched in one pass: ``FleetIndex.match_all``).

Each replica holds ``keys`` random 64-bit keys, distinct between replicas (the
fleet map's worst case for memory: nothing to share), plus the prompt's.
Measured per cell:

* ``Router.choose`` for a prompt every replica holds whole (the worst case: every
  replica's run is the whole prompt) and for one nobody holds, median of repeats;
* memory: the process's RSS growth over building the index (the key ints
  included), per held block;
* re-indexing one replica from a snapshot of ``keys`` keys as a follower does
  (``rebuild`` on a running loop): until the new index routes, until the old
  one is reclaimed (the fleet map sweeps the replica's old slot out), and the
  longest stretch the loop was held;
* applying events of 16 keys (stored then removed), per event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loop_watch import LoopWatch  # noqa: E402
from gateway import router  # noqa: E402
from gateway.config import RouterConfig  # noqa: E402
from gateway.router import ExactIndex, FleetIndex, Router  # noqa: E402

CONTENDERS = ("per-replica", "fleet")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class PerReplicaMapsBaseline:
    """Benchmark fixture: one dict per replica, the layout before the fleet map."""

    __slots__ = ("tiers",)

    def __init__(self) -> None:
        self.tiers: dict[int, int] = {}

    # The same probe of its own dict as the gateway's ExactIndex.match (which also still has one).
    match = ExactIndex.match

    def apply(self, kind: str, keys: Sequence[int], tier: str) -> None:
        bit, tiers = router._TIER_BITS[tier], self.tiers
        for key in keys:
            if kind == "stored":
                tiers[key] = tiers.get(key, 0) | bit
            elif left := tiers.get(key, 0) & ~bit:
                tiers[key] = left
            else:
                tiers.pop(key, None)

    def reset(self, held: dict[str, Sequence[int]]) -> None:
        self.tiers = {}
        for tier, keys in held.items():
            self.apply("stored", keys, tier)

    async def rebuild(self, held: dict[str, Sequence[int]]) -> None:
        tiers: dict[int, int] = {}
        for tier, keys in held.items():
            for start in range(0, len(keys), router._REBUILD_SLICE):
                tiers.update(dict.fromkeys(keys[start:start + router._REBUILD_SLICE], router._TIER_BITS[tier]))
                await asyncio.sleep(0)
        self.tiers = tiers


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


async def _reindex(index, held: dict[str, list[int]], fleet: FleetIndex | None) -> dict:
    """Rebuild ``index`` from ``held`` on this loop: time to routable, to reclaimed, longest hold."""
    async with LoopWatch() as watch:
        start = time.perf_counter()
        await index.rebuild(held)
        routable = time.perf_counter() - start
        while fleet is not None and fleet._sweeper is not None and not fleet._sweeper.done():
            await asyncio.sleep(0)
        reclaimed = time.perf_counter() - start
    return {"routable_ms": routable * 1e3, "reclaimed_ms": reclaimed * 1e3, "loop_held_ms": watch.longest * 1e3}


def run_cell(contender: str, replicas: int, keys: int, prompts: list[int], repeat: int) -> dict:
    rng = random.Random(1)
    prompt = [rng.getrandbits(64) for _ in range(max(prompts))]
    missing = [rng.getrandbits(64) for _ in range(max(prompts))]
    # The key objects count: a replica's keys arrive as its own ints (parsed from its events).
    before = _rss()
    fleet = FleetIndex() if contender == "fleet" else None
    indexes = [ExactIndex(fleet) if fleet else PerReplicaMapsBaseline() for _ in range(replicas)]
    build_s = 0.0
    for i, index in enumerate(indexes):
        held = [rng.getrandbits(64) for _ in range(keys)]
        start = time.perf_counter()
        index.reset({"device": held + prompt})
        build_s += time.perf_counter() - start
        if i == 0:
            first = held
    del held
    grown = _rss() - before - 8 * keys  # less the list of the first replica's keys, kept for below
    r = Router(RouterConfig(), [f"r{i}" for i in range(replicas)], 16)
    healthy = [True] * replicas
    out = {"contender": contender, "replicas": replicas, "keys": keys, "build_s": round(build_s, 2),
           "bytes_per_block": round(grown / (replicas * (keys + len(prompt)))), "choose_us": {}}
    for blocks in prompts:
        assert r.choose(prompt[:blocks], indexes, healthy).matched_blocks == blocks
        out["choose_us"][f"held_{blocks}"] = round(_median_us(lambda: r.choose(prompt[:blocks], indexes, healthy), repeat), 1)
        out["choose_us"][f"missed_{blocks}"] = round(_median_us(lambda: r.choose(missing[:blocks], indexes, healthy), repeat), 1)
    events = [first[i:i + 16] for i in range(0, min(keys, 16 * 2000), 16)]
    start = time.perf_counter()
    for event in events:
        indexes[0].apply("removed", event, "device")
    for event in events:
        indexes[0].apply("stored", event, "device")
    out["apply_us_per_event"] = round((time.perf_counter() - start) / (2 * len(events)) * 1e6, 2)
    snapshot = {"device": first[: keys * 4 // 5] + prompt, "host": first[keys * 4 // 5:]}
    out["reindex"] = {k: round(v, 1) for k, v in asyncio.run(_reindex(indexes[0], snapshot, fleet)).items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="8,32")
    ap.add_argument("--keys", default="100000,1000000", help="keys each replica holds (besides the prompt's)")
    ap.add_argument("--prompt", default="256,2048", help="prompt lengths in blocks")
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # a child process: one contender, one size
    args = ap.parse_args()
    prompts = [int(x) for x in args.prompt.split(",")]
    if args.cell:
        contender, replicas, keys = args.cell.split(":")
        print(json.dumps(run_cell(contender, int(replicas), int(keys), prompts, args.repeat)))
        return
    results = []
    for replicas in (int(x) for x in args.replicas.split(",")):
        for keys in (int(x) for x in args.keys.split(",")):
            cells = {}
            for contender in CONTENDERS:
                done = subprocess.run([sys.executable, __file__, "--cell", f"{contender}:{replicas}:{keys}",
                                       "--prompt", args.prompt, "--repeat", str(args.repeat)],
                                      check=True, capture_output=True, text=True)
                cells[contender] = json.loads(done.stdout)
                results.append(cells[contender])
            old, new = cells["per-replica"], cells["fleet"]
            print(f"{replicas} replicas x {keys:,} keys:")
            for name in old["choose_us"]:
                a, b = old["choose_us"][name], new["choose_us"][name]
                print(f"  choose, prompt {name:>12}: per-replica {a:>9.1f} us  fleet {b:>8.1f} us  ratio {b / a:.3f}")
            print(f"  bytes per held block:    per-replica {old['bytes_per_block']:>6}  fleet {new['bytes_per_block']:>6}")
            print(f"  apply, us per event:     per-replica {old['apply_us_per_event']:>6}  fleet {new['apply_us_per_event']:>6}")
            for name in ("routable_ms", "reclaimed_ms", "loop_held_ms"):
                print(f"  re-index one replica, {name:>12}: per-replica {old['reindex'][name]:>8.1f}  "
                      f"fleet {new['reindex'][name]:>8.1f}")
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
