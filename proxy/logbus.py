"""Log lines of the proxy and of its servers, fanned out to /logs/stream subscribers.

Publishing never blocks: a subscriber that falls behind loses lines, so a slow log reader can never
slow down request handling. It is told how many: a line `[N lines dropped]` stands where they
were, before the next line it gets. Called only on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass

BACKLOG = 200  # lines a new subscriber gets first
SUBSCRIBER_BUFFER = 1000


@dataclass(frozen=True)
class LogLine:
    ts: float
    source: str  # "proxy" or "server"
    model: str | None
    replica: int | None
    line: str

    def as_dict(self) -> dict:
        return asdict(self)


class Subscription:
    def __init__(self, model: str | None):
        self.model = model
        self.queue: asyncio.Queue[LogLine] = asyncio.Queue()  # bounded by offer, which never blocks
        self.dropped = 0  # lines lost since the last one queued

    def wants(self, line: LogLine) -> bool:
        return self.model is None or line.model == self.model

    def offer(self, line: LogLine) -> None:
        if self.queue.qsize() >= SUBSCRIBER_BUFFER:
            self.dropped += 1
            return
        if self.dropped:
            self.queue.put_nowait(LogLine(line.ts, "proxy", self.model, None, f"[{self.dropped} lines dropped]"))
            self.dropped = 0
        self.queue.put_nowait(line)

    async def next(self) -> LogLine:
        return await self.queue.get()


class LogBus:
    def __init__(self):
        self.backlog: deque[LogLine] = deque(maxlen=BACKLOG)
        self.subscribers: set[Subscription] = set()

    def publish(self, source: str, line: str, model: str | None = None, replica: int | None = None) -> None:
        entry = LogLine(time.time(), source, model, replica, line)
        self.backlog.append(entry)
        for sub in self.subscribers:
            if sub.wants(entry):
                sub.offer(entry)

    def subscribe(self, model: str | None = None) -> Subscription:
        sub = Subscription(model)
        for entry in self.backlog:
            if sub.wants(entry):
                sub.offer(entry)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)


class BusHandler(logging.Handler):
    """Sends the proxy's own log records to the bus; `model` comes from the record's extra, if any."""

    def __init__(self, bus: LogBus, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.bus, self.loop = bus, loop

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            model = getattr(record, "model", None)
            self.loop.call_soon_threadsafe(self.bus.publish, "proxy", text, model)
        except RuntimeError:  # the loop closed during shutdown
            pass
