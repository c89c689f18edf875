"""POST /v1/chat/completions and /v1/completions: OpenAI shapes, streamed over SSE or whole."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from server.generation import Final, Piece, PreparedRequest, prepare, run
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from server.state import ServerState

router = APIRouter()


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tandem
    if not state.runner.ready:
        raise APIError(503, "Loading model", "unavailable_error")
    return state


def render_chat(state: ServerState, body) -> str:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        return state.runner.engine.tokenizer.apply_chat_template(messages)
    except Exception as e:  # jinja's own errors name the problem (e.g. roles must alternate)
        raise APIError(400, f"messages: the chat template refused them: {e}") from e


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = get_state(request)
    tokenizer = state.runner.engine.tokenizer
    prompt_ids = await state.prompts.prompt_ids(render_chat(state, body))
    prepared = prepare(state, body, prompt_ids, body.n_logprobs)
    fmt = ChatFormat(state, body.model, tokenizer.decode)
    if body.stream:
        return _sse(state, prepared, fmt, body.include_usage)
    return await _whole(state, prepared, fmt, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = get_state(request)
    tokenizer = state.runner.engine.tokenizer
    prompt_ids = list(body.prompt) if isinstance(body.prompt, list) else await state.prompts.prompt_ids(body.prompt)
    prepared = prepare(state, body, prompt_ids, body.n_logprobs)
    fmt = TextFormat(state, body.model, tokenizer.decode)
    if body.stream:
        return _sse(state, prepared, fmt, body.include_usage)
    return await _whole(state, prepared, fmt, request)


def _sse(state: ServerState, prepared: PreparedRequest, fmt, include_usage: bool) -> EventSourceResponse:
    """As OpenAI's: `usage` only when stream_options.include_usage asks, in one more chunk with no
    choices after the finish_reason chunk. As llama-server's: `timings` on the last chunk before [DONE]."""
    async def events() -> AsyncIterator[dict]:
        first = fmt.first_chunk()
        if first is not None:
            yield {"data": json.dumps(first)}
        async for item in run(state, prepared):
            if isinstance(item, Final) and item.finish_reason == "error":
                yield {"data": json.dumps(_engine_error(state).body())}
            elif isinstance(item, Final):
                last = fmt.final_chunk(item)
                if include_usage:
                    yield {"data": json.dumps(last)}
                    last = {**fmt.envelope([], fmt.chunk_object), "usage": item.usage}
                yield {"data": json.dumps({**last, "timings": item.timings})}
            else:
                yield {"data": json.dumps(fmt.chunk(item))}
        yield {"data": "[DONE]"}

    return EventSourceResponse(events(), ping=15)


async def _whole(state: ServerState, prepared: PreparedRequest, fmt, request: Request) -> JSONResponse:
    # The body was read; the next ASGI message is the client's disconnect, if it leaves early.
    watcher = asyncio.ensure_future(request.receive())
    pieces: list[Piece] = []
    gen = run(state, prepared)
    try:
        while True:
            nxt = asyncio.ensure_future(gen.__anext__())
            await asyncio.wait([nxt, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():  # client gone: cancelling the step runs run()'s cleanup, which cancels
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await nxt
                return JSONResponse({}, status_code=499)
            item = nxt.result()
            if isinstance(item, Final):
                if item.finish_reason == "error":
                    raise _engine_error(state)
                return JSONResponse(fmt.whole(pieces, item))
            pieces.append(item)
    finally:
        watcher.cancel()
        await gen.aclose()


def _engine_error(state: ServerState) -> APIError:
    """A request the engine ended with an error: why, when the whole engine failed (a lost stage)."""
    failure = state.runner.engine.failure
    return APIError(500, "the engine failed on this request" + (f": {failure}" if failure else ""))


class _Format:
    chunk_object = ""  # the `object` of a streamed chunk

    def __init__(self, state: ServerState, model: str | None, decode: Callable[[list[int]], str]):
        self.id = f"{self.prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = state.model_name if not model or model == "default" else model
        self.decode = decode

    def envelope(self, choices: list[dict], object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": "tandem", "choices": choices}

    def first_chunk(self) -> dict | None:
        return None

    def final_chunk(self, final: Final) -> dict:
        """The chunk with finish_reason, which carries the attention probe's result when there is one."""
        return with_probe(self.chunk(final), final)


def with_probe(body: dict, final: Final) -> dict:
    return body if final.attention_probe is None else {**body, "attention_probe": final.attention_probe}


class ChatFormat(_Format):
    prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def first_chunk(self) -> dict:
        return self.envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], self.chunk_object)

    def chunk(self, item: Piece | Final) -> dict:
        if isinstance(item, Final):
            return self.envelope([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": item.finish_reason}],
                                 self.chunk_object)
        logprobs = {"content": self._logprobs(item.logprobs)} if item.logprobs else None
        return self.envelope([{"index": 0, "delta": {"content": item.text}, "logprobs": logprobs,
                               "finish_reason": None}], self.chunk_object)

    def whole(self, pieces: list[Piece], final: Final) -> dict:
        entries = [e for p in pieces for e in (p.logprobs or [])]
        message = {"role": "assistant", "content": "".join(p.text for p in pieces)}
        choice = {"index": 0, "message": message, "finish_reason": final.finish_reason,
                  "logprobs": {"content": self._logprobs(entries)} if entries else None}
        return with_probe({**self.envelope([choice], "chat.completion"), "usage": final.usage,
                           "timings": final.timings}, final)

    def _logprobs(self, entries: list[dict]) -> list[dict]:
        def one(token: int, logprob: float) -> dict:
            text = self.decode([token])
            return {"id": token, "token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**one(e["token"], e["logprob"]), "top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                for e in entries]


class TextFormat(_Format):
    prefix = "cmpl-"
    chunk_object = "text_completion"

    def chunk(self, item: Piece | Final) -> dict:
        if isinstance(item, Final):
            return self.envelope([{"index": 0, "text": "", "logprobs": None, "finish_reason": item.finish_reason}],
                                 self.chunk_object)
        return self.envelope([{"index": 0, "text": item.text, "logprobs": self._logprobs(item.logprobs),
                               "finish_reason": None}], self.chunk_object)

    def whole(self, pieces: list[Piece], final: Final) -> dict:
        entries = [e for p in pieces for e in (p.logprobs or [])]
        choice = {"index": 0, "text": "".join(p.text for p in pieces), "finish_reason": final.finish_reason,
                  "logprobs": self._logprobs(entries)}
        return with_probe({**self.envelope([choice], "text_completion"), "usage": final.usage,
                           "timings": final.timings}, final)

    def _logprobs(self, entries: list[dict] | None) -> dict | None:
        """The legacy completions shape: parallel lists per token."""
        if not entries:
            return None
        tokens = [self.decode([e["token"]]) for e in entries]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self.decode([t]): lp for t, lp in e["top"]} for e in entries],
                "text_offset": offsets}
