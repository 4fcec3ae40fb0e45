"""A run's plan, as the steps hand it on: what configure fixed (RunPlan), the requests that
prepare_prompts found still to do (Work), and the flow's own last step on the merged rows (Finish).

The one-engine path (flows/pipeline.py) and the Dask path (flows/parallel.py) both take these
and write shards of the same rows; neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from flows.config import RunConfig
from flows.preflight import Checked
from flows.prompts import PromptRenderer
from flows.rows import input_columns, output_schema, work_table
from flows.store import CheckpointStore, row_seed

# Prompts rendered per call: a resident engine renders chat templates in one round trip each
RENDER_BATCH = 1024

# A flow's last word on the merged rows: (config, rows in input order) -> (rows, extra summary).
Finish = Callable[[Any, pa.Table], tuple[pa.Table, dict[str, Any]]]


@dataclass
class RunPlan:
    config: RunConfig
    checked: Checked
    store: CheckpointStore


@dataclass
class Work:
    ids: pa.Array  # every request id of the run, in input order
    todo: pa.Table  # the requests still to make: id, input columns, prompt, seed
    schema: pa.Schema  # of an output row, as the shards hold it
    done_before: int

    @property
    def total(self) -> int:
        return len(self.ids)


def plan_requests(
    config: RunConfig,
    table: pa.Table,
    ids: pa.Array,
    done: set[str],
    renderer: PromptRenderer,
) -> Work:
    """The requests of the input's rows (samples_per_row each) that no shard holds yet, in input
    order, with their prompts rendered and seeds derived from (run seed, request id)."""
    samples = config.samples_per_row
    requests: dict[str, list[Any]] = {
        n: [] for n in ("id", "source_id", "sample", "prompt", "seed")
    }
    take: list[int] = []
    all_ids: list[str] = []
    pending: list[dict[str, Any]] = []  # rows whose prompts are not rendered yet
    counts: list[int] = []  # how many requests each pending row makes

    def render_pending() -> None:
        if not pending:
            return
        for prompt, count in zip(renderer.render_many(pending), counts):
            requests["prompt"].extend([prompt] * count)
        pending.clear()
        counts.clear()

    for index, (row_id, row) in enumerate(zip(ids.to_pylist(), _pylist(table))):
        count = 0
        for sample in range(samples):
            rid = row_id if samples == 1 else f"{row_id}/{sample}"
            all_ids.append(rid)
            if rid in done:
                continue
            count += 1
            take.append(index)
            requests["id"].append(rid)
            requests["source_id"].append(row_id)
            requests["sample"].append(sample)
            requests["seed"].append(row_seed(config.seed, rid))
        if count:  # one prompt per row, shared by its samples
            pending.append(row)
            counts.append(count)
            if len(pending) == RENDER_BATCH:
                render_pending()
    render_pending()
    inputs = input_columns(config, table).take(pa.array(take, pa.int64()))
    todo = work_table(config, inputs, requests)
    return Work(
        pa.array(all_ids, pa.string()),
        todo,
        output_schema(config, todo.schema),
        done_before=len(all_ids) - len(requests["id"]),
    )


def _pylist(table: pa.Table) -> Iterator[dict[str, Any]]:
    for batch in table.to_batches(max_chunksize=4096):
        yield from batch.to_pylist()
