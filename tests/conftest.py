"""Fixtures shared by the whole suite. The default model loads once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_engine():
    """The embedded SmolLM2 in f32 with three slots, stepping inline (no engine thread)."""
    from engine.engine import Engine
    from engine.settings import EngineConfig
    return Engine.load(EngineConfig(model="default", dtype="f32", ctx_size=3 * 1024, parallel=3, ubatch_size=128))


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own load of the same GGUF file: the reference implementation."""
    from bench.formats import load_reference
    return load_reference("default")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (configs/tiny/llama.json, seed 0) on disk."""
    from engine.cli.tiny import tiny_config, write_tiny_model
    config = tiny_config()
    return write_tiny_model(config, tmp_path_factory.mktemp("tiny-llama"), seed=0)
