"""Issue 6 observability: /metrics series, alarms, user hit share, reuse ratio.

The live tests run a real gateway on loopback over a real tiny engine (the
``tiny_model_dir`` model) and talk to it with the openai SDK; /metrics is
read over HTTP and parsed with prometheus-client's own parser.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine.block_pool import BlockPool
from engine.config import CacheConfig, EngineConfig, ModelConfig, WorkloadAwareConfig
from engine.context import RequestContext
from gateway.app import GATEWAY, create_app
from gateway.config import KvgateConfig, ReplicaConfig, ServerConfig
from gateway.metrics import GatewayMetrics, policy_rows
from gateway.observe import user_identity
from gateway.reuse_rate import MinuteReuse
from gateway.server import start_server
from gateway.stats import StatsHistory
from gateway.status_log import StatusLog
from tests.engine_procs import wait_for
from tests.gateway_helpers import serving
from gateway.user_share import UserHitShare

MODEL = "tiny"
SYSTEM = "You are a helpful assistant. Answer the question briefly and politely. " * 6
SECRET_USER = "alice-secret-user-id"

# Every series issue 6 lists, with the label names each must carry.
REQUIRED = {
    "kvgate_requests_total": {"endpoint", "workload", "status"},
    "kvgate_time_to_first_token_seconds_bucket": {"workload", "replica", "le"},
    "kvgate_queue_time_seconds_bucket": {"workload", "replica", "le"},
    "kvgate_inter_token_latency_seconds_bucket": {"workload", "replica", "le"},
    "kvgate_e2e_request_latency_seconds_bucket": {"workload", "replica", "le"},
    "kvgate_prefix_cache_queries_tokens_total": {"workload", "replica"},
    "kvgate_prefix_cache_hits_tokens_total": {"workload", "replica"},
    "kvgate_router_predicted_hit_tokens_total": {"workload", "replica"},
    "kvgate_reuse_ratio": {"workload", "type"},
    "kvgate_kv_cache_blocks": {"replica", "tier", "state"},
    "kvgate_kv_evictions_total": {"replica", "tier"},
    "kvgate_kv_swap_bytes_total": {"replica", "direction"},
    "kvgate_cache_policy_active": {"replica", "policy"},
    "kvgate_cache_fallbacks_total": {"replica"},
    "kvgate_reuse_alarm": {"replica"},
    "kvgate_traffic_spike": {"replica"},
    "kvgate_user_hit_share": {"top"},
    "kvgate_router_decisions_total": {"replica", "reason"},
    "kvgate_replica_inflight": {"replica"},
    "kvgate_replica_healthy": {"replica"},
    "kvgate_replica_failures_total": {"replica", "stage"},
    "kvgate_engine_requests": {"replica", "state"},
    "kvgate_prompt_tokens_total": {"workload", "replica"},
    "kvgate_generation_tokens_total": {"workload", "replica"},
    "kvgate_kv_cache_usage_ratio": {"replica"},
    "kvgate_kv_block_moves_total": {"replica", "direction"},
    "kvgate_engine_preemptions_total": {"replica"},
    "kvgate_cache_categories": {"replica"},
    "kvgate_build_info": {"version", "role"},
}


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(found: dict[str, list], name: str, **labels) -> float:
    return sum(s.value for s in found.get(name, ()) if all(s.labels.get(k) == v for k, v in labels.items()))


async def scrape(url: str, path: str = "/metrics") -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + path) as resp:
            assert resp.status == 200
            return await resp.text()


# ---- units: user hit share --------------------------------------------------------------


def exact_shares(hits_by_user: dict[str, int], tops) -> dict[float, float]:
    ordered = sorted(hits_by_user.values(), reverse=True)
    total = sum(ordered)
    return {top: sum(ordered[: max(1, math.ceil(top * len(ordered)))]) / total for top in tops}


def test_user_hit_share_is_exact_while_users_fit_the_sketch():
    share = UserHitShare(window_s=600.0, buckets=6)
    rng = random.Random(1)
    hits: dict[str, int] = {}
    for i in range(20_000):
        # A long tail: user k is picked with weight 1/k.
        user = f"user-{int(1 / (rng.random() + 1e-3))}-{rng.randrange(300) if rng.random() < 0.5 else 0}"
        tokens = rng.choice((0, 16, 32, 64, 512))
        share.record(user, tokens, now=i * 0.01)
        hits[user] = hits.get(user, 0) + tokens
    got = share.shares(now=200.0)
    want = exact_shares(hits, (0.01, 0.10, 0.19))
    assert got.keys() == want.keys()
    for top in want:
        # Users counted by HLL (about 1.6% error), so k may be off by a user or two.
        assert got[top] == pytest.approx(want[top], abs=0.01), (top, got, want)
    assert got[0.01] < got[0.10] < got[0.19] <= 1.0


def test_user_hit_share_estimates_a_long_tail_beyond_the_sketch_in_bounded_memory():
    share = UserHitShare(window_s=600.0, buckets=2, lg_max_items=10)  # tracks 768 users
    rng = random.Random(2)
    population = range(20_000)
    weights = [1 / (k + 1) ** 1.1 for k in population]  # Zipf-like: a few heavy users, a long tail
    hits: dict[str, int] = {}
    for i, k in enumerate(rng.choices(population, weights, k=60_000)):
        user = f"user-{k}"
        tokens = rng.choice((16, 32, 64))
        share.record(user, tokens, now=i * 0.001)
        hits[user] = hits.get(user, 0) + tokens
    assert len(hits) > 3 * 768
    for bucket in share._buckets:
        assert bucket.hits.num_active_items <= 768
    got = share.shares(now=60.0)
    want = exact_shares(hits, (0.01, 0.10, 0.19))
    # The heavy hitters are kept: the top 1% is close.  Past the tracked users the
    # untracked weight is spread evenly (documented), which errs low on a long tail.
    assert got[0.01] == pytest.approx(want[0.01], abs=0.05), (got, want)
    for top in (0.10, 0.19):
        assert want[top] - 0.12 <= got[top] <= want[top] + 0.02, (top, got, want)
    assert got[0.01] < got[0.10] < got[0.19]


def test_user_hit_share_window_slides():
    share = UserHitShare(window_s=60.0, buckets=6)
    share.record("heavy", 1000, now=0.0)
    for i in range(99):
        share.record(f"light-{i}", 10, now=1.0)
    assert share.shares(now=2.0)[0.01] == pytest.approx(1000 / 1990)
    # The first bucket has left the window; only later traffic counts.
    for i in range(10):
        share.record(f"late-{i}", 5 * (i + 1), now=65.0)
    assert share.shares(now=75.0)[0.10] == pytest.approx(50 / 275)
    assert share.shares(now=200.0) == {0.01: 0.0, 0.10: 0.0, 0.19: 0.0}


def test_user_identity_is_user_within_tenant_else_tenant_else_none():
    assert user_identity("bob", "acme") != user_identity("bob", "other")
    assert user_identity(None, "acme") == user_identity("", "acme") != user_identity("acme", None)
    assert user_identity(None, None) is None


# ---- units: reuse ratio and policy rows -------------------------------------------------


def test_reuse_ratio_reports_the_last_full_minute_only():
    reuse = MinuteReuse()
    base = 6000.0  # minute 100
    reuse.record("to-c", "text", 100, 40, base + 1)
    reuse.record("to-c", "text", 100, 60, base + 50)
    reuse.record("to-b", "api", 200, 10, base + 59)
    assert reuse.last_full_minute(base + 59.9) == {}  # minute still filling
    reuse.record("to-c", "text", 100, 100, base + 61)  # next minute's traffic does not leak back
    assert reuse.last_full_minute(base + 70) == {("to-c", "text"): 0.5, ("to-b", "api"): 0.05}
    assert reuse.last_full_minute(base + 130) == {("to-c", "text"): 1.0}
    assert reuse.last_full_minute(base + 250) == {}  # an idle minute passed


def test_policy_rows_flip_rather_than_appear():
    assert policy_rows("lru", {}) == {"lru": 1}
    assert policy_rows("wa", {"active": "wa"}) == {"wa": 1, "lru": 0}
    assert policy_rows("wa-paper", {"active": "lru"}) == {"wa-paper": 0, "lru": 1}


# ---- alarms: the policy drives the gauges and logs each change once ----------------------


def _request(pool: BlockPool, keys: list[int], ctx: RequestContext, now: float) -> None:
    blocks, _ = pool.touch_or_insert(keys, ctx, now)
    pool.release(list(reversed(blocks)), ctx, now)


def _pool_metrics(pool: BlockPool) -> GatewayMetrics:
    metrics = GatewayMetrics()

    def stats():
        yield "r0", {"policy_name": pool.policy_name, "policy": pool.device_policy.state(),
                     "blocks": {"device": {"free": len(pool.free_device), "cached": pool.num_cached(), "in_use": 0}},
                     "evictions": {"device": pool.stats.device_evictions}}

    metrics.watch_state(stats, dict, dict)
    return metrics


def _change_lines(caplog) -> list[str]:
    words = ("reuse alarm", "falling back to LRU", "back to workload-aware", "traffic spike")
    return [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in words)]


def test_fallback_and_alarm_drive_the_gauges_and_log_one_line_per_change(caplog):
    # The adversarial stream of the workload-aware tests: a spatial-only score with
    # head/tail classes loses to LRU on a hot set mixed with one-offs (fallback),
    # then a loop larger than the cache makes LRU the loser (switch back).
    cfg = WorkloadAwareConfig.model_validate({
        "weights": {"reuse": 0.0, "spatial": 1.0, "lifetime": 0.0}, "position_classes": 2,
        "rhythm": {"enabled": False}, "topic_switch": {"enabled": False}, "shared_class": False,
        "fallback": {"window_s": 60.0, "check_interval_s": 10.0, "min_accesses": 100, "margin": 0.05, "sustain_s": 30.0},
        "alarm": {"window_s": 60.0, "threshold": 0.4, "min_accesses": 1},
    })
    pool = BlockPool(40, 0, "wa", CacheConfig(workload_aware=cfg))
    policy = pool.device_policy
    metrics = _pool_metrics(pool)
    caplog.set_level(logging.INFO)
    changes = {"fallback": 0, "back": 0, "alarm_raised": 0, "alarm_cleared": 0}
    state = policy.state()

    def step(keys: list[int], chat_id: int, now: float) -> None:
        nonlocal state
        _request(pool, keys, RequestContext(timestamp=now, prompt_blocks=2, chat_id=chat_id), now)
        new = policy.state()
        if new["active"] != state["active"]:
            changes["fallback" if new["active"] == "lru" else "back"] += 1
        if new["reuse_alarm"] != state["reuse_alarm"]:
            changes["alarm_raised" if new["reuse_alarm"] else "alarm_cleared"] += 1
        state = new

    now, one_off = 0.0, 10_000
    while now < 200.0:
        for i in range(8):
            now += 0.5
            step([i * 2 + 1, i * 2 + 2], i, now)
            one_off += 2
            step([one_off, one_off + 1], one_off, now)
    found = samples(metrics.render().decode())
    assert value(found, "kvgate_cache_policy_active", replica="r0", policy="lru") == 1
    assert value(found, "kvgate_cache_policy_active", replica="r0", policy="wa") == 0
    assert value(found, "kvgate_cache_fallbacks_total", replica="r0") == changes["fallback"] >= 1
    while now < 600.0 and policy.state()["active"] == "lru":
        for i in range(30):
            now += 0.5
            key = 50_000 + i * 2
            step([key, key + 1], key, now)
    found = samples(metrics.render().decode())
    assert value(found, "kvgate_cache_policy_active", replica="r0", policy="wa") == 1
    assert changes["back"] >= 1 and changes["alarm_raised"] >= 1
    assert value(found, "kvgate_reuse_alarm", replica="r0") == (1 if state["reuse_alarm"] else 0)
    assert value(found, "kvgate_traffic_spike", replica="r0") == 0
    # Exactly one log line per state change, whichever way it goes (nothing logs twice).
    lines = _change_lines(caplog)
    assert sum("falling back to LRU" in line for line in lines) == changes["fallback"]
    assert sum("back to workload-aware" in line for line in lines) == changes["back"]
    assert sum("reuse alarm raised" in line for line in lines) == changes["alarm_raised"]
    assert sum("reuse alarm cleared" in line for line in lines) == changes["alarm_cleared"]


def test_traffic_spike_drives_its_gauge_and_logs_once(caplog):
    cfg = WorkloadAwareConfig.model_validate({
        "fallback": {"enabled": False},
        "rhythm": {"min_baseline_minutes": 3, "rate_window_s": 5.0, "spike_factor": 2.0, "prearm": False},
    })
    pool = BlockPool(500, 0, "wa", CacheConfig(workload_aware=cfg))
    metrics = _pool_metrics(pool)
    caplog.set_level(logging.INFO)
    key, now = 1, 0.0

    def arrivals(until: float, gap: float) -> None:
        nonlocal key, now
        while now < until:
            now += gap
            _request(pool, [key], RequestContext(workload="to-b", type="api", timestamp=now, prompt_blocks=1), now)
            key += 1

    arrivals(600.0, 1.0)  # ten quiet minutes: the baseline
    assert value(samples(metrics.render().decode()), "kvgate_traffic_spike", replica="r0") == 0
    arrivals(630.0, 0.1)  # ten times the rate
    assert value(samples(metrics.render().decode()), "kvgate_traffic_spike", replica="r0") == 1
    arrivals(700.0, 1.0)
    assert value(samples(metrics.render().decode()), "kvgate_traffic_spike", replica="r0") == 0
    spikes = [line for line in _change_lines(caplog) if "traffic spike" in line]
    assert len(spikes) == 2 and "started" in spikes[0] and "ended" in spikes[1]


# ---- live: a real gateway over a real tiny engine -----------------------------------------


def _config(model_dir: str, policy: str = "wa", **cache) -> KvgateConfig:
    wa = WorkloadAwareConfig.model_validate({
        # Windows of a second so the live alarm flips within the test.
        "fallback": {"check_interval_s": 0.25, "window_s": 1.0},
        "alarm": {"window_s": 0.5, "threshold": 0.99, "min_accesses": 1},
    })
    return KvgateConfig(
        model=ModelConfig(path=model_dir, served_name=MODEL, device="cpu", max_model_len=1024),
        engine=EngineConfig(block_size=16, device_blocks=64, host_blocks_multiplier=1.0, max_num_seqs=4,
                            max_batched_tokens=1024, threads=1),
        cache=CacheConfig(policy=policy, workload_aware=wa, **cache),
        server=ServerConfig(),
        replicas=[ReplicaConfig(kind="inprocess", name="local")],
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tiny_model_dir):
    async with serving(create_app(_config(tiny_model_dir))) as running:
        yield running


async def _traffic(client: openai.AsyncOpenAI, rounds: int = 3) -> tuple[int, int]:
    """Two users' multi-turn chats (sharing a system prompt), streamed and not, plus
    completions; returns the (prompt, completion) tokens the responses' usage gave."""
    prompt = completion = 0

    def add(usage) -> None:
        nonlocal prompt, completion
        prompt += usage.prompt_tokens
        completion += usage.completion_tokens

    for turn in range(rounds):
        for user in (SECRET_USER, "bob"):
            history = [{"role": "system", "content": SYSTEM}]
            for t in range(turn + 1):
                history.append({"role": "user", "content": f"Question {t} from {user[:3]}: what is a cache?"})
                if t < turn:
                    history.append({"role": "assistant", "content": f"Answer {t}."})
            add((await client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, user=user)).usage)
            stream = await client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=6, user=user, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    add(chunk.usage)
        add((await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3)).usage)
        await asyncio.sleep(0.3)  # let the policy's check interval pass between rounds
    return prompt, completion


