"""The flow configs' JSON schema (what the Prefect UI renders as a form, and what "Validate
parameters" checks) carries the engine's ranges and choices, and pydantic refuses the same
values: a bad value is refused in the form, before a run is created. Every field says what it
is, in one line.

The ranges, choices and defaults are read from the engine's own tables (`ServerArgs.rules()`,
`SamplingParams.rules()`), never typed here: a config field whose range, choices or default
drifts from the engine's rule fails here."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from pydantic import ValidationError

from engine import SamplingParams, ServerArgs
from flows.catalog import FLOWS
from flows.config import RunConfig
from flows.engine_sections import EngineConfig, SamplingConfig

CONFIGS = [RunConfig, *(entry.config_class() for entry in FLOWS.values())]
BASE = {
    "run_name": "x",
    "engine": {"model_path": "/models/m"},
    "source": {"path": "rows.jsonl"},
    "prompt": {"template": "{{ text }}"},
}
RULES = {"engine": ServerArgs.rules(), "sampling": SamplingParams.rules()}
SECTIONS = {"engine": EngineConfig, "sampling": SamplingConfig}
# what a field's rule says in a form (a string's non-emptiness and pattern are left to preflight,
# which asks the engine itself: model_path is the only string field, and a path of any form)
CONSTRAINTS = ("enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "not", "items")
# the fields whose description names the engine's default
NAMES_A_DEFAULT = {
    "engine": ("dtype", "mem_fraction_static", "kv_cache_dtype"),
    "sampling": ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens",
                 "frequency_penalty", "presence_penalty", "repetition_penalty"),
}  # fmt: skip
EXPOSED = [(section, name) for section, model in SECTIONS.items() for name in model.model_fields]


def _constraints(schema: dict) -> dict:
    """What a schema says beyond its type: a list's items' constraints where they say any."""
    said = {k: schema[k] for k in CONSTRAINTS if k in schema}
    if "items" in said:
        said["items"] = _constraints(said["items"])
    return {k: v for k, v in said.items() if v != {}}


def _refused(rule) -> list:
    """Values just outside the rule, from its own bounds, gap, choices and items."""
    schema = rule.json_schema()
    step = 1 if schema["type"] == "integer" else 0.5
    values = [schema[k] for k in ("exclusiveMinimum", "exclusiveMaximum") if k in schema]
    values += [schema["minimum"] - step] if "minimum" in schema else []
    values += [schema["maximum"] + step] if "maximum" in schema else []
    values += [schema["not"]["const"]] if "not" in schema else []
    values += ["nope"] if "enum" in schema else []
    values += [[v] for v in _refused(rule.items)] if "items" in schema else []
    return values


REFUSED = [
    (section, name, value)
    for section, name in EXPOSED
    if name in RULES[section]
    for value in _refused(RULES[section][name])
]


def _property(schema: dict, section: str, field: str) -> dict:
    ref = schema["properties"][section]
    ref = ref.get("$ref") or next(a["$ref"] for a in ref["anyOf"] if "$ref" in a)
    prop = schema["$defs"][ref.rsplit("/", 1)[1]]["properties"][field]
    return next((a for a in prop.get("anyOf", [prop]) if a.get("type") != "null"), prop)


@pytest.mark.parametrize(("section", "name"), EXPOSED)
def test_every_field_of_an_engine_section_is_the_engines_rule(section, name):
    """Its range, choices and items are the rule's, its type one the engine takes, and it is
    unset by default (the engine's default), which its description names where it names one."""
    rule = RULES[section][name]
    expected = rule.json_schema()
    kinds = expected["type"] if isinstance(expected["type"], list) else [expected["type"]]
    for config in (c for c in CONFIGS if section in c.model_fields):  # (a batch file: no sampling)
        prop = _property(config.model_json_schema(), section, name)
        assert _constraints(prop) == _constraints(expected), config.__name__
        assert prop["type"] in kinds or (prop["type"] == "integer" and "number" in kinds)
    field = SECTIONS[section].model_fields[name]
    assert field.is_required() if rule.required else field.default is None
    if name in NAMES_A_DEFAULT[section]:
        default = rule.settled if rule.default is None else rule.default
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert re.search(rf"(?<![\w.-]){re.escape(shown)}(?![\w.])", field.description), shown


def test_a_changed_engine_rule_would_show():
    """The comparison above is not blind: a range that differs from the rule is caught."""
    rule = RULES["sampling"]["top_p"].json_schema()
    assert _constraints({**rule, "maximum": 2}) != _constraints(rule)
    ids = RULES["sampling"]["stop_token_ids"].json_schema()
    assert _constraints({**ids, "items": {"type": "integer"}}) != _constraints(ids)


@pytest.mark.parametrize("section, field, value", REFUSED)
def test_pydantic_and_the_engine_refuse_a_value_outside_the_rule(section, field, value):
    with pytest.raises(ValidationError, match=field):
        RunConfig.model_validate({**BASE, section: {**BASE.get(section, {}), field: value}})
    # and the engine itself refuses it too: the form is the first line, never a stricter one
    with pytest.raises(ValueError):
        if section == "sampling":
            SamplingParams.from_dict({field: value}).verify_vocab(1000)
        else:
            ServerArgs.from_kwargs(model_path="/models/m", **{field: value})


def test_the_refused_values_cover_the_ranges():
    """(What REFUSED derives for the fields the old hand-written list named.)"""
    assert ("sampling", "top_p", 0) in REFUSED and ("sampling", "top_p", 1.5) in REFUSED
    assert ("sampling", "top_k", 0) in REFUSED and ("sampling", "top_k", -2) in REFUSED
    assert ("engine", "mem_fraction_static", 1) in REFUSED
    assert ("engine", "context_length", 0) in REFUSED
    assert ("sampling", "stop_token_ids", [-1]) in REFUSED
    assert not any(isinstance(v, float) and math.isnan(v) for _, _, v in REFUSED)


def test_top_k_is_minus_one_or_positive():
    prop = RunConfig.model_json_schema()["$defs"]["SamplingConfig"]["properties"]["top_k"]
    (schema,) = prop["anyOf"]  # one input in the form, not a choice of types
    assert schema["type"] == "integer"
    for bad in (0, -2):
        with pytest.raises(jsonschema.ValidationError):  # the form's check
            jsonschema.validate(bad, schema)
        with pytest.raises(ValidationError, match="top_k"):
            RunConfig.model_validate({**BASE, "sampling": {"top_k": bad}})
    for good in (-1, 1, 50):
        jsonschema.validate(good, schema)
        RunConfig.model_validate({**BASE, "sampling": {"top_k": good}})


def test_engine_choices_are_the_engines():
    schema = RunConfig.model_json_schema()["$defs"]["EngineConfig"]["properties"]
    for field in ("dtype", "attention_backend", "kv_cache_dtype"):
        enum = schema[field]["enum"]
        assert tuple(enum) == ServerArgs.choices()[field]
    with pytest.raises(ValidationError, match="dtype"):
        RunConfig.model_validate({**BASE, "engine": {**BASE["engine"], "dtype": "float64"}})


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_a_description(config):
    schema = config.model_json_schema()
    models = [("", schema), *schema["$defs"].items()]
    missing = [
        f"{name}.{field}"
        for name, model in models
        for field, prop in model.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert not missing, missing


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_run_name_reads_apart_from_prefects_flow_run_name(config):
    prop = config.model_json_schema()["properties"]["run_name"]
    assert prop["title"] != "Run Name" and "folder" in prop["title"].lower()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_optional_fields_open_as_their_own_type(config):
    """The form renders a field of type "null" as a "None" to switch away from before one can
    type: no field offers null, yet an unset (None) field still validates."""
    schema = config.model_json_schema()
    models = [("", schema), *schema["$defs"].items()]
    nullable = [
        f"{name}.{field}"
        for name, model in models
        for field, prop in model.get("properties", {}).items()
        if "null" in json.dumps({k: v for k, v in prop.items() if k != "default"})
    ]
    assert not nullable, nullable


def test_an_unset_field_is_none_and_a_null_still_validates():
    config = RunConfig.model_validate(
        {**BASE, "sampling": {"temperature": None}, "source": {"path": "r.jsonl", "format": None}}
    )
    assert config.sampling.temperature is None and config.source.format is None
    assert config.sampling.arguments() == {}  # unset: the engine's default
