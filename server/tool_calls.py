"""Tool calls in the Hermes form that Qwen, Hermes and SmolLM2's larger models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

What is here: the system text that describes tools to a template that does not render them itself
(SmolLM2-135M's does not), the grammar that makes a required call valid token by token, and the
reader that turns an answer, whole or streamed, into text and calls (docs/architecture.md, "Tools").
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass

from engine.sched.grammar import embedded_schema
from server.generation import Final
from server.protocol import GrammarSource, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_system_text(tools: list[Tool]) -> str:
    """Tools described for a model whose template does not render them."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True, by_alias=True)) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are listed "
            f"within <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "For each call, answer with a JSON object holding the function's name and arguments within "
            f'{OPEN}{CLOSE} tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def call_text(name: str, arguments) -> str:
    """One call as the model writes it (for an assistant's calls in the history)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def call_grammar(tools: list[Tool], parallel: bool, answer: GrammarSource | None = None) -> GrammarSource:
    """One call (or several, with parallel calls) of one of `tools`, each function's arguments
    following its parameters; with `answer` (a JSON schema), that answer instead of calls is allowed too."""
    one_of = embedded_schema({"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                                          "arguments": t.function.parameters},
                                         "required": ["name", "arguments"]} for t in tools]})
    calls = "call (\"\\n\" call)*" if parallel else "call"
    rules = [f'call: "{OPEN}\\n" call_json "\\n{CLOSE}"', f"call_json: %json {json.dumps(one_of)}"]
    start = f"start: {calls}"
    if answer is not None:
        start = f"start: answer | {calls}"
        schema = json.loads(answer.source) if answer.kind == "json_schema" else {"type": "object"}
        rules.append(f"answer: %json {json.dumps(embedded_schema(schema))}")
    return GrammarSource("lark", "\n".join([start, *rules]), "tools")


@dataclass
class Call:
    name: str
    arguments: str  # JSON text (always valid), as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _parse_call(body: str) -> Call | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text inside the JSON
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return Call(value["name"], json.dumps(arguments))


class CallReader:
    """Splits an answer into text and calls as it streams: text up to an opening tag passes at once
    (less any tail that could begin one), a call comes out whole when its closing tag arrives (or
    the answer ends). A block that does not parse as a call is passed on as text."""

    def __init__(self):
        self._held = ""
        self._in_call = False
        self.calls: list[Call] = []

    def push(self, text: str) -> tuple[str, list[Call]]:
        """Text to pass on now and the calls completed by `text`."""
        self._held += text
        out, calls = [], []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                out.append(self._close(self._held[:end], calls))
                self._held = self._held[end + len(CLOSE):].lstrip("\n")
                continue
            start = self._held.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, OPEN)
                out.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            out.append(self._held[:start])
            self._held, self._in_call = self._held[start + len(OPEN):], True
        return "".join(out), calls

    def finish(self) -> tuple[str, list[Call]]:
        """The answer ended: what is still held, as a call (an unclosed one that parses) or text."""
        calls: list[Call] = []
        text = self._close(self._held, calls, closed=False) if self._in_call else self._held
        self._held = ""
        return text, calls

    def _close(self, body: str, calls: list[Call], closed: bool = True) -> str:
        self._in_call = False
        call = _parse_call(body.strip())
        if call is None:
            return OPEN + body + (CLOSE if closed else "")
        calls.append(call)
        self.calls.append(call)
        return ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def ended(final: Final, calls: list[Call]) -> Final:
    """finish_reason "tool_calls" where the answer ended by itself after calling."""
    return dataclasses.replace(final, finish_reason="tool_calls") if calls and final.finish_reason == "stop" else final


def read_calls(text: str) -> tuple[str, list[Call]]:
    """A whole answer's text and calls."""
    reader = CallReader()
    head, calls = reader.push(text)
    tail, more = reader.finish()
    return (head + tail).strip() if calls or more else head + tail, calls + more
