"""The shards' rows in input order, streamed: collect writes output.parquet from these chunks
without ever holding the whole run.

Shards are written in the order rows finish, so each holds rows from around one stretch of the
input (the rows in flight when it was written), and a resumed run's shards follow the earlier
run's. The merge reads every shard once, in the order of its first row's input position, and
cuts the input into chunks of about CHUNK_BYTES:

    shard A (positions 0-1040) ──┐
    shard B (positions 980-2050) ├─► pieces by chunk ─► chunk 0 complete? sort, yield ─► ...
    shard C (positions 2001-...) ┘

NOTE (why a chunk is complete when yielded): shards are read in the order of their smallest
position, so once a shard starting at position p is reached, no shard still to come holds a
row before p: every chunk that ends at or before p has all its rows. Rows waiting for their
chunk stay in memory up to PENDING_BYTES, then the farthest chunks' pieces go to spill files
in the run folder, read back when their chunk comes: memory stays bounded however the shards
interleave (ordinary runs never spill).

Exactly once is checked first, from the ids alone: every id of the input in some shard, none
twice (CheckpointStore.scan), none that the input does not have.
"""

from __future__ import annotations

import shutil
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from flows.outputs.store import CheckpointStore

CHUNK_BYTES = 32 << 20  # about this much of decoded rows per yielded chunk
PENDING_BYTES = 128 << 20  # rows waiting for a later chunk kept in memory, beyond: spilled
_POSITION = "__position"  # a spilled piece's input positions


@dataclass
class _Shard:
    path: Path
    positions: np.ndarray  # each row's input position, in the shard's row order

    @property
    def first(self) -> int:
        return int(self.positions.min())


def ordered_chunks(
    store: CheckpointStore,
    ids: pa.Array,
    chunk_bytes: int = CHUNK_BYTES,
    pending_bytes: int = PENDING_BYTES,
) -> Iterator[pa.Table]:
    """Every row of the store's shards, in the order of `ids` (the run's request ids in input
    order), as tables of about chunk_bytes, all of one schema. ValueError when the shards do
    not hold each id exactly once."""
    for leftover in store.folder.glob(".merge-*"):  # a merge cut short by a crash
        shutil.rmtree(leftover, ignore_errors=True)
    scan = store.scan()
    if not scan.shards:
        raise ValueError(f"no shards in {store.shards_dir}")
    positions = pc.index_in(scan.done(), value_set=ids)
    unexpected = positions.null_count
    missing = len(ids) - (len(positions) - unexpected)  # (scan refused ids held twice)
    if missing or unexpected:
        raise ValueError(f"rows do not match the input: {missing} missing, {unexpected} unexpected")
    flat = positions.to_numpy(zero_copy_only=False).astype(np.int64)
    bounds = np.cumsum([0] + [len(a) for a in scan.ids])
    shards = sorted(
        (_Shard(path, flat[a:b]) for path, a, b in zip(scan.shards, bounds, bounds[1:])),
        key=lambda shard: shard.first,
    )
    schema = pa.unify_schemas([pq.read_schema(path) for path in scan.shards])
    chunk_rows = max(1, chunk_bytes // max(1, _row_bytes(scan.shards)))
    spill = _Spill(store.folder / f".merge-{uuid.uuid4().hex[:8]}", schema)
    try:
        yield from _chunks(shards, schema, chunk_rows, len(ids), pending_bytes, spill)
    finally:
        spill.remove()


def _chunks(
    shards: list[_Shard],
    schema: pa.Schema,
    chunk_rows: int,
    total: int,
    pending_bytes: int,
    spill: _Spill,
) -> Iterator[pa.Table]:
    pending: dict[int, list[tuple[np.ndarray, pa.Table]]] = defaultdict(list)
    held = 0  # bytes in `pending`
    chunks = -(-total // chunk_rows)
    next_chunk = 0

    def complete(chunk: int) -> pa.Table:
        nonlocal held
        pieces = pending.pop(chunk, [])
        held -= sum(t.nbytes for _, t in pieces)
        pieces += spill.take(chunk)
        order = np.concatenate([p for p, _ in pieces])
        rows = pa.concat_tables([t for _, t in pieces])
        return rows.take(pa.array(np.argsort(order, kind="stable")))

    for shard in shards:
        while next_chunk < min(chunks, shard.first // chunk_rows):
            yield complete(next_chunk)
            next_chunk += 1
        table = _conform(pq.read_table(shard.path), schema)
        chunk_of = shard.positions // chunk_rows
        for chunk in np.unique(chunk_of).tolist():
            mask = chunk_of == chunk
            piece = table.filter(pa.array(mask)) if not mask.all() else table
            pending[chunk].append((shard.positions[mask], piece))
            held += piece.nbytes
        while held > pending_bytes and len(pending) > 1:  # the farthest chunk to disk
            farthest = max(pending)
            pieces = pending.pop(farthest)
            held -= sum(t.nbytes for _, t in pieces)
            spill.put(farthest, pieces)
    while next_chunk < chunks:
        yield complete(next_chunk)
        next_chunk += 1


def _row_bytes(shards: list[Path]) -> int:
    """Decoded bytes per row, from the shards' Parquet footers (a run's rows are alike)."""
    rows = size = 0
    for path in shards[:64]:
        meta = pq.read_metadata(path)
        rows += meta.num_rows
        size += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return size // max(1, rows)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A shard's rows in the merged schema (a column an older shard lacks comes as nulls)."""
    columns = [
        table.column(f.name) if f.name in table.column_names else pa.nulls(len(table), f.type)
        for f in schema
    ]
    if table.schema.equals(schema):
        return table
    return pa.Table.from_arrays(columns, names=schema.names).cast(schema)


class _Spill:
    """Pieces of rows set aside on disk until their chunk comes, each file with its positions."""

    def __init__(self, folder: Path, schema: pa.Schema) -> None:
        self.folder = folder
        self.schema = schema
        self.files: dict[int, list[Path]] = defaultdict(list)

    def put(self, chunk: int, pieces: list[tuple[np.ndarray, pa.Table]]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        positions = np.concatenate([p for p, _ in pieces])
        rows = pa.concat_tables([t for _, t in pieces])
        path = self.folder / f"{chunk:08d}-{len(self.files[chunk])}.parquet"
        pq.write_table(rows.append_column(_POSITION, pa.array(positions)), path)
        self.files[chunk].append(path)

    def take(self, chunk: int) -> list[tuple[np.ndarray, pa.Table]]:
        pieces = []
        for path in self.files.pop(chunk, []):
            rows = pq.read_table(path)
            positions = rows.column(_POSITION).to_numpy()
            pieces.append((positions, _conform(rows.drop_columns([_POSITION]), self.schema)))
            path.unlink()
        return pieces

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
