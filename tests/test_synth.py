"""`kvgate synth`: determinism, Bailian format, and calibration bands around the paper's figures."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from engine import synth
from engine.traces import load_trace

HOUR = 3600.0
RATE = 2.0  # one hour at 2 req/s: enough for stable statistics, a few seconds per profile


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """profile -> (records, loaded trace, statistics), built once."""
    out = {}
    folder = tmp_path_factory.mktemp("synth")
    for profile in synth.PROFILES:
        records = synth.synthesize(profile, HOUR, RATE, seed=7)
        path = folder / f"{profile}.jsonl"
        synth.write_trace(records, path)
        trace = load_trace(path, "bailian")
        out[profile] = (records, trace, synth.trace_statistics(trace))
    return out


# -- determinism and format ----------------------------------------------------


def test_same_seed_same_bytes(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    synth.write_trace(synth.synthesize("mixed", 600, 3, seed=11), first)
    synth.write_trace(synth.synthesize("mixed", 600, 3, seed=11), second)
    assert first.read_bytes() == second.read_bytes()
    assert synth.synthesize("mixed", 600, 3, seed=12) != synth.synthesize("mixed", 600, 3, seed=11)


def test_a_gz_name_gets_a_gzipped_trace(tmp_path):
    import gzip

    records = synth.synthesize("mixed", 120, 2, seed=11)
    plain, zipped = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    synth.write_trace(records, plain)
    synth.write_trace(records, zipped)
    assert gzip.decompress(zipped.read_bytes()) == plain.read_bytes()
    again = tmp_path / "again.jsonl.gz"
    synth.write_trace(records, again)
    assert again.read_bytes() == zipped.read_bytes()  # no name or time in the gzip header
    assert len(load_trace(zipped).requests) == len(records)


@pytest.mark.parametrize("profile", synth.PROFILES)
def test_records_are_valid_bailian(traces, profile):
    records, trace, _ = traces[profile]
    assert len(trace.requests) == len(records) > 1000
    fields = ["chat_id", "parent_chat_id", "timestamp", "input_length", "output_length", "type", "turn", "hash_ids"]
    by_id = {}
    previous = -1.0
    for record in records:
        assert list(record) == fields
        assert record["timestamp"] >= previous
        previous = record["timestamp"]
        assert 0 <= record["timestamp"] < HOUR
        assert len(record["hash_ids"]) == math.ceil(record["input_length"] / 16) > 0
        assert record["output_length"] > 0
        assert record["type"] in (("api",) if profile == "to-b" else ("text", "search", "image", "file", "api"))
        assert record["chat_id"] not in by_id
        by_id[record["chat_id"]] = record
        if record["parent_chat_id"] == -1:
            assert record["turn"] == 1
            continue
        parent = by_id[record["parent_chat_id"]]  # parents come first
        assert record["turn"] == parent["turn"] + 1
        assert record["type"] == parent["type"]
        assert record["timestamp"] > parent["timestamp"]
        # The follow-up's prompt = the parent's prompt + its answer + new tokens.
        assert record["input_length"] > parent["input_length"] + parent["output_length"]
        full = parent["input_length"] // 16
        assert record["hash_ids"][:full] == parent["hash_ids"][:full]


def test_follow_up_prefix_hits_in_replay_keys(traces):
    records, trace, _ = traces["to-c"]
    index = {r.context.chat_id: r for r in trace.requests}
    follow_ups = [r for r in trace.requests if r.context.parent_chat_id >= 0]
    assert follow_ups
    for request in follow_ups[:200]:
        parent = index[request.context.parent_chat_id]
        full = parent.input_length // 16
        assert request.keys[:full] == parent.keys[:full]


def test_file_requests_start_with_a_template_block(traces):
    records, _, _ = traces["to-c"]
    firsts = Counter(r["hash_ids"][0] for r in records if r["type"] == "file" and r["turn"] == 1)
    assert sum(firsts.values()) > 100
    assert len(firsts) <= synth.FILE_TEMPLATES
    assert firsts.most_common(1)[0][1] > 10  # templates are shared across documents
    # Beyond the template the documents differ.
    seconds = Counter(r["hash_ids"][2] for r in records if r["type"] == "file" and r["turn"] == 1)
    assert seconds.most_common(1)[0][1] == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (("to-x", 60, 1, 0), "unknown profile"),
        (("to-c", 0, 1, 0), "duration"),
        (("to-c", -5, 1, 0), "duration"),
        (("to-c", float("nan"), 1, 0), "duration"),
        # Timestamps past 1e15 s are out of range for every trace reader (engine/traces.py):
        # the file written would be refused by replay and synth --stats.
        (("to-c", 1e16, 1e-13, 0), "duration 1e\\+16 s is past the 1e\\+15 s"),
        (("to-c", 60, 0, 0), "rate"),
        (("to-c", 60, float("inf"), 0), "rate"),
        (("to-c", 60, "5", 0), "rate"),
        (("to-c", 60, 1, -1), "seed"),
    ],
)
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message) as info:
        synth.synthesize(*args)
    assert "\n" not in str(info.value)


def test_more_requests_than_memory_holds_are_refused_up_front(monkeypatch):
    """Linux's OOM killer would end the run with no word; the figures in the
    message are readable however absurd the arguments."""
    monkeypatch.setattr(synth, "_physical_memory_bytes", lambda: 8 * 2**30)
    with pytest.raises(ValueError, match=r"asks for 360,000 requests, which take ~11 GiB to generate; "
                                         r"this machine has 8 GiB"):
        synth.synthesize("to-c", 3600, 100, seed=0)
    with pytest.raises(ValueError, match=r"asks for 100,000,000 requests; at most 20,000,000$"):
        synth.synthesize("to-c", 1e6, 100, seed=0)
    # Just above the bound reads as above it (3 significant digits said "2e+07").
    with pytest.raises(ValueError, match=r"asks for 20,000,001 requests; at most 20,000,000$"):
        synth.synthesize("to-c", 4000.0002, 5000, seed=0)
    with pytest.raises(ValueError, match=r"^rate 1e\+300 requests per second is above the 10,000 a trace may have$"):
        synth.synthesize("to-c", 1e-6, 1e300, seed=0)
    # Just above the bound reads as above it (3 significant digits said "1e+04").
    with pytest.raises(ValueError, match=r"^rate 10,001 requests per second is above the 10,000 a trace may have$"):
        synth.synthesize("to-c", 1e-6, 10_001, seed=0)
    # A to-B trace of a moment at the highest rate builds no more tenants than it has calls.
    assert len(synth.synthesize("to-b", 1e-3, 10_000, seed=0)) < 40


def test_rate_is_requests_per_second():
    for profile in synth.PROFILES:
        count = len(synth.synthesize(profile, 1800, 4, seed=3))
        assert 0.8 * 7200 < count < 1.25 * 7200, profile


# -- calibration against the paper ------------------------------------------------


def test_to_c_statistics(traces):
    _, _, stats = traces["to-c"]
    assert 0.50 <= stats["ideal_hit_ratio"] <= 0.72
    assert 0.73 <= stats["type_mix"]["text"] <= 0.83
    assert set(stats["type_mix"]) == {"text", "search", "image", "file"}
    assert 0.42 <= stats["next_turn_after_first"] <= 0.58
    assert 0.72 <= stats["next_turn_after_later"] <= 0.88
    by_type = {name: value["p50"] for name, value in stats["reuse_time_multi_turn_by_type_s"].items()}
    assert by_type["image"] < by_type["text"] < by_type["search"] < by_type["file"]
    assert stats["reuse_within_600s"] >= 0.75
    assert 300 <= stats["lifespan_s"]["p90"] <= 1200
    assert stats["top10_reuse_share"] >= 0.45
    assert stats["cross_session_hit_share"] < 0.2  # cross-user reuse is rare: shared system prompts only
    assert 800 <= stats["input_tokens"]["p50"] <= 2500
    assert 100 <= stats["output_tokens"]["p50"] <= 500


def test_to_b_statistics(traces):
    records, _, stats = traces["to-b"]
    assert 0.45 <= stats["ideal_hit_ratio"] <= 0.65
    assert stats["type_mix"] == {"api": 1.0}
    assert stats["multi_turn_requests"] < 0.002
    assert stats["single_turn_hit_share"] >= 0.97
    assert 0.70 <= stats["reuse_within_10s"] <= 0.92
    assert stats["lifespan_s"]["p90"] <= 0.3
    assert 1000 <= stats["input_tokens"]["p50"] <= 3000
    # Scheduled jobs: the first minute of the hour is busier than a typical minute.
    minutes = np.bincount([int(r["timestamp"] // 60) for r in records], minlength=60)
    assert minutes[0] > 1.5 * np.median(minutes)
    assert stats["top_of_hour_minute_ratio"] > 1.5


def test_mixed_statistics(traces):
    _, _, stats = traces["mixed"]
    assert 0.32 <= stats["type_mix"]["api"] <= 0.48
    assert 0.45 <= stats["ideal_hit_ratio"] <= 0.70
    # Turn statistics of a mixed trace describe its chat population.
    assert 0.42 <= stats["next_turn_after_first"] <= 0.58


def test_statistics_table_names_the_paper_figures(traces):
    for profile in synth.PROFILES:
        table = synth.format_statistics(traces[profile][2])
        assert "ideal hit ratio" in table and "paper" in table.splitlines()[0]
    assert "62.0%" in synth.format_statistics(traces["to-c"][2])
    assert "54.0%" in synth.format_statistics(traces["to-b"][2])
    json.dumps(traces["to-c"][2])  # plain data, ready for --json style use


def test_a_short_traces_next_turn_figures_are_marked_and_shares_of_no_hits_are_na(tmp_path, traces):
    """Next-turn probabilities leave out the last 10 minutes, which a trace of 20
    minutes or less cannot spare: its figures keep the turns whose next turn may
    fall after the end, run low, and are marked so.  A share of hits, when there
    are none, is no 0%."""
    assert "(short trace: low)" not in synth.format_statistics(traces["to-c"][2])
    path = tmp_path / "short.jsonl"
    synth.write_trace(synth.synthesize("to-c", 600.0, RATE, seed=7), path)
    table = synth.format_statistics(synth.trace_statistics(load_trace(path, "bailian")))
    marked = [line for line in table.splitlines() if "(short trace: low)" in line]
    assert [line.split("  ")[0] for line in marked] == [
        "multi-turn sessions (first turns followed)", "P(next turn | turn 1)", "P(next turn | turn >= 2)"]
    lone = tmp_path / "lone.jsonl"
    lone.write_text(json.dumps({"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 32,
                                "output_length": 4, "type": "text", "turn": 1, "hash_ids": [1, 2]}) + "\n")
    table = synth.format_statistics(synth.trace_statistics(load_trace(lone, "bailian")))
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert rows["hits from single-turn requests"].split()[-1] == "n/a"
    assert rows["hits on blocks another session created"].split()[-1] == "n/a"
