"""OpenAI Batch API output lines, from the engine's results.

    {"id": "batch_req_…", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "req_…", "body": {<chat.completion>}},
     "error": null}

The bodies are shaped as OpenAI's objects of each endpoint (`chat.completion`, with
`tool_calls` where the model called tools; `text_completion`; an embedding `list`), with `usage`; the usage also says how many prompt
tokens came from the prefix cache (`prompt_tokens_details.cached_tokens`, as OpenAI's does).
A request that could not be served gets `response: null` and `error: {code, message}`, the
shape of OpenAI's error file lines.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

from flows.openai_files.requests import BatchRequest, LineError
from flows.openai_files.tool_calls import ParsedCalls


def _hex() -> str:
    return uuid.uuid4().hex


def output_line(request: BatchRequest, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{_hex()}",
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{_hex()}", "body": body},
        "error": None,
    }


def error_line(request: BatchRequest, error: LineError) -> dict[str, Any]:
    return {
        "id": f"batch_req_{_hex()}",
        "custom_id": request.custom_id,
        "response": None,
        "error": {"code": error.code, "message": f"line {request.line}: {error}"},
    }


# ---------------------------------------------------------------------- bodies
def chat_body(
    results: list[dict],
    model: str,
    top: int | None,
    calls: Callable[[str], ParsedCalls | None] | None = None,
) -> dict[str, Any]:
    """A chat.completion of one conversation's n results; `calls` reads a result's text for
    tool calls (None: the line has no tools)."""
    choices = []
    for index, result in enumerate(results):
        meta = result["meta_info"]
        message = {"role": "assistant", "content": result["text"], "refusal": None}
        reason = _finish_reason(meta)
        parsed = calls(result["text"]) if calls is not None else None
        if parsed is not None:  # as OpenAI's: the calls, the text beside them, and why it ended
            message.update(content=parsed.content, tool_calls=parsed.calls)
            reason = "tool_calls"
        choices.append({
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(meta, result["text"]) if top is not None else None,
            "finish_reason": reason,
        })  # fmt: skip
    return _completion("chatcmpl", "chat.completion", model, choices, _usage(results, len(results)))


def completion_body(
    results: list[dict], prompts: list[str], n: int, model: str, top: int | None, echo: bool
) -> dict[str, Any]:
    """A text_completion of each prompt's n results (results in prompt order, n per prompt)."""
    choices = []
    for index, result in enumerate(results):
        meta = result["meta_info"]
        head = prompts[index // n] if echo else ""
        logprobs = None
        if top is not None:
            logprobs = _completion_logprobs(meta, len(head), result["text"])
            if echo:  # the prompt's tokens first, as OpenAI's legacy completions give them
                logprobs = _joined(_prompt_logprobs(meta), logprobs)
        choices.append({
            "index": index,
            "text": head + result["text"],
            "logprobs": logprobs,
            "finish_reason": _finish_reason(meta),
        })  # fmt: skip
    return _completion("cmpl", "text_completion", model, choices, _usage(results, per_prompt=n))


def _completion(prefix: str, kind: str, model: str, choices: list, usage: dict) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{_hex()}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }


def embedding_body(results: list[dict], model: str, encoding_format: str) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(r["embedding"], encoding_format)}
        for i, r in enumerate(results)
    ]
    tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def usage_of(line: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of an output line (zeros for an error entry)."""
    usage = ((line.get("response") or {}).get("body") or {}).get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), cached


# ---------------------------------------------------------------------- parts
def _usage(results: list[dict], per_prompt: int) -> dict[str, Any]:
    """A prompt's n samples share it: its tokens count once (the first sample's)."""
    firsts = [r["meta_info"] for r in results[::per_prompt]]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)},
    }


def _finish_reason(meta: dict[str, Any]) -> str:
    kind = (meta.get("finish_reason") or {}).get("type")
    return "length" if kind == "length" else "stop"


def _token(text: str | None) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def _covering(meta: dict[str, Any], text: str) -> int:
    """How many of the output's logprob entries the returned text covers: OpenAI's logprobs are
    those of the text it returns, so a stop token the text leaves out (`<|im_end|>`), and the
    tokens of a stop string trimmed off it, have none."""
    entries = meta["output_token_logprobs"]
    reason = meta.get("finish_reason") or {}
    if reason.get("type") != "stop" or not entries:
        return len(entries)
    if isinstance(reason.get("matched"), int):
        last = entries[-1][2] or ""
        return len(entries) - (not last or not text.endswith(last))
    covered, length = 0, 0
    while covered < len(entries) and length < len(text):
        length += len(entries[covered][2] or "")
        covered += 1
    return covered


def _chat_logprobs(meta: dict[str, Any], text: str) -> dict[str, Any]:
    n = _covering(meta, text)
    entries = meta["output_token_logprobs"][:n]
    tops = (meta.get("output_top_logprobs") or [[] for _ in entries])[:n]
    content = [
        {
            **_token(token),
            "logprob": logprob,
            "top_logprobs": [{**_token(t), "logprob": lp} for lp, _, t in top],
        }
        for (logprob, _, token), top in zip(entries, tops)
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(meta: dict[str, Any], offset: int, text: str) -> dict[str, Any]:
    n = _covering(meta, text)
    entries = meta["output_token_logprobs"][:n]
    tops = meta.get("output_top_logprobs")
    return _legacy(entries, tops[:n] if tops else None, offset)


def _prompt_logprobs(meta: dict[str, Any]) -> dict[str, Any]:
    """The prompt's tokens as a legacy completion's logprobs (the first has none)."""
    return _legacy(meta["input_token_logprobs"], meta.get("input_top_logprobs"), 0)


def _legacy(entries: list, tops: list | None, offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for _, _, text in entries:
        offsets.append(offset)
        tokens.append(text or "")
        offset += len(text or "")
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [None if top is None else {t or "": lp for lp, _, t in top} for top in tops]
        if tops
        else None,
        "text_offset": offsets,
    }


def _joined(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    top = None
    if head["top_logprobs"] is not None or tail["top_logprobs"] is not None:
        top = (head["top_logprobs"] or [None] * len(head["tokens"])) + (
            tail["top_logprobs"] or [None] * len(tail["tokens"])
        )
    return {
        "tokens": head["tokens"] + tail["tokens"],
        "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
        "top_logprobs": top,
        "text_offset": head["text_offset"] + tail["text_offset"],
    }


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64 form: the float32 values' little-endian bytes."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


def engine_error(error: ValueError) -> LineError:
    """A request the engine refused, as its error entry (a prompt longer than the context
    gets OpenAI's code for it)."""
    text = str(error)
    code = "context_length_exceeded" if "context length" in text else "invalid_request"
    return LineError(text, code)
