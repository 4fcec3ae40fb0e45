"""What a run keeps of its input without holding its rows (flows/inputs/sources.py sums it up): its
files and their row counts, the schema of all their rows, the digest of its bytes, and what the
checks tallied as the rows streamed past, the ids among them; `Input.batches` streams the rows
again, a batch at a time, for the prompts (flows/run/plan.py).

The ids are the one thing of O(rows) kept: the id column's values as strings, in one Arrow
array, which the checks of missing and repeated ids (`id_problems`) and the run's request ids
need whole. A problem is worded with its file and line (`Input.places`): only then is a text
file read whole again, to find its lines.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flows.config import ConfigError, SourceConfig
from flows.inputs.batches import conform, file_stat, read_file
from flows.inputs.file import read_text, row_lines
from flows.inputs.hf_datasets import open_saved_dataset, saved_dataset_batches

HF_DATASET = "hf-dataset"  # a save_to_disk folder (flows/inputs/hf_datasets.py)


class Tally(Protocol):
    """What a check keeps of the rows as they stream past: `add` sees each batch (in the
    input's schema, or in its own bytes' types where those are the input's; a column the
    batch lacks is null: `column_of`) and the input row its first row is."""

    def add(self, table: pa.Table, first: int) -> None: ...


# a tally's key (what it counts, of which column) and how to start one
Tallies = Mapping[Hashable, Callable[[], Tally]]


@dataclass(frozen=True)
class InputFile:
    path: Path
    name: str  # as messages name it: its path from the source's parent folder
    rows: int
    schema: pa.Schema  # of its rows, as a read of the whole file gives them
    stat: tuple[int, int, int]  # when it was summed up (input_batches.file_stat)


@dataclass(eq=False)
class Input:
    """A source summed up without holding its rows: its files and their row counts, the
    schema of all their rows, the digest of its bytes and what its tallies kept (the ids among
    them); `batches()` streams the rows again.

    NOTE: what stays in memory is O(rows) only in the ids (one Arrow string array); the rows
    themselves are read again, a batch at a time, by whoever needs them."""

    files: tuple[InputFile, ...]
    format: str  # jsonl, csv, parquet or HF_DATASET
    encoding: str
    digest: str
    schema: pa.Schema
    source: SourceConfig
    tallies: dict[Hashable, Tally] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return sum(f.rows for f in self.files)

    def places(self, rows: list[int]) -> list[tuple[InputFile, int]]:
        """Each row's file and 1-based line in it (Parquet: its 1-based row in the file)."""
        ends = list(itertools.accumulate(f.rows for f in self.files))
        lines: dict[int, list[int]] = {}
        found = []
        for row in rows:
            index = bisect.bisect_right(ends, row)
            file, local = self.files[index], row - ends[index] + self.files[index].rows
            if self.format in ("parquet", HF_DATASET):
                found.append((file, local + 1))
                continue
            if index not in lines:  # read again: this only runs to word a problem
                lines[index] = row_lines(read_text(file.path, self.encoding), self.format)
            found.append((file, lines[index][local]))
        return found

    def batches(self) -> Iterator[pa.Table]:
        """The rows again, in file order, a batch at a time, each in `schema`. ConfigError if a
        file changed since it was summed up (its rows would not be the ones planned)."""
        ids = self._ids_to_match()
        first = 0
        for file in self.files:
            if file_stat(file.path) != file.stat:
                raise changed(file)
            rows = 0
            for table in self._read(file):
                table = conform(table, self.schema)
                # NOTE: the rows must be the ones the ids were taken from (and the request
                # ids of the run's shards): a file edited in place, its size and time kept
                if ids is not None and not _ids_of(table, ids[0]).equals(
                    pa.chunked_array([ids[1].slice(first + rows, table.num_rows)])
                ):
                    raise changed(file)
                rows += table.num_rows
                yield table
            if rows != file.rows:
                raise changed(file)
            first += rows

    def ids(self) -> pa.Array | None:
        """The id column's values as strings (nulls kept), None where they are no strings."""
        tally = self.tallies[("ids", self.source.id_column)]
        assert isinstance(tally, Ids)
        return tally.value()

    def row_ids(self) -> pa.Array:
        """Each row's id as a string; ValueError naming source.id_column if ids are missing or
        repeat (a run whose input changed since preflight checked it)."""
        column = self.source.id_column
        if column is None:
            return positions(self.num_rows)
        ids = self.ids()
        if ids is None:
            raise ValueError(f"column {column!r} holds {self.schema.field(column).type} values")
        return unique_ids(ids, column)

    def _read(self, file: InputFile) -> Iterator[pa.Table]:
        if self.format == HF_DATASET:
            dataset, _ = open_saved_dataset(self.source.path, self.source.split)
            yield from saved_dataset_batches(dataset)
        else:
            yield from read_file(file.path, self.format, self.encoding, file.schema)

    def _ids_to_match(self) -> tuple[str, pa.Array] | None:
        column = self.source.id_column
        if column is None or ("ids", column) not in self.tallies or column not in self.schema.names:
            return None
        ids = self.ids()
        return None if ids is None else (column, ids)