@pytest.mark.asyncio(loop_scope="module")
async def test_metrics_exposes_every_issue_series_with_bounded_labels(live):
    app, server, client = live
    prompt_tokens, completion_tokens = await _traffic(client)
    gw = app[GATEWAY]
    # The reuse ratio shows the last *full* minute: look from the next one.
    # Pin the clock just inside the minute after the last recorded one, so a scrape
    # that happens to cross a minute boundary cannot skip the minute with the traffic.
    next_minute = (gw.observer.reuse._minute + 1) * 60 + 1
    gw.observer.wall_clock = lambda: next_minute
    text = await scrape(server.url)
    found = samples(text)
    for name, labels in REQUIRED.items():
        assert name in found, f"missing series {name}"
        for sample in found[name]:
            assert set(sample.labels) == labels, (name, sample.labels)
    # Never a user id, raw or otherwise, in any label.
    assert SECRET_USER not in text and "bob" not in text
    assert value(found, "kvgate_requests_total", endpoint="chat", workload="to-c", status="200") == 12
    assert value(found, "kvgate_requests_total", endpoint="completions", workload="to-b", status="200") == 3
    # Token counters equal what the responses' usage said, as vLLM's prompt/generation_tokens_total.
    assert value(found, "kvgate_prompt_tokens_total") == prompt_tokens
    assert value(found, "kvgate_generation_tokens_total") == completion_tokens
    # The process's own series, and which process this is.
    assert value(found, "process_resident_memory_bytes") > 0
    assert value(found, "kvgate_build_info", role="gateway") == 1
    usage = value(found, "kvgate_kv_cache_usage_ratio", replica="local")
    assert 0 <= usage <= 1
    windows = {s.labels["order"] for s in found["kvgate_cache_window_hit_ratio"]}
    assert windows <= {"policy", "shadow_lru"} and value(found, "kvgate_cache_categories", replica="local") >= 1
    assert {s.labels["direction"] for s in found["kvgate_kv_block_moves_total"]} == {"device_to_host", "host_to_device"}
    assert "kvgate_engine_preemptions_total" in found
    # Engine-actual prefix hits (the shared system prompt) and the router's prediction.
    queries = value(found, "kvgate_prefix_cache_queries_tokens_total", replica="local")
    hits = value(found, "kvgate_prefix_cache_hits_tokens_total", replica="local", workload="to-c")
    predicted = value(found, "kvgate_router_predicted_hit_tokens_total", replica="local", workload="to-c")
    assert 0 < hits < queries and predicted > 0
    assert hits % 16 == 0 and predicted % 16 == 0
    # With one replica and an exact index, the router predicts what the engine then hits.
    assert predicted == pytest.approx(hits, rel=0.15)
    ratios = {(s.labels["workload"], s.labels["type"]): s.value for s in found["kvgate_reuse_ratio"]}
    assert set(ratios) == {("to-c", "text"), ("to-b", "api")}
    assert 0 < ratios[("to-c", "text")] < 1
    # The tiny pool (64 device blocks, 64 host blocks) is fully accounted for per tier.
    for tier in ("device", "host"):
        total = sum(value(found, "kvgate_kv_cache_blocks", replica="local", tier=tier, state=s)
                    for s in ("free", "cached", "in_use"))
        assert total == 64
    assert {s.labels["direction"] for s in found["kvgate_kv_swap_bytes_total"]} == {"device_to_host", "host_to_device"}
    assert value(found, "kvgate_cache_policy_active", replica="local", policy="wa") + \
        value(found, "kvgate_cache_policy_active", replica="local", policy="lru") == 1
    # The alarm threshold (99% over half a second) is set to trip on this traffic.
    assert value(found, "kvgate_reuse_alarm", replica="local") == 1
    shares = {s.labels["top"]: s.value for s in found["kvgate_user_hit_share"]}
    assert set(shares) == {"0.01", "0.1", "0.19"}
    assert 0.4 <= shares["0.01"] <= 1.0  # two users: the top 1% is the heavier one
    assert value(found, "kvgate_router_decisions_total", replica="local") == 15
    # Every reason exported from zero, so that increase() sees the first of a kind.
    reasons = {s.labels["reason"]: s.value for s in found["kvgate_router_decisions_total"]}
    assert set(reasons) == {"prefix", "load", "imbalance", "hot-spread", "round-robin", "session", "session-spill",
                            "only"} and reasons["imbalance"] == 0
    assert value(found, "kvgate_replica_healthy", replica="local") == 1
    assert value(found, "kvgate_replica_inflight", replica="local") == 0
    assert value(found, "kvgate_engine_requests", replica="local", state="running") == 0
    assert value(found, "kvgate_engine_requests", replica="local", state="waiting") == 0
    # A stream under way is a running engine request.
    stream = await client.completions.create(model=MODEL, prompt="Count:", max_tokens=400, stream=True,
                                             extra_body={"ignore_eos": True})
    async for _ in stream:
        during = samples(await scrape(server.url))
        break
    await stream.close()
    assert value(during, "kvgate_engine_requests", replica="local", state="running") == 1
    itl = value(found, "kvgate_inter_token_latency_seconds_count", workload="to-c")
    assert itl >= 6 * 5  # at least the streamed chats' token gaps
    assert value(found, "kvgate_time_to_first_token_seconds_count", workload="to-c") == 12
    # The Grafana dashboard under deploy/ queries only series that exist.
    dashboard = json.loads((Path(__file__).parent.parent / "deploy/grafana/kvgate-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
    queried = {name for expr in exprs for name in re.findall(r"kvgate_[a-z0-9_]+", expr)}
    assert len(queried) >= len(REQUIRED) - 1 and not queried - set(found), queried - set(found)


@pytest.mark.asyncio(loop_scope="module")
async def test_remote_engine_stats_reach_the_gateway_metrics(live, tiny_model_dir):
    # A `kvgate engine` server (engine mode app) and a gateway that routes to it over HTTP.
    engine_app = create_app(_config(tiny_model_dir, policy="lru"), engine_mode=True)
    engine_server = await start_server(engine_app)
    config = _config(tiny_model_dir)
    config.replicas = [ReplicaConfig(kind="engine", url=engine_server.url, name="remote")]
    gateway_server = await start_server(create_app(config))
    try:
        client = openai.AsyncOpenAI(base_url=gateway_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for _ in range(60):
            if (await client.models.list()).data:
                break
            await asyncio.sleep(0.1)
        for q in ("one", "two", "three"):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], max_tokens=3)
        await client.close()
        found = samples(await scrape(gateway_server.url))
        assert value(found, "kvgate_kv_cache_blocks", replica="remote", tier="device") == 64
        assert value(found, "kvgate_kv_cache_blocks", replica="remote", tier="device", state="cached") > 0
        assert value(found, "kvgate_cache_policy_active", replica="remote", policy="lru") == 1
        assert value(found, "kvgate_prefix_cache_hits_tokens_total", replica="remote") > 0
        # The engine server's own /metrics carries the same engine series under its own name.
        own = samples(await scrape(engine_server.url))
        assert value(own, "kvgate_kv_cache_blocks", replica="engine", tier="device") == 64
        assert value(own, "kvgate_build_info", role="engine") == 1
        # The gateway sends a chat as token ids to /v1/completions; the engine counts it as the chat it is.
        assert value(own, "kvgate_requests_total", endpoint="chat", workload="to-c", status="200") == 3
        assert value(own, "kvgate_requests_total", endpoint="completions", workload="to-c", status="200") == 0
    finally:
        await gateway_server.stop()
        await engine_server.stop()


_WORK = ("kvgate_prompt_tokens_total", "kvgate_generation_tokens_total", "kvgate_prefix_cache_queries_tokens_total",
         "kvgate_prefix_cache_hits_tokens_total", "kvgate_router_predicted_hit_tokens_total")


async def _work(url: str) -> dict[str, float]:
    found = samples(await scrape(url))
    return {name: value(found, name, replica="local") for name in _WORK}


@pytest.mark.asyncio(loop_scope="module")
async def test_requests_the_client_leaves_count_what_the_engine_did(live):
    """As vLLM counts the tokens of aborted requests: a stream the client leaves
    counts its prompt, the tokens generated and its prefix-cache lookup, and the
    router's prediction counts with the hits it is compared to (a "router
    accuracy" panel divides one by the other)."""
    app, server, client = live
    gw = app[GATEWAY]
    engine = gw.replicas[0].engine
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a long story."}]
    before, engine_before = await _work(server.url), dict(engine.stats()["prefix_cache"])
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "stream": True, "ignore_eos": True}
        resp = await session.post(server.url + "/v1/completions", json=body)
        events = 0
        while events < 20:
            line = await resp.content.readline()
            assert line, "the stream ended before 20 events"
            events += line.startswith(b"data: ")
        resp.close()
        await wait_for(lambda: gw.router.inflight_requests == [0], what="the abandoned stream's end")
        left = await _work(server.url)
        assert left["kvgate_prompt_tokens_total"] > before["kvgate_prompt_tokens_total"]
        assert 20 <= left["kvgate_generation_tokens_total"] - before["kvgate_generation_tokens_total"] < 400
        # A chat that hits the cached system prompt, left after its first line.
        await client.chat.completions.create(model=MODEL, messages=history, max_tokens=1)
        resp = await session.post(server.url + "/v1/chat/completions",
                                  json={"model": MODEL, "messages": history, "max_tokens": 400, "stream": True,
                                        "ignore_eos": True})
        await resp.content.readline()
        resp.close()
        await wait_for(lambda: gw.router.inflight_requests == [0], what="the abandoned stream's end")
    after, engine_after = await _work(server.url), engine.stats()["prefix_cache"]
    grew = {name: after[name] - left[name] for name in _WORK}
    # The gateway's lookups and hits are the engine's own, the abandoned requests' included.
    assert after["kvgate_prefix_cache_queries_tokens_total"] - before["kvgate_prefix_cache_queries_tokens_total"] == \
        engine_after["query_tokens"] - engine_before["query_tokens"]
    assert after["kvgate_prefix_cache_hits_tokens_total"] - before["kvgate_prefix_cache_hits_tokens_total"] == \
        engine_after["hit_tokens"] - engine_before["hit_tokens"]
    assert grew["kvgate_prompt_tokens_total"] == grew["kvgate_prefix_cache_queries_tokens_total"]
    # One replica and an exact index: predicted what the engine then hit, no more.
    assert grew["kvgate_router_predicted_hit_tokens_total"] == grew["kvgate_prefix_cache_hits_tokens_total"] > 0
    assert grew["kvgate_generation_tokens_total"] >= 2


