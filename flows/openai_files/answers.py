"""An OpenAI batch line through the engine: prepared (`prepare_jobs`), then answered (`answer`)
as the checkpoint row that holds its output line.

Preparing decides, before any request is sent, what each line needs: a chat line's
conversation rendered by the engine's chat template (many at once: a resident engine renders
them in one round trip; with its tools, flows/openai_files/tools.py), its images, the format in
which its tool calls are read (flows/openai_files/tool_calls.py), and the lines this engine
cannot serve (an embedding line on a generating engine, or the other way round; an image for a
text-only model; tools for a chat template without them; a conversation the chat template
refuses), which get error entries.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from engine import EngineAPI
from flows.config import EngineConfig
from flows.inputs.image_column import image_placeholder
from flows.inputs.prompts import chat_template_text
from flows.openai_files.requests import (
    BatchRequest,
    LineError,
    chat_conversation,
    completion_prompts,
    embedding_inputs,
    sampling_params,
    top_logprobs,
)
from flows.openai_files.responses import (
    chat_body,
    completion_body,
    embedding_body,
    engine_error,
    error_line,
    output_line,
    usage_of,
)
from flows.openai_files.tool_calls import parse_tool_calls, tool_format
from flows.openai_files.tools import ToolRequest, read_tools

RENDER_BATCH = 1024  # conversations per chat-template call


@dataclass(frozen=True)
class Job:
    request: BatchRequest
    prompt: str | None = None  # a chat line's conversation, rendered
    images: list[str] | None = None  # a chat line's image_url parts, in order
    tools: ToolRequest | None = None  # a chat line's tools
    tool_format: str | None = None  # how its text's tool calls are read (tool_calls.py)
    error: LineError | None = None  # why it cannot be served: it gets an error entry


def prepare_jobs(
    requests: list[BatchRequest], engine: EngineAPI, section: EngineConfig, tokenizer_path: str
) -> list[Job]:
    embeds = bool(section.arguments().get("is_embedding"))
    slot = _image_slot(section, tokenizer_path)
    template: list[str] = []  # the chat template's text, read for the first line with tools
    jobs: list[Job] = []
    # the conversations to render, by their tools (a template call renders one list of tools):
    # tools as JSON -> (tools, [(job index, messages)])
    groups: dict[str, tuple[list | None, list[tuple[int, list[dict[str, Any]]]]]] = {}
    for request in requests:
        if request.error is not None:
            jobs.append(Job(request, error=request.error))
        elif embeds != (request.kind == "embedding"):
            jobs.append(Job(request, error=_wrong_engine(request, embeds)))
        elif request.kind == "chat":
            try:
                messages, images = chat_conversation(request, slot)
                tools = read_tools(request.body)
                if tools is not None and not template:
                    template.append(chat_template_text(tokenizer_path))
                form = _tool_format(tools, template[0]) if tools is not None else None
            except LineError as e:
                jobs.append(Job(request, error=e))
                continue
            rendered = tools.template_tools if tools is not None else None
            key = json.dumps(rendered) if rendered is not None else ""
            groups.setdefault(key, (rendered, []))[1].append((len(jobs), messages))
            jobs.append(Job(request, images=images, tools=tools, tool_format=form))
        else:
            jobs.append(Job(request))
    for tools, chats in groups.values():
        for start in range(0, len(chats), RENDER_BATCH):
            chunk = chats[start : start + RENDER_BATCH]
            rendered = _render(engine, [m for _, m in chunk], tools)
            for (index, _), (prompt, error) in zip(chunk, rendered):
                jobs[index] = dataclasses.replace(jobs[index], prompt=prompt, error=error)
    return jobs


def _tool_format(tools: ToolRequest, template: str) -> str | None:
    """How the line's calls are read: the template's format (for tool_choice auto), or None
    (forced calls are JSON by construction; tool_choice none reads none). LineError where the
    template cannot serve the line's tools."""
    if tools.choice == "none":
        return None
    if "tools" not in template:
        raise LineError("the model's chat template renders no tools (it never reads `tools`): "
                        "the model was not made to call them", param="tools")  # fmt: skip
    form = tool_format(template)
    if form is None and tools.choice == "auto":
        raise LineError("tool_choice 'auto' reads the calls the model writes in its chat "
                        "template's format, and this template's is none of hermes (<tool_call>) "
                        "or llama3 (JSON with \"parameters\"); give tool_choice 'required' or a "
                        "named function, whose calls are constrained", param="tool_choice")  # fmt: skip
    return form


