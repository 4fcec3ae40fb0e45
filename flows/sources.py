"""Input rows: a JSONL, CSV or Parquet file, or a folder of them, read whole and checked before
anything starts.

A row's id is its `id_column` value as a string, or else its 0-based position in the input.
Positions are stable because the input's content hash is part of the run's fingerprint: a
changed file gets a new run folder, so old ids never meet new rows.

`load_input` reads each file once: it hashes the bytes (the dataset's identity), decodes them
in `source.encoding` (JSONL and CSV; a text column never comes out as bytes) and parses them
with pyarrow. A file that does not read is a ConfigError naming the file, its line (Parquet: its
row), the column and the value. pyarrow's errors name a row within a block, not a line of the
file, so only then is the file read again with Python's json or csv module to find the line.
preflight loads the input; the run that follows (its fingerprint, prepare_prompts) uses what it
read while the files are unchanged.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flows.config import ConfigError, SourceConfig
from flows.hf_datasets import is_saved_dataset, load_saved_dataset, split_files
from flows.input_file import Unreadable, codec_name, parse_file, read_text, row_lines

_SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                   ".parquet": "parquet", ".pq": "parquet"}  # fmt: skip
TEXT_FORMATS = ("jsonl", "csv")  # the formats `source.encoding` applies to
HF_DATASET = "hf-dataset"  # a save_to_disk folder (flows/hf_datasets.py)
# what ends the word around undecodable bytes (the part of the value a message shows)


def source_files(source: SourceConfig) -> list[Path]:
    """The files of the source, in a stable order; ValueError if there are none."""
    path = source.path
    if path.is_file():
        if source.split is not None:
            raise ValueError("source.split picks a split of a dataset folder, not of one file")
        return [path]
    if not path.is_dir():
        raise ValueError(f"file not found: {path}")
    if is_saved_dataset(path):
        return [path]  # (read whole by datasets: flows/hf_datasets.py)
    if source.split is not None:  # a folder laid out as on the Hub: the split's files
        return split_files(path, source.split)
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
    if is_saved_dataset(source.path):
        return HF_DATASET
    path = source_files(source)[0]
    if path.suffix.lower() not in _SUFFIX_FORMATS:
        raise ValueError(
            f"cannot tell the format of {path.name}: set source.format to jsonl, csv or parquet"
        )
    return _SUFFIX_FORMATS[path.suffix.lower()]


# ---------------------------------------------------------------------- the input, read whole
@dataclass(frozen=True)
class InputFile:
    path: Path
    name: str  # as messages name it: its path from the source's parent folder
    rows: int


@dataclass(frozen=True)
class Input:
    """A source's rows in file order, the file each came from, and the digest of its bytes."""

    table: pa.Table
    files: tuple[InputFile, ...]
    format: str
    encoding: str
    digest: str

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


def load_input(source: SourceConfig) -> Input:
    """Every row of the source, checked: ConfigError naming each file that does not read."""
    try:
        files, fmt = source_files(source), source_format(source)
    except ValueError as e:
        raise ConfigError([("source.path", str(e))]) from None
    key = _cache_key(source, files, fmt)
    if key in _loaded:
        return _loaded[key]
    if fmt == HF_DATASET:
        return _remember(key, _load_saved_dataset(source))
    digest = _Digest(source, fmt)
    tables: list[pa.Table] = []
    read: list[InputFile] = []
    problems: list[tuple[str, str]] = []
    for path in files:
        name = _name(source, path)
        try:
            data = path.read_bytes()
            digest.add(path, data)
            table = parse_file(data, name, fmt, source.encoding)
        except Unreadable as e:
            problems.append(("source.path", str(e)))
            continue
        except OSError as e:
            problems.append(("source.path", f"cannot read {name}: {e.strerror or e}"))
            continue
        tables.append(table)
        read.append(InputFile(path, name, table.num_rows))
    if problems:
        raise ConfigError(problems)
    table = _concat(tables, read)
    if table.num_rows == 0:
        raise ConfigError([("source.path", _no_rows(source, read, fmt))])
    return _remember(key, Input(table, tuple(read), fmt, source.encoding, digest.value()))


def _remember(key: tuple[Any, ...], loaded: Input) -> Input:
    _loaded.clear()
    _loaded[key] = loaded
    return loaded


