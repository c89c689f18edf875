"""The KV cache: preallocated, written in place, never reallocated.

Two layouts behind one interface (`write`, `read`, `read_at`, `read_pool`, `ensure`, `truncate`), the one
model.py uses:
- `KVCache`: each slot owns ctx_per_slot positions (llama-server's default split of --ctx-size);
- `PagedKVCache`: one pool of positions in pages that any slot may use (--kv-unified).
Either stores floats, or q8_0 (`Q8Storage`: int8 with one scale per block of 32 values).

Each layer's storage follows its LayerSpec: a dense layer keeps K and V; a QSA layer also keeps
`kpool`, one f32 pooled key per block of `ratio` positions (engine/model/qsa.py), which a write recomputes
for every block whose last position it writes. Positions are written in order from a slot's
committed length, so that rule keeps each complete block's entry equal to the mean of its current
keys, through prompt chunks ending mid-block and drafts rejected and rewritten.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from engine.files.model_config import ModelConfig
from engine.model.layer_spec import DENSE, LayerSpec
from engine.model.qsa import block_means
from engine.model.recurrent_cache import RecurrentCache
from engine.ops import arena
from engine.settings import PAGE_SIZE, EngineConfig

# q8_0 is named by torch.int8 here; the cache stores it as Q8Storage, which reads back as float32.
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": torch.int8}
Q8_BLOCK = 32
# What one cached value costs: q8_0 holds an int8 and one f16 scale per block of 32.
KV_BYTES_PER_VALUE = {d: (1 + 2 / Q8_BLOCK if d == "q8_0" else t.itemsize) for d, t in KV_DTYPES.items()}


class Q8Storage:
    """q8_0 along the last axis (head_dim): int8 values and one f16 scale per block of 32 (one
    block per vector when head_dim is not a multiple of 32). Indexed like the float tensor it
    replaces: writes quantize, reads return float32 copies. `dtype` is what writers should pass
    (float32), so model code that casts to the cache's dtype keeps working unchanged."""

    dtype = torch.float32

    def __init__(self, shape: tuple[int, ...], device: torch.device | str = "cpu"):
        head_dim = shape[-1]
        self.block = Q8_BLOCK if head_dim % Q8_BLOCK == 0 else head_dim
        self.q = arena.zeros(shape, torch.int8, device)
        self.scale = arena.zeros((*shape[:-1], head_dim // self.block), torch.float16, device)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scale.numel()

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = x.float().unflatten(-1, (-1, self.block))  # [..., n_blocks, block]
        scale = (blocks.abs().amax(-1) / 127.0).half()
        inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return q.flatten(-2), scale

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (q.unflatten(-1, (-1, self.block)).float() * scale.float()[..., None]).flatten(-2)

    def __setitem__(self, index, value: torch.Tensor) -> None:
        self.q[index], self.scale[index] = self._quantize(value)

    def __getitem__(self, index) -> torch.Tensor:
        return self._dequantize(self.q[index], self.scale[index])

    def index_copy_(self, dim: int, rows: torch.Tensor, value: torch.Tensor) -> None:
        q, scale = self._quantize(value)
        self.q.index_copy_(dim, rows, q)
        self.scale.index_copy_(dim, rows, scale)

    def index_select(self, dim: int, rows: torch.Tensor) -> torch.Tensor:
        return self._dequantize(self.q.index_select(dim, rows), self.scale.index_select(dim, rows))


class KernelView(NamedTuple):
    """A layer's storage as tandem's attention kernels read it in place (engine/ops/kernels.py)."""
    k: torch.Tensor  # [S, kv_heads, ctx, head_dim], or a unified pool's [1, kv_heads, pool positions, head_dim]
    v: torch.Tensor
    kpool: torch.Tensor | None  # a QSA layer's pooled keys, [S or 1, kv_heads, positions // ratio, head_dim] f32
    pages: torch.Tensor | None  # a unified pool's page table, [slots, pages] int64 (None: slot-major)
    k_scale: torch.Tensor | None = None  # a q8_0 layer's scales, [..., head_dim // block] f16 (k, v: its int8)
    v_scale: torch.Tensor | None = None


def _kernel_view(k, v, kpool, pages, dtype: torch.dtype) -> KernelView | None:
    """K and V as the kernels read them, floats of `dtype` or q8_0 on both with f32 rows (None
    otherwise); a unified pool's (pages given) with a slot axis of 1, a slot-major cache's as
    stored (no view made per step)."""
    as_slots = (lambda t: t[None]) if pages is not None else (lambda t: t)
    kpool = None if kpool is None else as_slots(kpool)
    if isinstance(k, Q8Storage) and isinstance(v, Q8Storage) and dtype == torch.float32:
        return KernelView(as_slots(k.q), as_slots(v.q), kpool, pages, as_slots(k.scale), as_slots(v.scale))
    if _holds(k, v, dtype):
        return KernelView(as_slots(k), as_slots(v), kpool, pages)
    return None


def _holds(k, v, dtype: torch.dtype) -> bool:
    """Whether a layer's K and V both hold floats of `dtype` (not q8_0)."""
    return all(isinstance(t, torch.Tensor) and t.dtype == dtype for t in (k, v))


def _copy(store, dst, src) -> None:
    """store[dst] = store[src], as stored: q8_0 blocks are copied, never quantized again."""
    for t in (store.q, store.scale) if isinstance(store, Q8Storage) else (store,):
        t[dst] = t[src]


def _slot_rows(store, slot: int, positions: torch.Tensor) -> torch.Tensor:
    """A per-slot store's [kv_heads, len(positions), head_dim] at the slot's `positions`, reading
    (and for q8_0 widening) only those."""
    if isinstance(store, Q8Storage):
        return store._dequantize(store.q[slot].index_select(1, positions), store.scale[slot].index_select(1, positions))
    return store[slot].index_select(1, positions)


def _storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | Q8Storage:
    return Q8Storage(shape, device) if dtype == torch.int8 else arena.zeros(shape, dtype, device)


def _nbytes(stores) -> int:
    return sum(s.nbytes if isinstance(s, Q8Storage) else s.numel() * s.element_size() for s in stores if s is not None)


def _attention_storage(specs, devices, make) -> list:
    """make(device) for each attention layer, None for a recurrent one (its state lives in the
    RecurrentCache)."""
    return [None if spec.is_recurrent else make(device) for spec, device in zip(specs, devices)]


def _pools_keys(spec: LayerSpec) -> bool:
    """Whether the layer keeps tandem's pooled attention keys (a QSA layer without its model's indexer)."""
    return spec.is_qsa and not spec.index_dim


def _specs(specs: Sequence[LayerSpec] | None, num_layers: int) -> list[LayerSpec]:
    specs = list(specs) if specs is not None else [DENSE] * num_layers
    assert len(specs) == num_layers, f"{len(specs)} layer specs for {num_layers} layers"
    return specs


def _devices(devices: Sequence[torch.device | str] | None, num_layers: int) -> list[torch.device]:
    devices = [torch.device(d) for d in devices] if devices is not None else [torch.device("cpu")] * num_layers
    assert len(devices) == num_layers, f"{len(devices)} layer devices for {num_layers} layers"
    return devices


class _Stores:
    """What both layouts hold per layer: K and V (floats or Q8Storage), and a QSA layer's kpool; and,
    for a model with linear-attention layers, their states (`recurrent`, per slot, not per position)."""
    k: list
    v: list
    kpool: list
    recurrent: RecurrentCache | None = None

    def _index_stores(self, rows: int) -> None:
        """An indexed QSA layer's raw indexer keys, [rows, index_dim] f32 by the flat position row
        `_rows` gives, and its block keys, [rows // ratio, index_dim] by a block's first row // ratio;
        None for other layers."""
        self.ikeys = [arena.zeros((rows, spec.index_dim), device=device) if spec.index_dim else None
                      for spec, device in zip(self.specs, self.devices)]
        self.iblocks = [arena.zeros((rows // spec.ratio, spec.index_dim), device=device) if spec.index_dim else None
                        for spec, device in zip(self.specs, self.devices)]

    def write_index_keys(self, layer: int, slot: int, start: int, keys: torch.Tensor) -> None:
        """Raw indexer keys [T, index_dim] of positions start .. start+T-1 of the slot."""
        self.ikeys[layer][self._rows(slot, start, start + keys.shape[0])] = keys.float()

    def read_index_keys(self, layer: int, slot: int, start: int, end: int) -> torch.Tensor:
        return self.ikeys[layer][self._rows(slot, start, end)]

    def write_index_blocks(self, layer: int, slot: int, first: int, keys: torch.Tensor) -> None:
        """Block keys [B, index_dim] of the slot's blocks first .. first+B-1."""
        self.iblocks[layer][self._block_rows(layer, slot, first, first + keys.shape[0])] = keys.float()

    def read_index_blocks(self, layer: int, slot: int, blocks: int) -> torch.Tensor:
        """[blocks, index_dim]: the slot's first block keys; a view where the slot's rows are
        contiguous (a gathered copy of 4,096 blocks took 0.3 ms a decode row)."""
        first = self._first_row(slot)
        if first is not None:  # block b's row is (first + b * ratio) // ratio
            start = first // self.specs[layer].ratio
            return self.iblocks[layer][start:start + blocks]
        return self.iblocks[layer][self._block_rows(layer, slot, 0, blocks)]

    def _block_rows(self, layer: int, slot: int, first: int, last: int) -> torch.Tensor:
        r = self.specs[layer].ratio
        return self._rows(slot, first * r, last * r)[::r] // r

    def reusable(self, slot: int, length: int, with_hidden: bool = False) -> int:
        """The longest prefix of the slot, at most `length`, a request can resume from: any length
        for K/V; for a recurrent model one whose state the slot holds (RecurrentCache.reusable)."""
        return length if self.recurrent is None else self.recurrent.reusable(slot, length, with_hidden)

    def checkpoint(self, slot: int, length: int, hidden=None) -> None:
        """A recurrent model keeps the slot's state after `length` positions (a prompt's or an
        answer's end) for a next request that shares them; nothing to keep for K/V alone."""
        if self.recurrent is not None:
            self.recurrent.checkpoint(slot, length, hidden)

    def snapshot_hidden(self, slot: int, length: int):
        """The target's hidden state at position length-1 a recurrent model's snapshot kept, or None."""
        return None if self.recurrent is None else self.recurrent.snapshot_hidden(slot, length)

    def begin_rows(self, rows) -> None:
        """A forward is about to write the rows' positions (each a Row of engine/model/batch.py)."""
        if self.recurrent is not None:
            for row in rows:
                self.recurrent.begin(row.slot, row.start, len(row.tokens))

    def end_rows(self, rows) -> None:
        """The forward wrote them: the recurrent states it kept are there to resume from."""
        if self.recurrent is not None:
            for row in rows:
                self.recurrent.record(row.slot, row.start, len(row.tokens))

    def move(self, slot: int, src: int, dst: int) -> None:
        """Position src's K and V to position dst of the slot, in every layer: an accepted tree
        node's, from its scratch position down to the committed one. As a write there would, it
        recomputes a QSA layer's pooled key of the block dst ends (a later block is recomputed when
        the positions after dst are written)."""
        a, b = self._at(slot, dst), self._at(slot, src)
        for stores in (self.k, self.v):
            for store in stores:
                if store is not None:
                    _copy(store, a, b)
        for layer, spec in enumerate(self.specs):
            if _pools_keys(spec) and (dst + 1) % spec.ratio == 0:
                self._pool_blocks(layer, slot, dst, dst + 1)

    @property
    def nbytes(self) -> int:
        """K and V (the pooled keys and recurrent states are counted apart)."""
        return _nbytes(self.k + self.v)

    @property
    def recurrent_nbytes(self) -> int:
        return self.recurrent.nbytes if self.recurrent is not None else 0

    @property
    def kpool_nbytes(self) -> int:
        """QSA layers' keys beside K/V: tandem's pooled keys, or an indexer's raw and block keys."""
        return _nbytes(self.kpool + self.ikeys + self.iblocks)

    def layer_nbytes(self, layer: int) -> int:
        """The layer's K, V and QSA keys (a recurrent layer's states are the RecurrentCache's)."""
        return _nbytes([self.k[layer], self.v[layer], self.kpool[layer], self.ikeys[layer], self.iblocks[layer]])


class KVCache(_Stores):
    """K and V for every layer, slot and position up to ctx_per_slot.

    Storage per layer is [slots, kv_heads, ctx, head_dim], so one slot's keys for one head are
    contiguous and a slot's prefix is a view, never a copy.
    """

    def __init__(self, num_layers: int, num_slots: int, ctx_per_slot: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, v_dtype: torch.dtype | None = None,
                 specs: Sequence[LayerSpec] | None = None, devices: Sequence[torch.device | str] | None = None):
        """specs, devices: each layer's (default: all dense, all on the CPU)."""
        shape = (num_slots, kv_heads, ctx_per_slot, head_dim)
        self.specs = _specs(specs, num_layers)
        self.devices = _devices(devices, num_layers)
        self.k = _attention_storage(self.specs, self.devices, lambda device: _storage(shape, dtype, device))
        self.v = _attention_storage(self.specs, self.devices, lambda device: _storage(shape, v_dtype or dtype, device))
        # [slots, kv_heads, ctx // ratio, head_dim] f32 for a QSA layer; None for a dense one.
        self.kpool = [torch.zeros(num_slots, kv_heads, ctx_per_slot // spec.ratio, head_dim, device=device)
                      if _pools_keys(spec) else None for spec, device in zip(self.specs, self.devices)]
        self.num_slots = num_slots
        self.ctx_per_slot = ctx_per_slot
        self._index_stores(num_slots * ctx_per_slot)

    @property
    def capacity(self) -> int:
        return self.num_slots * self.ctx_per_slot

    def _rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Flat rows (slot-major) of the slot's positions start .. end-1."""
        return slot * self.ctx_per_slot + torch.arange(start, end)

    def _first_row(self, slot: int) -> int:
        """The flat row of the slot's position 0; the others follow it."""
        return slot * self.ctx_per_slot

    def _at(self, slot: int, position: int) -> tuple:
        """The index of a slot's position in every layer's storage."""
        return slot, slice(None), position

    def ensure(self, slot: int, length: int) -> bool:
        """Whether the slot can hold `length` positions (room is reserved here when it is shared)."""
        return length <= self.ctx_per_slot

    def truncate(self, slot: int, length: int) -> None:
        """The slot keeps only its first `length` positions (its room is its own; a recurrent model's
        state is set back to that length's, RecurrentCache.truncate)."""
        if self.recurrent is not None:
            self.recurrent.truncate(slot, length)

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, T, head_dim] for positions start .. start+T-1 of the slot."""
        end = start + k.shape[1]
        self.k[layer][slot, :, start:end] = k
        self.v[layer][slot, :, start:end] = v
        if self.kpool[layer] is not None:
            self._pool_blocks(layer, slot, start, end)

    def _pool_blocks(self, layer: int, slot: int, start: int, end: int) -> None:
        """Recompute the pooled keys of the blocks whose last position lies in start .. end-1."""
        r = self.specs[layer].ratio
        first, last = start // r, end // r
        if last > first:
            self.kpool[layer][slot, :, first:last] = block_means(self.k[layer][slot, :, first * r:last * r], r)

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [kv_heads, length, head_dim] of the slot's first `length` positions."""
        return self.k[layer][slot, :, :length], self.v[layer][slot, :, :length]

    def read_pool(self, layer: int, slot: int, blocks: int) -> torch.Tensor:
        """[kv_heads, blocks, head_dim] f32: the slot's first pooled keys (a QSA layer's)."""
        return self.kpool[layer][slot, :, :blocks]

    def read_at(self, layer: int, slot: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, len(positions), head_dim]: the slot's keys and values at `positions` alone
        (a sparse query's), copied from storage without reading the rest."""
        positions = positions.to(self.devices[layer])
        return _slot_rows(self.k[layer], slot, positions), _slot_rows(self.v[layer], slot, positions)

    def kernel_view(self, layer: int, dtype: torch.dtype) -> KernelView | None:
        """The layer's storage when K and V hold floats of `dtype` or both q8_0 for f32 rows (the
        kernels then read it in place); None when they do not."""
        return _kernel_view(self.k[layer], self.v[layer], self.kpool[layer], None, dtype)

    def rows_at(self, layer: int, slot: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple | None:
        """(K, V [kv_heads, rows, head_dim], the rows of the slot's `positions` in them): where a
        sparse query's keys lie, for a kernel to read in place; None unless both hold `dtype`."""
        k, v = self.k[layer], self.v[layer]
        return (k[slot], v[slot], positions) if _holds(k, v, dtype) else None

    def write_tokens(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """One token per row: k, v [R, kv_heads, head_dim] at positions[r] of slots[r]."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v
        if self.kpool[layer] is not None:
            ends = (positions + 1) % self.specs[layer].ratio == 0  # rows that complete a block
            for slot, position in zip(slots[ends].tolist(), positions[ends].tolist()):
                self._pool_blocks(layer, slot, position, position + 1)


class PagePool:
    """Which pages of a shared pool each slot holds, in position order. Pure bookkeeping."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.page_size = page_size
        self.free: list[int] = list(range(num_pages))  # kept sorted: low pages first
        self.pages: list[list[int]] = [[] for _ in range(num_slots)]

    @property
    def num_free(self) -> int:
        return len(self.free)

    def pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def ensure(self, slot: int, length: int) -> bool:
        """Give the slot pages for `length` positions; False (and nothing taken) when too few are free."""
        need = self.pages_for(length) - len(self.pages[slot])
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            self.pages[slot].append(self._take_after(self.pages[slot][-1] if self.pages[slot] else None))
        return True

    def truncate(self, slot: int, length: int) -> None:
        keep = self.pages_for(length)
        released, self.pages[slot] = self.pages[slot][keep:], self.pages[slot][:keep]
        if released:
            self.free = sorted(self.free + released)

    def _take_after(self, last: int | None) -> int:
        # The page right after the slot's last one keeps its positions contiguous (a view, no gather).
        if last is not None and last + 1 in self.free:
            self.free.remove(last + 1)
            return last + 1
        return self.free.pop(0)


class PagedKVCache(_Stores):
    """One pool of positions shared by all slots (--kv-unified). Storage per layer is
    [kv_heads, pool positions, head_dim]; a slot's positions live in the pages it holds."""

    def __init__(self, num_layers: int, num_slots: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, v_dtype: torch.dtype | None = None,
                 specs: Sequence[LayerSpec] | None = None, devices: Sequence[torch.device | str] | None = None):
        """specs, devices: each layer's (default: all dense, all on the CPU); a QSA layer's ratio
        divides PAGE_SIZE, so blocks never straddle pages."""
        num_pages = capacity // PAGE_SIZE
        shape = (kv_heads, num_pages * PAGE_SIZE, head_dim)
        self.specs = _specs(specs, num_layers)
        assert all(PAGE_SIZE % spec.ratio == 0 for spec in self.specs if spec.is_qsa)
        self.devices = _devices(devices, num_layers)
        self.k = _attention_storage(self.specs, self.devices, lambda device: _storage(shape, dtype, device))
        self.v = _attention_storage(self.specs, self.devices, lambda device: _storage(shape, v_dtype or dtype, device))
        # [kv_heads, pool positions // ratio, head_dim] f32, indexed by pool row // ratio (QSA layers).
        self.kpool = [torch.zeros(kv_heads, shape[1] // spec.ratio, head_dim, device=device) if _pools_keys(spec)
                      else None for spec, device in zip(self.specs, self.devices)]
        self.pool = PagePool(num_pages, PAGE_SIZE, num_slots)
        self.num_slots = num_slots
        self.ctx_per_slot = num_pages * PAGE_SIZE  # any one slot may fill the whole pool
        self._index = [torch.empty(0, dtype=torch.long) for _ in range(num_slots)]  # position -> pool row
        self._base: list[int | None] = [None] * num_slots  # first pool row when the pages are contiguous
        # The kernels' page table: row s's first len(pool.pages[s]) entries are slot s's pages.
        self.page_table = torch.zeros(num_slots, num_pages, dtype=torch.long)
        self._index_stores(num_pages * PAGE_SIZE)

    def _rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Pool rows of the slot's positions start .. end-1 (reserved by ensure)."""
        return self._index[slot][start:end]

    def _first_row(self, slot: int) -> int | None:
        """The pool row of the slot's position 0 when its pages are contiguous (the others then
        follow it); None when they are not."""
        return self._base[slot]

    @property
    def capacity(self) -> int:
        return self.ctx_per_slot

    def ensure(self, slot: int, length: int) -> bool:
        before = len(self.pool.pages[slot])
        ok = self.pool.ensure(slot, length)
        if len(self.pool.pages[slot]) != before:
            self._reindex(slot)
        return ok

    def truncate(self, slot: int, length: int) -> None:
        before = len(self.pool.pages[slot])
        self.pool.truncate(slot, length)
        if len(self.pool.pages[slot]) != before:
            self._reindex(slot)
        if self.recurrent is not None:
            self.recurrent.truncate(slot, length)

    def _at(self, slot: int, position: int) -> tuple:
        return slice(None), int(self._index[slot][position])

    def _reindex(self, slot: int) -> None:
        pages = torch.tensor(self.pool.pages[slot], dtype=torch.long)
        self.page_table[slot, :len(pages)] = pages
        self._index[slot] = (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()
        contiguous = bool(len(pages)) and bool((pages == pages[0] + torch.arange(len(pages))).all())
        self._base[slot] = int(pages[0]) * PAGE_SIZE if contiguous else None

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, T, head_dim] for positions start .. start+T-1 of the slot (reserved by ensure)."""
        end, base = start + k.shape[1], self._base[slot]
        if base is not None:
            self.k[layer][:, base + start:base + end] = k
            self.v[layer][:, base + start:base + end] = v
        else:
            rows = self._index[slot][start:end].to(self.devices[layer])
            self.k[layer].index_copy_(1, rows, k.to(self.k[layer].dtype))
            self.v[layer].index_copy_(1, rows, v.to(self.v[layer].dtype))
        if self.kpool[layer] is not None:
            self._pool_blocks(layer, slot, start, end)

    def _pool_blocks(self, layer: int, slot: int, start: int, end: int) -> None:
        """Recompute the pooled keys of the slot's blocks whose last position lies in start .. end-1."""
        r, base = self.specs[layer].ratio, self._base[slot]
        first, last = start // r, end // r
        if last > first and base is not None:  # a page starts on a block: base // r is the pool row
            self.kpool[layer][:, base // r + first:base // r + last] = \
                block_means(self.k[layer][:, base + first * r:base + last * r], r)
        elif last > first:
            keys = self.k[layer].index_select(1, self._index[slot][first * r:last * r].to(self.devices[layer]))
            self.kpool[layer].index_copy_(1, self._pool_rows(layer, slot, first, last), block_means(keys, r))

    def _pool_rows(self, layer: int, slot: int, first: int, last: int) -> torch.Tensor:
        """Pool-block indices of the slot's blocks first .. last-1 of the layer, on its device (a
        block lies in one page)."""
        ratio = self.specs[layer].ratio
        return (self._index[slot][torch.arange(first, last) * ratio] // ratio).to(self.devices[layer])

    def read_pool(self, layer: int, slot: int, blocks: int) -> torch.Tensor:
        """[kv_heads, blocks, head_dim] f32: the slot's first pooled keys (a QSA layer's); a view when
        the slot's pages are contiguous, as `read` gives."""
        base = self._base[slot]
        if base is not None:
            r = self.specs[layer].ratio
            return self.kpool[layer][:, base // r:base // r + blocks]
        return self.kpool[layer].index_select(1, self._pool_rows(layer, slot, 0, blocks))

    def kernel_view(self, layer: int, dtype: torch.dtype) -> KernelView | None:
        """The pool as one slot of the kernels' layout, read through the page table, when K and V
        hold floats of `dtype` or both q8_0 for f32 rows; None when they do not."""
        return _kernel_view(self.k[layer], self.v[layer], self.kpool[layer], self.page_table, dtype)

    def write_tokens(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """One token per row: k, v [R, kv_heads, head_dim] at positions[r] of slots[r] (reserved)."""
        rows = self.page_table[slots, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        self.k[layer][:, rows] = k.transpose(0, 1)
        self.v[layer][:, rows] = v.transpose(0, 1)
        if self.kpool[layer] is not None:
            ends = (positions + 1) % self.specs[layer].ratio == 0  # rows that complete a block
            for slot, position in zip(slots[ends].tolist(), positions[ends].tolist()):
                self._pool_blocks(layer, slot, position, position + 1)

    def read_at(self, layer: int, slot: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._index[slot][positions].to(self.devices[layer])
        return self.k[layer].index_select(1, rows), self.v[layer].index_select(1, rows)

    def rows_at(self, layer: int, slot: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple | None:
        k, v = self.k[layer], self.v[layer]
        return (k, v, self._index[slot][positions]) if _holds(k, v, dtype) else None

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, length, head_dim]: a view when the slot's pages are contiguous, else a gather."""
        base = self._base[slot]
        if base is not None:
            return self.k[layer][:, base:base + length], self.v[layer][:, base:base + length]
        rows = self._index[slot][:length].to(self.devices[layer])
        return self.k[layer].index_select(1, rows), self.v[layer].index_select(1, rows)


def cache_for(config: EngineConfig, model: ModelConfig, specs: Sequence[LayerSpec], devices: Sequence[str],
              layers: Sequence[int] | None = None) -> KVCache:
    """The cache an engine's config asks for, one layer per spec on its device: per-slot, or one
    unified pool (kv_unified); K and V in config.kv_types; the recurrent layers' states per slot,
    as many positions' as the longest row a step writes token by token (a verify row). layers: the
    model's indices of the specs' layers (a pipeline stage's), default 0.. ."""
    kv = tuple(KV_DTYPES[t] for t in config.kv_types)
    if config.kv_unified:
        cache = PagedKVCache(len(specs), config.parallel, config.ctx_size, model.num_kv_heads, model.head_dim, *kv,
                             specs=specs, devices=devices)
    else:
        cache = KVCache(len(specs), config.parallel, config.ctx_per_slot, model.num_kv_heads, model.head_dim, *kv,
                        specs=specs, devices=devices)
    if model.linear is not None:
        cache.recurrent = recurrent_cache(model, specs, devices, config.parallel, config.state_steps, layers)
    return cache


def model_cache(model: ModelConfig, specs: Sequence[LayerSpec], slots: int, positions: int, steps: int = 1,
                dtype: torch.dtype = torch.float32, device: str = "cpu") -> KVCache:
    """A per-slot cache on `device` for a model's layers (`specs`): K/V for its attention layers, and
    its recurrent layers' states (`steps` positions' per slot) when it has any. For a draft model's
    cache, and a model's built by hand (tests)."""
    devices = [device] * len(specs)
    cache = KVCache(len(specs), slots, positions, model.num_kv_heads, model.head_dim, dtype, specs=specs,
                    devices=devices)
    if model.linear is not None:
        cache.recurrent = recurrent_cache(model, specs, devices, slots, steps)
    return cache


def recurrent_cache(model: ModelConfig, specs: Sequence[LayerSpec], devices: Sequence[str], slots: int, steps: int,
                    layers: Sequence[int] | None = None) -> RecurrentCache:
    """The states of the recurrent layers among `specs` (model indices `layers`, default 0..)."""
    layers = list(layers if layers is not None else range(len(specs)))
    own = [(i, layer, device) for i, (layer, spec, device) in enumerate(zip(layers, specs, devices))
           if spec.is_recurrent]
    ngram = model.ngram
    return RecurrentCache([i for i, _, _ in own], slots, model.linear, steps, model.residual_width,
                          [device for _, _, device in own], ngram,
                          [i for i, layer, _ in own if ngram is not None and layer in ngram.layers])
