"""Checks at the edge, before any handler runs: the API key, the body size limit, and refusing new
requests while draining for shutdown. Also counts the requests in flight (a stream counts until
its last byte is sent), which the graceful shutdown waits on, and of those the completions, which
the wait queue's limit counts.

Every body is read as JSON whatever its Content-Type says (or without one), as llama-server does:
`curl -d '{...}'` sends application/x-www-form-urlencoded."""
from __future__ import annotations

import asyncio
import json

from server.memory import BIG_BODY, give_back_freed_memory
from server.protocol import COMPLETION_PATHS, APIError, error_body, is_open
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
        completion = path in COMPLETION_PATHS
        self.state.in_flight += 1
        self.state.completions += completion
        try:
            await self.app(scope, _limited(receive, settings.body_limit), send)
        finally:
            self.state.in_flight -= 1
            self.state.completions -= completion
            if declared > BIG_BODY:
                await asyncio.to_thread(give_back_freed_memory)


def _limited(receive, limit: int):
    """A receive that refuses a body (e.g. chunked, without Content-Length) growing past the limit."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        return message

    return wrapped


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

