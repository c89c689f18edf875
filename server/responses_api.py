"""POST /v1/responses: OpenAI's Responses API, translated onto a chat (the same prompt, grammar and
generation path as /v1/chat/completions) and its answer shaped back into output items.

Supported: `input` as text or items (messages with text parts, `function_call`,
`function_call_output`), `instructions`, function `tools` with `tool_choice` and
`parallel_tool_calls`, `text.format` (json_schema, json_object, text), `max_output_tokens`,
sampling fields, and streaming as `response.*` events. Nothing is stored: `previous_response_id`
is refused (send the whole input), and `store` is accepted and ignored.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from pydantic import Field, field_validator

from server.answers import reply
from server.generation import Final, Piece
from server.openai_api import engine_error, get_state, prepare_chat
from server.protocol import APIError, ChatCompletionRequest, RequestBody, translated_chat
from server.state import ServerState
from server.tool_calls import ArgumentsDelta, Call, CallEnded, CallStarted, Event, whole_answer

router = APIRouter()
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("previous_response_id")
    @classmethod
    def _not_stored(cls, v):
        if v is not None:
            raise ValueError("responses are not stored on this server: send the whole conversation as input")
        return v


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    pieces = []
    for part in content or []:
        if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: content part of type {part.get('type')!r} is not supported (only text)")
        pieces.append(part["text"])
    return "".join(pieces)


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input.{i}"
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise APIError(400, f"{where}.type: {kind!r} is not supported (message, function_call, "
                                "function_call_output)")
    chat = {"model": body.model, "messages": messages, "temperature": body.temperature, "top_p": body.top_p,
            "seed": body.seed, "max_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt:
        chat["response_format"] = {"type": fmt.get("type")}
    return translated_chat(chat)


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"tools.{i}.type: {tool.get('type')!r} is not supported (only function tools)")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    state = get_state(request)
    chat = to_chat(body)
    prepared = await prepare_chat(state, chat)
    return await reply(state, prepared, ResponseShape(state, body, chat.tool_mode != "none"), request, body.stream)


class ResponseShape:
    """One response: its items, whole or as the stream of events that builds them."""

    def __init__(self, state: ServerState, body: ResponsesRequest, calls: bool):
        self.state, self.body, self.calls = state, body, calls
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.model = state.model_name if not body.model or body.model == "default" else body.model
        self.sequence = 0

    def response(self, output: list[dict], final: Final | None) -> dict:
        status = "in_progress" if final is None else "incomplete" if final.finish_reason == "length" else \
            "failed" if final.finish_reason == "error" else "completed"
        usage = None
        if final is not None:
            u = final.usage
            usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                     "total_tokens": u["total_tokens"], "input_tokens_details": {"cached_tokens": final.timings["cache_n"]},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
                "parallel_tool_calls": b.parallel_tool_calls, "temperature": b.temperature, "top_p": b.top_p,
                "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
                "text": b.text or {"format": {"type": "text"}},
                **({"timings": final.timings} if final is not None else {})}

    def whole(self, pieces: list[Piece], final: Final) -> dict:
        text, calls, final = whole_answer(pieces, final, self.calls)
        output = ([_message(f"msg_{uuid.uuid4().hex}", text, "completed")] if text else []) + \
            [_function_call(c, "completed") for c in calls]
        return self.response(output, final)

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": f"response.{kind}", "sequence_number": self.sequence - 1, **fields}

    async def events(self, parts: AsyncIterator[Event | Final]) -> AsyncIterator[dict]:
        output: list[dict] = []
        yield self._event("created", response=self.response([], None))
        yield self._event("in_progress", response=self.response([], None))
        message, text, call_item = None, "", None  # the message item being written and its text; a call's
        async for part in parts:
            if isinstance(part, str):
                if message is None:
                    message, text = {**_message(f"msg_{uuid.uuid4().hex}", "", "in_progress"), "content": []}, ""
                    yield self._event("output_item.added", output_index=len(output), item=message)
                    yield self._event("content_part.added", item_id=message["id"], output_index=len(output),
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                text += part
                yield self._event("output_text.delta", item_id=message["id"], output_index=len(output),
                                  content_index=0, delta=part)
                continue
            if message is not None:  # a call or the end closes the message
                for event in self._close_message(message, text, output):
                    yield event
                message = None
            if isinstance(part, CallStarted):
                call_item = _function_call(part.call, "in_progress")
                yield self._event("output_item.added", output_index=len(output), item=call_item)
            elif isinstance(part, ArgumentsDelta):
                yield self._event("function_call_arguments.delta", item_id=call_item["id"], output_index=len(output),
                                  delta=part.text)
            elif isinstance(part, CallEnded):
                done = _function_call(part.call, "completed" if part.call.complete else "incomplete")
                yield self._event("function_call_arguments.done", item_id=done["id"], output_index=len(output),
                                  arguments=part.call.arguments)
                yield self._event("output_item.done", output_index=len(output), item=done)
                output.append(done)
            elif part.finish_reason == "error":
                yield self._event("failed", response={**self.response(output, part),
                                                      "error": {"code": "server_error",
                                                                "message": engine_error(self.state).message}})
            else:
                kind = "incomplete" if part.finish_reason == "length" else "completed"
                yield self._event(kind, response=self.response(output, part))

    def _close_message(self, message: dict, text: str, output: list[dict]):
        index, part = len(output), {"type": "output_text", "text": text, "annotations": []}
        yield self._event("output_text.done", item_id=message["id"], output_index=index, content_index=0, text=text)
        yield self._event("content_part.done", item_id=message["id"], output_index=index, content_index=0, part=part)
        done = {**message, "status": "completed", "content": [part]}
        yield self._event("output_item.done", output_index=index, item=done)
        output.append(done)


def _message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _function_call(call: Call, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}