@pytest.mark.asyncio(loop_scope="module")
async def test_queue_time_is_observed_once_per_request_whatever_its_n(live):
    """As through a remote `kvgate engine` (one header per stream) and as TTFT:
    the choices of n > 1 are one request that queued once."""
    app, server, client = live
    names = ("kvgate_queue_time_seconds_count", "kvgate_time_to_first_token_seconds_count")
    found = samples(await scrape(server.url))
    before = {name: value(found, name) for name in names}
    await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, n=3)
    found = samples(await scrape(server.url))
    assert {name: value(found, name) - before[name] for name in names} == {name: 1 for name in names}


def test_queue_time_resolves_the_waits_of_an_idle_engine():
    """Queue time's buckets began at 5 ms: a p50 of sub-millisecond waits read
    as ~2.5 ms on the dashboard (interpolated within the first bucket)."""
    metrics = GatewayMetrics()
    series = metrics.request_series("to-c", "r0")
    for _ in range(10):
        series.queue_time.observe(0.0002)
    series.queue_time.observe(0.003)
    found = {(s.name, s.labels.get("le")): s.value
             for fam in text_string_to_metric_families(metrics.render().decode()) for s in fam.samples
             if s.name == "kvgate_queue_time_seconds_bucket"}
    assert found[("kvgate_queue_time_seconds_bucket", "0.0005")] == 10
    assert found[("kvgate_queue_time_seconds_bucket", "0.005")] == 11


