"""The tables of the engine's rules (engine/rules.py): `ServerArgs.rules()` holds every argument
and `SamplingParams.rules()` every sampling parameter a caller may pass, each with its field's
own default, and what the engine checks is what the table's JSON schema says, value for value,
so a form built from a table (the flows' config) refuses exactly what the engine refuses."""

from __future__ import annotations

import dataclasses
import typing

import jsonschema
import pytest

from engine import SamplingParams, ServerArgs

RULES = ServerArgs.rules()
SAMPLING = SamplingParams.rules()


def test_every_argument_has_its_rule_with_its_fields_type_and_default():
    fields = dataclasses.fields(ServerArgs)
    assert list(RULES) == [f.name for f in fields]
    hints = typing.get_type_hints(ServerArgs)
    for field in fields:
        rule = RULES[field.name]
        assert rule.name == field.name
        members = typing.get_args(hints[field.name]) or (hints[field.name],)
        assert rule.types == tuple(m for m in members if m is not type(None))
        assert rule.optional == (type(None) in members)
        assert rule.required == (field.default is dataclasses.MISSING)
        assert rule.required or rule.default == field.default


def test_what_none_settles_to_is_the_tables():
    args = ServerArgs.from_kwargs(model_path="m")
    settled = {name: rule.settled for name, rule in RULES.items() if rule.settled is not None}
    assert settled  # mem_fraction_static, chunked_prefill_size
    assert {name: getattr(args, name) for name in settled} == settled


def _probes(rule) -> list:
    """Values of the rule's own type around its edges: bounds, the values just past them, the
    `also` values and the gap to the minimum, its choices and near misses."""
    if rule.choices:
        return [*rule.choices, "nope", rule.choices[0].upper(), ""]
    if rule.types == (str,):
        return ["", "x", "cpu", "cuda", "cuda:1", "cuda:", "cuda:x", "gpu", "/models/m"]
    if rule.types == (bool,):
        return [True, False]
    edges = [e for e in (rule.minimum, rule.maximum) if e is not None] + list(rule.also) + [0]
    if rule.types == (int,):
        return sorted({int(e) + d for e in edges for d in (-2, -1, 0, 1, 2)})
    # (no infinities: JSON has none, so a schema is never asked; `finite` is the engine's alone)
    return sorted({e + d for e in edges for d in (-1, -0.5, -1e-9, 0, 1e-9, 0.5, 1)})


# NOTE: not log_level, which takes any case (its schema's enum offers the spellings), nor
# tokenizer_mode, which takes only "auto" in this version (refused after the table's check)
CHECKED = [
    (name, value)
    for name, rule in RULES.items()
    if rule.types in ((bool,), (int,), (float,), (str,))
    and name not in ("log_level", "tokenizer_mode")
    for value in _probes(rule)
]


@pytest.mark.parametrize(("name", "value"), CHECKED)
def test_the_engine_accepts_what_the_tables_schema_accepts(name, value):
    schema = RULES[name].json_schema()
    try:
        jsonschema.validate(value, schema)
        by_schema = True
    except jsonschema.ValidationError:
        by_schema = False
    try:
        ServerArgs.from_kwargs(**{"model_path": "m", name: value})
        by_engine = True
    except ValueError as e:
        by_engine = not str(e).startswith(f"{name} must be ")  # refused for another reason
    assert by_engine == by_schema, (schema, value)


def test_the_schema_of_a_rule_with_values_below_its_range():
    assert RULES["chunked_prefill_size"].json_schema() == {
        "type": "integer",
        "minimum": -1,
        "not": {"const": 0},
    }
    assert RULES["mem_fraction_static"].json_schema() == {
        "type": "number",
        "exclusiveMinimum": 0,
        "exclusiveMaximum": 1,
    }
    assert RULES["dtype"].json_schema() == {"type": "string", "enum": list(RULES["dtype"].choices)}


def test_every_sampling_parameter_has_its_rule_with_its_fields_default():
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert set(SAMPLING) == set(defaults) - {"stop_ids"}  # (the engine's own, not a caller's)
    for name, rule in SAMPLING.items():
        assert rule.name == name and rule.default == defaults[name] and not rule.required


SAMPLING_CHECKED = [
    (name, value)
    for name, rule in SAMPLING.items()
    if rule.types in ((int,), (int, float)) and (rule.minimum, rule.maximum) != (None, None)
    for value in _probes(rule)
]


@pytest.mark.parametrize(("name", "value"), SAMPLING_CHECKED)
def test_the_sampling_check_accepts_what_the_tables_schema_accepts(name, value):
    """(min_new_tokens' bound by max_new_tokens, a rule between two parameters, is no schema's.)"""
    schema = SAMPLING[name].json_schema()
    try:
        jsonschema.validate(value, schema)
        by_schema = True
    except jsonschema.ValidationError:
        by_schema = False
    try:
        SamplingParams.from_dict({"max_new_tokens": None, name: value})
        by_engine = True
    except ValueError:
        by_engine = False
    assert by_engine == by_schema, (schema, value)


def test_the_sampling_schemas_of_a_gap_and_of_items():
    assert SAMPLING["top_k"].json_schema() == {
        "type": "integer",
        "minimum": -1,
        "not": {"const": 0},
    }
    assert SAMPLING["stop_token_ids"].json_schema() == {
        "type": "array",
        "items": {"type": "integer", "minimum": 0},
    }
    assert SAMPLING["stop"].json_schema() == {"type": ["string", "array"]}
