"""The access line names the replica that was serving a request whose client left
part way (499): the slow answers clients give up on are the ones an operator
most needs to trace to an engine."""
from __future__ import annotations

import logging

import aiohttp

from gateway.app import create_app
from gateway.replicas import InProcessReplica
from gateway.server import start_server
from tests.engine_procs import MODEL, tiny_config, wait_for


async def test_a_client_that_left_is_logged_with_its_replica(tiny_model_dir, caplog):
    config = tiny_config(tiny_model_dir)
    app = create_app(config, [InProcessReplica("r0", config)])
    server = await start_server(app, access_log=logging.getLogger("test.access.left"))
    try:
        with caplog.at_level(logging.INFO, logger="test.access.left"):
            async with aiohttp.ClientSession() as session:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500,
                        "stream": True, "ignore_eos": True}
                async with session.post(server.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.content.readline()  # the first bytes of the answer, then leave
            lines = lambda: [r.getMessage() for r in caplog.records if r.name == "test.access.left"]  # noqa: E731
            await wait_for(lambda: lines(), what="an access line")
        (line,) = lines()
        assert '" 499 ' in line, line
        assert line.rsplit(" ", 1)[1] == "r0", line
    finally:
        await server.stop()
