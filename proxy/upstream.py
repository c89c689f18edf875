"""Keep-alive HTTP/1.1 connections to the local servers, for the relay's hot path.

Every chunk of every stream passes through here, so this is h11 on plain asyncio streams rather
than httpx: measured on this machine, httpx (httpcore, anyio) spent about twice the CPU per relayed
SSE event, and the proxy's CPU is taken from the server's on a 2-core box. The request goes out in
one write. The proxy's other calls (health, /props) use httpx.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import AsyncIterator

import h11

READ_SIZE = 65536
MAX_IDLE = 64  # pooled connections per server


class UpstreamError(Exception):
    """The server could not be reached, or the connection broke; the message says which."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    @property
    def usable(self) -> bool:
        """Idle and not closed by the server (it closes idle keep-alive connections after a while)."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()

    async def next_event(self):
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as e:  # includes a close before the body was complete
                raise UpstreamError(f"RemoteProtocolError: {e}") from e
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.reader.read(READ_SIZE)
            except OSError as e:
                raise UpstreamError(f"{type(e).__name__}: {e}") from e
            self.h11.receive_data(data)  # b"" is the end of the connection


class UpstreamResponse:
    def __init__(self, client: "UpstreamClient", key: tuple[str, int], conn: _Connection, event: h11.Response):
        self.status = event.status_code
        self.headers: list[tuple[bytes, bytes]] = list(event.headers)  # lower-case names, as ASGI wants
        self._client, self._key, self._conn, self._complete = client, key, conn, False

    def header(self, name: bytes) -> bytes:
        return next((v for k, v in self.headers if k == name), b"")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as it arrives (chunked framing removed). Raises UpstreamError."""
        while True:
            event = await self._conn.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._complete = True
                return

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def close(self) -> None:
        """Pools the connection when the response was read to its end; closes it otherwise (so a
        server still generating sees the disconnect and frees the slot)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._complete and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            self._client._put(self._key, conn)
        else:
            conn.close()


class UpstreamClient:
    def __init__(self, connect_timeout: float = 5.0):
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = defaultdict(list)

    async def request(self, host: str, port: int, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> UpstreamResponse:
        """Sends one request and reads the response head. `headers` must not hold host, content-length
        or transfer-encoding. Raises UpstreamError."""
        key = (host, port)
        head = [(b"host", f"{host}:{port}".encode()), (b"content-length", str(len(body)).encode()), *headers]
        while True:
            conn, reused = self._take(key), True
            if conn is None:
                conn, reused = await self._connect(host, port), False
            try:
                conn.writer.write(conn.h11.send(h11.Request(method=method, target=target, headers=head))
                                  + conn.h11.send(h11.Data(data=body)) + conn.h11.send(h11.EndOfMessage()))
                event = await conn.next_event()
                while isinstance(event, h11.InformationalResponse):  # 100 Continue
                    event = await conn.next_event()
            except BaseException:  # broken, or cancelled: a half-used connection is never reused
                conn.close()
                raise
            if isinstance(event, h11.Response):
                return UpstreamResponse(self, key, conn, event)
            conn.close()  # closed without a word: the server had just dropped this idle connection
            if not reused:
                raise UpstreamError(f"{host}:{port} closed the connection without answering")

    async def _connect(self, host: str, port: int) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise UpstreamError(f"cannot connect to {host}:{port}: {type(e).__name__}: {e}") from e
        return _Connection(reader, writer)

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle[key]
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
            conn.close()
        return None

    def _put(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle[key]
        if len(idle) < MAX_IDLE and conn.usable:
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
