"""Real `kvgate engine` processes and tiny-model configs for gateway tests (loopback only)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import yaml

from engine.config import EngineConfig, ModelConfig
from gateway.config import ClassifierConfig, KvgateConfig, ReplicaConfig, RouterConfig, ServerConfig

MODEL = "tiny"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(model_dir: str, replicas: list[ReplicaConfig] | None = None, *, device_blocks: int = 256,
                host_multiplier: float = 3.0, router: RouterConfig | None = None, max_model_len: int = 1024,
                **server) -> KvgateConfig:
    return KvgateConfig(
        model=ModelConfig(path=model_dir, served_name=MODEL, device="cpu", max_model_len=max_model_len),
        engine=EngineConfig(block_size=16, device_blocks=device_blocks, host_blocks_multiplier=host_multiplier,
                            max_num_seqs=16, max_batched_tokens=1024, threads=1),
        server=ServerConfig(**server),
        router=router or RouterConfig(),
        # Half the context, as the default is of the bundled model's: a document and its answer fit.
        classifier=ClassifierConfig(file_min_tokens=max_model_len // 2),
        replicas=list(replicas or []),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """`kvgate engine --config FILE --port N` in its own process group."""

    def __init__(self, config: KvgateConfig, workdir: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = os.path.join(workdir, f"engine-{self.port}.yaml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config.model_dump(mode="json", exclude={"replicas"}), f)
        self.log_path = os.path.join(workdir, f"engine-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "engine", "--config", self.config_path,
                 "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    async def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine exited with {self.proc.returncode}: {self.tail()}")
                try:
                    async with session.get(self.url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(f"engine on {self.url} not ready in {timeout} s: {self.tail()}")

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (no goodbye on any connection)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""


async def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.02)
    assert cond(), f"timed out waiting for {what}"


def record_requests(engine) -> list:
    """Wrap the engine's entry the gateway calls (``generate_batches``) so tests
    see the GenerationRequests it received."""
    seen = []
    real = engine.generate_batches

    def generate_batches(request):
        seen.append(request)
        return real(request)

    engine.generate_batches = generate_batches
    return seen


def count_aborts(engine) -> list:
    """The ids of the requests ``engine`` is asked to abort, from now on: by id
    (``abort``) or by a reader closing its stream early."""
    aborted = []
    real = engine._abort

    def abort(state):
        aborted.append(state.request.request_id)
        return real(state)

    engine._abort = abort
    return aborted


def engine_idle(engine) -> bool:
    stats = engine.stats()
    return not (stats["running"] or stats["waiting"] or stats["blocks"]["device"]["in_use"])
