"""The head's side of the pipeline: the remote stages as one stage of its model, the cache
operations its scheduler makes mirrored to them, and a step split into micro-batches that occupy
different stages at once."""
from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from engine.model.batch import ForwardBatch, Row
from engine.pipeline.transport import HEARTBEAT_S, CacheOp, Link, LinkError, Message, Op, Pending


class PipelineError(RuntimeError):
    """A stage was lost: the pipeline can serve nothing more (the message names the stage)."""


class MirroredCache:
    """The head's KV cache as its scheduler and engine use it: every `ensure`, `truncate`, `move`
    and `checkpoint` is also queued for the workers' caches, which replay them in order before their next
    forward. Page allocation is deterministic, so each stage's pool then holds the same pages for
    the same slots as the head's, and a kept sibling's K/V (and pooled keys) move on every stage."""

    def __init__(self, cache, queued: list[tuple[int, int, int, int]]):
        self.cache, self.queued = cache, queued

    def ensure(self, slot: int, length: int) -> bool:
        self.queued.append((CacheOp.ENSURE, slot, length, 0))
        return self.cache.ensure(slot, length)

    def truncate(self, slot: int, length: int) -> None:
        self.queued.append((CacheOp.TRUNCATE, slot, length, 0))
        self.cache.truncate(slot, length)

    def move(self, slot: int, src: int, dst: int) -> None:
        self.queued.append((CacheOp.MOVE, slot, src, dst))
        self.cache.move(slot, src, dst)

    def checkpoint(self, slot: int, length: int, hidden=None) -> None:
        """The workers keep their layers' states; the target's hidden state stays on the head."""
        self.queued.append((CacheOp.CHECKPOINT, slot, length, 0))
        self.cache.checkpoint(slot, length, hidden)

    def reusable(self, slot: int, length: int, with_hidden: bool = False) -> int:
        return self.cache.reusable(slot, length, with_hidden)

    def snapshot_hidden(self, slot: int, length: int):
        return self.cache.snapshot_hidden(slot, length)


class RemoteStages(nn.Module):
    """Stages 1..N-1, on ranks 1..N-1, as the last stage of the head's model (no layers here; the
    head's steps run through `pipelined_forward`, which starts each micro-batch): hidden states, rows and queued cache operations go to rank 1; the last
    rank's hidden states come back. After a failure every call raises PipelineError at once: the
    ring has no way back to a consistent state."""

    def __init__(self, link: Link, timeout: float, device: str, name_failure=lambda rank, error: None):
        """device: where the head wants the hidden states back (its stage's). name_failure(rank,
        error): a better account of a lost rank when the head knows one (a local worker's exit
        status), else None."""
        super().__init__()
        self.layers = nn.ModuleList()
        self.device, self.first, self.last = torch.device(device), False, False
        self.link, self.timeout, self.name_failure = link, timeout, name_failure
        self.queued: list[tuple[int, int, int, int]] = []
        self.failure: str | None = None
        self._last_sent = time.monotonic()

    def start(self, x: torch.Tensor, rows: list[Row]) -> "InFlight":
        """Sends one micro-batch on and posts the receive of its result."""
        self._check()
        ops, self.queued[:] = list(self.queued), []
        with self._guard():
            sent = self.link.send(Message(Op.FORWARD, ops, rows, x), self.timeout)
            result = self.link.post_result(x.shape[0], self.timeout)
        self._last_sent = time.monotonic()
        return InFlight(self, sent, result)

    def keepalive(self) -> None:
        """Called by the idle engine: a heartbeat when the workers have heard nothing for a while,
        so they wait without timing out and the head learns of a lost worker while idle."""
        if self.failure is None and time.monotonic() - self._last_sent >= HEARTBEAT_S:
            with self._guard():
                self.link.send(Message(Op.HEARTBEAT), self.timeout).wait()
            self._last_sent = time.monotonic()

    def close(self) -> None:
        """Tells the workers to exit; a pipeline already broken has nobody to tell."""
        if self.failure is None:
            try:
                self.link.send(Message(Op.STOP), min(self.timeout, 2.0)).wait()
            except LinkError:
                pass

    def _check(self) -> None:
        if self.failure is not None:
            raise PipelineError(self.failure)

    @contextlib.contextmanager
    def _guard(self):
        """A LinkError inside becomes the pipeline's failure, named by stage, raised as PipelineError."""
        try:
            yield
        except LinkError as e:
            self.failure = self.name_failure(e.rank, e) or f"pipeline stage {e.rank} (rank {e.rank}) lost: {e}"
            raise PipelineError(self.failure) from e


class InFlight:
    """One micro-batch sent on: its result, when it comes."""

    def __init__(self, stages: RemoteStages, sent: Pending, result: Pending):
        self.stages, self.sent, self.result_pending = stages, sent, result

    def result(self) -> torch.Tensor:
        self.stages._check()
        with self.stages._guard():
            self.sent.wait()
            return self.result_pending.wait()


def micro_batches(rows: list[Row], depth: int) -> list[list[int]]:
    """The step's rows (their indices) in at most `depth` groups of consecutive slots, as even in
    rows as they split."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].slot)
    n = min(depth, len(rows))
    bounds = [len(order) * g // n for g in range(n + 1)]
    return [order[bounds[g]:bounds[g + 1]] for g in range(n)]


def pipelined_forward(model, depth: int, batch: ForwardBatch, cache) -> torch.Tensor:
    """model.forward with the step in micro-batches: the head's stages compute micro-batch g+1
    while the workers compute g. model.stages ends with the RemoteStages. Returns the hidden states
    after the final norm, [N, hidden], in the batch's token order."""
    *local, remote = model.stages
    groups = micro_batches(batch.rows, depth)
    starts = batch.row_starts()
    flights, indices = [], []
    with torch.inference_mode():
        try:
            for group in groups:
                probes = None if batch.probes is None else [batch.probes[i] for i in group]
                sub = ForwardBatch.build([batch.rows[i] for i in group], probes if probes and any(probes) else None)
                flights.append(remote.start(model.trunk(sub, cache, local), sub.rows))
                indices.append(torch.cat([torch.arange(starts[i], starts[i] + len(batch.rows[i].tokens))
                                          for i in group]))
        except Exception:
            # The micro-batches already sent must still be answered, or their results would be
            # taken for the next step's.
            for flight in flights:
                with contextlib.suppress(PipelineError):
                    flight.result()
            raise
        out = torch.empty(batch.num_tokens, model.config.residual_width, dtype=model.compute_dtype, device=remote.device)
        for flight, index in zip(flights, indices):
            out[index.to(remote.device)] = flight.result().to(remote.device)
        return model.norm(out)