def test_ttft_help_says_what_is_measured():
    """A non-streaming response sends nothing until the whole answer is in: its
    TTFT is when the gateway received the first tokens, not when they were sent."""
    found = {fam.name: fam.documentation
             for fam in text_string_to_metric_families(GatewayMetrics().render().decode())}
    help_text = found["kvgate_time_to_first_token_seconds"]
    assert "first token sent" not in help_text and "non-streaming" in help_text


def test_dashboard_panel_titles_agree_with_their_units():
    """Grafana shows percentunit 1.0 as 100%: a title that says "1 = one core"
    over such a panel reads one core as 100% against its own legend."""
    dashboard = json.loads((Path(__file__).parent.parent / "deploy/grafana/kvgate-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        title = panel.get("title", "")
        if unit == "percentunit":
            assert not re.search(r"(^|[(\s])1 = ", title), (panel.get("id"), title)
        if "100% =" in title:
            assert unit == "percentunit", (panel.get("id"), title)


def _stat_colour(panel: dict, reading: float) -> str:
    """The colour Grafana paints a stat panel at `reading`: the last threshold step at or
    under it, with Grafana's own default (green, red from 80) where the panel sets none."""
    default = {"steps": [{"color": "green", "value": None}, {"color": "red", "value": 80}]}
    steps = panel["fieldConfig"]["defaults"].get("thresholds", default)["steps"]
    return [s["color"] for s in steps if s["value"] is None or s["value"] <= reading][-1]


def test_dashboard_status_panels_colour_bad_readings_and_only_those():
    """A background-coloured stat is read by its colour: no replica healthy must not
    show green, a raised alarm must not, and a fleet of 80 healthy replicas must not show red."""
    dashboard = json.loads((Path(__file__).parent.parent / "deploy/grafana/kvgate-dashboard.json").read_text())
    panels = {p["title"]: p for p in dashboard["panels"] if p["type"] == "stat"}
    bad_when = {"Healthy replicas": [0], "Reuse alarm": [1], "Traffic spike": [1], "Cache fallbacks (1h)": [1, 500]}
    good_when = {"Healthy replicas": [1, 80, 500], "Reuse alarm": [0], "Traffic spike": [0], "Cache fallbacks (1h)": [0]}
    for title, panel in panels.items():
        assert panel["options"]["colorMode"] == "background", title
        assert all(_stat_colour(panel, r) != "green" for r in bad_when[title]), title
        assert all(_stat_colour(panel, r) == "green" for r in good_when[title]), title
    # One healthy replica of two is no fleet in health: its count of those down goes red from one.
    healthy = panels["Healthy replicas"]
    down = next(t for t in healthy["targets"] if t["legendFormat"] == "down")
    assert down["expr"].startswith("count(") and " - sum(" in down["expr"]
    (override,) = [o for o in healthy["fieldConfig"]["overrides"] if o["matcher"]["options"] == "down"]
    as_down = {"fieldConfig": {"defaults": {"thresholds": override["properties"][0]["value"]}}}
    assert _stat_colour(as_down, 0) == "green" and _stat_colour(as_down, 1) == "red" == _stat_colour(as_down, 31)


def test_dashboard_ratios_drop_a_zero_denominator():
    """A rate over a zero rate is NaN or +Inf in PromQL: the router accuracy under
    least-load routing (nothing predicted) drew +Inf and threw the axis.  Each
    ratio's denominator is filtered `> 0`, so such a point is simply absent."""
    dashboard = json.loads((Path(__file__).parent.parent / "deploy/grafana/kvgate-dashboard.json").read_text())
    ratios = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ()) if " / " in t["expr"]]
    assert len(ratios) >= 3
    for expr in ratios:
        _, denominator = expr.split(" / ")
        assert denominator.startswith("(") and denominator.endswith(" > 0)"), expr


