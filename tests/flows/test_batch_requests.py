"""OpenAI batch lines read and mapped onto the engine's sampling parameters, without an engine:
every line that cannot be served is an error of its own, naming what is wrong."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from flows.openai_files.requests import (
    LineError,
    chat_conversation,
    completion_prompts,
    read_batch,
    sampling_params,
    top_logprobs,
)
from flows.openai_files.responses import embedding_body, error_line

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


def line(custom_id, url=CHAT, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def read(*lines) -> list:
    raw = [item if isinstance(item, bytes) else json.dumps(item).encode() for item in lines]
    return read_batch(b"\n".join(raw) + b"\n")


def test_good_lines_become_requests_keyed_by_custom_id_in_file_order():
    requests = read(
        line("a", messages=USER),
        b"   ",  # blank lines are skipped, and still counted as lines
        line("b", "/v1/completions", prompt="x"),
        line("c", "/v1/embeddings", input=["x", "y"]),
    )
    assert [(r.line, r.key, r.kind, r.error) for r in requests] == [
        (1, "custom_id:a", "chat", None),
        (3, "custom_id:b", "completion", None),
        (4, "custom_id:c", "embedding", None),
    ]


BAD_LINES = [
    (b"{not json", "invalid_json", "not JSON", None),
    (b"\xff\xfe{}", "invalid_json", "not UTF-8", None),
    (b"[1, 2]", "invalid_json", "not a JSON object", None),
    (json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode(), "invalid_request",
     "custom_id must be a non-empty string", None),
    ({**line("x", messages=USER), "extra": 1}, "invalid_request", "unknown field(s) 'extra'", "x"),
    ({**line("x", messages=USER), "method": "GET"}, "invalid_request", "method must be 'POST'",
     "x"),
    (line("x", "/v1/chat/completion", messages=USER), "unsupported_url",
     "did you mean '/v1/chat/completions'", "x"),
    (line("x", messages=USER, temprature=0), "invalid_request",
     "unknown parameter 'temprature' (did you mean 'temperature'?)", "x"),
    (line("x", messages=USER, temperature=3), "invalid_request",
     "temperature must be in [0, 2], got 3", "x"),
    (line("x", messages=USER, top_p=0), "invalid_request", "top_p must be in (0, 1]", "x"),
    (line("x", messages=USER, n=True), "invalid_request", "n must be an integer", "x"),
    (line("x", messages=USER, max_tokens=0), "invalid_request", "max_tokens must be in [1,", "x"),
    (line("x", messages=[]), "invalid_request", "messages must be a non-empty list", "x"),
    (line("x", messages=USER, stream=True), "invalid_request", "stream is not available", "x"),
    (line("x", messages=USER, tools=[{"type": "function"}]), "invalid_request",
     "tools[0].function must be an object with a name", "x"),
    (line("x", messages=USER, top_logprobs=2), "invalid_request",
     "top_logprobs needs logprobs: true", "x"),
    (line("x", messages=USER, stop=[1]), "invalid_request", "stop must be a string or a list", "x"),
    (line("x", messages=USER, response_format={"type": "xml"}), "invalid_request",
     "response_format.type must be", "x"),
    (line("x", "/v1/completions"), "invalid_request", "prompt is required", "x"),
    (line("x", "/v1/completions", prompt="p", best_of=3), "invalid_request",
     "best_of must equal n", "x"),
    (line("x", "/v1/embeddings", input=[1, 2]), "invalid_request",
     "input as token ids is not supported", "x"),
    (line("x", "/v1/embeddings", input="a", encoding_format="int8"), "invalid_request",
     "encoding_format must be 'float' or 'base64'", "x"),
    (line("x", "/v1/embeddings", input="a", temperature=0), "invalid_request",
     "unknown parameter 'temperature'", "x"),
]  # fmt: skip


@pytest.mark.parametrize("raw,code,message,custom_id", BAD_LINES)
def test_a_line_that_cannot_be_served_carries_its_error(raw, code, message, custom_id):
    (request,) = read(raw)
    assert request.error is not None and request.error.code == code
    assert message in str(request.error)
    assert request.custom_id == custom_id
    assert request.key == (f"custom_id:{custom_id}" if custom_id else "line:1")
    entry = error_line(request, request.error)
    assert entry["response"] is None and entry["custom_id"] == custom_id
    assert entry["error"] == {"code": code, "message": f"line 1: {request.error}"}


def test_a_repeated_custom_id_is_an_error_keyed_by_its_line():
    requests = read(line("a", messages=USER), line("b", messages=USER), line("a", messages=USER))
    assert [r.key for r in requests] == ["custom_id:a", "custom_id:b", "line:3"]
    assert requests[2].error.code == "duplicate_custom_id"
    assert "already used on line 1" in str(requests[2].error)


def test_body_fields_map_onto_sampling_parameters():
    (chat,) = read(line(
        "a", messages=USER, max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9,
        n=2, stop="\n", seed=11, presence_penalty=0.1, frequency_penalty=-0.2, top_k=5,
        min_tokens=2, logprobs=True, top_logprobs=3,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object"}}},
    ))  # fmt: skip
    assert sampling_params(chat, seed=1) == {
        "max_new_tokens": 7, "sampling_seed": 11, "temperature": 0.5, "top_p": 0.9, "n": 2,
        "stop": "\n", "presence_penalty": 0.1, "frequency_penalty": -0.2, "top_k": 5,
        "min_new_tokens": 2, "json_schema": '{"type": "object"}',
    }  # fmt: skip
    assert top_logprobs(chat) == 3
    # OpenAI's defaults: a chat completion as long as the context allows, a completion 16
    # tokens; the run's seed for this line where the body gives none
    (bare_chat, bare_completion) = read(
        line("b", messages=USER), line("c", "/v1/completions", prompt="p")
    )
    assert sampling_params(bare_chat, seed=1) == {"max_new_tokens": None, "sampling_seed": 1}
    assert sampling_params(bare_completion, seed=2) == {"max_new_tokens": 16, "sampling_seed": 2}
    assert top_logprobs(bare_chat) is None and top_logprobs(bare_completion) is None
    (json_object,) = read(line("d", messages=USER, response_format={"type": "json_object"}))
    assert sampling_params(json_object, 0)["json_schema"] == '{"type": "object"}'


def test_completion_prompts_text_or_token_ids():
    texts = read(*(line(str(i), "/v1/completions", prompt=p) for i, p in enumerate(
        ["one", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])))  # fmt: skip
    assert [completion_prompts(r) for r in texts] == [
        (["one"], None), (["a", "b"], None), (None, [[1, 2, 3]]), (None, [[1, 2], [3]]),
    ]  # fmt: skip
    (mixed,) = read(line("m", "/v1/completions", prompt=["a", [1]]))
    with pytest.raises(LineError, match="prompt must be a string"):
        completion_prompts(mixed)


def test_chat_messages_text_parts_images_and_roles():
    (request,) = read(line("a", messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "?"},
        ]},
        {"role": "assistant", "content": "A square."},
    ]))  # fmt: skip
    messages, images = chat_conversation(request, "<img>")
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is <img>?"},
        {"role": "assistant", "content": "A square."},
    ]
    assert images == ["data:image/png;base64,AAAA"]
    with pytest.raises(LineError, match="takes text only"):
        chat_conversation(request, None)
    (bad_role,) = read(line("b", messages=[{"role": "robot", "content": "x"}]))
    with pytest.raises(LineError, match=r"messages\[0\]\.role must be one of"):
        chat_conversation(bad_role, None)
    (no_text,) = read(line("c", messages=[{"role": "assistant", "content": None}]))
    with pytest.raises(LineError, match=r"messages\[0\]\.content must be text"):
        chat_conversation(no_text, None)


def test_embeddings_in_openais_base64_are_the_float32_bytes():
    (request,) = read(line("e", "/v1/embeddings", input=["a", "b"], encoding_format="base64"))
    results = [
        {"embedding": [0.5, -1.25], "meta_info": {"prompt_tokens": 3}},
        {"embedding": [1.0, 2.0], "meta_info": {"prompt_tokens": 4}},
    ]
    body = embedding_body(results, "m", "base64")
    decoded = [struct.unpack("<2f", base64.b64decode(d["embedding"])) for d in body["data"]]
    assert decoded == [(0.5, -1.25), (1.0, 2.0)]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in body["data"]] == [0, 1] and body["object"] == "list"
