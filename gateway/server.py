"""Entry points for `kvgate serve` and `kvgate engine`, and a loopback helper for tests.

Both run the app with ``handler_cancellation=True``: aiohttp then cancels a
handler whose client disconnected, which is what lets a non-streaming request
abort its engine work too (aiohttp's default since 3.7 is to let it run on).
"""

from __future__ import annotations

import gc
import logging
from typing import NamedTuple

from aiohttp import web

from gateway.app import create_app
from gateway.config import KvgateConfig

log = logging.getLogger(__name__)


class RunningServer(NamedTuple):
    runner: web.AppRunner
    url: str  # http://host:port (the real port when 0 was asked)

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Start ``app`` on host:port (0: any free port) and return its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # the bound port when 0 was asked
    bound = sock.getsockname()[1]
    return RunningServer(runner, f"http://{host}:{bound}")


def run_gateway(
    config: KvgateConfig, host: str | None = None, port: int | None = None, replica_urls: list[str] | None = None
) -> None:
    """`kvgate serve`: blocks until interrupted."""
    app = create_app(config, replica_urls=list(replica_urls or ()))
    _run(app, host or config.server.host, config.server.port if port is None else port, "gateway")


def run_engine_server(config: KvgateConfig, host: str | None = None, port: int | None = None) -> None:
    """`kvgate engine`: one in-process engine behind the OpenAI surface plus /kv_events."""
    app = create_app(config, engine_mode=True)
    _run(app, host or config.server.host, config.server.port if port is None else port, "engine")


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
    log.info("moved %d startup objects out of the garbage collector's scans", gc.get_freeze_count())


def _run(app: web.Application, host: str, port: int, what: str) -> None:
    # After the app's own startup (model loading): on_startup runs in order.
    app.on_startup.append(freeze_startup_objects)
    # run_app "prints" once the model is loaded and the socket is bound: log that moment.
    ready = lambda *_: log.info("kvgate %s listening on http://%s:%d", what, host, port)  # noqa: E731
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None, print=ready)
