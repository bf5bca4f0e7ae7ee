"""`kvgate synth --stats` and `kvgate serve` argument checks, and output into a closed pipe."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import engine.async_engine
from gateway.cli import main
from gateway.server import bind_sockets


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def stats_rows(text):
    """The --stats table as {statistic: measured}."""
    rows = {}
    for line in text.splitlines()[2:]:
        name, _, rest = line.partition("  ")
        rows[name.strip()] = rest.strip().split("  ")[0]
    return rows


def mooncake_trace(path):
    """Two requests 5 s apart sharing a block, then one 2 minutes in; Mooncake counts milliseconds."""
    return write_jsonl(path, [
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 5000, "input_length": 1024, "output_length": 4, "hash_ids": [1, 3]},
        {"timestamp": 120000, "input_length": 512, "output_length": 4, "hash_ids": [4]},
    ])


def test_synth_stats_reads_mooncake_timestamps_as_milliseconds(tmp_path, capsys, caplog):
    path = mooncake_trace(tmp_path / "m.jsonl")
    assert main(["synth", "--stats", str(path)]) == 0
    rows = stats_rows(capsys.readouterr().out)
    assert rows["trace format"] == "mooncake"
    assert rows["duration"] == "120.0 s"
    assert rows["reuses within 10 s"] == "100.0%"
    assert main(["synth", "--stats", str(path), "--format", "mooncake"]) == 0
    assert stats_rows(capsys.readouterr().out)["duration"] == "120.0 s"
    # Forced, it reads as Bailian, seconds and all, with a warning that says so.
    with caplog.at_level(logging.WARNING):
        assert main(["synth", "--stats", str(path), "--format", "bailian"]) == 0
    assert stats_rows(capsys.readouterr().out)["duration"] == "120000.0 s"
    assert "m.jsonl:1: none of Bailian's chat_id" in caplog.text
    # A Bailian trace read as Mooncake would have its seconds taken for ms: refused, with the fix.
    bailian = write_jsonl(tmp_path / "b.jsonl", [{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 16,
                                                   "output_length": 1, "type": "text", "turn": 1, "hash_ids": [1]}])
    assert main(["replay", str(bailian), "--format", "mooncake", "--capacity-blocks", "4"]) == 2
    assert "give --format bailian or auto" in capsys.readouterr().err


def test_synth_format_applies_only_to_stats(tmp_path, capsys):
    assert main(["synth", "-o", str(tmp_path / "t.jsonl"), "--format", "mooncake"]) == 2
    assert capsys.readouterr().err.startswith("kvgate: synth: --format")


@pytest.mark.parametrize("last", [1e15, 1e308])
def test_synth_stats_survives_an_absurd_time_span(tmp_path, capsys, last):
    """A per-minute histogram of this span would need petabytes."""
    path = write_jsonl(tmp_path / "gap.jsonl", [
        {"timestamp": 0, "input_length": 3, "hash_ids": [1], "type": "text"},
        {"timestamp": 30, "input_length": 3, "hash_ids": [1], "type": "text"},
        {"timestamp": last, "input_length": 3, "hash_ids": [1], "type": "text"},
    ])
    assert main(["synth", "--stats", str(path)]) == 0
    captured = capsys.readouterr()
    rows = stats_rows(captured.out)
    assert rows["requests per minute (median)"] == "0"
    assert rows["duration"] == f"{last:.3g} s"
    assert captured.err == ""


def test_output_into_a_closed_pipe_exits_quietly(tmp_path):
    """`kvgate synth --stats FILE | head -1`: the reader leaves before the output is written."""
    path = mooncake_trace(tmp_path / "m.jsonl")
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([kvgate, "synth", "--stats", str(path)], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert done.stderr == ""


@pytest.mark.parametrize("url", ["notaurl", "localhost:8001", "ftp://host:8001", "http://", "openai+notaurl",
                                 "http://host:99999", "http://host:port", "http://[::1"])
def test_serve_refuses_a_replica_that_is_no_url_before_loading_anything(capsys, monkeypatch, url):
    import gateway.server

    def run_gateway(*args, **kwargs):  # fail now rather than serve (or load a model) until killed
        raise AssertionError(f"the gateway started with --replica {url!r}")

    monkeypatch.setattr(gateway.server, "run_gateway", run_gateway)
    started = time.monotonic()
    assert main(["serve", "--replica", url]) == 2
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err == (f"kvgate: --replica {url!r}: give a URL like http://host:8001 "
                   "(openai+http://... for an external server)\n")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8001", "https://gpu-3.internal/v1", "openai+http://[::1]:9000",
                                 "openai+https://api.example.com/v1"])
def test_serve_accepts_replica_urls(url):
    from gateway.cli import _check_replica_url

    _check_replica_url(url)


def test_log_level_is_checked_before_anything_runs(capsys, monkeypatch):
    assert main(["serve", "--log-level", "loud"]) == 2
    assert "log level 'loud': choose debug, info, warning or error" in capsys.readouterr().err
    monkeypatch.setenv("KVGATE_LOG_LEVEL", "chatty")
    assert main(["engine"]) == 2
    assert "log level 'chatty'" in capsys.readouterr().err


def test_a_port_in_use_fails_before_the_model_loads(capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(engine.async_engine, "load_model", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err
    assert time.monotonic() - started < 5
    assert main(["serve", "--host", "no.such.host.invalid", "--port", "0"]) == 2
    assert "cannot resolve host 'no.such.host.invalid'" in capsys.readouterr().err


def test_ctrl_c_during_a_slow_model_load_exits_at_once(monkeypatch):
    # A large model loads for minutes; Ctrl-C must not wait for the load to end.
    loading, done = threading.Event(), threading.Event()

    def slow_load(*args, **kwargs):
        loading.set()
        done.wait(60)  # abandoned with its daemon thread until the test ends (it holds the model-load lock)

    monkeypatch.setattr(engine.async_engine.AsyncEngine, "from_config", staticmethod(slow_load))

    def interrupt() -> None:
        if loading.wait(30):
            os.kill(os.getpid(), signal.SIGINT)  # what the terminal sends on Ctrl-C

    # A shell's background job (CI may run this way) starts with SIGINT ignored; a terminal's does not.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        started = time.monotonic()
        assert main(["serve", "--port", "0"]) == 130
        assert loading.is_set() and time.monotonic() - started < 15
    finally:
        signal.signal(signal.SIGINT, previous)
        done.set()


def test_sigterm_during_a_slow_model_load_exits_at_once_with_143(monkeypatch):
    # Kubernetes stopping a pod whose engine is still loading: exit now, 128 + SIGTERM.
    loading, done = threading.Event(), threading.Event()

    def slow_load(*args, **kwargs):
        loading.set()
        done.wait(60)

    monkeypatch.setattr(engine.async_engine.AsyncEngine, "from_config", staticmethod(slow_load))

    def terminate() -> None:
        if loading.wait(30):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--port", "0"])
        assert exited.value.code == 143 and time.monotonic() - started < 15
    finally:
        done.set()


def test_a_second_server_starting_at_the_same_moment_is_refused_the_port():
    # Both still loading their models: the first has its port, the second must not get it too.
    first = bind_sockets("127.0.0.1", 0)
    try:
        port = first[0].getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            bind_sockets("127.0.0.1", port)
    finally:
        for sock in first:
            sock.close()


@pytest.mark.skipif(not socket.has_ipv6, reason="this machine has no IPv6 stack")
def test_host_ipv6_wildcard_also_takes_ipv4_clients():
    sockets = bind_sockets("::", 0)
    try:
        port = sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted by the listening backlog
    finally:
        for sock in sockets:
            sock.close()


def test_synth_refuses_to_write_a_trace_without_requests(tmp_path, capsys):
    out = tmp_path / "empty.jsonl"
    assert main(["synth", "--duration", "1", "--rate", "0.1", "-o", str(out)]) == 2
    assert capsys.readouterr().err == ("kvgate: synth: 1 s at 0.1 requests/s gave no requests; raise --duration or "
                                       "--rate (nothing written)\n")
    assert not out.exists()


def test_synth_stats_refuses_an_output_file_it_would_not_write(tmp_path, capsys):
    path = mooncake_trace(tmp_path / "m.jsonl")
    out = tmp_path / "stats.txt"
    assert main(["synth", "--stats", str(path), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("kvgate: synth: --stats prints a trace's statistics and writes no file: drop -o "
                            "(or drop --stats to generate a trace)\n")
    assert captured.out == "" and not out.exists()
