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

from server.chat_prompt import render_chat
from server.generation import Final, Piece, PreparedRequest, constrain, prepare, run
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, GrammarSource
from server.tool_calls import ArgumentsDelta, CallReader, CallStarted, Event, call_grammar, ended, whole_answer
from server.state import ServerState

router = APIRouter()


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tandem
    if not state.runner.ready:
        raise APIError(503, "Loading model", "unavailable_error")
    return state


def chat_grammar(body: ChatCompletionRequest) -> GrammarSource | None:
    """What a chat's answer follows: a required call (of the named function, or of any tool), an
    answer or a call where tools meet a response format, else the request's own grammar."""
    mode = body.tool_mode
    if mode in ("required", "named"):
        tools = body.tools if mode == "required" else \
            [t for t in body.tools if t.function.name == body.tool_choice["function"]["name"]]
        return call_grammar(tools, body.parallel_tool_calls and mode == "required")
    if mode == "auto" and body.grammar_source is not None:
        return call_grammar(body.tools, body.parallel_tool_calls, answer=body.grammar_source)
    return body.grammar_source


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> PreparedRequest:
    """A chat checked and ready to submit: rendered with the tools it offers, its grammar compiled.
    The Responses and Messages APIs come here too, translated into a chat."""
    tools = body.tools if body.tool_mode != "none" else None
    prompt_ids = await state.prompts.prompt_ids(render_chat(state.runner.engine.tokenizer, body.messages, tools))
    prepared = prepare(state, body, prompt_ids, body.n_logprobs)
    prepared.constraint = await constrain(state, chat_grammar(body))
    return prepared


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = get_state(request)
    prepared = await prepare_chat(state, body)
    fmt = ChatFormat(state, body.model, state.runner.engine.tokenizer.decode, calls=body.tool_mode != "none")
    if body.stream:
        return _sse(state, prepared, fmt, body.include_usage)
    return await whole(state, prepared, fmt, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = get_state(request)
    tokenizer = state.runner.engine.tokenizer
    prompt_ids = list(body.prompt) if isinstance(body.prompt, list) else await state.prompts.prompt_ids(body.prompt)
    prepared = prepare(state, body, prompt_ids, body.n_logprobs)
    prepared.constraint = await constrain(state, body.grammar_source)
    fmt = TextFormat(state, body.model, tokenizer.decode)
    if body.stream:
        return _sse(state, prepared, fmt, body.include_usage)
    return await whole(state, prepared, fmt, request)


def _sse(state: ServerState, prepared: PreparedRequest, fmt, include_usage: bool) -> EventSourceResponse:
    """As OpenAI's: `usage` only when stream_options.include_usage asks, in one more chunk with no
    choices after the finish_reason chunk. As llama-server's: `timings` on the last chunk before [DONE]."""
    async def events() -> AsyncIterator[dict]:
        first = fmt.first_chunk()
        if first is not None:
            yield {"data": json.dumps(first)}
        async for item in run(state, prepared):
            if isinstance(item, Final) and item.finish_reason == "error":
                yield {"data": json.dumps(engine_error(state).body())}
            elif isinstance(item, Final):
                *held, last = fmt.final_chunks(item)
                for chunk in held:
                    yield {"data": json.dumps(chunk)}
                if include_usage:
                    yield {"data": json.dumps(last)}
                    last = {**fmt.envelope([], fmt.chunk_object), "usage": item.usage}
                yield {"data": json.dumps({**last, "timings": item.timings})}
            else:
                for chunk in fmt.chunks(item):
                    yield {"data": json.dumps(chunk)}
        yield {"data": "[DONE]"}

    return EventSourceResponse(events(), ping=15)


async def whole(state: ServerState, prepared: PreparedRequest, fmt, request: Request) -> JSONResponse:
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
                    raise engine_error(state)
                return JSONResponse(fmt.whole(pieces, item))
            pieces.append(item)
    finally:
        watcher.cancel()
        await gen.aclose()


def engine_error(state: ServerState) -> APIError:
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

    def chunks(self, piece: Piece) -> list[dict]:
        return [self.chunk(piece)]

    def final_chunks(self, final: Final) -> list[dict]:
        """Anything held back, then the chunk with finish_reason, which carries the attention
        probe's result when there is one."""
        return [with_probe(self.chunk(final), final)]


def with_probe(body: dict, final: Final) -> dict:
    return body if final.attention_probe is None else {**body, "attention_probe": final.attention_probe}


class ChatFormat(_Format):
    """calls: the answer may hold tool calls (server.tool_calls), read out of its text: streamed as
    OpenAI streams them (a call's id and name, then its arguments), whole as message.tool_calls,
    and finish_reason "tool_calls" where the answer ended by itself after a call."""
    prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, model: str | None, decode: Callable[[list[int]], str], calls: bool = False):
        super().__init__(state, model, decode)
        self.reader = CallReader() if calls else None

    def first_chunk(self) -> dict:
        return self.envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], self.chunk_object)

    def chunks(self, piece: Piece) -> list[dict]:
        if self.reader is None:
            return [self.chunk(piece)]
        return self._event_chunks(self.reader.push(piece.text), piece)

    def final_chunks(self, final: Final) -> list[dict]:
        if self.reader is None:
            return super().final_chunks(final)
        return self._event_chunks(self.reader.finish()) + [with_probe(self.chunk(self._with_reason(final)), final)]

    def _with_reason(self, final: Final) -> Final:
        return ended(final, self.reader.calls) if self.reader is not None else final

    def _event_chunks(self, events: list[Event], piece: Piece | None = None) -> list[dict]:
        """Text as content deltas (the piece's logprobs on the first), a call as OpenAI streams it:
        its index, id and name, then its arguments as they come."""
        out, logprobs = [], piece.logprobs if piece is not None else None
        for event in events:
            if isinstance(event, str):
                out.append(self.chunk(Piece(event, [], logprobs)))
                logprobs = None
            elif isinstance(event, CallStarted):
                out.append(self._call_delta({"index": event.call.index, "id": event.call.id, "type": "function",
                                             "function": {"name": event.call.name, "arguments": ""}}))
            elif isinstance(event, ArgumentsDelta):
                out.append(self._call_delta({"index": event.call.index, "function": {"arguments": event.text}}))
        if logprobs:  # every token of the piece was held back or went into a call
            out.append(self.chunk(Piece("", [], logprobs)))
        return out

    def _call_delta(self, delta: dict) -> dict:
        return self.envelope([{"index": 0, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None}],
                             self.chunk_object)

    def chunk(self, item: Piece | Final) -> dict:
        if isinstance(item, Final):
            return self.envelope([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": item.finish_reason}],
                                 self.chunk_object)
        logprobs = {"content": self._logprobs(item.logprobs)} if item.logprobs else None
        return self.envelope([{"index": 0, "delta": {"content": item.text}, "logprobs": logprobs,
                               "finish_reason": None}], self.chunk_object)

    def whole(self, pieces: list[Piece], final: Final) -> dict:
        entries = [e for p in pieces for e in (p.logprobs or [])]
        text, calls, final = whole_answer(pieces, final, self.reader is not None)
        # With tools offered, an answer that is only calls has no content, as OpenAI's.
        message = {"role": "assistant", "content": text if self.reader is None else text or None}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
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
