"""Annotate: label every row with one of a fixed set of choices, or as JSON of a schema.

The template sees the choices as `choices`:

    prompt:
      template: "Is this review positive, negative or neutral?\n{{ text }}\nAnswer with one of: {{ choices | join(', ') }}."
    annotate:
      choices: [positive, negative, neutral]

By default the model answers freely and `match_choice` maps its text to a choice (the earliest
choice named in it, else a close spelling), keeping the raw answer in `text` and leaving `label`
empty when nothing matches. `constraint_params` is where the constraint goes to the engine:
with `constrained: true` the choices go as a regex, so the engine emits exactly one of them;
`json_schema` (instead of choices) makes every answer JSON of that schema, kept as `label` when
it is complete.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from typing import Any, Literal

import pyarrow as pa
from prefect import flow
from pydantic import Field, model_validator

from flows.config import RunConfig, Section
from flows.pipeline import run_steps
from flows.run.plan import Finisher


class AnnotateSpec(Section):
    choices: list[str] | None = Field(None, description="the labels to choose from")
    json_schema: dict[str, Any] | None = Field(
        None, description="label as JSON of this schema (needs constrained output in the engine)"
    )
    constrained: bool = Field(
        False, description="make the engine emit only a choice (needs constrained output)"
    )
    label_column: str = Field(
        "label", pattern=r"^\w+$", description="the output column that holds each row's label"
    )

    @model_validator(mode="after")
    def _one_kind_of_label(self) -> AnnotateSpec:
        if (self.choices is None) == (self.json_schema is None):
            raise ValueError("give either choices or json_schema")
        if self.choices is not None:
            if len(self.choices) < 2 or any(not c.strip() for c in self.choices):
                raise ValueError("choices needs at least two non-empty labels")
            if len({c.lower() for c in self.choices}) != len(self.choices):
                raise ValueError("choices must differ (ignoring case)")
        return self


class AnnotateConfig(RunConfig):
    flow: Literal["annotate"] = Field("annotate", description="which flow runs the config")
    annotate: AnnotateSpec = Field(description="the labels: choices or a JSON schema")

    def template_variables(self) -> dict[str, Any]:
        spec = self.annotate
        return {"choices": spec.choices} if spec.choices else {"json_schema": spec.json_schema}

    def constraint(self) -> dict[str, Any]:
        return constraint_params(self.annotate)

    def added_columns(self) -> tuple[str, ...]:
        return (self.annotate.label_column,)


def constraint_params(spec: AnnotateSpec) -> dict[str, Any]:
    """The sampling parameters that make the engine emit only a valid label (none by default)."""
    if spec.json_schema is not None:
        return {"json_schema": json.dumps(spec.json_schema)}
    if spec.constrained and spec.choices:
        return {"regex": "|".join(re.escape(c) for c in spec.choices)}
    return {}


def match_choice(text: str | None, choices: list[str]) -> str | None:
    """The choice a free-text answer names: the earliest whole-word mention (case-insensitive;
    the longer choice when two start together), else a close spelling of the whole answer."""
    if not text:
        return None
    found = []
    for choice in choices:
        hit = re.search(rf"(?<!\w){re.escape(choice)}(?!\w)", text, re.IGNORECASE)
        if hit:
            found.append((hit.start(), -len(choice), choice))
    if found:
        return min(found)[2]
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(text.strip().lower(), list(by_lower), n=1, cutoff=0.8)
    return by_lower[close[0]] if close else None


class AddLabels(Finisher):
    """Each row's label (`annotate.label_column`) from its text, and the count of each label."""

    def __init__(self, config: AnnotateConfig) -> None:
        self.spec = config.annotate
        self.counts: Counter[str] = Counter()
        self.unlabelled = 0

    def rows(self, chunk: pa.Table) -> pa.Table:
        texts = chunk.column("text").to_pylist()
        if self.spec.choices is not None:
            labels = [match_choice(t, self.spec.choices) for t in texts]
        else:
            labels = [t if _is_json(t) else None for t in texts]
        self.counts.update(label for label in labels if label is not None)
        self.unlabelled += labels.count(None)
        return chunk.append_column(self.spec.label_column, pa.array(labels, pa.string()))

    def summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "labelled": sum(self.counts.values()),
            "unlabelled": self.unlabelled,
        }
        if self.spec.choices is not None:
            summary["label_counts"] = {c: self.counts.get(c, 0) for c in self.spec.choices}
        return summary


def _is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except ValueError:
        return False
    return True


@flow(name="annotate", flow_run_name="{config.run_name}")
def annotate(config: AnnotateConfig, fresh: bool = False) -> dict[str, Any]:
    """Label every row of an input file with one of the given choices."""
    return run_steps(config, fresh, finish=AddLabels)
