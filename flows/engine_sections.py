"""The config sections that are the engine's own arguments: `engine` (Engine's) and `sampling`
(SGLang's sampling parameters). Their common fields are typed, with the engine's ranges and
choices as JSON-schema constraints (the Prefect form refuses what the engine would), and the
engine's other arguments pass through, checked by the engine's own rules in preflight.

Nothing of a range, a choice or a default is typed here: each field's type comes from the
engine's own table of rules (`ServerArgs.rules()`, `SamplingParams.rules()`: the rules the
engine checks), and a description names the default that table gives.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine import SamplingParams, ServerArgs

_RULES = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "not")


def form_schema(schema: dict[str, Any]) -> None:
    """A section's JSON schema as the Prefect form should render it (its `json_schema_extra`).

    An optional field (`T | None = None`) validates None as ever (unset: the engine's or the
    flow's default), but its schema offers T alone, with no null default: the form opens the
    field as T's own input, not on a "None" to switch from first, and a field left unset stays
    out of the parameters (a Quick run fills each default in, and validates it).

    NOTE: Prefect's form checks a field's rules (a minimum, a "not") only inside an `anyOf`:
    it drops them from a plain field before it validates. So a field with rules stays an
    `anyOf`, of its one type."""
    for name, prop in schema.get("properties", {}).items():
        if prop.get("default", 0) is None:
            del prop["default"]
        elif isinstance(prop.get("default"), dict):
            prop["default"] = {k: v for k, v in prop["default"].items() if v is not None}
        options = [o for o in prop.get("anyOf", []) if o != {"type": "null"}]
        if len(options) == 1 and len(prop["anyOf"]) == 2:  # T | None
            del prop["anyOf"]
            prop.update(options[0])
        if "type" in prop and any(rule in prop for rule in _RULES):
            keep = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
            schema["properties"][name] = {"anyOf": [prop], **keep}


class _Open(BaseModel):
    """A section whose common fields are typed (they render as form fields in the Prefect UI)
    while the engine's other arguments pass through, checked by the engine's own rules."""

    model_config = ConfigDict(extra="allow", json_schema_extra=form_schema)

    def arguments(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


_ENGINE = ServerArgs.rules()
_SAMPLING = SamplingParams.rules()
_BOUNDS = {"minimum": "ge", "exclusiveMinimum": "gt", "maximum": "le", "exclusiveMaximum": "lt"}
_KINDS = {"boolean": bool, "integer": int, "number": float, "string": str}


def _typed(rule: Any) -> Any:
    """The pydantic type of a field that follows the engine's `rule` (engine/rules.py: Rule):
    its choices a Literal; its range pydantic's bounds, which are the JSON schema's (the form's);
    a value between the range and what is taken below it (top_k's -1) refused by the rule
    itself, its "not" in the schema; a list's items typed alike."""
    schema = rule.json_schema()
    typed = {"type", "enum", "items", "not", *_BOUNDS}
    assert set(schema) <= typed, f"{rule.name}: no type here for {set(schema) - typed}"
    if "enum" in schema:
        return Literal[tuple(schema["enum"])]
    if "items" in schema:
        return list[_typed(rule.items)]
    bounds = {_BOUNDS[key]: value for key, value in schema.items() if key in _BOUNDS}
    if "not" not in schema:
        return Annotated[_KINDS[schema["type"]], Field(**bounds)]

    def within(value: Any) -> Any:
        if not rule.accepts(value):
            raise ValueError(f"{rule.name} must be {rule.words()}, got {value}")
        return value

    extra = {"not": schema["not"]}
    return Annotated[
        _KINDS[schema["type"]], Field(**bounds, json_schema_extra=extra), AfterValidator(within)
    ]


def _engine(name: str) -> Any:
    return _typed(_ENGINE[name])


def _sampling(name: str) -> Any:
    return _typed(_SAMPLING[name])


def _default(rule: Any) -> str:
    """A rule's default as a description says it: what None settles to, else its field's."""
    value = rule.settled if rule.default is None else rule.default
    return f"{value:g}" if isinstance(value, float) else str(value)


_E = {name: _default(rule) for name, rule in _ENGINE.items()}
_S = {name: _default(rule) for name, rule in _SAMPLING.items()}


class EngineConfig(_Open):
    """Arguments of `engine.Engine` (SGLang's names); unset fields keep the engine's defaults.
    The ranges here are the engine's own rules, so a form refuses what the engine would."""

    model_path: str = Field(description="a local Hugging Face model folder")
    dtype: _engine("dtype") | None = Field(
        None, description=f"of weights and activations; default {_E['dtype']}: the model config's"
    )
    context_length: _engine("context_length") | None = Field(
        None, description="tokens one request may hold; default: the model's maximum"
    )
    max_running_requests: _engine("max_running_requests") | None = Field(
        None, description="requests generating at once; default: from the KV pool's size"
    )
    max_total_tokens: _engine("max_total_tokens") | None = Field(
        None, description="tokens the KV cache holds; default: from mem_fraction_static"
    )
    mem_fraction_static: _engine("mem_fraction_static") | None = Field(
        None,
        description=f"share of GPU memory for weights and KV cache ({_E['mem_fraction_static']})",
    )
    attention_backend: _engine("attention_backend") | None = Field(
        None, description="attention kernels; default triton on a GPU, torch on the CPU"
    )
    kv_cache_dtype: _engine("kv_cache_dtype") | None = Field(
        None,
        description=f"{_E['kv_cache_dtype']} (the model's dtype), or float8: half the KV bytes "
        "(a GPU)",
    )
    speculative_algorithm: _engine("speculative_algorithm") | None = Field(
        None,
        description="NGRAM: drafts from each row's own text and finished rows; STANDALONE: from "
        "a draft model (speculative_draft_model_path); checked by the model, same output. "
        "Default none",
    )
    speculative_policy: _engine("speculative_policy") | None = Field(
        None,
        description=f"{_E['speculative_policy']}: draft where it pays; always: every step",
    )


class SamplingConfig(_Open):
    """SGLang sampling parameters; unset fields keep the engine's defaults. Each row's
    `sampling_seed` comes from the run's seed and the row's id, never from here. The ranges
    are the engine's (engine/sampling_params.py), so a form refuses what the engine would."""

    temperature: _sampling("temperature") | None = Field(
        None, description=f"0: greedy; higher: more varied (default {_S['temperature']})"
    )
    top_p: _sampling("top_p") | None = Field(
        None, description=f"sample from the smallest set of tokens this likely ({_S['top_p']})"
    )
    top_k: _sampling("top_k") | None = Field(
        None, description=f"sample from the k likeliest tokens; {_S['top_k']}: all (default)"
    )
    min_p: _sampling("min_p") | None = Field(
        None, description=f"drop tokens less likely than this times the top one ({_S['min_p']})"
    )
    max_new_tokens: _sampling("max_new_tokens") | None = Field(
        None, description=f"the most tokens generated per row (default {_S['max_new_tokens']})"
    )
    min_new_tokens: _sampling("min_new_tokens") | None = Field(
        None, description=f"no stop before this many tokens (default {_S['min_new_tokens']})"
    )
    frequency_penalty: _sampling("frequency_penalty") | None = Field(
        None,
        description=f"lowers a token's logit per time it appeared ({_S['frequency_penalty']})",
    )
    presence_penalty: _sampling("presence_penalty") | None = Field(
        None,
        description=f"lowers the logit of any token that appeared ({_S['presence_penalty']})",
    )
    repetition_penalty: _sampling("repetition_penalty") | None = Field(
        None,
        description=f"divides repeated tokens' logits; {_S['repetition_penalty']}: none (default)",
    )
    # (a list only, of the engine's str or list: one input in the form)
    stop: list[str] | None = Field(None, description="strings that end a row's text")
    stop_token_ids: _sampling("stop_token_ids") | None = Field(
        None, description="token ids that end a row's text (besides EOS)"
    )
    ignore_eos: _sampling("ignore_eos") | None = Field(
        None, description="generate past the EOS token"
    )
