"""A worker rank's loop: receive a micro-batch from the previous rank, run this stage's layers on
it, send the result on; apply the head's cache operations to this stage's cache on the way."""
from __future__ import annotations

import logging

import torch

from engine.files.nearest_format import stored_formats
from engine.model.batch import ForwardBatch
from engine.model.kv_cache import cache_for
from engine.model.layer_spec import trunk_specs
from engine.model.rope import rope_table
from engine.model.transformer import decoder_layer, Stage
from engine.ops.arena import move_to_huge_pages
from engine.ops.quant import compute_dtype, keeps_blocks, resolve_activations, use_activations
from engine.pipeline.ranks import join
from engine.pipeline.transport import CacheOp, Link, LinkError, Message, Op

log = logging.getLogger("tandem.pipeline")

# A worker that hears nothing for IDLE_TIMEOUT_S (transport.HEARTBEAT_S apart, the head's heartbeats;
# or the pipeline timeout, when that is longer: a head computing a long micro-batch is silent) takes
# the head for lost and exits. A head that dies closes its sockets, which ends the wait at once.
IDLE_TIMEOUT_S = 9.0


class WorkerStage:
    """One stage's layers and cache on its device, the layers renumbered from 0 so that the cache
    holds theirs only."""

    def __init__(self, config, tensors: dict[str, torch.Tensor], layers: range, device: str, dtype: str,
                 engine_config, activations: str):
        """config: the model's ModelConfig; tensors: at least those of `layers`; engine_config: the
        EngineConfig, for the cache's slots, size, types and layout (the head's own); activations:
        "f32" or "q8", as the head resolved them for the whole file."""
        renamed = {}
        for i in layers:
            prefix = f"model.layers.{i}."
            renamed.update({f"model.layers.{i - layers.start}.{n[len(prefix):]}": t
                            for n, t in tensors.items() if n.startswith(prefix)})
        specs = trunk_specs(config, layers)
        c = engine_config
        cos, sin = rope_table(config.rope, config.rotary_dim, max(c.ctx_per_slot, config.max_position_embeddings))
        self.cos, self.sin = cos.to(compute_dtype(dtype)), sin.to(compute_dtype(dtype))
        self.stage = Stage([decoder_layer(config, renamed, i, dtype, spec, (self.cos, self.sin), layers.start + i)
                            for i, spec in enumerate(specs)], device, False, False)
        use_activations(self.stage, activations)
        move_to_huge_pages(self.stage)
        self.cache = cache_for(c, config, specs, [device] * len(specs), layers)

    def apply(self, cache_ops: list[tuple[int, int, int, int]]) -> None:
        for op, slot, a, b in cache_ops:
            if op == CacheOp.ENSURE:
                self.cache.ensure(slot, a)
            elif op == CacheOp.TRUNCATE:
                self.cache.truncate(slot, a)
            elif op == CacheOp.CHECKPOINT:
                self.cache.checkpoint(slot, a)
            else:
                self.cache.move(slot, a, b)

    @torch.inference_mode()
    def run(self, rows, x: torch.Tensor) -> torch.Tensor:
        batch = ForwardBatch.build(rows)
        self.cache.begin_rows(batch.rows)
        x = self.stage.run(x, batch, self.cos[batch.rope], self.sin[batch.rope], self.cache)
        self.cache.end_rows(batch.rows)
        return x


def serve(stage: WorkerStage, link: Link, timeout: float) -> None:
    """Until the head says stop: each message from the previous rank, handled and passed on.
    Raises LinkError when a neighbour is lost or silent for too long."""
    last, silence = link.next == 0, max(IDLE_TIMEOUT_S, timeout)
    while True:
        msg = link.recv(silence)
        if msg.op in (Op.HEARTBEAT, Op.STOP):
            if not last:
                link.send(msg, timeout).wait()
            if msg.op is Op.STOP:
                return
            continue
        if msg.op is not Op.FORWARD:
            raise LinkError(link.prev, f"a worker takes no {msg.op.name} message")
        stage.apply(msg.cache_ops)
        out = stage.run(msg.rows, msg.hidden)
        reply = Message(Op.RESULT, hidden=out) if last else Message(Op.FORWARD, msg.cache_ops, msg.rows, out)
        link.send(reply, timeout).wait()


def worker_main(config, headers, rank) -> int:
    """A worker process's life: load its stage, meet the other ranks, serve until the head stops
    it or is lost. config: the EngineConfig (the head's, from the same command line); headers: its
    checked files and placement; rank: a ranks.Rank. Returns the exit status."""
    if config.threads:
        torch.set_num_threads(config.threads)
    mc, placement = headers.model, headers.placement
    layers, device = placement.stage_ranges()[rank.rank], placement.devices[rank.rank]
    tensors = headers.files.load_tensors(layers, ends=False, keep_blocks=keeps_blocks(config.dtype))
    activations = resolve_activations(config.activations, config.dtype, stored_formats(headers.files))
    stage = WorkerStage(mc, tensors, layers, device, config.dtype, config, activations)
    log.info("pipeline stage %d (rank %d of %d): layers %d..%d on %s loaded, KV cache %.0f MiB", rank.rank,
             rank.rank, rank.stages, layers.start, layers.stop - 1, device, stage.cache.nbytes / 2**20)
    link = Link(rank.rank, rank.stages, mc.residual_width, compute_dtype(config.dtype), join(rank, placement))
    try:
        serve(stage, link, config.pipeline_timeout)
    except LinkError as e:
        log.error("pipeline stage %d: lost rank %d (%s); exiting", rank.rank, e.rank, e)
        return 1
    log.info("pipeline stage %d: stopped by the head", rank.rank)
    return 0
