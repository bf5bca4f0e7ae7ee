"""The gateway's request path part by part, each alone in a hot loop, next to whole requests.

    .venv/bin/python bench/gateway_parts.py [--json OUT]

Times each step kvgate adds to a streamed chat request (parse, validate,
template + block keys, classify, route, metrics, observer hooks, the engine
request objects, the fixture engine's answer, SSE shaping) with ``timeit``,
best of five, on the objects of a real gateway app (bench/gateway.py's, over
``InstantBenchEngine``).  Then it measures whole requests through the same
app and the bare handler with bench/gateway_inprocess.py's harness.

The comparison says where the overhead target stands: a part run a hundred
thousand times in a row keeps its code and data in the CPU's caches; in a
real request every part runs once, between aiohttp's own work, and costs
several times more.  The sum of the parts is a floor for what the gateway
adds, the in-situ difference is what it does add.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, whatever else has it: bench/gateway.py would shadow the gateway package

from multidict import CIMultiDict  # noqa: E402

from bench.gateway import _servers, write_json  # noqa: E402
from bench.gateway_inprocess import _measure, _raw_request  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from gateway.app import GATEWAY  # noqa: E402
from gateway.classify import ANONYMOUS  # noqa: E402
from gateway.dispatch import Sub  # noqa: E402
from gateway.observe import Finished  # noqa: E402
from gateway.protocol import new_id, parse_json, parse_request  # noqa: E402
from gateway.shapes import DONE, ChoiceState, StreamFormatter, now_s  # noqa: E402
from gateway.replicas import Job  # noqa: E402
from gateway.usage import UsageSum  # noqa: E402


def _best_us(fn, number: int = 20000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def _drive(coro) -> object:
    """Run a coroutine that never suspends (the instant engine's answer) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the coroutine suspended")


def _parts(gw) -> dict[str, float]:
    raw = _raw_request().split(b"\r\n\r\n", 1)[1]
    body = parse_json(raw)
    parsed = parse_request("chat", body, gw.limits)
    prompt = gw.hasher.chat(parsed.messages, parsed.images)
    headers = CIMultiDict({"Host": "bench", "Content-Type": "application/json", "Content-Length": str(len(raw))})
    ctx = gw.classifier.classify(parsed, ANONYMOUS, headers, len(prompt.token_ids), len(prompt.keys), prompt.token_ids)
    router, metrics, observer, replicas = gw.router, gw.metrics, gw.observer, gw.replicas
    sampling = parsed.sampling
    sampling.max_tokens = 8

    def route():
        decision = router.choose(prompt.keys, [r.index for r in replicas], [r.healthy for r in replicas], ctx.session, [])
        ticket = router.acquire(decision.replica, router.load_tokens(len(prompt.token_ids), 8, 1), prompt.keys,
                                decision.matched_blocks)
        router.release(ticket)

    def record_metrics():
        metrics.decisions.labels("r0", "prefix").inc()
        series = metrics.request_series(ctx.workload, "r0")
        series.predicted_hits.inc(16)
        series.prefix_queries.inc(40)
        series.prefix_hits.inc(32)
        series.queue_time.observe(0.0)
        metrics.requests.labels("chat", ctx.workload, "200").inc()
        series.e2e.observe(0.001)

    def observe():
        observer.first_token(ctx.workload, "r0", 0.001)
        observer.finished(Finished(ctx, "r0", prompt, 40, 32, 8, time.monotonic(), None, None))

    def request_objects():
        request = GenerationRequest(new_id("req-"), prompt.token_ids, sampling, ctx, prompt.mm_hashes)
        Job(request, parsed, prompt.keys, None, 8)
        Sub(prompt, None, ctx, 0, 8)
        UsageSum(1)
        UsageSum(1)
        ChoiceState()

    job = Job(GenerationRequest("req-1", prompt.token_ids, sampling, ctx, prompt.mm_hashes), parsed, prompt.keys, None, 8)

    async def answer():
        return [batch async for batch in replicas[0].generate(job)]

    out = _drive(answer())[0][0]

    def shape():
        fmt = StreamFormatter("chat", new_id("chatcmpl-"), now_s(), gw.model_name, False)
        fmt.role(0) + fmt.delta(0, out.text, out.logprobs, ChoiceState(), out.finish_reason) + DONE

    return {
        "parse JSON": _best_us(lambda: parse_json(raw)),
        "validate (parse_request)": _best_us(lambda: parse_request("chat", body, gw.limits)),
        "chat template + block keys": _best_us(lambda: gw.hasher.chat(parsed.messages, parsed.images)),
        "classify": _best_us(lambda: gw.classifier.classify(parsed, ANONYMOUS, headers, len(prompt.token_ids),
                                                             len(prompt.keys), prompt.token_ids)),
        "route + in-flight accounting": _best_us(route),
        "metrics": _best_us(record_metrics),
        "observer hooks": _best_us(observe),
        "engine request objects": _best_us(request_objects),
        "fixture engine's answer": _best_us(lambda: _drive(answer())),
        "SSE shaping": _best_us(shape),
    }


async def _main(rounds: int) -> dict:
    gateway, bare_server, _engines, _served = await _servers()
    try:
        parts = _parts(gateway.runner.app[GATEWAY])
        raw = _raw_request()
        whole = {}
        for c in (1, 64):
            bare = await _measure(bare_server.runner.app, raw, c, 6400, rounds)
            gw = await _measure(gateway.runner.app, raw, c, 6400, rounds)
            whole[str(c)] = {"gateway_us": round(min(gw), 1), "bare_us": round(min(bare), 1)}
    finally:
        await gateway.stop()
        await bare_server.stop()
    total = sum(parts.values())
    for name, us in parts.items():
        print(f"{name:32s} {us:6.2f} us")
    print(f"{'sum of the parts, hot':32s} {total:6.2f} us")
    for c, w in whole.items():
        print(f"whole request in situ, c={c:>2}:    gateway {w['gateway_us']:6.1f} us, bare {w['bare_us']:5.1f} us, "
              f"added {w['gateway_us'] - w['bare_us']:6.1f} us = {(w['gateway_us'] - w['bare_us']) / total:.1f}x the parts")
    return {"parts_us": {k: round(v, 2) for k, v in parts.items()}, "parts_sum_us": round(total, 2), "whole": whole}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of whole requests (best is reported)")
    parser.add_argument("--json", metavar="OUT", help="write results as JSON")
    args = parser.parse_args(argv)
    results = asyncio.run(_main(args.rounds))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
