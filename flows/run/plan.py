"""A run's plan, as the steps hand it on: what configure fixed (RunPlan), the requests that
prepare_prompts found still to do (Work), and the flow's own last step on the merged rows (Finish).

The one-engine path (flows/pipeline.py) and the Dask path (flows/parallel/generate.py) both take
these and write shards of the same rows; neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flows.config import RunBase, RunConfig
from flows.inputs.prompts import PromptRenderer
from flows.inputs.summary import joined
from flows.outputs.rows import input_columns, output_schema, work_table
from flows.outputs.store import CheckpointStore, row_seed
from flows.run.preflight import Checked

# Prompts rendered per call: a resident engine renders chat templates in one round trip each
RENDER_BATCH = 1024


class Finisher:
    """A flow's last word on the merged rows, which collect streams through it a chunk at a
    time in input order: the columns it adds to each chunk (a label, a score) and, once every
    chunk has passed, its part of the run's summary. This one adds nothing."""

    def rows(self, chunk: pa.Table) -> pa.Table:
        return chunk

    def summary(self) -> dict[str, Any]:
        return {}


# a ready flow's Finisher, made for one collect from the run's config
Finish = Callable[[Any], Finisher]


@dataclass
class RunPlan:
    config: RunConfig
    checked: Checked
    store: CheckpointStore


class Rows(Protocol):
    """An input's rows as a run reads them: their schema, and the rows again in input order, a
    batch at a time (flows/inputs/summary.py: Input)."""

    schema: pa.Schema

    def batches(self) -> Iterator[pa.Table]: ...


@dataclass
class Work:
    """The run's requests as prepare_prompts planned them: every request id in input order,
    which of them are still to do, and those as work tables made a window at a time.

    NOTE: nothing here holds a rendered prompt or an input row. `tables()` streams the input
    again and renders a prompt when it reaches the row, as the engine takes rows (generate
    pulls the next row only when one is free in flight), so the run's memory is its request
    ids, the todo mask and a window, never every row or prompt at once (a 4 KB instruction
    over millions of rows would not fit)."""

    ids: pa.Array  # every request id of the run, in input order
    todo: pa.Array  # bool, one per id: no shard holds it yet
    schema: pa.Schema  # of an output row, as the shards hold it
    tables: Callable[[], Iterator[pa.Table]]  # the todo requests' work tables, in input order

    @property
    def total(self) -> int:
        return len(self.ids)

    @property
    def todo_count(self) -> int:
        return int(pc.sum(self.todo).as_py() or 0)

    @property
    def done_before(self) -> int:
        return self.total - self.todo_count

    def rows(self) -> Iterator[dict[str, Any]]:
        """The todo requests' work rows, one at a time (rendered a window ahead)."""
        for table in self.tables():
            yield from table.to_pylist()


def plan_requests(
    config: RunConfig,
    rows: Rows,
    ids: pa.Array,
    done: pa.Array,
    renderer: PromptRenderer,
) -> Work:
    """The requests of the input's rows (samples_per_row each) that no shard holds yet (`done`:
    the ids in shards), in input order; their prompts are rendered as `Work.tables` reaches them,
    their seeds derived from (run seed, request id)."""
    samples = config.samples_per_row
    request_ids = _request_ids(ids, samples)
    todo = pc.invert(pc.is_in(request_ids, value_set=done))
    empty = {n: [] for n in ("id", "source_id", "sample", "prompt", "seed")}
    no_rows = input_columns(config, rows.schema.empty_table())
    schema = output_schema(config, work_table(config, no_rows, empty).schema)

    def tables() -> Iterator[pa.Table]:
        wanted = todo.to_numpy(zero_copy_only=False).reshape(-1, samples)
        for start, table in _windows(rows.batches(), RENDER_BATCH):
            window = wanted[start : start + table.num_rows]
            chosen = np.flatnonzero(window.any(axis=1))
            if len(chosen) == 0:
                continue  # every request of these rows is in a shard: none is rendered
            prompts = renderer.render_many(table.take(chosen).to_pylist())
            inputs = input_columns(config, table)
            # (the window's ids as Python strings at once: an Arrow scalar per row costs more)
            row_ids = ids.slice(start, table.num_rows).to_pylist()
            rids = request_ids.slice(start * samples, table.num_rows * samples).to_pylist()
            requests: dict[str, list[Any]] = {n: [] for n in empty}
            take: list[int] = []
            # one prompt per row, its samples share it
            for row, prompt in zip(chosen.tolist(), prompts):
                for sample in np.flatnonzero(window[row]).tolist():
                    rid = rids[row * samples + sample]
                    take.append(row)
                    requests["id"].append(rid)
                    requests["source_id"].append(row_ids[row])
                    requests["sample"].append(sample)
                    requests["prompt"].append(prompt)
                    requests["seed"].append(row_seed(config.seed, rid))
            yield work_table(config, inputs.take(pa.array(take, pa.int64())), requests)

    return Work(request_ids, todo, schema, tables)


def _windows(batches: Iterator[pa.Table], size: int) -> Iterator[tuple[int, pa.Table]]:
    """The rows of `batches` as windows of `size` rows (the last may be shorter), each with the
    input row it starts at: the same windows whatever the batches' sizes."""
    pending: list[pa.Table] = []
    held = start = 0
    for batch in batches:
        while batch.num_rows:
            part = batch.slice(0, size - held)
            pending.append(part)
            held += part.num_rows
            batch = batch.slice(part.num_rows)
            if held == size:
                yield start, joined(pending)
                start, pending, held = start + size, [], 0
    if held:
        yield start, joined(pending)


def _request_ids(ids: pa.Array, samples: int) -> pa.Array:
    """Each row's request ids in input order: its id, or `<id>/<k>` for each of its samples."""
    if samples == 1:
        return ids
    rows = pc.take(ids, pa.array(np.repeat(np.arange(len(ids)), samples)))
    suffix = pa.array(np.tile(np.arange(samples), len(ids)).astype(str))
    return pc.binary_join_element_wise(rows, suffix, "/")


def gpu_costs(config: RunBase, seconds: float, tokens: int) -> dict[str, Any]:
    """The generation's GPU-seconds (its wall time on every GPU of every engine: tensor x
    data parallel, times the Dask workers: `config.gpus`), output tokens per GPU-second and,
    with price_per_gpu_hour, what they cost."""
    gpu_seconds = seconds * config.gpus
    costs: dict[str, Any] = {
        "gpu_seconds": round(gpu_seconds, 3),
        "tokens_per_gpu_second": round(tokens / gpu_seconds, 1) if gpu_seconds else 0.0,
    }
    if config.price_per_gpu_hour is not None:
        costs["cost"] = round(gpu_seconds / 3600 * config.price_per_gpu_hour, 6)
    return costs
