"""n-gram lookup drafting: propose what followed the latest earlier occurrence of the last n tokens
of the prompt and history (`ngram-simple`, and beside the MTP draft in `draft-mtp-ngram`). No
weights; it pays off when the output repeats the input (summaries, edits, code)."""
from __future__ import annotations

import torch

from engine.sched.request import Draft, Request
from engine.spec.drafter import Span, as_draft


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


def lookup_draft(req: Request, tokens: list[int], vocab: int) -> Draft:
    """The draft of tokens the n-gram lookup found for req. A deterministic draft is a one-hot q:
    the acceptance rule then keeps it with p(x)."""
    qs = [torch.nn.functional.one_hot(torch.tensor(t), vocab).float() for t in tokens] \
        if not req.params.greedy else [None] * len(tokens)
    return as_draft(tokens, qs, req.draft_limits.n_min)


class NgramDrafter:
    """ngram-simple: the lookup alone, for every decoding request."""
    needs_hidden = False
    has_cache = False

    def __init__(self, n: int, vocab: int):
        self.n, self.vocab = n, vocab

    def resident(self) -> None:
        return None

    def draft(self, spans: list[Span]) -> dict[Request, Draft]:
        drafts = {}
        for span in spans:
            req = span.request
            if req.prefilling:
                continue
            tokens = ngram_draft(req.token_ids, self.n, min(req.draft_limits.n_max, span.room))
            drafts[req] = lookup_draft(req, tokens, self.vocab)
        return drafts
