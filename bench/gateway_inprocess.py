"""Gateway CPU per request without sockets: aiohttp's protocol fed from a fake transport.

    .venv/bin/python bench/gateway_inprocess.py [--requests 6400] [--concurrency 1,64] [--profile OUT.txt]

bench/gateway.py measures over loopback, where the kernel, the scheduler and
the client process move the figures from run to run.  This drives the same
two apps (the full gateway over ``InstantBenchEngine`` and the bare handler)
through aiohttp's own HTTP protocol object, writing into
``RecordingTransportBenchFixture`` instead of a socket, so what is left is
the Python work per request: steadier, for comparing changes to the request
path.  It is not the overhead target's measurement (bench/gateway.py is).

Prints the best and the median of several rounds, in microseconds of this
process's CPU time per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from aiohttp import web  # noqa: E402

from bench.gateway import REQUEST, _servers, profiled  # noqa: E402

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
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
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


async def _main(levels: list[int], requests: int, rounds: int, profile: str | None) -> dict:
    gateway, bare_server, _engines, _served = await _servers()
    body = json.dumps(REQUEST).encode()
    raw = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,64", help="comma-separated connection counts")
    parser.add_argument("--requests", type=int, default=6400, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", metavar="OUT.txt", help="pyinstrument profile of the last gateway level")
    parser.add_argument("--json", metavar="OUT", help="write results as JSON")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    results = asyncio.run(_main(levels, args.requests, args.rounds, args.profile))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
