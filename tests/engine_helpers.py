"""Helpers shared by the engine tests: building engines, collecting outputs, HF references."""

from __future__ import annotations

import os

import torch

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.request import GenerationOutput, GenerationRequest, SamplingParams


# bench/gpu_check.sh runs the engine tests on CUDA with KVGATE_TEST_DEVICE=cuda.
DEVICE = os.environ.get("KVGATE_TEST_DEVICE", "cpu")


def make_engine(path: str | None, **engine_kwargs) -> AsyncEngine:
    engine_kwargs.setdefault("device_blocks", 64)
    engine_kwargs.setdefault("host_blocks_multiplier", 2.0)
    policy = engine_kwargs.pop("policy", "lru")
    return AsyncEngine.from_config(
        ModelConfig(path=path, dtype="float32", device=DEVICE),
        EngineConfig(**engine_kwargs),
        CacheConfig(policy=policy),
    )


async def collect(engine: AsyncEngine, request: GenerationRequest) -> dict[int, list[GenerationOutput]]:
    """All outputs of a request, by choice index."""
    by_choice: dict[int, list[GenerationOutput]] = {}
    async for out in engine.generate(request):
        by_choice.setdefault(out.index, []).append(out)
    return by_choice


def tokens(outputs: list[GenerationOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def text(outputs: list[GenerationOutput]) -> str:
    return "".join(out.text for out in outputs)


def greedy(request_id: str, prompt: list[int], max_tokens: int, **kwargs) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)
    return GenerationRequest(request_id, list(prompt), params)


def hf_reference(path: str):
    """The same weights through plain transformers (its own attention, its own cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    model.generation_config.eos_token_id = None  # compare with ignore_eos
    return model


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=0
    )
    return out[0, len(prompt) :].tolist()


def assert_no_references(engine: AsyncEngine) -> None:
    refs = [(block, count) for block, count in enumerate(engine.pool.ref_count) if count]
    assert not refs, f"blocks still referenced after the test: {refs[:10]}"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.waiting._queues  # its per-tenant queues follow its count


def interrupt_on_call(real, call: int):
    """``real``, except that call number ``call`` (1-based) is a Ctrl-C."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return wrapped


def noting_stdout(real, capsys, printed: list[str]):
    """``real``, noting in ``printed`` what was written to stdout before each call."""
    def wrapped(*args, **kwargs):
        printed.append(capsys.readouterr().out)
        return real(*args, **kwargs)

    return wrapped
