"""One forward of a step's planned rows: probes captured, the pipeline's stages when there are
several processes, and logits only at the positions that need them."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.model.batch import ForwardBatch
from engine.model.kv_cache import KVCache
from engine.model.transformer import Transformer
from engine.pipeline.head import pipelined_forward
from engine.sched.scheduler import PlannedRow


@dataclass
class StepResult:
    """One forward's output, indexed by the plan's rows."""
    hidden: torch.Tensor  # [N, H] every token's hidden state after the final norm
    logits: torch.Tensor | None  # [L, vocab] the positions that need them (PlannedRow.num_logits each)
    starts: list[int]  # each row's first token in `hidden`
    firsts: list[int]  # each row's first position in `logits`
    now: float


def forward(model: Transformer, cache: KVCache, rows: list[PlannedRow], pipeline_depth: int | None) -> StepResult:
    """pipeline_depth: micro-batches in flight across the remote stages (-pp), None in one process."""
    probes = [p.request.probe if p.request.probe is not None
              and p.request.probe.wants(p.row.start, len(p.row.tokens)) else None for p in rows]
    batch = ForwardBatch.build([p.row for p in rows], probes if any(probes) else None)
    if pipeline_depth is not None:
        hidden = pipelined_forward(model, pipeline_depth, batch, cache)
    else:
        hidden = model(batch, cache)
    for p in rows:
        probe = p.request.probe
        if probe is not None and not probe.done and p.row.start + len(p.row.tokens) >= probe.n_prompt:
            p.request.probe_result = probe.result()
    starts = batch.row_starts()
    index, firsts = [], []
    for p, start in zip(rows, starts):
        firsts.append(len(index))
        end = start + len(p.row.tokens)
        index.extend(range(end - p.num_logits, end))
    logits = model.logits(hidden[torch.tensor(index)]) if index else None
    return StepResult(hidden, logits, starts, firsts, time.perf_counter())
