"""The bridge from the engine thread to asyncio.

The engine calls each request's `on_output` on its own thread; the callback only hands the output
to the event loop (`call_soon_threadsafe` into the request's asyncio.Queue), so the engine never
waits on HTTP and the event loop never waits on a forward pass.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from engine import DraftLimits, Engine, EngineConfig, Headers, ProbeSpec, Request, SamplingParams, StepOutput
from engine.pipeline.ranks import LocalWorkers, Rank

log = logging.getLogger("tandem.server")


@dataclass
class Stream:
    """One submitted request as the event loop sees it: its outputs, in order, then the end."""
    request: Request
    outputs: asyncio.Queue
    runner: "EngineRunner"
    t_arrived: float = field(default_factory=time.perf_counter)
    done: bool = False

    async def next(self) -> StepOutput:
        out = await self.outputs.get()
        self.done = out.finished
        return out

    def cancel(self) -> None:
        """Stop generating (client gone, or a stop string matched); the slot frees within one step."""
        if not self.done:
            self.runner.engine.cancel(self.request)
            self.done = True


class EngineRunner:
    """Loads the engine off the event loop, then submits requests to it; counts in-flight streams
    so that a graceful shutdown can wait for them."""

    def __init__(self, config: EngineConfig, headers: Headers | None = None, rank: Rank | None = None,
                 workers: LocalWorkers | None = None):
        """rank: the head's with -pp; workers: the ones it started itself, if it did."""
        self.config, self.headers, self.rank, self.workers = config, headers, rank, workers
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.in_flight = 0
        self._loaded = threading.Event()
        self._load_thread: threading.Thread | None = None

    @property
    def loading(self) -> bool:
        """Whether the load has started and not ended."""
        return self._load_thread is not None and self._load_thread.is_alive()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def load_in_background(self, loop: asyncio.AbstractEventLoop, on_failure) -> threading.Thread:
        def load() -> None:
            try:
                describe_loss = self.workers.describe_loss if self.workers is not None else lambda rank, e: None
                engine = Engine.load(self.config, self.headers, self.rank, describe_loss)
                engine.start()
                self.engine = engine
                log.info("model loaded; serving")
            except BaseException as e:  # reported and the server exits: nothing can be served
                self.load_error = e
                log.error("model load failed: %s", e)
                loop.call_soon_threadsafe(on_failure, e)
            finally:
                self._loaded.set()

        thread = self._load_thread = threading.Thread(target=load, name="tandem-load", daemon=True)
        thread.start()
        if self.workers is not None:
            threading.Thread(target=self._watch_workers, args=(loop, on_failure), name="tandem-workers",
                             daemon=True).start()
        return thread

    def _watch_workers(self, loop: asyncio.AbstractEventLoop, on_failure) -> None:
        """Until the engine has loaded: a worker that exits meanwhile (its load failed) fails the
        load, which would otherwise wait for it to meet the head for minutes."""
        while not self._loaded.wait(0.5):
            lost = self.workers.exited()
            if lost is not None:
                self.load_error = RuntimeError(f"{lost} before the pipeline's ranks met")
                log.error("model load failed: %s", self.load_error)
                loop.call_soon_threadsafe(on_failure, self.load_error)
                return

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, cache_prompt: bool,
               pinned_slot: int | None, probe: ProbeSpec | None = None, draft_limits: DraftLimits | None = None) -> Stream:
        """Called on the event loop, after the request was validated."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def on_output(out: StepOutput) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the loop closed during shutdown: nobody is listening
                pass

        request = self.engine.submit(prompt_ids, params, on_output, cache_prompt=cache_prompt, pinned_slot=pinned_slot,
                                     probe=probe, draft_limits=draft_limits)
        return Stream(request, outputs, self)

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
