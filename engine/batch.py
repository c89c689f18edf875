"""ForwardBatch: everything one forward pass needs, built once per engine step."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @classmethod
    def build(cls, rows: list[Row]) -> "ForwardBatch":
        tokens, positions, masks = [], [], []
        for row in rows:
            n = len(row.tokens)
            tokens.extend(row.tokens)
            positions.extend(range(row.start, row.start + n))
            masks.append(None if n == 1 else causal_mask(row.start, n))
        return cls(rows, torch.tensor(tokens, dtype=torch.long), torch.tensor(positions, dtype=torch.long), masks)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def last_token_indices(self) -> torch.Tensor:
        """Index into the N tokens of each row's last token."""
        ends = torch.tensor([len(r.tokens) for r in self.rows]).cumsum(0)
        return ends - 1


def causal_mask(start: int, n: int) -> torch.Tensor:
    """[n, start+n] bool: query i (at position start+i) sees keys 0 .. start+i."""
    keys = torch.arange(start + n)
    return keys[None, :] <= (start + torch.arange(n))[:, None]
