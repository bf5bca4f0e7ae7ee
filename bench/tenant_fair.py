"""One tenant's many-choice requests against another's short ones: engine.scheduling_policy
tenant-fair against fcfs, through the real gateway and engine.

    python bench/tenant_fair.py --json OUT [--model PATH] [--seconds 40] [--heavy 8]

Tenant "heavy" keeps ``--heavy`` (8) streaming completions of n=8 choices in flight
(32 new tokens each, EOS ignored); tenant "light" sends one short streaming
completion (4 new tokens) after another, 0.3 s apart.  Both go through a
gateway with one in-process engine (max_num_seqs 16), each tenant with its API
key.  For each policy, one after the other in this process: the light
requests' time to first token (p50, p90, max) and how many finished, and the
heavy requests' end-to-end latency and count, then the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig, ModelConfig  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.config import ApiKeyConfig, KvgateConfig, ServerConfig  # noqa: E402
from gateway.server import start_server  # noqa: E402
from gateway.stats import percentile  # noqa: E402

POLICIES = ("fcfs", "tenant-fair")


async def _stream(session: aiohttp.ClientSession, url: str, key: str, body: dict) -> tuple[float, float]:
    """(time to the first text, end to end) of one streamed completion."""
    start = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                if any(choice.get("text") for choice in json.loads(line[6:]).get("choices", ())):
                    first = time.perf_counter() - start
    return (first if first is not None else float("nan")), time.perf_counter() - start


async def _run(policy: str, args: argparse.Namespace) -> dict:
    config = KvgateConfig(
        model=ModelConfig(path=args.model, device="cpu"),
        engine=EngineConfig(scheduling_policy=policy, max_num_seqs=16, device_blocks=512, host_blocks_multiplier=0,
                            threads=args.threads),
        server=ServerConfig(api_keys=[ApiKeyConfig(key="k-heavy", tenant="heavy"),
                                      ApiKeyConfig(key="k-light", tenant="light")]),
    )
    server = await start_server(create_app(config))
    heavy_e2e: list[float] = []
    light_ttft: list[float] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async with session.get(server.url + "/v1/models", headers={"Authorization": "Bearer k-light"}) as resp:
                model = (await resp.json())["data"][0]["id"]
            await _stream(session, server.url, "k-light", {"model": model, "prompt": "Hi", "max_tokens": 2,
                                                           "stream": True})  # warm-up
            deadline = time.perf_counter() + args.seconds

            async def heavy(i: int) -> None:
                k = 0
                while time.perf_counter() < deadline:
                    k += 1
                    body = {"model": model, "prompt": f"Story {i}.{k}: " + "once upon a time " * 20, "max_tokens": 32,
                            "n": 8, "stream": True, "ignore_eos": True, "temperature": 1.0}
                    heavy_e2e.append((await _stream(session, server.url, "k-heavy", body))[1])

            async def light() -> None:
                await asyncio.sleep(2)  # the heavy tenant's queue first
                k = 0
                while time.perf_counter() < deadline:
                    k += 1
                    body = {"model": model, "prompt": f"Question {k}: hello?", "max_tokens": 4, "stream": True,
                            "ignore_eos": True}
                    light_ttft.append((await _stream(session, server.url, "k-light", body))[0])
                    await asyncio.sleep(0.3)

            await asyncio.gather(light(), *(heavy(i) for i in range(args.heavy)))
    finally:
        await server.stop()
    return {
        "light_requests": len(light_ttft),
        "light_ttft_p50_s": round(statistics.median(light_ttft), 4),
        "light_ttft_p90_s": round(percentile(light_ttft, 0.9), 4),
        "light_ttft_max_s": round(max(light_ttft), 4),
        "heavy_requests": len(heavy_e2e),
        "heavy_e2e_p50_s": round(statistics.median(heavy_e2e), 3),
    }


async def _main(args: argparse.Namespace) -> dict:
    results = {}
    for policy in POLICIES:
        results[policy] = r = await _run(policy, args)
        print(f"{policy:12s} light TTFT p50 {r['light_ttft_p50_s']:.3f} s, p90 {r['light_ttft_p90_s']:.3f} s, "
              f"max {r['light_ttft_max_s']:.3f} s ({r['light_requests']} done) | heavy e2e p50 "
              f"{r['heavy_e2e_p50_s']:.2f} s ({r['heavy_requests']} done)", flush=True)
    fcfs, fair = results["fcfs"], results["tenant-fair"]
    print(f"tenant-fair / fcfs: light TTFT p50 {fair['light_ttft_p50_s'] / fcfs['light_ttft_p50_s']:.2f}x, "
          f"light done {fair['light_requests'] / fcfs['light_requests']:.2f}x, "
          f"heavy done {fair['heavy_requests'] / fcfs['heavy_requests']:.2f}x, "
          f"heavy e2e p50 {fair['heavy_e2e_p50_s'] / fcfs['heavy_e2e_p50_s']:.2f}x")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--seconds", type=float, default=40.0, help="traffic per policy")
    parser.add_argument("--heavy", type=int, default=8, help="heavy requests in flight (each n=8: 64 sequences for 16 slots)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", metavar="OUT", help="write results as JSON")
    args = parser.parse_args()
    if args.seconds <= 2:
        parser.error("--seconds: give more than 2 (the light tenant starts 2 s in, after the heavy one's queue)")
    results = asyncio.run(_main(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "light tenant's TTFT beside a heavy tenant's n=8 streams, per scheduling policy",
                       "args": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