def joined(tables: list[pa.Table]) -> pa.Table:
    """Tables of one schema as one, zero-copy. NOTE: not pa.concat_tables, which gives 0 rows
    for tables of no column (a JSONL of `{}` rows has rows, and no column)."""
    batches = [batch for table in tables for batch in table.to_batches()]
    return pa.Table.from_batches(batches, schema=tables[0].schema)


def column_of(table: pa.Table, name: str) -> pa.ChunkedArray:
    """A column of a batch; all null where the batch has none (its rows lack the key)."""
    if name in table.column_names:
        return table.column(name)
    return pa.chunked_array([pa.nulls(table.num_rows)])


class Ids:
    """The id column's values cast to strings, kept as one compact Arrow array."""

    def __init__(self, column: str) -> None:
        self.column, self.chunks, self.castable = column, [], True
        self._value: pa.Array | None = None

    def add(self, table: pa.Table, first: int) -> None:
        if self.castable:
            try:
                self.chunks += _ids_of(table, self.column).chunks
            except pa.ArrowException:
                self.castable, self.chunks = False, []

    def value(self) -> pa.Array | None:
        if not self.castable:
            return None
        if self._value is None:
            self._value = pa.chunked_array(self.chunks, pa.string()).combine_chunks()
            self.chunks = []
        return self._value


def _ids_of(table: pa.Table, column: str) -> pa.ChunkedArray:
    return pc.cast(column_of(table, column), pa.string())


def changed(file: InputFile) -> ConfigError:
    return ConfigError(
        [("source.path", f"{file.name} changed since the run read it: run again to start a "
          "run of its new content")]
    )  # fmt: skip


def count_tallies(loaded: Input, wanted: Tallies) -> dict[Hashable, Tally]:
    """The tallies over the rows streamed again."""
    tallies = {k: start() for k, start in wanted.items()}
    first = 0
    for table in loaded.batches():
        for tally in tallies.values():
            tally.add(table, first)
        first += table.num_rows
    return tallies


# ---------------------------------------------------------------------- ids
def id_problems(loaded: Input, id_column: str) -> list[tuple[str, str]]:
    """Rows without an id, and ids that repeat, by file and line."""
    ids = loaded.ids()
    if ids is None:
        kind = loaded.schema.field(id_column).type
        return [("source.id_column", f"column {id_column!r} holds {kind} values, not ids")]
    problems = []
    missing = pc.indices_nonzero(ids.is_null()).to_pylist()
    if missing:
        (file, line), *_ = loaded.places(missing[:1])
        more = f" (nor do {len(missing) - 1} more rows)" if len(missing) > 1 else ""
        problems.append(
            ("source.id_column",
             f"{_at(loaded, line)} of {file.name} has no value in column {id_column!r}{more}")
        )  # fmt: skip
    counts = pc.value_counts(ids.drop_null())
    repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    if len(repeated):
        first = pc.indices_nonzero(pc.is_in(ids, repeated))[0].as_py()
        value = ids[first].as_py()
        rows = pc.indices_nonzero(pc.equal(ids, value)).to_pylist()
        more = _more_ids(len(repeated) - 1)
        problems.append(
            ("source.id_column",
             f"id {value!r} repeats: {_pair(loaded, rows[:2])}"
             + (f" ({len(rows)} times in all)" if len(rows) > 2 else "") + more)
        )  # fmt: skip
    return problems


def _more_ids(count: int) -> str:
    if count == 0:
        return ""
    return "; 1 more id repeats" if count == 1 else f"; {count} more ids repeat"


def _pair(loaded: Input, rows: list[int]) -> str:
    (file_a, a), (file_b, b) = loaded.places(rows)
    unit = "rows" if loaded.format == "parquet" else "lines"
    if file_a == file_b:
        return f"{unit} {a} and {b} of {file_a.name}"
    return f"{_at(loaded, a)} of {file_a.name} and {_at(loaded, b)} of {file_b.name}"


def _at(loaded: Input, number: int) -> str:
    return f"{'row' if loaded.format == 'parquet' else 'line'} {number}"


def positions(count: int) -> pa.Array:
    """The ids of rows without an id column: their 0-based positions, as strings."""
    return pc.cast(pa.array(np.arange(count)), pa.string())  # (no str per row)


def row_ids(table: pa.Table, id_column: str | None) -> pa.Array:
    """Each row's id as a string; ValueError naming source.id_column if ids are missing or repeat."""
    if id_column is None:
        return positions(table.num_rows)
    return unique_ids(pc.cast(table.column(id_column), pa.string()).combine_chunks(), id_column)


def unique_ids(ids: pa.Array, id_column: str) -> pa.Array:
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
