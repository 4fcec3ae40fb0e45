"""Tools in an OpenAI batch file, through `gristmill batch` on the tiny llama under a chat
template that renders them (tests/flows/tool_models.py): a forced call (tool_choice required or
a named function) always parses, its arguments follow the tool's parameter schema, and it is
what Engine.generate gives for the prompt transformers renders, under the json_schema of vLLM's
approach written out here; the prompt is transformers' apply_chat_template with the tools, for
a Llama-3-style template too; bad tool fields are error lines naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
from openai.types.chat import ChatCompletion

from flows.cli import main
from flows.config import EngineConfig
from flows.openai_files.answers import prepare_jobs
from flows.openai_files.requests import read_batch
from flows.outputs.store import row_seed
from tests.flows.fixtures import lent_engine
from tests.flows.tool_models import HERMES_TEMPLATE, LLAMA3_TEMPLATE, tool_model
from tests.tiny_models import CHAT_TEMPLATE, SHARED_ENGINE_ARGS

# NOTE: JSON allows whitespace between any two tokens, and a random model fills it until
# max_tokens runs out; compact JSON (as a trained model writes it anyway) lets its calls end
ENGINE_ARGS = {**SHARED_ENGINE_ARGS, "constrained_json_disable_any_whitespace": True}
CHAT = "/v1/chat/completions"

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]},
        "exact": {"type": "boolean"},
    },
    "required": ["zone", "exact"],
    "additionalProperties": False,
}
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                      "parameters": parameters}}
    for name, parameters in PARAMETERS.items()
]  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTIONS = ["Weather in Paris?", "Is it cold in Oslo?", "What time is it in Lima?"]

# a conversation with a turn of calls and their results, as OpenAI takes it ...
HISTORY = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}},
        {"id": "call_b", "type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": "CET", "exact": true}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 degrees"},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
    {"role": "user", "content": "And in Oslo?"},
]  # fmt: skip
# ... and as transformers' chat templates take it: the arguments as objects
HISTORY_FOR_TEMPLATE = [
    HISTORY[0],
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 1}}},
        {"id": "call_b", "type": "function", "function": {
            "name": "get_time", "arguments": {"zone": "CET", "exact": True}}},
    ]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 degrees"},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
    HISTORY[4],
]  # fmt: skip


def line(custom_id: str, messages: list[dict], **body: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": messages, **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def user(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in lines))
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def required_schema(parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice required: an array of calls, each one of the tools."""
    calls = [{"properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in PARAMETERS.items()]  # fmt: skip
    return {"type": "array", "items": {"type": "object", "anyOf": calls}, "minItems": 1,
            **({} if parallel else {"maxItems": 1})}  # fmt: skip


@pytest.fixture(scope="module")
def hermes_dir(llama_dir, tmp_path_factory) -> Path:
    return tool_model(llama_dir, tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def tool_engine(hermes_dir):
    from engine import Engine

    with Engine(model_path=str(hermes_dir), **ENGINE_ARGS) as engine:
        yield engine


FORCED = {
    **{f"named-{i}": line(f"named-{i}", user(q), tools=TOOLS, tool_choice=NAMED, max_tokens=60,
                          **({"temperature": 0} if i == 0 else {"temperature": 1.0, "seed": i}))
       for i, q in enumerate(QUESTIONS)},
    **{f"required-{i}": line(f"required-{i}", user(QUESTIONS[0]), tools=TOOLS,
                             tool_choice="required", max_tokens=200, temperature=1.0, seed=i)
       for i in range(4)},
    "required-one": line("required-one", user(QUESTIONS[0]), tools=TOOLS, tool_choice="required",
                         parallel_tool_calls=False, max_tokens=100, temperature=1.0, seed=5),
    "history": line("history", HISTORY, tools=TOOLS, tool_choice="required", max_tokens=200,
                    temperature=0),
}  # fmt: skip
FREE = {
    "auto": line("auto", user(QUESTIONS[0]), tools=TOOLS, max_tokens=8, temperature=0),
    "none": line("none", user(QUESTIONS[0]), tools=TOOLS, tool_choice="none", max_tokens=8,
                 temperature=0),
}  # fmt: skip
BAD = {  # custom_id -> (the line's body fields, the field its error names, what it says)
    "bad-tools": ({"messages": user("x"), "tools": "get_weather"}, "tools",
                  "tools must be a non-empty list"),
    "bad-name": ({"messages": user("x"), "tools": [{"type": "function", "function": {
        "description": "no name"}}]}, "tools[0].function.name", "1 to 64 letters"),
    "bad-choice": ({"messages": user("x"), "tools": TOOLS, "tool_choice": "any"}, "tool_choice",
                   "tool_choice must be 'none', 'auto', 'required' or"),
    "bad-named": ({"messages": user("x"), "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_news"}}}, "tool_choice.function.name",
        "'get_news' is not one of the tools: 'get_weather', 'get_time'"),
    "bad-arguments": ({"messages": [HISTORY[0], {**HISTORY[1], "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{zone}"}}]}],
        "tools": TOOLS}, "messages[1].tool_calls[0].function.arguments", "is not JSON"),
    "bad-schema": ({"messages": user("x"), "tool_choice": "required", "tools": [{
        "type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"a": {"type": "strin"}}}}}]}, "tools",
        "not a JSON schema the engine can constrain calls to"),
    "bad-tool-message": ({"messages": [*HISTORY[:2], {"role": "tool", "content": "18"}],
                          "tools": TOOLS}, "messages[2].tool_call_id", "the id of the call"),
}  # fmt: skip


@pytest.fixture(scope="module")
def answers(prefect_api, tool_engine, hermes_dir, tmp_path_factory) -> dict[str, dict]:
    """The batch of FORCED, FREE and BAD lines answered by `gristmill batch` on the tool
    engine: each custom_id's output line (from the output file or the error file)."""
    root = tmp_path_factory.mktemp("tools")
    bad = [{"custom_id": k, "method": "POST", "url": CHAT, "body": {"model": "m", **body}}
           for k, (body, _, _) in BAD.items()]  # fmt: skip
    source = write_lines(root / "requests.jsonl", [*FORCED.values(), *FREE.values(), *bad])
    output = root / "results.jsonl"
    sets = [f"engine.{k}={json.dumps(v)}" for k, v in ENGINE_ARGS.items()]
    command = ["batch", "-i", str(source), "-o", str(output), "--model", str(hermes_dir),
               "--set", f"output_dir={root / 'runs'}", *(a for s in sets for a in ("--set", s))]  # fmt: skip
    with lent_engine(tool_engine, {"model_path": str(hermes_dir), **ENGINE_ARGS}):
        assert main(command) == 0
    lines = read_lines(output) + read_lines(root / "results_errors.jsonl")
    return {o["custom_id"]: o for o in lines}


def reference(engine: Any, item: dict[str, Any], messages: list[dict], schema: dict) -> dict:
    """Engine.generate on the prompt transformers renders with the tools, under `schema`."""
    body = item["body"]
    prompt = engine.tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    seed = body.get("seed", row_seed(0, f"custom_id:{item['custom_id']}"))
    params = {"max_new_tokens": body["max_tokens"], "temperature": body["temperature"],
              "sampling_seed": seed, "json_schema": json.dumps(schema)}  # fmt: skip
    return engine.generate(prompt, params)


def test_forced_calls_parse_follow_the_schema_and_equal_engine_generate(answers, tool_engine):
    for custom_id, item in FORCED.items():
        body = item["body"]
        named = isinstance(body["tool_choice"], dict)
        messages = HISTORY_FOR_TEMPLATE if custom_id == "history" else body["messages"]
        schema = (
            WEATHER_PARAMETERS if named else required_schema(body.get("parallel_tool_calls", True))
        )
        want = reference(tool_engine, item, messages, schema)
        assert want["meta_info"]["finish_reason"]["type"] == "stop", (custom_id, want["text"])
        # the reference's calls: its text is the JSON the schema forced, read by json.loads
        value = json.loads(want["text"])
        want_calls = (
            [("get_weather", value)] if named else [(c["name"], c["parameters"]) for c in value]
        )
        response = answers[custom_id]["response"]
        assert response is not None and response["status_code"] == 200, answers[custom_id]
        completion = ChatCompletion.model_validate(response["body"])
        (choice,) = completion.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        assert got == want_calls, custom_id
        for name, arguments in got:
            jsonschema.validate(arguments, PARAMETERS[name])
        assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        if body.get("parallel_tool_calls") is False:
            assert len(calls) == 1
        usage, meta = completion.usage, want["meta_info"]
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            meta["prompt_tokens"], meta["completion_tokens"]
        )  # fmt: skip
    # the sampled lines called both tools (several calls in one output: test_tool_calls.py; the
    # tiny model closes its array after the first)
    required = [answers[k]["response"]["body"]["choices"][0]["message"]["tool_calls"]
                for k in FORCED if k.startswith("required")]  # fmt: skip
    assert {c["function"]["name"] for calls in required for c in calls} == set(PARAMETERS)


def test_auto_reads_the_text_and_none_renders_no_tools(answers, tool_engine):
    tokenizer = tool_engine.tokenizer
    for custom_id, tools in (("auto", TOOLS), ("none", None)):
        item = FREE[custom_id]
        prompt = tokenizer.apply_chat_template(
            item["body"]["messages"], tools=tools, tokenize=False, add_generation_prompt=True
        )
        seed = row_seed(0, f"custom_id:{custom_id}")
        want = tool_engine.generate(
            prompt, {"max_new_tokens": 8, "temperature": 0, "sampling_seed": seed}
        )
        assert "<tool_call>" not in want["text"]  # (a random model's text: no call in it)
        completion = ChatCompletion.model_validate(answers[custom_id]["response"]["body"])
        (choice,) = completion.choices
        assert choice.message.content == want["text"] and choice.message.tool_calls is None
        assert choice.finish_reason == want["meta_info"]["finish_reason"]["type"]
        assert completion.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    # tool_choice none renders the conversation without its tools: the prompt is shorter
    prompts = {k: answers[k]["response"]["body"]["usage"]["prompt_tokens"] for k in FREE}
    assert prompts["none"] < prompts["auto"]


def test_bad_tool_fields_are_error_lines_naming_the_field(answers):
    for custom_id, (_, param, message) in BAD.items():
        entry = answers[custom_id]
        assert entry["response"] is None and entry["error"]["code"] == "invalid_request"
        assert param in entry["error"]["message"] and message in entry["error"]["message"]
    assert all(answers[k]["error"] is None for k in (*FORCED, *FREE))


# ---------------------------------------------------------------------- the rendered prompt
def prepared(folder: Path, lines: list[dict], tokenizer: Any = None) -> list:
    """prepare_jobs on a folder's tokenizer (no engine: it renders with the tokenizer alone)."""
    from transformers import AutoTokenizer

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    requests = read_batch(b"\n".join(json.dumps(item).encode() for item in lines))
    section = EngineConfig.model_validate({"model_path": str(folder)})
    return prepare_jobs(requests, SimpleNamespace(tokenizer=tokenizer), section, str(folder))


@pytest.mark.parametrize("template", ["hermes", "llama3"])
def test_the_prompt_is_transformers_apply_chat_template_with_the_tools(
    template, llama_dir, tmp_path
):
    from transformers import AutoTokenizer

    text = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE}[template]
    folder = tool_model(llama_dir, tmp_path / template, text)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # (Llama 3.1's template renders one call per assistant turn)
    history = HISTORY if template == "hermes" else [
        HISTORY[0], {**HISTORY[1], "tool_calls": HISTORY[1]["tool_calls"][:1]}, HISTORY[2],
    ]  # fmt: skip
    expected_history = HISTORY_FOR_TEMPLATE if template == "hermes" else [
        HISTORY_FOR_TEMPLATE[0],
        {**HISTORY_FOR_TEMPLATE[1], "tool_calls": HISTORY_FOR_TEMPLATE[1]["tool_calls"][:1]},
        HISTORY_FOR_TEMPLATE[2],
    ]  # fmt: skip
    lines = [line("a", history, tools=TOOLS), line("b", user("Hi"), tools=TOOLS[1:]),
             line("c", user("Hi"), tools=TOOLS, tool_choice="none"), line("d", user("Hi"))]  # fmt: skip
    jobs = prepared(folder, lines, tokenizer)
    assert [job.error for job in jobs] == [None] * 4

    def render(messages: list[dict], tools: list | None) -> str:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )

    assert [job.prompt for job in jobs] == [
        render(expected_history, TOOLS), render(user("Hi"), TOOLS[1:]),
        render(user("Hi"), None), render(user("Hi"), None),
    ]  # fmt: skip
    # (the template did render them: the calls' arguments as objects, each tool's schema)
    assert '"city": "Paris", "unit": "celsius", "days": 1}' in jobs[0].prompt
    assert '"maxLength": 6' in jobs[0].prompt and "get_weather" not in jobs[1].prompt
    assert [job.tool_format for job in jobs] == [template, template, None, None]


def test_a_template_without_tools_or_without_a_known_format_refuses_what_it_cannot_do(
    llama_dir, tmp_path
):
    plain = [line("a", user("Hi"), tools=TOOLS), line("b", user("Hi"), tools=TOOLS,
             tool_choice="none")]  # fmt: skip
    jobs = prepared(llama_dir, plain)  # tests/tiny_models.py's template: no tools in it
    assert jobs[0].error.param == "tools" and "renders no tools" in str(jobs[0].error)
    assert jobs[1].error is None  # (tool_choice none renders none)
    # a template that lists the tools but shows no call format gristmill reads: forced calls
    # are JSON by construction, and only 'auto' needs to read the model's own format
    listing = "{%- for t in tools %}{{ t.function.name }}\n{% endfor %}" + CHAT_TEMPLATE
    folder = tool_model(llama_dir, tmp_path / "listing", listing)
    jobs = prepared(folder, [line("a", user("Hi"), tools=TOOLS),
                             line("b", user("Hi"), tools=TOOLS, tool_choice="required")])  # fmt: skip
    assert jobs[0].error.param == "tool_choice" and "none of hermes" in str(jobs[0].error)
    assert jobs[1].error is None and jobs[1].prompt.startswith("get_weather\nget_time\n")
