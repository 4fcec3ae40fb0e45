"""The config sections that are the engine's own arguments: `engine` (Engine's) and `sampling`
(SGLang's sampling parameters). Their common fields are typed, with the engine's ranges and
choices as JSON-schema constraints (the Prefect form refuses what the engine would), and the
engine's other arguments pass through, checked by the engine's own rules in preflight.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt

from engine import ServerArgs

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


_CHOICES = ServerArgs.choices()  # the engine's own lists: forms offer what the engine takes
Dtype = Literal[_CHOICES["dtype"]]
KvCacheDtype = Literal[_CHOICES["kv_cache_dtype"]]
AttentionBackend = Literal[_CHOICES["attention_backend"]]


def _not_zero(k: int) -> int:
    if k == 0:
        raise ValueError("top_k must be -1 (all tokens) or at least 1, got 0")
    return k


# -1 or a positive count, as one integer field: a form renders a union as a choice of types,
# and its unset (None) value as an error
TopK = Annotated[
    int, Field(ge=-1, json_schema_extra={"not": {"const": 0}}), AfterValidator(_not_zero)
]


class EngineConfig(_Open):
    """Arguments of `engine.Engine` (SGLang's names); unset fields keep the engine's defaults.
    The ranges here are the engine's own rules, so a form refuses what the engine would."""

    model_path: str = Field(description="a local Hugging Face model folder")
    dtype: Dtype | None = Field(
        None, description="of weights and activations; default auto: the model config's"
    )
    context_length: int | None = Field(
        None, ge=1, description="tokens one request may hold; default: the model's maximum"
    )
    max_running_requests: int | None = Field(
        None, ge=1, description="requests generating at once; default: from the KV pool's size"
    )
    max_total_tokens: int | None = Field(
        None, ge=1, description="tokens the KV cache holds; default: from mem_fraction_static"
    )
    mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, description="share of GPU memory for weights and KV cache (0.85)"
    )
    attention_backend: AttentionBackend | None = Field(
        None, description="attention kernels; default triton on a GPU, torch on the CPU"
    )
    kv_cache_dtype: KvCacheDtype | None = Field(
        None, description="auto (the model's dtype), or float8: half the KV bytes (a GPU)"
    )


class SamplingConfig(_Open):
    """SGLang sampling parameters; unset fields keep the engine's defaults. Each row's
    `sampling_seed` comes from the run's seed and the row's id, never from here. The ranges
    are the engine's (engine/sampling_params.py), so a form refuses what the engine would."""

    temperature: float | None = Field(
        None, ge=0, description="0: greedy; higher: more varied (default 1)"
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="sample from the smallest set of tokens this likely (1)"
    )
    top_k: TopK | None = Field(
        None, description="sample from the k likeliest tokens; -1: all (default)"
    )
    min_p: float | None = Field(
        None, ge=0, le=1, description="drop tokens less likely than this times the top one (0)"
    )
    max_new_tokens: int | None = Field(
        None, ge=0, description="the most tokens generated per row (default 128)"
    )
    min_new_tokens: int | None = Field(
        None, ge=0, description="no stop before this many tokens (default 0)"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="lowers a token's logit per time it appeared (0)"
    )
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="lowers the logit of any token that appeared (0)"
    )
    repetition_penalty: float | None = Field(
        None, gt=0, le=2, description="divides repeated tokens' logits; 1: none (default)"
    )
    stop: list[str] | None = Field(None, description="strings that end a row's text")
    stop_token_ids: list[NonNegativeInt] | None = Field(
        None, description="token ids that end a row's text (besides EOS)"
    )
    ignore_eos: bool | None = Field(None, description="generate past the EOS token")
