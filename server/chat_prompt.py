"""A chat's messages (and tools) rendered by the model's chat template into its prompt.

A template that renders tools itself (Qwen's, Hermes') gets them as transformers passes them, with
the history's calls and results as structured messages, as llama-server's --jinja does. A template
that ignores them (SmolLM2-135M's) gets them described in the system message, the calls in the
history written out in the same form and the results wrapped in <tool_response> tags
(server.tool_calls).
"""
from __future__ import annotations

import functools

from server.protocol import APIError, ChatMessage, Tool
from server.tool_calls import call_text, tool_system_text

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_name", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@functools.lru_cache(maxsize=8)
def renders_tools(tokenizer) -> bool:
    """Whether the template puts tools in the prompt: a conversation rendered with one differs."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        return tokenizer.hf.apply_chat_template(messages, tools=[_PROBE_TOOL], chat_template=tokenizer.chat_template,
                                                tokenize=False, add_generation_prompt=True) != \
            tokenizer.apply_chat_template(messages)
    except Exception:  # a template that fails on tools does not render them
        return False


def render_chat(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None = None) -> str:
    """The prompt text; tools None or empty: none offered (tool_choice "none" offers none)."""
    try:
        if tools and renders_tools(tokenizer):
            return tokenizer.hf.apply_chat_template(
                [_structured(m) for m in messages], tools=[t.model_dump(exclude_none=True) for t in tools],
                chat_template=tokenizer.chat_template, tokenize=False, add_generation_prompt=True)
        plain = [_written_out(m) for m in messages]
        if tools:
            plain = _with_system_text(plain, tool_system_text(tools))
        return tokenizer.apply_chat_template(plain)
    except APIError:
        raise
    except Exception as e:  # jinja's own errors name the problem (e.g. roles must alternate)
        raise APIError(400, f"messages: the chat template refused them: {e}") from e


def _structured(m: ChatMessage) -> dict:
    out = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": c.function.arguments_object}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _written_out(m: ChatMessage) -> dict:
    text = m.text()
    if m.tool_calls:
        calls = "\n".join(call_text(c.function.name, c.function.arguments_object) for c in m.tool_calls)
        text = f"{text}\n{calls}" if text else calls
    if m.role == "tool":
        text = f"<tool_response>\n{text}\n</tool_response>"
    return {"role": m.role, "content": text}


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{"role": messages[0]["role"], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
