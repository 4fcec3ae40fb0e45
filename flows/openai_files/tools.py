"""A chat line's `tools`, `tool_choice` and `parallel_tool_calls`, as OpenAI's API takes them:
checked (`read_tools`), rendered by the model's chat template (`ToolRequest.template_tools`,
`template_tool_calls`) and, where a call is forced, constrained (`tool_constraint`).

What each tool_choice does:
  - "auto" (the default with tools): the chat template renders the tools, the model writes calls
    or text as it likes, and its text is parsed for calls in the format its chat template
    taught it (tool_calls.py).
  - "none": as SGLang's OpenAI server does, the tools are not rendered and nothing is parsed: the
    model answers in text (earlier calls and tool results in the conversation still render).
  - "required", or {"type": "function", "function": {"name": ...}}: the tools are rendered and
    the output is constrained by the engine's json_schema, as vLLM does, so the call is always
    well-formed and always parses: for a named function the output IS its arguments (a JSON
    object of its `parameters` schema); for "required" a JSON array of {"name", "parameters"}
    objects, each item one of the tools (anyOf), each item a call. parallel_tool_calls false
    caps the array at one item.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from flows.openai_files.errors import LineError

TOOL_CHOICES = ("none", "auto", "required")
_CHOICE_FORM = """'none', 'auto', 'required' or {"type": "function", "function": {"name": ...}}"""
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# a function without `parameters` takes none (OpenAI: "an empty parameter list")
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat line asks of tools. NOTE: `function` is set exactly when choice is
    "function", and names one of `functions`."""

    functions: tuple[dict[str, Any], ...]  # each tool's function: name, description, parameters
    choice: str  # "none", "auto", "required", or "function" (the one named in `function`)
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls: false allows one call at most

    @property
    def forced(self) -> bool:
        """Whether the output is constrained to calls (required, or a named function)."""
        return self.choice in ("required", "function")

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template takes them (transformers' JSON-schema tool format, which
        is OpenAI's tool entry: {"type": "function", "function": {...}}); None for tool_choice
        none, whose tools are not rendered."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": function} for function in self.functions]

    def parameters(self, name: str) -> dict[str, Any]:
        (function,) = (f for f in self.functions if f["name"] == name)
        return function.get("parameters") or _NO_PARAMETERS


def read_tools(body: dict[str, Any]) -> ToolRequest | None:
    """A chat body's tool fields, checked; None where the line has no tools (a tool_choice of
    'none' or 'auto' alone asks nothing). LineError naming the field."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise LineError(f"parallel_tool_calls must be true or false, got {parallel!r}",
                        param="parallel_tool_calls")  # fmt: skip
    tools = body.get("tools")
    functions = _functions(tools) if tools is not None else ()
    choice, function = _choice(body.get("tool_choice"), functions)
    if not functions:
        if choice in ("required", "function"):
            raise LineError(f"tool_choice {body['tool_choice']!r} needs tools: give the "
                            "functions in tools", param="tool_choice")  # fmt: skip
        return None
    forced = choice in ("required", "function")
    others = [name for name in ("regex", "ebnf") if body.get(name) is not None]
    if (body.get("response_format") or {}).get("type") in ("json_object", "json_schema"):
        others.insert(0, "response_format")
    if forced and others:
        raise LineError(f"tool_choice {body['tool_choice']!r} constrains the output to tool calls; "
                        f"it cannot be combined with {others[0]}", param="tool_choice")  # fmt: skip
    return ToolRequest(functions, choice, function, parallel is not False)


def tool_constraint(tools: ToolRequest | None) -> dict[str, str]:
    """The engine's json_schema that forces the line's call (see the module's docstring); no
    constraint for 'auto' and 'none'."""
    if tools is None or not tools.forced:
        return {}
    if tools.choice == "function":
        assert tools.function is not None
        return {"json_schema": json.dumps(tools.parameters(tools.function))}
    calls = [
        {
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": tools.parameters(f["name"]),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in tools.functions
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"type": "object", "anyOf": calls},
                              "minItems": 1}  # fmt: skip
    if not tools.parallel:
        schema["maxItems"] = 1
    return {"json_schema": json.dumps(schema)}


def template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool_calls as chat templates take them.

    NOTE: OpenAI gives each call's arguments as a JSON string; chat templates write them with
    `tojson` and want the object (transformers' format), so the string is parsed here."""
    if not isinstance(calls, list) or not calls:
        raise LineError(f"{where} must be a non-empty list of tool calls", param=where)
    converted = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise LineError(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": "
                            "{\"name\", \"arguments\"}}", param=at)  # fmt: skip
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise LineError(f"{at}.function.arguments is not JSON ({e.msg})",
                                param=f"{at}.function.arguments") from None  # fmt: skip
        if not isinstance(arguments, dict):
            raise LineError(f"{at}.function.arguments must be a JSON object (as a string, as "
                            "OpenAI gives it)", param=f"{at}.function.arguments")  # fmt: skip
        entry: dict[str, Any] = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
        entry.update(type="function", function={"name": function["name"], "arguments": arguments})
        converted.append(entry)
    return converted


# ---------------------------------------------------------------------- checks
def _functions(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list) or not tools:
        raise LineError('tools must be a non-empty list of {"type": "function", "function": '
                        '{"name", "description", "parameters"}}', param="tools")  # fmt: skip
    first: dict[str, int] = {}  # name -> the tool that has it
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else tool
        if kind != "function":
            raise LineError(f"{where}.type must be 'function', got {kind!r}", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise LineError(f"{where}.function must be an object with a name",
                            param=f"{where}.function")  # fmt: skip
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise LineError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                            f"'-', got {name!r}", param=f"{where}.function.name")  # fmt: skip
        if name in first:
            raise LineError(f"{where}.function.name {name!r} is already tools[{first[name]}]'s; "
                            "each tool needs its own", param=f"{where}.function.name")  # fmt: skip
        first[name] = i
        unknown = sorted(set(function) - set(_FUNCTION_FIELDS))
        if unknown:
            raise LineError(f"unknown field(s) {', '.join(map(repr, unknown))} in {where}.function"
                            f"; a function has {', '.join(_FUNCTION_FIELDS)}",
                            param=f"{where}.function")  # fmt: skip
        for field, kind, what in (("description", str, "a string"),
                                  ("parameters", dict, "a JSON schema object"),
                                  ("strict", bool, "true or false")):  # fmt: skip
            value = function.get(field)
            if value is not None and not isinstance(value, kind):
                raise LineError(f"{where}.function.{field} must be {what}, got {value!r}",
                                param=f"{where}.function.{field}")  # fmt: skip
    return tuple(tool["function"] for tool in tools)


def _choice(choice: Any, functions: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    """(kind, the named function) of a tool_choice; OpenAI's default: auto with tools."""
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, str):
        if choice in TOOL_CHOICES:
            return choice, None
        raise LineError(f"tool_choice must be {_CHOICE_FORM}, got {choice!r}", param="tool_choice")
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type") != "function":
        raise LineError(f"tool_choice must be {_CHOICE_FORM}, got {choice!r}", param="tool_choice")
    names = [f["name"] for f in functions]
    name = function.get("name")
    if name not in names:
        known = ", ".join(map(repr, names)) if names else "no tools are given"
        raise LineError(f"tool_choice.function.name {name!r} is not one of the tools: {known}",
                        param="tool_choice.function.name")  # fmt: skip
    return "function", name
