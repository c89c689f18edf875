"""Gated DeltaNet: the linear-attention layer of the Qwen3.5 family (docs/architecture.md,
"Gated DeltaNet"), as transformers' Qwen3_5GatedDeltaNet computes it.

Per token t, from x_t: qkv = in_proj_qkv x (then a causal depthwise convolution over the last
conv_kernel tokens' qkv, and SiLU), z = in_proj_z x, beta = sigmoid(in_proj_b x), and the decay
g = A * softplus(in_proj_a x + dt_bias), with A = -exp(A_log). q and k are L2-normed per head and
q scaled by k_dim^-1/2; each value head reads one key head. The state S [k_dim, v_dim] of each
value head follows the delta rule:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

and the head's output is RMSNorm(o) * w * silu(z), then out_proj over all heads.

A row of a few tokens (decode, verify) runs the rule token by token and keeps the state after each
position (engine/model/recurrent_cache.py); a longer prompt chunk runs it in chunks of 64 with the
intra-chunk part as matrix products (the WY form transformers' torch_chunk_gated_delta_rule uses)
and keeps the states after its last two positions (its last token runs alone).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.batch import ForwardBatch
from engine.model.norm import GatedRMSNorm
from engine.model.recurrent_cache import RecurrentCache
from engine.ops import blocks, kernels
from engine.ops.quant import Linear

CHUNK = 64
L2_EPS = 1e-6  # the reference's l2norm epsilon, fixed whatever rms_norm_eps is


class GatedDeltaNet(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str):
        """p: the layer's `linear_attn.` prefix; tensors as engine/files/qwen3_5_layout.py reads them."""
        super().__init__()
        lin = self.linear = c.linear
        # One projection for qkv, z, b and a: they read the same input.
        self.in_proj = Linear(blocks.cat_rows([t[p + n + ".weight"] for n in ("in_proj_qkv", "in_proj_z",
                                                                           "in_proj_b", "in_proj_a")]),
                              None, dtype, parts=4)
        self.splits = [lin.conv_dim, lin.value_dim, lin.num_v_heads, lin.num_v_heads]
        self.register_buffer("conv_weight", t[p + "conv1d.weight"].float().contiguous())  # [conv_dim, kernel]
        self.register_buffer("A", t[p + "A"].float())  # -exp(A_log), [v_heads]
        self.register_buffer("dt_bias", t[p + "dt_bias"].float())
        self.norm = GatedRMSNorm(t[p + "norm.weight"], c.rms_norm_eps, c.linear_gate_act)
        self.out_proj = Linear(t[p + "out_proj.weight"], None, dtype)
        # The key head each value head reads.
        group = lin.num_v_heads // lin.num_k_heads
        heads = torch.arange(lin.num_v_heads)
        self.register_buffer("k_head", heads % lin.num_k_heads if lin.tiled_v_heads else heads // group)
        self.sigmoid_gate = c.linear_gate_act == "sigmoid"

    def _one_call(self, x: torch.Tensor, batch: ForwardBatch, cache: RecurrentCache) -> bool:
        """Whether the layer runs in one kernel call (gated_delta_mixer): every row a few tokens, each
        token its own, taken token by token, and both projections the kernel's products."""
        return kernels.usable(x) and len(batch.slots) == x.shape[0] \
            and x.shape[0] <= min(self.in_proj.max_kernel_rows, self.out_proj.max_kernel_rows) \
            and all(cache.per_token(len(row.tokens)) for row in batch.rows)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: RecurrentCache, layer: int) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]; reads and writes the layer's state of each row's slot."""
        lin, n = self.linear, x.shape[0]
        if self._one_call(x, batch, cache):  # decode and verify rows of a family outside decoder_layers
            j = cache.layers[layer]
            tensors = [self.conv_weight, self.A, self.dt_bias, self.k_head, self.norm.weight, cache.conv[j], cache.state[j]]
            return kernels.gated_delta_mixer(x, self.kernel_weights, tensors, batch.slots, batch.positions,
                                             self.norm.eps, self.sigmoid_gate,
                                             self.in_proj.q8_activations or self.out_proj.q8_activations)
        proj = self.in_proj(x).float()
        mixed, z, b, a = proj.split(self.splits, dim=-1)
        beta = torch.sigmoid(b)
        g = self.A * F.softplus(a + self.dt_bias)  # [N, v_heads], <= 0
        core = torch.empty(n, lin.num_v_heads, lin.v_head_dim)
        # Rows of a few tokens (decode, verify) run the rule token by token, in one kernel call
        # where it is usable; longer rows (prompt chunks) in chunks, row by row.
        kernel = kernels.usable(x) and len(batch.slots) == n
        stepped, offset = [], 0
        for row in batch.rows:
            t = len(row.tokens)
            rows = slice(offset, offset + t)
            offset += t
            if kernel and cache.per_token(t):
                stepped.append(torch.arange(rows.start, rows.stop))
            else:
                core[rows] = self._row(mixed[rows], g[rows], beta[rows], cache, layer, row.slot, row.start)
        if stepped:
            i = torch.cat(stepped) if len(stepped) < len(batch.rows) else slice(None)
            j = cache.layers[layer]
            core[i] = kernels.gated_delta_rows(proj[i], lin.key_dim, self.conv_weight, self.A, self.dt_bias,
                                               self.k_head, cache.conv[j], cache.state[j], batch.slots[i],
                                               batch.positions[i])
        out = self.norm(core, z.view(n, lin.num_v_heads, lin.v_head_dim))
        return self.out_proj(out.view(n, lin.value_dim).to(x.dtype))

    @functools.cached_property
    def kernel_weights(self) -> list[torch.Tensor | None]:
        """The input projection's and out_proj's (weight, scale, bias)."""
        return [t for m in (self.in_proj, self.out_proj) for t in (m.weight, m.scale, m.bias)]

    @functools.cached_property
    def _taps(self) -> torch.Tensor:
        """The convolution's weights by tap, [kernel, conv_dim]: a prompt chunk's rows times a tap's
        contiguous weights take torch's vectorised loop (a column of conv_weight, strided, took
        5x as long at 512 rows); the same products."""
        return self.conv_weight.t().contiguous()

    def _row(self, mixed, g, beta, cache: RecurrentCache, layer: int, slot: int, start: int) -> torch.Tensor:
        """One row's tokens at positions start.. of the slot: mixed [T, conv_dim], g, beta [T, v_heads]
        -> the delta rule's outputs [T, v_heads, v_dim], the slot's states written."""
        lin, t = self.linear, mixed.shape[0]
        tail, state = cache.read(layer, slot, start)
        window = torch.cat([tail, mixed])  # [kernel-1 + T, conv_dim]: the inputs each output reads
        k = lin.conv_kernel
        conv = window[:t] * self._taps[0]
        for i in range(1, k):  # in place: a prompt chunk's [T, conv_dim] is larger than the cache
            conv += window[i:i + t] * self._taps[i]
        q, key, v = F.silu(conv, inplace=True).split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        q = _l2norm(q.view(t, lin.num_k_heads, lin.k_head_dim))[:, self.k_head] * lin.k_head_dim ** -0.5
        key = _l2norm(key.view(t, lin.num_k_heads, lin.k_head_dim))[:, self.k_head]
        v = v.view(t, lin.num_v_heads, lin.v_head_dim)
        if cache.per_token(t):
            out = torch.empty(t, lin.num_v_heads, lin.v_head_dim)
            for i in range(t):
                state = _step(state, q[i], key[i], v[i], g[i], beta[i])
                out[i] = torch.einsum("hk,hkv->hv", q[i], state)
                cache.write(layer, slot, start + i, window[i + 1:i + k], state)
            return out
        # All but the last token in chunks, the last alone: the states after both are kept.
        out = torch.empty(t, lin.num_v_heads, lin.v_head_dim)
        head, state = chunked_delta_rule(q[:-1].transpose(0, 1), key[:-1].transpose(0, 1), v[:-1].transpose(0, 1),
                                         g[:-1].t(), beta[:-1].t(), state)
        out[:-1] = head.transpose(0, 1)
        cache.write(layer, slot, start + t - 2, window[t - 1:t - 2 + k], state)
        state = _step(state, q[-1], key[-1], v[-1], g[-1], beta[-1])
        out[-1] = torch.einsum("hk,hkv->hv", q[-1], state)
        cache.write(layer, slot, start + t - 1, window[t:], state)
        return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _step(state, q, k, v, g, beta) -> torch.Tensor:
    """One token of the delta rule for every value head: state [H, k_dim, v_dim]; q, k [H, k_dim];
    v [H, v_dim]; g, beta [H]. Returns the new state (q is read by the caller)."""
    state = state * g.exp()[:, None, None]
    delta = (v - torch.einsum("hk,hkv->hv", k, state)) * beta[:, None]
    return state + k[:, :, None] * delta[:, None, :]


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over T tokens at once: q, k [H, T, k_dim] (normed, q scaled), v [H, T, v_dim],
    g, beta [H, T], state [H, k_dim, v_dim] before them -> (outputs [H, T, v_dim], the state after).

    Within a chunk of C tokens, with G_i the decay summed from the chunk's start to i and D the
    lower-triangular [C, C] matrix exp(G_i - G_j) (j <= i): the corrections u_i = beta_i (v_i -
    S_{i-1}^T k_i) solve (I + L) u = beta v - (beta k exp(G)) S_0, L the strictly lower part of
    (beta k k^T) * D; then o = (q exp(G)) S_0 + ((q k^T) * D) u, and the state after the chunk is
    exp(G_C) S_0 + (k exp(G_C - G))^T u."""
    h, t, dk = k.shape
    pad = (-t) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, n, chunk).cumsum(-1), beta.reshape(h, n, chunk)
    kb, vb = k * beta[..., None], v * beta[..., None]
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, n, C, C]
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * g.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    qd = q * g.exp()[..., None]
    kd = k * (g[..., -1:] - g).exp()[..., None]
    last = g[..., -1].exp()  # [H, n]
    out = torch.empty_like(v)
    for i in range(n):
        correction = u[:, i] - w[:, i] @ state
        out[:, i] = qd[:, i] @ state + attn[:, i] @ correction
        state = state * last[:, i, None, None] + kd[:, i].transpose(-1, -2) @ correction
    return out.reshape(h, n * chunk, -1)[:, :t], state
