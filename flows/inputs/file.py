"""One input file: its bytes decoded (JSONL and CSV, in `source.encoding`) and parsed with
pyarrow, or, when that fails, the message that names the file, the real line, the column and
the value. pyarrow names a row within a block, not a line of the file, so only a file that does
not read is read again with Python's json or csv module to find the line (flows/inputs/sources.py
reads the input through here).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

_CLIP = 60  # characters of a value shown in a message
_WORD_ENDS = b' \t\r\n,;:"{}[]'


def codec_name(encoding: str) -> str:
    return codecs.lookup(encoding).name  # "UTF8", "utf_8" and "utf-8" are one encoding


class Unreadable(Exception):
    """A file that does not read; its message names the file, the line and what is wrong."""


def parse_file(data: bytes, name: str, fmt: str, encoding: str) -> pa.Table:
    if fmt == "parquet":
        try:
            return pq.read_table(pa.BufferReader(data))
        except (OSError, pa.ArrowException) as e:
            raise Unreadable(f"{name}: not readable as Parquet ({e})") from None
    if not data.strip():
        return pa.table({})
    utf8 = _as_utf8(data, name, fmt, encoding)
    try:
        if fmt == "jsonl":
            return pa_json.read_json(pa.BufferReader(utf8))
        # NOTE: quoted fields may hold line breaks, as Python's csv module (which words the
        # errors) reads them; pyarrow's default would split such a row at a block's end
        options = pa_csv.ParseOptions(newlines_in_values=True)
        return pa_csv.read_csv(pa.BufferReader(utf8), parse_options=options)
    except pa.ArrowException as e:
        text = _without_bom(utf8.decode("utf-8"))
        problem = _json_problem(text, name) if fmt == "jsonl" else _csv_problem(text, name)
        raise Unreadable(problem or f"{name}: not readable as {fmt.upper()} ({e})") from None


def _as_utf8(data: bytes, name: str, fmt: str, encoding: str) -> bytes:
    """The bytes as UTF-8, for pyarrow: checked whole, so no column is read as binary."""
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as e:
        raise Unreadable(_undecodable(data, e, name, fmt, encoding)) from None
    return data if codec_name(encoding) == "utf-8" else text.encode("utf-8")


def _undecodable(data: bytes, error: UnicodeDecodeError, name: str, fmt: str, encoding: str) -> str:
    line = data[: error.start].decode(encoding, errors="replace").count("\n") + 1
    text = _without_bom(data.decode(encoding, errors="surrogateescape"))
    column = _column_at(text, line, fmt)
    left, right = error.start, error.end
    while left > 0 and error.start - left < 20 and data[left - 1] not in _WORD_ENDS:
        left -= 1
    while right < len(data) and right - error.end < 20 and data[right] not in _WORD_ENDS:
        right += 1
    where = f"line {line}" + (f", column {column!r}" if column is not None else "")
    return (
        f"{name} {where}: bytes {data[left:right]!r} are not valid {encoding} "
        f"(set source.encoding if the file is not {encoding})"
    )


def _column_at(text: str, line: int, fmt: str) -> str | None:
    """The column whose value holds the first undecoded byte (a lone surrogate) on `line`."""
    if fmt == "jsonl":
        try:
            row = json.loads(text.split("\n")[line - 1])
        except ValueError:
            return None
        if isinstance(row, dict):
            return next((key for key, value in row.items() if _undecoded(value)), None)
        return None
    header = None
    for start, fields in _csv_records(text):
        if header is None:
            header = fields
            if start == line and _undecoded(fields):
                return None  # in the header itself
            continue
        if start <= line and _undecoded(fields):
            index = next(i for i, field in enumerate(fields) if _undecoded(field))
            return header[index] if index < len(header) else None
    return None


def _undecoded(value: Any) -> bool:
    """Whether a value holds bytes that did not decode (surrogateescape's lone surrogates)."""
    if isinstance(value, str):
        return any("\udc80" <= c <= "\udcff" for c in value)
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, list) and any(map(_undecoded, value))


def _json_problem(text: str, name: str) -> str | None:
    """The first line pyarrow cannot read: not JSON, not an object, or a value whose JSON type
    differs from the column's on an earlier line. None if Python finds nothing wrong."""
    kinds: dict[str, tuple[str, int]] = {}
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            why = f"{e.msg.removesuffix(' at')} at character {e.colno}"  # "Unterminated ... at"
            return f"{name} line {number}: not valid JSON ({why}): {_clip(line)}"
        if not isinstance(row, dict):
            return f"{name} line {number}: not a JSON object (JSONL is one per line): {_clip(line)}"
        for key, value in row.items():
            kind = _json_kind(value)
            if kind is None:
                continue
            first_kind, first_line = kinds.setdefault(key, (kind, number))
            if kind != first_kind:
                return (
                    f"{name} line {number}, column {key!r}: {_clip(json.dumps(value), quote=False)}"
                    f" is {kind}, but line {first_line} has {first_kind}"
                )
    return None


def _json_kind(value: Any) -> str | None:
    """A JSON value's type as pyarrow tells columns apart (integers and decimals mix)."""
    if value is None:
        return None
    for kind, types in (("a boolean", bool), ("a number", (int, float)), ("a string", str),
                        ("an array", list), ("an object", dict)):  # fmt: skip
        if isinstance(value, types):
            return kind
    return None


def _csv_problem(text: str, name: str) -> str | None:
    """The first record whose number of fields differs from the header's, by its line."""
    header = None
    for line, fields in _csv_records(text):
        if header is None:
            header = fields
        elif len(fields) != len(header):
            return (
                f"{name} line {line}: {len(fields)} fields, but the header has {len(header)}: "
                f"{_clip(','.join(fields))}"
            )
    return None


def _csv_records(text: str) -> Iterator[tuple[int, list[str]]]:
    """(first line, fields) of each non-empty record, the header first (as pyarrow skips empty
    lines); a quoted field may span lines."""
    reader = csv.reader(io.StringIO(text, newline=""))
    start = 1
    for fields in reader:
        if fields:
            yield start, fields
        start = reader.line_num + 1


def row_lines(text: str, fmt: str) -> list[int]:
    """The line each row of a text file starts on."""
    if fmt == "jsonl":
        return [n for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    return [line for line, _ in _csv_records(text)][1:]


def read_text(path: Path, encoding: str) -> str:
    return _without_bom(path.read_bytes().decode(encoding, errors="replace"))


def _without_bom(text: str) -> str:
    return text.removeprefix("\ufeff")  # pyarrow skips it; json and csv would read it as text


def _clip(text: str, quote: bool = True) -> str:
    text = text.strip()
    text = text if len(text) <= _CLIP else text[: _CLIP - 1] + "…"
    return repr(text) if quote else text
