"""QSA: query-aware sparse attention over pooled key blocks (docs/architecture.md, "The hybrid cache and QSA").

A QSA layer with compress ratio r and budget B groups positions into blocks of r (block b holds
positions b*r .. b*r+r-1). A query at position p sees the complete blocks before its own,
0 .. p//r - 1, and its own tail block, positions r*(p//r) .. p. While those complete blocks number at
most B/r it attends to every visible position: exactly dense attention. Beyond that, block b scores
s_b = sum over query heads h of relu(q_h . kpool[b, kv(h)]) / sqrt(head_dim), where kpool[b] is the
mean of the block's post-RoPE keys; the B/r best blocks are kept (ties to the lower index), and the
query attends the kept blocks' keys plus its tail block with an ordinary softmax.

Every layer carries its own `LayerSpec`; nothing looks a ratio up by layer index.
"""
from __future__ import annotations

import torch

from engine.model.layer_spec import LayerSpec


def block_means(keys: torch.Tensor, ratio: int) -> torch.Tensor:
    """Pooled keys of whole blocks: keys [kv_heads, n*ratio, d] -> [kv_heads, n, d] in f32."""
    kv_heads, length, d = keys.shape
    return keys.float().view(kv_heads, length // ratio, ratio, d).mean(2)


def select_blocks(q: torch.Tensor, kpool: torch.Tensor, positions: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """The blocks each query keeps, [T, keep], for queries q [T, heads, d] at `positions` [T] that
    all see more complete blocks than `spec.keep`; kpool [kv_heads, n, d] covers at least the
    blocks the last of them sees."""
    t, heads, d = q.shape
    kv_heads = kpool.shape[0]
    visible = positions // spec.ratio  # [T] complete blocks each query sees
    n = int(visible.max())
    qg = q.float().view(t, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("tkgd,kbd->tkgb", qg, kpool[:, :n]).relu().sum((1, 2)) * d ** -0.5  # [T, n]
    scores = scores.masked_fill(torch.arange(n, device=q.device) >= visible[:, None], -torch.inf)
    # A stable sort keeps equal scores in index order: ties go to the lower block.
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :spec.keep]


def allowed_keys(positions: torch.Tensor, length: int, kept: torch.Tensor | None, spec: LayerSpec,
                 base: torch.Tensor | None = None) -> torch.Tensor:
    """[T, length] bool: which key positions each query attends. kept: [T, keep] selected blocks
    of the queries past the budget (rows of queries within it are ignored), or None for none.
    base: [T, length] the keys each query could see in a dense layer, when not the causal ones (a
    tree row's mask, engine/model/batch.py: a node stands at `positions` but its own key lies at
    its scratch position past the chain)."""
    device = positions.device  # a stage's (engine/placement.py): every index made here lives there
    keys = torch.arange(length, device=device)
    seen = keys <= positions[:, None] if base is None else base
    if kept is None:
        return seen
    block = keys // spec.ratio  # [length]
    visible = positions // spec.ratio  # [T]
    chosen = torch.zeros(len(positions), int(visible.max()) + 1, dtype=torch.bool, device=device)
    chosen.scatter_(1, kept, True)
    chosen[torch.arange(len(positions), device=device), visible] = True  # the tail block
    # A query's own key stays wherever it was written: at its position (in its tail block), or
    # past the chain for a tree's sibling.
    own = keys >= positions[:, None]
    sparse = (chosen[:, block.clamp(max=chosen.shape[1] - 1)] | own) & seen
    return torch.where((visible > spec.keep)[:, None], sparse, seen)


def attended(q: torch.Tensor, kpool: torch.Tensor, positions: torch.Tensor, length: int,
             spec: LayerSpec, base: torch.Tensor | None = None) -> torch.Tensor:
    """[T, length] bool: the keys queries q [T, heads, d] standing at `positions` attend in a QSA
    layer, given pooled keys kpool [kv_heads, >= length//r, d]; base as allowed_keys takes it."""
    past = positions // spec.ratio > spec.keep
    if not bool(past.any()):
        return allowed_keys(positions, length, None, spec, base)
    kept = torch.zeros(len(positions), spec.keep, dtype=torch.long, device=q.device)
    kept[past] = select_blocks(q[past], kpool, positions[past], spec)
    return allowed_keys(positions, length, kept, spec, base)


def sparse_keys(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kpool: torch.Tensor,
                positions: torch.Tensor, spec: LayerSpec, mask: torch.Tensor | None = None):
    """What queries q [T, heads, d] standing at `positions` attend in a QSA layer, given a slot's
    keys and values [kv_heads, L, d] (L: past the last key written) and pooled keys kpool
    [kv_heads, >= L//r, d]: (keys, values, mask [T, L'] bool or None), ready for the layer's
    ordinary attention. mask: the row's dense mask [T, L] (causal or a tree's; None for one query,
    which sees 0 .. its position). Within the budget these are exactly the dense path's inputs."""
    if len(positions) > 1:
        return keys, values, attended(q, kpool, positions, keys.shape[1], spec, mask)
    p = int(positions[0])
    if p // spec.ratio <= spec.keep:
        return keys, values, None
    # One query: gather its kept blocks and tail, so the cost follows the budget, not L.
    blocks = select_blocks(q, kpool, positions, spec)[0].sort().values
    index = torch.cat([(blocks[:, None] * spec.ratio + torch.arange(spec.ratio, device=q.device)).flatten(),
                       torch.arange(p // spec.ratio * spec.ratio, p + 1, device=q.device)])
    return keys[:, index], values[:, index], None
