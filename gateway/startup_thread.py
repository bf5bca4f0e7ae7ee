"""Slow start-up work (loading a model or a tokenizer) off the event loop, in a
thread that a Ctrl-C does not have to wait for.

``asyncio.to_thread`` runs on the loop's default executor, whose threads
``asyncio.run`` joins before it returns: a Ctrl-C during a model load (minutes
for a large model, ~20 s for the bundled one's first conversion) cancels the
start-up at once but then waits for the load to finish before the process can
exit.  A daemon thread is not joined: the process exits now and the load dies
with it.  Only for work that leaves nothing half-written behind (the GGUF
conversion writes a temporary folder and renames it).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args, name: str = "kvgate-startup") -> T:
    """``fn(*args)`` on a new daemon thread; its result or exception, awaited."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result, error) -> None:
        if future.done():  # cancelled meanwhile: nobody waits for it any more
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        finally:
            _running.discard(threading.current_thread())
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop has closed: the server stopped while this ran

    thread = threading.Thread(target=run, name=name, daemon=True)
    _running.add(thread)
    thread.start()
    return await future


# Start-up threads still at work, for abandoned().
_running: set[threading.Thread] = set()


def abandoned() -> bool:
    """Whether start-up work is still running that nobody waits for (a model load a
    signal cut short).  It may be inside torch's C++ code: Python's own shutdown
    would stop that thread mid-call (std::terminate, an abort) or wait for a lock
    it holds (a hang), so the process must end without it (os._exit)."""
    return any(thread.is_alive() for thread in _running)
