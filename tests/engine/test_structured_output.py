"""Structured output (json_schema, regex, ebnf through xgrammar): every output obeys its grammar.

The references are independent of xgrammar: `json.loads` + `jsonschema` for JSON schemas,
Python's `re.fullmatch` for regexes, and `lark` for EBNF grammars (each written a second time
in Lark's syntax). The tiny random model wanders, so the grammars are bounded (maxItems,
maxLength, integer ranges, finite alternatives) and every request must end on its own (stop),
well before its generous max_new_tokens. Sampling is seeded at temperature > 0, so the
constrained requests also show that masks never leak into other rows: a seeded request draws
the same tokens alone, in a mixed batch, with overlap scheduling on or off, and retracted.
"""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from engine import Engine
from engine.frontend.input_processor import InputProcessor
from tests.engine.core import InProcessCore

# the tiny model would fill any whitespace allowance with "\n" and "\r": compact JSON only
CORE_ARGS = {"dtype": "float32", "constrained_json_disable_any_whitespace": True}
MAX_NEW = 256

SCHEMAS = [
    {  # nested object, required fields, integer range, boolean
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "name": {"type": "string", "minLength": 1, "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {  # top-level array of bounded integers
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 50},
        "minItems": 1,
        "maxItems": 4,
    },
    {  # enums, with and without a type
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["color", "size", "count"],
        "additionalProperties": False,
    },
    {  # array of objects with a string pattern
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # const, nullable and optional fields
        "type": "object",
        "properties": {
            "ok": {"const": True},
            "level": {"type": "integer", "minimum": -3, "maximum": 3},
            "note": {"type": ["string", "null"], "maxLength": 4},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        },
        "required": ["ok", "level"],
        "additionalProperties": False,
    },
]

REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)",
    r"(yes|no|maybe)",
    r"-?[1-9][0-9]{0,3}",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}",
]

# each EBNF grammar (xgrammar's GBNF dialect) beside the same language in Lark's syntax
EBNFS = [
    (
        """root ::= expr
expr ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [0-9] | [1-9] [0-9]
""",
        """start: expr
expr: term | term OP term | term OP term OP term
term: NUM | "(" NUM OP NUM ")"
OP: "+" | "-" | "*"
NUM: /[1-9]?[0-9]/
""",
    ),
    (
        """root ::= pair | pair "," pair | pair "," pair "," pair
pair ::= key "=" value
key ::= [a-z] | [a-z] [a-z] | [a-z] [a-z] [a-z]
value ::= "true" | "false" | [0-9]
""",
        """start: pair | pair "," pair | pair "," pair "," pair
pair: KEY "=" VALUE
KEY: /[a-z]{1,3}/
VALUE: "true" | "false" | /[0-9]/
""",
    ),
]

N_JSON, N_REGEX, N_EBNF, N_FREE = 120, 50, 30, 16  # 200 constrained generations, 16 free


def _workload(tokenizer) -> tuple[list[list[int]], list[dict], list[tuple[str, object]]]:
    """Prompts, sampling params and (kind, reference) per request: constrained and free mixed."""
    prompts, params, refs = [], [], []
    kinds = (
        [("json", i % len(SCHEMAS)) for i in range(N_JSON)]
        + [("regex", i % len(REGEXES)) for i in range(N_REGEX)]
        + [("ebnf", i % len(EBNFS)) for i in range(N_EBNF)]
        + [("free", None)] * N_FREE
    )
    for i, (kind, j) in enumerate(kinds):
        p = {
            "max_new_tokens": MAX_NEW,
            "temperature": [0.7, 1.0, 1.3][i % 3],
            "sampling_seed": 1000 + i,
        }
        if i % 4 == 1:
            p["top_p"] = 0.9
        if i % 5 == 2:
            p["top_k"] = 20
        if kind == "json":
            p["json_schema"] = json.dumps(SCHEMAS[j])
            refs.append(("json", SCHEMAS[j]))
        elif kind == "regex":
            p["regex"] = REGEXES[j]
            refs.append(("regex", REGEXES[j]))
        elif kind == "ebnf":
            p["ebnf"] = EBNFS[j][0]
            refs.append(("ebnf", EBNFS[j][1]))
        else:
            p["max_new_tokens"] = 12 + i % 7
            refs.append(("free", None))
        prompts.append(tokenizer.encode(f"Request {i}: {kind} output, please."))
        params.append(p)
    # interleave, so prefill and decode batches mix constrained and free rows
    order = sorted(range(len(kinds)), key=lambda i: (i * 37) % len(kinds))
    return [prompts[i] for i in order], [params[i] for i in order], [refs[i] for i in order]


def _generate(core: InProcessCore, prompts, params):
    reqs = core.submit(prompts, params)
    while core.scheduler.has_work():
        core.scheduler.step()
    return reqs


_LARK: dict[str, lark.Lark] = {}


