"""Weights and caches on huge pages: one 2 MiB-aligned block of memory holds every weight of a
model, and each cache tensor of 2 MiB or more gets one of its own (`zeros`).

Decode reads every weight once per step, so the whole model streams through the TLB: with 4 KiB
pages a 135M-parameter model spans tens of thousands of pages and the page walks cost 10-15% of a
step (measured on the default model, every format). A QSA query reads its selected blocks of the
KV cache where they lie, 4 KiB runs: on 4 KiB pages each run is a page walk of its own (one query's
~2,050 selected rows of 2 kv heads of 256, cold: 0.43-0.59 ms on huge pages against 0.53-0.63; the
dense query over all 16,385 rows 2.5-3.3 against 2.7-3.4; Zen 4). Linux backs an anonymous mapping
advised MADV_HUGEPAGE with 2 MiB pages where transparent huge pages are enabled for it ("madvise"
or "always"); elsewhere the advice is ignored and the block is ordinary memory.
"""
from __future__ import annotations

import math
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _huge_block(nbytes: int) -> torch.Tensor:
    """nbytes of zeros, uint8, starting on a 2 MiB boundary of a mapping advised for huge pages."""
    # Private and anonymous: a shared mapping would be shmem, which transparent huge pages skip.
    block = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(block, dtype=torch.uint8)  # keeps the mapping alive
    offset = -memory.data_ptr() % HUGE_PAGE
    return memory[offset:offset + nbytes]


def zeros(shape, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape), on huge pages when it lies in CPU memory and spans at least one (a smaller
    one would take a whole huge page once touched)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return _huge_block(nbytes).view(dtype).view(shape)


def move_to_huge_pages(module: nn.Module, buffer_name: str = "weight") -> None:
    """Copies the `buffer_name` buffer of every submodule that has one in CPU memory into one block
    of memory on huge pages, replacing the buffer by a view of the block (same values, same dtype).
    Buffers on other devices (a stage's, engine/placement.py) stay where they are."""
    owners = [m for m in module.modules()
              if m._buffers.get(buffer_name) is not None and m._buffers[buffer_name].is_cpu]
    total = sum(_padded(m._buffers[buffer_name].nbytes) for m in owners)
    if total < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    memory, offset = _huge_block(total), 0
    for m in owners:
        weight = m._buffers[buffer_name]
        view = memory[offset:offset + weight.nbytes].view(weight.dtype).view(weight.shape)
        view.copy_(weight)
        m._buffers[buffer_name] = view
        offset += _padded(weight.nbytes)
