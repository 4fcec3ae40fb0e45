"""Evaluate: prompt every row, extract the answer from the generation, score it against a
reference column, and report the metric.

    evaluate:
      reference_column: answer
      extract: "answer is (\\-?\\d+)"    # a regex: its first group (or whole match) is the answer
      metric: exact_match                # exact_match | regex | choice

- exact_match: the answer equals the reference, after trimming and collapsing spaces (and
  ignoring case unless case_sensitive).
- regex: the reference is a pattern the whole answer must match.
- choice: the answer names a choice (as annotate maps it) and that choice is the reference.

Scoring happens on the merged rows in the finish step, so changing the metric or the extractor
re-scores the same generations instead of regenerating them (they are not in the fingerprint).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pyarrow as pa
from prefect import flow
from pydantic import Field, field_validator, model_validator

from flows.annotate import match_choice
from flows.config import RunConfig, Section
from flows.outputs.rows import output_column
from flows.pipeline import run_steps
from flows.run.plan import Finisher


class EvaluateSpec(Section):
    reference_column: str = Field(description="the input column holding the right answer")
    metric: Literal["exact_match", "regex", "choice"] = Field(
        "exact_match",
        description="exact_match: the answer equals the reference; regex: the reference is a "
        "pattern the answer matches; choice: the choice named in the answer is the reference",
    )
    extract: str | None = Field(None, description="regex; default: the whole generation")
    choices: list[str] | None = Field(None, description="for metric choice; templates see them")
    case_sensitive: bool = Field(False, description="compare answers with case (default: not)")

    @field_validator("extract")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"not a valid regex: {e}") from None
        return pattern

    @model_validator(mode="after")
    def _choice_needs_choices(self) -> EvaluateSpec:
        if self.metric == "choice" and not self.choices:
            raise ValueError("metric choice needs choices")
        return self


class EvaluateConfig(RunConfig):
    flow: Literal["evaluate"] = Field("evaluate", description="which flow runs the config")
    evaluate: EvaluateSpec = Field(description="how answers are scored against the references")

    def template_variables(self) -> dict[str, Any]:
        return {"choices": self.evaluate.choices} if self.evaluate.choices else {}

    def needed_columns(self) -> dict[str, str]:
        return {self.evaluate.reference_column: "evaluate.reference_column"}

    def added_columns(self) -> tuple[str, ...]:
        return ("predicted", "correct")


def extract_answer(text: str | None, pattern: str | None) -> str | None:
    if text is None:
        return None
    if pattern is None:
        return text.strip()
    hit = re.search(pattern, text)
    if hit is None:
        return None
    return (hit.group(1) if hit.re.groups else hit.group(0)).strip()


def is_correct(predicted: str | None, reference: Any, spec: EvaluateSpec) -> bool:
    if predicted is None or reference is None:
        return False
    reference = str(reference)
    if spec.metric == "regex":
        flags = 0 if spec.case_sensitive else re.IGNORECASE
        try:
            return re.fullmatch(reference, predicted, flags) is not None
        except re.error:
            return False
    if spec.metric == "choice":
        chosen = match_choice(predicted, spec.choices or [])
        return chosen is not None and _norm(chosen, spec) == _norm(reference, spec)
    return _norm(predicted, spec) == _norm(reference, spec)


def _norm(text: str, spec: EvaluateSpec) -> str:
    text = " ".join(text.split())
    return text if spec.case_sensitive else text.lower()


class Score(Finisher):
    """Each row's extracted answer (`predicted`) and whether it matches the reference
    (`correct`), and the accuracy over all rows."""

    def __init__(self, config: EvaluateConfig) -> None:
        self.spec = config.evaluate
        self.reference = output_column(config, self.spec.reference_column)
        self.rows_seen = self.correct = self.no_answer = 0

    def rows(self, chunk: pa.Table) -> pa.Table:
        references = chunk.column(self.reference).to_pylist()
        predicted = [extract_answer(t, self.spec.extract) for t in chunk.column("text").to_pylist()]
        correct = [is_correct(p, r, self.spec) for p, r in zip(predicted, references)]
        self.rows_seen += len(correct)
        self.correct += sum(correct)
        self.no_answer += predicted.count(None)
        chunk = chunk.append_column("predicted", pa.array(predicted, pa.string()))
        return chunk.append_column("correct", pa.array(correct, pa.bool_()))

    def summary(self) -> dict[str, Any]:
        n = self.rows_seen
        return {
            "metric": self.spec.metric,
            "accuracy": round(self.correct / n, 6) if n else 0.0,
            "correct": self.correct,
            "no_answer": self.no_answer,
        }


@flow(name="evaluate", flow_run_name="{config.run_name}")
def evaluate(config: EvaluateConfig, fresh: bool = False) -> dict[str, Any]:
    """Score a model's answers to every row of an input file against a reference column."""
    return run_steps(config, fresh, finish=Score)