def test_request_counts_of_common_statuses_start_at_zero():
    """An alert on rate(kvgate_requests_total{status="500"}) must see the first 500:
    a series born at 1 shows no increase, so the common ones exist from the start."""
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    found = {
        (s.labels["endpoint"], s.labels["workload"], s.labels["status"]): s.value
        for fam in text_string_to_metric_families(generate_latest(GatewayMetrics().registry).decode())
        for s in fam.samples if s.name == "kvgate_requests_total"
    }
    for endpoint in ("chat", "completions"):
        for workload in ("to-c", "to-b", "multimodal", "unknown"):
            for status in ("200", "400", "429", "499", "500", "502", "503"):
                assert found[endpoint, workload, status] == 0


def test_a_replicas_token_and_latency_series_start_at_zero():
    """increase() over a series born at its first event misses that event: a
    replica's per-workload counters and the latency histograms exist from the start."""
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.watch_replica("r0", lambda: 0, lambda: 1, lambda: 0, lambda: 0, lambda: 0)
    found = samples(metrics.render().decode())

    def exported(name: str, **labels) -> list[float]:
        return [s.value for s in found.get(name, ()) if all(s.labels.get(k) == v for k, v in labels.items())]

    for workload in ("to-c", "to-b", "multimodal"):
        for name in ("kvgate_prompt_tokens_total", "kvgate_generation_tokens_total",
                     "kvgate_prefix_cache_queries_tokens_total", "kvgate_prefix_cache_hits_tokens_total",
                     "kvgate_router_predicted_hit_tokens_total"):
            assert exported(name, workload=workload, replica="r0") == [0], (name, workload)
        for name in ("kvgate_inter_token_latency_seconds_count", "kvgate_queue_time_seconds_count",
                     "kvgate_time_to_first_token_seconds_count", "kvgate_e2e_request_latency_seconds_count"):
            assert exported(name, workload=workload, replica="r0") == [0], (name, workload)


