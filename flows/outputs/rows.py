"""The output row: the columns a flow writes for each request, their Arrow types, how an input
column is renamed when it collides with one of them, and how an engine result becomes a row.

A row of every shard and of output.parquet, in column order:

    id                     the request's id: the input row's id, or `<row id>/<k>` for sample k
    source_id, sample      the input row's id and k (only with samples_per_row > 1: synthesize)
    <the input's columns>  as read; `input_<name>` where the flow writes a column of that name
    prompt                 the rendered prompt
    text, finish_reason, prompt_tokens, completion_tokens, cached_tokens, latency
    logprobs, top_logprobs with `logprobs` / `top_logprobs` only
    error                  why the engine refused the request (finish_reason "error"), else null

The work table that prepare_prompts plans (flows/run/plan.py) holds the columns up to `prompt`, and
the WORK_ONLY_COLUMNS a request needs but a row does not keep. A ready flow's finish step adds
its own columns (`RunConfig.added_columns`: a label, a score) to the merged rows only.

NOTE: names, order and types are the on-disk format: a resumed run merges shards written by
earlier runs with its own, so they must agree across versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from flows.config import RunConfig

# Columns the flows write; an input column with one of these names is kept as `input_<name>`.
OUTPUT_COLUMNS = (
    "id", "prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens",
    "cached_tokens", "latency", "logprobs", "top_logprobs", "error",
)  # fmt: skip
SAMPLE_COLUMNS = ("source_id", "sample")  # with samples_per_row > 1
WORK_ONLY_COLUMNS = ("seed",)  # in the work table, not in output rows

# The request's own columns of the work table: these before the input's, `prompt`, `seed` after.
_REQUEST_TYPES = {
    "id": pa.string(),
    "source_id": pa.string(),
    "sample": pa.int64(),
    "prompt": pa.string(),
    "seed": pa.int64(),
}


def output_column(config: RunConfig, column: str) -> str:
    """An input column keeps its name in the output unless the flow writes a column of that name."""
    reserved = {*OUTPUT_COLUMNS, *WORK_ONLY_COLUMNS, *config.added_columns()}
    if config.samples_per_row > 1:
        reserved |= set(SAMPLE_COLUMNS)
    return f"input_{column}" if column in reserved else column


def input_columns(config: RunConfig, table: pa.Table) -> pa.Table:
    """The input's columns as output rows carry them (renamed by output_column)."""
    if config.source.id_column == "id":  # it becomes the output's id column, not a copy of it
        table = table.drop_columns(["id"])
    return table.rename_columns([output_column(config, c) for c in table.column_names])


def work_table(config: RunConfig, inputs: pa.Table, requests: dict[str, list[Any]]) -> pa.Table:
    """The work table: each request's id (and sample columns), its input row's columns (from
    input_columns, one row per request), its prompt and its seed, from `requests` by name."""
    head = ["id", *(SAMPLE_COLUMNS if config.samples_per_row > 1 else ())]
    tail = ["prompt", *WORK_ONLY_COLUMNS]

    def arrays(names: list[str]) -> list[pa.Array]:
        return [pa.array(requests[name], _REQUEST_TYPES[name]) for name in names]

    return pa.Table.from_arrays(
        arrays(head) + inputs.columns + arrays(tail),
        names=head + inputs.column_names + tail,
    )


def output_schema(config: RunConfig, work: pa.Schema) -> pa.Schema:
    """An output row's schema, as every shard holds it (whatever the values of its rows)."""
    return pa.schema([f for f in work if f.name not in WORK_ONLY_COLUMNS] + result_fields(config))


def result_fields(config: RunConfig) -> list[pa.Field]:
    """The columns the engine's result fills, after the work's."""
    fields = [
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("cached_tokens", pa.int64()),
        pa.field("latency", pa.float64()),
    ]
    if config.logprobs:
        fields.append(pa.field("logprobs", pa.list_(pa.float64())))
    if config.top_logprobs:
        entry = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
        fields.append(pa.field("top_logprobs", pa.list_(pa.list_(entry))))
    fields.append(pa.field("error", pa.string()))
    return fields


def result_row(
    work_row: dict[str, Any], result: dict[str, Any], *, logprobs: bool, top_logprobs: int
) -> dict[str, Any]:
    """The output row of a request the engine answered: its work row's columns, then the result's."""
    meta = result["meta_info"]
    row = _kept(work_row)
    row.update(
        text=result["text"],
        finish_reason=(meta.get("finish_reason") or {}).get("type"),
        prompt_tokens=meta["prompt_tokens"],
        completion_tokens=meta["completion_tokens"],
        cached_tokens=meta["cached_tokens"],
        latency=meta["e2e_latency"],
    )
    if logprobs:
        row["logprobs"] = [lp for lp, _, _ in meta["output_token_logprobs"]]
    if top_logprobs:
        row["top_logprobs"] = [
            [{"token_id": t, "logprob": lp} for lp, t, _ in top]
            for top in meta["output_top_logprobs"]
        ]
    return row


def refused_row(work_row: dict[str, Any], error: Exception) -> dict[str, Any]:
    """The output row of a request the engine refused: done, with the reason in `error`."""
    return {**_kept(work_row), "finish_reason": "error", "error": str(error)}


def _kept(work_row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in work_row.items() if k not in WORK_ONLY_COLUMNS}
