"""The bridge from the engine thread to asyncio.

The engine calls each request's `on_output` on its own thread; the callback only appends the output
to the request's Stream and wakes the event loop when the stream's reader waits for it, so the
engine never waits on HTTP and the event loop never waits on a forward pass.

A stream's reader takes whatever has arrived as one output, and after its first at most one every
`interval` seconds (--stream-interval-ms). Each chunk costs the event loop ~0.5 ms of Python
(uvicorn, the SSE framing, the wake-up) on a core the forward's threads are using; at a token every
6-7 ms a chunk per token cost the served path about 7% of its tokens (docs/benchmarks.md).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from engine import (Constraint, DraftLimits, Engine, EngineConfig, Headers, ProbeSpec, Request, SamplingParams,
                    StepOutput)
from engine.pipeline.ranks import LocalWorkers, Rank

log = logging.getLogger("tandem.server")


@dataclass
class Stream:
    """One submitted request as the event loop sees it: its outputs, in order, then the end."""
    runner: "EngineRunner"
    loop: asyncio.AbstractEventLoop
    interval: float  # seconds between two outputs the reader takes, after its first
    request: Request | None = None  # set once submitted
    t_arrived: float = field(default_factory=time.perf_counter)
    done: bool = False
    _arrived: collections.deque = field(default_factory=collections.deque)  # appended on the engine thread
    _waiter: asyncio.Future | None = None  # while the reader waits
    _resting: bool = False  # whether it waits out its interval (only the last output cuts that short)
    _t_taken: float | None = None

    def deliver(self, out: StepOutput) -> None:
        """Engine thread. The append comes before the look at the waiter, and the reader sets its
        waiter before it looks at the queue again, so one of them sees the other."""
        self._arrived.append(out)
        waiter = self._waiter
        if waiter is not None and (out.finished or not self._resting):
            try:
                self.loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the loop closed during shutdown: nobody is listening
                pass

    async def next(self) -> StepOutput:
        """The outputs arrived since the last call, as one (their tokens and logprobs in order); with
        an interval of 0, the next output as it is (a chunk per step). The last output is taken as
        soon as it comes, the interval notwithstanding."""
        if self._t_taken is not None:
            rest = self._t_taken + self.interval - self.loop.time()
            if rest > 0:
                await self._wait(rest)
        while not self._arrived:
            await self._wait(None)
        out = self._arrived.popleft()
        while self.interval and self._arrived and not out.finished:
            more = self._arrived.popleft()
            logprobs = None if out.logprobs is None and more.logprobs is None else \
                (out.logprobs or []) + (more.logprobs or [])
            out = dataclasses.replace(more, token_ids=out.token_ids + more.token_ids, logprobs=logprobs)
        self._t_taken = self.loop.time()
        self.done = out.finished
        return out

    async def _wait(self, rest: float | None) -> None:
        """Until an output arrives (rest None), or until `rest` seconds pass or the last output arrives."""
        self._resting = rest is not None
        waiter = self._waiter = self.loop.create_future()
        timer = None if rest is None else self.loop.call_later(rest, _wake, waiter)
        try:
            if not (self._arrived and (self._arrived[-1].finished or not self._resting)):
                await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

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
               pinned_slot: int | None, probe: ProbeSpec | None = None, draft_limits: DraftLimits | None = None,
               constraint: Constraint | None = None, interval: float = 0.0) -> Stream:
        """Called on the event loop, after the request was validated. interval: seconds between the
        outputs the stream's reader takes, after its first (0: each as it comes)."""
        stream = Stream(self, asyncio.get_running_loop(), interval)
        stream.request = self.engine.submit(prompt_ids, params, stream.deliver, cache_prompt=cache_prompt,
                                            pinned_slot=pinned_slot, probe=probe, draft_limits=draft_limits,
                                            constraint=constraint)
        return stream

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
