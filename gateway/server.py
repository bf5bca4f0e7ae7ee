"""Entry points for `kvgate serve` and `kvgate engine`, and a loopback helper for tests.

Both run the app with ``handler_cancellation=True``: aiohttp then cancels a
handler whose client disconnected, which is what lets a non-streaming request
abort its engine work too (aiohttp's default since 3.7 is to let it run on).

Both bind their port before the model loads and stop in stages on SIGTERM or
Ctrl-C (ServerConfig: shutdown_delay_s, drain_timeout_s), the way a server
behind a Kubernetes Service has to: out of rotation first, then no new
connections, then the requests in flight finish or end with an OpenAI error.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import errno
import signal
import socket
import time
from typing import NamedTuple

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gateway.access_log import AccessLine
from gateway.app import GATEWAY, create_app
from gateway.config import KvgateConfig, LimitsConfig, ServerConfig
from gateway.http_protocol import KvgateRunner

log = logging.getLogger(__name__)


class _MalformedRequestFilter(logging.Filter):
    """aiohttp logs a request it cannot parse at ERROR, with a traceback that
    quotes the offending bytes: an Authorization header (an API key) included,
    and anyone can fill the log that way.  Such a request is the client's
    mistake and already got its 400: one DEBUG line, without the bytes.  So is
    a body that does not decode (aiohttp re-raises its error when it drains
    the rest of that body after the 400), and a client that went away while
    its body was arriving (counted as status 499, as any client that leaves)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, RequestPayloadError):
            log.debug("drained a request body that does not decode (%s)", type(exc.__cause__).__name__)
            return False
        if isinstance(exc, ConnectionResetError):
            log.debug("the client went away before its request was read")
            return False
        if not isinstance(exc, HttpProcessingError):
            return True
        log.debug("refused a malformed HTTP request (%s %s)", exc.code, type(exc).__name__)
        return False


logging.getLogger("aiohttp.server").addFilter(_MalformedRequestFilter())


class RunningServer(NamedTuple):
    runner: web.AppRunner
    url: str  # http://host:port (the real port when 0 was asked)

    async def stop(self) -> None:
        await self.runner.cleanup()


def _refusal_counter(app: web.Application):
    """What counts the answers the HTTP layer gives itself (kvgate_http_refused_total)."""
    return app[GATEWAY].metrics.refused if GATEWAY in app else None


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0,
                       access_log: logging.Logger | None = None) -> RunningServer:
    """Start ``app`` on host:port (0: any free port) and return its base URL;
    ``access_log``: where server.access_log's lines go (none by default)."""
    limits = app[GATEWAY].limits if GATEWAY in app else LimitsConfig()
    runner = KvgateRunner(app, header_timeout_s=limits.header_timeout_s, send_timeout_s=limits.send_timeout_s,
                          keepalive_timeout=limits.keepalive_timeout_s, handler_cancellation=True,
                          access_log=access_log, access_log_class=AccessLine, on_refused=_refusal_counter(app))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]  # the bound port when 0 was asked
    return RunningServer(runner, f"http://{host}:{bound}")


def run_gateway(
    config: KvgateConfig, host: str | None = None, port: int | None = None, replica_urls: list[str] | None = None
) -> None:
    """`kvgate serve`: blocks until stopped (SIGTERM, Ctrl-C), then drains."""
    host = config.server.host if host is None else host  # "": every interface, as in the config
    port = config.server.port if port is None else port
    sockets = bind_sockets(host, port)  # before the model loads: a taken port fails at once
    app = create_app(config, replica_urls=list(replica_urls or ()))
    warn_if_open(app, sockets)
    run_on_event_loop(_serve(app, sockets, config.server, "gateway"), config.server.event_loop)


def run_engine_server(config: KvgateConfig, host: str | None = None, port: int | None = None) -> None:
    """`kvgate engine`: one in-process engine behind the OpenAI surface plus /kv_events."""
    host = config.server.host if host is None else host  # "": every interface, as in the config
    port = config.server.port if port is None else port
    sockets = bind_sockets(host, port)
    app = create_app(config, engine_mode=True)
    warn_if_open(app, sockets)
    run_on_event_loop(_serve(app, sockets, config.server, "engine"), config.server.event_loop)


