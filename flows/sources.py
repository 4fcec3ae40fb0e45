"""Input rows: a JSONL, CSV or Parquet file, or a folder of Parquet files, read with pyarrow.

A row's id is its `id_column` value as a string, or else its 0-based position in the input.
Positions are stable because the input's content hash is part of the run's fingerprint: a
changed file gets a new run folder, so old ids never meet new rows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from flows.config import SourceConfig

_SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                   ".parquet": "parquet", ".pq": "parquet"}  # fmt: skip
_ARROW_FORMATS = {"jsonl": "json", "csv": "csv", "parquet": "parquet"}


def source_files(source: SourceConfig) -> list[Path]:
    """The files of the source, in a stable order; ValueError if there are none."""
    path = source.path
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"file not found: {path}")
    # a folder: its data files of one format, skipping hidden and _-prefixed ones (_SUCCESS, ...)
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in _SUFFIX_FORMATS
        and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
    )
    wanted = source.format or (_SUFFIX_FORMATS[files[0].suffix.lower()] if files else None)
    files = [p for p in files if _SUFFIX_FORMATS[p.suffix.lower()] == wanted]
    if not files:
        raise ValueError(f"folder {path} holds no .jsonl, .csv or .parquet files")
    return files


def source_format(source: SourceConfig) -> str:
    if source.format is not None:
        return source.format
    path = source_files(source)[0]
    if path.suffix.lower() not in _SUFFIX_FORMATS:
        raise ValueError(
            f"cannot tell the format of {path.name}: set source.format to jsonl, csv or parquet"
        )
    return _SUFFIX_FORMATS[path.suffix.lower()]


def _dataset(source: SourceConfig) -> ds.Dataset:
    files = source_files(source)
    return ds.dataset([str(f) for f in files], format=_ARROW_FORMATS[source_format(source)])


def read_schema(source: SourceConfig) -> pa.Schema:
    """The input's columns, read from file headers (JSONL and CSV: from their first block)."""
    return _dataset(source).schema


def read_rows(source: SourceConfig) -> pa.Table:
    """All input rows, in file order."""
    return _dataset(source).to_table()


def content_digest(source: SourceConfig) -> str:
    """A hash of the input's bytes (and its files' names within a folder): the dataset identity."""
    digest = hashlib.sha256()
    root = source.path if source.path.is_dir() else source.path.parent
    for path in source_files(source):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def row_ids(table: pa.Table, id_column: str | None) -> pa.Array:
    """Each row's id as a string; ValueError naming source.id_column if ids are missing or repeat."""
    if id_column is None:
        return pa.array([str(i) for i in range(table.num_rows)], pa.string())
    ids = pc.cast(table.column(id_column), pa.string()).combine_chunks()
    if ids.null_count:
        raise ValueError(f"{ids.null_count} row(s) have no value in id column {id_column!r}")
    counts = pc.value_counts(ids)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        first = repeated[0].as_py()
        raise ValueError(
            f"ids in column {id_column!r} must be unique: {len(repeated)} repeat, "
            f"e.g. {first['values']!r} appears {first['counts']} times"
        )
    return ids
