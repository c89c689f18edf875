"""Byte-for-byte relay of one HTTP exchange to an upstream server, at the raw ASGI level.

Raw ASGI rather than a StreamingResponse because the relay must see the client leave at any point,
waiting in the queue included, and must choose the status code only once the upstream has answered.
Each upstream chunk is sent on as soon as it arrives; nothing is buffered beyond the last few chunks,
which are kept to read the final `timings` after the stream has ended.
"""
from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass

from proxy.upstream import UpstreamClient, UpstreamError
from server.protocol import APIError, error_body

# Hop-by-hop headers (RFC 9110 7.6.1), plus what uvicorn sets itself and the proxy's own credentials.
DROP_REQUEST = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                b"proxy-authorization", b"proxy-connection", b"content-length", b"authorization"}
UPSTREAM_HOST = "127.0.0.1"  # servers listen on loopback only
DROP_RESPONSE = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                 b"proxy-connection", b"server", b"date"}
TAIL_CHUNKS = 4


class DisconnectWatch:
    """Cancels the request's task when the client disconnects. Start it once the body is read:
    uvicorn's receive() then returns only when the connection is lost."""

    def __init__(self, receive):
        self.fired, self._armed = False, True
        self._owner = asyncio.current_task()
        self._waiting = asyncio.ensure_future(receive())
        self._waiting.add_done_callback(self._on_message)

    def _on_message(self, fut: asyncio.Future) -> None:
        if self._armed and not fut.cancelled() and fut.result().get("type") == "http.disconnect":
            self.fired = True
            self._owner.cancel()

    def disarm(self) -> None:
        """Called before the response's last message: uvicorn reports a completed response as a disconnect."""
        self._armed = False

    def close(self) -> None:
        self._armed = False
        self._waiting.cancel()


@dataclass
class Outcome:
    status: int
    failure: str | None = None  # the upstream broke (could not connect, or died mid-response)
    timings: dict | None = None  # from the last SSE event, or the JSON body


class ClientGone(Exception):
    """The client disconnected before its request was read; there is no one to answer."""


async def read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None when it exceeds `limit` bytes."""
    parts, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > limit:
            return None
        more = message.get("more_body", False)
    return b"".join(parts)


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def send_error(send, status: int, message: str, type_: str | None = None, headers: list | None = None) -> None:
    await send_json(send, status, error_body(status, message, type_), headers)


async def send_api_error(send, e: APIError) -> None:
    await send_error(send, e.status, e.message, e.type,
                     [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()])


def sse_error_event(message: str, status: int, type_: str | None = None) -> bytes:
    """The OpenAI-style error event that ends a stream the proxy could not finish, then [DONE], so a
    client reading to the end sees the stream closed as a stream ends."""
    return b"data: " + json.dumps(error_body(status, message, type_)).encode() + b"\n\ndata: [DONE]\n\n"


def find_timings(tail: deque[bytes], sse: bool) -> dict | None:
    data = b"".join(tail)
    try:
        if not sse:
            return json.loads(data).get("timings")
        at = data.rfind(b'"timings"')
        if at < 0:
            return None
        start = data.rfind(b"data: ", 0, at)
        end = data.find(b"\n", at)
        return json.loads(data[start + 6:end if end >= 0 else None]).get("timings")
    except (ValueError, AttributeError):
        return None


async def relay(scope, send, watch: DisconnectWatch | None, client: UpstreamClient, port: int, path: str,
                body: bytes, why_cancelled=lambda: None) -> Outcome:
    """Sends the request to the server on `port` and streams the answer back; returns how it went.

    The task may be cancelled: by the DisconnectWatch (the client left) or by the proxy cutting the
    request off, in which case `why_cancelled()` gives the reason and the client gets it as an error.
    Either way the upstream connection is closed on the way out, so the server frees the slot."""
    headers = [(k, v) for k, v in scope["headers"] if k not in DROP_REQUEST]  # ASGI names are lower-case
    query = scope.get("query_string", b"")
    target = path + ("?" + query.decode() if query else "")
    response, sse = None, False
    try:
        try:
            response = await client.request(UPSTREAM_HOST, port, scope["method"], target, headers, body)
        except UpstreamError as e:
            message = f"the upstream server did not answer: {e}"
            await send_error(send, 502, message, "upstream_error")
            return Outcome(502, failure=message)
        out = [(k, v) for k, v in response.headers if k not in DROP_RESPONSE]
        sse = response.header(b"content-type").startswith(b"text/event-stream")
        if not response.header(b"x-accel-buffering"):
            out.append((b"x-accel-buffering", b"no"))  # nginx and friends must not hold chunks back
        await send({"type": "http.response.start", "status": response.status, "headers": out})
        tail: deque[bytes] = deque(maxlen=TAIL_CHUNKS)
        try:
            async for chunk in response.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail.append(chunk)
        except UpstreamError as e:
            message = f"the upstream server broke off the response: {e}"
            await _end(send, watch, sse_error_event(message, 502, "upstream_error") if sse else b"")
            return Outcome(response.status, failure=message)
        await _end(send, watch, b"")
        return Outcome(response.status, timings=find_timings(tail, sse) if response.status == 200 else None)
    except asyncio.CancelledError:
        reason = why_cancelled()
        if reason and response is None:
            await send_error(send, 503, reason)
        elif reason:
            await _end(send, watch, sse_error_event(reason, 503) if sse else b"")
        raise
    finally:
        if response is not None:
            response.close()  # unread: the connection is dropped and the server frees the slot


async def _end(send, watch: DisconnectWatch | None, body: bytes) -> None:
    if watch:
        watch.disarm()
    await send({"type": "http.response.body", "body": body, "more_body": False})
