"""One input file as Arrow batches, read a piece at a time: memory O(a batch), not O(the file).

Two passes read a file. The scan (`FileScan`, preflight's) hashes its bytes, decodes them and
yields its rows as they parse, each batch in the types its own bytes give; after it, `rows` and
`schema` are what pyarrow's read of the whole file gives. The read (`read_file`, the run's)
yields the rows again in that schema. Why a file does not scan is worded by the whole-file
reader of flows/inputs/file.py (`word_problem`), which names the line: only a bad file is read
whole, and its message is the one a whole read gives.

Why the scan settles a schema instead of trusting pyarrow's streaming readers: they fix each
column's type from the first block, where a whole-file read widens it for later rows.
- JSONL: `read_json` of the whole file adds a key first seen in a later row, and promotes a
  column (null to any type, int64 to double, a date-like timestamp[s] to string, lists and
  structs field by field); `open_json` refuses all of these. The scan parses newline-aligned
  pieces with `read_json` and joins their types by the same rules (`_join`); the read parses
  each piece with the settled schema as its explicit schema, so every value comes from its
  text in its final type, as in the whole-file read.
- CSV: `read_csv` of a whole file gives each column the first type of pyarrow's inference
  order that converts every value; `open_csv` fails where a later block needs a looser one.
  The scan pins that column to the next type of the order and reads the file again (its bytes
  are hashed once); the read pins every column.
- Parquet: the file's own schema; its bytes are hashed by a read of their own.
"""

from __future__ import annotations

import codecs
import io
import itertools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from flows.inputs.file import Unreadable, codec_name, parse_file

# NOTE: bytes read at a time (a JSONL batch is about this much text): not more, as with 16 MiB
# pieces a scan's peak grew with the file (freed pieces fragment the heap: +66 MB from 29 MB of
# JSONL to 184 MB), with 4 MiB ones it did not, and they parse as fast
READ_BYTES = 4 << 20
CSV_BLOCK = 1 << 20  # bytes of CSV text per batch (pyarrow's default)
BATCH_ROWS = 65_536  # rows of a Parquet batch
# NOTE: as flows/inputs/file.py reads a whole CSV: quoted fields may hold line breaks
_CSV_PARSE = pa_csv.ParseOptions(newlines_in_values=True)
# pyarrow's CSV inference tries these types in turn (arrow/csv/inference_internal.h), and a
# whole-file read gives a column the first that converts every value of it
_CSV_ORDER = (pa.null(), pa.int64(), pa.bool_(), pa.date32(), pa.time32("s"),
              pa.timestamp("s"), pa.timestamp("ns"), pa.timestamp("s", "UTC"),
              pa.timestamp("ns", "UTC"), pa.float64(), pa.string())  # fmt: skip
_CSV_CONVERSION = re.compile(r"In CSV column #(\d+): (?:Row #\d+: )?CSV conversion error to ")

Hash = Callable[[bytes], None]


class CannotRead(Exception):
    """The file itself cannot be read (a permission, a disk error): not a problem of its text."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))


def open_input(path: Path) -> io.BufferedReader:
    """Every read of an input file opens it here (a test counts the reads)."""
    return open(path, "rb")  # noqa: SIM115 (closed by its reader)


def file_stat(path: Path) -> tuple[int, int, int]:
    """What tells a changed file: its size, time of change and inode."""
    stat = path.stat()
    return (stat.st_size, stat.st_mtime_ns, stat.st_ino)


# ---------------------------------------------------------------------- bytes
class _Bytes:
    """A file's bytes, READ_BYTES at a time; each byte is hashed once, however often it is read."""

    def __init__(self, path: Path, hash: Hash | None = None) -> None:
        self.path, self.hash, self.hashed = path, hash, 0

    def chunks(self) -> Iterator[bytes]:
        try:
            file = open_input(self.path)
        except OSError as e:
            raise CannotRead(e) from None
        with file:
            offset = 0
            while True:
                try:
                    chunk = file.read(READ_BYTES)
                except OSError as e:
                    raise CannotRead(e) from None
                if not chunk:
                    return
                end = offset + len(chunk)
                if self.hash is not None and end > self.hashed:
                    self.hash(memoryview(chunk)[max(0, self.hashed - offset) :])
                    self.hashed = end
                offset = end
                yield chunk

    def unless_blank(self) -> Iterator[bytes] | None:
        """chunks(), or None if the bytes are all whitespace (flows/inputs/file.py reads no rows
        of them): a blank start is read to its end or its first other byte, in the same read."""
        chunks, start = self.chunks(), []
        for chunk in chunks:
            start.append(chunk)
            if chunk.strip():
                return itertools.chain(start, chunks)
        return None


