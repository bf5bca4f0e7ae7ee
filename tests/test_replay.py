import heapq
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.replay import replay
from engine.traces import load_trace
from gateway.cli import main
from tests.engine_helpers import interrupt_on_call, noting_stdout

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def mooncake():
    if not MOONCAKE.exists():
        pytest.fail(f"the shared Mooncake trace is missing at {MOONCAKE}")
    return load_trace(MOONCAKE)


def independent_lru_prefix(trace, capacity):
    """A second LRU with the same semantics, built differently (heap of release stamps).

    Prefix hits; every key touched or inserted; release tail first; keys of
    the request being served cannot be evicted.
    """
    cached, stamp, heap = set(), {}, []
    clock = hits = accesses = 0
    for request in trace.requests:
        in_use = set()
        leading = True
        for key in request.keys:
            if key in cached:
                hits += leading
                in_use.add(key)
                continue
            leading = False
            if len(cached) >= capacity:
                victim = None
                while heap:
                    s, candidate = heapq.heappop(heap)
                    if candidate in cached and stamp[candidate] == s and candidate not in in_use:
                        victim = candidate
                        break
                if victim is None:
                    break
                cached.discard(victim)
            cached.add(key)
            in_use.add(key)
        accesses += len(request.keys)
        for key in reversed(request.keys):
            if key in cached:
                clock += 1
                stamp[key] = clock
                heapq.heappush(heap, (clock, key))
    return hits / accesses


def test_mooncake_reference_figures(mooncake):
    assert mooncake.unique_blocks() == 43924
    assert mooncake.ideal_hit_ratio() == pytest.approx(0.640, abs=0.0005)
    assert replay(mooncake, "lru", 4392).hit_ratio == pytest.approx(0.262, abs=0.0005)
    assert replay(mooncake, "belady", 4392).hit_ratio == pytest.approx(0.506, abs=0.001)


@pytest.mark.parametrize("capacity", [439, 2196, 8785])
def test_lru_matches_an_independent_simulator(mooncake, capacity):
    assert round(replay(mooncake, "lru", capacity).hit_ratio, 3) == round(independent_lru_prefix(mooncake, capacity), 3)


def write_bailian(path, requests=400, seed=3):
    """Sessions with growing prompts over a few shared system prompts."""
    rng = random.Random(seed)
    lines, sessions, next_id = [], {}, 1000
    for chat_id in range(requests):
        t = chat_id * 0.5
        if sessions and rng.random() < 0.5:
            parent = rng.choice(list(sessions))
            ids = sessions.pop(parent) + [next_id + i for i in range(rng.randint(1, 4))]
            turn = 2
        else:
            parent, turn = -1, 1
            ids = [rng.randrange(3)] + [next_id + i for i in range(rng.randint(2, 8))]
        next_id += 10
        sessions[chat_id] = ids
        lines.append(json.dumps({"chat_id": chat_id, "parent_chat_id": parent, "timestamp": t,
                                 "input_length": len(ids) * 16, "output_length": 20, "type": "text",
                                 "turn": turn, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bailian_lru_matches_an_independent_simulator(tmp_path):
    trace = load_trace(write_bailian(tmp_path / "b.jsonl"))
    assert trace.format == "bailian"
    for capacity in (20, 60, 200):
        assert round(replay(trace, "lru", capacity).hit_ratio, 3) == round(independent_lru_prefix(trace, capacity), 3)


def test_a_recorded_request_holds_its_blocks_until_it_ends(tmp_path):
    """The engine holds a request's blocks from its start to its end and releases
    them then; replay released them at arrival.  Here a request lasting 10 s (a
    recording's duration_s) keeps its two blocks from the next request's
    evictions, and a third request after it ends finds them; its answer's block
    is cached at its end.  A trace without durations replays as before."""
    def line(chat_id, timestamp, ids, **extra):
        return {"chat_id": chat_id, "timestamp": timestamp, "input_length": 16 * len(ids), "output_length": 1,
                "hash_ids": ids, "cacheable_blocks": len(ids), **extra}

    rows = [line(1, 0.0, [1, 2], duration_s=10.0, output_hash_ids=[9]), line(2, 1.0, [3, 4, 5]),
            line(3, 20.0, [1, 2, 9, 6])]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    held = load_trace(path)
    assert [r.duration for r in held.requests] == [10.0, 0.0, 0.0]
    # 4 blocks: the second request takes the 2 free ones only (no room for its third
    # key); the third hits the first's two and its answer's (the last is its own).
    assert replay(held, "lru", 4).hits == 3
    for row in rows:
        row.pop("duration_s", None)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # Released at once: the second request evicted the answer's block and the second one.
    assert replay(load_trace(path), "lru", 4).hits == 1


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path):
    import gzip

    from engine.traces import TraceError

    plain = write_bailian(tmp_path / "b.jsonl")
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_trace(plain), load_trace(packed)
    assert [(r.timestamp, r.keys, r.input_length) for r in a.requests] == \
        [(r.timestamp, r.keys, r.input_length) for r in b.requests]
    assert replay(a, "lru", 60).hit_ratio == replay(b, "lru", 60).hit_ratio
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-20])
    with pytest.raises(TraceError, match=r"cut.jsonl.gz: cannot read: Compressed file ended"):
        load_trace(cut)


