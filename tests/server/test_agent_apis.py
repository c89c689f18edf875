"""What agents send, through the official SDKs against the main command on the default model: a
two-turn tool flow (the model calls, the tool answers, the model answers) on OpenAI's chat
completions and Responses API and on Anthropic's Messages API, streamed and whole. A required or
named call is held to the function's parameters by a grammar, so even this 135M model calls validly."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                         "parameters": PARAMETERS}}
OTHER = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
QUESTION = "What is the weather like in Paris today?"
RESULT = "Sunny, 21 degrees celsius."
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(main_server):
    return openai.OpenAI(base_url=f"{main_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(main_server):
    return anthropic.Anthropic(base_url=main_server.url, api_key="unused", max_retries=0, timeout=120)


def check_call(name: str, arguments: str) -> dict:
    assert name == "get_weather"
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMETERS)
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_tool_round_trip(oai, stream):
    messages = [{"role": "user", "content": QUESTION}]
    choice = {"type": "function", "function": {"name": "get_weather"}} if stream else "required"
    first = dict(model="default", messages=messages, tools=[TOOL, OTHER], tool_choice=choice,
                 parallel_tool_calls=False, max_tokens=80, **GREEDY)
    if stream:
        calls, reason = {}, None
        for chunk in oai.chat.completions.create(**first, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            for part in (delta.tool_calls or []) if delta else []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                call["name"] += part.function.name or "" if part.function else ""
                call["arguments"] += part.function.arguments or "" if part.function else ""
            reason = chunk.choices[0].finish_reason if chunk.choices else reason
        assert list(calls) == [0] and calls[0]["id"].startswith("call_") and reason == "tool_calls"
        call_id, name, arguments = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
    else:
        reply = oai.chat.completions.create(**first)
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        [call] = reply.choices[0].message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    check_call(name, arguments)
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
    final = oai.chat.completions.create(model="default", messages=messages, tools=[TOOL], tool_choice="none",
                                        max_tokens=40, **GREEDY)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > 0


def test_responses_api_tool_round_trip_whole_then_streamed(oai):
    tool = {"type": "function", **TOOL["function"]}
    first = oai.responses.create(model="default", input=QUESTION, tools=[tool], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=80, **GREEDY)
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    check_call(call.name, call.arguments)
    history = [{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    with oai.responses.stream(model="default", input=history, tools=[tool], tool_choice="none",
                              max_output_tokens=30, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                     "response.incomplete")
    assert "response.output_text.delta" in kinds and final.output_text
    assert first.output_text == "" and final.usage.output_tokens > 0


def test_responses_api_text_format_json_schema(oai):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    reply = oai.responses.create(model="default", input="Is the sea salty?", max_output_tokens=30, **GREEDY,
                                 text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}})
    jsonschema.validate(json.loads(reply.output_text), schema)


def test_messages_api_tool_round_trip_whole_then_streamed(claude):
    tool = {"name": "get_weather", "description": "The current weather in a city", "input_schema": PARAMETERS}
    ask = [{"role": "user", "content": QUESTION}]
    first = claude.messages.create(model="default", max_tokens=80, messages=ask, tools=[tool],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, PARAMETERS)
    history = ask + [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    with claude.messages.stream(model="default", max_tokens=30, messages=history, tools=[tool],
                                tool_choice={"type": "none"}, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    # tool_choice none offers no tools: the prompt is the history's alone, as count_tokens counts it without them.
    counted = claude.messages.count_tokens(model="default", messages=history)
    assert counted.input_tokens == final.usage.input_tokens
    assert claude.messages.count_tokens(model="default", messages=ask, tools=[tool]).input_tokens == \
        first.usage.input_tokens


def test_messages_api_streams_a_tool_use_block(claude):
    tool = {"name": "get_weather", "description": "The current weather in a city", "input_schema": PARAMETERS}
    with claude.messages.stream(model="default", max_tokens=80, messages=[{"role": "user", "content": QUESTION}],
                                tools=[tool], tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    jsonschema.validate(final.content[-1].input, PARAMETERS)
