"""Messages between neighbouring ranks of the ring, as tensors over torch.distributed point-to-point.

A message is a fixed header (`HEADER_SIZE` int64: the operation and the sizes of what follows), then
its payloads: the cache operations [C, 3], the rows [R, 3] (slot, start, tokens) and the hidden
states [N, hidden]. A receiver learns every size from the header before it posts the payloads'
receives. Every wait is bounded: a timed-out wait breaks the link for good (gloo closes the pair),
which is what a hung or lost peer means here.
"""
from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.distributed as dist

from engine.batch import Row

HEADER_SIZE = 4


class Op(IntEnum):
    FORWARD = 1  # rows and hidden states for the next stage
    RESULT = 2  # the last stage's hidden states, back to the head
    HEARTBEAT = 3  # the head is alive and idle
    STOP = 4  # the head is shutting down


class CacheOp(IntEnum):
    """What a head's scheduler did to its KV cache, to be done to every stage's (kv_cache.py)."""
    ENSURE = 1
    TRUNCATE = 2


class LinkError(RuntimeError):
    """A peer died, hung, or sent what the protocol does not allow."""

    def __init__(self, rank: int, what: str):
        super().__init__(what)
        self.rank = rank

    @classmethod
    def of(cls, rank: int, error: RuntimeError) -> "LinkError":
        """torch.distributed's error, in one line without gloo's source location."""
        line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return cls(rank, re.sub(r"^\[[^\]]*\]\s*", "", line)[:200])


@dataclass
class Message:
    op: Op
    cache_ops: list[tuple[int, int, int]] = field(default_factory=list)  # (CacheOp, slot, length)
    rows: list[Row] = field(default_factory=list)  # tokens are placeholders: a stage needs their count
    hidden: torch.Tensor | None = None  # [N, hidden]


class Pending:
    """Sends or receives in flight; `wait` bounds them all and gives the received message."""

    def __init__(self, works: list, keep: list[torch.Tensor], timeout: float, peer: int,
                 message: Callable[[], object] | None = None):
        self.works, self.keep, self.timeout, self.peer, self._message = works, keep, timeout, peer, message

    def wait(self):
        try:
            for work in self.works:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise LinkError.of(self.peer, e) from e
        return self._message() if self._message is not None else None


class Link:
    """This rank's ends of the ring: what it sends to `next` and receives from `prev`."""

    def __init__(self, rank: int, world: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        """device: where messages travel from (the CPU under gloo, the rank's GPU under nccl)."""
        self.rank, self.world = rank, world
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device

    def send(self, message: Message, timeout: float, to: int | None = None) -> Pending:
        """Posts the message's sends to `to` (default: the next rank); the tensors stay referenced
        until the sends complete."""
        to = self.next if to is None else to
        n = 0 if message.hidden is None else message.hidden.shape[0]
        header = self._long([message.op, len(message.cache_ops), len(message.rows), n])
        parts = [header]
        if message.cache_ops:
            parts.append(self._long(message.cache_ops))
        if message.rows:
            parts.append(self._long([(r.slot, r.start, len(r.tokens)) for r in message.rows]))
        if n:
            parts.append(message.hidden.to(self.device).contiguous())
        try:
            works = [dist.isend(t, to) for t in parts]
        except RuntimeError as e:
            raise LinkError.of(to, e) from e
        return Pending(works, parts, timeout, to)

    def recv(self, timeout: float, frm: int | None = None) -> Message:
        """The next message from `frm` (default: the previous rank), waiting at most `timeout`
        seconds for each of its parts."""
        frm = self.prev if frm is None else frm
        header = self._empty(HEADER_SIZE)
        self._recv([header], timeout, frm).wait()
        op, n_ops, n_rows, n = header.tolist()
        if op not in Op.__members__.values():
            raise LinkError(frm, f"unknown operation {op} in a message header")
        parts = [self._empty(n_ops, 3) if n_ops else None, self._empty(n_rows, 3) if n_rows else None,
                 self._empty(n, self.hidden_size, dtype=self.dtype) if n else None]
        self._recv([p for p in parts if p is not None], timeout, frm).wait()
        ops, rows, hidden = parts
        return Message(Op(op), [tuple(o) for o in ops.tolist()] if ops is not None else [],
                       [Row(s, start, [0] * t) for s, start, t in rows.tolist()] if rows is not None else [], hidden)

    def post_result(self, tokens: int, timeout: float) -> Pending:
        """Posts the receives of a RESULT of `tokens` rows from the last rank (the head's side,
        which knows the size it sent): waiting on it gives the hidden states."""
        header = self._empty(HEADER_SIZE)
        hidden = self._empty(tokens, self.hidden_size, dtype=self.dtype)

        def message() -> torch.Tensor:
            if header.tolist() != [Op.RESULT, 0, 0, tokens]:
                raise LinkError(self.prev, f"expected a result of {tokens} rows, got header {header.tolist()}")
            return hidden
        return self._recv([header, hidden], timeout, self.prev, message)

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _empty(self, *shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _recv(self, parts: list[torch.Tensor], timeout: float, frm: int, message=None) -> Pending:
        try:
            works = [dist.irecv(t, frm) for t in parts]
        except RuntimeError as e:
            raise LinkError.of(frm, e) from e
        return Pending(works, parts, timeout, frm, message)
