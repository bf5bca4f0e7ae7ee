"""A /kv_events snapshot's cost: JSON arrays of keys against packed keys and a sliced index build.

    python bench/kv_snapshot.py [--keys 100000,1000000] [--repeat 3] [--json OUT]

A gateway (re)connecting to a `kvgate engine` reads a snapshot of every block
the engine holds.  Both ends do that work on their event loop, so what matters
is how long the loop is held in one piece: on the engine, every stream it is
serving waits; on the gateway, every request.  For each snapshot size this
measures both ways side by side, in one process:

* arrays: the engine json-encodes its keys as arrays of integers, the gateway
  parses them and indexes them at once (``ExactIndex.reset``), as before;
* packed: the engine packs each tier (``kv_wire.pack_keys``), the gateway
  unpacks and indexes in slices (``ExactIndex.rebuild``), other tasks running between.

Engine: encode time (one piece) and the frame's bytes.  Gateway: the whole
time from frame to index, and the longest stretch in it that no other task
could run (a ticker task measures the gaps between its turns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loop_watch import LoopWatch  # noqa: E402
from gateway import kv_wire  # noqa: E402
from gateway.router import ExactIndex  # noqa: E402


def _snapshot(keys: list[int]) -> dict:
    # Mostly device blocks, a host tier behind them, as an engine with offloading holds.
    split = len(keys) * 4 // 5
    return {"seq": 1, "model": "bench", "keys": {"device": keys[:split], "host": keys[split:]}, "draining": False}


def _encode(snapshot: dict, packed: bool) -> tuple[bytes, float]:
    start = time.perf_counter()
    if packed:
        snapshot = {**snapshot, "keys": {tier: kv_wire.pack_keys(keys) for tier, keys in snapshot["keys"].items()},
                    "keys_format": kv_wire.PACKED_KEYS}
    frame = json.dumps(snapshot).encode()
    return frame, time.perf_counter() - start


async def _index(frame: bytes, packed: bool) -> tuple[float, float]:
    """(seconds from frame to index, the longest the loop was held in that time)."""
    async with LoopWatch() as watch:
        start = time.perf_counter()
        index = ExactIndex()
        data = json.loads(frame)
        if packed:
            await index.rebuild(kv_wire.held_from_snapshot(data))
        else:
            index.reset(data["keys"])
        elapsed = time.perf_counter() - start
    return elapsed, watch.longest


def measure(n: int, repeat: int) -> dict:
    keys = [random.getrandbits(64) for _ in range(n)]
    snapshot = _snapshot(keys)
    out = {"keys": n}
    exact = {}  # unrounded: the ratios are of these (at small sizes the rounded figures are 0)
    for name, packed in (("arrays", False), ("packed", True)):
        runs = []
        for _ in range(repeat):
            frame, encode_s = _encode(snapshot, packed)
            total_s, held_s = asyncio.run(_index(frame, packed))
            runs.append((encode_s, total_s, held_s, len(frame)))
        exact[name] = (statistics.median(r[0] for r in runs), runs[0][3], statistics.median(r[2] for r in runs))
        out[name] = {
            "engine_encode_ms": round(exact[name][0] * 1000, 1),
            "frame_mb": round(runs[0][3] / 1e6, 2),
            "gateway_total_ms": round(statistics.median(r[1] for r in runs) * 1000, 1),
            "gateway_loop_held_ms": round(exact[name][2] * 1000, 1),
        }
    a, p = exact["arrays"], exact["packed"]
    out["ratios"] = {
        what: round(p[i] / a[i], 3) if a[i] else None
        for i, what in enumerate(("engine_encode", "frame_bytes", "gateway_loop_held"))
    }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="100000,1000000", help="comma-separated snapshot sizes")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size and format (medians reported)")
    parser.add_argument("--json", metavar="OUT", help="write results as JSON")
    args = parser.parse_args(argv)
    random.seed(1)
    results = []
    for n in (int(k) for k in args.keys.split(",")):
        r = measure(n, args.repeat)
        results.append(r)
        for name in ("arrays", "packed"):
            m = r[name]
            print(f"{n:>9,} keys {name:>6}: engine encode {m['engine_encode_ms']:7.1f} ms, frame {m['frame_mb']:6.2f} MB | "
                  f"gateway {m['gateway_total_ms']:7.1f} ms, loop held at most {m['gateway_loop_held_ms']:6.1f} ms")
        print(f"{n:>9,} keys  packed/arrays: engine encode {r['ratios']['engine_encode']:.2f}, bytes "
              f"{r['ratios']['frame_bytes']:.2f}, gateway loop held {r['ratios']['gateway_loop_held']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "kv_events snapshot: arrays vs packed + sliced index build", "results": results}, f,
                      indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
