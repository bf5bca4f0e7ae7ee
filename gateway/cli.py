"""The `kvgate` command: serve, engine, replay, tune, synth.

Heavy imports (torch, transformers, aiohttp) happen inside the subcommand
that needs them, so `kvgate replay` starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterator, Sequence

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left
EXIT_TERMINATED = 143  # 128 + SIGTERM


class CliError(Exception):
    """A problem to report as one line on stderr with exit status 2."""


class StdoutError(CliError):
    """Standard output could not be written (a full disk, an I/O error)."""


class _GuardedStdout:
    """sys.stdout for the offline commands: a failed write becomes StdoutError,
    one line on stderr, where it was a traceback (`kvgate replay T > out.txt` on a
    full disk).  A reader that left (BrokenPipeError) is handled apart."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with _as_stdout_error():
            return self._stream.write(text)

    def flush(self) -> None:
        with _as_stdout_error():
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _as_stdout_error() -> Iterator[None]:
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise StdoutError(f"stdout: {exc.strerror or exc}") from None


OFFLINE_COMMANDS = ("replay", "tune", "synth")


def console() -> None:
    """The `kvgate` command: ``main()``, then the process's exit.  A model load cut
    short by a signal goes on in its daemon thread, maybe inside torch: then the
    process ends at once (logs and output flushed), without Python's shutdown,
    which would abort on that thread or hang on a lock it holds."""
    try:
        code = main()
    except SystemExit as exc:  # SIGTERM during start-up: 143
        if not _abandoned():
            raise
        code = exc.code if isinstance(exc.code, int) else 1
    if _abandoned():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _abandoned() -> bool:
    """gateway.startup_thread.abandoned(), where a server's start-up imported it (no
    thread of its was started otherwise).  Not imported here: that import (asyncio,
    ~30 ms) ran before main() could catch a Ctrl-C, which then printed a traceback."""
    startup = sys.modules.get("gateway.startup_thread")
    return startup is not None and startup.abandoned()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while the command starts (its imports) or after it ran
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    # SIGTERM to a replay or a tune (a job scheduler's time limit, `kill`) stops it as
    # Ctrl-C does, reporting what finished rather than losing it all; the exit status
    # still says which signal it was.
    terminated: list[int] = []

    def stop_as_if_interrupted(signum, frame) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    terminable = (args.command in ("replay", "tune", "serve", "engine")
                  and threading.current_thread() is threading.main_thread()
                  and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN)
    handler = _stop_server_start if args.command in ("serve", "engine") else stop_as_if_interrupted
    previous = signal.signal(signal.SIGTERM, handler) if terminable else None
    try:
        code = _run(args)
    finally:
        if terminable:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_TERMINATED if terminated and code == EXIT_INTERRUPTED else code


def _stop_server_start(signum, frame) -> None:
    """SIGTERM to a server before its event loop takes the signal over (its imports,
    its config; gateway/server.py handles it from then on, the model load included).

    The kernel's default action would end it, but never for a container's first
    process (a Kubernetes pod has no init): the signal was dropped, and the server
    loaded, served and was killed terminationGracePeriodSeconds later.  Nothing has
    started that needs stopping, so it ends now, as the default action would; not by
    an exception, which an import under way can swallow (torch's of numpy prints it
    and goes on, broken)."""
    logging.getLogger("gateway.server").info("SIGTERM during start-up: stopping")
    sys.stderr.flush()
    os._exit(EXIT_TERMINATED)


