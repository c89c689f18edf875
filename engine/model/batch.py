"""ForwardBatch: everything one forward pass needs, built once per engine step."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.model.probe import ProbeCapture

NO_ROWS = torch.empty(0, dtype=torch.long)


@dataclass
class Row:
    """One slot's part of a step: `tokens` new tokens written at positions start .. start+len-1.
    A tree's verify row also gives each token's depth: a chain token's is its index, a sibling's
    that of the chain token it stands beside. A sibling is written past the chain, at its own
    scratch position, but stands (RoPE) at start + depth and sees the chain before that depth."""
    slot: int
    start: int
    tokens: list[int]
    depths: list[int] | None = None  # None: a chain, token i at depth i


@dataclass
class ForwardBatch:
    rows: list[Row]
    token_ids: torch.Tensor  # [N] all rows' tokens, concatenated
    positions: torch.Tensor  # [N] where each token's K/V is written
    masks: list[torch.Tensor | None]  # per row [T, start+T] causal (or tree) mask, None when T == 1
    # The rows of one token (decode without drafts), which attention takes all in one call
    # (left empty, every row attends on its own):
    decode_index: torch.Tensor = field(default_factory=lambda: NO_ROWS)  # [D] their index into the N tokens
    decode_slots: torch.Tensor = field(default_factory=lambda: NO_ROWS)  # [D]
    decode_positions: torch.Tensor = field(default_factory=lambda: NO_ROWS)  # [D] each attends to 0 .. its position
    # Each token's slot, [N]: with causal masks every token is a row of its own (model.fused_layers).
    # Left empty by a batch built by hand with other masks, which then runs layer by layer.
    slots: torch.Tensor = field(default_factory=lambda: NO_ROWS)
    # Per row, the probe that captures from it (engine/model/probe.py); None when no row probes, the
    # common case, which then runs exactly as without probes.
    probes: list[ProbeCapture | None] | None = None
    # [N] each token's position for RoPE, when a tree row makes it differ from `positions`.
    rope_positions: torch.Tensor | None = None
    # This batch's tensors on each other device a stage runs on, moved once per step.
    _copies: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, rows: list[Row], probes: list[ProbeCapture | None] | None = None) -> "ForwardBatch":
        tokens, positions, rope, masks, decode, slots = [], [], [], [], [], []
        for row in rows:
            n = len(row.tokens)
            if n == 1:
                decode.append((len(tokens), row.slot, row.start))
            tokens.extend(row.tokens)
            slots.extend([row.slot] * n)
            positions.extend(range(row.start, row.start + n))
            rope.extend(row.start + d for d in row.depths or range(n))
            masks.append(None if n == 1 else causal_mask(row.start, n) if row.depths is None
                         else tree_mask(row.start, row.depths))
        index, decode_slots, starts = (torch.tensor(c, dtype=torch.long) for c in zip(*decode)) if decode else (NO_ROWS,) * 3
        tree = any(row.depths is not None for row in rows)
        return cls(rows, torch.tensor(tokens, dtype=torch.long), torch.tensor(positions, dtype=torch.long), masks,
                   index, decode_slots, starts, torch.tensor(slots, dtype=torch.long), probes,
                   torch.tensor(rope, dtype=torch.long) if tree else None)

    def on(self, device: torch.device) -> "ForwardBatch":
        """The batch with its tensors on `device`: itself where they already are, else a copy made
        once and kept for the other stages and layers on that device."""
        if self.positions.device == device:
            return self
        if device not in self._copies:
            moved = {f.name: _to(getattr(self, f.name), device) for f in fields(self) if f.name != "_copies"}
            self._copies[device] = ForwardBatch(**moved)
        return self._copies[device]

    @property
    def rope(self) -> torch.Tensor:
        """[N] each token's position for RoPE."""
        return self.positions if self.rope_positions is None else self.rope_positions

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def row_starts(self) -> list[int]:
        """Each row's first token's index into the N tokens."""
        return list(accumulate((len(r.tokens) for r in self.rows[:-1]), initial=0))


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


def causal_mask(start: int, n: int) -> torch.Tensor:
    """[n, start+n] bool: query i (at position start+i) sees keys 0 .. start+i."""
    keys = torch.arange(start + n)
    return keys[None, :] <= (start + torch.arange(n))[:, None]


def tree_mask(start: int, depths: list[int]) -> torch.Tensor:
    """[n, start+n] bool: token i (depth d) sees keys 0 .. start+d-1, the prefix and the chain
    tokens before depth d, and itself at start+i."""
    n, keys = len(depths), torch.arange(start + len(depths))
    mask = keys[None, :] < (start + torch.tensor(depths))[:, None]
    mask[torch.arange(n), start + torch.arange(n)] = True
    return mask
