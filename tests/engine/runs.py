"""Driving an engine inline from a test: every request submitted at once, steps run until each
has finished."""
from __future__ import annotations

import queue

from engine.engine import Engine
from engine.request import Request
from engine.sampling import SamplingParams


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
    """`params`: one for all prompts, or one per prompt."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    requests = [engine.submit(p, sp, outputs.put, cache_prompt=False) for p, sp in zip(prompts, per_prompt)]
    finished = 0
    while finished < len(requests):
        while outputs.empty():
            engine._drain_inbox()
            engine.step()
        finished += outputs.get().finished
    return requests
