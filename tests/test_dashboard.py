"""GET /dashboard in a real browser: Debian's headless Chromium against a live gateway.

The gateway runs on loopback over a real tiny engine and has served a few
requests; Chromium loads /dashboard, the page polls /stats and draws its
canvases, and the DOM it dumps must show all four charts drawn with data and
a policy row per replica.  Chromium is required (.ci/run installs it): its
absence fails the test rather than skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import aiohttp
import aiohttp.web
import openai
import pytest
import pytest_asyncio

from engine.config import CacheConfig, EngineConfig, ModelConfig
from gateway.config import KvgateConfig, ReplicaConfig
from gateway.app import GATEWAY, create_app
from gateway.server import start_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
DASHBOARD_HTML = Path(__file__).resolve().parent.parent / "gateway" / "static" / "dashboard.html"
CHARTS = {"hit", "ttft", "load", "cache"}


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Debian's chromium is required for the dashboard test (apt-get install -y chromium; .ci/run does it)"
    return path


async def run_chromium(tmp_path, url: str, *extra: str) -> str:
    """Headless Chromium on ``url``; stdout.  Run as a subprocess so this loop keeps serving the gateway."""
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    args = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--lang=en-US", f"--user-data-dir={profile}", "--virtual-time-budget=6000", *extra, url,
    ]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "HOME": str(tmp_path), "TZ": "UTC"}
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode(errors="replace")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_model_dir):
    config = KvgateConfig(
        model=ModelConfig(path=tiny_model_dir, served_name=MODEL, device="cpu", max_model_len=1024),
        engine=EngineConfig(block_size=16, device_blocks=96, host_blocks_multiplier=1.0, max_num_seqs=4, threads=1),
        cache=CacheConfig(policy="wa"),
        replicas=[ReplicaConfig(kind="inprocess", name="alpha"), ReplicaConfig(kind="inprocess", name="beta")],
    )
    server = await start_server(create_app(config))
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    system = "You are a helpful assistant. Answer the question briefly and politely. " * 4
    for i in range(6):
        await client.chat.completions.create(
            model=MODEL, max_tokens=4, user=f"user-{i % 3}",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question number {i}?"}],
        )
    await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3)
    yield server
    await client.close()
    await server.stop()


async def test_stats_json_has_what_the_page_draws(served):
    async with aiohttp.ClientSession() as session:
        async with session.get(served.url + "/stats") as resp:
            assert resp.status == 200
            stats = await resp.json()
        async with session.get(served.url + "/dashboard") as resp:
            assert resp.status == 200 and resp.content_type == "text/html" and resp.charset == "utf-8"
            # Its own inline script and style, /stats from here, no framing elsewhere; the
            # Chromium test below shows the page still draws under that policy.
            policy = resp.headers["Content-Security-Policy"]
            assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
            page = await resp.text()
    # Self-contained: no script, style or font from anywhere but the page itself.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert stats["totals"]["requests"] == 7
    assert 0 < time.time() - stats["started"] < 300  # wall clock: the page tells a restart by it
    point = stats["history"][-1]
    assert set(point["hit_ratio"]) == {"to-c", "to-b"} and point["ttft_p50"] > 0
    assert set(point["rps"]) <= {"alpha", "beta"} and sum(point["rps"].values()) > 0
    names = [r["name"] for r in stats["replicas"]]
    assert names == ["alpha", "beta"]
    for replica in stats["replicas"]:
        assert replica["healthy"] is True and replica["inflight"] == 0
        assert sum(replica["cache"]["device"].values()) == 96 and sum(replica["cache"]["host"].values()) == 96
        assert replica["policy"]["name"] == "wa" and replica["policy"]["active"] in ("wa", "lru")
        assert set(replica["policy"]) >= {"fallbacks", "reuse_alarm", "traffic_spike"}
    json.dumps(stats)  # plain JSON all the way down


async def test_dashboard_renders_all_charts_with_data_in_headless_chromium(served, tmp_path):
    dom = await run_chromium(tmp_path, served.url + "/dashboard", "--dump-dom")
    marked = re.search(r'data-charts-with-data="([^"]*)"', dom)
    assert marked, "the page never rendered /stats:\n" + dom[-3000:]
    assert set(marked.group(1).split(",")) == CHARTS
    tbody = re.search(r'<table id="policy">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", tbody, re.S)
    assert [re.search(r"<td>(.*?)</td>", row).group(1) for row in rows] == ["alpha", "beta"]
    assert all("<td>wa</td>" in row for row in rows)
    assert "7 requests" in dom and 'id="error"></span>' in dom
    # Gridlines a round step apart, each label distinct and exact (0.05|0.10|0.15, not 0.07|0.05|0.03).
    for chart in ("ttft", "load"):
        ticks = re.search(rf'<canvas id="{chart}"[^>]*data-ticks="([^"]*)"', dom).group(1).split("|")
        values = [float(t.replace(",", "")) for t in ticks]
        assert len(set(ticks)) == 5 and values[0] == 0, (chart, ticks)
        assert all(abs((b - a) - values[1]) < 1e-9 for a, b in zip(values, values[1:])), (chart, ticks)
    # One bar per replica and tier, each its own 96 blocks (not device and host stacked into 192).
    assert re.search(r'<canvas id="cache"[^>]*data-bars="([^"]*)"', dom).group(1) == "96,96,96,96"
    assert re.search(r'<div class="legend" id="cache-legend">(.*?)</div>', dom).group(1).count("<i ") == 3

    shot = tmp_path / "dashboard.png"
    await run_chromium(tmp_path, served.url + "/dashboard", f"--screenshot={shot}", "--window-size=1280,1100",
                       "--hide-scrollbars")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    if os.environ.get("KVGATE_DASHBOARD_SHOT"):
        shutil.copy(shot, os.environ["KVGATE_DASHBOARD_SHOT"])


async def test_an_idle_stretch_breaks_the_lines_and_the_axis_runs_to_now(tmp_path):
    """The page over a /stats whose history has an idle stretch (gateway/stats.py
    marks one where it starts and ends): the hit ratio and TTFT lines break there
    instead of joining across it, and the charts' x axis runs to the last idle
    mark, i.e. now, not to the last busy period."""
    def busy(t):
        return {"t": t, "partial": False, "idle": False, "hit_ratio": {"to-c": 0.5}, "ttft_p50": 0.1,
                "ttft_p99": 0.2, "rps": {"r": 0.2}}

    def idle(t):
        return {"t": t, "partial": False, "idle": True, "hit_ratio": {}, "ttft_p50": None, "ttft_p99": None,
                "rps": {}}

    stats = {"now": 200.0, "sample_s": 5.0, "history": [busy(5), busy(10), idle(15), idle(100), busy(105),
                                                        idle(110), idle(200)],
             "replicas": [{"name": "r", "healthy": True, "inflight": 0, "cache": {}, "policy": {}}],
             "totals": {"requests": 3, "engine_requests": 3, "prompt_tokens": 30, "cached_tokens": 15,
                        "hit_ratio": 0.5}}
    dom = await _dashboard_over(tmp_path, lambda request: aiohttp.web.json_response(stats))

    def canvas(chart: str, attribute: str) -> str:
        return re.search(rf'<canvas id="{chart}"[^>]*data-{attribute}="([^"]*)"', dom).group(1)

    assert canvas("hit", "runs") == "2" and canvas("ttft", "runs") == "4"  # p50 and p99, each in two
    assert canvas("load", "runs") == "1"  # load reads 0 while idle: one line
    assert canvas("hit", "span") == canvas("load", "span") == "195"
    # The x axis says what it spans, the same for every line chart.
    assert canvas("hit", "xlabels") == canvas("ttft", "xlabels") == canvas("load", "xlabels") == "3 min ago|98 s ago|now"


async def test_a_long_history_big_counts_and_a_small_cache_read_plainly(tmp_path):
    """Eight hours of history read "480 min ago" on the x axis; 12480 requests and
    3000 requests a second had no thousands separators; a cache of 10 blocks got
    2.5-block steps, labelled 0|3|5|8|10."""
    def sample(t):
        return {"t": t, "partial": False, "idle": False, "hit_ratio": {"to-c": 0.5}, "ttft_p50": 0.1,
                "ttft_p99": 0.2, "rps": {"r": 3000.0}}

    stats = {**_idle_stats([{"name": "r", "healthy": True, "inflight": 1500, "policy": {},
                             "cache": {"device": {"free": 4, "cached": 6}}}]),
             "now": 28_805.0, "history": [sample(5.0), sample(28_800.0)]}
    stats["totals"] = {**stats["totals"], "requests": 12_480}
    dom = await _dashboard_over(tmp_path, lambda request: aiohttp.web.json_response(stats))

    def canvas(chart: str, attribute: str) -> str:
        return re.search(rf'<canvas id="{chart}"[^>]*data-{attribute}="([^"]*)"', dom).group(1)

    assert canvas("hit", "xlabels") == "8 h ago|4 h ago|now"
    assert canvas("cache", "bars") == "10" and canvas("cache", "ticks") == "0|3|6|9|12"
    assert canvas("load", "ticks") == "0|1,000|2,000|3,000|4,000"
    assert "12,480 requests" in dom and "1,500 in flight" in dom


async def test_absent_slots_are_counted_not_shown_as_down(tmp_path):
    """Slots of a replica entry with a count whose pods do not exist (2 engines in
    8 slots) are neither rows, lines nor "6/8 healthy": the summary counts them."""
    def replica(name, healthy, absent):
        return {"name": name, "healthy": healthy, "absent": absent, "inflight": 0, "cache": {}, "policy": {}}

    stats = _idle_stats([replica("pod-0", True, False), replica("pod-1", False, False),
                         *(replica(f"pod-{i}", False, True) for i in range(2, 8))])
    dom = await _dashboard_over(tmp_path, lambda request: aiohttp.web.json_response(stats))
    assert re.search(r'id="summary">[^<]* · 1/2 replicas healthy \(6 absent\)</span>', dom), dom[-3000:]
    rows = re.findall(r"<tr><td>(pod-\d)</td>", dom)
    assert rows == ["pod-0", "pod-1"]


async def test_a_cache_chart_with_no_bars_has_a_readable_axis_and_says_why(tiny_model_dir, tmp_path):
    """No replica with block figures (every one down, or external servers: kvgate in
    front of vLLM): the empty chart's axis read 0|0|1|1|1 (quarter steps rounded to
    whole blocks), with no word of why nothing was drawn."""
    from tests.engine_procs import free_port

    config = KvgateConfig(
        model=ModelConfig(path=tiny_model_dir, served_name=MODEL, device="cpu", max_model_len=1024),
        replicas=[ReplicaConfig(kind="engine", name="down", url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=1)],
    )
    server = await start_server(create_app(config))
    try:
        dom = await run_chromium(tmp_path, server.url + "/dashboard", "--dump-dom")
    finally:
        await server.stop()
    assert "0/1 replicas healthy" in dom
    ticks = re.search(r'<canvas id="cache"[^>]*data-ticks="([^"]*)"', dom).group(1).split("|")
    assert len(set(ticks)) == 5, ticks  # 0|1|2|3|4
    assert re.search(r'<canvas id="cache"[^>]*data-note="no replica reports its blocks', dom), dom[-3000:]


async def test_a_workload_absent_for_a_while_breaks_its_line(tmp_path):
    """Periods with only another workload's traffic break a workload's hit-ratio
    line: it joined its figures either side, as if measured in between."""
    def busy(t, hit_ratio):
        return {"t": t, "partial": False, "idle": False, "hit_ratio": hit_ratio, "ttft_p50": 0.1,
                "ttft_p99": 0.2, "rps": {"r": 1.0}}

    stats = {"now": 20.0, "sample_s": 5.0, "started": 1.0e9,
             "history": [busy(5, {"to-c": 0.5}), busy(10, {"to-b": 0.3}), busy(15, {"to-c": 0.6, "to-b": 0.4})],
             "replicas": [{"name": "r", "healthy": True, "inflight": 0, "cache": {}, "policy": {}}],
             "totals": {"requests": 3, "engine_requests": 3, "prompt_tokens": 30, "cached_tokens": 15,
                        "hit_ratio": 0.5}}
    dom = await _dashboard_over(tmp_path, lambda request: aiohttp.web.json_response(stats))
    assert re.search(r'<canvas id="hit"[^>]*data-runs="([^"]*)"', dom).group(1) == "3"  # to-c in two, to-b in one


# Where a canvas shows a series of colour [r, g, b] (its line or its dots): the
# pixel columns holding that colour, in clusters more than a dot's width apart.
_SERIES_CLUSTERS = """((id, rgb) => {
  const c = document.getElementById(id), d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const xs = [];
  for (let x = 0; x < c.width; x++) for (let y = 0; y < c.height; y++) {
    const i = (y * c.width + x) * 4;
    if (d[i + 3] > 200 && rgb.every((v, j) => Math.abs(d[i + j] - v) < 40)) { xs.push(x); break; }
  }
  return xs.filter((x, k) => k === 0 || x - xs[k - 1] > 8).length;
})"""


async def test_a_burst_between_idle_stretches_shows_on_the_hit_ratio_and_ttft_charts(tiny_model_dir, tmp_path):
    """A burst with idle periods either side (a batch job's every minute) is a line
    of one point: stroked, it drew nothing, so the hit-ratio and TTFT charts showed
    the latest burst alone and the earlier ones not at all.  Each is a dot now."""
    config = KvgateConfig(
        model=ModelConfig(path=tiny_model_dir, served_name=MODEL, device="cpu", max_model_len=1024),
        engine=EngineConfig(block_size=16, device_blocks=96, host_blocks_multiplier=1.0, max_num_seqs=4, threads=1),
        replicas=[ReplicaConfig(kind="inprocess", name="solo")],
    )
    app = create_app(config)
    server = await start_server(app)
    # 1 s periods, not 5 s: a period opens at the first event after an idle stretch,
    # so each burst below (one short request) falls in one period, idle ones either side.
    app[GATEWAY].observer.history.sample_s = 1.0
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        for i in range(3):
            if i:
                await asyncio.sleep(2.5)
            await client.completions.create(model=MODEL, prompt=f"The capital of France is {i}", max_tokens=2)
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/stats") as resp:
                history = (await resp.json())["history"]
        lone = [k for k, p in enumerate(history) if not p["idle"] and p["hit_ratio"]
                and (k == 0 or history[k - 1]["idle"]) and (k + 1 == len(history) or history[k + 1]["idle"])]
        assert len(lone) >= 2, history  # the earlier bursts: a point each, idle marks around it
        shown = await dom_in_real_time(tmp_path, server.url + "/dashboard", 3.0,
                                       # to-b's line (blue) and p99's (orange, over p50's when one request makes both)
                                       f'JSON.stringify([{_SERIES_CLUSTERS}("hit", [0, 114, 178]), '
                                       f'{_SERIES_CLUSTERS}("ttft", [213, 94, 0])])')
    finally:
        await client.close()
        await server.stop()
    assert json.loads(shown) == [3, 3], shown  # every burst, on both charts


async def test_a_restarted_gateway_is_said_to_have_restarted(tmp_path):
    """A restart empties the history and totals; the page said nothing, so its
    short charts read as a quiet spell.  It now says when the gateway (re)started."""
    answers = []

    async def stats(request):
        answers.append(request)
        started = 1.7e9 if len(answers) == 1 else 1.7e9 + 3600  # the second poll finds it restarted
        return aiohttp.web.json_response(
            {**_idle_stats([{"name": "r", "healthy": True, "inflight": 0, "cache": {}, "policy": {}}]),
             "started": started})

    dom = await _dashboard_over(tmp_path, stats)
    assert len(answers) >= 2
    summary = re.search(r'id="summary">([^<]*)</span>', dom).group(1)
    # Chromium runs in UTC (run_chromium); a start on another day than today's says its date.
    again = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(1.7e9 + 3600))
    assert summary == f"0 requests · hit ratio - since {again} · 1/1 replicas healthy · " \
                      f"restarted at {again}, figures start over"


async def test_every_replica_line_and_its_legend_swatch_look_unlike_the_others(tmp_path):
    """Colour and dash both came round every 7 series, so replica 7 was drawn as
    replica 0; and every dashed swatch in the legend was the same CSS dash."""
    names = [f"engine-{i}" for i in range(9)]
    replicas = [{"name": n, "healthy": True, "inflight": 0, "cache": {}, "policy": {}} for n in names]
    history = [{"t": t, "partial": False, "idle": False, "hit_ratio": {}, "ttft_p50": None, "ttft_p99": None,
                "rps": {n: 1.0 + i for i, n in enumerate(names)}} for t in (20.0, 25.0)]

    async def stats(request):
        return aiohttp.web.json_response({
            "now": 30.0, "sample_s": 5.0, "started": 1.7e9, "history": history, "replicas": replicas,
            "totals": {"requests": 9, "engine_requests": 9, "prompt_tokens": 0, "cached_tokens": 0, "hit_ratio": 0.0}})

    dom = await _dashboard_over(tmp_path, stats)
    swatches = re.findall(r'stroke="([^"]+)" stroke-width="3" stroke-dasharray="([^"]*)"',
                          re.search(r'id="load-legend">(.*?)</div>', dom).group(1))
    assert len(swatches) == 9 and len(set(swatches)) == 9, swatches
    assert len({dash for _, dash in swatches[:7]}) == 7  # the first seven differ by dash too


async def test_the_cache_bars_of_many_replicas_say_whose_they_are(tiny_model_dir, tmp_path):
    """Six replicas named alike but for their ends: each bar's "name tier" was cut
    to its end, and every bar read "…evice" or "… host", whose was anyone's guess.
    A label that does not fit keeps the part of the name the others do not share."""
    prefix = "inference-engine-replica-in-the-eu-west-zone-number-"
    config = KvgateConfig(
        model=ModelConfig(path=tiny_model_dir, served_name=MODEL, device="cpu", max_model_len=1024),
        engine=EngineConfig(block_size=16, device_blocks=32, host_blocks_multiplier=1.0, max_num_seqs=4, threads=1),
        replicas=[ReplicaConfig(kind="inprocess", name=f"{prefix}{i}") for i in range(6)],
    )
    server = await start_server(create_app(config))
    try:
        dom = await run_chromium(tmp_path, server.url + "/dashboard", "--dump-dom", "--window-size=1280,1000")
    finally:
        await server.stop()
    labels = re.search(r'<canvas[^>]*id="cache"[^>]*data-labels="([^"]*)"', dom).group(1).split("|")
    assert len(labels) == 12 and len(set(labels)) == 12, labels  # a device and a host bar each, told apart
    for i, label in enumerate(labels):
        assert re.search(rf"(^|…|\D){i // 2} [dh]", label), labels  # replica i // 2's, device or host


@pytest.mark.parametrize("names, own", [
    # Emoji share the first half of their surrogate pair: the cut fell inside it, and
    # every bar read "…\ufffd d" (a lone half, drawn as a box), whose was anyone's guess.
    ([f"inference-engine-replica-number-{chr(0x1F171 + i)}" for i in range(6)],
     [chr(0x1F171 + i) for i in range(6)]),
    # A name that is the start of the others' read "…", and an accent alone over "…".
    (["inference-engine-replica-in-the-eu-west", "inference-engine-replica-in-the-eu-west-2",
      "inference-engine-replica-in-the-eu-west-3"], ["west", "west-2", "west-3"]),
    ([f"replica-e{accent}-inference-engine-in-the-eu-west-zone" for accent in ("\u0301", "\u0300")],
     ["e\u0301", "e\u0300"]),
], ids=["emoji", "a name the others start with", "accents"])
async def test_cut_bar_labels_keep_whole_characters_and_something_of_each_name(tmp_path, names, own):
    replicas = [{"name": n, "healthy": True, "inflight": 0, "policy": {},
                 "cache": {"device": {"free": 10, "cached": 5, "in_use": 1}, "host": {"free": 10, "cached": 5, "in_use": 0}}}
                for n in names]

    async def stats(request):
        return aiohttp.web.json_response(_idle_stats(replicas))

    async with _scripted_page(stats) as url:
        labels = json.loads(await dom_in_real_time(tmp_path, url + "/dashboard", 3.0, (
            'JSON.stringify((document.getElementById("cache").dataset.labels || "").split("|")'
            '.map(label => label.isWellFormed() ? label : null))')))
    assert None not in labels and len(set(labels)) == len(labels) == 2 * len(names), labels
    assert all(label.rsplit(" ", 1)[0].strip("…") == own[i // 2] for i, label in enumerate(labels)), labels


async def _dashboard_over(tmp_path, stats_handler) -> str:
    """The page's DOM in Chromium, its /stats answered by ``stats_handler``, which
    the page read without an error."""
    dom = await _page_dom(tmp_path, stats_handler)
    assert 'id="error"></span>' in dom, dom[-2000:]
    return dom


async def test_a_greyed_page_greys_its_summary_too(tmp_path):
    """Lost contact greyed the charts and the table, but the summary beside the
    "figures frozen" banner (requests, hit ratio, replicas healthy) stayed as bright
    as live figures.  And the page asks for nothing but itself and /stats."""
    stats = {"now": 30.0, "sample_s": 5.0, "history": [], "replicas": [],
             "totals": {"requests": 3, "engine_requests": 3, "prompt_tokens": 30, "cached_tokens": 15, "hit_ratio": 0.5}}
    answers = []
    stats_once = _once_then_gone(stats, answers)

    asked = []
    anything_else = {"/{other:.*}": lambda request: asked.append(request.path) or aiohttp.web.Response(status=404)}
    async with _scripted_page(stats_once, **anything_else) as url:
        shown = await dom_in_real_time(tmp_path, url + "/dashboard", 5.0, (
            'JSON.stringify([document.body.dataset.stale || null, '
            'Number(getComputedStyle(document.getElementById("summary")).opacity)])'))
    stale, opacity = json.loads(shown)
    assert stale == "1" and opacity < 0.5, shown  # live, the header's spans are at .8
    assert asked == []  # no /favicon.ico either: its 404 was an error in the console at every load


async def test_the_page_under_the_gateways_own_policy_logs_no_error(served, tmp_path):
    """The page's empty icon (data:, so that no /favicon.ico 404 is logged) is an
    image: under the gateway's Content-Security-Policy (default-src 'none', no
    img-src) the browser blocked it with a CSP error in the console at every load,
    which the tests did not see as they served the page without that policy."""
    console = []
    await dom_in_real_time(tmp_path, served.url + "/dashboard", 3.0, "document.body.dataset.chartsWithData || ''",
                           console=console)
    errors = [f"{entry.get('source')}: {entry.get('text')}" for entry in console if entry.get("level") == "error"]
    assert errors == [], errors


def _once_then_gone(stats: dict, answers: list):
    """A /stats handler that answers ``stats`` once, then 503s (a gateway gone);
    ``answers`` gets each request."""
    async def handler(request):
        answers.append(request)
        if len(answers) > 1:
            return aiohttp.web.json_response({"error": {"message": "gone"}}, status=503)
        return aiohttp.web.json_response(stats)
    return handler


def _idle_stats(replicas: list[dict]) -> dict:
    """A /stats of ``replicas`` before any traffic, in gateway/stats.py's shape."""
    return {"now": 30.0, "sample_s": 5.0, "started": 1.7e9, "history": [], "replicas": replicas,
            "totals": {"requests": 0, "engine_requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "hit_ratio": 0.0}}


@contextlib.asynccontextmanager
async def _scripted_page(stats_handler, **pages):
    """The dashboard served beside a scripted /stats (``stats_handler``) and
    ``pages`` (path -> handler); yields the server's URL."""
    page = aiohttp.web.Application()
    page.router.add_get("/dashboard", lambda request: aiohttp.web.FileResponse(DASHBOARD_HTML))
    page.router.add_get("/stats", stats_handler)
    for path, handler in pages.items():
        page.router.add_get(path, handler)
    server = await start_server(page)
    try:
        yield server.url
    finally:
        await server.stop()


async def _page_dom(tmp_path, stats_handler) -> str:
    async with _scripted_page(stats_handler) as url:
        return await run_chromium(tmp_path, url + "/dashboard", "--dump-dom")


async def dom_in_real_time(tmp_path, url: str, seconds: float,
                           expression: str = "document.documentElement.outerHTML", console: list | None = None,
                           locale: str | None = None):
    """The page's DOM (or ``expression``'s value) after ``seconds`` of wall time in
    headless Chromium, read over its DevTools socket.  Virtual time (run_chromium)
    stands still while a fetch is pending, so a page waiting on a silent server needs this.
    ``console``: given, it gets the console's entries so far ({"level", "source", "text"}).
    ``locale``: the reader's (Intl's default; headless Chromium's own stays en-US whatever --lang says)."""
    args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
            "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile-realtime'}", "--remote-debugging-port=0",
            "about:blank" if locale else url]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                                                env={**os.environ, "HOME": str(tmp_path), "TZ": "UTC"})
    try:
        line = b""
        while b"DevTools listening on" not in line:
            line = await asyncio.wait_for(proc.stderr.readline(), 60)
            assert line, "chromium exited before its DevTools socket opened"
        port = re.search(rb"ws://[^:]+:(\d+)/", line).group(1).decode()
        await asyncio.sleep(0 if locale else seconds)  # a locale: the page loads once it is set
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json") as resp:
                page = next(t for t in await resp.json() if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                if locale:  # set before the page loads, then the page (answers read by id below)
                    await ws.send_json({"id": 2, "method": "Emulation.setLocaleOverride", "params": {"locale": locale}})
                    await ws.send_json({"id": 3, "method": "Page.navigate", "params": {"url": url}})
                    await asyncio.sleep(seconds)
                if console is not None:  # Log.enable sends the entries collected so far
                    await ws.send_json({"id": 0, "method": "Log.enable"})
                await ws.send_json({"id": 1, "method": "Runtime.evaluate",
                                    "params": {"expression": expression, "returnByValue": True}})
                async for msg in ws:
                    answer = json.loads(msg.data)
                    if answer.get("method") == "Log.entryAdded" and console is not None:
                        console.append(answer["params"]["entry"])
                    if answer.get("id") == 1:
                        return answer["result"]["result"]["value"]
        raise AssertionError("no answer from chromium's DevTools socket")
    finally:
        proc.kill()
        await proc.wait()


async def test_in_a_german_browser_the_hit_ratio_is_written_as_the_counts_beside_it(tmp_path):
    """Counts and axis ticks are in the reader's locale (12.480 requests, 0,2 s), but
    the hit ratio was always written with a point: 12.5% beside them, which a German
    reader takes for twelve and a half thousand or a typo."""
    stats = {**_idle_stats([]), "totals": {"requests": 12_480, "engine_requests": 12_480, "prompt_tokens": 1000,
                                           "cached_tokens": 125, "hit_ratio": 0.125}}
    async with _scripted_page(lambda request: aiohttp.web.json_response(stats)) as url:
        summary = await dom_in_real_time(tmp_path, url + "/dashboard", 3.0,
                                         'document.getElementById("summary").textContent', locale="de-DE")
    assert summary.startswith("12.480 requests · hit ratio 12,5% since "), summary


async def test_a_gateway_that_takes_the_connection_but_never_answers_greys_the_page(tmp_path):
    """A gateway whose loop is stopped, or a restart still loading its model on a
    port it has taken, accepts the page's fetch and says nothing: the fetch had no
    deadline, so the page kept its last figures as live, with no word of it."""
    answers = []

    async def stats_then_silence(request):
        answers.append(request)
        if len(answers) > 1:
            await asyncio.sleep(60)
        return aiohttp.web.json_response(
            _idle_stats([{"name": "r", "healthy": True, "inflight": 0, "cache": {}, "policy": {}}]))

    async with _scripted_page(stats_then_silence) as url:
        dom = await dom_in_real_time(tmp_path, url + "/dashboard", 10.0)  # 2 s between polls, 5 s deadline
    assert len(answers) >= 2 and re.search(r'<body[^>]*data-stale="1"', dom), dom[-1500:]
    error = re.search(r'id="error">([^<]*)</span>', dom).group(1)
    assert re.fullmatch(r"lost contact with the gateway since \d\d:\d\d:\d\d \(no answer in 5 s\): figures frozen", error), error


async def test_a_gateway_that_stops_answering_leaves_the_page_greyed_and_saying_since_when(tmp_path):
    """The page kept showing the last figures as live after the gateway died (its
    only sign "TypeError: Failed to fetch"): it now greys them and says since when
    it has had no answer.  A replica with no figures (down) shows them as unknown,
    not as "0" fallbacks and a green "off"; long replica names are cut to their
    bars; an empty tier (no host tier) takes no bar."""
    long_name = "inference-engine-replica-in-the-eu-west-zone-number-0"
    blocks = {"device": {"free": 10, "cached": 20, "in_use": 2}, "host": {"free": 0, "cached": 0, "in_use": 0}}
    replicas = [{"name": f"{long_name}{i}", "healthy": i == 0, "inflight": 0, "cache": blocks if i == 0 else {},
                 "policy": {"name": "wa", "active": "wa", "fallbacks": 2, "reuse_alarm": False,
                            "traffic_spike": False} if i == 0 else {}} for i in range(4)]
    replicas[1]["cache"] = blocks
    stats = {"now": 30.0, "sample_s": 5.0, "history": [
        {"t": 25.0, "partial": False, "idle": False, "hit_ratio": {"to-c": 0.5}, "ttft_p50": 0.1, "ttft_p99": 0.2,
         "rps": {replicas[0]["name"]: 1.0}}], "replicas": replicas,
        "totals": {"requests": 3, "engine_requests": 3, "prompt_tokens": 30, "cached_tokens": 15, "hit_ratio": 0.5}}
    answers = []
    stats_once = _once_then_gone(stats, answers)

    dom = await _page_dom(tmp_path, stats_once)
    assert len(answers) >= 2
    assert re.search(r'<body[^>]*data-stale="1"', dom), dom[:1500]
    error = re.search(r'id="error">([^<]*)</span>', dom).group(1)
    assert re.fullmatch(r"lost contact with the gateway since \d\d:\d\d:\d\d \(/stats answered 503\): figures frozen",
                        error), error
    assert "3 requests · hit ratio 50.0% since start · 1/4 replicas healthy" in dom
    rows = re.findall(r"<tr>(.*?)</tr>", re.search(r"<tbody>(.*?)</tbody>", dom, re.S).group(1), re.S)
    assert "<td>2</td>" in rows[0] and '<span class="ok">off</span>' in rows[0]
    assert rows[1].count('<span class="unknown">-</span>') == 5 and "off" not in rows[1] and "<td>0</td>" not in rows[1]
    labels = re.search(r'<canvas[^>]*id="cache"[^>]*data-labels="([^"]*)"', dom).group(1).split("|")
    assert len(labels) == 2 and all(label.startswith("…") and label.endswith(" device") for label in labels), labels


async def test_on_a_phone_the_policy_table_shows_each_replicas_health(tmp_path):
    """Replica names of 50 characters, unwrapped, took a 400 px window's whole width:
    the healthy column (a replica down in red) was out of view, and the rows read
    alike, each name cut at the same place.  The names wrap now."""
    long_names = [f"inference-engine-replica-in-the-eu-west-zone-number-{i}" for i in range(3)]
    replicas = [{"name": n, "healthy": i != 1, "inflight": 0, "cache": {}, "policy": {}} for i, n in enumerate(long_names)]

    async def stats(request):
        return aiohttp.web.json_response(_idle_stats(replicas))

    # A phone's width: the page in a 400 px frame (headless Chromium keeps its window wider).
    phone = {"/phone": lambda request: aiohttp.web.Response(
        text='<iframe src="dashboard" width="400" height="900" style="border:0"></iframe>', content_type="text/html")}
    async with _scripted_page(stats, **phone) as url:
        # Each row: the right edge of its healthy cell and of its name cell's text, against the window's width.
        shown = await dom_in_real_time(tmp_path, url + "/phone", 4.0, """(doc => JSON.stringify({
            width: doc.documentElement.clientWidth,
            rows: [...doc.querySelectorAll("#policy tbody tr")].map(row => ({
                healthy: row.cells[1].getBoundingClientRect().right, text: row.cells[1].textContent,
                name: row.cells[0].scrollWidth <= row.cells[0].clientWidth}))}))(frames[0].document)""")
    shown = json.loads(shown)
    assert shown["width"] <= 400 and [row["text"] for row in shown["rows"]] == ["yes", "no", "yes"], shown
    assert all(row["healthy"] <= shown["width"] and row["name"] for row in shown["rows"]), shown