def test_an_engine_exports_no_routing_series():
    """A `kvgate engine` routes only to itself: router and replica series belong to gateways."""
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    def names(role: str) -> set[str]:
        metrics = GatewayMetrics(role)
        metrics.watch_replica("engine", lambda: 1, lambda: 1, lambda: 0, lambda: 0, lambda: 0)
        metrics.decisions.labels("engine", "prefix").inc()
        return {fam.name for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode())}

    routing = {"kvgate_router_decisions", "kvgate_router_predicted_hit_tokens", "kvgate_router_index_blocks",
               "kvgate_router_external_load_tokens", "kvgate_replica_inflight", "kvgate_replica_healthy",
               "kvgate_replica_failures"}
    assert routing <= names("gateway")
    engine = names("engine")
    assert not routing & engine and {"kvgate_requests", "kvgate_build_info"} <= engine


def test_loop_series_export_what_prometheus_client_exports():
    """The request-path series (lock-free, loop thread only) must read on a
    scrape exactly like prometheus_client's own Counter and Histogram fed the
    same values: bucket edges inclusive, cumulative counts, sum, count, _total."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from gateway.metrics import LoopCounter, LoopHistogram

    buckets = (0.001, 0.01, 0.1, 1.0)
    values = [0.0, 0.001, 0.0010001, 0.01, 0.05, 0.1, 2.0, 1.0, 0.5, 1e9]
    theirs_reg, ours_reg = CollectorRegistry(), CollectorRegistry()
    theirs_h = Histogram("lat_seconds", "doc", ["w"], buckets=buckets, registry=theirs_reg)
    ours_h = LoopHistogram("lat_seconds", "doc", ["w"], buckets=buckets, registry=ours_reg)
    theirs_c = Counter("req", "doc", ["status"], registry=theirs_reg)
    ours_c = LoopCounter("req", "doc", ["status"], registry=ours_reg)
    for i, v in enumerate(values):
        for h in (theirs_h, ours_h):
            h.labels("to-c" if i % 3 else "to-b").observe(v)
    for c in (theirs_c, ours_c):
        c.labels("200").inc()
        c.labels(200).inc(2.5)  # a non-string label value is the same series as its string
        c.labels("400").inc()

    def samples(reg):
        return sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for fam in text_string_to_metric_families(generate_latest(reg).decode())
            for s in fam.samples if not s.name.endswith("_created")
        )

    assert samples(ours_reg) == samples(theirs_reg)
    assert ("req_total", (("status", "200"),), 3.5) in samples(ours_reg)
    # Less than theirs: no `_created` series beside every counter and histogram.
    assert "_created" not in generate_latest(ours_reg).decode()
    with pytest.raises(ValueError):
        ours_c.labels("200").inc(-1)
    with pytest.raises(ValueError):
        ours_h.labels("a", "b")


def test_status_line_reports_the_interval_then_starts_over():
    history, status = StatsHistory(), StatusLog()
    assert status.line(10, history, [("r0", 0, {"running": 0, "waiting": 0}, "up")]) is None  # idle: no line
    history.finished("to-c", "r0", 1000, 600, now=1.0)
    history.finished("to-b", "r0", 1000, 200, now=2.0)
    history.answered()
    history.answered()
    stats = {"running": 2, "waiting": 1, "blocks": {"device": {"total": 200, "in_use": 90}}}
    replicas = [("r0", 3, stats, "up"), ("vllm", 4, None, "up"), ("old", 0, None, "down"), ("e1", 2, None, "draining"),
                ("pod-6", 0, None, "absent"), ("pod-7", 0, None, "absent")]
    line = status.line(10, history, replicas, generated=100)
    # Absent slots (no such pod) are counted only: 2 engines in 8 slots are no 6 down.
    assert line == ("last 10 s: 2 answered, prompt 200 tok/s (40% cached), generation 10 tok/s; "
                    "r0: 2 running, 1 waiting, KV 45% in use; vllm: 4 in flight; old: down; e1: draining, 2 in flight; "
                    "2 absent")
    assert status.line(10, history, [("r0", 0, {"running": 0}, "up")], generated=100) is None  # nothing new since
    # One client request whose three prompts were three engine requests is one request.
    for _ in range(3):
        history.finished("to-c", "r0", 100, 0, now=3.0)
    history.answered()
    assert status.line(10, history, [("r0", 0, {"running": 0}, "up")], generated=100).startswith(
        "last 10 s: 1 answered, prompt 30 tok/s")
    # Tokens of a stream still running count as they come, before any request ends.
    assert status.line(10, history, [("r0", 1, {"running": 1}, "up")], generated=400).startswith(
        "last 10 s: 0 answered, prompt 0 tok/s, generation 30 tok/s")
    # Refused or failed requests alone make a line: the non-200 responses since the last one, by
    # whose they are (a flood of bad requests read as "176 errors", as if the server were failing).
    assert status.line(10, history, [("r0", 0, {"running": 0}, "up")], errors=(5, 38, 2), generated=400).startswith(
        "last 10 s: 0 answered, 5 refused (4xx), 38 over limits (429), 2 failed (5xx),")
    assert status.line(10, history, [("r0", 0, {"running": 0}, "up")], errors=(5, 38, 2), generated=400) is None
    assert status.line(10, history, [("r0", 0, {"running": 0}, "up")], errors=(5, 38, 3), generated=400).startswith(
        "last 10 s: 0 answered, 1 failed (5xx),")
    # Streams whose clients left (499s) are no errors but make a line, with the tokens they generated.
    assert status.line(10, history, [("r0", 0, {"running": 0}, "up")], errors=(5, 38, 3), generated=460, left=2) == (
        "last 10 s: 0 answered, 2 left, prompt 0 tok/s, generation 6 tok/s; r0: 0 running, 0 waiting")
    # Tokens alone, too (the 499s counted at the last line).
    assert status.line(10, history, [("r0", 0, {"running": 0}, "up")], errors=(5, 38, 3), generated=480,
                       left=2).startswith("last 10 s: 0 answered, prompt 0 tok/s, generation 2 tok/s")


def test_the_status_line_says_why_a_replica_is_out_of_routing():
    """A draining engine (a rolling restart) and a hung in-process step read "down"
    like a dead replica."""
    from types import SimpleNamespace

    from gateway.observe import _state

    assert _state(SimpleNamespace(healthy=True)) == "up"
    assert _state(SimpleNamespace(healthy=False, absent=False, draining=True)) == "draining"
    assert _state(SimpleNamespace(healthy=False, absent=False, stalled_for=lambda: 75.0)) == "stalled"
    assert _state(SimpleNamespace(healthy=False, absent=False, draining=False, stalled_for=lambda: 0.0)) == "down"
    assert _state(SimpleNamespace(healthy=False, absent=True, draining=False)) == "absent"


def test_the_dashboards_rate_of_a_period_under_way_is_over_the_sample_span():
    """/stats ends with the period still under way; its requests over its own
    few milliseconds would plot a steady 1 request/s as 50."""
    history = StatsHistory(sample_s=5.0)
    for second in range(11):  # one request a second
        history.finished("to-c", "r", 10, 0, now=float(second))
    points = history.snapshot([], now=10.02)["history"]
    assert [p["partial"] for p in points] == [False, False, True]
    assert [p["rps"]["r"] for p in points[:2]] == [1.0, 1.0]
    assert points[2]["rps"]["r"] == pytest.approx(1.0, rel=0.25)  # one request 20 ms in: an estimate
    # After a quiet spell the period under way stands alone.
    history.finished("to-c", "r", 10, 0, now=100.0)
    last = history.snapshot([], now=100.5)["history"][-1]
    assert last["partial"] and last["rps"]["r"] == pytest.approx(1 / 5.0)


def test_the_dashboard_history_shows_an_idle_stretch_as_idle_up_to_now():
    """Three requests 20 s apart used to plot as a steady 0.2 requests/s, the axis
    ending at the last busy period however long ago; a stretch of a period or
    more with nothing is now marked idle where it starts and ends, and a
    snapshot during one ends at now.  An engine request whose replica did not
    say its hits counts as load, not in the hit ratio."""
    history = StatsHistory(sample_s=5.0)
    history.finished("to-c", "r", 10, 4, now=0.0)
    history.finished("to-c", "r", 10, None, now=20.0)
    points = history.snapshot([], now=21.0)["history"]
    assert [(p["t"], p["idle"], p["partial"]) for p in points] == [
        (5.0, False, False), (10.0, True, False), (20.0, True, False), (21.0, False, True)]
    assert points[0]["rps"] == {"r": 0.2} and points[1]["rps"] == {} and points[1]["ttft_p50"] is None
    assert points[3]["hit_ratio"] == {} and points[3]["rps"]["r"] > 0
    # Quiet since: the snapshot runs to now, idle from a period after the last point.
    points = history.snapshot([], now=60.0)["history"]
    assert [(p["t"], p["idle"]) for p in points[-3:]] == [(25.0, False), (30.0, True), (60.0, True)]
    assert history.snapshot([], now=61.0)["history"][-1]["t"] == 61.0  # not kept: each snapshot ends at its now
    totals = history.snapshot([], now=62.0)["totals"]
    assert (totals["engine_requests"], totals["prompt_tokens"], totals["cached_tokens"]) == (2, 10, 4)
    # Back to busy within a period of the last point: no idle marks.
    history.finished("to-c", "r", 10, 0, now=62.0)
    history.finished("to-c", "r", 10, 0, now=66.0)
    history.finished("to-c", "r", 10, 0, now=69.0)
    tail = [(p["t"], p["idle"]) for p in history.snapshot([], now=69.5)["history"][-4:]]
    assert tail == [(30.0, True), (62.0, True), (65.0, False), (69.5, False)]


async def test_status_line_in_the_log_while_busy(tiny_model_dir, caplog):
    config = _config(tiny_model_dir)
    config.server.log_stats_interval_s = 0.3
    caplog.set_level(logging.INFO, logger="gateway.observe")
    async with serving(create_app(config)) as (app, server, client):
        await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3)
        await asyncio.sleep(0.7)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("last 0.3 s:")]
    assert lines and "1 answered," in lines[0] and "local: 0 running, 0 waiting, KV" in lines[0]
    assert sum("1 answered," in line for line in lines) == 1  # counted once, then quiet while idle


async def test_status_line_rates_are_over_the_time_since_the_last_line(tiny_model_dir, caplog, monkeypatch):
    """A remote engine's stats poll may take seconds (up to its timeout): the line
    then covers the interval and the poll, and its rates are over that."""
    config = _config(tiny_model_dir)
    config.server.log_stats_interval_s = 0.3
    caplog.set_level(logging.INFO, logger="gateway.observe")
    async with serving(create_app(config)) as (app, server, client):
        observer = app[GATEWAY].observer
        refresh = observer.refresh

        async def slow_stats_poll():
            await asyncio.sleep(0.5)
            await refresh()

        monkeypatch.setattr(observer, "refresh", slow_stats_poll)
        await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3)
        await wait_for(lambda: any("1 answered," in r.getMessage() for r in caplog.records), what="a status line")
    line = next(r.getMessage() for r in caplog.records if "1 answered," in r.getMessage())
    window = float(line.split()[1])
    assert 0.75 <= window < 1.5, line  # the 0.3 s interval and the 0.5 s poll


def _tokens(scrape: str, name: str = "kvgate_generation_tokens_total") -> float:
    return sum(sample.value for family in text_string_to_metric_families(scrape) for sample in family.samples
               if sample.name == name)


async def test_a_long_streams_tokens_count_while_it_runs(tiny_model_dir, caplog):
    """Prompt tokens are counted once prefilled and generated ones as they
    arrive (as vLLM counts them): a Grafana rate and the status line show a long
    stream's work while it runs, not all of it at its end, and each once."""
    config = _config(tiny_model_dir)
    config.server.log_stats_interval_s = 0.3
    caplog.set_level(logging.INFO, logger="gateway.observe")
    async with serving(create_app(config)) as (app, server, client):
        stream = await client.completions.create(model=MODEL, prompt="Count:", max_tokens=1000, stream=True,
                                                 extra_body={"ignore_eos": True})
        seen = 0
        async with aiohttp.ClientSession() as session:
            async for chunk in stream:
                seen += 1
                if seen == 60:  # well under way
                    async with session.get(server.url + "/metrics") as resp:
                        scrape = await resp.text()
                    counted, prompt = _tokens(scrape), _tokens(scrape, "kvgate_prompt_tokens_total")
                    assert 50 <= counted < 1000 and prompt > 0
                    await wait_for(lambda: any("0 answered" in r.getMessage() and "generation 0 tok/s" not in
                                               r.getMessage() for r in caplog.records), what="a status line")
                    await stream.close()
                    break
            await asyncio.sleep(0.2)
            async with session.get(server.url + "/metrics") as resp:
                scrape = await resp.text()
            assert counted <= _tokens(scrape) < 1000  # cut short: what it made, once
            assert _tokens(scrape, "kvgate_prompt_tokens_total") == prompt


