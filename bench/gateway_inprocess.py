"""Gateway CPU per request without sockets: aiohttp's protocol fed from a fake transport.

    .venv/bin/python bench/gateway_inprocess.py [--requests 6400] [--concurrency 1,64] [--profile OUT.txt]
    .venv/bin/python bench/gateway_inprocess.py --instructions [--concurrency 1,64]

bench/gateway.py measures over loopback, where the kernel, the scheduler and
the client process move the figures from run to run.  This drives the same
two apps (the full gateway over ``InstantBenchEngine`` and the bare handler)
through aiohttp's own HTTP protocol object, writing into
``RecordingTransportBenchFixture`` instead of a socket, so what is left is
the Python work per request: steadier, for comparing changes to the request
path.  It is not the overhead target's measurement (bench/gateway.py is).

Prints the best and the median of several rounds, in microseconds of this
process's CPU time per request.

``--instructions`` counts instead of timing: each contender runs under
valgrind's callgrind at two request counts, and the difference over the
extra requests is the instructions per request.  Slow (a minute or two per
level) but the same on every run, whatever else the machine is doing; use it
to judge a change to the request path when timings drift.  Instructions are
not time: the gateway runs at a lower rate per instruction than the bare
handler (more code and data per request for the caches).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, whatever else has it: bench/gateway.py would shadow the gateway package

from aiohttp import web  # noqa: E402

from bench.gateway import REQUEST, _servers, profiled, write_json  # noqa: E402
from gateway.config import LimitsConfig  # noqa: E402
from gateway.http_protocol import KvgateRunner  # noqa: E402

_END_OF_CHUNKED = b"0\r\n\r\n"


class RecordingTransportBenchFixture(asyncio.Transport):
    """A transport that keeps what is written and resolves ``done`` at the end of a chunked response."""

    def __init__(self) -> None:
        super().__init__()
        self.done: asyncio.Future | None = None

    def write(self, data) -> None:
        if bytes(data).endswith(_END_OF_CHUNKED) and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def _measure(app: web.Application, raw: bytes, concurrency: int, requests: int, rounds: int) -> list[float]:
    # The protocol kvgate serves with (gateway/http_protocol.py), for both contenders, as bench/gateway.py.
    runner = KvgateRunner(app, header_timeout_s=LimitsConfig().header_timeout_s, handler_cancellation=True,
                          access_log=None)
    await runner.setup()
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(concurrency):
        protocol, transport = runner.server(), RecordingTransportBenchFixture()
        protocol.connection_made(transport)
        conns.append((protocol, transport))

    async def one(protocol, transport) -> None:
        transport.done = loop.create_future()
        protocol.data_received(raw)
        await transport.done

    async def wave() -> None:
        await asyncio.gather(*(one(p, t) for p, t in conns))

    waves = max(1, requests // concurrency)
    for _ in range(max(1, 200 // concurrency)):
        await wave()  # warm-up
    per_request = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(waves):
            await wave()
        per_request.append((time.process_time() - start) / (waves * concurrency) * 1e6)
    for protocol, _ in conns:
        protocol.connection_lost(None)
    return per_request


def _raw_request() -> bytes:
    body = json.dumps(REQUEST).encode()
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _main(levels: list[int], requests: int, rounds: int, profile: str | None) -> dict:
    gateway, bare_server, _engines, _served = await _servers()
    raw = _raw_request()
    results = {}
    try:
        for c in levels:
            bare = await _measure(bare_server.runner.app, raw, c, requests, rounds)
            with profiled(profile if c == levels[-1] else None, interval=0.0002):
                gw = await _measure(gateway.runner.app, raw, c, requests, rounds)
            results[str(c)] = {"gateway_us": {"best": round(min(gw), 1), "median": round(statistics.median(gw), 1)},
                               "bare_us": {"best": round(min(bare), 1), "median": round(statistics.median(bare), 1)}}
            print(f"c={c:>3}: gateway best {min(gw):6.1f} us median {statistics.median(gw):6.1f} us | "
                  f"bare best {min(bare):5.1f} us median {statistics.median(bare):5.1f} us | "
                  f"best/best {min(bare) / min(gw):.2f}", flush=True)
    finally:
        await gateway.stop()
        await bare_server.stop()
    return results


async def _run_only(which: str, concurrency: int, requests: int) -> None:
    """One pass of ``requests`` through one contender, for counting its instructions."""
    gateway, bare_server, _engines, _served = await _servers()
    try:
        app = (gateway if which == "gateway" else bare_server).runner.app
        await _measure(app, _raw_request(), concurrency, requests, 1)
    finally:
        await gateway.stop()
        await bare_server.stop()


def _callgrind_instructions(which: str, concurrency: int, requests: int) -> int:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, os.path.abspath(__file__),
           "--only", which, "--concurrency", str(concurrency), "--requests", str(requests)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(f"no instruction count from callgrind: {done.stderr[-500:]}")
    return int(match.group(1))


def _instructions(levels: list[int], requests: int) -> dict:
    """Instructions per request of each contender: (count at ``requests`` - count at
    one wave) / the requests between them.  Start-up and warm-up cancel out."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    results = {}
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        for c in levels:
            waves = max(2, requests // c)
            runs = {(which, w): pool.submit(_callgrind_instructions, which, c, w * c)
                    for which in ("gateway", "bare") for w in (1, waves)}
            per = {which: (runs[which, waves].result() - runs[which, 1].result()) / ((waves - 1) * c)
                   for which in ("gateway", "bare")}
            results[str(c)] = {"gateway_instructions": round(per["gateway"]), "bare_instructions": round(per["bare"])}
            print(f"c={c:>3}: gateway {per['gateway'] / 1e3:6.0f}k instructions/request | bare {per['bare'] / 1e3:6.0f}k | "
                  f"bare/gateway {per['bare'] / per['gateway']:.2f}", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,64", help="comma-separated connection counts")
    parser.add_argument("--requests", type=int, help="requests per round (default 6400; 1280 with --instructions)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", metavar="OUT.txt", help="pyinstrument profile of the last gateway level")
    parser.add_argument("--json", metavar="OUT", help="write results as JSON")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per request under valgrind instead of timing (default 1280 requests)")
    parser.add_argument("--only", choices=("gateway", "bare"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    if args.only:
        asyncio.run(_run_only(args.only, levels[0], args.requests))
        return 0
    if args.instructions:
        results = _instructions(levels, args.requests or 1280)
    else:
        results = asyncio.run(_main(levels, args.requests or 6400, args.rounds, args.profile))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
