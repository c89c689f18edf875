"""What a placement asks of each device. Before any weights are read, from the headers: the named
devices exist, and each one's weights and KV cache at the requested context and slots fit its
memory (`check_devices`, `check_fit`). Once loaded, what each device holds (`measure`, for the load
log and /props).

The estimate counts the layers' weights in their format, the lm_head and the embedding copies
(engine/model/transformer.py keeps one per device that reads it), K and V in their cache types with a QSA
layer's pooled keys, and the draft (a detached MTP draft by its file's size). The RoPE tables and
activations are left out: they are a rounding error next to these.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from engine.errors import ConfigError
from engine.files.model_config import ModelConfig, recurrent_state_bytes
from engine.model.kv_cache import KV_BYTES_PER_VALUE
from engine.model.mtp import MTPDraft
from engine.model.recurrent_cache import SNAPSHOTS
from engine.files.nearest_format import served
from engine.ops.blocks import BLOCK
from engine.ops.quant import BYTES_PER_WEIGHT, compute_dtype
from engine.placement import Placement
from engine.settings import EngineConfig
from engine.spec.loading import DraftFiles

MIB = 2**20


@dataclass
class DeviceNeed:
    weights: int = 0
    kv: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv


def layer_weight_bytes(c: ModelConfig, dtype: str, layer: int = 0) -> int:
    """Decoder layer `layer`'s weights (an attention layer's for an MTP layer's block, at
    num_layers and after): the matrices and biases in the weight format (int8 with an f32 scale per
    output channel), the norms in the compute dtype, a linear-attention layer's convolution, decay
    parameters and gated norm in f32."""
    if c.experts is not None:  # Qwen4-Exp: every parameter in the weight format, its hash tables apart
        return c.layer_parameters(layer) * BYTES_PER_WEIGHT[dtype]
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size
    rows = [2 * i, h]  # the MLP's gate_up and down matrices' output channels, each reading h or i
    weights = 3 * h * i + ((2 * i + h) if c.mlp_bias else 0)
    norms, f32 = 2 * h, 0
    if layer < c.num_layers and c.is_recurrent(layer):
        lin = c.linear
        projected = lin.conv_dim + lin.value_dim + 2 * lin.num_v_heads  # qkv, z, b and a in one matrix
        rows += [projected, h]
        weights += projected * h + h * lin.value_dim
        # The convolution, A, dt_bias and the gated norm in f32; each value head's key head, an int64.
        f32 = lin.conv_dim * lin.conv_kernel + 2 * lin.num_v_heads + lin.v_head_dim + 2 * lin.num_v_heads
    else:
        q_out = 2 * q if c.attn_output_gate else q
        rows += [q_out + 2 * kv, h]
        weights += (q_out + 2 * kv) * h + q * h + (q + 2 * kv if c.attention_bias else 0)
        norms += 2 * c.head_dim if c.qk_norm else 0
    return weights * BYTES_PER_WEIGHT[dtype] + norms * compute_dtype(dtype).itemsize + 4 * f32 \
        + (4 * sum(rows) if dtype == "int8" else 0)


def state_bytes(c: ModelConfig, steps: int) -> int:
    """One slot's recurrent state in every linear-attention layer: `steps` positions' and the
    snapshots' (engine/model/recurrent_cache.py)."""
    return recurrent_state_bytes(c) * (steps + SNAPSHOTS)


def table_bytes(c: ModelConfig, dtype: str) -> int:
    """A [vocab, hidden] table (the lm_head, a tied embedding) in the weight format."""
    return c.vocab_size * (c.hidden_size * BYTES_PER_WEIGHT[dtype] + (4 if dtype == "int8" else 0))


