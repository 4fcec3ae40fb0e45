"""Input rows: a JSONL, CSV or Parquet file, a folder of them, or a Hugging Face dataset folder,
checked before anything starts and streamed, never held whole.

A row's id is its `id_column` value as a string, or else its 0-based position in the input.
Positions are stable because the input's content hash is part of the run's fingerprint: a
changed file gets a new run folder, so old ids never meet new rows.

`load_input` sums the input up in one streaming pass (flows/inputs/batches.py reads each file a
piece at a time): it hashes the bytes (the dataset's identity), decodes them in
`source.encoding` (JSONL and CSV; a text column never comes out as bytes), parses and counts the
rows, settles the schema a whole-file read would give, and keeps the ids and what the checks
tally (flows/inputs/summary.py: `Input`). A file that does not read is a ConfigError naming the
file, its line (Parquet: its row), the column and the value: pyarrow's errors name a row within
a block, not a line of the file, so only then is the file read again, whole, by
flows/inputs/file.py to find the line. preflight sums the input up; the run that follows (its
fingerprint, prepare_prompts) uses that summary while the files are unchanged, and streams the
rows again as it renders their prompts (`Input.batches`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa

from flows.config import ConfigError, SourceConfig
from flows.inputs.batches import (
    FileScan,
    file_stat,
    hash_file,
    is_blank,
    word_problem,
)
from flows.inputs.file import codec_name
from flows.inputs.hf_datasets import (
    is_saved_dataset,
    open_saved_dataset,
    saved_dataset_digest,
    split_files,
)
from flows.inputs.summary import (
    HF_DATASET,
    Ids,
    Input,
    InputFile,
    Tallies,
    Tally,
    count_tallies,
    joined,
)

_SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                   ".parquet": "parquet", ".pq": "parquet"}  # fmt: skip
TEXT_FORMATS = ("jsonl", "csv")  # the formats `source.encoding` applies to


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
        return [path]  # (opened by datasets: flows/inputs/hf_datasets.py)
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


# ---------------------------------------------------------------------- the input, summed up
def load_input(source: SourceConfig, tallies: Tallies | None = None) -> Input:
    """The source summed up in one streaming pass, every row checked, and `tallies` kept of
    its rows: ConfigError naming each file that does not read. The summary of the files as
    they are now is kept for the process (`_loaded`); a tally it lacks costs a pass of its own."""
    try:
        files, fmt = source_files(source), source_format(source)
    except ValueError as e:
        raise ConfigError([("source.path", str(e))]) from None
    wanted = dict(tallies or {})
    if source.id_column is not None:
        wanted[("ids", source.id_column)] = partial(Ids, source.id_column)
    key = _cache_key(source, files, fmt)
    loaded = _loaded.get(key)
    if loaded is None:
        if fmt == HF_DATASET:
            loaded = _scan_saved_dataset(source, wanted)
        else:
            loaded = _scan(source, files, fmt, wanted)
        _remember(key, loaded)
    missing = {k: start for k, start in wanted.items() if k not in loaded.tallies}
    if missing:
        loaded.tallies.update(count_tallies(loaded, missing))
    return loaded


def _scan(source: SourceConfig, files: list[Path], fmt: str, wanted: Tallies) -> Input:
    """Every file read once: its bytes hashed, its rows parsed and counted and given to the
    tallies as they pass. NOTE: a tally saw a batch in the batch's own types; where the
    input's schema settled on others (a JSONL key typed only in later rows, a CSV column
    loosened, files whose types differ), the tallies count again over `batches()`."""
    digest = _Digest(source, fmt)
    tallies = {k: start() for k, start in wanted.items()}
    seen: list[pa.Schema] = []  # the types the tallies saw
    settled, first = True, 0
    scanned: list[InputFile] = []
    problems: list[tuple[str, str]] = []
    for path in files:
        name, stat = _name(source, path), file_stat(path)
        digest.start(path)
        scan = FileScan(path, fmt, source.encoding, digest.update)
        try:
            for table in scan.batches():
                if settled and not problems:
                    _add(tallies, table, first, seen)
                first += table.num_rows
        except Exception as e:  # any failure of its reader: worded from the file itself
            problems.append(("source.path", word_problem(path, name, fmt, source.encoding, e)))
            continue
        settled = settled and not scan.retyped
        scanned.append(InputFile(path, name, scan.rows, scan.schema, stat))
    if problems:
        raise ConfigError(problems)
    schema = _unified(scanned)
    loaded = Input(tuple(scanned), fmt, source.encoding, digest.value(), schema, source)
    if loaded.num_rows == 0:
        raise ConfigError([("source.path", _no_rows(source, scanned, fmt))])
    if settled and all(_fits(s, schema) for s in seen):
        loaded.tallies = tallies
        return loaded
    try:
        loaded.tallies = count_tallies(loaded, wanted)
    except pa.ArrowException:  # a file's rows that do not take the types of all files
        raise ConfigError([("source.path", _disagreement(scanned))]) from None
    return loaded


def _add(tallies: dict[Hashable, Tally], table: pa.Table, first: int, seen: list) -> None:
    if not any(table.schema.equals(s) for s in seen):
        seen.append(table.schema)
    for tally in tallies.values():
        tally.add(table, first)


def _fits(seen: pa.Schema, schema: pa.Schema) -> bool:
    """Whether a batch of types `seen` holds its values as they are in `schema` (a column it
    lacks is null either way)."""
    return all(schema.field(f.name).type == f.type for f in seen)


def _scan_saved_dataset(source: SourceConfig, wanted: Tallies) -> Input:
    """A save_to_disk folder, opened by datasets: the digest of its data files, its rows
    streamed past the tallies a batch at a time."""
    try:
        dataset, split = open_saved_dataset(source.path, source.split)
    except ValueError as e:
        where = "source.split" if "source.split" in str(e) else "source.path"
        raise ConfigError([(where, str(e))]) from None
    name = _name(source, source.path) + (f" (split {split})" if split else "")
    if dataset.num_rows == 0:
        raise ConfigError([("source.path", f"{name} has no rows")])
    file = InputFile(source.path, name, dataset.num_rows, dataset.data.schema,
                     file_stat(source.path))  # fmt: skip
    digest = saved_dataset_digest(dataset, split)
    loaded = Input((file,), HF_DATASET, "utf-8", digest, dataset.data.schema, source)
    loaded.tallies = count_tallies(loaded, wanted)
    return loaded


def _remember(key: tuple[Any, ...], loaded: Input) -> Input:
    _loaded.clear()
    _loaded[key] = loaded
    return loaded


def input_for_run(source: SourceConfig) -> Input:
    """The input a run plans from: preflight's summary if the files are unchanged, else summed
    up again; let go of here, as the run holds it now (a finished run keeps no copy here)."""
    loaded = load_input(source)
    _loaded.clear()
    return loaded


def read_rows(source: SourceConfig) -> pa.Table:
    """All input rows as one table, in file order (for a look at a small input: a run streams
    them, `Input.batches`)."""
    loaded = input_for_run(source)
    return joined([loaded.schema.empty_table(), *loaded.batches()])


def content_digest(source: SourceConfig) -> str:
    """A hash of the input's bytes (and its files' names within a folder), and of the encoding
    they are read in when it is not UTF-8: the dataset's identity."""
    files, fmt = source_files(source), source_format(source)
    loaded = _loaded.get(_cache_key(source, files, fmt))
    if loaded is not None:
        return loaded.digest  # the bytes the rows were read from, not a later version
    if fmt == HF_DATASET:
        return saved_dataset_digest(*open_saved_dataset(source.path, source.split))
    digest = _Digest(source, fmt)
    for path in files:
        digest.start(path)
        hash_file(path, digest.update)
    return digest.value()


