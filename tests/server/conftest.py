"""Fixtures for server tests: real server processes."""
from __future__ import annotations

import pytest

from tests.server.helpers import ServerProcess


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(args, api_key=None) -> a ready ServerProcess, killed at the end of the session
    unless the test ends it sooner."""
    started: list[ServerProcess] = []

    def start(args: list[str], api_key: str | None = None, wait: bool = True) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(args, log, api_key)
        started.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in started:
        server.kill()


@pytest.fixture(scope="session")
def main_server(start_server):
    """The main command on the default model (its own Q4_1 weights, the shipped MTP draft, 4 slots
    sharing a pool), as a user starts it: shared by the tests of what agents send."""
    return start_server(["-m", "default"])
