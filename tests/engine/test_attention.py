"""A chain's prompt chunk attends in two parts (engine/model/attention.py): the keys before it, which
every query sees, and its own, causally; merged by their log-sum-exps, it gives what one call under
the chunk's whole causal mask gives."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import _prefix_then_causal


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