# NOTE: one input's summary is kept, the last summed up, while its files are unchanged (same
# size, time of change and inode): preflight makes it, then the run's fingerprint and
# prepare_prompts use it and its digest, in the same process, instead of reading the files again.
_loaded: dict[tuple[Any, ...], Input] = {}


def _cache_key(source: SourceConfig, files: list[Path], fmt: str) -> tuple[Any, ...]:
    stats = [(str(path.resolve()), *file_stat(path)) for path in files]
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

    def start(self, path: Path) -> None:
        """A file's name, before its bytes (`update`, a piece at a time)."""
        self.sha.update(str(path.relative_to(self.root)).encode() + b"\0")

    def update(self, data: bytes) -> None:
        self.sha.update(data)

    def value(self) -> str:
        self.sha.update(self.suffix)
        return self.sha.hexdigest()


def _name(source: SourceConfig, path: Path) -> str:
    return str(path.relative_to(source.path.parent))


# ---------------------------------------------------------------------- the files together
def _unified(files: list[InputFile]) -> pa.Schema:
    """The schema of all files' rows, as pa.concat_tables(promote_options="permissive") gives it."""
    if len(files) == 1:
        return files[0].schema
    try:
        return pa.unify_schemas([f.schema for f in files], promote_options="permissive")
    except pa.ArrowException:
        raise ConfigError([("source.path", _disagreement(files))]) from None


def _disagreement(files: list[InputFile]) -> str:
    """Which column two files give types that do not go together."""
    seen: dict[str, tuple[pa.DataType, str]] = {}
    for file in files:
        for field in file.schema:
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
    if is_blank(file.path):
        return f"{file.name} is empty"
    return f"{file.name} has a header but no rows" if fmt == "csv" else f"{file.name} has no rows"
