"""QSA: query-aware sparse attention over block keys (docs/architecture.md, "The hybrid cache and QSA").

One rule for every QSA layer, whatever gives its block keys (a model's own indexer,
engine/model/indexer.py, or the mean of the block's post-RoPE attention keys on a model without
one). A layer with compress ratio r and budget B groups positions into blocks of r. A query at p sees
n = (p+1) // r complete blocks and a tail, positions n*r .. p, empty at a block's end: the query's
own token then competes in its block. Block b scores sum over query heads h of
relu(q_h . kblock[b, kv(h)]) / sqrt(head_dim); the query attends the positions of its top
min(B/r, n) blocks (torch.topk over exactly its n scores) and its tail, with an ordinary softmax.
While n <= B/r that is every position: exactly dense attention.

Every layer carries its own `LayerSpec`; nothing looks a ratio up by layer index.
"""
from __future__ import annotations

import math

import torch

from engine.ops import kernels


def block_means(keys: torch.Tensor, ratio: int) -> torch.Tensor:
    """Pooled keys of whole blocks: keys [kv_heads, n*ratio, d] -> [kv_heads, n, d] in f32."""
    kv_heads, length, d = keys.shape
    return keys.float().view(kv_heads, length // ratio, ratio, d).mean(2)


def complete_blocks(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """[T] the complete blocks a query at each position sees."""
    return (positions + 1) // ratio


def scores(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[T, n] each query's block scores: q [T, heads, d], block keys blocks [kv_heads, n, d] (one
    kv head: an indexer's, shared by all its query heads)."""
    if kernels.usable(q):  # the same numbers for a query whatever rows share the call
        return kernels.block_scores(q, blocks)
    # One query at a time, as the kernel's own portable path: a batched product's additions follow
    # its shape, so a query beside others (a verify block) could score other bits than alone (its
    # decode row) and select another block at a near-tie.
    t, heads, d = q.shape
    kv_heads, keys = blocks.shape[0], blocks.float()
    qg = q.float().view(t, kv_heads, heads // kv_heads, d)
    return torch.stack([torch.einsum("kgd,kbd->kgb", one, keys).relu().sum((0, 1)) for one in qg]) / math.sqrt(d)


def allowed(block_scores: torch.Tensor, positions: torch.Tensor, length: int, ratio: int, keep: int,
            base: torch.Tensor | None = None) -> torch.Tensor:
    """[T, length] bool: the keys queries standing at `positions` attend, given their scores
    [T, >= the last one's complete blocks] (columns past a query's own complete blocks unread).
    base: [T, length] the keys each query could see in a dense layer, when not the causal ones (a
    tree row's mask, engine/model/batch.py: a sibling stands at its position but its own key lies at
    its scratch position past the chain; that key counts in the sibling's own block)."""
    device = positions.device  # a stage's (engine/placement.py): every index made here lives there
    keys = torch.arange(length, device=device)
    seen = keys <= positions[:, None] if base is None else base
    complete = complete_blocks(positions, ratio)
    n = int(complete.max())
    if n <= keep:
        return seen
    rows = torch.arange(len(positions), device=device)
    chosen = torch.zeros(len(positions), n + 1, dtype=torch.bool, device=device)
    # Queries seeing as many blocks share one topk over exactly their n scores: the reference's
    # order among ties (relu makes exact zeros).
    for count in complete.unique().tolist():
        same = (complete == count).nonzero()[:, 0]
        if count <= keep:
            chosen[same, :count] = True
        else:
            chosen[same[:, None], block_scores[same, :count].topk(keep, dim=-1).indices] = True
    chosen[rows, complete] = True  # the tail
    own = chosen[rows, positions // ratio]  # [T] whether a query's own block is attended
    return torch.where(keys > positions[:, None], own[:, None], chosen[:, (keys // ratio).clamp(max=n)]) & seen


def attended(block_scores: torch.Tensor, position: int, ratio: int, keep: int) -> torch.Tensor:
    """[k] ascending: the positions a lone query at `position` attends once it sees more than `keep`
    complete blocks, given its scores [1, >= its complete blocks]: `allowed`'s one row as indices,
    the same topk over the same scores, without building and scanning a mask of the whole context
    (a decode row at 16k positions: about 0.25 ms a layer less)."""
    n = (position + 1) // ratio
    top = block_scores[:, :n].topk(keep, dim=-1).indices[0].sort().values
    device = block_scores.device
    chosen = (top[:, None] * ratio + torch.arange(ratio, device=device)).flatten()
    return torch.cat([chosen, torch.arange(n * ratio, position + 1, device=device)])  # then the tail


def pooled_scores(q: torch.Tensor, kpool: torch.Tensor, positions: torch.Tensor, written: torch.Tensor,
                  ratio: int, read_keys) -> torch.Tensor:
    """[T, n] scores of queries q [T, heads, d] at `positions` over pooled attention keys kpool
    [kv_heads, n, d], n at least the last query's complete blocks. A tree's sibling whose position ends a
    block (its key `written` past the chain, not at its position) pools that block with its own key
    in place of the chain's, as the chain would had it drawn the sibling: read_keys(index [m]) gives
    the slot's keys there, [kv_heads, m, d]."""
    complete = complete_blocks(positions, ratio)
    block_scores = scores(q, kpool)
    sibling = ((written != positions) & ((positions + 1) % ratio == 0)).nonzero()[:, 0]
    if len(sibling):
        first = positions[sibling] - ratio + 1
        index = torch.cat([first[:, None] + torch.arange(ratio - 1, device=q.device), written[sibling, None]], 1)
        own = read_keys(index.flatten()).float().unflatten(1, index.shape).mean(2)  # [kv_heads, m, d]
        block_scores[sibling, complete[sibling] - 1] = scores(q[sibling], own).diagonal()
    return block_scores