def hash_file(path: Path, hash: Hash) -> None:
    """Feed a file's bytes to `hash`, a piece at a time."""
    for _ in _Bytes(path, hash).chunks():
        pass


def is_blank(path: Path) -> bool:
    return _Bytes(path).unless_blank() is None


def _utf8(chunks: Iterator[bytes], encoding: str) -> Iterator[bytes]:
    """The text as UTF-8 bytes, decoded piece by piece: UnicodeDecodeError where a byte does not
    decode (never a binary column), as flows/inputs/file.py decodes the whole file."""
    same = codec_name(encoding) == "utf-8"
    decoder = codecs.getincrementaldecoder(encoding)()
    for chunk in chunks:
        text = decoder.decode(chunk)
        yield chunk if same else text.encode("utf-8")
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail.encode("utf-8")


class _Stream(io.RawIOBase):
    """Pieces of bytes as a file, for pyarrow's CSV reader.

    NOTE: a read fills the whole buffer unless the bytes end: pyarrow's CSV reader splits a
    short read's block at a line break inside a quoted field."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self.pieces, self.left = pieces, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        filled = 0
        while filled < len(buffer):
            if not len(self.left):
                piece = next(self.pieces, None)
                if piece is None:
                    break
                self.left = memoryview(piece)
            size = min(len(buffer) - filled, len(self.left))
            buffer[filled : filled + size] = self.left[:size]
            self.left = self.left[size:]
            filled += size
        return filled


# ---------------------------------------------------------------------- the scan
class FileScan:
    """The first pass over one file: `batches()` hashes its bytes and yields its rows as they
    parse (each batch in its own bytes' types); after it, `rows` and `schema` are those of a
    read of the whole file, and `retyped` says whether a batch yielded holds other values than
    the read gives (a CSV column loosened, then read again; a JSONL piece pyarrow misread).
    Raises whatever the file's reader raises (CannotRead for an OSError)."""

    def __init__(self, path: Path, fmt: str, encoding: str, hash: Hash) -> None:
        self.path, self.fmt, self.encoding = path, fmt, encoding
        self.bytes = _Bytes(path, hash)
        self.rows, self.schema, self.retyped = 0, pa.schema([]), False

    def batches(self) -> Iterator[pa.Table]:
        if self.fmt == "parquet":
            yield from self._parquet()
        elif self.fmt == "jsonl":
            yield from self._jsonl()
        else:
            yield from self._csv()

    def _parquet(self) -> Iterator[pa.Table]:
        for _ in self.bytes.chunks():  # the digest's; the reader seeks, so reads on its own
            pass
        file = pq.ParquetFile(self.path)
        self.schema = file.schema_arrow
        for batch in file.iter_batches(batch_size=BATCH_ROWS):
            self.rows += batch.num_rows
            yield pa.Table.from_batches([batch])

    def _jsonl(self) -> Iterator[pa.Table]:
        chunks = self.bytes.unless_blank()
        if chunks is None:
            return
        schema = pa.schema([])
        for table in _json_tables(_utf8(chunks, self.encoding), None):
            schema = _join_schemas(schema, table.schema)
            self.rows += table.num_rows
            self.retyped = self.retyped or not _valid(table)
            yield table
        self.schema = schema

    def _csv(self) -> Iterator[pa.Table]:
        chunks = self.bytes.unless_blank()
        if chunks is None:
            return
        pinned: dict[str, pa.DataType] = {}
        names: list[str] = []
        while True:
            self.rows, reader = 0, None
            try:
                text = _utf8(chunks or self.bytes.chunks(), self.encoding)
                chunks = None  # (read again from its start, a column loosened: a new read)
                reader = _csv_reader(text, pinned)
                names = reader.schema.names
                for batch in reader:
                    self.rows += batch.num_rows
                    if not self.retyped:  # (once restarted, the caller reads them again)
                        yield pa.Table.from_batches([batch])
                self.schema = reader.schema
                return
            except pa.ArrowInvalid as e:
                looser = _loosened(e, names, pinned, reader)
                if looser is None:
                    raise
                pinned, self.retyped = looser, True


def _valid(table: pa.Table) -> bool:
    """NOTE: pyarrow's inferring read_json drops a list's leading nulls (`[null, 1]`) and
    builds an invalid array; the read, with an explicit schema, parses them right."""
    try:
        table.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _json_tables(pieces: Iterator[bytes], schema: pa.Schema | None) -> Iterator[pa.Table]:
    """The rows of newline-aligned pieces of JSONL, each parsed by read_json (in `schema` if
    given); at least one parse, so an empty text fails as read_json fails on it."""
    options = pa_json.ParseOptions(explicit_schema=schema) if schema is not None else None
    rest, parsed = b"", False
    for piece in pieces:
        data = rest + piece if rest else piece
        cut = data.rfind(b"\n") + 1
        lines, rest = data[:cut], data[cut:]
        if lines.strip():
            parsed = True
            yield pa_json.read_json(pa.BufferReader(lines), parse_options=options)
    if rest.strip() or not parsed:
        yield pa_json.read_json(pa.BufferReader(rest), parse_options=options)


def _join_schemas(a: pa.Schema, b: pa.Schema) -> pa.Schema:
    """Two pieces' JSON schemas as read_json gives the whole: a's fields, then b's new ones."""
    fields = {f.name: f.type for f in a}
    for field in b:
        fields[field.name] = (
            _join(fields[field.name], field.type) if field.name in fields else field.type
        )
    return pa.schema(list(fields.items()))


def _join(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """The type read_json gives a column whose values are of types a and b (its promotions);
    ArrowInvalid where it refuses the mix."""
    if a == b or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    for narrow, wide in ((pa.int64(), pa.float64()), (pa.timestamp("s"), pa.string())):
        if {a, b} == {narrow, wide}:
            return wide
    if pa.types.is_list(a) and pa.types.is_list(b):
        return pa.list_(_join(a.value_type, b.value_type))
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        joined = _join_schemas(pa.schema(list(a)), pa.schema(list(b)))
        return pa.struct(list(joined))
    raise pa.ArrowInvalid(f"a JSON column holds both {a} and {b}")


def _csv_reader(pieces: Iterator[bytes], types: dict[str, pa.DataType]) -> Any:
    return pa_csv.open_csv(
        _Stream(pieces),
        read_options=pa_csv.ReadOptions(block_size=CSV_BLOCK),
        parse_options=_CSV_PARSE,
        convert_options=pa_csv.ConvertOptions(column_types=types),
    )


def _loosened(
    error: pa.ArrowInvalid, names: list[str], pinned: dict[str, pa.DataType], reader: Any
) -> dict[str, pa.DataType] | None:
    """The pinned types with the column that failed to convert moved to pyarrow's next
    inference type, or None if the error is no such failure (or the column is a string)."""
    match = _CSV_CONVERSION.match(str(error))
    if match is None or int(match[1]) >= len(names):
        return None
    name = names[int(match[1])]
    current = pinned.get(name) or (reader.schema.field(name).type if reader else None)
    if current not in _CSV_ORDER or current == _CSV_ORDER[-1]:
        return None
    return {**pinned, name: _CSV_ORDER[_CSV_ORDER.index(current) + 1]}


# ---------------------------------------------------------------------- the read
def read_file(path: Path, fmt: str, encoding: str, schema: pa.Schema) -> Iterator[pa.Table]:
    """A scanned file's rows again, in the schema its scan settled."""
    if fmt == "parquet":
        file = pq.ParquetFile(path)
        for batch in file.iter_batches(batch_size=BATCH_ROWS):
            yield pa.Table.from_batches([batch])
        return
    chunks = _Bytes(path).unless_blank()
    if chunks is None:
        return
    text = _utf8(chunks, encoding)
    if fmt == "jsonl":
        yield from _json_tables(text, schema)
        return
    for batch in _csv_reader(text, dict(zip(schema.names, schema.types))):
        yield pa.Table.from_batches([batch])


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A file's rows in the schema of all files: their columns in its order and types, null
    where the file has none, as pa.concat_tables(promote_options="permissive") gives them."""
    if table.schema.equals(schema):
        return table
    return pa.concat_tables([schema.empty_table(), table], promote_options="permissive")


def word_problem(path: Path, name: str, fmt: str, encoding: str, error: Exception) -> str:
    """Why a file does not read, in today's words (flows/inputs/file.py, which reads it whole:
    only a bad file is), else the error of the batch that failed."""
    if isinstance(error, CannotRead):
        return f"cannot read {name}: {error}"
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"cannot read {name}: {e.strerror or e}"
    try:
        parse_file(data, name, fmt, encoding)
    except Unreadable as problem:
        return str(problem)
    label = {"jsonl": "JSONL", "csv": "CSV", "parquet": "Parquet"}[fmt]
    return f"{name}: not readable as {label} ({error})"