async def answer(engine: EngineAPI, job: Job, model: str, seed: int) -> dict[str, Any]:
    """The job's checkpoint row (flows/openai_batch.py SCHEMA); `model` names the model where
    the body does not, `seed` samples where the body gives none."""
    request, error = job.request, job.error
    if error is None:
        try:
            line = output_line(request, await _body(engine, job, request.model or model, seed))
        except LineError as e:
            error = e
        except ValueError as e:  # the engine refused the request: this line fails, no other
            error = engine_error(e)
            if job.tools is not None and job.tools.forced and str(e).startswith("json_schema"):
                error = LineError(f"tools: a function's parameters are not a JSON schema the "
                                  f"engine can constrain calls to ({e})", param="tools")  # fmt: skip
    if error is not None:
        line = error_line(request, error)
    prompt, completion, cached = usage_of(line)
    return {
        "id": request.key,
        "line": request.line,
        "custom_id": request.custom_id,
        "status_code": None if error is not None else 200,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "error": line["error"]["message"] if error is not None else None,
        "output": json.dumps(line, ensure_ascii=False),
    }


async def _body(engine: EngineAPI, job: Job, model: str, seed: int) -> dict[str, Any]:
    request = job.request
    if request.kind == "embedding":  # (the run's engine embeds: prepare_jobs saw to it)
        body = request.body
        results = await engine.async_encode(
            embedding_inputs(request), dimensions=body.get("dimensions")
        )
        return embedding_body(results, model, body.get("encoding_format", "float"))
    params = sampling_params(request, seed)
    top = top_logprobs(request)
    logprobs = {"return_logprob": top is not None, "top_logprobs_num": top or None,
                "return_text_in_logprobs": top is not None}  # fmt: skip
    if request.kind == "chat":
        results = await engine.async_generate(
            prompt=job.prompt, sampling_params=params, image_data=job.images or None, **logprobs
        )
        calls = functools.partial(parse_tool_calls, tools=job.tools, form=job.tool_format)
        return chat_body(_listed(results), model, top, calls)
    texts, ids = completion_prompts(request)
    echo = bool(request.body.get("echo"))
    if echo and texts is None:
        raise LineError("echo needs text prompts (the prompt is token ids)", param="echo")
    if echo and top is not None:  # the prompt's logprobs too, from its first token
        logprobs["logprob_start_len"] = 0
    results = await engine.async_generate(
        prompt=texts, input_ids=ids, sampling_params=params, **logprobs
    )
    return completion_body(_listed(results), texts or [], params.get("n", 1), model, top, echo)


def _listed(results: dict | list[dict]) -> list[dict]:
    return results if isinstance(results, list) else [results]


def _wrong_engine(request: BatchRequest, embeds: bool) -> LineError:
    if embeds:
        why = "this run's engine embeds (engine.is_embedding): it does not generate"
    else:
        why = "this run's engine generates: embeddings need an embedding model, in a batch file of their own"
    return LineError(f"{why}", "unsupported_url", "url")


def _image_slot(section: EngineConfig, tokenizer_path: str) -> str | None:
    """The model's image slot where it takes images, else None."""
    from engine import ModelConfig

    model_path = section.arguments()["model_path"]
    if not ModelConfig.from_folder(str(model_path)).is_vision_language:
        return None
    return image_placeholder(model_path, tokenizer_path)


def _render(
    engine: EngineAPI, conversations: list[list[dict[str, Any]]], tools: list | None
) -> list[tuple]:
    """(prompt, None) per conversation, or (None, error) for one the chat template refuses;
    all in one call, one by one only when that call fails. `tools` go to the template as
    transformers takes them (None: the conversations have none)."""
    template = _chat_template(engine)
    extra = {"tools": tools} if tools is not None else {}
    try:
        prompts = template(conversations, tokenize=False, add_generation_prompt=True, **extra)
        return [(prompt, None) for prompt in prompts]
    except Exception:  # a template raises on one bad conversation (e.g. roles out of order)
        pass
    rendered = []
    for messages in conversations:
        try:
            (prompt,) = template([messages], tokenize=False, add_generation_prompt=True, **extra)
            rendered.append((prompt, None))
        except Exception as e:
            error = LineError(f"the model's chat template refused the messages: {e}",
                              param="messages")  # fmt: skip
            rendered.append((None, error))
    return rendered


def _chat_template(engine: EngineAPI) -> Any:
    """A resident engine's renderer (its own tokenizer), else the engine's tokenizer's."""
    if hasattr(engine, "apply_chat_template"):
        return engine.apply_chat_template
    return engine.tokenizer.apply_chat_template
