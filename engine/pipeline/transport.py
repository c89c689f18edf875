"""Messages between neighbouring ranks of the ring, as tensors over torch.distributed point-to-point.

A message is a fixed header (`HEADER_SIZE` int64: the operation, the number of cache operations,
of rows, of tokens and of tree depths), then its payloads: the cache operations, the rows and the
tree rows' depths as one int64 tensor ([C + R, 4]: (CacheOp, slot, a, b), then (slot, start,
tokens, whether a tree), flattened, then the depths) and the hidden states [N, hidden]. A receiver
learns every size from the header before it posts the payloads' receives. Every wait is bounded: a
timed-out wait breaks the link for good (gloo closes the pair), which is what a hung or lost peer
means here.
"""
from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.distributed as dist

from engine.model.batch import Row

HEADER_SIZE = 5
# An idle head sends a heartbeat this often, so that its workers can tell idle from lost.
HEARTBEAT_S = 1.0
HEADER_TAG, PAYLOAD_TAG = 1, 2


class Op(IntEnum):
    FORWARD = 1  # rows and hidden states for the next stage
    RESULT = 2  # the last stage's hidden states, back to the head
    HEARTBEAT = 3  # the head is alive and idle
    STOP = 4  # the head is shutting down


class CacheOp(IntEnum):
    """What a head's engine did to its KV cache, to be done to every stage's (kv_cache.py), as
    (CacheOp, slot, a, b): ENSURE and TRUNCATE a slot to length a; MOVE position a's K/V to b (a
    kept tree sibling's); CHECKPOINT a recurrent model's state after a positions."""
    ENSURE = 1
    TRUNCATE = 2
    MOVE = 3
    CHECKPOINT = 4


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
    cache_ops: list[tuple[int, int, int, int]] = field(default_factory=list)  # (CacheOp, slot, a, b)
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
    """This rank's ends of the ring: what it sends to `next` and receives from `prev`.

    Gloo moves a message only once its receive is posted, and a message sent before that waits
    milliseconds more (measured: a header-then-payload round trip took 8 ms instead of 0.5 ms). So
    the next header's receive is always posted before it can arrive (`recv` posts the following
    one as soon as one comes in, the head posts a result's receives as it sends the micro-batch),
    and headers travel under their own tag, so that a posted header receive never takes a payload.
    nccl matches by order alone (no tags), so under it (messages on a GPU) nothing is posted ahead.
    """

    def __init__(self, rank: int, world: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        """device: where messages travel from (the CPU under gloo, the rank's GPU under nccl)."""
        self.rank, self.world = rank, world
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._header: tuple[torch.Tensor, list] | None = None  # the next header's posted receive

    def send(self, message: Message, timeout: float) -> Pending:
        """Posts the message's sends to the next rank; the tensors stay referenced until they complete."""
        n = 0 if message.hidden is None else message.hidden.shape[0]
        depths = [d for r in message.rows if r.depths is not None for d in r.depths]
        header = self._long([message.op, len(message.cache_ops), len(message.rows), n, len(depths)])
        payload = []
        if message.cache_ops or message.rows:  # one tensor: each message part sent costs a wait
            rows = [(r.slot, r.start, len(r.tokens), int(r.depths is not None)) for r in message.rows]
            payload.append(self._long([v for quad in (*message.cache_ops, *rows) for v in quad] + depths))
        if n:
            payload.append(message.hidden.to(self.device).contiguous())
        try:
            works = [dist.isend(header, self.next, tag=HEADER_TAG)]
            works += [dist.isend(t, self.next, tag=PAYLOAD_TAG) for t in payload]
        except RuntimeError as e:
            raise LinkError.of(self.next, e) from e
        return Pending(works, [header, *payload], timeout, self.next)

    def recv(self, timeout: float) -> Message:
        """The next message from the previous rank, waiting at most `timeout` seconds for each of
        its parts."""
        header, works = self._header or self._post_header()
        Pending(works, [header], timeout, self.prev).wait()
        self._header = self._post_header() if self.device.type == "cpu" else None
        op, n_ops, n_rows, n, n_depths = header.tolist()
        if op not in Op.__members__.values():
            raise LinkError(self.prev, f"unknown operation {op} in a message header")
        meta = self._empty(4 * (n_ops + n_rows) + n_depths) if n_ops + n_rows else None
        hidden = self._empty(n, self.hidden_size, dtype=self.dtype) if n else None
        self._recv([p for p in (meta, hidden) if p is not None], PAYLOAD_TAG, timeout).wait()
        values = meta.tolist() if meta is not None else []
        quads = [tuple(values[i:i + 4]) for i in range(0, 4 * (n_ops + n_rows), 4)]
        depths, rows = values[4 * (n_ops + n_rows):], []
        for slot, start, t, tree in quads[n_ops:]:
            rows.append(Row(slot, start, [0] * t, depths[:t] if tree else None))
            depths = depths[t:] if tree else depths
        return Message(Op(op), quads[:n_ops], rows, hidden)

    def post_result(self, tokens: int, timeout: float) -> Pending:
        """Posts the receives of a RESULT of `tokens` rows from the last rank (the head's side,
        which knows the size it sent): waiting on it gives the hidden states."""
        header = self._empty(HEADER_SIZE)
        hidden = self._empty(tokens, self.hidden_size, dtype=self.dtype)

        def message() -> torch.Tensor:
            if header.tolist() != [Op.RESULT, 0, 0, tokens, 0]:
                raise LinkError(self.prev, f"expected a result of {tokens} rows, got header {header.tolist()}")
            return hidden
        head = self._recv([header], HEADER_TAG, timeout)
        body = self._recv([hidden], PAYLOAD_TAG, timeout)
        return Pending(head.works + body.works, [header, hidden], timeout, self.prev, message)

    def _post_header(self) -> tuple[torch.Tensor, list]:
        header = self._empty(HEADER_SIZE)
        return header, self._recv([header], HEADER_TAG, 0).works

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _empty(self, *shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _recv(self, parts: list[torch.Tensor], tag: int, timeout: float, message=None) -> Pending:
        try:
            works = [dist.irecv(t, self.prev, tag=tag) for t in parts]
        except RuntimeError as e:
            raise LinkError.of(self.prev, e) from e
        return Pending(works, parts, timeout, self.prev, message)
