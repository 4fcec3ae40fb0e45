"""The flow configs' JSON schema (what the Prefect UI renders as a form, and what "Validate
parameters" checks) carries the engine's ranges and choices, and pydantic refuses the same
values: a bad value is refused in the form, before a run is created. Every field says what it
is, in one line."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from engine import SamplingParams, ServerArgs
from flows.catalog import FLOWS
from flows.config import RunConfig

CONFIGS = [RunConfig, *(entry.config_class() for entry in FLOWS.values())]
BASE = {
    "run_name": "x",
    "engine": {"model_path": "/models/m"},
    "source": {"path": "rows.jsonl"},
    "prompt": {"template": "{{ text }}"},
}
# (section, field, a value the engine refuses, JSON-schema keys that say so)
REFUSED = [
    ("sampling", "temperature", -1, {"minimum": 0}),
    ("sampling", "top_p", 0, {"exclusiveMinimum": 0, "maximum": 1}),
    ("sampling", "top_p", 1.5, {"exclusiveMinimum": 0, "maximum": 1}),
    ("sampling", "min_p", 2, {"minimum": 0, "maximum": 1}),
    ("sampling", "max_new_tokens", -1, {"minimum": 0}),
    ("sampling", "min_new_tokens", -3, {"minimum": 0}),
    ("sampling", "frequency_penalty", 2.5, {"minimum": -2, "maximum": 2}),
    ("sampling", "presence_penalty", -2.5, {"minimum": -2, "maximum": 2}),
    ("sampling", "repetition_penalty", 0, {"exclusiveMinimum": 0, "maximum": 2}),
    ("engine", "mem_fraction_static", 1.5, {"exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("engine", "context_length", 0, {"minimum": 1}),
    ("engine", "max_total_tokens", 0, {"minimum": 1}),
    ("engine", "max_running_requests", -4, {"minimum": 1}),
]


def _property(schema: dict, section: str, field: str) -> dict:
    ref = schema["properties"][section]
    ref = ref.get("$ref") or next(a["$ref"] for a in ref["anyOf"] if "$ref" in a)
    prop = schema["$defs"][ref.rsplit("/", 1)[1]]["properties"][field]
    return next((a for a in prop.get("anyOf", [prop]) if a.get("type") != "null"), prop)


@pytest.mark.parametrize("section, field, value, keys", REFUSED)
def test_schema_carries_the_engines_ranges_and_pydantic_refuses_them(section, field, value, keys):
    for config in (c for c in CONFIGS if section in c.model_fields):  # (a batch file: no sampling)
        prop = _property(config.model_json_schema(), section, field)
        assert {k: prop.get(k) for k in keys} == keys, (config.__name__, prop)
    with pytest.raises(ValidationError, match=field):
        RunConfig.model_validate({**BASE, section: {**BASE.get(section, {}), field: value}})
    # and the engine itself refuses it too: the form is the first line, never a stricter one
    with pytest.raises(ValueError):
        if section == "sampling":
            SamplingParams.from_dict({field: value}).verify_vocab(1000)
        else:
            ServerArgs.from_kwargs(model_path="/models/m", **{field: value})


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
