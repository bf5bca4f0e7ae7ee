"""The endpoints only `kvgate engine` serves, for the gateways in front of it.

``/kvgate/info``: block size, hash salt and context length, so a gateway
hashes prompts exactly as this engine does.  ``/kv_events``: the engine's
block stored/removed events as server-sent events, so a gateway keeps an
exact index of what this engine holds; while it stops, a ``draining`` event
(and a snapshot with no blocks) naming the requests it has not started, which
their gateways offer to other replicas.  ``/kvgate/stats``: the engine's
figures, polled by gateways for their /metrics and /stats.  ``/health``
answers with the engine's load (requests running and waiting, KV usage), so
that gateways sharing engines see each other's work.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.errors import too_many_followers
from gateway.kv_wire import PACKED_KEYS, PACKED_QUERY, pack_keys
from gateway.replicas import KV_EVENTS_HEARTBEAT_S
from gateway.respond import SSE_HEADERS

if TYPE_CHECKING:
    from gateway.app import Gateway

# A /kv_events consumer this far behind (in events, or in the keys they hold:
# an eviction burst removes thousands at once) is cut off; it resyncs from a snapshot.
_BACKLOG = 100_000
_BACKLOG_KEYS = 1_000_000


class EngineEndpoints:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway  # its only replica is the in-process engine
        self._streams: set[asyncio.Queue] = set()
        # Names this process to its gateways: a restarted engine is a new one (RemoteReplica._fetch_info).
        self.instance = secrets.token_hex(8)

    async def stats(self, request: web.Request) -> web.Response:
        """AsyncEngine.stats(), polled by gateways for their /metrics and /stats."""
        gw = self.gateway
        gw.authenticate(request)
        return web.json_response(gw.replicas[0].engine.stats())

    async def health(self, request: web.Request) -> web.Response:
        """Alive, and how loaded: every gateway probing this engine learns the
        requests it holds, other gateways' included (RemoteReplica._probe).  A
        model step running past engine.step_timeout_s is a hung engine: 503, and
        the probing gateways' breakers take it out of routing."""
        engine = self.gateway.replicas[0].engine
        limit = self.gateway.config.engine.step_timeout_s
        running = engine.step_running_s()
        if limit and running > limit:
            return web.json_response({"status": "stalled", "step_running_s": round(running, 1), **engine.load()},
                                     status=503)
        return web.json_response({"status": "ok", **engine.load()})

    async def info(self, request: web.Request) -> web.Response:
        """Block identity and limits: what a gateway needs to hash prompts as this engine does."""
        gw = self.gateway
        replica = gw.replicas[0]
        salt = replica.info.hash_salt
        return web.json_response(
            {
                "model": gw.model_name,
                "block_size": replica.info.block_size,
                "hash_salt": salt.decode() if isinstance(salt, bytes) else salt,
                "max_model_len": gw.max_model_len,
                "instance": self.instance,
            }
        )

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        """SSE: a snapshot of the held keys, then every stored/removed event in order.

        The listener is attached before the snapshot is taken and buffers what
        arrives meanwhile; replaying those events over the snapshot converges
        to the engine's state because each event is applied in order.  A
        consumer that falls too far behind is cut off and resyncs.
        """
        gw = self.gateway
        gw.authenticate(request)
        if len(self._streams) >= gw.limits.max_kv_event_followers:
            raise too_many_followers(gw.limits.max_kv_event_followers)
        replica = gw.replicas[0]
        queue: asyncio.Queue = asyncio.Queue()
        lagging = False
        queued_keys = 0

        def put(item) -> None:
            nonlocal lagging, queued_keys
            if lagging:
                return  # the writer stops at its next item (the queue is full): keep nothing more
            if queue.qsize() >= _BACKLOG or queued_keys >= _BACKLOG_KEYS:
                lagging = True
                # A follower this far behind has most likely stopped reading, and the
                # writer then waits on a send that never drains: cut the connection
                # (the writer's wait ends at once) rather than hold it until TCP gives up.
                transport = request.transport
                if transport is not None:
                    transport.abort()
                return
            if item is not None:
                queued_keys += len(item[2])
            queue.put_nowait(item)

        def listener(seq: int, kind: str, keys: list[int], tier: str) -> None:
            put((seq, kind, keys, tier))  # on the loop thread, between engine steps

        detach = replica.add_listener(listener)
        self._streams.add(queue)
        try:
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            # "draining": a gateway reconnecting while this engine stops must not rejoin it,
            # nor index its blocks: none are sent (a million keys took this loop ~90 ms
            # and 10 MB at each gateway's reconnect, every 2 s of the drain).  It learns
            # which of its requests this engine has not started, to offer them elsewhere.
            held = {} if gw.draining else replica.held_keys()
            snapshot = {"seq": replica.seq, "model": gw.model_name, "keys": held, "draining": gw.draining}
            if gw.draining:
                snapshot["unstarted"] = replica.engine.unstarted()
            if request.query.get("keys") == PACKED_QUERY["keys"]:
                snapshot["keys"] = {tier: pack_keys(keys) for tier, keys in snapshot["keys"].items()}
                snapshot["keys_format"] = PACKED_KEYS
            await resp.write(b"event: snapshot\ndata: " + json.dumps(snapshot).encode() + b"\n\n")
            if gw.draining:  # a gateway that reconnects while this engine stops
                queue.put_nowait(None)
            while not lagging:
                if not queue.empty():
                    item = queue.get_nowait()  # busy: no timer (wait_for makes a task per call)
                else:
                    try:
                        item = await asyncio.wait_for(queue.get(), KV_EVENTS_HEARTBEAT_S)
                    except asyncio.TimeoutError:
                        await resp.write(b": idle\n\n")  # an SSE comment: followers know the stream lives
                        continue
                if item is None:
                    # Shutting down: the engine finishes what it holds but takes
                    # nothing new; a gateway that knows stops routing here without
                    # cutting the streams still being served.  The requests queued
                    # behind them are named: their gateways may have another
                    # replica that starts them sooner (RemoteReplica._offer_elsewhere).
                    unstarted = json.dumps({"unstarted": replica.engine.unstarted()}).encode()
                    await resp.write(b"event: draining\ndata: " + unstarted + b"\n\n")
                    break
                seq, kind, keys, tier = item
                queued_keys -= len(keys)
                frame = {"seq": seq, "kind": kind, "keys": keys, "tier": tier}
                await resp.write(b"data: " + json.dumps(frame).encode() + b"\n\n")
            return resp
        finally:
            self._streams.discard(queue)
            detach()

    def announce_draining(self) -> None:
        """Tell every gateway following /kv_events that this engine is stopping
        (they stop routing to it; its streams run on) and end those streams,
        which would otherwise hold the shutdown for its whole timeout."""
        for queue in list(self._streams):
            queue.put_nowait(None)
        self._streams.clear()

    async def on_shutdown(self, app: web.Application) -> None:
        self.announce_draining()
