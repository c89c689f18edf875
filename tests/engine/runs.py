"""Driving an engine inline from a test: every request submitted at once, steps run until each
has finished."""
from __future__ import annotations

import queue

from engine.engine import Engine
from engine.model.probe import ProbeSpec
from engine.sched.grammar import GrammarSpec
from engine.sched.request import Request
from engine.sched.sampling import SamplingParams


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
            probes: list[ProbeSpec | None] | None = None, cache_prompt: bool = False,
            grammar: GrammarSpec | None = None) -> list[Request]:
    """`params`: one for all prompts, or one per prompt; `probes`: one per prompt, or None for none;
    `grammar`: one each request's answer follows, with a matcher of its own."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    requests = [engine.submit(p, sp, outputs.put, cache_prompt=cache_prompt, probe=probe,
                              constraint=None if grammar is None else engine.grammars.constraint(grammar))
                for p, sp, probe in zip(prompts, per_prompt, probes or [None] * len(prompts))]
    finished = 0
    while finished < len(requests):
        while outputs.empty():
            engine.step()
        finished += outputs.get().finished
    return requests
