"""`kvgate synth --stats` and `kvgate serve` argument checks, and output into a closed pipe."""

import json
import logging
import os
import re
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
from tests.engine_helpers import interrupt_on_call


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


@pytest.mark.parametrize("last", [1e12, 1e15])  # 1e15: the largest a trace may give (engine/traces.py)
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


@pytest.mark.parametrize("output", [["synth", "--duration", "60", "--rate", "2", "-o", "/dev/stdout"],
                                    ["replay", "TRACE", "--policies", "lru", "--capacity-blocks", "4",
                                     "--json", "/dev/stdout"]])
def test_a_results_file_on_stdout_into_a_closed_pipe_exits_quietly(tmp_path, output):
    """`kvgate synth -o /dev/stdout | head`: the reader that left is no failed write (exit 2, an error line)."""
    argv = [str(mooncake_trace(tmp_path / "m.jsonl")) if arg == "TRACE" else arg for arg in output]
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([kvgate, *argv], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert "Broken pipe" not in done.stderr and "cannot write" not in done.stderr


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


def _serve_errors(monkeypatch, capsys, *argv):
    """`kvgate serve ARGV`'s exit status and stderr, failing if the gateway starts."""
    import gateway.server

    def run_gateway(*args, **kwargs):  # fail now rather than serve (or load a model) until killed
        raise AssertionError(f"the gateway started with {argv!r}")

    monkeypatch.setattr(gateway.server, "run_gateway", run_gateway)
    code = main(["serve", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://h:8001/?x=1", "http://h:8001#f", "openai+http://h:8001/v1?", "http://h:8001#",
                                 "openai+https://alice:s3cret@h/v1?key=1"])
def test_serve_refuses_a_replica_url_with_a_query_or_fragment(capsys, monkeypatch, url):
    # Requests went to http://h:8001/?x=1/kvgate/info: the replica looked dead for good.
    assert _serve_errors(monkeypatch, capsys, "--replica", url) == (2, (
        f"kvgate: --replica {url.replace('alice:s3cret@', '')!r} has a ?query or #fragment: a replica URL is "
        "scheme://host:port[/path], with neither\n"))


@pytest.mark.parametrize("urls, why", [
    (["http://h:8001", "http://h:8002", "http://h:8001/"],
     "--replica 'http://h:8001/': the same server as --replica 'http://h:8001' (http://h:8001)"),
    (["openai+http://alice:s3cret@h:8001/v1/", "http://H:8001"],
     "--replica 'http://H:8001': the same server as --replica 'openai+http://h:8001/v1/' (http://h:8001)"),
])
def test_serve_refuses_one_server_given_twice(capsys, monkeypatch, urls, why):
    argv = [arg for url in urls for arg in ("--replica", url)]
    assert _serve_errors(monkeypatch, capsys, *argv) == (2, f"kvgate: {why}\n")


def test_serve_refuses_a_replica_flag_that_repeats_a_config_replica(tmp_path, capsys, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n  - {kind: engine, url: 'http://e:8000'}\n"
                    "  - {kind: openai, url: 'http://alice:s3cret@vllm-0:8000/v1'}\n")
    assert _serve_errors(monkeypatch, capsys, "--config", str(path), "--replica", "http://e:8001",
                         "--replica", "openai+http://vllm-0:8000") == (
        2, "kvgate: --replica 'openai+http://vllm-0:8000': the same server as replicas.1 (http://vllm-0:8000)\n")


def test_serve_reports_config_replica_defects_in_one_line_each(tmp_path, capsys, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n  - url: http://127.0.0.1:8001\n")
    code, err = _serve_errors(monkeypatch, capsys, "--config", str(path))
    assert code == 2 and err.startswith(f"kvgate: {path}:2: replicas.0: url 'http://127.0.0.1:8001' needs a remote "
                                        "kind: set kind: engine") and err.count("\n") == 1
    path.write_text("replicas:\n  - {kind: engine, url: 'http://e:8001'}\n  - {kind: openai, url: 'http://e:8001/v1'}\n"
                    "  - {kind: engine, url: 'http://e:8001?'}\n")
    code, err = _serve_errors(monkeypatch, capsys, "--config", str(path))
    assert (code, err) == (2, f"kvgate: {path}:4: replicas.2: url 'http://e:8001?' has a ?query or #fragment: "
                              "a replica URL is scheme://host:port[/path], with neither\n")
    path.write_text("replicas:\n  - {kind: engine, url: 'http://e:8001'}\n  - {kind: openai, url: 'http://e:8001/v1'}\n")
    code, err = _serve_errors(monkeypatch, capsys, "--config", str(path))
    assert (code, err) == (2, f"kvgate: {path}:3: replicas.1: the same server as replicas.0 (http://e:8001)\n")


def test_serve_refuses_a_replica_key_variable_that_is_unset(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVGATE_TEST_ENGINE_KEY", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n  - {kind: engine, url: 'http://e:8001', api_key_env: KVGATE_TEST_ENGINE_KEY}\n")
    assert _serve_errors(monkeypatch, capsys, "--config", str(path)) == (
        2, f"kvgate: {path}:2: replicas.0: api_key_env: the environment variable KVGATE_TEST_ENGINE_KEY is not set or "
           "is empty\n")


def test_serve_starts_with_distinct_replicas(tmp_path, monkeypatch):
    import gateway.server

    started = []
    monkeypatch.setattr(gateway.server, "run_gateway", lambda config, host, port, urls: started.append(urls))
    path = tmp_path / "c.yaml"
    path.write_text("replicas:\n  - {kind: engine, url: 'http://e:8000'}\n  - {kind: inprocess}\n")
    urls = ["http://e:8001", "openai+http://e:8002/v1", "openai+https://e:8001/b"]
    assert main(["serve", "--config", str(path), *(arg for url in urls for arg in ("--replica", url))]) == 0
    assert started == [urls]


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
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err and "[Errno" not in err
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


_LOADING_INSIDE_TORCH = """
import pathlib, sys
flag = sys.argv[1]
import engine.async_engine
from gateway import cli

def load(*args, **kwargs):  # a long load: torch at work, the GIL let go, as a large model's
    import torch
    torch.set_num_threads(1)
    a = torch.randn(400, 400)
    pathlib.Path(flag).write_text("loading")
    while True:
        a = torch.mm(a, a).clamp_(-1, 1)

engine.async_engine.AsyncEngine.from_config = staticmethod(load)
sys.argv = ["kvgate", "serve", "--port", "0"]
cli.console()
"""


def test_sigterm_while_torch_loads_the_model_exits_143_without_an_abort(tmp_path):
    """The `kvgate` command, stopped while its model load runs inside torch: Python's
    shutdown stopped the loading thread mid-call (std::terminate: "Fatal Python
    error: Aborted", exit -6 every time here), or, with warnings shown, hung on a
    lock it held.  It ends at once with 143 now."""
    script, flag = tmp_path / "serve.py", tmp_path / "loading"
    script.write_text(_LOADING_INSIDE_TORCH)
    root = str(Path(__file__).resolve().parent.parent)
    for _ in range(2):
        flag.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, str(script), str(flag)], cwd=root, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": root, "PYTHONWARNINGS": "default"})
        try:
            deadline = time.monotonic() + 60
            while not flag.exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert flag.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no load"
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            err = proc.communicate(timeout=20)[1].decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 143, err[-2000:]
        assert "SIGTERM during start-up: stopping" in err and "Fatal Python error" not in err, err[-2000:]


_CTRL_C_AT_THE_FIRST_IMPORT = """
import os, signal, sys
from gateway import cli

class CtrlC:  # the terminal's Ctrl-C, landing while the command imports its first module
    def find_spec(self, name, path=None, target=None):
        sys.meta_path.remove(self)
        os.kill(os.getpid(), signal.SIGINT)

signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with it ignored
sys.meta_path.insert(0, CtrlC())
sys.argv = ["kvgate", "replay", "no-such-trace.jsonl"]
cli.console()
"""


def test_ctrl_c_while_the_command_imports_exits_130_without_a_traceback(tmp_path):
    """console() imported gateway.startup_thread (asyncio: ~30 ms, longer on a busy
    machine) before main() guarded against Ctrl-C: a Ctrl-C right after Enter printed
    a traceback and the process died of SIGINT."""
    script = tmp_path / "kvgate.py"
    script.write_text(_CTRL_C_AT_THE_FIRST_IMPORT)
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": root})
    err = proc.stderr.decode()
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err[-2000:])


