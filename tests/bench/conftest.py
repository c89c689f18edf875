"""Fixtures for benchmark tests: a fake upstream in-process and a real tiny-model server process.

Both listen on a free loopback port, every wait is bounded, and both are stopped in finalizers."""
from __future__ import annotations

import pytest

from tests.bench.fake_upstream import FakeUpstream, Mode, Running
from tests.server.helpers import ServerProcess

TINY_SLOTS = 2


@pytest.fixture(scope="module")
def _fake_server():
    fake = FakeUpstream()
    running = Running(fake)
    yield fake
    running.stop()


@pytest.fixture
def fake(_fake_server) -> FakeUpstream:
    """The module's fake upstream, reset to honest answers for each test."""
    _fake_server.mode, _fake_server.completions = Mode(), 0
    return _fake_server


def _serve_tiny(tmp_path_factory):
    """`python -m server` on a tiny random model with two slots, served as 'tiny', a chunk per step
    (`--stream-interval-ms 0`): the bench's inter-token latencies are what its tests read."""
    from engine.cli.tiny import tiny_config, write_tiny_model
    config = tiny_config()
    model = write_tiny_model(config, tmp_path_factory.mktemp("tiny-llama"), seed=0)
    server = ServerProcess(["-m", str(model), "-np", str(TINY_SLOTS), "-c", "2048", "--alias", "tiny",
                            "--stream-interval-ms", "0"],
                           tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield server.wait_ready()
    finally:
        server.kill()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    yield from _serve_tiny(tmp_path_factory)


@pytest.fixture
def fresh_tiny_server(tmp_path_factory):
    """A tiny server of its own: no earlier session's prompt waits in a slot. The byte tokenizer
    gives a session only ~44 distinct first tokens, so against a shared server a prompt can meet a
    cached one-token prefix and come back (rightly) invalid with cache_n=1."""
    yield from _serve_tiny(tmp_path_factory)
