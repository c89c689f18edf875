"""Weights on huge pages: one 2 MiB-aligned block of memory holds every weight of a model.

Decode reads every weight once per step, so the whole model streams through the TLB: with 4 KiB
pages a 135M-parameter model spans tens of thousands of pages and the page walks cost 10-15% of a
step (measured on the default model, every format). Linux backs an anonymous mapping advised
MADV_HUGEPAGE with 2 MiB pages where transparent huge pages are enabled for it ("madvise" or
"always"); elsewhere the advice is ignored and the block is ordinary memory.
"""
from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def move_to_huge_pages(module: nn.Module, buffer_name: str = "weight") -> None:
    """Copies the `buffer_name` buffer of every submodule that has one in CPU memory into one block
    of memory on huge pages, replacing the buffer by a view of the block (same values, same dtype).
    Buffers on other devices (a stage's, engine/placement.py) stay where they are."""
    owners = [m for m in module.modules()
              if m._buffers.get(buffer_name) is not None and m._buffers[buffer_name].is_cpu]
    total = sum(_padded(m._buffers[buffer_name].nbytes) for m in owners)
    if total < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    # Private and anonymous: a shared mapping would be shmem, which transparent huge pages skip.
    block = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(block, dtype=torch.uint8)  # keeps the mapping alive
    offset = -memory.data_ptr() % HUGE_PAGE
    for m in owners:
        weight = m._buffers[buffer_name]
        view = memory[offset:offset + weight.nbytes].view(weight.dtype).view(weight.shape)
        view.copy_(weight)
        m._buffers[buffer_name] = view
        offset += _padded(weight.nbytes)
