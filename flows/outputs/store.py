"""The checkpoint store: results as Parquet shards that survive any crash, each row written once.

    <output_dir>/<run_name>/<fingerprint>/config.json      what produced these rows
    <output_dir>/<run_name>/<fingerprint>/shards/*.parquet  the rows, in shards
    <output_dir>/<run_name>/<fingerprint>/run.json         the run's settings and row count
    <output_dir>/<run_name>/<fingerprint>/output.parquet   all rows merged, once complete
    <output_dir>/<run_name>/<fingerprint>/summary.json     the merged run's numbers

A shard is written to a dot-prefixed temporary name and moved into place with os.replace, so a
reader sees a whole shard or none; its name carries a CRC-32 of its bytes. Resuming checks
every shard whole against that checksum, reads its ids and skips those rows; what a crash or
a bad disk left behind (temporary files, shards that do not read back whole) is reported, set
aside and redone, so merging never meets an unreadable shard. The fingerprint hashes
everything that changes an output row, so a changed config writes beside the old results,
never into them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

ID_COLUMN = "id"
# shard-<uuid>-<CRC-32 of the file's bytes>.parquet; shards of earlier versions have no checksum
_CHECKSUM = re.compile(r"^shard-[0-9a-f]{32}-(?P<crc>[0-9a-f]{8})\.parquet$")


def fingerprint(identity: dict[str, Any]) -> str:
    """A short stable hash of everything that changes an output row (canonical JSON)."""
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def row_seed(run_seed: int, row_id: str) -> int:
    """The sampling seed of one row: a resumed row gets the seed a fresh run would have given it."""
    digest = hashlib.sha256(f"{run_seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative int64


@dataclass
class Scan:
    """What a run folder holds: the good shards and their ids, and what was set aside.

    NOTE: ids are kept as Arrow arrays, a few bytes a row: a run of millions of rows must not
    hold a Python string per done row (flows/run/plan.py tests membership with pyarrow)."""

    shards: list[Path] = field(default_factory=list)
    ids: list[pa.Array] = field(default_factory=list)  # each good shard's, in `shards` order
    problems: list[str] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(len(ids) for ids in self.ids)

    def done(self) -> pa.Array:
        """Every id the shards hold, as one string array."""
        if not self.ids:
            return pa.array([], pa.string())
        return pa.concat_arrays(self.ids)

    @property
    def done_ids(self) -> set[str]:
        """The same as a set: for small runs (OpenAI batch files) and tests."""
        return set(self.done().to_pylist())


class CheckpointStore:
    def __init__(self, output_dir: str | Path, run_name: str, identity: dict[str, Any]) -> None:
        self.identity = identity
        self.fingerprint = fingerprint(identity)
        self.folder = Path(output_dir) / run_name / self.fingerprint
        self.shards_dir = self.folder / "shards"
        self._lock: int | None = None
        self.writer_token: str | None = None  # this run's mark in the writer file, once locked

    def __getstate__(self) -> dict[str, Any]:
        # NOTE: a lock is a descriptor of this process: a copy sent to another process (a Dask
        # worker writing shards) holds none, so it can never close a stranger's descriptor.
        return {**self.__dict__, "_lock": None}

    @classmethod
    def at(cls, folder: str | Path) -> CheckpointStore:
        """An existing run folder, to look at: its identity is read back from its config.json."""
        folder = Path(folder)
        config = folder / "config.json"
        if not config.is_file():
            raise ValueError(f"{folder} is not a run folder (it has no config.json)")
        store = cls(folder.parent.parent, folder.parent.name, json.loads(config.read_text()))
        store.fingerprint, store.folder, store.shards_dir = folder.name, folder, folder / "shards"
        return store

    # ------------------------------------------------------------------ one writer at a time
    def lock(self) -> None:
        """Become the folder's only writer, or raise ValueError if another run is writing to it.

        NOTE: two runs of one config would each write the rows the other has not finished,
        so both would write them. The lock is a flock on a file beside the folder: the kernel
        drops it when the holder exits, however it exits, so a crash never leaves it stuck.
        """
        if self._lock is not None:
            return
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + 2.0  # a look (writer()) holds it for an instant
        while not _try_flock(fd, fcntl.LOCK_EX):
            if time.monotonic() > deadline:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise ValueError(
                    f"another run (pid {holder}) is writing to {self.folder}; wait for it to end"
                )
            time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock = fd
        self.writer_token = uuid.uuid4().hex
        _atomic_write(self._writer_path, self.writer_token.encode())

    def check_writer(self) -> None:
        """Raise unless the run that locked this store (in any process) is still its writer.

        NOTE: the lock holder's helpers in other processes (Dask workers) write shards without
        the lock; if the holder died while a helper on another machine went on, a rerun takes
        the lock and writes a new token, and this check stops the stray helper before its next
        shard lands (all but a rename's instant), so it cannot write rows the rerun redoes.
        """
        if self.writer_token is None:
            return
        try:
            current = self._writer_path.read_text()
        except OSError:
            current = None
        if current != self.writer_token:
            raise RuntimeError(
                f"a newer run is writing to {self.folder}: this worker of an earlier run stops "
                "without writing its unsaved rows (the newer run does them)"
            )

    def writer(self) -> str | None:
        """The pid of the run writing to the folder now, or None (a look: it takes no lock)."""
        if not self._lock_path.exists():
            return None
        fd = os.open(self._lock_path, os.O_RDONLY)
        try:
            if _try_flock(fd, fcntl.LOCK_SH):
                return None  # closing the descriptor lets go at once
            return os.read(fd, 64).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)

    @property
    def _lock_path(self) -> Path:
        return self.folder.parent / f"{self.fingerprint}.lock"

    @property
    def _writer_path(self) -> Path:
        return self.folder.parent / f"{self.fingerprint}.writer"

    def unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    # ------------------------------------------------------------------ a soft stop
    def request_stop(self) -> None:
        """Ask this run's helpers in other processes (Dask workers) to stop taking rows: they
        write the rows they have finished and end their parts (the run's Ctrl-C)."""
        _atomic_write(self._stop_path, (self.writer_token or "").encode())

    def stop_requested(self) -> bool:
        """Has the run that locked this store asked its helpers to stop? (A request of an
        earlier run names an older writer token, so it never stops a later one.)"""
        try:
            return self.writer_token is not None and self._stop_path.read_text() == (
                self.writer_token
            )
        except OSError:
            return False

    @property
    def _stop_path(self) -> Path:
        return self.folder.parent / f"{self.fingerprint}.stop"

    # ------------------------------------------------------------------ opening
    def open(self) -> Scan:
        """Create or reopen the run folder; returns what is already done there."""
        siblings = (
            [p.name for p in self.folder.parent.glob("*") if p.is_dir() and p != self.folder]
            if self.folder.parent.is_dir()
            else []
        )
        if siblings and not self.folder.exists():
            logger.warning(
                "config changed: writing to %s beside earlier results in %s",
                self.folder.name,
                ", ".join(sorted(siblings)),
            )
        self.shards_dir.mkdir(parents=True, exist_ok=True)
        config = self.folder / "config.json"
        if config.exists():
            if json.loads(config.read_text()) != json.loads(json.dumps(self.identity, default=str)):
                raise ValueError(
                    f"{config} belongs to another config with the same fingerprint (hash collision?)"
                )
        else:
            _atomic_write(
                config, json.dumps(self.identity, indent=2, sort_keys=True, default=str).encode()
            )
        return self.scan()

    def scan(self, repair: bool = True) -> Scan:
        """The shards' ids; with repair=False (to look, not to run) leftovers are only reported."""
        scan = Scan()
        for path in sorted(self.shards_dir.iterdir()):
            if path.name.startswith("."):
                if repair:
                    path.unlink()
                scan.problems.append(
                    f"removed an unfinished shard left by a crash: {path.name}"
                    if repair
                    else f"found an unfinished shard (being written, or left by a crash): {path.name}"
                )
                continue
            if path.suffix != ".parquet":
                continue
            try:
                ids = _verified_ids(path)
            except Exception as e:  # not whole (corrupt, cut short): set aside, its rows redone
                if repair:
                    path.rename(path.with_name(f"{path.name}.unreadable"))
                verb = "set aside" if repair else "found"
                scan.problems.append(
                    f"{verb} unreadable shard {path.name} ({e}); its rows will be redone"
                )
                continue
            scan.shards.append(path)
            scan.ids.append(ids)
        _check_unique(scan)
        if repair:
            for problem in scan.problems:
                logger.warning(problem)
        return scan

    # ------------------------------------------------------------------ writing
    def write_shard(
        self,
        rows: list[dict[str, Any]],
        schema: pa.Schema | None = None,
        fence: Callable[[], None] | None = None,
    ) -> Path:
        """Write rows as one new shard, atomically; returns its path.

        With a schema every shard gets the same column types, even one whose values are all null.
        `fence` runs just before the shard is moved into place; if it raises, no shard appears.
        """
        if not rows:
            raise ValueError("a shard needs at least one row")
        if any(ID_COLUMN not in r for r in rows):
            raise ValueError(f"every row needs an {ID_COLUMN!r} column")
        data = _parquet_bytes(pa.Table.from_pylist(rows, schema=schema))
        path = self.shards_dir / f"shard-{uuid.uuid4().hex}-{zlib.crc32(data):08x}.parquet"
        _atomic_write(path, data, fence)
        return path

    @property
    def output_path(self) -> Path:
        return self.folder / "output.parquet"

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        path = self.folder / name
        _atomic_write(path, json.dumps(data, indent=2, sort_keys=True, default=str).encode())
        return path

    # ------------------------------------------------------------------ reading
    def merge(self, expected_ids: set[str] | None = None) -> pa.Table:
        """All rows in one table; checks ids are unique and, if given, exactly the expected ones."""
        scan = self.scan()
        if not scan.shards:
            raise ValueError(f"no shards in {self.shards_dir}")
        table = pa.concat_tables([pq.read_table(p) for p in scan.shards], promote_options="default")
        ids = table.column(ID_COLUMN).to_pylist()
        if len(ids) != len(set(ids)):
            raise ValueError("duplicate ids across shards")
        if expected_ids is not None and set(ids) != expected_ids:
            missing, extra = expected_ids - set(ids), set(ids) - expected_ids
            raise ValueError(
                f"rows do not match the input: {len(missing)} missing, {len(extra)} unexpected"
            )
        return table


def _try_flock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _verified_ids(shard: Path) -> pa.Array:
    """The ids of a shard that reads back whole; ValueError or an Arrow error if it does not.

    The checksum in its name covers every byte, so a shard that matches it decodes as written
    and its id column alone is read. NOTE: the ids alone are not enough: a page of another
    column can be corrupt while the ids read back, and merging would fail on it in every
    rerun. A shard named without a checksum (an earlier version's) is read whole instead."""
    data = shard.read_bytes()  # one read: the checksum and the ids come from the same bytes
    match = _CHECKSUM.match(shard.name)
    if match is None:
        ids = pq.read_table(pa.BufferReader(data)).column(ID_COLUMN)
    elif f"{zlib.crc32(data):08x}" != match["crc"]:
        raise ValueError("its bytes do not match the checksum it was written with")
    else:
        ids = pq.read_table(pa.BufferReader(data), columns=[ID_COLUMN]).column(ID_COLUMN)
    return ids.combine_chunks().cast(pa.string())


def _check_unique(scan: Scan) -> None:
    """ValueError naming a shard that repeats ids of an earlier one (in one hash pass)."""
    counts = pc.value_counts(scan.done())
    repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    if not len(repeated):
        return
    seen = pa.array([], pa.string())
    for path, ids in zip(scan.shards, scan.ids):
        again = ids.filter(pc.is_in(ids, value_set=seen))
        if len(again):
            examples = sorted(again.to_pylist())[:3]
            raise ValueError(
                f"shard {path.name} repeats {len(again)} id(s) already in other shards, "
                f"e.g. {examples}"
            )
        seen = pa.concat_arrays([seen, ids])
    raise ValueError(f"an id repeats within a shard, e.g. {repeated[0].as_py()!r}")


def write_parquet(path: Path, table: pa.Table, fence: Callable[[], None] | None = None) -> None:
    """A Parquet file that appears whole or not at all."""
    _atomic_write(path, _parquet_bytes(table), fence)


def write_parquet_chunks(path: Path, chunks: Iterable[pa.Table]) -> int:
    """A Parquet file of the chunks (one schema, the first's), a row group or more each, that
    appears whole or not at all; memory holds one chunk at a time. Returns the rows written."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    rows = 0
    writer: pq.ParquetWriter | None = None
    try:
        for chunk in chunks:
            if writer is None:
                writer = pq.ParquetWriter(tmp, chunk.schema)
            writer.write_table(chunk)
            rows += chunk.num_rows
        if writer is None:
            raise ValueError(f"{path.name}: no rows to write")
        writer.close()
        writer = None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    return rows


def write_file(path: Path, data: bytes) -> None:
    """A file that appears whole or not at all."""
    _atomic_write(path, data)


def _parquet_bytes(table: pa.Table) -> bytes:
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    return buffer.getvalue().to_pybytes()


def _atomic_write(path: Path, data: bytes, fence: Callable[[], None] | None = None) -> None:
    """Write to a dot-prefixed temporary beside `path`, flush it to disk, then rename into place
    (unless `fence` raises: then the temporary is removed and nothing appears)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if fence is not None:
        try:
            fence()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, path)
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # a rename into it survives a power cut
    finally:
        os.close(dir_fd)
