"""Tool calls read from a model's text, each format against calls written out by hand, and
every body validated by the `openai` SDK's types; a chat line's tool fields checked, each
error naming its field. No engine."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall

from flows.openai_files.requests import read_batch, sampling_params
from flows.openai_files.responses import chat_body
from flows.openai_files.tool_calls import (
    parse_forced,
    parse_hermes,
    parse_llama3,
    parse_tool_calls,
    tool_format,
)
from flows.openai_files.tools import read_tools
from tests.flows.tool_models import HERMES_TEMPLATE, LLAMA3_TEMPLATE
from tests.tiny_models import CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}  # (no parameters: it takes none)
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def calls_of(parsed) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after the SDK's type has read the entry."""
    out = []
    for entry in parsed.calls:
        call = ChatCompletionMessageToolCall.model_validate(entry)
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        out.append((call.function.name, json.loads(call.function.arguments)))
    return out


def tools_of(**body) -> object:
    return read_tools({"messages": USER, "tools": TOOLS, **body})


def body_of(text: str, reason: dict, **body) -> ChatCompletion:
    """A chat.completion of one result whose text is `text`, for a line with these tool fields."""
    meta = {"finish_reason": reason, "prompt_tokens": 5, "completion_tokens": 9, "cached_tokens": 0}
    tools = tools_of(**body)
    form = tool_format(HERMES_TEMPLATE)
    raw = chat_body([{"text": text, "meta_info": meta}], "m", None,
                    lambda t: parse_tool_calls(t, tools, form))  # fmt: skip
    return ChatCompletion.model_validate(raw)


# ---------------------------------------------------------------------- formats
def test_the_format_is_read_off_the_chat_template():
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format(LLAMA3_TEMPLATE) == "llama3"
    assert tool_format(CHAT_TEMPLATE) is None


def test_hermes_calls_with_text_around_them():
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nOne moment.'
    )
    parsed = parse_hermes(text)
    assert calls_of(parsed) == [("get_weather", {"city": "Paris", "days": [1, 2]}),
                                ("get_time", {})]  # fmt: skip
    assert parsed.content == "Let me look.\nOne moment."
    # calls alone: no content; a last call whose </tool_call> never came still counts
    parsed = parse_hermes('<tool_call>\n{"name": "get_time", "arguments": {"zone": "ü"}}')
    assert calls_of(parsed) == [("get_time", {"zone": "ü"})] and parsed.content is None


@pytest.mark.parametrize("text", [
    "No calls here.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # no }
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>\n{"name": ',
])  # fmt: skip
def test_hermes_text_without_a_whole_call_is_no_call(text):
    assert parse_hermes(text) is None


def test_llama3_calls_after_the_python_tag_or_as_the_whole_text():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {}}')  # fmt: skip
    parsed = parse_llama3(text)
    assert calls_of(parsed) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert parsed.content is None
    parsed = parse_llama3('Sure.<|python_tag|>{"name": "get_time", "arguments": {"z": 1}};\n')
    assert calls_of(parsed) == [("get_time", {"z": 1})] and parsed.content == "Sure."
    # <|python_tag|> is a special token, gone from a text decoded without special tokens
    parsed = parse_llama3(' {"name": "get_weather", "parameters": {"city": "Lima"}}')
    assert calls_of(parsed) == [("get_weather", {"city": "Lima"})] and parsed.content is None


@pytest.mark.parametrize("text", [
    'The weather is {"warm"}.',
    '{"name": "get_weather", "parameters": {"city": "Oslo"}} and then some',
    '{"name": "get_weather", "parameters": {"city": }}',
    '<|python_tag|>{"name": "get_weather", "parameters": {}} {"name": "get_time"}',  # no ;
    '{"city": "Oslo"}',  # an object, not a call
])  # fmt: skip
def test_llama3_text_without_a_whole_call_is_no_call(text):
    assert parse_llama3(text) is None


