"""Building an engine's parts from a checked configuration: weights, tokenizer, drafter, KV cache,
the remote stages of a pipeline, and the scheduler over them, each logged as it is placed."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.files.nearest_format import stored_formats
from engine.files.tokenizer import Tokenizer
from engine.files.weights import ModelFiles
from engine.footprint import DeviceUsage, measure
from engine.model.kv_cache import KVCache, cache_for
from engine.model.transformer import Transformer
from engine.ops import kernels
from engine.ops.quant import describe_formats, keeps_blocks, resolve_activations, use_activations
from engine.pipeline.draft_rank import DraftLink, RemoteDrafter
from engine.pipeline.head import MirroredCache, RemoteStages
from engine.pipeline.ranks import Rank, join
from engine.pipeline.transport import Link
from engine.placement import Placement
from engine.preflight import Headers, describe_cache
from engine.sched.scheduler import Scheduler
from engine.settings import EngineConfig
from engine.spec.drafter import Drafter
from engine.spec.loading import load_drafter

log = logging.getLogger("tandem.engine")


@dataclass
class Parts:
    files: ModelFiles
    model: Transformer
    tokenizer: Tokenizer
    cache: KVCache
    scheduler: Scheduler
    eos_ids: frozenset[int]
    drafter: Drafter | None
    devices: list[DeviceUsage]  # what each device holds, as loaded
    remote: RemoteStages | None  # stages 1.. in worker processes (-pp)
    placement: Placement  # the whole model's, remote stages included
    weight_formats: dict[str, int]  # the target's tensors per format
    activations: str  # what block weights multiply, resolved: "f32" or "q8"


def load_parts(config: EngineConfig, headers: Headers, rank: Rank | None, describe_loss) -> Parts:
    """headers: read_headers(config), every config error already raised. rank: the head's, with -pp
    (ranks.Rank); it meets the workers once its own stage is loaded. describe_loss: RemoteStages'
    account of a lost stage."""
    files, mc = headers.files, headers.model
    if config.ctx_per_slot > mc.max_position_embeddings:
        log.warning("ctx per slot %d exceeds the model's trained context %d",
                    config.ctx_per_slot, mc.max_position_embeddings)
    for line in config.adapted:
        log.info("a default yielded: %s", line)
    tokenizer = Tokenizer.load(files, config.chat_template)
    t0 = time.perf_counter()
    # Build (or find) the CPU kernels now, not in the first request's forward: the server
    # reports healthy only after load, and a first build takes about a minute.
    log.info("CPU kernels: %s", "ready" if kernels.available() else "unavailable, torch's ops instead")
    stages = headers.placement.stage_ranges()
    # A pipeline head builds stage 0 and reads only its tensors; RemoteStages stands for the rest.
    pipelined = rank is not None and rank.stages > 1
    placement = headers.placement.first_stage() if pipelined else headers.placement
    tensors = files.load_tensors(stages[0] if pipelined else None, keep_blocks=keeps_blocks(config.dtype))
    model = Transformer(mc, tensors, config.dtype,
                        max_positions=max(config.ctx_per_slot, mc.max_position_embeddings), placement=placement)
    drafter = None
    if config.spec is not None and not config.draft_rank:
        here = model.stages[0].device == torch.device(placement.draft_device)
        drafter = load_drafter(config.spec, headers.draft, mc, tensors, config.dtype, config.parallel,
                               config.ctx_per_slot, headers.draft_ratios, placement.draft_device,
                               model.embed_tokens if here else None, model.head_logits)
    del tensors
    resident = drafter.resident() if drafter is not None else None  # a draft model and its cache
    activations = resolve_activations(config.activations, config.dtype, stored_formats(files))
    q8_layers = use_activations(model, activations) + (use_activations(resident[0], activations) if resident else 0)
    log.info("loaded %s (%s, %s) in %.1f s", files.path, mc.family, config.dtype, time.perf_counter() - t0)
    log.info("activations: %s", f"8-bit for {q8_layers} block-weight layers" if q8_layers
             else "f32")
    formats = model.weight_formats()
    log.info("weights: %s", describe_formats(formats))
    cache = cache_for(config, mc, model.specs, placement.layer_devices())
    slots = f"1 unified pool of {cache.capacity} positions for {config.parallel} slots" if config.kv_unified \
        else f"{config.parallel} slots x {config.ctx_per_slot} ctx"
    log.info("KV cache: %s", describe_cache(model.specs, slots, cache.nbytes, cache.kpool_nbytes,
                                            cache.recurrent_nbytes, config.state_steps))
    if resident is not None:  # a draft model, placed on its device
        devices = measure(model, cache, placement.draft_device, *resident)
    else:
        devices = measure(model, cache)
    log.info("%d stage(s), pipeline depth %d, %d process(es)", len(stages), config.depth, config.world)
    for usage in devices:
        log.info("device %s", usage.describe())
    eos = set(mc.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    remote = None
    message_device = join(rank, headers.placement) if rank is not None else None
    if pipelined:
        log.info("pipeline: this head (rank 0) runs stage 0, layers %s; %s", _layer_span(stages[0]),
                 "; ".join(f"rank {r} stage {r}, layers {_layer_span(s)} on {headers.placement.devices[r]}"
                           for r, s in enumerate(stages) if r))
        link = Link(0, rank.stages, mc.residual_width, model.compute_dtype, message_device)
        remote = RemoteStages(link, config.pipeline_timeout, placement.devices[0], describe_loss)
        model.stages.append(remote)  # after the local stage, before the final norm
    if config.draft_rank:
        log.info("the draft (%s) runs on rank %d, on its %s", config.spec.type, rank.world - 1, placement.draft_device)
        drafter = RemoteDrafter(DraftLink(rank.world - 1, mc.residual_width, model.compute_dtype), config.spec,
                                mc.vocab_size, config.pipeline_timeout, describe_loss)
    # A drafter that pairs the hidden state at position i with the token at i+1 needs, where a
    # request resumes a cached prefix, the hidden state before it: K/V can recompute that position
    # (a reuse margin of one), a recurrent state cannot step back, so its snapshots keep it.
    pairs = drafter is not None and drafter.needs_hidden
    scheduler = Scheduler(config.parallel, config.ctx_per_slot, config.batch_size, config.ubatch_size,
                          MirroredCache(cache, remote.queued) if remote is not None else cache,
                          reuse_margin=int(pairs and cache.recurrent is None),
                          draft_max=config.spec.verify_rows if config.spec else 0,
                          keep_hidden=pairs and cache.recurrent is not None)
    return Parts(files, model, tokenizer, cache, scheduler, frozenset(eos), drafter, devices, remote,
                 headers.placement, {fmt: use.tensors for fmt, use in formats.items()}, activations)


def _layer_span(layers: range) -> str:
    return f"{layers.start}..{layers.stop - 1}"
