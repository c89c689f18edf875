"""`python -m server`: parse flags, start uvicorn (the model loads once it is up), drain on SIGTERM.

SIGTERM (or Ctrl-C): new requests get 503 while in-flight ones finish, up to --drain-timeout,
then the process exits 0. A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys

import uvicorn
from sse_starlette.sse import AppStatus

from engine import TandemError, read_headers
from engine.pipeline import ranks
from engine.pipeline.draft_rank import draft_main
from engine.pipeline.worker import worker_main
from engine.threads import describe_cpus, pin
from server.app import create_app
from server.cli import configs
from server.flags import FlagError, help_text, parse_flags
from server.logs import UVICORN_LOG_OPTIONS, setup_logging
from server.runner import EngineRunner
from server.state import ServerSettings, ServerState

log = logging.getLogger("tandem.server")


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first exit signal drains instead of closing streams mid-way."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:  # a signal handler, on the main thread
        if self.state.draining or self._loop is None:
            AppStatus.should_exit = True
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        log.info("signal %s: draining %d in-flight request(s), up to %.0f s", sig, self.state.in_flight,
                 self.state.settings.drain_timeout)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = self._loop.time() + self.state.settings.drain_timeout
        while self.state.in_flight > 0 and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        AppStatus.should_exit = True  # streams still open past the deadline are closed
        self.should_exit = True

    def fail(self, error: BaseException) -> None:
        """The model could not load: nothing can be served."""
        self.exit_code = 1
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        flags = parse_flags(argv)
        if flags.help:
            print(help_text())
            return 0
        engine_config, settings = configs(flags)
        if flags.cpus:
            run_on(flags.cpus)
        # Model, draft and compression checked from their headers before the server listens, so a
        # bad one exits 2 here instead of failing the load thread later.
        headers = read_headers(engine_config)
        engine_config = headers.config  # with any default that had to yield
        rank = ranks.from_env(engine_config.pipeline_parallel_size, draft=engine_config.draft_rank)
    except (FlagError, TandemError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(flags.log_level, flags.log_format)
    if rank is not None and not rank.is_head:
        return (draft_main if rank.is_draft else worker_main)(engine_config, headers, rank)
    workers = None
    if rank is None and engine_config.world > 1:
        # From this, the main thread: a worker's parent-death signal fires when its spawning thread exits.
        workers = ranks.LocalWorkers(argv, engine_config.world, engine_config.draft_rank)
        rank = workers.rank
    runner = EngineRunner(engine_config, headers, rank, workers)
    try:
        code = serve(settings, runner)
    finally:
        if workers is not None:
            workers.stop()
    if runner.loading:
        # The load still waits for ranks that are gone; torch cannot be finalized under it.
        logging.shutdown()
        os._exit(code)
    return code


def run_on(cpus: frozenset[int]) -> None:
    """This process's threads onto `cpus` (-C, -Cr), before the engine starts any; raises FlagError
    for CPUs the process may not use."""
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise FlagError(f"--cpu-mask/--cpu-range: CPU(s) {describe_cpus(cpus - allowed)} are not among this "
                        f"process's CPUs {describe_cpus(allowed)}")
    pin(os.getpid(), cpus)


def serve(settings: ServerSettings, runner: EngineRunner) -> int:
    """Listen until a signal drains the server or the model fails to load; the exit status."""
    # Streams end when their request does, not when the signal arrives (see DrainingServer).
    AppStatus.disable_automatic_graceful_drain()
    state = ServerState(settings, runner)
    holder: list[DrainingServer] = []
    app = create_app(state, on_load_failure=lambda e: holder[0].fail(e))
    config = uvicorn.Config(app, host=settings.host, port=settings.port, timeout_graceful_shutdown=5, lifespan="on",
                            **UVICORN_LOG_OPTIONS)
    server = DrainingServer(config, state)
    holder.append(server)
    log.info("listening on http://%s:%d (model loading)", settings.host, settings.port)
    server.run()
    if server.exit_code == 0 and not server.started:
        return 1  # e.g. the port was taken
    return server.exit_code


if __name__ == "__main__":
    # SIGPIPE stays ignored (Python's default): a write to a client or a log reader that has gone
    # must raise EPIPE in that one place, not kill the process and every stream in it.
    sys.exit(main())
