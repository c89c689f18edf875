"""Qwen4-Exp's decoder layer (docs/architecture.md, "Qwen4-Exp"), as transformers' Qwen4ExpTextDecoderLayer
computes it: on `hc_count` residual streams [N, hc * hidden], the layer's n-gram embeddings (PLE
layers) are added first; then its mixer (gated attention with the model's QSA indexer, or a Gated
DeltaNet) and its experts each run inside a hyper-connection, which gives them one mixed [N, hidden]
input and adds their output back to every stream.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.attention import Attention
from engine.model.batch import ForwardBatch
from engine.model.experts import Experts
from engine.model.gated_delta import GatedDeltaNet
from engine.model.hyper_connections import HyperConnection
from engine.model.kv_cache import KVCache
from engine.model.layer_spec import LayerSpec
from engine.model.ngram_embedding import NgramEmbedding


class Qwen4ExpLayer(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, index: int, dtype: str, spec: LayerSpec,
                 rope: tuple[torch.Tensor, torch.Tensor], model_index: int):
        """index: the layer's in t and in the cache; model_index: in the model (which layers have
        n-gram embeddings)."""
        super().__init__()
        p = f"model.layers.{index}."
        self.index, self.spec = index, spec
        self.ple = NgramEmbedding(c, t, p + "ple.", dtype) if c.ngram and model_index in c.ngram.layers else None
        self.attn_hyper_connection = HyperConnection(c, t, p + "attn_hyper_connection.", dtype)
        self.self_attn = None if spec.is_recurrent else Attention(c, t, p + "self_attn.", dtype, spec, rope)
        self.linear_attn = GatedDeltaNet(c, t, p + "linear_attn.", dtype) if spec.is_recurrent else None
        self.mlp_hyper_connection = HyperConnection(c, t, p + "mlp_hyper_connection.", dtype)
        self.mlp = Experts(c, t, p + "mlp.", dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos, sin, cache: KVCache) -> torch.Tensor:
        """x [N, hc * hidden] -> [N, hc * hidden]."""
        if self.ple is not None:
            x = x + self.ple(x, batch, cache.recurrent, self.index)
        if self.linear_attn is not None:
            x = self.attn_hyper_connection(x, lambda h: self.linear_attn(h, batch, cache.recurrent, self.index))
        else:
            x = self.attn_hyper_connection(x, lambda h: self.self_attn(h, batch, cos, sin, cache, self.index))
        return self.mlp_hyper_connection(x, self.mlp)


class StreamMixer(HyperConnection):
    """The model's last hyper-connection: the streams [N, hc * hidden] mixed into the [N, hidden]
    states the lm_head reads (in place of a final norm)."""

    def __init__(self, c: ModelConfig, t: dict, dtype: str):
        super().__init__(c, t, "model.hyper_connection_mixer.", dtype, inject=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)[0]

