"""An answer as the Responses and Messages APIs shape it: text and tool calls in the order they
come, then the end. Both stream it as events of their own and, whole, read it from the joined text."""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import Request
from sse_starlette import EventSourceResponse

from server.generation import Final, PreparedRequest, run
from server.openai_api import whole
from server.state import ServerState
from server.tool_calls import CallReader, Event, ended


async def answer_events(state: ServerState, prepared: PreparedRequest, calls: bool) -> AsyncIterator[Event | Final]:
    """Text deltas and each call's start, arguments and end as they come (calls: the answer may
    hold them; server.tool_calls.CallReader), then the Final."""
    reader = CallReader() if calls else None
    async for item in run(state, prepared):
        if isinstance(item, Final):
            for event in reader.finish() if reader is not None else ():
                yield event
            yield item if reader is None else ended(item, reader.calls)
            return
        for event in reader.push(item.text) if reader is not None else [item.text] if item.text else []:
            yield event


async def reply(state: ServerState, prepared: PreparedRequest, shape, request: Request, stream: bool):
    """The answer as `shape` gives it: whole (`shape.whole`), or as its named SSE events (`shape.events`)."""
    if not stream:
        return await whole(state, prepared, shape, request)

    async def events() -> AsyncIterator[dict]:
        async for event in shape.events(answer_events(state, prepared, shape.calls)):
            yield {"event": event["type"], "data": json.dumps(event)}
    return EventSourceResponse(events(), ping=15)
