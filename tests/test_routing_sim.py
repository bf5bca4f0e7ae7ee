"""The routing simulation: N block pools behind the real router, driven by a trace."""

from __future__ import annotations

import json

from engine import synth
from engine.traces import load_trace
from gateway.cli import main
from gateway.config import RouterConfig
from gateway.router import BackendLoad
from gateway import routing_sim
from gateway.routing_sim import load_imbalance, run_routing, simulate
from tests.engine_helpers import noting_stdout


def _trace(tmp_path, profile="to-c", duration=240.0):
    path = tmp_path / f"{profile}.jsonl"
    synth.write_trace(synth.synthesize(profile, duration, 4.0, 3), str(path))
    return load_trace(path)


def test_prefix_aware_beats_round_robin_and_stays_balanced(tmp_path):
    trace = _trace(tmp_path)
    capacity = max(16, trace.unique_blocks() // 50)
    results = {r.routing: r for r in run_routing(trace, ["prefix-aware", "round-robin", "least-load", "session"], 4,
                                                 ["lru"], [capacity])}
    pa, rr = results["prefix-aware"], results["round-robin"]
    assert pa.hit_ratio > rr.hit_ratio
    assert pa.load_imbalance <= 1.3
    assert 0 < pa.pooled_hit_ratio and pa.share_of_pooled == pa.hit_ratio / pa.pooled_hit_ratio
    assert all(r.accesses == trace.accesses and sum(r.per_replica_accesses) == trace.accesses for r in results.values())


def test_one_replica_equals_plain_replay(tmp_path):
    from engine.replay import replay

    trace = _trace(tmp_path, "to-b", 120.0)
    capacity = max(16, trace.unique_blocks() // 20)
    single = simulate(trace, "prefix-aware", 1, capacity, "lru", None, RouterConfig())
    assert abs(single.hit_ratio - replay(trace, "lru", capacity).hit_ratio) < 1e-12
    assert single.decisions == {"only": len(trace.requests)}


def test_recordings_replay_per_replica_as_in_plain_replay(tmp_path):
    """A recording's uncacheable tail block and cached answer blocks count the same
    behind the router as in one pool: with room for everything and one
    conversation, every routing that keeps it on one replica equals the pooled cache."""
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 40, "output_length": 40,
         "hash_ids": [1, 2, 3], "cacheable_blocks": 2, "output_hash_ids": [4, 5]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 100.0, "input_length": 90, "output_length": 10,
         "hash_ids": [1, 2, 4, 5, 6, 7], "cacheable_blocks": 5},
        {"chat_id": 3, "parent_chat_id": 2, "timestamp": 200.0, "input_length": 90, "output_length": 10,
         "hash_ids": [1, 2, 4, 5, 6, 7], "cacheable_blocks": 5},
    ]
    path = tmp_path / "recording.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    trace = load_trace(path)
    results = {r.routing: r for r in run_routing(trace, ["session", "prefix-aware"], 2, ["lru"], [1000])}
    # Turn 2 hits 1, 2 and the answer's 4, 5; turn 3 also 6 (7 is its uncacheable tail): 9 of 15.
    assert results["session"].pooled_hit_ratio == 9 / 15
    assert all(r.hit_ratio == 9 / 15 for r in results.values())


def test_recordings_hold_their_blocks_per_replica_as_in_plain_replay(tmp_path):
    """A recording's request holds its blocks until it ended (duration_s) behind the
    router too: A's blocks, held while B and C come, are not C's to evict, so D hits them."""
    from engine.replay import replay

    trace = _rows(tmp_path, [
        {"chat_id": 1, "timestamp": 0.0, "input_length": 32, "hash_ids": [1, 2], "session_id": 1, "duration_s": 10.0},
        {"chat_id": 2, "timestamp": 1.0, "input_length": 32, "hash_ids": [3, 4], "session_id": 1},
        {"chat_id": 3, "timestamp": 2.0, "input_length": 32, "hash_ids": [5, 6], "session_id": 1},
        {"chat_id": 4, "timestamp": 3.0, "input_length": 32, "hash_ids": [1, 2], "session_id": 1},
    ])
    assert replay(trace, "lru", 4).hit_ratio == 2 / 8
    (routed,) = run_routing(trace, ["session"], 2, ["lru"], [4])
    assert sorted(routed.per_replica_accesses) == [0, 8]  # one session: one replica, as one pool
    assert routed.hit_ratio == 2 / 8


