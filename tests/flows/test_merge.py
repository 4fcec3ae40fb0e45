"""The streaming merge (flows/outputs/merge.py) against brute force: all shards read into one
table and sorted by input position. Shards in finish order, in random order (which spills), an
older shard without a column, and the exactly-once checks."""

import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.outputs.merge import ordered_chunks
from flows.outputs.store import CheckpointStore

SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("n", pa.int64())])


def _store(tmp_path, shards: list[list[int]], ids: list[str]) -> CheckpointStore:
    store = CheckpointStore(tmp_path, "run", {"test": 1})
    store.open()
    for rows in shards:
        store.write_shard(
            [{"id": ids[i], "text": f"row {i} " + "x" * (i % 50), "n": i} for i in rows], SCHEMA
        )
    return store


def _brute_force(store: CheckpointStore, ids: list[str]) -> pa.Table:
    rows = pa.concat_tables(
        [pq.read_table(p) for p in store.scan().shards], promote_options="default"
    )
    where = {rid: k for k, rid in enumerate(ids)}
    order = np.argsort([where[r] for r in rows.column("id").to_pylist()])
    return rows.take(pa.array(order))


def _finish_order(n: int, window: int, shard: int, rng: random.Random) -> list[list[int]]:
    """Rows as a run writes them: submitted in order, finishing within `window` of their turn,
    written `shard` at a time."""
    finished = sorted(range(n), key=lambda i: i + rng.uniform(0, window))
    return [finished[k : k + shard] for k in range(0, n, shard)]


@pytest.mark.parametrize(
    "layout, chunk_bytes, pending_bytes",
    [
        ("finish order", 4096, 1 << 30),  # many chunks, nothing spilled
        ("finish order, resumed", 2048, 1 << 30),
        ("random", 4096, 8192),  # every shard spans every chunk: pieces spill and come back
    ],
)
def test_chunks_are_the_rows_in_input_order(tmp_path, layout, chunk_bytes, pending_bytes):
    rng = random.Random(layout)
    n = 1500
    ids = [f"q{rng.randrange(10**9):09d}-{i}" for i in range(n)]  # not sorted as strings
    if layout == "finish order":
        shards = _finish_order(n, 64, 50, rng)
    elif layout == "finish order, resumed":  # a first run wrote some, the rerun the rest
        first = _finish_order(700, 64, 50, rng)[:-3]
        done = {i for s in first for i in s}
        rest = [i for i in range(n) if i not in done]
        shards = first + [rest[k : k + 25] for k in range(0, len(rest), 25)]
    else:
        order = list(range(n))
        rng.shuffle(order)
        shards = [order[k : k + 50] for k in range(0, n, 50)]
    store = _store(tmp_path, shards, ids)
    spill_dirs = []
    chunks = []
    for chunk in ordered_chunks(store, pa.array(ids), chunk_bytes, pending_bytes):
        chunks.append(chunk)
        spill_dirs += list(store.folder.glob(".merge-*/*.parquet"))
    merged = pa.concat_tables(chunks)
    assert merged.equals(_brute_force(store, ids))
    assert merged.column("id").to_pylist() == ids
    assert len(chunks) > 5, "the merge streams: many chunks of bounded size"
    assert max(c.nbytes for c in chunks) < 4 * chunk_bytes
    assert bool(spill_dirs) == (layout == "random")
    assert not list(store.folder.glob(".merge-*")), "spill files are removed"


def test_a_shard_of_an_earlier_version_without_a_column_merges_with_nulls(tmp_path):
    ids = [str(i) for i in range(30)]
    store = _store(tmp_path, [list(range(10, 30))], ids)
    old = pa.table({"id": ids[:10], "text": ["old"] * 10})  # no "n" column, no checksum
    pq.write_table(old, store.shards_dir / "shard-old.parquet")
    merged = pa.concat_tables(ordered_chunks(store, pa.array(ids), chunk_bytes=256))
    assert merged.schema == SCHEMA
    assert merged.column("id").to_pylist() == ids
    assert merged.column("n").to_pylist() == [None] * 10 + list(range(10, 30))


def test_missing_and_unexpected_ids_are_refused(tmp_path):
    ids = [str(i) for i in range(10)]
    store = _store(tmp_path, [[0, 1, 2], [3, 4]], ids)
    with pytest.raises(ValueError, match="5 missing, 0 unexpected"):
        next(ordered_chunks(store, pa.array(ids)))
    with pytest.raises(ValueError, match="0 missing, 2 unexpected"):
        next(ordered_chunks(store, pa.array(ids[:3])))
    store.write_shard([{"id": "4", "text": "again", "n": 4}], SCHEMA)
    with pytest.raises(ValueError, match="repeats 1 id"):
        next(ordered_chunks(store, pa.array(ids[:5])))
