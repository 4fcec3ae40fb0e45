"""Synthesize: N generations per seed row, each with its own seed, for synthetic data.

    synthesize: {n: 4}
    sampling: {temperature: 0.9, max_new_tokens: 256}

Sample k of row r has id `r/k`, `source_id` r and `sample` k, and samples with the seed derived
from (seed, its id): rerunning, resuming or adding rows never changes a sample already made.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow
from pydantic import Field

from flows.config import RunConfig, Section
from flows.pipeline import run_steps
from flows.run.plan import Finisher


class SynthesizeSpec(Section):
    n: int = Field(ge=1, le=10_000, description="generations per input row")


class SynthesizeConfig(RunConfig):
    flow: Literal["synthesize"] = Field("synthesize", description="which flow runs the config")
    synthesize: SynthesizeSpec = Field(description="how many generations each row gets")

    @property
    def samples_per_row(self) -> int:
        return self.synthesize.n

    def flow_problems(self) -> list[tuple[str, str]]:
        params = self.sampling.arguments()
        greedy = params.get("temperature", 1.0) < 1e-6 or params.get("top_k") == 1
        if self.synthesize.n > 1 and greedy:
            return [("synthesize.n", "n > 1 with greedy sampling gives n identical generations; "
                                     "set sampling.temperature above 0")]  # fmt: skip
        return []


class CountDistinct(Finisher):
    """How varied the generations are: distinct texts among all samples (kept as 8-byte
    hashes, not the texts: the merge streams a run of any size through this)."""

    def __init__(self, config: SynthesizeConfig) -> None:
        self.n = config.synthesize.n
        self.rows_seen = 0
        self.texts: set[bytes] = set()

    def rows(self, chunk: pa.Table) -> pa.Table:
        self.rows_seen += chunk.num_rows
        for text in pc.unique(chunk.column("text").drop_null()).to_pylist():
            self.texts.add(hashlib.blake2b(text.encode(), digest_size=8).digest())
        return chunk

    def summary(self) -> dict[str, Any]:
        return {"seed_rows": self.rows_seen // self.n, "distinct_texts": len(self.texts)}


@flow(name="synthesize", flow_run_name="{config.run_name}")
def synthesize(config: SynthesizeConfig, fresh: bool = False) -> dict[str, Any]:
    """Generate n samples for every row of an input file."""
    return run_steps(config, fresh, finish=CountDistinct)
