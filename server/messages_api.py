"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, translated onto a chat
(the same prompt, grammar and generation path as /v1/chat/completions) and its answer shaped back
into content blocks.

Supported: `system` (text or text blocks), messages of text, `tool_use` and `tool_result` blocks,
`tools` (name, description, input_schema) with `tool_choice` (auto, any, tool, none;
disable_parallel_tool_use), `max_tokens`, `stop_sequences`, sampling fields, and streaming as
message_start / content_block_* / message_delta / message_stop events. Images and documents are
refused. A stop sequence ends the answer with stop_reason "end_turn": which one matched is not kept.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from server.answers import reply
from server.chat_prompt import render_chat
from server.generation import Final, Piece
from server.openai_api import engine_error, get_state, prepare_chat
from server.protocol import APIError, Body, ChatCompletionRequest, RequestBody, translated_chat
from server.state import ServerState
from server.tool_calls import ArgumentsDelta, Call, CallEnded, CallStarted, Event, whole_answer

router = APIRouter()
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice types as OpenAI's


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(RequestBody):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(RequestBody):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def _blocks_text(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    pieces = []
    for block in blocks:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}: block of type {block.get('type')!r} is not supported here (only text)")
        pieces.append(block["text"])
    return "".join(pieces)


def _messages(body: MessagesRequest | CountTokensRequest) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": _blocks_text(body.system, "system")}] if body.system else []
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "text":
                text.append(block.get("text", ""))
            elif kind == "tool_use" and m.role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": block.get("input", {})}})
            elif kind == "tool_result" and m.role == "user":
                result = block.get("content", "")
                result = _blocks_text(result, f"{where}.{j}.content") if isinstance(result, list) else str(result)
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"Error: {result}" if block.get("is_error") else result})
            else:
                raise APIError(400, f"{where}.{j}: block of type {kind!r} is not supported in a {m.role} message")
        if text or calls:
            out.append({"role": m.role, "content": "".join(text) or None, **({"tool_calls": calls} if calls else {})})
    return out


def _tools(tools: list[dict] | None) -> list[dict] | None:
    return None if not tools else [
        {"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                          "parameters": t.get("input_schema", {"type": "object"})}} for t in tools]


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    chat = {"model": body.model, "messages": _messages(body), "max_tokens": body.max_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences}
    if body.tools:
        chat["tools"] = _tools(body.tools)
    choice = body.tool_choice or {}
    kind = choice.get("type")
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind is not None:
        if kind not in CHOICES:
            raise APIError(400, f"tool_choice.type: {kind!r} must be auto, any, tool or none")
        chat["tool_choice"] = CHOICES[kind]
    chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    return translated_chat(chat)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    state = get_state(request)
    state.check_model(body.model)
    tokenizer = state.runner.engine.tokenizer
    chat = translated_chat({"messages": _messages(body), "tools": _tools(body.tools)})
    return {"input_tokens": len(await state.prompts.prompt_ids(render_chat(tokenizer, chat.messages, chat.tools)))}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    state = get_state(request)
    chat = to_chat(body)
    prepared = await prepare_chat(state, chat)
    return await reply(state, prepared, MessageShape(state, body.model, chat.tool_mode != "none", len(prepared.prompt_ids)), request, body.stream)


class MessageShape:
    def __init__(self, state: ServerState, model: str | None, calls: bool, input_tokens: int):
        self.state, self.calls, self.input_tokens = state, calls, input_tokens
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = state.model_name if not model or model == "default" else model

    def message(self, content: list[dict], final: Final | None) -> dict:
        output = 0 if final is None else final.usage["completion_tokens"]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": None if final is None else STOP_REASONS.get(final.finish_reason, final.finish_reason),
                "stop_sequence": None, "usage": {"input_tokens": self.input_tokens, "output_tokens": output}}

    def whole(self, pieces: list[Piece], final: Final) -> dict:
        text, calls, final = whole_answer(pieces, final, self.calls)
        content = ([{"type": "text", "text": text}] if text else []) + [_tool_use(c) for c in calls]
        return {**self.message(content, final), "timings": final.timings}

    async def events(self, parts: AsyncIterator[Event | Final]) -> AsyncIterator[dict]:
        yield {"type": "message_start", "message": self.message([], None)}
        index, in_text = 0, False
        async for part in parts:
            if isinstance(part, str):
                if not in_text:
                    yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
                    in_text = True
                yield {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": part}}
                continue
            if in_text:
                yield {"type": "content_block_stop", "index": index}
                index, in_text = index + 1, False
            if isinstance(part, CallStarted):
                yield {"type": "content_block_start", "index": index,
                       "content_block": {"type": "tool_use", "id": _tool_use_id(part.call), "name": part.call.name,
                                         "input": {}}}
            elif isinstance(part, ArgumentsDelta):
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": part.text}}
            elif isinstance(part, CallEnded):
                yield {"type": "content_block_stop", "index": index}
                index += 1
            elif part.finish_reason == "error":
                yield {"type": "error", "error": {"type": "api_error", "message": engine_error(self.state).message}}
            else:
                end = self.message([], part)
                yield {"type": "message_delta", "delta": {"stop_reason": end["stop_reason"], "stop_sequence": None},
                       "usage": {"output_tokens": end["usage"]["output_tokens"]}, "timings": part.timings}
                yield {"type": "message_stop"}


def _tool_use_id(call: Call) -> str:
    return f"toolu_{call.id.removeprefix('call_')}"


def _tool_use(call: Call) -> dict:
    value = json.loads(call.arguments)
    return {"type": "tool_use", "id": _tool_use_id(call), "name": call.name,
            "input": value if isinstance(value, dict) else {"value": value}}