# Open files a server asks for (vLLM's figure): each client connection is one.
_OPEN_FILES = 65_535


def raise_open_files_limit(wanted: int = _OPEN_FILES) -> None:
    """Raise the soft limit on open files toward the hard one.  systemd and many
    shells start processes at 1024, which ~1,000 idle keep-alive clients use up:
    every later connection then fails at once (uvloop) or floods the log with
    accept() errors (asyncio)."""
    try:
        import resource
    except ImportError:  # not on Linux or macOS
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d (%s): about %d client connections at "
                        "once are the most this server takes", soft, target, exc, soft)


def run_on_event_loop(main, event_loop: str):
    """``asyncio.run(main)``, on uvloop when asked for and installed; ``main``'s result."""
    try:
        raise_open_files_limit()
        if event_loop == "uvloop":
            try:
                import uvloop
            except ImportError:
                log.warning("uvloop is not installed: running on asyncio's own event loop (pip install uvloop)")
            else:
                return uvloop.run(main)
        return asyncio.run(main)
    except BaseException:
        # A Ctrl-C before the loop ran it: closed, or Python warns that it "was never awaited".
        main.close()
        raise


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def warn_if_open(app: web.Application, sockets: list[socket.socket]) -> None:
    """Say so when the server takes requests from other machines with no API key."""
    if app[GATEWAY].principals:
        return
    exposed = [s.getsockname()[0] for s in sockets if not _is_loopback(s.getsockname()[0])]
    if exposed:
        log.warning("listening on %s with no API keys: anyone who can reach this port can use it "
                    "(set server.api_keys or KVGATE_API_KEYS, or bind to 127.0.0.1)", ", ".join(exposed))


async def freeze_startup_objects(app: web.Application) -> None:
    """Move everything alive after startup (model, tokenizer, config: ~390k
    objects with the default model) out of the cyclic garbage collector's reach.

    Otherwise each full collection walks them all: 210 ms measured with the
    default model, a stall of every stream on the loop.  Only the CLI servers do
    this: a test process that builds many apps would keep the cyclic garbage of
    the frozen ones.
    """
    gc.collect()
    gc.freeze()
    log.debug("moved %d startup objects out of the garbage collector's scans", gc.get_freeze_count())


