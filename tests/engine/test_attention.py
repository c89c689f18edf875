"""A chain's prompt chunk attends in two parts (engine/model/attention.py): the keys before it, which
every query sees, and its own, causally; merged by their log-sum-exps, it gives what one call under
the chunk's whole causal mask gives. A sparse query's selected keys are read where they lie
(attend_at), as a gathered copy would give them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import _prefix_then_causal
from engine.ops import kernels


@pytest.mark.parametrize("t, prefix, group", [(2, 1, 1), (16, 40, 3), (512, 700, 3), (33, 512, 4)])
def test_a_chunk_after_its_prefix_attends_as_under_its_whole_causal_mask(t, prefix, group):
    torch.manual_seed(t + prefix)
    kv_heads, d = 2, 64
    q = torch.randn(1, kv_heads, group * t, d)
    keys, values = torch.randn(1, kv_heads, prefix + t, d), torch.randn(1, kv_heads, prefix + t, d)
    mask = torch.ones(t, prefix + t, dtype=torch.bool).tril(prefix).repeat(group, 1)
    whole = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    parts = _prefix_then_causal(q, keys, values, prefix, group)
    assert parts.shape == whole.shape
    assert (parts - whole).abs().max() < 1e-5
    # A query sees no key past its own position: changing the chunk's later values leaves the
    # queries before them as they were.
    values[:, :, prefix + t // 2:] += 100
    moved = _prefix_then_causal(q, keys, values, prefix, group).view(1, kv_heads, group, t, d)
    assert torch.equal(moved[..., :t // 2, :], parts.view(1, kv_heads, group, t, d)[..., :t // 2, :])


@pytest.mark.parametrize("m, heads, kv_heads, d", [(1, 8, 2, 256), (300, 9, 3, 64), (2052, 8, 2, 256)])
def test_a_query_reads_its_selected_rows_in_place_as_from_a_gathered_copy(m, heads, kv_heads, d):
    # The rows, scattered over a larger store (a slot's, or a pool's through its pages) and more
    # than one span of 512 for the longest, in no particular order but the last the query's own.
    torch.manual_seed(m)
    store_k, store_v = torch.randn(2, kv_heads, 3 * m + 16, d).unbind(0)
    rows = torch.randperm(3 * m + 16)[:m]
    q = torch.randn(heads, d)
    keys, values = store_k.index_select(1, rows), store_v.index_select(1, rows)
    qg = q.view(kv_heads, heads // kv_heads, d)
    gathered = F.scaled_dot_product_attention(qg[None], keys[None], values[None])[0].reshape(heads, d)
    in_place = kernels.attend_at(q, store_k, store_v, rows, d ** -0.5)
    assert (in_place - gathered).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="outside"):
        kernels.attend_at(q, store_k, store_v, torch.tensor([3 * m + 16]), d ** -0.5)
