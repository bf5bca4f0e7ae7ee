"""Gateway overhead: the full gateway vs a bare aiohttp handler sending the same SSE bytes.

    .venv/bin/python bench/gateway.py --json /tmp/gateway_bench.json

Both servers run in this process, on loopback, over ``InstantBenchEngine``
(bench/instant_engine.py: answers instantly), so the difference is what the
gateway adds per request: parsing, validation, tokenising, classifying,
hashing, routing, in-flight accounting, metrics and SSE shaping.  The bare
handler reads the body and writes the SSE bytes the gateway produced for the
same request, as one chunked stream like the gateway's.

The load comes from a separate client process (this file with --client):
a raw HTTP/1.1 keep-alive client on asyncio streams, C connections each
sending requests back to back, so the client costs a few microseconds per
request and is not the bottleneck (the aiohttp client costs more than the
bare server).  Each phase is bounded by a request count and a time limit.

Per concurrency, the JSON holds gateway_rps, bare_rps, added_p50_ms and
added_p99_ms (gateway latency percentile minus the bare one, measured by the
client from the first byte sent to the last byte read), and each server's CPU
time per request (``server_cpu_us``: this process's CPU time over the requests
it served in the phase), which other load on the machine disturbs far less
than throughput.  With two or more CPUs the servers are pinned to CPU 0 and
the client to CPU 1.

The instant engine has every token ready at once, so each choice reaches the
gateway as one output (as AsyncEngine hands over a backlog the gateway has not
taken yet) and leaves as one SSE delta: this measures the per-request cost.
With an engine pacing its tokens each token is its own frame.

On loopback a server's send also runs the receiving side's TCP work and, when
the client sleeps in epoll, its wake-up (an inter-processor interrupt, dear in
a VM), all charged to the server's CPU.  A client waiting on a slower server
sleeps more, so the slower contender pays more of this than it would with
clients on other machines: perf put 12% of the gateway phase in that wake-up
and next to none of the bare phase (bench/RESULTS.md).  ``--client-poll``
keeps the client's loop polling so that no send has to wake it, for both
contenders alike; the default keeps an ordinary sleeping client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, whatever else has it: bench/gateway.py would shadow the gateway package

MODEL = "bench-model"
REQUEST = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "max_tokens": 8,
    "stream": True,
}


# ----------------------------------------------------------------------------- client (own process)


async def _worker(host: str, port: int, raw: bytes, stop_at: float, budget: list[int], lat: list[float]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    perf = time.perf_counter
    try:
        while budget[0] > 0 and perf() < stop_at:
            budget[0] -= 1
            t0 = perf()
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"bad response: {head[:80]!r}")
            lower = head.lower()
            if b"transfer-encoding: chunked" in lower:
                while True:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    if size == 0:
                        await reader.readline()
                        break
                    await reader.readexactly(size + 2)
            else:
                start = lower.index(b"content-length:") + 15
                length = int(lower[start:lower.index(b"\r\n", start)])
                await reader.readexactly(length)
            lat.append(perf() - t0)
    finally:
        writer.close()


async def _keep_polling() -> None:
    """Keeps this client's event loop from sleeping (its selector polls with no
    timeout while this runs), see --client-poll."""
    while True:
        await asyncio.sleep(0)


async def _client(url: str, concurrency: int, requests: int, seconds: float, poll: bool = False) -> dict:
    poller = asyncio.ensure_future(_keep_polling()) if poll else None
    host, port = url.split("//")[1].split(":")
    body = json.dumps(REQUEST).encode()
    raw = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    lat: list[float] = []
    budget = [requests]
    # Warm-up: connections, caches, the allocator.
    await asyncio.gather(*(_worker(host, int(port), raw, time.perf_counter() + 1, [20], []) for _ in range(concurrency)))
    start = time.perf_counter()
    await asyncio.gather(*(_worker(host, int(port), raw, start + seconds, budget, lat) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    if poller is not None:
        poller.cancel()
    lat.sort()
    return {
        "requests": len(lat),
        "seconds": elapsed,
        "rps": len(lat) / elapsed,
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "mean_ms": statistics.fmean(lat) * 1e3,
    }


# ----------------------------------------------------------------------------- servers (this process)


async def _servers():
    from aiohttp import web

    from bench.instant_engine import InstantBenchEngine
    from gateway.app import create_app
    from gateway.config import KvgateConfig
    from gateway.replicas import InProcessReplica
    from gateway.server import start_server

    engines = [InstantBenchEngine(MODEL), InstantBenchEngine(MODEL)]
    bare_served = [0]
    gw_app = create_app(KvgateConfig(), [InProcessReplica(f"r{i}", engine=e) for i, e in enumerate(engines)])
    gateway = await start_server(gw_app)
    # The bytes the gateway sends for the request, captured once.
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(gateway.url + "/v1/chat/completions", json=REQUEST) as resp:
            assert resp.status == 200, await resp.text()
            sse = await resp.read()

    async def bare(request: web.Request) -> web.StreamResponse:
        bare_served[0] += 1
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(sse)
        await resp.write_eof()
        return resp

    bare_app = web.Application()
    bare_app.router.add_post("/v1/chat/completions", bare)
    bare_server = await start_server(bare_app)
    return gateway, bare_server, engines, bare_served


# With two or more CPUs the servers run on CPU 0 and the client on CPU 1, for
# both contenders alike: the scheduler then never puts them on one core, which
# would charge the client's work to whichever server is measured.
PIN = hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2


async def _run_client(url: str, concurrency: int, requests: int, seconds: float, poll: bool = False) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.abspath(__file__), "--client", url, "--concurrency", str(concurrency),
        "--requests", str(requests), "--seconds", str(seconds), *(["--client-poll"] if poll else []),
        stdout=asyncio.subprocess.PIPE,
    )
    if PIN:
        os.sched_setaffinity(proc.pid, {1})
    out, _ = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"client failed ({proc.returncode})")
    return json.loads(out)


@contextlib.contextmanager
def profiled(path: str | None, interval: float = 0.001):
    """A pyinstrument profile of the block written to ``path`` (None: no profiling)."""
    if not path:
        yield
        return
    from pyinstrument import Profiler

    profiler = Profiler(interval=interval, async_mode="disabled")
    profiler.start()
    try:
        yield
    finally:
        profiler.stop()
        with open(path, "w") as f:
            f.write(profiler.output_text(unicode=False, color=False, show_all=False))


async def _phase(url: str, served, c: int, requests: int, seconds: float, poll: bool) -> dict:
    """One client run against one server, with that server's CPU per request: this
    process's CPU time over every request it served (warm-up included)."""
    cpu0, n0 = time.process_time(), served()
    result = await _run_client(url, c, requests, seconds, poll)
    result["server_cpu_us"] = (time.process_time() - cpu0) / (served() - n0) * 1e6
    return result