def test_the_status_lines_errors_leave_out_clients_that_left():
    """A 499 is a client that hung up (a closed stream, a Ctrl-C): the status
    line's errors are refusals (4xx), over limits (429) and failures (5xx)."""
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    for status, times in (("200", 5), ("499", 3), ("400", 1), ("401", 1), ("429", 4), ("502", 2), ("503", 1)):
        for _ in range(times):
            metrics.requests.labels("chat", "to-c", status).inc()
    assert metrics.errors_total() == (2, 4, 3)


def test_a_long_request_in_flight_is_no_idle_stretch():
    """One stream decoding for 30 s starts and ends nothing in between: the page
    drew it as no load, its lines broken.  Periods in which a snapshot saw it in
    flight are busy ones (rates, no hit ratio of their own), and the stretch
    after it ends is idle again."""
    history = StatsHistory(sample_s=5.0)
    history.first_token(0.2, now=0.0)
    replicas = [{"name": "r", "inflight": 1}]
    for second in range(2, 30, 2):  # the page polls every 2 s
        history.snapshot(replicas, now=float(second))
    history.finished("to-c", "r", 10, 0, now=30.0)
    points = history.snapshot([{"name": "r", "inflight": 0}], now=31.0)["history"]
    assert not any(p["idle"] for p in points), [(p["t"], p["idle"]) for p in points]
    assert points[-1]["rps"]["r"] > 0 and points[1]["hit_ratio"] == {} and points[1]["ttft_p50"] is None
    quiet = history.snapshot([{"name": "r", "inflight": 0}], now=60.0)["history"]
    assert [p["idle"] for p in quiet[-2:]] == [True, True]


def test_dashboard_queries_are_scoped_to_the_chosen_namespaces():
    """One Prometheus often scrapes several deployments (staging and production, two
    models): every series a panel selects is narrowed by the namespace variable, or
    the panels summed them all.  kvgate_build_info is only joined on instance."""
    dashboard = json.loads((Path(__file__).parent.parent / "deploy/grafana/kvgate-dashboard.json").read_text())
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "namespace"]
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
    selectors = [m for expr in exprs for m in re.finditer(r"\b(kvgate_\w+)(\{[^}]*\})?", expr)]
    assert len(selectors) > 40
    for match in selectors:
        if match.group(1) != "kvgate_build_info":
            assert 'namespace=~"$namespace"' in (match.group(2) or ""), match.group(0)
