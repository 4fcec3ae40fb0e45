"""The hand-out of a Dask run's rows: batches that its parts take one at a time, as they free up.

    <run folder>/handout/<writer token>/todo.parquet   the rows still to do, one row group a batch
    <run folder>/handout/<writer token>/claims/000012  -> "part-1": batch 12 is part 1's

The flow process writes the run's work once, before any part starts. A part takes the next
batch that no part has by creating its claim: a symbolic link whose target names the part, made
by one system call that fails when the claim exists (atomic on a local disk and on NFS alike).
So two parts never take one batch, and from the instant a claim exists it says whose it is: a
part that Dask runs again after its worker died finds the batches its lost attempt took.

NOTE (exactly once): a batch's rows are generated only by the part that claimed it, and a
run's batches hold only rows no shard had when it began (a new run, with a new writer token,
writes a new hand-out). So a batch taken from the pool has no row in a shard yet; only a batch
of a lost attempt may, and its taker skips those rows (parts.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flows.outputs.store import CheckpointStore

_PART = "part-"  # a claim's target: the part that took the batch


@dataclass
class Handout:
    folder: Path  # <run folder>/handout/<writer token>
    batches: int
    rows: int
    _next: int = field(default=0, repr=False)  # where this process looks for a free batch
    _file: pq.ParquetFile | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ the flow process
    @classmethod
    def write(cls, store: CheckpointStore, todo: Iterable[pa.Table], batch_rows: int) -> Handout:
        """The run's work as batches of `batch_rows` rows, in input order, in the run folder:
        the work tables stream to the disk as they come (a prompt is rendered, written and let
        go), then the file moves into place whole."""
        if store.writer_token is None:
            raise RuntimeError("the hand-out is written by the run that locked the store")
        root = store.folder / "handout"
        if root.is_dir():  # a crashed run's: its parts are stopped by the store's writer check
            for old in root.iterdir():
                shutil.rmtree(old, ignore_errors=True)
        folder = root / store.writer_token
        (folder / "claims").mkdir(parents=True)
        path, partial = folder / "todo.parquet", folder / ".todo.parquet.tmp"
        rows = 0
        writer: pq.ParquetWriter | None = None
        try:
            for batch in _rebatch(todo, batch_rows):  # NOTE: a row group is exactly one batch
                if writer is None:
                    writer = pq.ParquetWriter(partial, batch.schema)
                writer.write_table(batch, row_group_size=batch_rows)
                rows += batch.num_rows
        finally:
            if writer is not None:
                writer.close()
        if writer is None:
            raise ValueError("the hand-out needs at least one row")
        os.replace(partial, path)
        return cls(folder, pq.read_metadata(path).num_row_groups, rows)

    def remove(self) -> None:
        """Once every part has ended: the batches are in shards, or redone by a rerun."""
        shutil.rmtree(self.folder, ignore_errors=True)

    # ------------------------------------------------------------------ a part
    def claim(self, part: int) -> int | None:
        """Take the first batch no part has taken, for `part`: its number, or None if none left."""
        while self._next < self.batches:
            batch, self._next = self._next, self._next + 1
            try:
                os.symlink(f"{_PART}{part}", self._claim_path(batch))
            except FileExistsError:
                continue  # another part's
            return batch
        return None

    def left(self) -> int:
        """How many batches no part has taken yet (a look: another part may take them first)."""
        return self.batches - len(os.listdir(self.folder / "claims"))

    def claimed_by(self, part: int) -> list[int]:
        """The batches `part` has taken (an earlier attempt's, when Dask runs a part again)."""
        mine = []
        for entry in os.scandir(self.folder / "claims"):
            if os.readlink(entry.path) == f"{_PART}{part}":
                mine.append(int(entry.name))
        return sorted(mine)

    def claims(self) -> dict[int, int]:
        """{batch: the part that took it}: what the parts took so far."""
        return {
            int(entry.name): int(os.readlink(entry.path).removeprefix(_PART))
            for entry in os.scandir(self.folder / "claims")
        }

    def read(self, batch: int) -> pa.Table:
        """A batch's rows (the work rows of flows/run/plan.py: id, input columns, prompt, seed)."""
        if self._file is None:
            self._file = pq.ParquetFile(self.folder / "todo.parquet")
        return self._file.read_row_group(batch)

    def _claim_path(self, batch: int) -> Path:
        return self.folder / "claims" / f"{batch:06d}"

    def __getstate__(self) -> dict[str, object]:
        # NOTE: a copy sent to a part starts its own look for free batches and opens its own file
        return {**self.__dict__, "_next": 0, "_file": None}


def _rebatch(tables: Iterable[pa.Table], rows: int) -> Iterator[pa.Table]:
    """The tables' rows again, as tables of exactly `rows` rows (the last: what is left)."""
    held: list[pa.Table] = []
    count = 0
    for table in tables:
        held.append(table)
        count += table.num_rows
        while count >= rows:
            joined = pa.concat_tables(held)
            yield joined.slice(0, rows).combine_chunks()
            rest = joined.slice(rows)
            held, count = [rest], rest.num_rows
    if count:
        yield pa.concat_tables(held).combine_chunks()
