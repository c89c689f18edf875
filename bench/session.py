"""One benchmark session against one server: preflight and warm-up, then `runs` rounds of `lanes`
concurrent requests. Entry points (the CLI, a side-by-side comparison) drive it; it prints nothing.

Everything that can show the benchmark cannot run as asked (server unreachable, model unknown,
prompts not buildable, the server counting a prompt differently) raises FixtureError before the
first measured request.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from typing import Callable

import httpx

from bench.client import completion_body, served_models, stream_completion, tokenize
from bench.records import INTERRUPTED, Record
from bench.workload import WARMUP_GEN_TOKENS, FixtureError, Prompts, Workload, build_prompts


class Session:
    """Use as `async with Session(...) as s: await s.prepare(); await s.run(on_record)`."""

    def __init__(self, url: str, model: str, workload: Workload, timeout: float = 600.0):
        self.url, self.model, self.workload = url.rstrip("/"), model, workload
        self.timeout = timeout  # seconds any one read may wait: a long prefill sends nothing meanwhile
        self.nonce = secrets.token_hex(4)
        self.records: list[Record] = []
        self.interrupted = False
        self._prompts: Prompts | None = None
        self._tasks: list[asyncio.Task] = []
        self._http: httpx.AsyncClient | None = None

    def describe(self) -> dict:
        """The configuration printed beside every figure."""
        return {"url": self.url, "model": self.model, **self.workload.describe(), "nonce": self.nonce}

    async def __aenter__(self) -> "Session":
        limits = httpx.Limits(max_connections=self.workload.lanes + 1, max_keepalive_connections=self.workload.lanes + 1)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.timeout, connect=10.0),
                                       limits=limits)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()

    async def prepare(self) -> None:
        """Checks the server and the model, builds every prompt, and sends one unrecorded warm-up
        request of the full prompt length."""
        models = await served_models(self._http)
        if models is not None and self.model not in models:
            raise FixtureError(f"model {self.model!r}: {self.url} serves {', '.join(models) or 'nothing'}")
        self._prompts = await build_prompts(lambda text: tokenize(self._http, text, self.model), self.workload, self.nonce)
        ids = self._prompts.warmup
        body = completion_body(self.model, ids, min(WARMUP_GEN_TOKENS, self.workload.gen_tokens), self.workload)
        warm = await stream_completion(self._http, body, lane=0, run=-1, t0=time.perf_counter())
        if warm.error is not None:
            raise FixtureError(f"warm-up request failed: {warm.error}")
        if warm.usage_prompt_tokens != len(ids):
            raise FixtureError(f"the server counted {warm.usage_prompt_tokens} prompt tokens for {len(ids)} "
                               "token ids: prompts cannot be sent at an exact length")

    async def run(self, on_record: Callable[[Record], None] = lambda r: None) -> list[Record]:
        """The measured rounds; each record goes to on_record as it completes. After interrupt(),
        in-flight requests come back as records marked interrupted and no further round starts."""
        assert self._prompts is not None, "prepare() first"
        t0 = time.perf_counter()
        for run, prompts in enumerate(self._prompts.rounds):
            if self.interrupted:
                break
            round_start = time.perf_counter() - t0
            self._tasks = [asyncio.create_task(self._lane(run, lane, ids, t0, round_start, on_record))
                           for lane, ids in enumerate(prompts)]
            for outcome in await asyncio.gather(*self._tasks, return_exceptions=True):
                # A lane cancelled by interrupt() before its first step never sent its request and
                # leaves no record; anything else that went wrong is the caller's to see.
                if isinstance(outcome, BaseException) and not (
                        self.interrupted and isinstance(outcome, asyncio.CancelledError)):
                    raise outcome
        return self.records

    def interrupt(self) -> None:
        """Called from the event loop's thread (a signal handler added with loop.add_signal_handler)."""
        self.interrupted = True
        for task in self._tasks:
            task.cancel()

    async def _lane(self, run: int, lane: int, ids: list[int], t0: float, round_start: float,
                    on_record: Callable[[Record], None]) -> None:
        body = completion_body(self.model, ids, self.workload.gen_tokens, self.workload)
        try:
            record = await stream_completion(self._http, body, lane, run, t0)
        except asyncio.CancelledError:
            if not self.interrupted:  # someone else's cancellation: not ours to absorb
                raise
            record = Record(lane=lane, run=run, prompt_tokens=len(ids), gen_tokens=self.workload.gen_tokens,
                            start_s=round_start, end_s=time.perf_counter() - t0, error=INTERRUPTED)
        self.records.append(record)
        on_record(record)