def _load_saved_dataset(source: SourceConfig) -> Input:
    """A save_to_disk folder, read by datasets: its rows and the digest of its data files."""
    try:
        table, split, digest = load_saved_dataset(source.path, source.split)
    except ValueError as e:
        where = "source.split" if "source.split" in str(e) else "source.path"
        raise ConfigError([(where, str(e))]) from None
    name = _name(source, source.path) + (f" (split {split})" if split else "")
    if table.num_rows == 0:
        raise ConfigError([("source.path", f"{name} has no rows")])
    file = InputFile(source.path, name, table.num_rows)
    return Input(table, (file,), HF_DATASET, "utf-8", digest)


def read_rows(source: SourceConfig) -> pa.Table:
    """All input rows, in file order: those preflight loaded if the files are unchanged."""
    table = load_input(source).table
    _loaded.clear()  # the run has them now: a finished run keeps no copy here
    return table


def content_digest(source: SourceConfig) -> str:
    """A hash of the input's bytes (and its files' names within a folder), and of the encoding
    they are read in when it is not UTF-8: the dataset's identity."""
    files, fmt = source_files(source), source_format(source)
    loaded = _loaded.get(_cache_key(source, files, fmt))
    if loaded is not None:
        return loaded.digest  # the bytes the rows were read from, not a later version
    if fmt == HF_DATASET:
        return load_saved_dataset(source.path, source.split)[2]
    digest = _Digest(source, fmt)
    for path in files:
        digest.add(path, path.read_bytes())
    return digest.value()


# NOTE: one input is kept, the last loaded, while its files are unchanged (same size, time of
# change and inode): preflight loads it, then the run's fingerprint and prepare_prompts use
# those rows and that digest, in the same process, instead of reading the files again.
_loaded: dict[tuple[Any, ...], Input] = {}


def _cache_key(source: SourceConfig, files: list[Path], fmt: str) -> tuple[Any, ...]:
    stats = []
    for path in files:
        stat = path.stat()
        stats.append((str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return (
        str(source.path.resolve()),
        source.split,
        fmt,
        codec_name(source.encoding),
        tuple(stats),
    )


class _Digest:
    def __init__(self, source: SourceConfig, fmt: str) -> None:
        self.root = source.path if source.path.is_dir() else source.path.parent
        self.sha = hashlib.sha256()
        # NOTE: UTF-8 adds nothing, so the fingerprints of runs from before `encoding` stand
        codec = codec_name(source.encoding)
        text = fmt in TEXT_FORMATS and codec != "utf-8"
        self.suffix = f"encoding:{codec}".encode() if text else b""

    def add(self, path: Path, data: bytes) -> None:
        self.sha.update(str(path.relative_to(self.root)).encode() + b"\0")
        self.sha.update(data)

    def value(self) -> str:
        self.sha.update(self.suffix)
        return self.sha.hexdigest()


def _name(source: SourceConfig, path: Path) -> str:
    return str(path.relative_to(source.path.parent))


# ---------------------------------------------------------------------- the files together
def _concat(tables: list[pa.Table], files: list[InputFile]) -> pa.Table:
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException:
        raise ConfigError([("source.path", _disagreement(tables, files))]) from None


def _disagreement(tables: list[pa.Table], files: list[InputFile]) -> str:
    """Which column two files give types that do not go together."""
    seen: dict[str, tuple[pa.DataType, str]] = {}
    for table, file in zip(tables, files):
        for field in table.schema:
            first = seen.setdefault(field.name, (field.type, file.name))
            try:
                pa.unify_schemas(
                    [pa.schema([(field.name, first[0])]), pa.schema([field])],
                    promote_options="permissive",
                )
            except pa.ArrowException:
                return (
                    f"column {field.name!r} is {first[0]} in {first[1]} "
                    f"but {field.type} in {file.name}"
                )
    return "its files' columns do not go together"


def _no_rows(source: SourceConfig, files: list[InputFile], fmt: str) -> str:
    if len(files) != 1:
        return f"the {len(files)} files of folder {source.path.name} hold no rows"
    file = files[0]
    if not file.path.read_bytes().strip():
        return f"{file.name} is empty"
    return f"{file.name} has a header but no rows" if fmt == "csv" else f"{file.name} has no rows"


# ---------------------------------------------------------------------- ids
def id_problems(loaded: Input, id_column: str) -> list[tuple[str, str]]:
    """Rows without an id, and ids that repeat, by file and line."""
    try:
        ids = pc.cast(loaded.table.column(id_column), pa.string()).combine_chunks()
    except pa.ArrowException:
        kind = loaded.table.schema.field(id_column).type
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


def row_ids(table: pa.Table, id_column: str | None) -> pa.Array:
    """Each row's id as a string; ValueError naming source.id_column if ids are missing or repeat."""
    if id_column is None:
        return pc.cast(pa.array(np.arange(table.num_rows)), pa.string())  # (no str per row)
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
