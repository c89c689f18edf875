"""Per-layer n-gram embeddings (PLE) of Qwen4-Exp (docs/architecture.md, "Qwen4-Exp"), as
transformers' Qwen4ExpTextPLELayer computes them.

For the token at p and each order m in 2..n, the m-gram ending at p (tokens at p, p-1, .., p-m+1;
a token before the start, or at or before an EOS among p-1, .., p-m+1 ... reads as EOS) is hashed:
h = XOR over i < m of token_{p-i} * mult_i in int64 (wrapping), then per head of that order
(h mod vocab_head) + offset_head indexes one table of rows. The rows of all heads, [embed_dim],
give a key per residual stream and one value; each stream's gate g = <norm_key(key_s),
norm_query(x_s)> / sqrt(hidden), signed-square-rooted, scales the value: v_s = sigmoid(g) v. The
layer adds v_s + silu(conv(norm_conv(v))) to the streams, conv a depthwise convolution whose taps
lie `n` positions apart.

Its state per slot (engine/model/recurrent_cache.py): the last n-1 token ids and the convolution's
last (kernel-1)*n inputs. The tables are read by row, as the checkpoint shards them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.batch import ForwardBatch
from engine.model.norm import GroupedRMSNorm
from engine.model.recurrent_cache import RecurrentCache, kept_of_long_row
from engine.ops import blocks
from engine.ops.quant import Linear, compute_dtype


def shifted_tokens(history: torch.Tensor, shifts: int, eos: int) -> torch.Tensor:
    """history [n-1 + T] (the n-1 ids before a row, then its T) -> [shifts, T]: row s holds, for
    each of the T tokens, the token s back, or EOS where an EOS lies between them (the token s back
    included: it reads EOS either way)."""
    t = history.shape[0] - (shifts - 1)
    out = torch.empty(shifts, t, dtype=history.dtype)
    is_eos = history == eos
    for s in range(shifts):
        back = history[shifts - 1 - s:shifts - 1 - s + t]
        # An EOS at any of the s positions p-s .. p-1 cuts the n-gram there.
        cut = torch.zeros(t, dtype=torch.bool)
        for i in range(1, s + 1):
            cut |= is_eos[shifts - 1 - i:shifts - 1 - i + t]
        out[s] = torch.where(cut, torch.full_like(back, eos), back)
    return out


class NgramEmbedding(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str):
        """p: the layer's `ple.` prefix."""
        super().__init__()
        g = self.config = c.ngram
        self.streams, self.hidden, self.eos = c.hc_count, c.hidden_size, g.eos
        e = p + "ple_embedding."

        def constants(name: str, given: tuple[int, ...]) -> torch.Tensor:
            return t[e + name].long() if e + name in t else torch.tensor(given, dtype=torch.long)
        self.register_buffer("multipliers", constants("layer_multipliers", g.multipliers))
        self.register_buffer("sizes", constants("ngram_heads_vocab_sizes", g.sizes))
        self.register_buffer("offsets", constants("ngram_heads_offsets", g.offsets))
        shards = sorted((n for n in t if n.startswith(e + "ngram_embedding.shard_")),
                        key=lambda n: int(n.rsplit("shard_", 1)[1].split(".")[0]))
        self.shards = [t[n] for n in shards]  # rows as the file holds them, never joined
        self.register_buffer("shard_ends", torch.tensor([s.shape[0] for s in self.shards]).cumsum(0))
        cdt = compute_dtype(dtype)
        self.key_proj = Linear(t[p + "key_proj.weight"], None, dtype)
        self.value_proj = Linear(t[p + "value_proj.weight"], None, dtype)
        self.norm_key = GroupedRMSNorm(t[p + "norm_key.weight"], c.hidden_size, c.rms_norm_eps, cdt)
        self.norm_query = GroupedRMSNorm(t[p + "norm_query.weight"], c.hidden_size, c.rms_norm_eps, cdt)
        self.norm_conv = GroupedRMSNorm(t[p + "norm_conv.weight"], c.hidden_size, c.rms_norm_eps, cdt)
        self.register_buffer("conv_weight", t[p + "conv1d.weight"].float().contiguous())  # [wide, kernel]

    def ids(self, history: torch.Tensor) -> torch.Tensor:
        """The table rows of a row's tokens: history [n-1 + T] -> [T, heads]."""
        g = self.config
        shifted = shifted_tokens(history, g.ngram, self.eos) * self.multipliers[:, None]  # [n, T], wrapping
        orders, mixed = [], shifted[0]
        for m in range(1, g.ngram):
            mixed = torch.bitwise_xor(mixed, shifted[m])
            heads = slice((m - 1) * g.heads_per_ngram, m * g.heads_per_ngram)
            orders.append(torch.remainder(mixed[:, None], self.sizes[heads]) + self.offsets[heads])
        return torch.cat(orders, dim=-1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Table rows ids [T, heads] -> [T, embed_dim], each from the shard that holds it, widened
        row by row from the file's format (a GGUF may store the table in blocks)."""
        shard = torch.bucketize(ids, self.shard_ends, right=True)
        out = torch.empty(*ids.shape, self.shards[0].shape[1])
        for s in shard.unique().tolist():
            at = shard == s
            out[at] = blocks.to_f32(blocks.take_rows(self.shards[s], ids[at] - (self.shard_ends[s - 1] if s else 0)))
        return out.flatten(-2)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: RecurrentCache, layer: int) -> torch.Tensor:
        """x [N, hc * hidden] -> what the layer adds to it, [N, hc * hidden]; reads and writes the
        layer's n-gram state of each row's slot."""
        g, n = self.config, x.shape[0]
        history = []
        for row in batch.rows:
            context = cache.read_ngram(layer, row.slot, row.start)
            if context is None:  # nothing before the slot's first token
                context = torch.full((g.ngram - 1,), self.eos, dtype=torch.long)
            history.append(torch.cat([context, torch.as_tensor(row.tokens, dtype=torch.long)]))
        emb = self.rows(torch.cat([self.ids(h) for h in history])).to(x.dtype)
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.streams, self.hidden))
        query = self.norm_query(x).unflatten(-1, (self.streams, self.hidden))
        gate = (key * query).sum(-1, keepdim=True) / self.hidden ** 0.5
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        value = (torch.sigmoid(gate) * self.value_proj(emb).unsqueeze(-2)).flatten(-2)  # [N, wide]
        normed = self.norm_conv(value)
        conv = torch.empty_like(value)
        offset = 0
        for row, h in zip(batch.rows, history):
            t = len(row.tokens)
            rows = slice(offset, offset + t)
            offset += t
            conv[rows] = self._conv(normed[rows], h, cache, layer, row.slot, row.start)
        return value + conv

    def _conv(self, x, history, cache: RecurrentCache, layer: int, slot: int, start: int) -> torch.Tensor:
        """silu of the dilated convolution over one row's inputs x [T, wide], the slot's state
        written (after each position for a row kept token by token, else after its last)."""
        g, t = self.config, x.shape[0]
        tail = cache.read_ngram_conv(layer, slot, start)
        window = torch.cat([tail.to(x.dtype), x])  # [tail + T, wide]
        out = sum(window[k * g.ngram:k * g.ngram + t] * self.conv_weight[:, k].to(x.dtype)
                  for k in range(g.conv_kernel))
        span = g.conv_tail
        for i in (range(t) if cache.per_token(t) else kept_of_long_row(0, t)):
            cache.write_ngram(layer, slot, start + i, history[i + 1:i + g.ngram], window[i + 1:i + 1 + span])
        return F.silu(out)
