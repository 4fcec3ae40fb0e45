"""A model's text parsed into OpenAI tool calls, in the format its chat template taught it.

    {"role": "assistant", "content": <the text outside the calls, or null>,
     "tool_calls": [{"id": "call_…", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}

One parser per format, each returning None where the text holds no well-formed call: then the
whole text is the message's content and finish_reason what the engine said, never a half-read
call. A forced call (tool_choice required or a named function, tools.py) is JSON by
construction and read by `parse_forced`. Arguments are re-serialized JSON, whatever spacing
the model wrote.

The format is read off the chat template (`tool_format`): the template shows the model how to
call, so the same text decides how to read its calls.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flows.openai_files.tools import ToolRequest


@dataclass(frozen=True)
class ParsedCalls:
    content: str | None  # the text outside the calls (None where there is none)
    calls: list[dict[str, Any]]  # OpenAI's tool_calls entries, at least one


def tool_format(chat_template: str) -> str | None:
    """The tool-call format a chat template teaches: "hermes", "llama3", or None (unknown)."""
    # Qwen 2.5 / 3, Hermes 2 Pro, and the templates written after them
    if "<tool_call>" in chat_template:
        return "hermes"
    # Llama 3.1 / 3.2 / 3.3: a call is {"name": ..., "parameters": ...}, after <|python_tag|>
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3"
    return None


def parse_tool_calls(text: str, tools: ToolRequest | None, form: str | None) -> ParsedCalls | None:
    """A choice's calls, None where it made none (its text is then the message's content)."""
    if tools is None or tools.choice == "none":
        return None
    parsed = parse_forced(text, tools) if tools.forced else PARSERS[form](text) if form else None
    if parsed is not None and not tools.parallel:  # (a forced array has one item already)
        parsed = dataclasses.replace(parsed, calls=parsed.calls[:1])
    return parsed


# ---------------------------------------------------------------------- formats
def parse_hermes(text: str) -> ParsedCalls | None:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number of them, with
    text before, between or after. A last call whose `</tool_call>` never came (the model ended
    right after its JSON) still counts: its JSON is whole or the parse fails."""
    if "<tool_call>" not in text:
        return None
    calls, outside, end = [], [], 0
    while (start := text.find("<tool_call>", end)) >= 0:
        outside.append(text[end:start])
        inner_start = start + len("<tool_call>")
        close = text.find("</tool_call>", inner_start)
        inner = text[inner_start:] if close < 0 else text[inner_start:close]
        end = len(text) if close < 0 else close + len("</tool_call>")
        call = _call(_json(inner.strip()))
        if call is None:
            return None
        calls.append(call)
    outside.append(text[end:])
    return ParsedCalls(_content(outside), calls)


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> ParsedCalls | None:
    """Llama 3's JSON calls, `{"name": ..., "parameters": {...}}`, several separated by `;`,
    after `<|python_tag|>` (text before it is content) or as the whole text.

    NOTE: <|python_tag|> is a special token of Llama 3's tokenizer: a text decoded with
    skip_special_tokens (the default) has none left, and a call is then text that is JSON from
    its first character."""
    head, tag, body = text.partition(_PYTHON_TAG)
    if not tag:
        head, body = "", text
    body = body.strip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        call = _call(value)
        if call is None:
            return None
        calls.append(call)
        rest = body[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None  # more text after a call: not a call after all
        at = len(body) - len(rest.removeprefix(";").lstrip())
    return ParsedCalls(_content([head]), calls)


def parse_forced(text: str, tools: ToolRequest) -> ParsedCalls | None:
    """A constrained output (tools.py: tool_constraint): a named function's arguments, or
    "required"'s array of {"name", "parameters"}. None only where the output was cut short
    (max_tokens) before its JSON ended."""
    value = _json(text)
    if tools.choice == "function":
        if not isinstance(value, dict):
            return None
        return ParsedCalls(None, [tool_call(tools.function or "", value)])
    if not isinstance(value, list) or not value:
        return None
    calls = [_call(item) for item in value]
    return None if None in calls else ParsedCalls(None, calls)


PARSERS: dict[str, Callable[[str], ParsedCalls | None]] = {
    "hermes": parse_hermes,
    "llama3": parse_llama3,
}


# ---------------------------------------------------------------------- parts
def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool_calls entry; its id in OpenAI's form (call_ and 24 characters)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _content(pieces: list[str]) -> str | None:
    """The text around the calls, a line between pieces (the calls' own lines are gone)."""
    return "\n".join(p.strip() for p in pieces if p.strip()) or None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(value: Any) -> dict[str, Any] | None:
    """A call object as OpenAI's entry, None if it is not one. Models write the arguments as
    `arguments` (Hermes) or `parameters` (Llama 3), and now and then as a JSON string."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    return tool_call(value["name"], arguments) if isinstance(arguments, dict) else None