_SIGTERM_WHILE_THE_SERVER_IMPORTS = """
import os, signal, sys
from gateway import cli

class Sigterm:  # Kubernetes deleting the pod while the server imports its modules
    def find_spec(self, name, path=None, target=None):
        if name == "gateway.server":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)

sys.meta_path.insert(0, Sigterm())
sys.argv = ["kvgate", sys.argv[1], "--port", "0"]
cli.console()
"""


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_sigterm_while_a_server_imports_stops_it_by_its_own_handler(tmp_path, command):
    """A SIGTERM before the event loop takes the signals over (the imports: a second
    or more, torch's on a GPU image longer) killed the process by the kernel's
    default action, exit -15, which a container's first process never gets: in a
    Kubernetes pod (no init) the signal was dropped, and the server loaded, served
    and was killed terminationGracePeriodSeconds (130 s) later.  kvgate's own
    handler stops it, as during the model load: 143, and the log says why."""
    script = tmp_path / "kvgate.py"
    script.write_text(_SIGTERM_WHILE_THE_SERVER_IMPORTS)
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, str(script), command], cwd=tmp_path, capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": root})
    err = proc.stderr.decode()
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert "SIGTERM during start-up: stopping" in err and "Traceback" not in err, err[-2000:]


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
    # Nor does it take generation settings silently (they were ignored, exit 0).
    assert main(["synth", "--stats", str(path), "--profile", "to-b", "--rate", "99"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("kvgate: synth: --stats prints a trace's statistics and generates none: drop --profile, "
                            "--rate\n")
    assert captured.out == ""


def test_serve_refuses_a_recording_path_that_is_a_directory(tmp_path, capsys, monkeypatch):
    """Rotating the old recording away would rename the directory itself (to DIR.1)."""
    import gateway.server

    monkeypatch.setattr(gateway.server, "run_gateway", lambda *a: pytest.fail("the server started"))
    folder = tmp_path / "recordings"
    folder.mkdir()
    assert main(["serve", "--record-trace", str(folder)]) == 2
    assert capsys.readouterr().err == f"kvgate: --record-trace: {folder} is a directory; give a file path\n"
    config = tmp_path / "config.yaml"
    config.write_text(f"server:\n  record_trace: {folder}\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err == f"kvgate: {config}:2: server.record_trace: {folder} is a directory; give a file path\n"
    assert folder.is_dir() and not (tmp_path / "recordings.1").exists()
    config.write_text("server:\n  port: 8000\n  record_trace: /proc/kvgate/served.jsonl\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith(f"kvgate: {config}:3: server.record_trace: cannot write /proc/kvgate/")
    # Nor a file that cannot be made (here: under /proc, which takes no new files, even as root).
    assert main(["serve", "--record-trace", "/proc/kvgate/served.jsonl"]) == 2
    assert capsys.readouterr().err.startswith("kvgate: --record-trace: cannot write /proc/kvgate/served.jsonl: ")
    # A file where its folder should be is named (makedirs said "File exists"), and nothing is made under it.
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["serve", "--record-trace", str(afile / "day" / "x.jsonl")]) == 2
    assert capsys.readouterr().err == (f"kvgate: --record-trace: cannot write {afile / 'day' / 'x.jsonl'}: "
                                       f"{afile} is a file, not a folder\n")


@pytest.mark.parametrize("command", ["replay", "tune"])
def test_a_host_tier_beyond_any_machine_is_refused(tmp_path, capsys, command):
    """Its bookkeeping would be allocated up front: an OverflowError or the machine's memory."""
    path = mooncake_trace(tmp_path / "m.jsonl")
    assert main([command, str(path), "--capacity-blocks", "4", "--host-blocks", str(10**20), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"kvgate: --host-blocks: {10**20} is too large (at most 100,000,000 blocks)\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fill a disk")
@pytest.mark.parametrize("argv, flag", [
    (["replay", "{trace}", "--capacity-blocks", "4", "--json", "/dev/full"], "--json"),
    (["replay", "{trace}", "--capacity-blocks", "4", "--replicas", "2", "--json", "/dev/full"], "--json"),
    (["synth", "--duration", "60", "-o", "/dev/full"], "-o"),
])
def test_a_full_disk_is_one_line_not_a_traceback(tmp_path, capsys, argv, flag):
    trace = str(mooncake_trace(tmp_path / "m.jsonl"))
    assert main([part.format(trace=trace) for part in argv] + ["--no-progress"] * (argv[0] == "replay")) == 2
    assert capsys.readouterr().err.endswith(f"kvgate: {flag}: cannot write /dev/full: No space left on device\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fill a disk")
@pytest.mark.parametrize("argv", [
    ["replay", "{trace}", "--capacity-blocks", "4", "--no-progress"],
    ["synth", "--stats", "{trace}"],
    ["tune", "{trace}", "--capacity-blocks", "4", "--max-evals", "2", "--no-progress"],
])
def test_a_full_disk_under_stdout_is_one_line_not_a_traceback(tmp_path, argv):
    """`kvgate replay T > results.txt` on a full disk: a traceback before."""
    trace = str(mooncake_trace(tmp_path / "m.jsonl"))
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    with open("/dev/full", "w") as full:
        done = subprocess.run([kvgate] + [part.format(trace=trace) for part in argv], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.endswith("kvgate: stdout: No space left on device\n") and "Traceback" not in done.stderr


def test_results_on_standard_output_are_the_results_alone_and_keep_what_was_there(tmp_path):
    """`--json /dev/stdout`, as the refusal of `--json -` suggests: the table came
    first on the same stream (no JSON for `| jq`), and with standard output sent
    to a file the results were renamed over it (`>> log` lost the log)."""
    trace = mooncake_trace(tmp_path / "m.jsonl")
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    piped = subprocess.run([kvgate, "replay", str(trace), "--capacity-blocks", "4", "--policies", "lru",
                            "--no-progress", "--json", "/dev/stdout"], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0
    assert json.loads(piped.stdout)["results"][0]["policy"] == "lru"
    assert piped.stderr.startswith("trace ")  # the table, on standard error
    log = tmp_path / "log.txt"
    log.write_text("earlier\n")
    for argv in (["replay", str(trace), "--capacity-blocks", "4", "--policies", "lru", "--no-progress",
                  "--json", "/dev/stdout"],
                 ["synth", "--profile", "to-b", "--duration", "5", "--rate", "1", "--seed", "1", "-o", "/dev/stdout"]):
        with open(log, "a") as appended:
            done = subprocess.run([kvgate, *argv], stdout=appended, stderr=subprocess.PIPE, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert text.startswith("earlier\n")
    results, end = json.JSONDecoder().raw_decode(text, len("earlier\n"))
    assert results["results"][0]["policy"] == "lru"
    trace_lines = text[end:].split("\n")[1:-1]
    assert trace_lines and all("hash_ids" in json.loads(line) for line in trace_lines)


@pytest.mark.parametrize("argv", [
    ["replay", "{trace}", "--capacity-blocks", "4", "--json", "{out}", "--no-progress"],
    ["synth", "--stats", "{trace}"],
])
def test_ctrl_c_while_the_trace_is_read_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch, argv):
    """It exited 130 without a word, as if it had finished."""
    import engine.traces

    trace = str(mooncake_trace(tmp_path / "m.jsonl"))
    out = tmp_path / "earlier.json"
    out.write_text("an earlier run's results")
    monkeypatch.setattr(engine.traces, "load_trace", interrupt_on_call(engine.traces.load_trace, 1))
    assert main([part.format(trace=trace, out=out) for part in argv]) == 130
    assert capsys.readouterr().err == "kvgate: interrupted; no file written\n"
    assert out.read_text() == "an earlier run's results"


def test_an_unknown_routing_is_refused_before_the_trace_is_read(tmp_path, capsys, monkeypatch):
    """It waited for the whole trace to load (19 s for a 124 MB one)."""
    import engine.traces

    def load_trace(*args, **kwargs):
        raise AssertionError("the trace was read before the options were checked")

    monkeypatch.setattr(engine.traces, "load_trace", load_trace)
    trace = str(mooncake_trace(tmp_path / "m.jsonl"))
    assert main(["replay", trace, "--replicas", "2", "--routing", "prefix-aware,foo", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("kvgate: --routing: unknown foo; choose from prefix-aware, least-load, "
                                       "round-robin, session\n")


def test_a_policy_named_twice_is_replayed_once(tmp_path, capsys):
    """As a capacity given twice; it printed two identical rows."""
    trace = str(mooncake_trace(tmp_path / "m.jsonl"))
    assert main(["replay", trace, "--policies", "lru,fifo,lru", "--capacity-blocks", "4,4", "--no-progress"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith(("lru ", "fifo "))]
    assert rows == ["lru", "fifo"]


def test_synth_stats_takes_64_bit_hash_ids(tmp_path, capsys):
    """Mooncake hash ids are any JSON integer; a 64-bit hash can pass int64."""
    small = mooncake_trace(tmp_path / "small.jsonl")
    big = write_jsonl(tmp_path / "big.jsonl", [
        dict(r, hash_ids=[2**64 - i for i in r["hash_ids"]]) for r in map(json.loads, small.read_text().splitlines())
    ])
    assert main(["synth", "--stats", str(small)]) == 0
    expected = capsys.readouterr().out.replace("small.jsonl", "big.jsonl")
    assert main(["synth", "--stats", str(big)]) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("field, value", [("turn", 2**70), ("input_length", 10**400), ("chat_id", -2**64)])
def test_a_trace_integer_past_64_bits_is_a_line_error(tmp_path, capsys, field, value):
    record = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1,
              "type": "text", "turn": 1, "hash_ids": [1]}
    path = write_jsonl(tmp_path / "t.jsonl", [record, {**record, "chat_id": 2, field: value}])
    assert main(["synth", "--stats", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvgate: {path}:2: field {field!r} is out of range, got {str(value)[:20]}")


def test_an_empty_output_path_is_refused_not_ignored(tmp_path, capsys):
    path = mooncake_trace(tmp_path / "m.jsonl")
    assert main(["replay", str(path), "--capacity-blocks", "4", "--json", "", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "kvgate: --json: give a file path\n" and captured.out == ""


@pytest.mark.parametrize("argv, message", [
    (["replay", "{trace}", "--capacity-blocks", "20000"],
     "kvgate: --capacity-blocks: a cache of 20,000 blocks needs ~1.5 MiB of bookkeeping up front; "
     "1.0 MiB of memory is available\n"),
    (["replay", "{trace}", "--capacity-blocks", "4,5000", "--replicas", "4"],
     "kvgate: --capacity-blocks: 4 caches of 5,000 blocks need ~1.5 MiB of bookkeeping up front; "
     "1.0 MiB of memory is available\n"),
    (["tune", "{trace}", "--capacity-blocks", "20000000"],
     "kvgate: --capacity-blocks: a cache of 30,000 blocks (the trace's distinct ones) needs ~2.3 MiB of "
     "bookkeeping up front; 1.0 MiB of memory is available\n"),
])
def test_caches_whose_bookkeeping_cannot_fit_are_refused_before_the_run(tmp_path, capsys, monkeypatch, argv, message):
    from engine import memory

    monkeypatch.setattr(memory, "available_ram", lambda: 1 << 20)
    # 30,000 distinct blocks: no cache of this trace allocates more.
    trace = str(write_jsonl(tmp_path / "m.jsonl", [
        {"timestamp": t * 1000, "input_length": 512 * 10_000, "output_length": 4,
         "hash_ids": list(range(t * 10_000, (t + 1) * 10_000))} for t in range(3)]))
    assert main([part.format(trace=trace) for part in argv] + ["--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err == message and captured.out == ""


def test_running_out_of_memory_anyway_is_one_line(tmp_path, capsys, monkeypatch):
    """A ulimit, or memory taken meanwhile: MemoryError mid-run is no traceback."""
    import engine.replay

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(engine.replay, "BlockPool", no_memory)
    trace = str(mooncake_trace(tmp_path / "m.jsonl"))
    assert main(["replay", trace, "--capacity-blocks", "4", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("kvgate: out of memory (replay and tune allocate each cache up front")


def test_replay_small_trace_cases(tmp_path, capsys):
    """Capacities that round alike run once; --routing '' is refused, not read as all;
    a plot path without an extension is written as given; a null line says null."""
    trace = str(mooncake_trace(tmp_path / "m.jsonl"))
    assert main(["replay", trace, "--policies", "lru", "--no-progress"]) == 0
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines() if line.startswith("lru ")] == [["lru", "1"]]
    assert main(["replay", trace, "--replicas", "2", "--routing", "", "--capacity-blocks", "4", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("kvgate: --routing: unknown (none given); choose from prefix-aware")
    plot = tmp_path / "hit-ratios"
    assert main(["replay", trace, "--policies", "lru", "--capacity-blocks", "2", "--plot", str(plot), "--no-progress"]) == 0
    assert plot.read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "hit-ratios.png").exists()
    capsys.readouterr()
    nulls = tmp_path / "null.jsonl"
    nulls.write_text("null\n")
    assert main(["replay", str(nulls), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"kvgate: {nulls}:1: expected a JSON object, got null\n"


def _tiny_config(tmp_path, tiny_model_dir, engine: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"model:\n  path: {tiny_model_dir}\n  device: cpu\n  dtype: float32\n"
                    f"engine:\n  threads: 1\n{engine}")
    return str(path)


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_a_kv_cache_the_allocator_refuses_is_one_line_naming_the_setting(tmp_path, capsys, monkeypatch,
                                                                          tiny_model_dir, command):
    """device_blocks: 200000 on a 23 GB machine (or a GPU): the allocator's RuntimeError was a traceback."""
    import torch

    def refused(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 73.70 GiB. GPU 0 has a total capacity\n"
                                     "of 23 GiB...")

    monkeypatch.setattr(engine.async_engine, "KVCache", refused)
    config = _tiny_config(tmp_path, tiny_model_dir, "  device_blocks: 64\n  host_blocks_multiplier: 0\n")
    assert main([command, "--config", config, "--port", "0"]) == 2
    err = capsys.readouterr().err
    # At the line that set it (found at start-up, it is still the file's error).
    assert err.endswith(f"kvgate: {config}:7: engine.device_blocks: cannot allocate the KV cache (64 device blocks "
                        "of 8 KiB): CUDA out of memory. Tried to allocate 73.70 GiB. GPU 0 has a total capacity\n")
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_a_model_path_that_does_not_load_is_named_at_its_line(tmp_path, capsys, command):
    path = tmp_path / "config.yaml"
    path.write_text(f"engine:\n  threads: 1\nmodel:\n  path: {tmp_path / 'no-model'}\n")
    assert main([command, "--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvgate: {path}:4: cannot load model '{tmp_path / 'no-model'}': directory not found\n"


def test_a_cache_dir_the_default_model_cannot_be_converted_into_is_named_at_once(tmp_path, capsys, monkeypatch):
    """A read-only root (a pod's) as model.cache_dir: the first start failed after
    half a minute of conversion with "cannot start: [Errno 2] ...", no line, no setting."""
    import engine.model_loader as model_loader

    monkeypatch.setattr(model_loader, "convert_gguf", lambda *args: pytest.fail("converted anyway"))
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    path = tmp_path / "config.yaml"
    path.write_text(f"engine:\n  threads: 1\nmodel:\n  cache_dir: {blocked / 'cache'}\n")
    assert main(["engine", "--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (f"kvgate: {path}:4: cannot load model '<default>': cannot write the converted model into "
                   f"{blocked / 'cache'} (Not a directory); give model.cache_dir a writable folder\n")


def test_a_listen_address_is_named_at_its_line_unless_a_flag_gave_it(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(engine.async_engine, "load_model", no_loading)
    path = tmp_path / "config.yaml"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path.write_text(f"server:\n  port: {port}\n  host: no.such.host.invalid\n")
        assert main(["serve", "--config", str(path)]) == 2
        assert capsys.readouterr().err.startswith(f"kvgate: {path}:3: cannot start: cannot resolve host")
        assert main(["serve", "--config", str(path), "--host", "127.0.0.1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvgate: {path}:2: cannot start:") and "in use" in err
        # Both from flags: the file is not to blame.
        assert main(["serve", "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]) == 2
        assert capsys.readouterr().err.startswith("kvgate: cannot start:")
        assert main(["engine", "--config", str(path), "--port", "0"]) == 2
        assert capsys.readouterr().err.startswith(f"kvgate: {path}:3: cannot start: cannot resolve host")


def test_a_failed_start_leaves_no_recording_behind(tmp_path, capsys, monkeypatch):
    """The recording's path is checked (its folders made, its file opened) before
    the port is bound: a start that then failed left an empty file and the
    folders behind.  What was there before stays as it was."""
    monkeypatch.setattr(engine.async_engine, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text('{"chat_id": 1}\n')
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        new = tmp_path / "recordings" / "day" / "served.jsonl"
        link = tmp_path / "link.jsonl"  # to a file not made yet: the link stays, no file behind it
        link.symlink_to(tmp_path / "target.jsonl")
        for recording in (new, earlier, empty, link):
            assert main(["serve", "--host", "127.0.0.1", "--port", port, "--record-trace", str(recording)]) == 2
            assert "in use" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.jsonl", "empty.jsonl", "link.jsonl"]
    assert link.is_symlink() and not link.exists()
    assert earlier.read_text() == '{"chat_id": 1}\n' and empty.stat().st_size == 0


def test_a_kv_cache_beyond_the_machine_is_refused_before_allocating(tmp_path, monkeypatch, tiny_model_dir):
    """On CPU both tiers are RAM: past what is available, an allocator's error or the OOM killer."""
    from engine import memory
    from engine.async_engine import AsyncEngine
    from engine.config import ConfigError
    from gateway.config import load_config

    monkeypatch.setattr(memory, "available_ram", lambda: 512 << 20)
    config = load_config(_tiny_config(tmp_path, tiny_model_dir, "  device_blocks: 50000\n  host_blocks_multiplier: 1\n"))
    with pytest.raises(ConfigError) as info:
        AsyncEngine.from_config(config.model, config.engine, config.cache)
    assert str(info.value) == ("engine.device_blocks (and engine.host_blocks_multiplier): 50,000 device + 50,000 host "
                               "blocks of 8 KiB need 0.8 GiB; 0.5 GiB of RAM is available")


@pytest.mark.parametrize("command, hint", [
    ("engine", "the engine allocates its KV cache up front: a smaller engine.device_blocks"),
    ("serve", "the engine allocates its KV cache up front"),
])
def test_out_of_memory_hints_fit_the_command(capsys, monkeypatch, command, hint):
    # replay's hint (a smaller capacity, fewer --replicas) said nothing to a server.
    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(engine.async_engine.AsyncEngine, "from_config", staticmethod(no_memory))
    assert main([command, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"kvgate: out of memory ({hint}" in err and "Traceback" not in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resource limits as on Linux")
@pytest.mark.parametrize("hard, expected", [(4096, 4096), (200_000, 65_535)])
def test_a_server_raises_its_open_files_limit(hard, expected):
    """A soft limit of 1024 (systemd's) is ~1,000 idle keep-alive clients: every
    connection after them would fail.  Servers raise it toward the hard limit."""
    import resource

    ours = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if ours != resource.RLIM_INFINITY and ours < hard:
        hard = expected = min(ours, 65_535)  # an unprivileged run cannot raise its hard limit
    script = ("import resource; from gateway.server import raise_open_files_limit; raise_open_files_limit(); "
              "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
        cwd=Path(__file__).resolve().parents[1],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )
    assert int(out.stdout) == expected


def test_an_output_path_that_cannot_be_written_says_why(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "t.jsonl"
    assert main(["synth", "--duration", "10", "-o", str(missing)]) == 2
    assert capsys.readouterr().err == f"kvgate: -o: cannot write into {missing.parent}: no such folder\n"
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert main(["synth", "--duration", "10", "-o", str(locked / "t.jsonl")]) == 2
        assert capsys.readouterr().err.endswith(": permission denied\n")


@pytest.mark.parametrize("model", ["empty-folder", "no-such-folder", "bad.gguf"])
def test_a_gateway_of_remote_replicas_names_a_model_it_cannot_read(tmp_path, capsys, model):
    """Its tokenizer alone is loaded: that failed with a traceback (or a hub error for a missing folder)."""
    path = tmp_path / model
    if model == "empty-folder":
        path.mkdir()
    elif model == "bad.gguf":
        path.write_bytes(b"not a gguf file")
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {path}\n")
    started = time.monotonic()
    assert main(["serve", "--config", str(config), "--port", "0", "--replica", "http://127.0.0.1:9"]) == 2
    # At once: not after waiting out the replica that never answers (connect_timeout_s, 10 s).
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err.startswith(f"kvgate: {config}:2: cannot load model '{path}': ") and err.count("\n") == 1
    if model == "no-such-folder":
        assert err.endswith("directory not found\n")


def test_replay_outputs_never_overwrite_the_trace_the_config_or_each_other(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 512, "hash_ids": [1]}])
    config = tmp_path / "c.yaml"
    config.write_text("cache:\n  policy: lru\n")
    before = trace.read_text(), config.read_text()
    base = ["replay", str(trace), "--policies", "lru", "--no-progress", "--config", str(config)]
    for extra, message in [
        (["--json", str(trace)], f"--json: {trace} is the trace; write the output elsewhere"),
        (["--plot", f"{tmp_path}/./t.jsonl"], f"--plot: {tmp_path}/./t.jsonl is the trace"),
        (["--json", str(config)], f"--json: {config} is the config file"),
        (["--json", str(tmp_path / "out"), "--plot", str(tmp_path / "out")],
         f"--json and --plot: both write {tmp_path / 'out'}; give each its own file"),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert (trace.read_text(), config.read_text()) == before


def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    trace = write_jsonl(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 512, "hash_ids": [1]}])
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    real_access = os.access
    # As a user without write permission sees it (root passes every permission check).
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(kept) else real_access(p, mode))
    assert main(["replay", str(trace), "--policies", "lru", "--no-progress", "--json", str(kept)]) == 2
    assert capsys.readouterr() == ("", f"kvgate: --json: cannot write {kept}: permission denied\n")


def test_a_recording_never_replaces_the_config(tmp_path, capsys, monkeypatch):
    """The recorder moves an older file at its path aside: the config was moved, and the
    next start served the defaults."""
    monkeypatch.setattr(engine.async_engine, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    config = tmp_path / "c.yaml"
    config.write_text("server:\n  port: 0\n")
    assert main(["serve", "--config", str(config), "--record-trace", str(config)]) == 2
    assert f"--record-trace: {config} is the config file" in capsys.readouterr().err
    assert config.read_text() == "server:\n  port: 0\n"
    assert main(["serve", "--config", str(config), "--record-trace", ""]) == 2
    assert "--record-trace: give a file path" in capsys.readouterr().err


def test_an_interrupted_synth_leaves_the_old_file(tmp_path, monkeypatch):
    from engine import synth

    path = tmp_path / "t.jsonl"
    path.write_text("the old trace\n")
    records = [{"n": i} for i in range(10)]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(synth.json, "dumps", lambda record, **kw: interrupted() if record["n"] == 5 else "{}")
    with pytest.raises(KeyboardInterrupt):
        synth.write_trace(records, path)
    assert path.read_text() == "the old trace\n" and os.listdir(tmp_path) == ["t.jsonl"]
    monkeypatch.undo()
    synth.write_trace(records, path)
    assert path.read_text().count("\n") == 10 and os.listdir(tmp_path) == ["t.jsonl"]


def test_outputs_replace_a_link_s_target_and_keep_its_mode(tmp_path, capsys):
    """A --json path that is a link (results/latest.json -> run-7.json) still
    points where it did, at the new results; a file's permissions stay as set;
    a plot path without an extension is still a PNG (the partial file keeps
    the extension matplotlib picks a format by)."""
    trace = str(mooncake_trace(tmp_path / "m.jsonl"))
    target, link, plot = tmp_path / "run-7.json", tmp_path / "latest.json", tmp_path / "curve"
    target.write_text("{}")
    target.chmod(0o640)
    link.symlink_to(target.name)
    assert main(["replay", trace, "--policies", "lru", "--capacity-blocks", "2", "--json", str(link),
                 "--plot", str(plot), "--no-progress"]) == 0
    assert link.is_symlink() and os.readlink(link) == target.name
    assert json.loads(target.read_text())["results"][0]["policy"] == "lru"
    assert target.stat().st_mode & 0o777 == 0o640
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve", "latest.json", "m.jsonl", "run-7.json"]


def test_empty_flag_values_mean_what_the_same_config_value_means(capsys, monkeypatch):
    import gateway.server

    hosts = []

    def bind(host, port):
        hosts.append(host)
        raise gateway.server.ListenError("server.host", "stop here")

    monkeypatch.setattr(gateway.server, "bind_sockets", bind)
    # `--host ""` is every interface, as `server.host: ""` is (it was the config's host).
    assert main(["serve", "--host", "", "--port", "0"]) == 2
    assert main(["engine", "--host", ""]) == 2
    assert hosts == ["", ""]
    capsys.readouterr()
    assert main(["serve", "--log-level", ""]) == 2  # was info, silently
    assert capsys.readouterr().err == "kvgate: --log-level: log level '': choose debug, info, warning or error\n"


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"kvgate {version('kvgate')}\n"


def test_a_dash_is_no_file_name_and_dev_stdout_is_written_in_place(tmp_path, capsys, monkeypatch):
    """`-` would have been a file literally named "-": refused with the path to use;
    /dev/stdout (or any existing non-regular file) is written in place, whatever /dev's mode."""
    monkeypatch.chdir(tmp_path)
    path = str(mooncake_trace(tmp_path / "m.jsonl"))
    for argv, said in ((["replay", path, "--json", "-"], "kvgate: --json: give a file path (for standard output, /dev/stdout)\n"),
                       (["synth", "-o", "-"], "kvgate: -o: give a file path (for standard output, /dev/stdout)\n"),
                       (["replay", "-"], "kvgate: TRACE: give a file path (for standard input, /dev/stdin)\n")):
        assert main(argv) == 2
        assert capsys.readouterr().err == said
    assert not (tmp_path / "-").exists()
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    read = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        with monkeypatch.context() as patched:
            # As a user who cannot write into tmp_path (as /dev for /dev/stdout).
            patched.setattr(os, "access", lambda p, mode: str(p) == str(fifo))
            assert main(["replay", path, "--capacity-blocks", "4", "--json", str(fifo), "--no-progress"]) == 0
        assert json.loads(read.communicate(timeout=30)[0])["results"][0]["capacity_blocks"] == 4
    finally:
        read.kill()
        read.wait()


def test_server_log_times_carry_their_utc_offset():
    """asctime had no offset: logs of hosts in other zones (or across a DST change)
    could not be compared without guessing."""
    from gateway.cli import _ServerLogFormat

    record = logging.LogRecord("kvgate", logging.INFO, __file__, 1, "hello", None, None)
    line = _ServerLogFormat("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d{4} INFO kvgate: hello", line), line


def test_engine_listens_where_its_help_says(tmp_path, capsys, monkeypatch):
    """`kvgate engine` takes server.host from --config, as `kvgate serve` does, and
    its --help says so (it promised 127.0.0.1, while a config shared with a gateway
    on 0.0.0.0 exposed the engine on every interface)."""
    import gateway.server

    for command in ("serve", "engine"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "listen address (default: server.host of --config, 127.0.0.1)" in " ".join(capsys.readouterr().out.split())
    listened = []
    monkeypatch.setattr(gateway.server, "run_engine_server", lambda config, host, port: listened.append((host, port)))
    config = tmp_path / "c.yaml"
    config.write_text("server:\n  host: 127.0.0.2\n")
    main(["engine", "--config", str(config), "--port", "19999"])
    main(["engine", "--config", str(config), "--port", "19999", "--host", "127.0.0.3"])
    assert listened == [("127.0.0.2", 19999), ("127.0.0.3", 19999)]