def _check(kind: str, ref, text: str) -> None:
    """The output obeys its grammar, by a checker that is not xgrammar."""
    if kind == "json":
        jsonschema.validate(json.loads(text), ref)
    elif kind == "regex":
        assert re.fullmatch(ref, text), f"{text!r} does not match {ref!r}"
    elif kind == "ebnf":
        if ref not in _LARK:
            _LARK[ref] = lark.Lark(ref, start="start", parser="earley", lexer="dynamic_complete")
        _LARK[ref].parse(text)  # raises on a string outside the language


@pytest.fixture(scope="module")
def core(llama_dir):
    return InProcessCore(llama_dir, **CORE_ARGS)


@pytest.fixture(scope="module")
def mixed(core):
    """One run of 200 constrained and 16 free seeded requests, in shared batches."""
    prompts, params, refs = _workload(core.inputs.tokenizer)
    compiled_before = core.scheduler.grammar.compilations
    reqs = _generate(core, prompts, params)
    compiled = core.scheduler.grammar.compilations - compiled_before
    return prompts, params, refs, reqs, compiled


def test_every_constrained_output_obeys_its_grammar(core, mixed):
    _, _, refs, reqs, _ = mixed
    tok = core.inputs.tokenizer
    counts = {"json": 0, "regex": 0, "ebnf": 0}
    for req, (kind, ref) in zip(reqs, refs):
        if kind == "free":
            continue
        assert req.finish_reason == {"type": "stop", "matched": tok.eos_token_id}, req.request.rid
        assert req.output_ids[-1] == tok.eos_token_id
        _check(kind, ref, tok.decode(req.output_ids, skip_special_tokens=True))
        counts[kind] += 1
    assert counts == {"json": N_JSON, "regex": N_REGEX, "ebnf": N_EBNF}


def test_outputs_vary_and_the_model_is_not_just_echoing_a_template(core, mixed):
    """Temperature > 0 with distinct seeds: a schema's outputs are not all the same text."""
    _, _, refs, reqs, _ = mixed
    tok = core.inputs.tokenizer
    by_ref: dict[str, set[str]] = {}
    for req, (kind, ref) in zip(reqs, refs):
        if kind != "free":
            key = json.dumps(ref) if kind == "json" else ref
            by_ref.setdefault(key, set()).add(tok.decode(req.output_ids, skip_special_tokens=True))
    assert all(len(texts) > 1 for texts in by_ref.values())


def test_each_distinct_grammar_is_compiled_once(mixed):
    *_, compiled = mixed
    assert compiled == len(SCHEMAS) + len(REGEXES) + len(EBNFS)


def test_finished_requests_drop_their_matchers(core, mixed):
    _, _, _, reqs, _ = mixed
    assert all(req.grammar is None for req in reqs)
    assert not core.scheduler.queues.running and not core.scheduler.queues.waiting


def test_seeded_requests_draw_the_same_tokens_in_another_batch_without_overlap(llama_dir, mixed):
    """Masks touch only their own rows, and reading constrained steps early changes nothing."""
    prompts, params, refs, reqs, _ = mixed
    picks = [i for i, r in enumerate(refs) if r[0] == "free"][:3]
    for kind in ("json", "regex", "ebnf"):
        picks += [i for i, r in enumerate(refs) if r[0] == kind][:3]
    other = InProcessCore(llama_dir, disable_overlap_schedule=True, **CORE_ARGS)
    outs = _generate(other, [prompts[i] for i in picks], [params[i] for i in picks])
    for i, out in zip(picks, outs):
        assert out.output_ids == reqs[i].output_ids, refs[i]
        assert out.finish_reason == reqs[i].finish_reason


def test_retracted_constrained_requests_resume_their_grammar(llama_dir, mixed):
    """A pool too small for the batch: decode retracts requests, which re-prefill their output
    tokens (the matcher must not accept them twice) and still end as they do with room."""
    prompts, params, refs, reqs, _ = mixed
    constrained = [i for i, r in enumerate(refs) if r[0] != "free"]
    picks = sorted(
        (i for i in constrained if len(reqs[i].output_ids) >= 25),
        key=lambda i: len(reqs[i].output_ids),
    )[:4]
    # max_new_tokens one past each output, and a pool that admits two requests at once on
    # admission's estimate (0.7 of what they may still generate) but cannot hold them both whole
    params = [{**params[i], "max_new_tokens": len(reqs[i].output_ids) + 1} for i in picks]
    longest_prompt = max(len(prompts[i]) for i in picks)
    longest_output = max(p["max_new_tokens"] for p in params)
    pool = 2 * longest_prompt + int(1.5 * longest_output)
    tight = InProcessCore(llama_dir, max_total_tokens=pool, **CORE_ARGS)
    outs = _generate(tight, [prompts[i] for i in picks], params)
    assert tight.scheduler.stats.retractions > 0
    tok = tight.inputs.tokenizer
    for i, out in zip(picks, outs):
        assert out.output_ids == reqs[i].output_ids, refs[i]
        assert out.finish_reason["type"] == "stop"
        _check(*refs[i], tok.decode(out.output_ids, skip_special_tokens=True))