async def _bench(levels: list[int], requests: int, seconds: float, profile: str | None, repeat: int, poll: bool) -> dict:
    if PIN:
        os.sched_setaffinity(0, {0})
    gateway, bare_server, engines, bare_served = await _servers()
    gateway_served = lambda: sum(e.served for e in engines)  # noqa: E731
    results = {}
    try:
        for c in levels:
            runs = []
            for attempt in range(repeat):
                # Alternating bare and gateway phases, so that drifting load on the
                # machine touches both alike; the medians are reported.
                bare = await _phase(bare_server.url, lambda: bare_served[0], c, requests, seconds, poll)
                last = c == levels[-1] and attempt == repeat - 1
                with profiled(profile if last else None):
                    gw = await _phase(gateway.url, gateway_served, c, requests, seconds, poll)
                runs.append({"gateway": gw, "bare": bare})
                print(f"c={c:>3}: gateway {gw['rps']:8.0f} rps p50 {gw['p50_ms']:.2f} ms p99 {gw['p99_ms']:.2f} ms | "
                      f"bare {bare['rps']:8.0f} rps p50 {bare['p50_ms']:.2f} ms p99 {bare['p99_ms']:.2f} ms | "
                      f"ratio {gw['rps'] / bare['rps']:.2f} added p50 {gw['p50_ms'] - bare['p50_ms']:.3f} ms | "
                      f"server CPU/request gateway {gw['server_cpu_us']:.0f} us, bare {bare['server_cpu_us']:.0f} us",
                      file=sys.stderr, flush=True)

            def median(side: str, key: str) -> float:
                return statistics.median(run[side][key] for run in runs)

            results[str(c)] = {
                "concurrency": c,
                "gateway_rps": round(median("gateway", "rps"), 1),
                "bare_rps": round(median("bare", "rps"), 1),
                "rps_ratio": round(statistics.median(r["gateway"]["rps"] / r["bare"]["rps"] for r in runs), 3),
                "added_p50_ms": round(statistics.median(r["gateway"]["p50_ms"] - r["bare"]["p50_ms"] for r in runs), 3),
                "added_p99_ms": round(statistics.median(r["gateway"]["p99_ms"] - r["bare"]["p99_ms"] for r in runs), 3),
                "gateway_cpu_us_per_request": round(median("gateway", "server_cpu_us"), 1),
                "bare_cpu_us_per_request": round(median("bare", "server_cpu_us"), 1),
                "runs": runs,
            }
    finally:
        await gateway.stop()
        await bare_server.stop()
    return results


def write_json(path: str, payload) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="write results as JSON")
    parser.add_argument("--concurrency", default="1,64,256", help="comma-separated levels (client: one level)")
    parser.add_argument("--requests", type=int, default=20000, help="most requests per phase")
    parser.add_argument("--seconds", type=float, default=6.0, help="most seconds per phase")
    parser.add_argument("--profile", metavar="OUT.txt", help="pyinstrument profile of the last gateway phase")
    parser.add_argument("--repeat", type=int, default=1, help="runs per concurrency (medians are reported)")
    parser.add_argument("--client-poll", action="store_true",
                        help="the client polls instead of sleeping between responses (see the module notes)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                        help="the servers' event loop, both alike (kvgate serve's default: uvloop)")
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(_client(args.client, int(args.concurrency), args.requests, args.seconds, args.client_poll))))
        return 0
    import logging

    logging.basicConfig(level=logging.WARNING)
    levels = [int(x) for x in args.concurrency.split(",")]
    from gateway.server import run_on_event_loop

    results = run_on_event_loop(_bench(levels, args.requests, args.seconds, args.profile, max(1, args.repeat),
                                       args.client_poll), args.loop)
    payload = {
        "what": "full gateway vs bare aiohttp handler, same SSE bytes, InstantBenchEngine, loopback",
        "client": "separate process, raw HTTP/1.1 keep-alive over asyncio streams"
                  + (", polling (never sleeps)" if args.client_poll else ""),
        "event_loop": args.loop,
        "cpus": os.cpu_count(),
        "pinned": "servers on CPU 0, client on CPU 1" if PIN else "no",
        "python": sys.version.split()[0],
        "results": results,
    }
    if args.json:
        write_json(args.json, payload)
    print(json.dumps({c: {k: r[k] for k in ("gateway_rps", "bare_rps", "added_p50_ms", "added_p99_ms")}
                      for c, r in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