def test_load_imbalance():
    assert load_imbalance([10, 10, 10, 10]) == 1.0
    assert load_imbalance([20, 10, 10, 0]) == 2.0
    assert load_imbalance([0, 0]) == 1.0


def test_cli_routing_json(tmp_path, capsys):
    trace_path = tmp_path / "t.jsonl"
    synth.write_trace(synth.synthesize("mixed", 120.0, 3.0, 5), str(trace_path))
    out = tmp_path / "r.json"
    code = main(["replay", str(trace_path), "--replicas", "3", "--routing", "prefix-aware,round-robin",
                 "--policies", "lru", "--capacity", "0.05", "--json", str(out), "--no-progress"])
    assert code == 0
    table = capsys.readouterr().out
    assert "prefix-aware" in table and "imbalance" in table and "vs pooled" in table
    data = json.loads(out.read_text())
    assert data["replicas"] == 3
    assert [r["routing"] for r in data["results"]] == ["prefix-aware", "round-robin"]
    assert all(r["replicas"] == 3 and r["load_imbalance"] >= 1.0 for r in data["results"])
    assert main(["replay", str(trace_path), "--replicas", "2", "--routing", "nope", "--no-progress"]) == 2
    assert "names no sessions" not in table


def test_cli_says_when_session_routing_has_no_sessions(tmp_path, capsys):
    trace_path = tmp_path / "m.jsonl"
    trace_path.write_text("".join(
        json.dumps({"timestamp": 1000 * i, "input_length": 1024, "output_length": 8, "hash_ids": [i % 3, i]}) + "\n"
        for i in range(40)
    ))
    assert main(["replay", str(trace_path), "--replicas", "2", "--routing", "session,least-load", "--policies", "lru",
                 "--capacity-blocks", "4", "--no-progress"]) == 0
    assert "names no sessions (Mooncake): session routing fell back to least-load" in capsys.readouterr().out


def test_backend_reported_load_steers_the_router():
    from gateway.router import ExactIndex, Router

    router = Router(RouterConfig(), ["a", "b"], block_size=16)
    idx = [ExactIndex(), ExactIndex()]
    router.set_external_load(0, BackendLoad(waiting=4, kv_usage=0.5))
    assert router.external_tokens == [4 * 1024, 0]
    assert all(router.choose([1, 2], idx, [True, True]).replica == 1 for _ in range(4))
    router.set_external_load(0, BackendLoad(waiting=0, kv_usage=1.0))  # a full KV cache: 4 requests' worth
    assert router.external_tokens[0] == 4 * 1024
    router.set_external_load(0, BackendLoad(waiting=0, kv_usage=None))
    assert router.external_tokens == [0, 0]
    # In-flight accounting is untouched by it.
    assert router.inflight_tokens == [0, 0]


def test_a_shared_engine_prices_only_the_requests_other_gateways_sent():
    from gateway.router import Router

    router = Router(RouterConfig(), ["a", "b"], block_size=16)
    tickets = [router.acquire(0, 100) for _ in range(3)]
    # The engine holds 5 requests: our 3 and 2 from elsewhere.
    router.set_external_load(0, BackendLoad(waiting=0.0, kv_usage=0.2, held=5))
    assert router.external_tokens[0] == int(2 * router._mean_request_tokens)
    # Ours only (or fewer: ours still in transit): nothing from elsewhere, and the KV
    # pressure of a full cache is our requests', priced by their own tokens already.
    for held, usage in ((3, 0.2), (1, 0.2), (3, 1.0)):
        router.set_external_load(0, BackendLoad(waiting=0.0, kv_usage=usage, held=held))
        assert router.external_tokens[0] == 0
    # A full cache that others share: their share of its pressure (3 of the 6 requests: 2 of 4 requests' worth).
    router.set_external_load(0, BackendLoad(waiting=0.0, kv_usage=1.0, held=6))
    assert router.external_tokens[0] == int((3 + 4 * 3 / 6) * router._mean_request_tokens)
    for ticket in tickets:
        router.release(ticket)
    router.set_external_load(0, BackendLoad(waiting=0.0, kv_usage=0.2, held=5))
    assert router.external_tokens[0] == int(5 * router._mean_request_tokens)