def test_an_aborted_constrained_request_leaves_the_others_whole(core):
    tok = core.inputs.tokenizer
    prompts = [tok.encode(f"abort test {i}") for i in range(4)]
    params = [
        {"regex": REGEXES[1], "temperature": 1.0, "sampling_seed": i, "max_new_tokens": MAX_NEW}
        for i in range(4)
    ]
    reqs = core.submit(prompts, params)
    (waiting,) = core.submit([prompts[0]], params[0])  # aborted before it runs
    assert waiting.grammar is not None
    assert core.scheduler.abort_request(waiting.request.rid) is waiting and waiting.grammar is None
    while not reqs[0].output_ids:
        core.scheduler.step()
    assert reqs[0].grammar is not None and not reqs[0].finished
    assert core.scheduler.abort_request(reqs[0].request.rid) is reqs[0]
    assert reqs[0].grammar is None and reqs[0].finish_reason["type"] == "abort"
    while core.scheduler.has_work():
        core.scheduler.step()
    for req in reqs[1:]:
        assert req.finish_reason["type"] == "stop"
        _check("regex", REGEXES[1], tok.decode(req.output_ids, skip_special_tokens=True))


# ---------------------------------------------------------------------------------------------
# validation, in the caller's process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        ({"json_schema": "{not json"}, "json_schema is not a valid JSON schema: "),
        ({"json_schema": '{"type": "frobnicate"}'}, "json_schema is not a valid JSON schema: "),
        ({"regex": "(ab"}, "regex is not a valid regular expression: "),
        ({"ebnf": 'root ::= ("a"'}, "ebnf is not a valid EBNF grammar: "),
        ({"ebnf": 'start ::= "a"'}, "ebnf is not a valid EBNF grammar: "),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "Only one of regex, json_schema, or ebnf"),
        ({"json_schema": "{}", "regex": "a"}, "Only one of regex, json_schema, or ebnf"),
    ],
)
def test_an_invalid_grammar_is_refused_naming_the_field(core, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        core.requests([[5, 6, 7]], {"max_new_tokens": 8, **params})


def test_constrained_output_needs_the_tokenizer(core):
    no_tokenizer = InputProcessor(
        core.scheduler.args, core.scheduler.config, None, core.scheduler.max_total_tokens
    )
    with pytest.raises(ValueError, match="regex needs the tokenizer.*skip_tokenizer_init"):
        no_tokenizer.make_call(None, [[5, 6]], {"regex": "a+"}, False, None, None, None)


# ---------------------------------------------------------------------------------------------
# end to end, through the Engine's processes
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(llama_dir):
    # on the CPU, where the in-process core ran the same requests
    with Engine(model_path=str(llama_dir), device="cpu", max_total_tokens=8192, **CORE_ARGS) as e:
        yield e


def _engine_run(engine, core, mixed):
    """Every ninth request of the mixed run, through the Engine; constrained outputs checked."""
    prompts, params, refs, _, _ = mixed
    picks = list(range(0, len(prompts), 9))  # every kind, interleaved
    assert {refs[i][0] for i in picks} == {"json", "regex", "ebnf", "free"}
    texts = [core.inputs.tokenizer.decode(prompts[i]) for i in picks]
    outs = engine.generate(texts, [params[i] for i in picks])
    for i, out in zip(picks, outs):
        kind, ref = refs[i]
        if kind != "free":
            assert out["meta_info"]["finish_reason"]["type"] == "stop", refs[i]
            _check(kind, ref, out["text"])
    return picks, outs


def test_engine_mixes_constrained_and_free_requests(engine, core, mixed):
    picks, outs = _engine_run(engine, core, mixed)
    reqs, refs = mixed[3], mixed[2]
    for i, out in zip(picks, outs):
        assert out["output_ids"] == reqs[i].output_ids, refs[i]


@pytest.mark.gpu
def test_engine_masks_on_the_gpu(llama_dir, core, mixed):
    """The CUDA path: bitmasks copied to the device, CUDA graphs and overlap scheduling on."""
    with Engine(model_path=str(llama_dir), max_total_tokens=8192, **CORE_ARGS) as gpu_engine:
        info = gpu_engine.get_server_info()
        assert info["device"].startswith("cuda") and info["internal_states"][0]["overlap_schedule"]
        _engine_run(gpu_engine, core, mixed)


def test_engine_refuses_an_invalid_grammar_before_queueing_anything(engine):
    good = {"regex": "(yes|no)", "max_new_tokens": 8}
    with pytest.raises(ValueError, match=re.escape("request 1: json_schema is not a valid")):
        engine.generate(["a", "b"], [good, {"json_schema": "[1, 2]"}])
    assert engine.get_server_info()["internal_states"][0]["num_waiting_reqs"] == 0
    out = engine.generate("a", good)
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"
