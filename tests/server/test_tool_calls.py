"""Tool calls: read out of an answer whole or streamed in any split, required by a grammar that a
valid call passes and an invalid one does not, and offered to the model by its template when it
renders tools, else in its system message."""
from __future__ import annotations

import json

import pytest

from engine.files.tokenizer import Tokenizer
from engine.sched.grammar import Grammars, GrammarSpec
from server.chat_prompt import render_chat, renders_tools
from server.protocol import ChatMessage, Tool
from server.tool_calls import ArgumentsDelta, CallEnded, CallReader, CallStarted, call_grammar, read_calls

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}})
ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>')


def test_a_whole_answer_gives_its_text_and_each_call_with_json_arguments():
    text, calls = read_calls(ANSWER)
    assert text == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_streamed_answer_gives_the_same_in_any_split(size):
    reader, events = CallReader(), []
    for i in range(0, len(ANSWER), size):
        got = reader.push(ANSWER[i:i + size])
        assert all("<" not in e for e in got if isinstance(e, str)), "text that could begin a call was passed on"
        events += got
    events += reader.finish()
    assert "".join(e for e in events if isinstance(e, str)) == "Let me check.\n"
    kinds = [type(e).__name__ for e in events if not isinstance(e, str)]
    assert kinds[0] == "CallStarted" and kinds.count("CallStarted") == kinds.count("CallEnded") == 2
    arguments = {}
    for e in events:
        if isinstance(e, ArgumentsDelta):
            arguments[e.call.index] = arguments.get(e.call.index, "") + e.text
    assert [json.loads(arguments[i]) for i in (0, 1)] == [{"city": "Paris"}, {"zone": "CET"}]
    assert [c.arguments for c in reader.calls] == [arguments[0], arguments[1]]


def test_arguments_pass_on_as_they_come_and_a_call_cut_off_ends_incomplete():
    reader = CallReader()
    started, opened = reader.push('<tool_call>\n{"name": "get_weather", "arguments": {')
    assert isinstance(started, CallStarted) and started.call.name == "get_weather" and opened.text == "{"
    assert [e.text for e in reader.push('"city": "Pa}r') if isinstance(e, ArgumentsDelta)] == ['"city": "Pa}r']
    [ended] = reader.finish()
    assert isinstance(ended, CallEnded) and not ended.call.complete and reader.calls == []
    text, calls = read_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r')
    assert calls == [] and text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r'


def test_what_does_not_parse_as_a_call_stays_text():
    assert read_calls("a <tool_call>not json</tool_call> b") == ("a <tool_call>not json</tool_call> b", [])
    text, calls = read_calls("cut short: <tool_call>\n{\"name\": \"get_wea")
    assert calls == [] and text.endswith('{"name": "get_wea')
    assert read_calls("x < y and <tool") == ("x < y and <tool", [])


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from engine.files.weights import open_model
    return Tokenizer.load(open_model(tiny_model))


def test_a_required_call_grammar_passes_a_valid_call_and_refuses_others(tokenizer):
    grammars = Grammars(tokenizer.hf, 512, frozenset([tokenizer.eos_token_id]))
    source = call_grammar([WEATHER, TIME], parallel=False)

    def passes(text: str) -> bool:
        constraint = grammars.constraint(GrammarSpec(source.kind, source.source, source.field))
        ids = tokenizer.encode(text)
        return constraint.matcher.validate_tokens(ids) == len(ids) and constraint.matcher.consume_tokens(ids) \
            and constraint.matcher.is_accepting()

    assert passes('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')
    assert passes('<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>')
    assert not passes('<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not passes('<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>')
    assert not passes('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>')
    assert not passes("Sure, the weather is fine.")


NATIVE_TEMPLATE = (  # a Hermes-style template that renders tools and structured calls itself
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

HISTORY = [ChatMessage.model_validate(m) for m in [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]]


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_structures(tokenizer):
    native = Tokenizer(tokenizer.hf, NATIVE_TEMPLATE)
    assert renders_tools(native)
    prompt = render_chat(native, HISTORY, [WEATHER, TIME])
    assert "TOOLS: get_weather get_time" in prompt
    assert '[call get_weather {"city": "Paris"}]' in prompt
    assert "<|im_start|>tool\n18 C<|im_end|>" in prompt


def test_a_template_that_ignores_tools_gets_them_in_the_system_message_and_calls_written_out(tokenizer):
    assert not renders_tools(tokenizer)
    prompt = render_chat(tokenizer, HISTORY, [WEATHER])
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather"' in prompt.split("<tools>\n")[1].split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt
    assert render_chat(tokenizer, HISTORY[:1]) == tokenizer.apply_chat_template([{"role": "user",
                                                                                   "content": "Weather in Paris?"}])
