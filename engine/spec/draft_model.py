"""draft-simple: a smaller model with the target's vocabulary as the drafter."""
from __future__ import annotations

from engine.model.batch import ForwardBatch, Row
from engine.spec.drafter import CachedDrafter, Span


class DraftModelDrafter(CachedDrafter):
    """A smaller model with the same vocabulary, run autoregressively on its own cache."""
    needs_hidden = False

    def __init__(self, model, cache, vocab: int, width: int = 1, p_sibling: float = 0.0):
        super().__init__(cache, vocab, width, p_sibling)
        self.model = model

    def catch_up_rows(self, span: Span):
        # Positions start .. end-1 as the target wrote them, plus the token just sampled at `end`.
        ids = span.request.token_ids
        return Row(span.request.slot, span.start, ids[span.start:span.end + 1]), None

    def run(self, depth, rows, hidden, at=None):
        batch = ForwardBatch.build(rows)
        out = self.model(batch, self.cache)
        return None, self.model.logits(out if at is None else out[at.to(out.device)])
