"""The recurrent half of the hybrid cache: each linear-attention layer's state per slot, kept by
position (docs/architecture.md, "The hybrid cache: recurrent state").

A linear-attention layer's state after position p of a slot is its recurrent state [v_heads, k_dim,
v_dim] and its convolution's tail, the last conv_kernel - 1 inputs [conv_kernel - 1, conv_dim]; both
f32. A slot keeps `steps` such states, entry p % steps holding the state after position p, with a tag
saying which position it holds. A step of a few tokens (decode, a verify row: at most `steps`)
writes the state after each of its positions; a longer prompt chunk, computed in chunks, the states
after its last two (a draft model catching up goes on from the one before the last). So after a verify row the state after every position it wrote is there, and
rolling back rejected drafts is, as for the KV cache, only a shorter length: the next step reads the
state after the last accepted position. The state before the row is not kept: its first token
(the last sampled one) is always committed.

A state cannot be cut back to an arbitrary earlier position as K/V can. So each slot also keeps a
few snapshots, copies of its state where a request's prompt ended and where its answer ended, with
the target's last hidden state there (what an MTP draft pairs with the next token): a next request
sharing that prefix (a chat's next turn) resumes from one (`reusable`, `truncate`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.files.model_config import LinearAttention, NgramEmbedding
from engine.ops import arena

SNAPSHOTS = 2  # per slot: where the last request's prompt ended, and where its answer ended


def kept_of_long_row(start: int, tokens: int) -> range:
    """The positions whose states a row longer than `steps` keeps: its last two."""
    return range(start + tokens - 2, start + tokens)


class RecurrentCache:
    def __init__(self, layers: Sequence[int], num_slots: int, linear: LinearAttention, steps: int, hidden: int,
                 devices: Sequence[torch.device | str] | None = None, ngram: NgramEmbedding | None = None,
                 ngram_layers: Sequence[int] = ()):
        """layers: the model's linear-attention layer indices (their storage sits on `devices`, one
        per such layer, default the CPU); steps: states kept per slot, at least the longest row a
        step writes token by token (1 + the verify rows); hidden: the width of the states between
        layers (hidden_size, or Qwen4-Exp's residual streams). ngram_layers: those of them with
        n-gram embeddings (Qwen4-Exp), whose state is their last n-1 token ids and their
        convolution's inputs, `hidden` wide."""
        devices = [torch.device(d) for d in devices] if devices is not None else [torch.device("cpu")] * len(layers)
        self.layers = {layer: j for j, layer in enumerate(layers)}
        self.linear, self.steps, self.num_slots = linear, steps, num_slots
        tail = (linear.conv_kernel - 1, linear.conv_dim)
        state = (linear.num_v_heads, linear.k_head_dim, linear.v_head_dim)
        # Per layer [slots, steps, ...] and the snapshots' copies [slots, SNAPSHOTS, ...], f32.
        self.conv = [arena.zeros((num_slots, steps, *tail), device=d) for d in devices]
        self.state = [arena.zeros((num_slots, steps, *state), device=d) for d in devices]
        self.snap_conv = [torch.zeros(num_slots, SNAPSHOTS, *tail, device=d) for d in devices]
        self.snap_state = [torch.zeros(num_slots, SNAPSHOTS, *state, device=d) for d in devices]
        self.snap_hidden = torch.zeros(num_slots, SNAPSHOTS, hidden)
        self._zero = [(torch.zeros(tail, device=d), torch.zeros(state, device=d)) for d in devices]
        # Per n-gram layer: [slots, steps, n-1] token ids and [slots, steps, conv tail, streams * hidden].
        self.ngram_ids, self.ngram_conv, self._ngram_zero = {}, {}, {}
        if ngram_layers:
            ids, tail = (ngram.ngram - 1,), (ngram.conv_tail, hidden)
            for layer in ngram_layers:
                d = devices[layers.index(layer)]
                self.ngram_ids[layer] = torch.zeros(num_slots, steps, *ids, dtype=torch.long, device=d)
                self.ngram_conv[layer] = torch.zeros(num_slots, steps, *tail, device=d)
                self._ngram_zero[layer] = torch.zeros(tail, device=d)
        # Every per-position store [slots, steps, ...] with its snapshots' copy [slots, SNAPSHOTS, ...].
        current = self.conv + self.state + list(self.ngram_ids.values()) + list(self.ngram_conv.values())
        snapshots = self.snap_conv + self.snap_state + [
            torch.zeros(num_slots, SNAPSHOTS, *t.shape[2:], dtype=t.dtype, device=t.device)
            for t in current[len(self.conv) + len(self.state):]]
        self.stores = list(zip(current, snapshots))
        self.tags = [[-1] * steps for _ in range(num_slots)]  # the position each entry holds, -1: none
        self.snap_lengths = [[-1] * SNAPSHOTS for _ in range(num_slots)]  # -1: unused
        self.snap_hidden_set = [[False] * SNAPSHOTS for _ in range(num_slots)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.stores for t in pair)

    def per_token(self, tokens: int) -> bool:
        """Whether a row of this many tokens is computed token by token, keeping every position's state."""
        return tokens <= self.steps

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's state after the slot's first `length` positions: (conv tail [kernel-1, conv_dim],
        state [v_heads, k_dim, v_dim]), views; zeros before the first position."""
        j = self.layers[layer]
        if length == 0:
            return self._zero[j]
        e = (length - 1) % self.steps
        return self.conv[j][slot, e], self.state[j][slot, e]

    def write(self, layer: int, slot: int, position: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """The layer's state after `position` of the slot."""
        j, e = self.layers[layer], position % self.steps
        self.conv[j][slot, e] = conv
        self.state[j][slot, e] = state

    def read_ngram(self, layer: int, slot: int, length: int) -> torch.Tensor | None:
        """An n-gram layer's last n-1 token ids of the slot's first `length` positions; None before
        the first."""
        return None if length == 0 else self.ngram_ids[layer][slot, (length - 1) % self.steps]

    def read_ngram_conv(self, layer: int, slot: int, length: int) -> torch.Tensor:
        """An n-gram layer's convolution inputs before position `length` [tail, streams * hidden]."""
        return self._ngram_zero[layer] if length == 0 else self.ngram_conv[layer][slot, (length - 1) % self.steps]

    def write_ngram(self, layer: int, slot: int, position: int, ids: torch.Tensor, conv: torch.Tensor) -> None:
        """An n-gram layer's state after `position` of the slot."""
        e = position % self.steps
        self.ngram_ids[layer][slot, e] = ids
        self.ngram_conv[layer][slot, e] = conv

    def _written(self, start: int, tokens: int):
        """The positions whose states a row keeps: all, or a longer row's last two (a drafter that
        caught up on a span through its sampled token goes on from the position before it)."""
        return range(start, start + tokens) if self.per_token(tokens) else kept_of_long_row(start, tokens)

    def begin(self, slot: int, start: int, tokens: int) -> None:
        """A row is about to write positions start .. start+tokens-1 of the slot: the states after
        positions from `start` on are gone, and so are those in the entries it writes."""
        self._forget(slot, start)
        for position in self._written(start, tokens):
            self.tags[slot][position % self.steps] = -1

    def record(self, slot: int, start: int, tokens: int) -> None:
        """The row wrote them, in every layer: the states it kept are there to resume from."""
        for position in self._written(start, tokens):
            self.tags[slot][position % self.steps] = position

    def _forget(self, slot: int, length: int) -> None:
        tags = self.tags[slot]
        for e, position in enumerate(tags):
            if position >= length:
                tags[e] = -1

    def reusable(self, slot: int, length: int, with_hidden: bool = False) -> int:
        """The longest prefix, at most `length`, whose state the slot holds or can restore: 0, the
        positions its entries hold, its snapshots (with_hidden: only a snapshot that kept the
        target's hidden state at its last position, or 0)."""
        best = max((n for n, h in zip(self.snap_lengths[slot], self.snap_hidden_set[slot])
                    if 0 < n <= length and (h or not with_hidden)), default=0)
        if not with_hidden:
            best = max([best] + [p + 1 for p in self.tags[slot] if 0 <= p < length])
        return best

    def truncate(self, slot: int, length: int) -> None:
        """The slot keeps its first `length` positions (a length `reusable` gave): their state is
        made current, from a snapshot when no entry holds it; states and snapshots past it go."""
        self._forget(slot, length)
        lengths = self.snap_lengths[slot]
        for s, n in enumerate(lengths):
            if n > length:
                lengths[s] = -1
        if length == 0 or self.tags[slot][(length - 1) % self.steps] == length - 1:
            return
        s = lengths.index(length)  # the scheduler truncates only to a reusable length
        e = (length - 1) % self.steps
        for current, snapshots in self.stores:
            current[slot, e] = snapshots[slot, s]
        self.tags[slot][e] = length - 1

    def checkpoint(self, slot: int, length: int, hidden: torch.Tensor | None = None) -> None:
        """Snapshot the state after the slot's first `length` positions (which it holds), with the
        target's hidden state at position length-1 when given, in place of the shortest snapshot (a
        chat's turns grow: the latest prompt's end and answer's end are kept)."""
        lengths = self.snap_lengths[slot]
        if length <= 0 or length in lengths or self.tags[slot][(length - 1) % self.steps] != length - 1:
            return
        s = lengths.index(-1) if -1 in lengths else min(range(SNAPSHOTS), key=lambda i: lengths[i])
        e = (length - 1) % self.steps
        for current, snapshots in self.stores:
            snapshots[slot, s] = current[slot, e]
        lengths[s] = length
        self.snap_hidden_set[slot][s] = hidden is not None
        if hidden is not None:
            self.snap_hidden[slot, s] = hidden.float().cpu()

    def snapshot_hidden(self, slot: int, length: int) -> torch.Tensor | None:
        """The target's hidden state at position length-1 that the slot's snapshot at `length` kept."""
        lengths = self.snap_lengths[slot]
        if length not in lengths or not self.snap_hidden_set[slot][lengths.index(length)]:
            return None
        return self.snap_hidden[slot, lengths.index(length)].clone()