def test_bailian_ids_are_chained_into_prefix_keys(tmp_path):
    path = tmp_path / "chain.jsonl"
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 32, "type": "text", "turn": 1, "hash_ids": [5, 6]},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 1, "input_length": 32, "type": "text", "turn": 1, "hash_ids": [7, 6]},
        {"chat_id": 3, "parent_chat_id": 1, "timestamp": 2, "input_length": 48, "type": "text", "turn": 2, "hash_ids": [5, 6, 8]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    trace = load_trace(path)
    first, second, third = (r.keys for r in trace.requests)
    assert first[1] != second[1]  # same block id after a different prefix
    assert third[:2] == first
    assert trace.requests[2].context.session == trace.requests[0].context.session


def test_cli_table_json_and_plot(tmp_path, capsys):
    trace = write_bailian(tmp_path / "t.jsonl")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["replay", str(trace), "--policies", "lru,fifo,s3fifo,belady", "--capacity", "0.05,0.2,0.9",
                 "--json", str(out_json), "--plot", str(out_png), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "capacity planning" in printed and "belady" in printed
    data = json.loads(out_json.read_text())
    assert set(data["trace"]) == {"path", "format", "requests", "accesses", "unique_blocks", "ideal_hit_ratio"}
    assert len(data["results"]) == 12
    row = data["results"][0]
    assert set(row) >= {"policy", "capacity_blocks", "capacity_fraction", "hit_ratio", "evictions",
                        "eviction_us_p50", "accesses_per_s"}
    by = {(r["policy"], r["capacity_blocks"]): r["hit_ratio"] for r in data["results"]}
    for capacity in {r["capacity_blocks"] for r in data["results"]}:
        assert by[("belady", capacity)] >= by[("lru", capacity)] - 1e-9
        assert by[("lru", capacity)] <= data["trace"]["ideal_hit_ratio"] + 1e-9
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 1, "input_length": 5\n', ":2: not valid JSON"),
        ('{"timestamp": 0, "input_length": "many", "hash_ids": [1]}\n', ":1: field 'input_length' must be an integer"),
        ('{"timestamp": 0, "input_length": 3, "hash_ids": [1, "x"]}\n', ":1: hash_ids must hold integers"),
        ("[1, 2]\n", ":1: expected a JSON object"),
        ('{"timestamp": 0, "input_length": 3}\n', ":1: missing field 'hash_ids'"),
        ("\n\n", "holds no requests"),
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 3, "hash_ids": [1]}\n', ":1: timestamp out of range"),
        # Each finite, but inf apart: the workload-aware policy's windows came out NaN (a traceback).
        ('{"timestamp": -1.7e308, "input_length": 3, "hash_ids": [1]}\n'
         '{"timestamp": 1.7e308, "input_length": 3, "hash_ids": [1]}\n', ":1: timestamp out of range"),
        ("[" * 100_000 + "\n", ":1: not valid JSON"),
    ],
)
def test_cli_bad_traces_give_file_line_and_status_2(tmp_path, capsys, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert main(["replay", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert expected in err and str(path) in err
    assert "Traceback" not in err


def test_a_line_of_bad_utf8_is_said_to_be_so(tmp_path, capsys):
    """json.loads would guess UTF-16 from a line's first bytes and call it no JSON."""
    good = b'{"timestamp": 0, "input_length": 3, "hash_ids": [1]}\n'
    for line, byte in ((b"\xff\xfe" + good, 1), (b'{"timestamp": 0, "x": "\xe9", "input_length": 3, "hash_ids": [1]}\n', 24)):
        path = tmp_path / "latin1.jsonl"
        path.write_bytes(good + line)
        assert main(["replay", str(path), "--no-progress"]) == 2
        assert capsys.readouterr().err == f"kvgate: {path}:2: not UTF-8 text (byte {byte} of the line)\n"
    path.write_bytes(good + b"  \xe9\n")  # the byte counts from the line's start, its leading blanks too
    assert main(["replay", str(path), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"kvgate: {path}:2: not UTF-8 text (byte 3 of the line)\n"
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\xef\xbb\xbf{\xe9\n")
    assert main(["replay", str(path), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"kvgate: {path}:2: not UTF-8 text (byte 5 of the line)\n"
    path.write_bytes(b"\xef\xbb\xbf" + good)  # a BOM is no text
    assert main(["replay", str(path), "--no-progress"]) == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc/self/mem")
def test_a_trace_whose_first_read_fails_is_one_line(capsys):
    """A file that opens but cannot be read (a failing disk, a network mount: here
    /proc/self/mem, whose offset 0 is unmapped) is `FILE: cannot read`, no traceback."""
    assert main(["replay", "/proc/self/mem", "--no-progress"]) == 2
    assert capsys.readouterr().err == "kvgate: /proc/self/mem: cannot read: Input/output error\n"


def test_cli_missing_trace_and_bad_arguments(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    trace = write_bailian(tmp_path / "t.jsonl", requests=20)
    assert main(["replay", str(trace), "--policies", "lru,lfu"]) == 2
    assert "unknown lfu" in capsys.readouterr().err
    assert main(["replay", str(trace), "--capacity", "0.1,abc"]) == 2
    assert "not a number" in capsys.readouterr().err
    assert main(["replay", str(trace), "--capacity-blocks", "-5"]) == 2
    assert "must be a positive" in capsys.readouterr().err
    assert main(["replay", str(trace), "--capacity", "nan"]) == 2
    assert "must be a positive" in capsys.readouterr().err
    assert main(["replay", str(trace), "--host-blocks", "-5"]) == 2
    assert "--host-blocks" in capsys.readouterr().err
    # Output that cannot be written is refused before the run, not after it.
    assert main(["replay", str(trace), "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "--json: cannot write" in capsys.readouterr().err
    assert main(["replay", str(trace), "--plot", str(tmp_path / "x.xyz")]) == 2
    assert "--plot" in capsys.readouterr().err


def test_a_long_gap_in_a_trace_replays_promptly(tmp_path):
    """The traffic-rhythm detector steps through trace time a minute at a time:
    a gap of years between two requests must not take years of steps."""
    path = tmp_path / "gap.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3, "hash_ids": [1]}\n'
                    '{"timestamp": 1e12, "input_length": 3, "hash_ids": [1]}\n')
    result = replay(load_trace(str(path)), "wa", 1)
    assert (result.hits, result.accesses) == (1, 2)


def test_console_script_runs(tmp_path):
    trace = write_bailian(tmp_path / "t.jsonl", requests=50)
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    done = subprocess.run([kvgate, "replay", str(trace), "--policies", "lru", "--capacity-blocks", "32"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "lru" in done.stdout and "Traceback" not in done.stderr


def test_replay_reports_wa_fallbacks_and_the_cli_keeps_policy_logs_out(tmp_path, capsys, caplog):
    """The result counts the shadow-LRU switches the policy made (one log line
    each when serving); `kvgate replay` prints them in its report instead of
    interleaving wall-clock log lines with the progress bar."""
    import logging

    import yaml

    from engine.config import CacheConfig

    path = write_bailian(tmp_path / "b.jsonl", requests=1500)
    # A twitchy fallback (short windows, no margin, no sustain) so this small trace switches.
    fallback = {"window_s": 20, "check_interval_s": 2, "min_accesses": 20, "sustain_s": 0, "margin": 0.0,
                "switch_back_margin": 0.0}
    cache = CacheConfig(workload_aware={"fallback": fallback})
    with caplog.at_level(logging.INFO, logger="kvgate.cache"):
        result = replay(load_trace(path), "wa", 40, cache)
    switches = [r for r in caplog.records if "falling back to LRU" in r.getMessage()]
    assert result.fallbacks == len(switches) > 0

    caplog.clear()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"cache": {"workload_aware": {"fallback": fallback}}}))
    with caplog.at_level(logging.INFO):
        code = main(["replay", str(path), "--policies", "wa", "--capacity-blocks", "40", "--config", str(config),
                     "--no-progress"])
    assert code == 0
    assert f"wa         @ 40 blocks: {result.fallbacks} switch(es) to LRU" in capsys.readouterr().out
    assert not [r for r in caplog.records if r.name == "kvgate.cache"]
    assert logging.getLogger("kvgate.cache").level == logging.NOTSET  # restored after the command


def test_cli_replicas_plot_hit_ratio_and_imbalance(tmp_path, capsys):
    trace = write_bailian(tmp_path / "t.jsonl", requests=120)
    out_png = tmp_path / "routing.png"
    code = main(["replay", str(trace), "--replicas", "2", "--routing", "prefix-aware,round-robin",
                 "--policies", "lru", "--capacity-blocks", "16,64", "--plot", str(out_png), "--no-progress"])
    assert code == 0
    assert "prefix-aware" in capsys.readouterr().out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_ctrl_c_during_replay_reports_the_finished_rows(tmp_path, capsys, monkeypatch):
    import engine.replay

    monkeypatch.setattr(engine.replay, "replay", interrupt_on_call(engine.replay.replay, 2))
    trace = write_bailian(tmp_path / "t.jsonl", requests=60)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["replay", str(trace), "--policies", "lru,fifo", "--capacity-blocks", "8,32",
                 "--json", str(out_json), "--plot", str(out_png), "--no-progress"])
    assert code == 130
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith(("lru ", "fifo "))]
    assert len(rows) == 1 and rows[0].split()[:2] == ["lru", "8"]
    assert "interrupted after 1 of 4 runs" in captured.err
    data = json.loads(out_json.read_text())
    assert data["interrupted"] is True
    assert [(r["policy"], r["capacity_blocks"]) for r in data["results"]] == [("lru", 8)]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("presses", [1, 2])
def test_cli_ctrl_c_while_the_plot_is_drawn(tmp_path, capsys, monkeypatch, presses):
    """Every run has finished and the plot is being drawn (a second or so): one
    Ctrl-C waits for the outputs, whole; a second stops at once and says which
    file it left unwritten.  Never a silent exit without the plot."""
    import os
    import signal

    import engine.replay_report

    draw = engine.replay_report.write_plot

    def pressed_while_drawing(path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG, the first rows")  # matplotlib writes as it goes
        for _ in range(presses):
            os.kill(os.getpid(), signal.SIGINT)  # what the terminal sends on Ctrl-C
        return draw(path, *args, **kwargs)

    monkeypatch.setattr(engine.replay_report, "write_plot", pressed_while_drawing)
    trace = write_bailian(tmp_path / "t.jsonl", requests=60)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    out_png.write_bytes(b"an earlier run's plot")
    # A shell's background job (CI may run this way) starts with SIGINT ignored; a terminal's does not.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main(["replay", str(trace), "--policies", "lru", "--capacity-blocks", "8,32",
                     "--json", str(out_json), "--plot", str(out_png), "--no-progress"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130
    err = capsys.readouterr().err
    assert "interrupted" not in json.loads(out_json.read_text())  # both runs finished
    if presses == 1:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "interrupted after every run had finished; the outputs were written first" in err
    else:  # the earlier plot stays whole rather than half replaced, and nothing is left beside it
        # ... and that --json was (it said "no file written" too).
        assert err.endswith(f"--plot {out_png} not written (interrupted while written; any earlier file there is "
                            f"unchanged); --json {out_json} written\n")
        assert out_png.read_bytes() == b"an earlier run's plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png", "t.jsonl"]


@pytest.mark.parametrize("replicas", [1, 2])
def test_cli_ctrl_c_before_any_run_leaves_the_earlier_outputs(tmp_path, capsys, monkeypatch, replicas):
    """An empty result does not replace an earlier run's --json (it did; the plot was kept)."""
    import engine.replay
    import gateway.routing_sim

    if replicas == 1:
        monkeypatch.setattr(engine.replay, "replay", interrupt_on_call(engine.replay.replay, 1))
    else:
        monkeypatch.setattr(gateway.routing_sim, "simulate", interrupt_on_call(gateway.routing_sim.simulate, 1))
    trace = write_bailian(tmp_path / "t.jsonl", requests=60)
    out_png, out_json = tmp_path / "r.png", tmp_path / "r.json"
    out_png.write_bytes(b"an earlier run's plot")
    out_json.write_text("an earlier run's results")
    code = main(["replay", str(trace), "--policies", "lru", "--capacity-blocks", "8", "--plot", str(out_png),
                 "--json", str(out_json), "--replicas", str(replicas), "--no-progress"])
    assert code == 130
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-2:] == [f"kvgate: --json {out_json}, --plot {out_png} not written: no run finished",
                                              "kvgate: interrupted before any run finished"]
    assert "capacity planning" not in captured.out  # a heading over nothing
    assert out_json.read_text() == "an earlier run's results" and out_png.read_bytes() == b"an earlier run's plot"


def test_cli_ctrl_c_during_a_routing_replay_reports_the_finished_rows(tmp_path, capsys, monkeypatch):
    import gateway.routing_sim

    monkeypatch.setattr(gateway.routing_sim, "simulate", interrupt_on_call(gateway.routing_sim.simulate, 2))
    trace = write_bailian(tmp_path / "t.jsonl", requests=60)
    out_json = tmp_path / "r.json"
    code = main(["replay", str(trace), "--replicas", "2", "--routing", "prefix-aware,round-robin",
                 "--policies", "lru", "--capacity-blocks", "16", "--json", str(out_json), "--no-progress"])
    assert code == 130
    captured = capsys.readouterr()
    assert "prefix-aware" in captured.out and "round-robin" not in captured.out
    assert "interrupted after 1 of 2 runs" in captured.err
    data = json.loads(out_json.read_text())
    assert data["interrupted"] is True and [r["routing"] for r in data["results"]] == ["prefix-aware"]


def test_cli_capacity_planning_agrees_with_the_printed_share(tmp_path, capsys):
    """The plan compares the unrounded share; the table never prints more than it.

    One hot block and 201 one-off blocks, each followed by the hot block: with
    room for one block LRU loses 201 of the ideal 3998 hits, 94.97% of the
    ideal: short of 95%, so printed as 94.9% (rounding would print 95.0%) and
    not counted as reaching 95%; with room for two it reaches 100%.
    """
    rows = [[0]] * 3798 + [ids for x in range(1, 202) for ids in ([x], [0])]
    path = tmp_path / "hot.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i * 1000, "input_length": 512, "hash_ids": ids}) + "\n"
                            for i, ids in enumerate(rows)))
    out_json = tmp_path / "r.json"
    assert main(["replay", str(path), "--policies", "lru", "--capacity-blocks", "1,2", "--json", str(out_json),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert [line.split()[4] for line in printed.splitlines() if line.startswith("lru ")] == ["94.9%", "100.0%"]
    assert "90%: 1   95%: 2" in printed
    assert json.loads(out_json.read_text())["capacity_planning"]["lru"] == {"90%": 1, "95%": 2}


def test_cli_prints_each_row_as_its_run_finishes(tmp_path, capsys, monkeypatch):
    """A replay of a long trace takes minutes per run: rows must not wait for the last run."""
    import engine.replay

    printed_before: list[str] = []  # stdout written before each run starts
    monkeypatch.setattr(engine.replay, "replay", noting_stdout(engine.replay.replay, capsys, printed_before))
    trace = write_bailian(tmp_path / "t.jsonl", requests=60)
    out_json = tmp_path / "r.json"
    assert main(["replay", str(trace), "--policies", "lru,fifo", "--capacity-blocks", "8,32", "--json", str(out_json),
                 "--no-progress"]) == 0
    printed = "".join(printed_before) + capsys.readouterr().out
    assert printed_before[0].startswith("trace ") and "policy      capacity" in printed_before[0]  # the header first
    assert [line.split()[:2] for line in printed_before[1].splitlines()] == [["lru", "8"]]
    assert [line.split()[:2] for line in printed_before[3].splitlines()] == [["fifo", "8"]]
    rows = [line.split()[:2] for line in printed.splitlines() if line.startswith(("lru ", "fifo "))]
    assert rows == [["lru", "8"], ["lru", "32"], ["fifo", "8"], ["fifo", "32"]]  # each once
    assert printed.splitlines()[-3].startswith("capacity planning")  # it needs every row: it comes last
    assert [(r["policy"], r["capacity_blocks"]) for r in json.loads(out_json.read_text())["results"]] == [
        ("lru", 8), ("lru", 32), ("fifo", 8), ("fifo", 32)]


def test_cli_host_tier_is_named_in_the_header_and_the_plot_title(tmp_path, capsys, monkeypatch):
    import engine.replay_report

    titles = []
    real_title = engine.replay_report.plot_title

    def title(*args, **kwargs):
        titles.append(real_title(*args, **kwargs))
        return titles[-1]

    monkeypatch.setattr(engine.replay_report, "plot_title", title)
    trace = write_bailian(tmp_path / "t.jsonl", requests=60)
    assert main(["replay", str(trace), "--policies", "lru", "--capacity-blocks", "8", "--host-blocks", "24",
                 "--plot", str(tmp_path / "r.png"), "--no-progress"]) == 0
    header = capsys.readouterr().out.split("policy ")[0]
    assert "host tier 24 blocks" in header
    assert titles == ["t.jsonl, host tier 24 blocks"]
    assert main(["replay", str(trace), "--policies", "lru", "--capacity-blocks", "8", "--no-progress"]) == 0
    assert "host tier" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--capacity", ""], "--capacity: give at least one value"),
        (["--capacity-blocks", ""], "--capacity-blocks: give at least one value"),
        (["--capacity", "5%"], "--capacity: '5%' is not a number; give a fraction such as 0.05"),
        (["--capacity", "0.1,2.5%"], "give a fraction such as 0.025"),
        (["--capacity-blocks", "1e12"], "--capacity-blocks: '1e12' is too large (at most 100,000,000 blocks)"),
        (["--capacity", "1e308"], "--capacity: 1e+308 of"),
        (["--capacity-blocks", "100000000000"], "is too large"),
        (["--capacity-blocks", "2.5"], "--capacity-blocks: '2.5' is not a whole number"),
        (["--capacity-blocks", "many"], "--capacity-blocks: 'many' is not a number"),
        (["--capacity", "1e9"], "is too large"),
        (["--routing", "least-load"], "--routing is about routing across replicas: give --replicas N (N >= 2) too"),
        (["--routing", "least-load", "--replicas", "1"], "give --replicas N (N >= 2)"),
        (["--index", "approx"], "--index is about routing across replicas: give --replicas N (N >= 2) too"),
        (["--index-lag", "0.5"], "--index-lag is about routing across replicas"),
        (["--replicas", "2", "--index-lag", "-1"], "--index-lag: give seconds, from 0 to 86400"),
        (["--replicas", "2", "--index-lag", "nan"], "--index-lag: give seconds, from 0 to 86400"),
        (["--replicas", "2", "--index", "approx", "--index-lag", "1"],
         "--index-lag delays KV events, which only the exact index follows: drop --index approx"),
    ],
)
def test_cli_argument_mistakes_are_one_line_errors(tmp_path, capsys, args, message):
    trace = write_bailian(tmp_path / "t.jsonl", requests=20)
    assert main(["replay", str(trace), "--policies", "lru", "--no-progress", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1
    assert captured.out == ""


def test_cli_capacity_blocks_may_be_written_in_exponent_form(tmp_path, capsys):
    trace = write_bailian(tmp_path / "t.jsonl", requests=20)
    assert main(["replay", str(trace), "--policies", "lru", "--capacity-blocks", "1e2", "--no-progress"]) == 0
    assert next(line for line in capsys.readouterr().out.splitlines() if line.startswith("lru ")).split()[1] == "100"


def test_cli_corrupt_line_error_has_no_second_position(tmp_path, capsys):
    """json's own "line 2 column 1" (the newline after a cut-off line) next to FILE:LINE reads as a contradiction."""
    path = tmp_path / "cut.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 1, "input_length": 5\n'
                    '{"timestamp": 2, "input_length": 10, "hash_ids": [1]}\n')
    assert main(["replay", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvgate: {path}:2: not valid JSON (Expecting ',' delimiter at column 35)\n"


def test_cli_an_unterminated_string_is_said_in_plain_words(tmp_path, capsys):
    """json's own message ends in "at": "starting at at column 2" read as a typo."""
    path = tmp_path / "cut.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timest\n')
    assert main(["replay", str(path), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"kvgate: {path}:2: not valid JSON (Unterminated string starting at column 2)\n"


def test_cli_csv_is_named_as_such(tmp_path, capsys):
    path = tmp_path / "trace.csv"
    path.write_text("timestamp,input_length,output_length,hash_ids\n0,1024,4,\"[1,2]\"\n")
    assert main(["replay", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (f"kvgate: {path}:1: this looks like a CSV header; kvgate reads JSONL traces (Bailian or Mooncake "
                   "format), one JSON object per line, not CSV\n")


BAILIAN_ROW = {"chat_id": 9, "parent_chat_id": -1, "timestamp": 3.0, "input_length": 32, "output_length": 2,
               "type": "text", "turn": 1, "hash_ids": [7, 8]}


def mooncake_row(i):
    return {"timestamp": 1000 * i, "input_length": 1024, "output_length": 4, "hash_ids": [i, i + 1]}


def trace_warnings(caplog, path):
    import logging

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.traces"):
        load_trace(path)
    return [r.getMessage() for r in caplog.records if r.name == "engine.traces"]


def test_a_record_of_the_other_format_is_warned_about_once(tmp_path, caplog):
    rows = [mooncake_row(i) for i in range(10)]
    rows[5] = rows[7] = BAILIAN_ROW
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    [warning] = trace_warnings(caplog, path)
    assert warning.startswith(f"{path}:6: a record with Bailian's chat fields")
    assert "first record is mooncake: read as mooncake" in warning and "(2 such lines; this is the first)" in warning
    # The reverse: a Mooncake-shaped record in a Bailian trace.
    rows = [dict(BAILIAN_ROW, chat_id=i, timestamp=float(i)) for i in range(8)]
    rows[5] = mooncake_row(5)
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    [warning] = trace_warnings(caplog, path)
    assert warning.startswith(f"{path}:6: a record with none of Bailian's chat fields") and "such lines" not in warning


def test_mooncake_hash_ids_disagreeing_with_input_length_are_warned_about_once(tmp_path, caplog):
    rows = [mooncake_row(i) for i in range(6)]
    rows[2] = dict(rows[2], input_length=1025)  # 3 blocks' worth of tokens, 2 ids
    rows[4] = dict(rows[4], hash_ids=[4])
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    [warning] = trace_warnings(caplog, path)
    assert warning == (f"{path}:3: 2 hash_ids for input_length 1025; a Mooncake trace has ceil(1025 / 512) = 3, "
                       "one per block (2 such lines; this is the first)")


def test_bailian_hash_ids_disagreeing_with_input_length_are_warned_about_once(tmp_path, caplog):
    """As Mooncake's: a line with fewer ids than its tokens' blocks counts the wrong blocks."""
    rows = [dict(BAILIAN_ROW, chat_id=i, timestamp=float(i)) for i in range(6)]
    rows[1] = dict(rows[1], input_length=320, hash_ids=[1, 2])
    rows[3] = dict(rows[3], input_length=17, hash_ids=[1])
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    [warning] = trace_warnings(caplog, path)
    assert warning == (f"{path}:2: 2 hash_ids for input_length 320; a Bailian trace has ceil(320 / 16) = 20, "
                       "one per block (2 such lines; this is the first)")


def test_the_shared_mooncake_trace_loads_without_warnings(caplog):
    assert trace_warnings(caplog, MOONCAKE) == []


def test_bailian_block_tokens_below_one_are_refused_at_their_line(tmp_path):
    from engine.traces import TraceError

    for value in (0, -16):
        rows = [BAILIAN_ROW, dict(BAILIAN_ROW, chat_id=10, block_tokens=value, output_hash_ids=[3])]
        path = tmp_path / "b.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(TraceError, match=rf"b.jsonl:2: block_tokens must be >= 1, got {value}$"):
            load_trace(path)


def test_bailian_fields_out_of_their_range_are_refused_at_their_line(tmp_path):
    """A trace holds one block size (its hit ratios and the routing simulation
    count blocks of it), a turn counts from 1, and a recording's cacheable_blocks
    is some of its line's hash_ids: otherwise the figures count the wrong blocks."""
    from engine.traces import TraceError

    second = dict(BAILIAN_ROW, chat_id=10, timestamp=BAILIAN_ROW["timestamp"] + 1)
    cases = [
        (BAILIAN_ROW, dict(second, block_tokens=32),
         r"b.jsonl:2: block_tokens 32, where the lines before give 16; a trace holds one block size"),
        (dict(BAILIAN_ROW, block_tokens=32), second,
         r"b.jsonl:2: no block_tokens \(so 16\), where the lines before give 32"),
        (BAILIAN_ROW, dict(second, turn=0), r"b.jsonl:2: turn must be >= 1 \(a conversation's first turn is 1\), got 0$"),
        (BAILIAN_ROW, dict(second, cacheable_blocks=-1),
         r"b.jsonl:2: cacheable_blocks must be from 0 to the line's 2 hash_ids, got -1$"),
        (BAILIAN_ROW, dict(second, cacheable_blocks=99),
         r"b.jsonl:2: cacheable_blocks must be from 0 to the line's 2 hash_ids, got 99$"),
        (BAILIAN_ROW, dict(second, duration_s=-1), r"b.jsonl:2: duration_s must be from 0 to 1e\+15 seconds, got -1$"),
        (BAILIAN_ROW, dict(second, duration_s=10**400), r"b.jsonl:2: duration_s must be from 0 to 1e\+15 seconds, got inf$"),
        (BAILIAN_ROW, dict(second, duration_s="1"), r"b.jsonl:2: field 'duration_s' must be an integer or a number"),
    ]
    path = tmp_path / "b.jsonl"
    for first, row, message in cases:
        path.write_text("".join(json.dumps(r) + "\n" for r in (first, row)))
        with pytest.raises(TraceError, match=message):
            load_trace(path)
    # A recording of 32-token blocks, every line saying so, is a trace of 32-token blocks.
    path.write_text("".join(json.dumps(dict(r, block_tokens=32, cacheable_blocks=2)) + "\n"
                            for r in (BAILIAN_ROW, second)))
    assert load_trace(path).block_tokens == 32


def test_unknown_types_and_workloads_are_warned_about_once_and_kept_or_inferred(tmp_path, caplog):
    rows = [dict(BAILIAN_ROW, chat_id=i, timestamp=float(i)) for i in range(6)]
    rows[1] = dict(rows[1], type="video")
    rows[3] = dict(rows[3], type="video")
    rows[4] = dict(rows[4], type="api", workload="to-x")
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    warnings = trace_warnings(caplog, path)
    assert warnings == [
        f'{path}:2: type "video" is none of text, search, image, file, api; the policy gives it categories of its own '
        "(2 such lines; this is the first)",
        f'{path}:5: workload "to-x" is none of to-c, to-b, multimodal; read from the type instead',
    ]
    contexts = {r.context.chat_id: r.context for r in load_trace(path).requests}
    assert contexts[1].type == "video" and contexts[4].workload == "to-b"


def test_capacities_below_the_longest_prompt_are_noted_not_refused(tmp_path, capsys):
    rows = [dict(BAILIAN_ROW, chat_id=i, timestamp=float(i), hash_ids=list(range(i + 1))) for i in range(6)]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["replay", str(path), "--policies", "lru", "--capacity-blocks", "3,5,6", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("kvgate: note: --capacity-blocks: 3, 5 (in blocks) below the trace's longest prompt "
                            "(6 blocks): an engine with so few device blocks would refuse that prompt, which the "
                            "replay still counts\n")
    assert len([line for line in captured.out.splitlines() if line.startswith("lru ")]) == 3
    assert main(["tune", str(path), "--capacity-blocks", "2", "--max-evals", "2", "--no-progress"]) == 0
    assert "--capacity-blocks: 2 (in blocks) below the trace's longest prompt" in capsys.readouterr().err


def test_a_capacity_past_the_traces_blocks_allocates_only_those(tmp_path, capsys, monkeypatch):
    """A cache as large as the trace's distinct blocks never evicts: a larger one
    gives the same figures, so a replay allocates no more (100M blocks took 7 GB
    on a 172-request trace, and 8 such replicas were refused for want of RAM)."""
    import engine.block_pool

    trace_path = write_bailian(tmp_path / "t.jsonl", requests=80)
    trace = load_trace(str(trace_path))
    unique = trace.unique_blocks()
    sizes = []
    real_pool = engine.block_pool.BlockPool

    def noting_sizes(device, host, *args, **kwargs):
        sizes.append((device, host))
        return real_pool(device, host, *args, **kwargs)

    monkeypatch.setattr("engine.replay.BlockPool", noting_sizes)
    monkeypatch.setattr("gateway.routing_sim.BlockPool", noting_sizes)
    code = main(["replay", str(trace_path), "--replicas", "8", "--routing", "prefix-aware", "--policies", "lru",
                 "--capacity-blocks", "100000000", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert sizes and all(device <= unique and host == 0 for device, host in sizes)
    assert main(["replay", str(trace_path), "--replicas", "5000", "--no-progress"]) == 2
    assert "--replicas: give a number from 1 to 1024" in capsys.readouterr().err
    # The figures are those of tiers allocated as asked (the cap turned off), device
    # past the distinct blocks, or host past them behind a small device tier.
    capped = {}
    for policy in ("lru", "fifo", "s3fifo", "wa", "wa-paper", "belady"):
        for device, host in ((2 * unique, 0), (unique // 10, 3 * unique)):
            result = replay(trace, policy, device, host_blocks=host, unique_blocks=unique)
            assert result.capacity_blocks == device  # reported as asked
            capped[policy, device, host] = (result.hits, result.evictions, result.fallbacks)
    monkeypatch.setattr("engine.replay.pool_sizes", lambda device, host, unique: (device, host))
    for (policy, device, host), figures in capped.items():
        result = replay(trace, policy, device, host_blocks=host, unique_blocks=unique)
        assert (result.hits, result.evictions, result.fallbacks) == figures, (policy, device, host)


def test_a_trace_with_no_reuse_plans_no_capacity(tmp_path, capsys):
    """An ideal hit ratio of 0 is reached by any cache: the plan says there is
    nothing to buy rather than naming the smallest capacity tested."""
    path = tmp_path / "once.jsonl"
    path.write_text(json.dumps(dict(BAILIAN_ROW, hash_ids=[1, 2, 3], input_length=48)) + "\n")
    assert main(["replay", str(path), "--policies", "lru", "--capacity-blocks", "1,10", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "capacity planning: the trace reuses no block, so no capacity raises its hit ratio" in out
    assert "90%:" not in out


def test_a_tools_warnings_read_as_its_errors_do(tmp_path):
    """The console script, as a user runs it: a trace's warning is a `kvgate: `
    line beside the table, not a server log line with a timestamp and a logger."""
    path = tmp_path / "odd.jsonl"
    rows = [dict(BAILIAN_ROW, chat_id=i, timestamp=float(i)) for i in range(3)]
    rows[1] = dict(rows[1], type="video")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    done = subprocess.run([kvgate, "replay", str(path), "--policies", "lru", "--capacity-blocks", "4", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stderr.splitlines() if "video" in line]
    assert warning.startswith(f"kvgate: {path}:2: type \"video\" is none of "), warning


def test_sigterm_while_the_plot_is_drawn_waits_for_it_then_exits_143(tmp_path, capsys, monkeypatch):
    """A scheduler's SIGTERM as the last files are written: held as Ctrl-C is,
    then delivered, so the status still says SIGTERM."""
    import os
    import signal

    import engine.replay_report

    draw = engine.replay_report.write_plot

    def terminated_while_drawing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return draw(*args, **kwargs)

    monkeypatch.setattr(engine.replay_report, "write_plot", terminated_while_drawing)
    trace = write_bailian(tmp_path / "t.jsonl", requests=60)
    out_png = tmp_path / "r.png"
    code = main(["replay", str(trace), "--policies", "lru", "--capacity-blocks", "8", "--plot", str(out_png),
                 "--no-progress"])
    assert code == 143
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
