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
import re
import uuid
from dataclasses import dataclass

from engine.sched.grammar import embedded_schema
from server.generation import Final, Piece
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
    arguments: str = ""  # JSON text, as OpenAI sends it: valid JSON once the call is complete
    id: str = ""
    index: int = 0  # its place among the answer's calls
    complete: bool = False  # whole and parsed (not cut off by the answer's end)
    raw: str = ""  # the text after its opening tag, for an answer read whole where it was cut off

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallStarted:
    call: Call  # its id, index and name; the arguments follow


@dataclass
class ArgumentsDelta:
    call: Call
    text: str


@dataclass
class CallEnded:
    call: Call  # call.complete says whether it parsed; an incomplete one was cut off


Event = str | CallStarted | ArgumentsDelta | CallEnded
# A call's opening as models write it: the name, then the arguments, whose text is then streamed as
# it comes. A call written otherwise (arguments first, arguments as a JSON string) is read whole
# when it closes.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=[{\[])')


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole call's body, or None."""
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
    return value["name"], json.dumps(arguments)


class CallReader:
    """Splits an answer into text and calls as it streams (events: text, CallStarted,
    ArgumentsDelta, CallEnded). Text up to an opening tag passes at once, less any tail that could
    begin one; a call starts once its name is read, its arguments pass on as they come, and it ends
    at its closing tag (or the answer's end). A block that does not parse as a call passes on as text."""

    def __init__(self):
        self._held = ""
        self._call: Call | None = None  # the call being read, once started
        self._body: str | None = None  # the text after the opening tag, while in a block
        self._depth, self._in_string, self._escaped = 0, False, False
        self._args_done = False
        self._after_call = False
        self.started: list[Call] = []
        self.calls: list[Call] = []  # the complete ones

    def push(self, text: str) -> list[Event]:
        self._held += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list[Event]) -> bool:
        """One move through what is held; False when it needs more text."""
        if self._body is None:
            if self._after_call:  # the newline between a closing tag and what follows is not text
                self._held = self._held.lstrip("\n")
                if not self._held:
                    return False
                self._after_call = False
            start = self._held.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, OPEN)
                _text(events, self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                return False
            _text(events, self._held[:start])
            self._held, self._body = self._held[start + len(OPEN):], ""
            return True
        close = self._held.find(CLOSE)
        if self._call is None:
            head = _HEAD.match(self._held)
            if head and (close < 0 or head.end() <= close):
                self._start(events, json.loads(f'"{head[1]}"'))
                self._body += self._held[:head.end()]
                self._held = self._held[head.end():]
                return True
            if close < 0:
                return False
            self._body += self._held[:close]
            self._held = self._held[close + len(CLOSE):]
            self._whole(events, closed=True)
            return True
        if not self._args_done:
            n = self._scan(self._held if close < 0 else self._held[:close])
            if n:
                self._call.arguments += self._held[:n]
                events.append(ArgumentsDelta(self._call, self._held[:n]))
                self._body += self._held[:n]
                self._held = self._held[n:]
            if not self._args_done:
                return False if close < 0 else self._end(events, closed=True)
            return True
        if close < 0:
            return False
        return self._end(events, closed=True)

    def _scan(self, text: str) -> int:
        """How much of `text` belongs to the arguments' JSON value (its nesting followed)."""
        for i, ch in enumerate(text):
            if self._in_string:
                self._escaped, self._in_string = not self._escaped and ch == "\\", self._escaped or ch != '"'
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._args_done = True
                    return i + 1
        return len(text)

    def _start(self, events: list[Event], name: str) -> Call:
        self._call = Call(name, index=len(self.started))
        self.started.append(self._call)
        events.append(CallStarted(self._call))
        return self._call

    def _end(self, events: list[Event], closed: bool) -> bool:
        """The block ends (closed by its tag, or by the answer's end) after a started call."""
        call = self._call
        close = self._held.find(CLOSE) if closed else -1
        if close >= 0:
            self._body += self._held[:close]
            self._held = self._held[close + len(CLOSE):]
        call.raw = self._body
        try:
            json.loads(call.arguments)
            call.complete = self._args_done
        except ValueError:
            call.complete = False
        if call.complete:
            self.calls.append(call)
        events.append(CallEnded(call))
        self._reset()
        return True

    def _whole(self, events: list[Event], closed: bool) -> None:
        """A block that never started a call: a call read whole, or text."""
        parsed = _parse_call(self._body.strip())
        if parsed is None:
            _text(events, OPEN + self._body + (CLOSE if closed else ""))
        else:
            call = self._start(events, parsed[0])
            call.arguments, call.raw, call.complete = parsed[1], self._body, True
            self.calls.append(call)
            events += [ArgumentsDelta(call, call.arguments), CallEnded(call)]
        self._reset()
        self._after_call = parsed is not None

    def _reset(self) -> None:
        self._call, self._body, self._after_call = None, None, True
        self._depth, self._in_string, self._escaped, self._args_done = 0, False, False, False

    def finish(self) -> list[Event]:
        """The answer ended: what is still held, as text or the end of a call."""
        events: list[Event] = []
        if self._body is None:
            _text(events, self._held)
        elif self._call is None:
            self._body += self._held
            self._whole(events, closed=False)
        else:
            self._body += self._held
            self._end(events, closed=False)
        self._held = ""
        return events


def _text(events: list[Event], text: str) -> None:
    if text:
        events.append(text)


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
    """A whole answer's text and complete calls; a call the answer's end cut off stays text."""
    reader = CallReader()
    parts = []
    for event in reader.push(text) + reader.finish():
        if isinstance(event, str):
            parts.append(event)
        elif isinstance(event, CallEnded) and not event.call.complete:
            parts.append(OPEN + event.call.raw)
    out = "".join(parts)
    return (out.strip() if reader.calls else out), reader.calls


def whole_answer(pieces: list[Piece], final: Final, calls: bool) -> tuple[str, list[Call], Final]:
    """A whole answer's text, its complete calls (calls: it may hold them) and its end."""
    text = "".join(p.text for p in pieces)
    if not calls:
        return text, [], final
    text, found = read_calls(text)
    return text, found, ended(final, found)
