"""Checks at the edge, before any handler runs: the API key, the body size limit, a body that is not
UTF-8 or nests too deep (named, before any parser sees it), and refusing new requests while
draining for shutdown. Also counts the requests in flight (a stream counts until
its last byte is sent), which the graceful shutdown waits on, and of those the completions, which
the wait queue's limit counts.

Every body is read as JSON whatever its Content-Type says (or without one), as llama-server does:
`curl -d '{...}'` sends application/x-www-form-urlencoded."""
from __future__ import annotations

import asyncio
import json

from server.memory import BIG_BODY, give_back_freed_memory
from server.protocol import COMPLETION_PATHS, body_problem, error_body, is_open
from server.state import ServerState



class EdgeMiddleware:
    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings, path = self.state.settings, scope["path"]
        headers = dict(scope["headers"])
        if settings.api_key and not is_open(path):
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {settings.api_key}":
                return await _reply(send, 401, "Invalid API Key: send 'Authorization: Bearer KEY'")
        if self.state.draining and not is_open(path):
            return await _reply(send, 503, "Server is shutting down")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await _reply(send, 400, "Content-Length: not a number")
        if declared > settings.body_limit:
            return await _reply(send, 413, f"request body of {declared} bytes exceeds the limit of "
                                           f"{settings.body_limit} bytes")
        if scope["method"] == "POST":
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
            body = await _whole_body(receive, settings.body_limit)
            if body is None:  # the client left before it finished sending
                return
            if len(body) > settings.body_limit:  # chunked, without a Content-Length to refuse it by
                return await _reply(send, 413, f"request body exceeds the limit of {settings.body_limit} bytes")
            problem = body_problem(body)
            if problem:
                return await _reply(send, 400, problem)
            receive = _replayed(body, receive)
        completion = path in COMPLETION_PATHS
        self.state.in_flight += 1
        self.state.completions += completion
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
            self.state.completions -= completion
            if declared > BIG_BODY:
                await asyncio.to_thread(give_back_freed_memory)


async def _whole_body(receive, limit: int) -> bytes | None:
    """The request's body, read to its end or until it is past `limit` bytes (by its last chunk
    at most); None if the client disconnected first."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body") or size > limit:
            return b"".join(chunks)


def _replayed(body: bytes, receive):
    """A receive that gives the app the body already read, then what the client sends next (its
    disconnect, which a whole answer watches for)."""
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

