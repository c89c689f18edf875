"""A stream between the engine thread and the event loop (server/runner.py): its reader gets the
first output at once, then whatever arrived meanwhile as one output, at most one per interval;
nothing is lost, reordered or duplicated, and a reader waiting for an output wakes when the engine
thread delivers it."""
from __future__ import annotations

import asyncio
import threading
import time

from engine import StepOutput
from server.runner import Stream


def output(tokens: list[int], finished: bool = False, logprobs: list[dict] | None = None) -> StepOutput:
    return StepOutput(None, tokens, finished, logprobs)


def test_outputs_arriving_between_reads_come_as_one_in_order():
    async def read() -> list[StepOutput]:
        stream = Stream(None, asyncio.get_running_loop(), interval=0.05)
        stream.deliver(output([1]))
        loop = asyncio.get_running_loop()
        asked = loop.time()  # no later than the first output is taken, whence the interval runs
        first = await stream.next()
        for t in (2, 3, 4):  # while the reader's interval runs
            stream.deliver(output([t], logprobs=[{"token": t}]))
        second = await stream.next()
        assert loop.time() - asked >= 0.05  # it waited out its interval
        return [first, second]

    first, second = asyncio.run(read())
    assert first.token_ids == [1] and not first.finished
    assert second.token_ids == [2, 3, 4] and not second.finished
    assert second.logprobs == [{"token": t} for t in (2, 3, 4)]


def test_the_last_output_cuts_the_interval_short():
    async def read() -> tuple[StepOutput, float]:
        stream = Stream(None, asyncio.get_running_loop(), interval=10.0)
        stream.deliver(output([1]))
        await stream.next()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, stream.deliver, output([2]))
        loop.call_later(0.02, stream.deliver, output([3], finished=True))
        started = time.perf_counter()
        last = await asyncio.wait_for(stream.next(), 5)
        assert stream.done
        return last, time.perf_counter() - started

    last, waited = asyncio.run(read())
    assert last.token_ids == [2, 3] and last.finished and last.logprobs is None
    assert waited < 1.0


def test_a_waiting_reader_wakes_when_the_engine_thread_delivers():
    async def read() -> list[list[int]]:
        stream = Stream(None, asyncio.get_running_loop(), interval=0.0)

        def engine() -> None:
            for t in range(20):
                time.sleep(0.002)
                stream.deliver(output([t], finished=t == 19))

        thread = threading.Thread(target=engine)
        thread.start()
        got = []
        while not stream.done:
            got.append((await asyncio.wait_for(stream.next(), 5)).token_ids)
        thread.join()
        return got

    got = asyncio.run(read())
    assert got == [[t] for t in range(20)]  # interval 0: a chunk per step, each as it comes


def test_the_first_output_is_not_held():
    async def read() -> float:
        stream = Stream(None, asyncio.get_running_loop(), interval=10.0)
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, stream.deliver, output([7]))
        started = time.perf_counter()
        assert (await asyncio.wait_for(stream.next(), 5)).token_ids == [7]
        return time.perf_counter() - started

    assert asyncio.run(read()) < 1.0
