"""The KV cache: preallocated per layer and slot, written in place, never reallocated."""
from __future__ import annotations

import torch

KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class KVCache:
    """K and V for every layer, slot and position up to ctx_per_slot.

    Storage per layer is [slots, kv_heads, ctx, head_dim], so one slot's keys for one head are
    contiguous and a slot's prefix is a view, never a copy.
    """

    def __init__(self, num_layers: int, num_slots: int, ctx_per_slot: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        shape = (num_slots, kv_heads, ctx_per_slot, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.ctx_per_slot = ctx_per_slot

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, T, head_dim] for positions start .. start+T-1 of the slot."""
        end = start + k.shape[1]
        self.k[layer][slot, :, start:end] = k
        self.v[layer][slot, :, start:end] = v

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [kv_heads, length, head_dim] of the slot's first `length` positions."""
        return self.k[layer][slot, :, :length], self.v[layer][slot, :, :length]
