"""Shared fixtures."""

from __future__ import annotations

import pytest

from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-init 2-layer Llama HF directory with its own tokenizer (built once per session)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))
