"""OpenAI Batch API request lines, read and checked: what each asks the engine for.

A line of an OpenAI batch input file is one request:

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}}

`read_batch` reads every line into a `BatchRequest`. A line that cannot be served (not JSON, a
field missing or of the wrong type, an unknown body parameter, a custom_id already used) is
not an error of the run: it becomes a request with `error` set, which the flow answers with an
error entry for it, while the other lines run. The body's fields map onto SGLang's sampling
parameters as SGLang's OpenAI server maps them (`sampling_params`); the engine's own checks
stay the second line (a request it refuses also gets an error entry).

NOTE: `key` is the request's id in the checkpoint store, unique in the file: `custom_id:<id>`,
or `line:<n>` for a line with no usable custom_id (malformed, or a repeat), so the two kinds
can never collide.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from typing import Any

from flows.openai_files.errors import LineError
from flows.openai_files.tools import read_tools, template_tool_calls, tool_constraint

# endpoint -> what it asks of the engine
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
}
_COMMON = {"model", "user", "metadata", "store", "service_tier"}  # accepted, not used
_SAMPLING = {
    "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "response_format", "stream",
    # SGLang's extensions of the OpenAI API (its server takes them too)
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "regex", "ebnf",
}  # fmt: skip
BODY_FIELDS = {
    "chat": _COMMON | _SAMPLING | {
        "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
        "tools", "tool_choice", "parallel_tool_calls",
    },
    "completion": _COMMON | _SAMPLING | {"prompt", "max_tokens", "logprobs", "echo", "suffix",
                                         "best_of"},
    "embedding": _COMMON | {"input", "encoding_format", "dimensions"},
}  # fmt: skip
# OpenAI's defaults where they differ from the engine's: a completion's max_tokens is 16, a
# chat completion's is "as many as fit" (max_new_tokens None: the rest of the context)
DEFAULT_MAX_TOKENS = {"chat": None, "completion": 16}


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based, in the input file
    key: str  # the request's id in the checkpoint store (see the module's NOTE)
    custom_id: str | None
    kind: str | None  # chat, completion or embedding (ENDPOINTS)
    body: dict[str, Any]
    error: LineError | None = None

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None


def read_batch(data: bytes) -> list[BatchRequest]:
    """Every non-blank line of a batch input file's bytes, in order; malformed lines included,
    each with its error."""
    requests: list[BatchRequest] = []
    first_line: dict[str, int] = {}  # custom_id -> the line that has it
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        request = parse_line(raw, number)
        custom_id = request.custom_id
        if custom_id is not None and custom_id in first_line:
            error = LineError(
                f"custom_id {custom_id!r} is already used on line {first_line[custom_id]}; "
                "each request needs its own", "duplicate_custom_id", "custom_id",
            )  # fmt: skip
            request = BatchRequest(
                number, f"line:{number}", custom_id, request.kind, request.body, error
            )
        elif custom_id is not None:
            first_line[custom_id] = number
        requests.append(request)
    return requests


def parse_line(raw: bytes, number: int) -> BatchRequest:
    """One input line as a request; a line that cannot be served carries its LineError."""
    custom_id, kind, body = None, None, {}
    try:
        try:
            line = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise LineError(f"not UTF-8 ({e.reason})", "invalid_json") from None
        except json.JSONDecodeError as e:
            raise LineError(f"not JSON ({e.msg})", "invalid_json") from None
        if not isinstance(line, dict):
            raise LineError("not a JSON object", "invalid_json")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            custom_id = None
            raise LineError("custom_id must be a non-empty string", param="custom_id")
        unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
        if unknown:
            raise LineError(f"unknown field(s) {', '.join(map(repr, unknown))} in the line; a "
                            "line has custom_id, method, url and body")  # fmt: skip
        if line.get("method") != "POST":
            raise LineError(f"method must be 'POST', got {line.get('method')!r}", param="method")
        url = line.get("url")
        kind = ENDPOINTS.get(url) if isinstance(url, str) else None
        if kind is None:
            raise LineError(
                f"url {url!r} is not served{_did_you_mean(url, ENDPOINTS)}; urls: "
                f"{', '.join(ENDPOINTS)}", "unsupported_url", "url",
            )  # fmt: skip
        body = line.get("body")
        if not isinstance(body, dict):
            body = {}
            raise LineError("body must be a JSON object", param="body")
        check_body(kind, body)
    except LineError as error:
        key = f"custom_id:{custom_id}" if custom_id is not None else f"line:{number}"
        return BatchRequest(number, key, custom_id, kind, body, error)
    return BatchRequest(number, f"custom_id:{custom_id}", custom_id, kind, body)


def check_body(kind: str, body: dict[str, Any]) -> None:
    """The body's fields against OpenAI's API for its endpoint (unknown names, types, ranges,
    what the engine does not do): LineError naming the param."""
    unknown = sorted(set(body) - BODY_FIELDS[kind])
    if unknown:
        name = unknown[0]
        raise LineError(
            f"unknown parameter {name!r}{_did_you_mean(name, BODY_FIELDS[kind])}", param=name
        )
    if kind == "embedding":
        _check_embedding(body)
        return
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise LineError("messages must be a non-empty list of messages", param="messages")
    elif body.get("prompt") is None:
        raise LineError("prompt is required", param="prompt")
    if body.get("stream"):
        raise LineError("stream is not available in a batch: its responses are whole",
                        param="stream")  # fmt: skip
    if body.get("suffix"):
        raise LineError("suffix is not supported by this engine", param="suffix")
    best_of, n = body.get("best_of"), body.get("n", 1)
    if best_of is not None and best_of != n:
        raise LineError("best_of must equal n (best_of > n is not supported)", param="best_of")
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1, low_open=True)
    _number(body, "presence_penalty", -2, 2)
    _number(body, "frequency_penalty", -2, 2)
    _integer(body, "n", 1, 128)
    _integer(body, "seed", -(2**63), 2**63 - 1)
    for name in ("max_tokens", "max_completion_tokens"):
        _integer(body, name, 1, 2**31 - 1)
    if kind == "chat":
        _boolean(body, "logprobs")
        _integer(body, "top_logprobs", 0, 20)
        if body.get("top_logprobs") and not body.get("logprobs"):
            raise LineError("top_logprobs needs logprobs: true", param="top_logprobs")
        read_tools(body)
    else:
        _integer(body, "logprobs", 0, 20)
        _boolean(body, "echo")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or _strings(stop)):
        raise LineError("stop must be a string or a list of strings", param="stop")
    _response_format(body.get("response_format"))


def sampling_params(request: BatchRequest, seed: int) -> dict[str, Any]:
    """The engine's sampling parameters for a chat or completion request; `seed` where the body
    gives none (the run's seed for this request: a rerun samples the same)."""
    body, kind = request.body, request.kind
    assert kind in DEFAULT_MAX_TOKENS, kind
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    params: dict[str, Any] = {
        "max_new_tokens": DEFAULT_MAX_TOKENS[kind] if limit is None else limit,
        "sampling_seed": body["seed"] if body.get("seed") is not None else seed,
    }
    renamed = {"min_tokens": "min_new_tokens"}
    for name in ("temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty",
                 "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens",
                 "stop_token_ids", "ignore_eos", "skip_special_tokens", "regex", "ebnf"):  # fmt: skip
        if body.get(name) is not None:
            params[renamed.get(name, name)] = body[name]
    params.update(_constraint(body.get("response_format")))
    if kind == "chat":  # a forced tool call (read_tools refuses it beside another constraint)
        params.update(tool_constraint(read_tools(body)))
    return params


def top_logprobs(request: BatchRequest) -> int | None:
    """How many top logprobs per token the response lists (None: no logprobs at all)."""
    body = request.body
    if request.kind == "chat":
        return (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return body.get("logprobs")  # completions: an int, 0 meaning the sampled token's alone


def completion_prompts(request: BatchRequest) -> tuple[list[str] | None, list[list[int]] | None]:
    """A completion body's prompt(s): texts, or token ids (one prompt or a list of them)."""
    prompt = request.body["prompt"]
    if isinstance(prompt, str):
        return [prompt], None
    if _strings(prompt) and prompt:
        return prompt, None
    if _token_ids(prompt):
        return None, [prompt]
    if isinstance(prompt, list) and prompt and all(_token_ids(p) for p in prompt):
        return None, prompt
    raise LineError("prompt must be a string, a list of strings, a list of token ids or a list "
                    "of such lists", param="prompt")  # fmt: skip


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "tool"}  # fmt: skip


def chat_conversation(
    request: BatchRequest, image_slot: str | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """A chat body's messages as the chat template takes them (role and text content; an
    assistant's tool_calls, a tool message's tool_call_id), and the images of its image_url
    parts in order. An image part's place in the text holds the model's image slot
    (`image_slot`; None: the model takes text only, and an image is refused). OpenAI's
    `developer` role is a system message."""
    messages, images = [], []
    for i, message in enumerate(request.body["messages"]):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            got = message.get("role") if isinstance(message, dict) else message
            raise LineError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {got!r}",
                            param=f"{where}.role")  # fmt: skip
        content, role = message.get("content"), message["role"]
        calls = message.get("tool_calls") if role == "assistant" else None
        if content is None and calls is not None:  # an assistant turn of calls alone
            content = ""
        if isinstance(content, list):
            content = "".join(_part(part, f"{where}.content[{j}]", image_slot, images)
                              for j, part in enumerate(content))  # fmt: skip
        if not isinstance(content, str):
            raise LineError(f"{where}.content must be text or a list of content parts",
                            param=f"{where}.content")  # fmt: skip
        entry: dict[str, Any] = {"role": CHAT_ROLES[role], "content": content}
        if calls is not None:
            entry["tool_calls"] = template_tool_calls(calls, f"{where}.tool_calls")
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise LineError(f"{where}.tool_call_id must be the id of the call it answers",
                                param=f"{where}.tool_call_id")  # fmt: skip
            entry["tool_call_id"] = message["tool_call_id"]
        messages.append(entry)
    return messages, images


def _part(part: Any, where: str, image_slot: str | None, images: list[str]) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise LineError(f"{where}.image_url needs a url", param=where)
        if image_slot is None:
            raise LineError(f"{where} is an image, and this model takes text only: images need "
                            "a vision-language model (Qwen2.5-VL)", param=where)  # fmt: skip
        images.append(url)
        return image_slot
    raise LineError(f"{where} must be a text part or an image_url part", param=where)


def embedding_inputs(request: BatchRequest) -> list[str]:
    inputs = request.body["input"]
    return [inputs] if isinstance(inputs, str) else inputs


# ---------------------------------------------------------------------- checks
def _check_embedding(body: dict[str, Any]) -> None:
    inputs = body.get("input")
    if isinstance(inputs, list) and inputs and (_token_ids(inputs) or all(map(_token_ids, inputs))):
        raise LineError("input as token ids is not supported by this engine: send text",
                        param="input")  # fmt: skip
    if not (isinstance(inputs, str) and inputs) and not (_strings(inputs) and inputs):
        raise LineError("input must be a non-empty string or list of strings", param="input")
    if body.get("encoding_format", "float") not in ("float", "base64"):
        raise LineError(
            f"encoding_format must be 'float' or 'base64', got {body['encoding_format']!r}",
            param="encoding_format",
        )
    _integer(body, "dimensions", 1, 2**31 - 1)


def _response_format(value: Any) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise LineError("response_format.type must be 'text', 'json_object' or 'json_schema'",
                        param="response_format")  # fmt: skip
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise LineError("response_format.json_schema needs a schema object",
                            param="response_format")  # fmt: skip


def _constraint(value: Any) -> dict[str, Any]:
    """response_format as the engine's constrained output."""
    if not value or value.get("type") == "text":
        return {}
    if value["type"] == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    return {"json_schema": json.dumps(value["json_schema"]["schema"])}


def _number(body: dict[str, Any], name: str, low: float, high: float, low_open=False) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LineError(f"{name} must be a number, got {value!r}", param=name)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise LineError(f"{name} must be in {bracket}{low}, {high}], got {value}", param=name)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise LineError(f"{name} must be an integer, got {value!r}", param=name)
    if not low <= value <= high:
        raise LineError(f"{name} must be in [{low}, {high}], got {value}", param=name)


def _boolean(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise LineError(f"{name} must be true or false, got {value!r}", param=name)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _did_you_mean(name: object, known: Any) -> str:
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