class ListenError(OSError):
    """The server cannot take its address; ``key`` names the setting to change."""

    def __init__(self, key: str, message: str, code: int | None = None) -> None:
        super().__init__(*((code, message) if code is not None else (message,)))
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return self.message  # the errno stays on .errno; "[Errno 98]" means nothing to a user


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets for every address ``host`` resolves to, bound and listening now;
    connections wait in the backlog until the app has started.

    Taking the port before the model loads turns a port in use or an unknown
    host into an error within a second, not after minutes of loading.  Listening
    at once (not only binding) also stops a second server started at the same
    moment: SO_REUSEADDR, needed to rebind over TIME_WAIT after a restart, lets
    two sockets bind one port as long as neither listens.
    """
    try:
        # "" (like aiohttp's default) means every interface.
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError("server.host", f"cannot resolve host {host!r}: {exc.strerror}") from None
    infos = list(dict.fromkeys(infos))
    # Several addresses ("" gives 0.0.0.0 and ::) each take their own family; "::"
    # alone also takes IPv4 clients, as uvicorn's (and so vLLM's) --host :: does.
    v6only = len({info[0] for info in infos}) > 1
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
            try:
                sock.bind((address[0], port, *address[2:]))
                sock.listen(_BACKLOG)
            except OSError as exc:
                # An address this machine does not have is the host's fault; in use or not allowed, the port's.
                key = "server.host" if exc.errno == errno.EADDRNOTAVAIL else "server.port"
                raise ListenError(key, f"cannot listen on {host}:{port}: {exc.strerror}", exc.errno) from None
            if port == 0:  # one port for every address, the first one the kernel chose
                port = sock.getsockname()[1]
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


# aiohttp's own default backlog for a site.
_BACKLOG = 128


async def _serve(app: web.Application, sockets: list[socket.socket], cfg: ServerConfig, what: str) -> None:
    """Run ``app`` on the bound ``sockets`` until a signal, then stop as ServerConfig
    describes: out of rotation, still serving for shutdown_delay_s, port closed,
    drain_timeout_s for what is in flight, then the rest ended with an error."""
    app.on_startup.append(freeze_startup_objects)  # after the app's own startup (model loading)
    access_log = None
    if cfg.access_log:
        access_log = logging.getLogger("aiohttp.access")
        # Asked for in the config: its lines are INFO, and a log_level of warning
        # must not drop them all without a word.
        access_log.setLevel(logging.INFO)
    runner = KvgateRunner(app, header_timeout_s=cfg.limits.header_timeout_s, send_timeout_s=cfg.limits.send_timeout_s,
                          keepalive_timeout=cfg.limits.keepalive_timeout_s, handler_cancellation=True,
                          access_log=access_log, access_log_class=AccessLine, handle_signals=False,
                          shutdown_timeout=_CLEANUP_TIMEOUT_S, on_refused=_refusal_counter(app))
    await _start_or_stop(runner)
    signals = _Signals()
    try:
        sites = [web.SockSite(runner, sock) for sock in sockets]
        for site in sites:
            await site.start()
        host, port = sockets[0].getsockname()[:2]
        log.info("kvgate %s listening on http://%s:%d (event loop: %s)", what, host if ":" not in host else f"[{host}]",
                 port, type(asyncio.get_running_loop()).__module__.split(".")[0])
        await signals.first.wait()
        gw = app[GATEWAY]
        live = len(gw.live)
        log.info("%s: stopping; /ready answers 503; %d %s in flight (drain up to %g s, a second signal "
                 "ends them now)", signals.name, live, "request" if live == 1 else "requests",
                 cfg.shutdown_delay_s + cfg.drain_timeout_s)
        gw.begin_drain()
        await _wait(signals.second, cfg.shutdown_delay_s)
        for site in sites:
            await site.stop()  # no new connections
        gw.refusing = True  # nor new requests on open keep-alive connections
        deadline = time.monotonic() + cfg.drain_timeout_s
        while gw.live and time.monotonic() < deadline and not signals.second.is_set():
            await _wait(signals.second, min(0.1, deadline - time.monotonic()))
        if gw.live:
            log.warning("ending %d requests still in flight with an error", len(gw.live))
            pending = list(gw.live)
            gw.cut_live()
            await asyncio.wait(pending, timeout=_CLEANUP_TIMEOUT_S)
    finally:
        await runner.cleanup()
    log.info("kvgate %s stopped", what)


async def _start_or_stop(runner: web.AppRunner) -> None:
    """The app's start-up (model loading: seconds to minutes), ended at once by
    SIGINT (as KeyboardInterrupt) or SIGTERM (exit status 143).

    Through the loop's own signal handling rather than Python's default: a
    signal the kernel hands to another thread (the loading one, say) only sets
    a flag, and with no wake-up descriptor the loop would sleep on until the
    load ends before the main thread saw it.
    """
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []

    def stop(sig: signal.Signals) -> None:
        if not received:
            received.append(sig)
            task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    try:
        await runner.setup()
    except asyncio.CancelledError:
        if not received:
            raise
        log.info("%s during start-up: stopping", received[0].name)
        if received[0] == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


# The last wait, for requests already told to end and for aiohttp's own cleanup.
_CLEANUP_TIMEOUT_S = 5.0


class _Signals:
    """SIGTERM / SIGINT as two events: the first asks for a graceful stop, the
    second for an immediate one (as uvicorn and vLLM treat a second Ctrl-C)."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        self.name = ""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: signal.Signals) -> None:
        if self.first.is_set():
            log.warning("%s again: stopping now", sig.name)
            self.second.set()
            # A third signal gets Python's default (SIGINT: KeyboardInterrupt), should
            # the last clean-up itself hang.
            loop = asyncio.get_running_loop()
            for other in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(other)
            return
        self.name = sig.name
        self.first.set()


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Up to ``seconds``, or until ``event`` is set."""
    if seconds > 0 and not event.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)