def layer_kv_bytes(c: ModelConfig, ratio: int, positions: int, kv_types: tuple[str, str]) -> int:
    """One layer's K and V for `positions` positions, and its pooled keys when it is a QSA layer."""
    kv = positions * c.kv_size * (KV_BYTES_PER_VALUE[kv_types[0]] + KV_BYTES_PER_VALUE[kv_types[1]])
    if ratio and c.indexer is not None:  # raw indexer keys per position, a block key per block (f32)
        return int(kv + 4 * c.indexer.head_dim * (positions + positions // ratio))
    return int(kv + (positions // ratio * c.kv_size * 4 if ratio else 0))


def estimated_format(dtype: str, stored: dict[str, tuple[int, int]]) -> str:
    """The format the estimate counts every matrix in: the one asked for, or under auto the widest
    the file keeps (its quantized matrices in the block format they load in, engine/files/nearest_format.py;
    plain ones, and an HF model's, f32). stored: a GGUF file's tensors as ModelFiles.stored gives them."""
    if dtype != "auto":
        return dtype
    kept = {served(kind, (1, BLOCK)) or "f32" for name, (kind, _) in stored.items()
            if name.endswith(".weight") and "norm" not in name}
    return max(kept or {"f32"}, key=BYTES_PER_WEIGHT.get)


def device_needs(config: EngineConfig, model: ModelConfig, placement: Placement, draft: DraftFiles | None,
                 stored: dict[str, tuple[int, int]] | None = None) -> dict[str, DeviceNeed]:
    """Estimated bytes per device, the draft's included (draft: its headers, with speculation;
    stored: the file's tensors as stored, which --dtype auto keeps)."""
    dtype = estimated_format(config.dtype, stored or {})
    needs = {device: DeviceNeed() for device in (*placement.devices, placement.draft_device)}
    positions = config.ctx_per_slot * (1 if config.kv_unified else config.parallel)
    for layer, (device, ratio) in enumerate(zip(placement.layer_devices(), model.layer_ratios)):
        needs[device].weights += layer_weight_bytes(model, dtype, layer)
        if model.is_recurrent(layer):
            needs[device].kv += state_bytes(model, config.state_steps) // model.recurrent_layers * config.parallel
        else:
            needs[device].kv += layer_kv_bytes(model, ratio, positions, config.kv_types)
    first, last = placement.devices[0], placement.devices[-1]
    needs[last].weights += table_bytes(model, dtype)  # the lm_head
    embed_bytes = table_bytes(model, dtype) if model.tie_word_embeddings else \
        model.vocab_size * model.hidden_size * compute_dtype(dtype).itemsize
    if not model.tie_word_embeddings or first != last:
        needs[first].weights += embed_bytes
    spec, need = config.spec, needs[placement.draft_device]
    # A draft's cache is per slot, in the compute dtype.
    draft_positions = config.ctx_per_slot * config.parallel
    draft_kv = ("bf16", "bf16") if compute_dtype(dtype) == torch.bfloat16 else ("f32", "f32")
    if spec is not None and spec.runs_mtp and draft.nextn is not None:  # the model's own MTP layers
        layers = draft.nextn.config.num_nextn_predict_layers  # the file's (a target without them: -md's)
        h = model.hidden_size  # its projection of [embedding; hidden] and three norms beside the blocks
        need.weights += layers * layer_weight_bytes(model, dtype, model.num_layers) \
            + 2 * h * h * BYTES_PER_WEIGHT[dtype] + (4 * h if dtype == "int8" else 0) \
            + 3 * h * compute_dtype(dtype).itemsize
        need.kv += layers * layer_kv_bytes(model, 0, draft_positions + config.parallel, draft_kv)
    elif spec is not None and spec.runs_mtp:
        need.weights += os.path.getsize(spec.draft_model)
        need.kv += len(draft.ratios) * layer_kv_bytes(model, 0, draft_positions, draft_kv)
    if spec is not None and spec.runs_mtp and placement.draft_device != first:  # its own embedding copy
        need.weights += embed_bytes
    elif spec is not None and spec.type == "draft-simple":
        small = draft.model.config
        need.weights += sum(layer_weight_bytes(small, dtype, i) for i in range(small.num_layers)) \
            + table_bytes(small, dtype) * (1 if small.tie_word_embeddings else 2)
        need.kv += (small.num_layers - small.recurrent_layers) * layer_kv_bytes(small, 0, draft_positions, draft_kv) \
            + state_bytes(small, spec.n_max + 2) * config.parallel
    return {d: n for d, n in needs.items() if n.total}


def device_memory(device: str) -> int:
    """The device's memory in bytes: the machine's RAM for the CPU (every CPU stage shares it)."""
    if device == "cpu":
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def check_devices(placement: Placement) -> None:
    """Raises ConfigError naming the field and the device that this machine does not have."""
    named = [("devices", d) for d in placement.devices] + [("draft_device", placement.draft_device)]
    for field, device in named:
        if device == "cpu":
            continue
        if not torch.cuda.is_available():
            raise ConfigError(f"{field}={device!r}: no CUDA device is usable here (torch {torch.__version__} "
                              f"{'has no CUDA support' if torch.version.cuda is None else 'finds no device'}); "
                              f"use cpu")
        count, index = torch.cuda.device_count(), torch.device(device).index
        if index >= count:
            raise ConfigError(f"{field}={device!r}: no such device, this machine has {count} CUDA device(s), "
                              f"cuda:0 .. cuda:{count - 1}")


def check_fit(config: EngineConfig, model: ModelConfig, placement: Placement, draft: DraftFiles | None,
              stored: dict[str, tuple[int, int]]) -> None:
    """Raises ConfigError when a device's estimated weights and KV cache exceed its memory."""
    for device, need in device_needs(config, model, placement, draft, stored).items():
        have = device_memory(device)
        if need.total > have:
            raise ConfigError(
                f"ctx_size={config.ctx_size}: {device} would need about {need.total / MIB:.0f} MiB (weights "
                f"{need.weights / MIB:.0f} MiB + KV cache {need.kv / MIB:.0f} MiB at parallel={config.parallel}) "
                f"but has {have / MIB:.0f} MiB; use a smaller ctx_size or fewer slots, or move layers to "
                f"another device")


@dataclass
class DeviceUsage:
    """What one device holds once the model is loaded."""
    device: str
    stages: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)  # trunk layers
    weight_bytes: int = 0
    kv_bytes: int = 0
    embedding_copies: int = 0  # tables holding the token embedding (a tied lm_head counts)
    draft: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """The load log's line for the device."""
        layers = f"layers {self.layers[0]}-{self.layers[-1]}" if self.layers else "no trunk layers"
        stages = f"stage{'s' if len(self.stages) > 1 else ''} {','.join(map(str, self.stages))}, " if self.stages \
            else ""
        draft = ", the draft" if self.draft else ""
        return (f"{self.device}: {stages}{layers}{draft}, weights {self.weight_bytes / MIB:.0f} MiB, KV cache "
                f"{self.kv_bytes / MIB:.0f} MiB, {self.embedding_copies} embedding cop"
                f"{'y' if self.embedding_copies == 1 else 'ies'}")


def measure(model, cache, draft_device: str | None = None, draft_model=None, draft_cache=None) -> list[DeviceUsage]:
    """What each device holds of a loaded model (engine.model.Transformer) and its cache, and of the
    draft (on draft_device, None without one: its model and cache when it has them), in stage
    order, the draft's device last when it holds no stage. The RoPE tables count where they sit."""
    usage: dict[str, DeviceUsage] = {}

    def at(device: torch.device | str) -> DeviceUsage:
        return usage.setdefault(str(device), DeviceUsage(str(device)))

    for index, stage in enumerate(model.stages):
        at(stage.device).stages.append(index)
        at(stage.device).layers.extend(layer.index for layer in stage.layers)
    if draft_device is not None:
        at(draft_device).draft = True
    for module in filter(None, (model, draft_model)):
        for buffer in module.buffers():
            at(buffer.device).weight_bytes += buffer.nbytes
    for part in filter(None, (cache, draft_cache)):
        for layer, device in enumerate(part.devices):
            at(device).kv_bytes += part.layer_nbytes(layer)
        if part.recurrent is not None:
            for tensors in part.recurrent.stores:
                at(tensors[0].device).kv_bytes += sum(t.nbytes for t in tensors)
    # Copies of the target's embedding table: its own, a tied lm_head, a detached draft's.
    tables = [model.embed, model.lm_head if model.config.tie_word_embeddings else None,
              draft_model.embed if isinstance(draft_model, MTPDraft) else None]
    for table in filter(None, tables):
        at(table.weight.device).embedding_copies += 1
    return list(usage.values())