def test_cli_says_that_belady_is_skipped_across_replicas(tmp_path, capsys):
    trace_path = tmp_path / "t.jsonl"
    synth.write_trace(synth.synthesize("mixed", 60.0, 3.0, 5), str(trace_path))
    out = tmp_path / "r.json"
    assert main(["replay", str(trace_path), "--replicas", "2", "--routing", "round-robin", "--policies", "belady,lru",
                 "--capacity-blocks", "2000", "--host-blocks", "16", "--json", str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("kvgate: belady skipped: it needs each replica's future, which depends on the routing "
                            "(not simulated across replicas)\n")
    assert "host tier 16 blocks" in captured.out.split("routing ")[0]
    assert [r["policy"] for r in json.loads(out.read_text())["results"]] == ["lru"]
    # Not named, not mentioned.
    assert main(["replay", str(trace_path), "--replicas", "2", "--routing", "round-robin", "--policies", "lru",
                 "--capacity-blocks", "2000", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_cli_prints_each_routing_row_as_it_finishes(tmp_path, capsys, monkeypatch):
    import gateway.routing_sim

    printed_before: list[str] = []  # stdout written before each simulation starts
    monkeypatch.setattr(gateway.routing_sim, "simulate", noting_stdout(gateway.routing_sim.simulate, capsys, printed_before))
    trace_path = tmp_path / "t.jsonl"
    synth.write_trace(synth.synthesize("mixed", 60.0, 3.0, 5), str(trace_path))
    assert main(["replay", str(trace_path), "--replicas", "2", "--routing", "prefix-aware,round-robin",
                 "--policies", "lru", "--capacity-blocks", "64", "--no-progress"]) == 0
    printed = "".join(printed_before) + capsys.readouterr().out
    assert printed_before[0].startswith("trace ") and "vs pooled" in printed_before[0]
    assert [line.split()[0] for line in printed_before[1].splitlines()] == ["prefix-aware"]
    assert [line.split()[0] for line in printed.splitlines() if line.startswith(("prefix-aware", "round-robin"))] == [
        "prefix-aware", "round-robin"]


def _rows(tmp_path, rows):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_trace(path)


def _two_readers_of_one_document(tmp_path, gap_s):
    """One long document read by two requests ``gap_s`` apart, the first still in
    flight when the second comes (so load alone would send it elsewhere)."""
    doc = list(range(1, 41))
    return _rows(tmp_path, [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 640, "output_length": 200,
         "hash_ids": doc},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": gap_s, "input_length": 656, "output_length": 10,
         "hash_ids": doc + [41]},
    ])


def test_kv_events_that_lag_hide_a_prefix_from_the_router(tmp_path):
    trace = _two_readers_of_one_document(tmp_path, 0.5)
    exact = simulate(trace, "prefix-aware", 2, 1000, "lru", None, RouterConfig())
    assert exact.hit_ratio == 40 / 81 and exact.per_replica_accesses in ([81, 0], [0, 81])
    # The same events, one second late: the router has not heard of the document yet.
    late = simulate(trace, "prefix-aware", 2, 1000, "lru", None, RouterConfig(), index_lag_s=1.0)
    assert late.decisions == {"load": 2} and late.hit_ratio == 0 and sorted(late.per_replica_accesses) == [40, 41]
    # Late, but not too late for a reader who comes after them.
    later = simulate(_two_readers_of_one_document(tmp_path, 2.0), "prefix-aware", 2, 1000, "lru", None,
                     RouterConfig(), index_lag_s=1.0)
    assert later.hit_ratio == 40 / 81


def test_an_approximate_index_remembers_what_it_sent_for_its_time_to_live(tmp_path):
    trace = _two_readers_of_one_document(tmp_path, 30.0)
    kept = simulate(trace, "prefix-aware", 2, 1000, "lru", None, RouterConfig(), index="approx")
    assert kept.hit_ratio == 40 / 81 and kept.decisions == {"load": 1, "prefix": 1}
    forgot = simulate(trace, "prefix-aware", 2, 1000, "lru", None, RouterConfig(approx_ttl_s=10.0), index="approx")
    assert forgot.decisions == {"load": 2} and forgot.hit_ratio == 0


def test_cli_routing_json_says_what_the_router_knew(tmp_path, capsys):
    _trace(tmp_path, "to-b", 60.0)
    out = tmp_path / "r.json"
    assert main(["replay", str(tmp_path / "to-b.jsonl"), "--replicas", "2", "--routing", "prefix-aware", "--policies", "lru", "--capacity", "0.1",
                 "--index-lag", "0.25", "--json", str(out), "--no-progress"]) == 0
    assert "router index: KV events 0.25 s late" in capsys.readouterr().out
    result = json.loads(out.read_text())["results"][0]
    assert result["index"] == "exact" and result["index_lag_s"] == 0.25


def test_cli_index_flags_need_a_routing_that_reads_the_index(tmp_path, capsys):
    _trace(tmp_path, "to-b", 60.0)
    trace = str(tmp_path / "to-b.jsonl")
    for flags, first in ((["--index", "approx"], "--index approx"), (["--index-lag", "2"], "--index-lag")):
        assert main(["replay", trace, "--replicas", "2", "--routing", "least-load,round-robin", "--policies", "lru",
                     "--capacity", "0.1", *flags, "--no-progress"]) == 2
        captured = capsys.readouterr()
        assert captured.err == (f"kvgate: {first}: only prefix-aware routing reads the index; add it to --routing\n")
        assert captured.out == ""


def test_the_routing_plot_title_names_the_index(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    titles = []
    real = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda fig, text, **kw: titles.append(text) or real(fig, text, **kw))
    _trace(tmp_path, "to-b", 60.0)
    assert main(["replay", str(tmp_path / "to-b.jsonl"), "--replicas", "2", "--routing", "prefix-aware",
                 "--policies", "lru", "--capacity", "0.1", "--index", "approx", "--plot", str(tmp_path / "r.png"),
                 "--no-progress"]) == 0
    [title] = titles
    assert title.endswith("2 replicas; router index: approximate (what was sent where, as for an external server)")


def test_the_approximate_index_capacity_counts_the_gateway_blocks_not_the_trace_blocks(tmp_path, monkeypatch):
    """router.approx_capacity_blocks is in engine.block_size blocks; a Mooncake block holds
    512 tokens, 32 of the gateway's, so 1,280 gateway blocks remember 40 trace blocks."""
    doc = list(range(1, 41))
    trace = _rows(tmp_path, [
        {"timestamp": 0, "input_length": 40 * 512, "output_length": 200, "hash_ids": doc},
        {"timestamp": 1000, "input_length": 41 * 512, "output_length": 10, "hash_ids": doc + [41]},
    ])
    assert trace.block_tokens == 512
    made = []
    real = routing_sim.ApproxIndex
    monkeypatch.setattr(routing_sim, "ApproxIndex",
                        lambda ttl_s, capacity, clock: made.append(capacity) or real(ttl_s, capacity, clock=clock))
    for capacity in (1280, 1279):
        out = simulate(trace, "prefix-aware", 2, 1000, "lru", None, RouterConfig(approx_capacity_blocks=capacity),
                       index="approx", gateway_block_tokens=16)
        # The second prompt goes where the first went: one gateway block short, the
        # index forgets the prompt's last trace block, not its first (a tail goes first).
        assert out.hit_ratio == 40 / 81 and out.decisions["prefix"] == 1, capacity
    assert made == [40, 40, 39, 39]
