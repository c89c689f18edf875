"""A mixture-of-experts MLP (Qwen4-Exp; docs/architecture.md, "Qwen4-Exp"), as transformers'
Qwen3NextSparseMoeBlock computes it.

The router scores every expert, softmax in f32; each token goes to its top_k experts, their
probabilities renormalised to sum to 1 (norm_top_k). Each expert is a gated SiLU MLP; a token's
output is the weighted sum of its experts' outputs, plus the shared expert's output scaled by
sigmoid(shared_expert_gate x). Rows are grouped by expert: each touched expert runs once over all
the rows routed to it, so a verify block of a few tokens costs one pass per touched expert.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.mlp import MLP
from engine.ops import kernels
from engine.ops.blocks import BlockTensor
from engine.ops.quant import Linear


def expert_tensors(t: dict, p: str, k: int, count: int, width: int) -> dict[str, torch.Tensor | BlockTensor]:
    """Expert k's gate_proj, up_proj and down_proj weights, from one tensor each
    (`experts.k.gate_proj.weight`) or from merged [experts, ...] tensors (`experts.gate_up_proj`:
    gate rows then up rows; or `experts.gate_proj`, `up_proj`, `down_proj`, which a GGUF may hold in
    blocks, its `count` experts' rows stacked); views, not copies."""
    if p + "experts.gate_up_proj" in t:
        gate_up, down = t[p + "experts.gate_up_proj"][k], t[p + "experts.down_proj"][k]
        return {"gate_proj.weight": gate_up[:width], "up_proj.weight": gate_up[width:], "down_proj.weight": down}
    if p + "experts.gate_proj" in t:
        def expert(w: torch.Tensor | BlockTensor) -> torch.Tensor | BlockTensor:
            if isinstance(w, BlockTensor):
                rows = w.shape[0] // count
                return w.rows(slice(k * rows, (k + 1) * rows))
            return w[k]
        return {f"{n}_proj.weight": expert(t[p + f"experts.{n}_proj"]) for n in ("gate", "up", "down")}
    e = p + f"experts.{k}."
    return {n: t[e + n] for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}


class Experts(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str):
        """p: the layer's `mlp.` prefix (per-expert tensors under `experts.E.`)."""
        super().__init__()
        e = self.config = c.experts
        self.router = Linear(t[p + "gate.weight"], None, dtype)
        self.experts = nn.ModuleList(MLP(c, expert_tensors(t, p, k, e.count, e.intermediate), "", dtype, e.intermediate)
                                     for k in range(e.count))
        self.shared_expert = MLP(c, t, p + "shared_expert.", dtype, e.shared_intermediate)
        self.shared_expert_gate = Linear(t[p + "shared_expert_gate.weight"], None, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, top_k] in x's dtype, experts [N, top_k])."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.config.top_k, dim=-1)
        if self.config.norm_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), chosen

    @functools.cached_property
    def kernel_weights(self) -> list[torch.Tensor | None]:
        """The linear layers' (weight, scale, bias) in the order tandem's experts_rows reads them."""
        layers = [self.router, self.shared_expert_gate, self.shared_expert.gate_up_proj, self.shared_expert.down_proj,
                  *(p for mlp in self.experts for p in (mlp.gate_up_proj, mlp.down_proj))]
        return [t for layer in layers for t in (layer.weight, layer.scale, layer.bias)]

    @functools.cached_property
    def kernel_rows(self) -> int:
        """Up to this many rows the kernel takes the experts: every one of its linear layers' kernel rows."""
        return min(m.max_kernel_rows for m in self.modules() if isinstance(m, Linear))

    @functools.cached_property
    def _format_layers(self) -> list[Linear]:
        """The linear layers whose formats stand for all (the routed experts share one format)."""
        return [self.router, self.shared_expert_gate, self.shared_expert.gate_up_proj, self.shared_expert.down_proj,
                *self.experts[0].children()]

    @property
    def q8_activations(self) -> bool:
        """Whether its block weights take 8-bit activations (engine/ops/quant.py use_activations sets
        every block layer of a model alike). Read every decode row: the layers are looked up once
        (through nn.Module's attribute lookup, 12 us a call)."""
        return any(m.q8_activations for m in self._format_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A few rows (decode, verify) in one kernel call: the same ops, without a dispatch from
        # Python for each (experts_rows).
        if x.dim() == 2 and x.shape[0] <= self.kernel_rows and kernels.usable(x):
            return kernels.experts_rows(x, self.kernel_weights, self.config.top_k, self.config.norm_top_k,
                                        self.q8_activations)
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        # The rows each expert takes, experts in index order (the reference's order of summation).
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.config.count).tolist()
        rows, slots = order // chosen.shape[1], order % chosen.shape[1]
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            r, s = rows[start:start + n], slots[start:start + n]
            start += n
            out.index_add_(0, r, self.experts[expert](x[r]) * weights[r, s, None])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
