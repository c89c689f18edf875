"""Fixtures shared by the whole suite. The default model loads once per test session (once per
pytest-xdist worker: the suite runs on two, pyproject.toml)."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import torch

# The suite runs on pytest-xdist workers (pyproject.toml): the in-process engines of each worker
# share the CPUs this process may use (as the engine counts them, engine/threads.py) rather than
# each spinning a thread per CPU against the other.
torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


# The reference load of the default model (hf_default_model: transformers' GGUF reader, 25-37 s of
# a core) is made once per worker that asks for it.
SHARED_LOAD = "hf_default_model"


def pytest_collection_modifyitems(items):
    """Whole files go to one worker (--dist loadgroup, pyproject.toml), so module fixtures load once,
    and every file that reads SHARED_LOAD goes to the same worker, so it loads once in the run."""
    files = {}
    for item in items:
        if SHARED_LOAD in item.fixturenames:
            files[item.path] = SHARED_LOAD
    for item in items:
        item.add_marker(pytest.mark.xdist_group(files.get(item.path, str(item.path))))


@pytest.fixture(autouse=True)
def host_share(request, tmp_path_factory):
    """Tests marked `alone` watch the host's cores (a server giving a thread to a busy neighbour and
    taking it back): they run with no other worker's test beside them. Every other test holds a
    shared lock while it runs, an `alone` test the exclusive one; a turnstile taken before either
    lets a waiting `alone` test in ahead of the other worker's next tests."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    root = tmp_path_factory.getbasetemp().parent  # the run's folder, above each worker's own
    alone = request.node.get_closest_marker("alone") is not None
    with open(root / "turnstile.lock", "a") as turnstile, open(root / "host.lock", "a") as host:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(host, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield


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
