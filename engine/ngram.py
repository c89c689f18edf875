"""n-gram lookup drafting: propose what followed the latest earlier occurrence of the last n tokens
of the prompt and history. No weights; it pays off when the output repeats the input (summaries,
edits, code)."""
from __future__ import annotations

import torch


def ngram_draft(history: list[int], n: int, n_max: int) -> list[int]:
    """Up to n_max tokens that followed the most recent earlier match of history[-n:]."""
    if len(history) <= n or n_max < 1:
        return []
    seq = torch.tensor(history, dtype=torch.long)
    windows = seq.unfold(0, n, 1)[:-1]  # [L - n, n]: every n-gram that has a successor
    hits = torch.nonzero((windows == seq[-n:]).all(dim=1)).flatten()
    if hits.numel() == 0:
        return []
    start = int(hits[-1]) + n
    return history[start:start + n_max]