def test_forced_outputs_are_the_calls():
    named = tools_of(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    parsed = parse_forced('{ "city" : "Paris" }', named)
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})] and parsed.content is None
    required = tools_of(tool_choice="required")
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert calls_of(parse_forced(text, required)) == [
        ("get_time", {}), ("get_weather", {"city": "Oslo"}),
    ]  # fmt: skip
    assert parse_forced('{"city": "Par', named) is None  # cut short by max_tokens
    assert parse_forced('[{"name": "get_time", "parameters": {}}, {"na', required) is None


# ---------------------------------------------------------------------- bodies
def test_a_body_with_calls_ends_with_tool_calls_and_one_without_as_the_engine_said():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    (choice,) = body_of(text, {"type": "stop", "matched": 4}).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_weather", {"city": "Oslo"})]  # fmt: skip
    # malformed JSON: the whole text is the content, and the engine's reason stays
    broken = text.replace('"Oslo"}', '"Oslo"')
    (choice,) = body_of(broken, {"type": "stop", "matched": 4}).choices
    assert choice.finish_reason == "stop" and choice.message.content == broken
    assert choice.message.tool_calls is None
    (choice,) = body_of(broken, {"type": "length", "length": 9}).choices
    assert choice.finish_reason == "length"
    # tool_choice none: nothing is read, whatever the text
    (choice,) = body_of(text, {"type": "stop", "matched": 4}, tool_choice="none").choices
    assert choice.finish_reason == "stop" and choice.message.content == text


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')  # fmt: skip
    (choice,) = body_of(text, {"type": "stop", "matched": 4}, parallel_tool_calls=False).choices
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]


# ---------------------------------------------------------------------- the line's fields
def line(**body) -> dict:
    body = {"model": "m", "messages": USER, **body}
    return {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body}


def error_of(**body):
    (request,) = read_batch(json.dumps(line(**body)).encode())
    return request.error


BAD_TOOLS = [
    ({"tools": {"type": "function"}}, "tools", "tools must be a non-empty list"),
    ({"tools": []}, "tools", "tools must be a non-empty list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function', got 'retrieval'"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "an object with a name"),
    ({"tools": [{"type": "function", "function": {"description": "d"}}]},
     "tools[0].function.name", "1 to 64 letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "already tools[0]'s"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]},
     "tools[0].function", "unknown field(s) 'params'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "a JSON schema object"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice",
     "must be 'none', 'auto', 'required' or {\"type\": \"function\""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice.function.name", "'get_news' is not one of the tools: 'get_weather', 'get_time'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "tool_choice",
     "cannot be combined with regex"),
]  # fmt: skip


@pytest.mark.parametrize("body,param,message", BAD_TOOLS)
def test_bad_tool_fields_are_errors_naming_the_field(body, param, message):
    error = error_of(**body)
    assert error is not None and error.param == param and error.code == "invalid_request"
    assert message in str(error)


def test_tool_choice_none_and_auto_alone_ask_nothing():
    assert error_of(tool_choice="none") is None and error_of(tool_choice="auto") is None
    (request,) = read_batch(json.dumps(line(tool_choice="auto")).encode())
    assert read_tools(request.body) is None


def test_forced_calls_are_json_schemas_and_auto_is_free():
    def params_of(**body):
        (request,) = read_batch(json.dumps(line(tools=TOOLS, **body)).encode())
        assert request.error is None
        return sampling_params(request, seed=0)

    assert "json_schema" not in params_of() and "json_schema" not in params_of(tool_choice="none")
    named = params_of(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named["json_schema"]) == WEATHER["function"]["parameters"]
    required = json.loads(params_of(tool_choice="required")["json_schema"])
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    assert [item["properties"]["name"] for item in required["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["get_time"]}
    ]  # fmt: skip
    assert [item["properties"]["parameters"] for item in required["items"]["anyOf"]] == [
        WEATHER["function"]["parameters"],
        {"type": "object", "properties": {}, "additionalProperties": False},
    ]
    one = json.loads(params_of(tool_choice="required", parallel_tool_calls=False)["json_schema"])
    assert one["maxItems"] == 1
