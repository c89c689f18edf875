"""ForwardBatch: everything one forward pass needs, built once per engine step."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.probe import ProbeCapture

NO_ROWS = torch.empty(0, dtype=torch.long)


@dataclass
class Row:
    """One slot's part of a step: `tokens` new tokens written at positions start .. start+len-1."""
    slot: int
    start: int
    tokens: list[int]


@dataclass
class ForwardBatch:
    rows: list[Row]
    token_ids: torch.Tensor  # [N] all rows' tokens, concatenated
    positions: torch.Tensor  # [N]
    masks: list[torch.Tensor | None]  # per row [T, start+T] causal mask, None when T == 1
    # The rows of one token (decode without drafts), which attention takes all in one call
    # (left empty, every row attends on its own):
    decode_index: torch.Tensor = field(default_factory=lambda: NO_ROWS)  # [D] their index into the N tokens
    decode_slots: torch.Tensor = field(default_factory=lambda: NO_ROWS)  # [D]
    decode_positions: torch.Tensor = field(default_factory=lambda: NO_ROWS)  # [D] each attends to 0 .. its position
    # Each token's slot, [N]: with causal masks every token is a row of its own (model.fused_layers).
    # Left empty by a batch built by hand with other masks, which then runs layer by layer.
    slots: torch.Tensor = field(default_factory=lambda: NO_ROWS)
    # Per row, the probe that captures from it (engine/probe.py); None when no row probes, the
    # common case, which then runs exactly as without probes.
    probes: list[ProbeCapture | None] | None = None
    # This batch's tensors on each other device a stage runs on, moved once per step.
    _copies: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, rows: list[Row], probes: list[ProbeCapture | None] | None = None) -> "ForwardBatch":
        tokens, positions, masks, decode, slots = [], [], [], [], []
        for row in rows:
            n = len(row.tokens)
            if n == 1:
                decode.append((len(tokens), row.slot, row.start))
            tokens.extend(row.tokens)
            slots.extend([row.slot] * n)
            positions.extend(range(row.start, row.start + n))
            masks.append(None if n == 1 else causal_mask(row.start, n))
        index, decode_slots, starts = (torch.tensor(c, dtype=torch.long) for c in zip(*decode)) if decode else (NO_ROWS,) * 3
        return cls(rows, torch.tensor(tokens, dtype=torch.long), torch.tensor(positions, dtype=torch.long), masks,
                   index, decode_slots, starts, torch.tensor(slots, dtype=torch.long), probes)

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