def _run(args: argparse.Namespace) -> int:
    offline = args.command in OFFLINE_COMMANDS
    stdout = sys.stdout
    if offline and stdout is not None:
        sys.stdout = _GuardedStdout(stdout)
    try:
        _setup_logging(getattr(args, "log_level", None), server=args.command in ("serve", "engine"))
        code = args.run(args) or 0
        # Flush here, not at interpreter exit: a reader that left (`| head`)
        # shows up as BrokenPipeError now, where it can be handled.
        sys.stdout.flush()
        return code
    except CliError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        if isinstance(exc, StdoutError):
            _discard_stdout()  # what is still buffered would fail again at exit
        return EXIT_USAGE
    except MemoryError:
        # Past the up-front checks (_check_pool_memory, the engine's KV sizing): a
        # ulimit, or memory that went elsewhere meanwhile.
        print(f"kvgate: out of memory ({_MEMORY_HINTS[args.command]})", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        # What reached here stopped before any output file (those are written whole
        # or not at all), or while they were written, which said what it left.
        # Replay and tune report their own interruptions later on.
        if offline:
            from engine.replay_report import OutputsInterrupted  # loaded by then, if any output was

            if not isinstance(exc, OutputsInterrupted):
                print("kvgate: interrupted; no file written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        if offline:
            sys.stdout = stdout


# What needs less memory, by subcommand: what each allocates up front.
_SERVER_MEMORY_HINT = ("the engine allocates its KV cache up front: a smaller engine.device_blocks, "
                       "engine.kv_memory_fraction or engine.host_blocks_multiplier needs less")
_REPLAY_MEMORY_HINT = ("replay and tune allocate each cache up front: a smaller capacity, fewer --replicas or a "
                       "smaller --host-blocks needs less")
_MEMORY_HINTS = {"serve": _SERVER_MEMORY_HINT, "engine": _SERVER_MEMORY_HINT, "replay": _REPLAY_MEMORY_HINT,
                 "tune": _REPLAY_MEMORY_HINT, "synth": "a shorter --duration or a lower --rate needs less"}


class _ServerLogFormat(logging.Formatter):
    """Times as ISO 8601 with the UTC offset and milliseconds
    (2026-12-07T01:19:32.123+0000): logs from hosts in other time zones, or
    read after a DST change, sort and compare without guessing."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = self.converter(record.created)
        return f"{time.strftime('%Y-%m-%dT%H:%M:%S', when)}.{int(record.msecs):03d}{time.strftime('%z', when)}"


def _setup_logging(level: str | None, server: bool = True) -> None:
    name = (level if level is not None else os.environ.get("KVGATE_LOG_LEVEL") or "info").upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        source = "--log-level" if level is not None else "KVGATE_LOG_LEVEL"
        raise CliError(f"{source}: log level {name.lower()!r}: choose debug, info, warning or error")
    # A server's log is read later, by time and source; a tool's warnings (a trace's
    # odd lines) are read now, beside its one-line errors, in the same voice.
    if server:
        handler = logging.StreamHandler()
        handler.setFormatter(_ServerLogFormat("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=name, handlers=[handler])
    else:
        logging.basicConfig(level=name, format="kvgate: %(message)s")
    # Libraries' INFO lines are not the user's business: matplotlib announces building
    # its font cache (the first --plot), torch dumps cache statistics at exit.
    for library in ("matplotlib", "torch"):
        logging.getLogger(library).setLevel(max(logging.WARNING, logging.getLogger().level))
    if not sys.stderr.isatty():
        # Progress bars (transformers' weight loading) are a screenful of
        # carriage returns in a container's log.
        # (Read by transformers when it is imported, which is later.)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _discard_stdout() -> None:
    """Point stdout at /dev/null once its reader is gone.

    Python flushes stdout again at exit; without this, the output still
    buffered would fail a second time and print a BrokenPipeError traceback.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no real file (captured, closed): nothing to flush later
        pass


def _build_parser() -> argparse.ArgumentParser:
    from gateway.version import kvgate_version

    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvgate {kvgate_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible gateway")
    serve.add_argument("--config", help="config.yaml (default: built-in defaults)")
    serve.add_argument("--host", help="listen address (default: server.host of --config, 127.0.0.1)")
    serve.add_argument("--port", type=_port, help="listen port (default: server.port of --config, 8000)")
    serve.add_argument("--replica", action="append", default=[], metavar="URL",
                       help="a `kvgate engine` server to route to (openai+http://... for an external "
                            "OpenAI-compatible server); repeat for more")
    serve.add_argument("--record-trace", metavar="FILE", help="record served traffic as a Bailian trace")
    serve.add_argument("--log-level", help="debug, info (default), warning or error; also KVGATE_LOG_LEVEL")
    serve.set_defaults(run=_run_serve)

    engine = sub.add_parser("engine", help="run one engine replica over HTTP")
    engine.add_argument("--config", help="config.yaml")
    engine.add_argument("--host", default=None, help="listen address (default: server.host of --config, 127.0.0.1)")
    engine.add_argument("--port", type=_port, default=8001, help="listen port (default 8001)")
    engine.add_argument("--log-level", help="debug, info (default), warning or error; also KVGATE_LOG_LEVEL")
    engine.set_defaults(run=_run_engine)

    replay = sub.add_parser("replay", help="replay a trace through the block cache")
    replay.add_argument("trace", help="Bailian or Mooncake JSONL trace")
    replay.add_argument("--format", default="auto", choices=["auto", "bailian", "mooncake"],
                        help="trace format (default auto: told by its fields)")
    replay.add_argument("--policies", default="lru,fifo,s3fifo,belady",
                        help="comma-separated: lru,fifo,s3fifo,belady,wa,wa-paper (default: lru,fifo,s3fifo,belady)")
    sizes = replay.add_mutually_exclusive_group()
    sizes.add_argument("--capacity", default=None,
                       help="fractions of the trace's unique blocks (default 0.01,0.02,0.05,0.1,0.2)")
    sizes.add_argument("--capacity-blocks", default=None, help="comma-separated capacities in blocks")
    replay.add_argument("--host-blocks", type=int, default=0, help="host tier behind each device tier (default 0)")
    replay.add_argument("--config", help="config.yaml whose cache section configures the policies")
    replay.add_argument("--json", metavar="OUT", help="write results as JSON")
    replay.add_argument("--plot", metavar="OUT.png", help="plot hit ratio against capacity")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.add_argument("--replicas", type=int, default=1,
                        help="simulate N replicas behind the router (capacity is per replica)")
    replay.add_argument("--routing", default=None,
                        help="with --replicas: comma-separated prefix-aware,least-load,round-robin,session "
                             "(default: all four)")
    replay.add_argument("--index", default="exact", choices=["exact", "approx"],
                        help="with --replicas: what the router knows of each replica's cache: exact (a `kvgate "
                             "engine`'s KV events) or approx (an external server's: what was sent where; "
                             "router.approx_ttl_s and approx_capacity_blocks) (default exact)")
    replay.add_argument("--index-lag", type=float, default=0.0, metavar="SECONDS",
                        help="with --replicas and the exact index: KV events reach the router this late (default 0)")
    replay.set_defaults(run=_quietly(_run_replay))

    tune = sub.add_parser("tune", help="search the workload-aware weights and windows on a trace")
    tune.add_argument("trace", help="Bailian or Mooncake JSONL trace (e.g. a `serve --record-trace` recording)")
    tune.add_argument("--format", default="auto", choices=["auto", "bailian", "mooncake"],
                      help="trace format (default auto: told by its fields)")
    tune_sizes = tune.add_mutually_exclusive_group()
    tune_sizes.add_argument("--capacity", default=None,
                            help="device tier as a fraction of the trace's unique blocks (default 0.05)")
    tune_sizes.add_argument("--capacity-blocks", default=None,
                            help="device tier in blocks (the engine's; one value, as --capacity)")
    tune.add_argument("--host-blocks", type=int, default=0, help="host tier behind the device tier (default 0)")
    tune.add_argument("--config", help="config.yaml: its cache section is the starting point and the baseline")
    tune.add_argument("--time-limit", type=float, default=300.0, metavar="S", help="stop searching after S seconds (default 300)")
    tune.add_argument("--max-evals", type=int, default=None, metavar="N", help="stop the search after N replays (the two baselines, lru and the starting settings, always run)")
    tune.add_argument("--holdout", type=float, default=0.0, metavar="F",
                      help="search on the first 1-F of the trace, report all three on the last F (default 0: no held-out part)")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    tune.set_defaults(run=_quietly(_run_tune))

    synth = sub.add_parser("synth", help="generate a Bailian-format trace, or print a trace's statistics")
    synth.add_argument("--profile", choices=["to-c", "to-b", "mixed"],
                       help="workload whose statistics the trace follows (default to-c)")
    synth.add_argument("--duration", type=float, help="seconds of traffic (default 3600)")
    synth.add_argument("--rate", type=float,
                       help="mean requests per second over whole hours, follow-up turns included; to-B's "
                            "top-of-hour jobs put a shorter trace above it (default 5)")
    synth.add_argument("--seed", type=int, help="random seed (default 0)")
    synth.add_argument("-o", "--output", metavar="FILE", help="where to write the trace")
    synth.add_argument("--stats", metavar="FILE", help="print the paper's statistics for this trace instead")
    synth.add_argument("--format", default=None, choices=["auto", "bailian", "mooncake"],
                       help="format of the --stats trace (default auto)")
    synth.set_defaults(run=_run_synth)
    return parser


def _load_config(path: str | None, gateway: bool = False):
    from engine.config import ConfigError
    from gateway.config import load_config

    try:
        return load_config(path, gateway=gateway)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _run_serve(args: argparse.Namespace) -> int:
    for url in args.replica:
        _check_replica_url(url)
    from gateway.config import located

    config = _load_config(args.config, gateway=True)
    _check_replica_servers(config, args.replica)
    if args.record_trace is not None:
        if not args.record_trace:  # `--record-trace ""` would record nothing, silently
            raise CliError("--record-trace: give a file path")
        config.server.record_trace = os.path.expanduser(args.record_trace)  # "~/x" quoted, as the config's
    recording = config.server.record_trace
    made: list[str] = []  # what the check below created: gone again if the server does not start
    if recording:  # now, not after the model has loaded
        # The flag's errors name it; the config file's start at its FILE:LINE.
        flag = "--record-trace" if args.record_trace else located(args.config, "server.record_trace") + "server.record_trace"
        if os.path.isdir(recording):
            raise CliError(f"{flag}: {recording} is a directory; give a file path")
        # A recording moves an older file at its path aside (FILE.1, ...), then drops the oldest.
        _distinct_outputs([(flag, recording)], [("config file", args.config), ("model", config.model.path)])
        folder = os.path.dirname(os.path.abspath(recording))
        existing = folder
        while not os.path.exists(existing):
            made.append(existing)  # innermost first
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):  # makedirs would say "File exists", which names no culprit
            raise CliError(f"{flag}: cannot write {recording}: {existing} is a file, not a folder")
        if not os.path.exists(recording):
            made.insert(0, os.path.realpath(recording))  # a link's target (the file made), never the link
        try:
            # What the recorder will do at start: its folder, and a file it can write.
            os.makedirs(folder, exist_ok=True)
            with open(recording, "a", encoding="ascii"):
                pass
        except OSError as exc:
            raise CliError(f"{flag}: cannot write {recording}: {exc.strerror}") from None
        if existing != folder:
            logging.getLogger("kvgate").info("created %s for the recording", folder)
    from gateway.server import run_gateway

    try:
        with _startup_errors(args.config, _listen_flags(args)):
            run_gateway(config, config.server.host if args.host is None else args.host,
                        args.port if args.port is not None else config.server.port, args.replica)
    except CliError:
        _remove_unused(made)  # a start that failed (the port taken, the model) recorded nothing
        raise
    return 0


def _remove_unused(paths: Sequence[str]) -> None:
    """The empty file and then the folders the recording's check made, each only
    while still empty (innermost first)."""
    for path in paths:
        with contextlib.suppress(OSError):
            if os.path.isdir(path):
                os.rmdir(path)  # refuses a folder that is not empty
            elif os.path.getsize(path) == 0:
                os.unlink(path)


def _run_engine(args: argparse.Namespace) -> int:
    config = _load_config(args.config)
    from gateway.server import run_engine_server

    with _startup_errors(args.config, _listen_flags(args)):
        run_engine_server(config, config.server.host if args.host is None else args.host, args.port)
    return 0


def _listen_flags(args: argparse.Namespace) -> list[str]:
    """The listen settings given by flags (their errors are not the config file's)."""
    return [key for key, flag in (("server.host", args.host), ("server.port", args.port)) if flag is not None]


@contextlib.contextmanager
def _startup_errors(config_path: str | None, flags: Sequence[str] = ()):
    """What stops a server from starting (the model, the port, the keys, the
    recording file) as one line: these say what to fix, a traceback would not.
    A setting's error starts with its FILE:LINE when the config file set it
    (``flags``: the settings a command-line flag gave instead)."""
    from engine.config import ConfigError
    from engine.model_loader import ModelLoadError
    from gateway.config import located
    from gateway.server import ListenError

    try:
        yield
    except (ModelLoadError, ConfigError) as exc:
        raise CliError(located(config_path, exc.key) + str(exc) if exc.key else str(exc)) from None
    except OSError as exc:  # the port in use, a recording path that cannot be made
        where = located(config_path, exc.key) if isinstance(exc, ListenError) and exc.key not in flags else ""
        raise CliError(f"{where}cannot start: {exc}") from None


def _check_replica_url(url: str) -> None:
    """Refuse a --replica that is no http(s) URL now, not at the first request
    routed to it after the model has loaded."""
    from gateway.config import is_http_url, replica_url_problem, without_userinfo

    bare = url[len("openai+"):] if url.startswith("openai+") else url
    if not is_http_url(bare):
        raise CliError(f"--replica {without_userinfo(url)!r}: give a URL like http://host:8001 "
                       "(openai+http://... for an external server)")
    problem = replica_url_problem(bare)
    if problem:
        raise CliError(f"--replica {without_userinfo(url)!r} {problem}")


def _check_replica_servers(config, urls: Sequence[str]) -> None:
    """Refuse a --replica that reaches the same server as a config replica or an
    earlier --replica (what a config file's own replicas are checked for): one
    server listed twice gets twice the traffic and two indexes of one cache."""
    from gateway.config import replica_base_url, replica_slots, same_servers, without_userinfo

    slots = replica_slots(config.replicas)
    entries = [(f"replicas.{i}", spec.url) for i, spec in slots]
    entries += [(f"--replica {without_userinfo(url)!r}", url.removeprefix("openai+")) for url in urls]
    # A flag's replica names no model (the server's own): the config's entries say theirs.
    pairs = same_servers([url for _, url in entries], [spec.model for _, spec in slots])
    if pairs:  # one line: the first (a config's own duplicates were refused as it loaded)
        later, first = pairs[0]
        server = without_userinfo(replica_base_url(entries[first][1]))
        raise CliError(f"{entries[later][0]}: the same server as {entries[first][0]} ({server})")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535)")
    return value


def _writable(path: str | None, flag: str) -> None:
    """Refuse an output path that cannot be written before a long run, not after."""
    if path is None:
        return
    if not path:  # `--json ""`: the run would end and write nothing, silently
        raise CliError(f"{flag}: give a file path")
    if path == "-":  # the shell's stdout, which kvgate does not take (it would write a file named "-")
        raise CliError(f"{flag}: give a file path (for standard output, /dev/stdout)")
    if os.path.isdir(path):
        raise CliError(f"{flag}: {path} is a directory")
    from engine.whole_file import is_stdout

    if is_stdout(path):  # written through the descriptor the shell gave, wherever it leads
        return
    if os.path.exists(path) and not os.path.isfile(path):  # a pipe, a device: written in place
        if not os.access(path, os.W_OK):
            raise CliError(f"{flag}: cannot write {path}: permission denied")
        return
    parent = os.path.dirname(os.path.realpath(path))  # where the file is renamed into (a link: its target's)
    if not os.path.isdir(parent):
        raise CliError(f"{flag}: cannot write into {parent}: no such folder")
    if not os.access(parent, os.W_OK):
        raise CliError(f"{flag}: cannot write into {parent}: permission denied")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise CliError(f"{flag}: cannot write {path}: permission denied")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet: the same path, however written
        return os.path.realpath(a) == os.path.realpath(b)


def _distinct_outputs(outputs: Sequence[tuple[str, str | None]], inputs: Sequence[tuple[str, str | None]]) -> None:
    """Refuse an output that would overwrite an input (the trace, the config) or
    another output, before the run: the results would replace what they came from."""
    given = [(flag, path) for flag, path in outputs if path]
    for i, (flag, path) in enumerate(given):
        for name, source in inputs:
            if source and _same_file(path, source):
                raise CliError(f"{flag}: {path} is the {name}; write the output elsewhere")
        for other, other_path in given[:i]:
            if _same_file(path, other_path):
                raise CliError(f"{other} and {flag}: both write {path}; give each its own file")


# More blocks than this is no cache anyone has, and the replay's pool would
# allocate bookkeeping for every one of them up front (gigabytes, then MemoryError).
MAX_BLOCKS = 100_000_000
# Each simulated replica is a whole cache and its policy; a fleet past this is no
# longer one router's (and 100,000 of them took 5 GB on a 172-request trace).
MAX_REPLICAS = 1024
# A block pool's bookkeeping per block, allocated up front whatever the trace
# (engine.block_pool: ~72 bytes measured); the blocks a trace fills cost more on top.
POOL_BYTES_PER_BLOCK = 80


def _check_pool_memory(device_blocks: int, host_blocks: int, unique: int, flag: str, pools: int = 1) -> None:
    """Refuse caches whose bookkeeping alone would not fit in this machine's RAM
    (a MemoryError or the kernel's OOM killer, minutes into a run).  A replay
    allocates no tier past the trace's distinct blocks (engine.replay.pool_sizes)."""
    from engine.memory import available_ram
    from engine.replay import pool_sizes

    blocks = sum(pool_sizes(device_blocks, host_blocks, unique))
    need = blocks * pools * POOL_BYTES_PER_BLOCK
    room = available_ram()
    if need > room:
        size = f"{blocks:,} blocks" + (" (the trace's distinct ones)" if blocks < device_blocks + host_blocks else "")
        caches = f"{pools} caches of {size} need" if pools > 1 else f"a cache of {size} needs"
        raise CliError(f"{flag}: {caches} ~{_memory_text(need)} of bookkeeping up front; "
                       f"{_memory_text(room)} of memory is available")


def _memory_text(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _parse_list(text: str, kind: type, name: str) -> list:
    values = [_parse_value(part.strip(), kind, name) for part in text.split(",") if part.strip()]
    if not values:
        raise CliError(f"{name}: give at least one value")
    return values


def _parse_value(part: str, kind: type, name: str) -> float | int:
    try:
        number = float(part)
    except ValueError:
        hint = f"; give a fraction such as {_percent_as_fraction(part)}" if part.endswith("%") else ""
        raise CliError(f"{name}: {part!r} is not a number{hint}") from None
    if not number > 0 or number == float("inf"):
        raise CliError(f"{name}: {part!r} must be a positive, finite number")
    if kind is float:
        return number
    # Whole numbers, written 4096 or 4e3; float() reads both, int() only the first.
    if number > MAX_BLOCKS:
        raise CliError(f"{name}: {part!r} is too large (at most {MAX_BLOCKS:,} blocks)")
    if number != int(number):
        raise CliError(f"{name}: {part!r} is not a whole number")
    return int(number)


def _percent_as_fraction(text: str) -> str:
    """'5%' -> '0.05', for the hint; a fallback when the percentage is no number."""
    try:
        return f"{float(text[:-1]) / 100:g}"
    except ValueError:
        return "0.05"


def _run_replay(args: argparse.Namespace) -> int:
    from engine.whole_file import is_stdout

    if is_stdout(args.json) or is_stdout(args.plot):
        # Standard output holds the results file alone (`--json /dev/stdout | jq`):
        # the table goes to standard error.
        with contextlib.redirect_stdout(sys.stderr):
            return _replay(args)
    return _replay(args)


def _replay(args: argparse.Namespace) -> int:
    from engine.replay import future_accesses
    from engine.replay_report import (
        collect_until_interrupted, interrupted_note, print_row, table_footer, table_header, table_row, trace_summary,
        unfinished_outputs, write_json, write_outputs, write_plot,
    )

    config = _load_config(args.config)
    _check_replay_args(args)
    policies = _replay_policies(args.policies)
    trace = _read_trace(args.trace, args.format)
    unique = trace.unique_blocks()
    capacities = _replay_capacities(args, unique)
    # Pools run one at a time, but a routing run holds one per replica (its pooled
    # reference, one of N times the capacity, is the same size).
    _check_pool_memory(max(capacities), args.host_blocks, unique, _capacity_flag(args), args.replicas)
    _note_capacities_below_the_longest_prompt(trace, capacities, _capacity_flag(args))
    summary = trace_summary(trace, unique, trace.ideal_hit_ratio())
    if args.replicas > 1:
        from gateway.routing_sim import run_from_cli

        try:
            interrupted = run_from_cli(args, trace, policies, capacities, config, summary, unique)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        return EXIT_INTERRUPTED if interrupted else 0
    future = future_accesses(trace) if "belady" in policies else None
    runs = _replays(args, trace, policies, capacities, config, unique, future)
    # The header now and each row as its run finishes: on a long trace a run takes minutes.
    print(table_header(summary, args.host_blocks), flush=True)
    ideal = summary["ideal_hit_ratio"]
    results, interrupted = collect_until_interrupted(runs, on_result=lambda r: print_row(table_row(r, ideal)))
    if results:  # else its capacity plan would be a heading over nothing
        print(table_footer(summary, results))
    if not results and (note := unfinished_outputs([("--json", args.json), ("--plot", args.plot)])):
        print(note, file=sys.stderr)
    interrupted |= write_outputs(CliError, [
        ("--json", args.json if results else None,
         lambda out: write_json(out, summary, results, {"interrupted": True} if interrupted else None)),
        ("--plot", args.plot if results else None, lambda out: write_plot(out, summary, results, partial=interrupted)),
    ])
    if interrupted:
        print(interrupted_note(len(results), len(policies) * len(capacities)), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _note_capacities_below_the_longest_prompt(trace, capacities: Sequence[int], flag: str) -> None:
    """Said, not refused: the figures are still what a cache of that size keeps,
    but an engine (vLLM, kvgate's) with so few device blocks refuses such a prompt."""
    longest = max(len(request.keys) for request in trace.requests)
    small = [c for c in capacities if c < longest]
    if small:
        print(f"kvgate: note: {flag}: {', '.join(map(str, small))} (in blocks) below the trace's longest prompt "
              f"({longest} blocks): an engine with so few device blocks would refuse that prompt, which the replay "
              "still counts", file=sys.stderr)


def _read_trace(path: str, fmt: str):
    """The trace at ``path``; a file that is not one is a `FILE:LINE: why` error."""
    from engine.traces import TraceError, load_trace

    if path == "-" and not os.path.exists(path):
        raise CliError("TRACE: give a file path (for standard input, /dev/stdin)")
    try:
        return load_trace(path, fmt)
    except TraceError as exc:
        raise CliError(str(exc)) from None


def _check_replay_args(args: argparse.Namespace) -> None:
    _writable(args.json, "--json")
    _writable(args.plot, "--plot")
    _distinct_outputs([("--json", args.json), ("--plot", args.plot)],
                      [("trace", args.trace), ("config file", args.config)])
    if args.plot and os.path.splitext(args.plot)[1].lower() not in ("", ".png", ".pdf", ".svg", ".jpg", ".jpeg"):
        raise CliError("--plot: write .png, .pdf, .svg or .jpg")
    _check_host_blocks(args.host_blocks)
    if not 1 <= args.replicas <= MAX_REPLICAS:
        raise CliError(f"--replicas: give a number from 1 to {MAX_REPLICAS}")
    if args.replicas < 2:
        # One replica has nothing to route: the run would be a plain replay in disguise.
        for flag, given in (("--routing", args.routing is not None), ("--index", args.index != "exact"),
                            ("--index-lag", args.index_lag != 0)):
            if given:
                raise CliError(f"{flag} is about routing across replicas: give --replicas N (N >= 2) too")
    if not 0 <= args.index_lag <= 86_400:  # also NaN
        raise CliError("--index-lag: give seconds, from 0 to 86400")
    if args.index_lag and args.index != "exact":
        raise CliError("--index-lag delays KV events, which only the exact index follows: drop --index approx")
    if args.replicas > 1:
        # Before the trace is read: a typo should not wait for a large trace to load.
        from gateway.routing_sim import routings_from_cli

        try:
            routings_from_cli(args)
        except ValueError as exc:
            raise CliError(str(exc)) from None


def _check_host_blocks(blocks: int) -> None:
    if blocks < 0:
        raise CliError("--host-blocks: give a number >= 0")
    if blocks > MAX_BLOCKS:
        raise CliError(f"--host-blocks: {blocks} is too large (at most {MAX_BLOCKS:,} blocks)")


def _replay_policies(text: str) -> list[str]:
    from engine.policies import policy_names

    policies = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))  # each once, as capacities
    unknown = [p for p in policies if p not in policy_names()]
    if unknown or not policies:
        raise CliError(f"--policies: unknown {', '.join(unknown) or '(none given)'}; "
                       f"choose from {', '.join(policy_names())}")
    return policies


def _capacity_flag(args: argparse.Namespace) -> str:
    return "--capacity-blocks" if args.capacity_blocks is not None else "--capacity"


def _replay_capacities(args: argparse.Namespace, unique: int) -> list[int]:
    # `is not None`: an empty --capacity "" is a mistake to report, not a request for the defaults.
    if args.capacity_blocks is not None:
        return list(dict.fromkeys(_parse_list(args.capacity_blocks, int, "--capacity-blocks")))
    fractions = _parse_list("0.01,0.02,0.05,0.1,0.2" if args.capacity is None else args.capacity, float, "--capacity")
    # Once each: on a small trace several fractions round to the same number of blocks.
    return list(dict.fromkeys(_blocks_of(f, unique, "--capacity") for f in fractions))


def _blocks_of(fraction: float, unique: int, flag: str) -> int:
    wanted = fraction * unique
    if not wanted <= MAX_BLOCKS:  # also inf, which round() cannot take
        raise CliError(f"{flag}: {fraction:g} of {unique} unique blocks is too large (at most {MAX_BLOCKS:,} blocks)")
    blocks = max(1, round(wanted))
    if blocks > MAX_BLOCKS:
        raise CliError(f"{flag}: {fraction:g} of {unique} unique blocks is too large (at most {MAX_BLOCKS:,} blocks)")
    return blocks


def _replays(args: argparse.Namespace, trace, policies: list[str], capacities: list[int], config, unique: int,
             future) -> Iterator:
    """One ReplayResult per policy and capacity, as each finishes, under a progress bar."""
    from tqdm import tqdm

    from engine.replay import replay

    total = len(trace.requests) * len(policies) * len(capacities)
    with tqdm(total=total, unit="req", file=sys.stderr, disable=True if args.no_progress else None,
              mininterval=0.5, leave=False) as bar:
        for policy in policies:
            for capacity in capacities:
                bar.set_description(f"{policy}@{capacity}")
                yield replay(trace, policy, capacity, config.cache, host_blocks=args.host_blocks,
                             unique_blocks=unique, progress=bar.update, future=future)


@contextlib.contextmanager
def _quiet_policy_logs():
    """Replays run many policies over trace time: the live server's alarm and
    fallback log lines (stamped with wall-clock time) would only interleave with
    the progress bar.  The results report the fallbacks instead."""
    logger = logging.getLogger("kvgate.cache")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _quietly(run):
    def quiet_run(args: argparse.Namespace) -> int:
        with _quiet_policy_logs():
            return run(args)
    return quiet_run


def _run_tune(args: argparse.Namespace) -> int:
    from engine.tune import NothingFinished, format_report, tune

    config = _load_config(args.config)
    _check_tune_args(args)
    try:
        trace = _read_trace(args.trace, args.format)
        unique = trace.unique_blocks()
        capacity = _tune_capacity(args, unique)
        _check_pool_memory(capacity, args.host_blocks, unique, _capacity_flag(args))
        _note_capacities_below_the_longest_prompt(trace, [capacity], _capacity_flag(args))
        result = _tune_with_progress(args, tune, trace, capacity, config)
    except NothingFinished as exc:
        return _nothing_to_report(exc.stopped, args.time_limit)
    except KeyboardInterrupt:  # while the trace was being read
        return _nothing_to_report("interrupted", args.time_limit)
    except ValueError as exc:
        raise CliError(f"tune: {exc}") from None
    print(format_report(result, args.trace, len(trace.requests), unique))
    return EXIT_INTERRUPTED if result.stopped == "interrupted" else 0


def _check_tune_args(args: argparse.Namespace) -> None:
    if not 0 <= args.holdout < 1:
        raise CliError("--holdout: give a fraction in [0, 1)")
    if not args.time_limit > 0:
        raise CliError("--time-limit: give a positive number of seconds")
    if args.max_evals is not None and args.max_evals < 1:
        raise CliError("--max-evals: give at least 1 replay")
    _check_host_blocks(args.host_blocks)


def _tune_capacity(args: argparse.Namespace, unique: int) -> int:
    if args.capacity_blocks is not None:
        return _tune_value(args.capacity_blocks, int, "--capacity-blocks")
    fraction = 0.05 if args.capacity is None else _tune_value(args.capacity, float, "--capacity")
    return _blocks_of(fraction, unique, "--capacity")


def _tune_value(text: str, kind: type, flag: str) -> float | int:
    # Read as replay reads each value of its list (4096 or 4e3; 5% gets a hint), but one only.
    if "," in text:
        raise CliError(f"{flag}: tune searches at one capacity; give one value")
    return _parse_value(text.strip(), kind, flag)


def _tune_with_progress(args: argparse.Namespace, tune, trace, capacity: int, config):
    from tqdm import tqdm

    with tqdm(total=1, unit="replay", file=sys.stderr, disable=True if args.no_progress else None, leave=False) as bar:
        def progress(done: int, planned: int, label: str) -> None:
            bar.total = planned
            bar.set_description(label[:60])
            bar.update(done - bar.n)

        return tune(trace, capacity, config.cache, host_blocks=args.host_blocks, time_limit_s=args.time_limit,
                    max_evaluations=args.max_evals, holdout=args.holdout, progress=progress)


def _nothing_to_report(stopped: str, time_limit: float) -> int:
    """The search stopped before its baselines were scored: one line, no report."""
    if stopped == "interrupted":
        print("kvgate: tune interrupted before the first replays (lru and the starting settings) finished: "
              "nothing to report", file=sys.stderr)
        return EXIT_INTERRUPTED
    raise CliError(f"tune: the time limit ({time_limit:g} s) ran out before the first replays (lru and the starting "
                   "settings) finished: nothing to report; raise --time-limit")


def _run_synth(args: argparse.Namespace) -> int:
    from engine import synth
    from engine.replay_report import write_errors_as

    if args.stats and args.output:
        raise CliError("synth: --stats prints a trace's statistics and writes no file: drop -o "
                       "(or drop --stats to generate a trace)")
    # Their defaults are set here, so that --stats can tell them given (and unused).
    generation = {"--profile": (args.profile, "to-c"), "--duration": (args.duration, 3600.0),
                  "--rate": (args.rate, 5.0), "--seed": (args.seed, 0)}
    if args.stats and (given := [flag for flag, (value, _) in generation.items() if value is not None]):
        raise CliError(f"synth: --stats prints a trace's statistics and generates none: drop {', '.join(given)}")
    args.profile, args.duration, args.rate, args.seed = (
        default if value is None else value for value, default in generation.values())
    if args.stats:
        # Auto-detected like replay's: a Mooncake trace read as Bailian would
        # have its millisecond timestamps taken for seconds.
        trace = _read_trace(args.stats, args.format or "auto")
        print(synth.format_statistics(synth.trace_statistics(trace)))
        return 0
    if args.format:
        raise CliError("synth: --format describes the --stats trace; generated traces are always Bailian")
    if not args.output:
        raise CliError("synth: give -o FILE for the trace (or --stats FILE to analyse one)")
    _writable(args.output, "-o")
    try:
        records = synth.synthesize(args.profile, args.duration, args.rate, args.seed)
    except ValueError as exc:
        raise CliError(f"synth: {exc}") from None
    if not records:
        # An empty file is no trace: replay and tune would only refuse it later.
        raise CliError(f"synth: {args.duration:g} s at {args.rate:g} requests/s gave no requests; "
                       "raise --duration or --rate (nothing written)")
    with write_errors_as(CliError, "-o", args.output):
        synth.write_trace(records, args.output)
    print(f"wrote {len(records)} requests to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    console()
