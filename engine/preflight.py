"""What an engine config asks of its files, checked from their headers before any weights are read.

`read_headers` is the one validation path for a model, its draft, the compression flags and the
placement on devices (that they exist and the model fits them, engine/footprint.py): the
server calls it before it starts listening (a bad value exits 2 with one message), and
`Engine.load` calls it first.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.errors import ConfigError
from engine.files.model_config import LINEAR_ATTENTION, ModelConfig, with_compression
from engine.files.weights import ModelFiles, open_model
from engine.footprint import check_devices, check_fit
from engine.model.layer_spec import LayerSpec
from engine.model.recurrent_cache import SNAPSHOTS
from engine.placement import Placement
from engine.settings import PAGE_SIZE, EngineConfig
from engine.spec.loading import DraftFiles, check_draft_files


@dataclass(frozen=True)
class Headers:
    config: EngineConfig  # the config as checked, with any default that had to yield (config.adapted)
    files: ModelFiles
    model: ModelConfig  # the target's, with --compress-ratios and --qsa-budget applied
    draft: DraftFiles | None  # the draft's headers, with speculation
    draft_ratios: tuple[int, ...]  # the detached MTP draft's layers' (empty without one)
    placement: Placement  # the trunk's stages and the draft's device


def read_headers(config: EngineConfig) -> Headers:
    """Raises ConfigError naming field, value and rule, for values the user gave; a default that
    cannot stand beside them yields instead (Headers.config, which says so in `adapted`)."""
    files = open_model(config.model)
    draft = check_draft_files(config.spec, files.config, files) if config.spec is not None else None
    if config.spec is not None and config.spec.width > 1 and files.config.recurrent_layers:
        raise ConfigError(f"spec_draft_width={config.spec.width}: must be 1 on a model with {LINEAR_ATTENTION} "
                          "(recurrent) layers: a tree's siblings would each need a recurrent state of their own")
    model, draft_ratios = with_compression(files.config, config.compress_ratios, config.qsa_budget,
                                           draft.ratios if draft is not None else ())
    page = PAGE_SIZE
    unpaged = sorted({r for r in model.layer_ratios if r and page % r})
    if config.kv_unified and unpaged and config.auto_slots:
        config = replace(config, parallel=1, kv_unified=False, adapted=config.adapted + (
            f"-np auto: 1 slot with the whole context, not {config.parallel} sharing one KV pool: compress ratio "
            f"{unpaged[0]} does not divide the pool's page of {page} positions",))
    if config.kv_unified and unpaged:
        raise ConfigError(f"compress_ratios: ratio {unpaged[0]} must divide the KV page size {page} with kv_unified")
    stages = config.pipeline_parallel_size
    if stages > model.num_layers:
        raise ConfigError(f"pipeline_parallel_size={stages}: must be at most the model's {model.num_layers} trunk "
                          f"layers (one or more per stage)")
    devices = config.devices
    if stages > 1 and len(devices) not in (1, stages):
        raise ConfigError(f"devices={','.join(devices)!r}: with pipeline_parallel_size={stages}, must list one device "
                          f"per stage ({stages}), or one for all")
    try:
        placement = Placement.resolve(model.num_layers, devices * stages if len(devices) < stages else devices,
                                      config.layer_split, config.tensor_split, config.draft_device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_devices(placement)
    check_fit(config, model, placement, draft, files.stored)
    return Headers(config, files, model, draft, draft_ratios, placement)


def describe_cache(specs: list[LayerSpec], slots: str, kv_bytes: int, kpool_bytes: int, state_bytes: int = 0,
                   steps: int = 0) -> str:
    """The load log's line, e.g. `30 layers (23 dense, 7 qsa r=4) x 2 slots x 4096 ctx = 360 MiB, kpool 6 MiB`,
    or for a hybrid model `24 layers (18 recurrent, 6 dense) x ... = 96 MiB, recurrent state 300 MiB
    (4 positions + 2 snapshots per slot)`."""
    kinds: dict[str, int] = {}
    for spec in specs:
        kinds[spec.describe()] = kinds.get(spec.describe(), 0) + 1
    mix = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    pool = f", kpool {kpool_bytes / 2**20:.0f} MiB" if kpool_bytes else ""
    state = f", recurrent state {state_bytes / 2**20:.0f} MiB ({steps} position{'s' if steps > 1 else ''} + " \
            f"{SNAPSHOTS} snapshots per slot)" if state_bytes else ""
    return f"{len(specs)} layers ({mix}) x {slots} = {kv_bytes / 2**20:.0f} MiB{pool}{state}"
