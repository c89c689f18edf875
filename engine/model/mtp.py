"""The detached multi-token-prediction (MTP) draft and its file format.

Depth k takes a hidden state h and the embedding of the next token: for k = 1, h is the target's
last hidden state after its final norm (what feeds the lm_head); for k > 1, h is depth k-1's block
output before `norm`, and the token is the one just drafted. Each layer normalises both inputs
(`enorm`, `hnorm`), projects their concatenation [e; h] 2H -> H (`eh_proj`), runs one decoder block
with its own KV cache, applies `norm`, and scores a frequent-token subset with its own small head;
subset ids map back to full-vocabulary ids. A file with fewer layers than the draft length reuses
its last layer (and that layer's cache) for the deeper steps.

The file: safetensors whose metadata names the format, the layer count, the fingerprint of the
target it was trained for and optionally each layer's compress ratio (`compress_ratios`, a comma
list; absent: all dense); tensors `layers.{k}.{enorm,hnorm,eh_proj,norm}.weight`,
`layers.{k}.block.<HF decoder-layer names>`, `head.weight` [K, H] and `head.vocab_ids` [K].
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.errors import ConfigError
from engine.files.model_config import ModelConfig
from engine.model.batch import ForwardBatch
from engine.model.layer_spec import LayerSpec
from engine.model.rope import rope_table
from engine.model.norm import RMSNorm
from engine.model.transformer import DecoderLayer, embed_rows, run_on
from engine.ops.arena import move_to_huge_pages
from engine.ops.blocks import BlockTensor
from engine.ops.quant import Linear, compute_dtype

FORMAT = "tandem-mtp/1"


def target_fingerprint(config: ModelConfig, embedding: torch.Tensor | BlockTensor) -> str:
    """Identifies a target by its geometry and the first rows of its f32 embedding (as loaded,
    before any weight-format conversion)."""
    h = hashlib.sha256()
    geometry = [config.family, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
                config.head_dim, config.vocab_size]
    h.update(json.dumps(geometry).encode())
    first = embedding.rows(slice(0, 64)).dequantize() if isinstance(embedding, BlockTensor) else embedding[:64]
    h.update(first.float().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class MTPHeader:
    num_layers: int
    hidden_size: int
    subset_size: int
    target_fingerprint: str
    target_name: str
    compress_ratios: tuple[int, ...]  # one per layer; 0 is dense


def read_header(path: str | Path) -> MTPHeader:
    from safetensors import safe_open
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"spec_draft_model={str(path)!r}: file does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            shape = f.get_slice("head.weight").get_shape() if "head.weight" in f.keys() else None
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ConfigError(f"spec_draft_model={str(path)!r}: not a safetensors file ({e})") from e
    if meta.get("format") != FORMAT or shape is None:
        raise ConfigError(f"spec_draft_model={str(path)!r}: not a tandem MTP draft (format {meta.get('format')!r}, "
                          f"expected {FORMAT!r})")
    layers = int(meta["num_layers"])
    text = meta.get("compress_ratios", "")
    try:
        ratios = tuple(int(r) for r in text.split(",")) if text else (0,) * layers
    except ValueError:
        ratios = ()
    if len(ratios) != layers:
        raise ConfigError(f"spec_draft_model={str(path)!r}: metadata compress_ratios={text!r}: must be one integer "
                          f"per draft layer ({layers}), comma-separated")
    return MTPHeader(layers, int(shape[1]), int(shape[0]), meta["target_fingerprint"], meta.get("target_name", "?"),
                     ratios)


def check_compatible(header: MTPHeader, path, target: ModelConfig, fingerprint: str) -> None:
    """fingerprint "": only the geometry, from the headers (the fingerprint needs embedding rows)."""
    if header.hidden_size != target.hidden_size:
        theirs = f"hidden size {header.hidden_size}", f"this target's hidden_size is {target.hidden_size}"
    elif fingerprint and header.target_fingerprint != fingerprint:
        theirs = f"fingerprint {header.target_fingerprint}", f"this target's fingerprint is {fingerprint}"
    else:
        return
    raise ConfigError(f"spec_draft_model={str(path)!r}: trained for another target ({header.target_name}, "
                      f"{theirs[0]}): a draft serves only the target whose fingerprint it carries; {theirs[1]}")


def save(path: str | Path, tensors: dict[str, torch.Tensor], num_layers: int, fingerprint: str,
         target_name: str, dtype: torch.dtype = torch.bfloat16, compress_ratios: tuple[int, ...] = ()) -> None:
    from safetensors.torch import save_file
    out = {n: (t if n == "head.vocab_ids" else t.to(dtype)).contiguous() for n, t in tensors.items()}
    meta = {"format": FORMAT, "num_layers": str(num_layers), "target_fingerprint": fingerprint,
            "target_name": target_name}
    if compress_ratios:
        meta["compress_ratios"] = ",".join(str(r) for r in compress_ratios)
    save_file(out, str(path), metadata=meta)


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return {n: (t if n == "head.vocab_ids" else t.float()) for n, t in load_file(str(path)).items()}


class MTPLayer(nn.Module):
    def __init__(self, config: ModelConfig, t: dict, k: int, dtype: str, spec: LayerSpec):
        super().__init__()
        cdt, eps, p = compute_dtype(dtype), config.rms_norm_eps, f"layers.{k}."
        self.enorm = RMSNorm(t[p + "enorm.weight"], eps, cdt)
        self.hnorm = RMSNorm(t[p + "hnorm.weight"], eps, cdt)
        self.eh_proj = Linear(t[p + "eh_proj.weight"], None, dtype)
        # The block reads tensors under HF decoder-layer names and its own cache layer k. Its spec is
        # the draft layer's own: the target's config holds the trunk's ratios, not this layer's.
        block = {f"model.layers.{k}.{n[len(p + 'block.'):]}": v for n, v in t.items() if n.startswith(p + "block.")}
        self.block = DecoderLayer(config, block, k, dtype, spec)
        self.norm = RMSNorm(t[p + "norm.weight"], eps, cdt)


class MTPDraft(nn.Module):
    """Built from f32 tensors of an MTP file. Embeds its tokens with the target's embedding, or
    with `embed`, a copy of that table on its own device when the target's first stage is elsewhere."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], specs: list[LayerSpec], dtype: str,
                 max_positions: int, device: str = "cpu", embed: Linear | None = None):
        """specs: each draft layer's (their number is the file's layer count). Everything but the
        RoPE tables and vocab_ids (read on the CPU, where the steps' positions and logits are)
        sits on `device`."""
        super().__init__()
        self.config, self.num_layers = config, len(specs)
        self.device = torch.device(device)
        self.layers = nn.ModuleList(MTPLayer(config, tensors, k, dtype, spec).to(self.device)
                                    for k, spec in enumerate(specs))
        self.head = Linear(tensors["head.weight"], None, dtype).to(self.device)
        self.embed = embed
        self.register_buffer("vocab_ids", tensors["head.vocab_ids"].long())
        self.compute_dtype = cdt = compute_dtype(dtype)
        cos, sin = rope_table(config.rope, config.head_dim, max_positions)
        self.register_buffer("cos", cos.to(cdt))
        self.register_buffer("sin", sin.to(cdt))
        move_to_huge_pages(self)

    @property
    def specs(self) -> list[LayerSpec]:
        return [layer.block.self_attn.spec for layer in self.layers]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Its own embedding copy's rows (only a draft built with one has them)."""
        return embed_rows(self.embed, ids, self.compute_dtype)

    def layer_for_depth(self, depth: int) -> int:
        return min(depth, self.num_layers) - 1

    def forward(self, depth: int, hidden: torch.Tensor, embeddings: torch.Tensor, batch: ForwardBatch,
                cache, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, embeddings: [N, H] for the batch's N positions (the token at each position is the
        next token after it), on any device. Writes this depth's layer cache. Returns (block output
        before norm [N, H] on the draft's device, subset logits f32 on the CPU: [len(at), K] at the
        positions `at` indexes, or [N, K] when it is None)."""
        layer, d = self.layers[self.layer_for_depth(depth)], self.device
        x = layer.eh_proj(torch.cat([layer.enorm(embeddings.to(d)), layer.hnorm(hidden.to(d))], dim=-1))
        x = run_on(d, [layer.block], x, batch, self.cos[batch.positions], self.sin[batch.positions], cache)
        return x, self.head(layer.norm(x if at is None else x[at.to(d)])).float().cpu()
