"""The Parquet checkpoint store: atomic shards, resume by id, crash leftovers, shards verified
whole, fingerprints."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows.outputs.store import CheckpointStore, fingerprint, row_seed, write_parquet
from tests.flows.fixtures import alter_the_first_value_of, corrupt_a_page_of, wait_until

IDENTITY = {"model": "tiny", "sampling": {"temperature": 0}, "template": "{q}", "seed": 1}


def _rows(ids, tag="x"):
    return [{"id": str(i), "text": f"{tag}{i}", "tokens": i} for i in ids]


def test_shards_resume_and_merge(tmp_path):
    store = CheckpointStore(tmp_path, "run", IDENTITY)
    assert store.open().done_ids == set()
    store.write_shard(_rows(range(0, 5)))
    store.write_shard(_rows(range(5, 8)))
    again = CheckpointStore(
        tmp_path, "run", dict(reversed(list(IDENTITY.items())))
    )  # same config, other key order
    assert again.folder == store.folder
    scan = again.open()
    assert scan.done_ids == {str(i) for i in range(8)} and scan.rows == 8 and not scan.problems
    table = again.merge(expected_ids={str(i) for i in range(8)})
    assert sorted(table.column("id").to_pylist(), key=int) == [str(i) for i in range(8)]
    assert (store.folder / "config.json").is_file()


def test_crash_leftovers_are_reported_set_aside_and_redone(tmp_path, caplog):
    store = CheckpointStore(tmp_path, "run", IDENTITY)
    store.open()
    good = store.write_shard(_rows(range(3)))
    torn = store.write_shard(_rows(range(3, 6)))
    torn.write_bytes(torn.read_bytes()[:40])  # a shard cut short
    (store.shards_dir / ".shard-abc.parquet.1234.tmp").write_bytes(b"half")
    with caplog.at_level(logging.WARNING, logger="flows.outputs.store"):
        scan = store.open()
    assert scan.done_ids == {"0", "1", "2"} and scan.shards == [good]
    assert len(scan.problems) == 2 and len(caplog.records) == 2
    assert not [p for p in store.shards_dir.iterdir() if p.name.startswith(".")]
    assert (store.shards_dir / f"{torn.name}.unreadable").exists()
    store.write_shard(_rows(range(3, 6), tag="redo"))
    assert store.merge(expected_ids={str(i) for i in range(6)}).num_rows == 6


def test_changed_config_writes_beside_the_old_results(tmp_path, caplog):
    old = CheckpointStore(tmp_path, "run", IDENTITY)
    old.open()
    old_shard = old.write_shard(_rows(range(4)))
    before = old_shard.read_bytes()
    with caplog.at_level(logging.WARNING, logger="flows.outputs.store"):
        new = CheckpointStore(tmp_path, "run", {**IDENTITY, "sampling": {"temperature": 0.7}})
        assert new.open().done_ids == set()
    assert new.folder != old.folder and new.folder.parent == old.folder.parent
    assert "config changed" in caplog.text and old.fingerprint in caplog.text
    assert old_shard.read_bytes() == before


def test_duplicate_or_missing_ids_are_caught(tmp_path):
    store = CheckpointStore(tmp_path, "run", IDENTITY)
    store.open()
    store.write_shard(_rows(range(3)))
    with pytest.raises(ValueError, match="1 missing, 0 unexpected"):
        store.merge(expected_ids={"0", "1", "2", "3"})
    store.write_shard(_rows([2, 3]))
    with pytest.raises(ValueError, match="repeats 1 id"):
        store.scan()
    with pytest.raises(ValueError, match="at least one row"):
        store.write_shard([])
    with pytest.raises(ValueError, match="'id' column"):
        store.write_shard([{"text": "no id"}])


def test_fingerprint_and_row_seed_are_stable():
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert row_seed(7, "row-1") == row_seed(7, "row-1")
    seeds = {row_seed(7, f"row-{i}") for i in range(1000)} | {row_seed(8, "row-1")}
    assert len(seeds) == 1001 and all(0 <= s < 2**63 for s in seeds)


def test_sigkill_while_writing_leaves_only_whole_shards(tmp_path):
    """A writer killed at a random moment: after a scan every shard is whole and no temp file remains."""
    script = textwrap.dedent(f"""
        import sys
        from flows.outputs.store import CheckpointStore
        store = CheckpointStore({str(tmp_path)!r}, "run", {IDENTITY!r})
        store.open()
        print("ready", flush=True)
        for s in range(100000):
            store.write_shard([{{"id": f"{{s}}-{{i}}", "text": "y" * 2000, "tokens": i}} for i in range(200)])
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        shards = tmp_path / "run"
        wait_until(lambda: any(shards.glob("*/shards/shard-*.parquet")), 60, "a first shard")
        time.sleep(0.1)  # into a later shard's write
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    store = CheckpointStore(tmp_path, "run", IDENTITY)
    scan = store.open()
    assert scan.shards, "the writer got some shards in before it was killed"
    for shard in scan.shards:
        assert pq.read_table(shard).num_rows == 200
    assert scan.rows == 200 * len(scan.shards) == len(scan.done_ids)
    assert not [p for p in store.shards_dir.iterdir() if p.name.startswith(".")]


def test_looking_at_a_run_folder_repairs_nothing(tmp_path):
    store = CheckpointStore(tmp_path, "run", IDENTITY)
    store.open()
    good = store.write_shard(_rows(range(3)))
    torn = store.write_shard(_rows(range(3, 6)))
    torn.write_bytes(torn.read_bytes()[:40])
    temp = store.shards_dir / ".shard-abc.parquet.1234.tmp"
    temp.write_bytes(b"half")
    looked = CheckpointStore.at(store.folder)
    assert looked.fingerprint == store.fingerprint and looked.shards_dir == store.shards_dir
    scan = looked.scan(repair=False)
    assert scan.shards == [good] and scan.done_ids == {"0", "1", "2"} and len(scan.problems) == 2
    assert temp.exists() and torn.exists(), "a look leaves the leftovers for the next run to repair"
    with pytest.raises(ValueError, match="not a run folder"):
        CheckpointStore.at(tmp_path)


def test_a_schema_gives_every_shard_the_same_column_types(tmp_path):
    store = CheckpointStore(tmp_path, "run", IDENTITY)
    store.open()
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("score", pa.float64())])
    store.write_shard([{"id": "0", "text": "a", "score": None}], schema)
    store.write_shard([{"id": "1", "text": None, "score": 0.5}], schema)
    for shard in store.scan().shards:
        assert pq.read_schema(shard).equals(schema, check_metadata=False)
    assert store.merge({"0", "1"}).schema.equals(schema, check_metadata=False)


def test_one_writer_at_a_time_and_a_dead_writer_holds_nothing(tmp_path):
    first = CheckpointStore(tmp_path, "run", IDENTITY)
    assert first.writer() is None
    first.lock()
    second = CheckpointStore(tmp_path, "run", IDENTITY)
    assert second.writer() == str(os.getpid())
    with pytest.raises(ValueError, match=f"another run \\(pid {os.getpid()}\\) is writing"):
        second.lock()
    first.unlock()
    second.lock()  # free once the first let go
    second.unlock()
    script = f"""
import os, signal
from flows.outputs.store import CheckpointStore
CheckpointStore({str(tmp_path)!r}, "run", {IDENTITY!r}).lock()
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    assert subprocess.run([sys.executable, "-c", script], env=env).returncode == -signal.SIGKILL
    assert second.writer() is None
    second.lock()  # a writer killed while holding the lock left nothing behind


def _long_rows(ids, tag="x"):
    """Rows whose texts are long and unlike each other, so a text page is mostly the texts."""
    return [
        {
            "id": str(i),
            "text": f"{tag}{i} " + "".join(uuid.uuid4().hex for _ in range(8)),
            "tokens": i,
        }
        for i in ids
    ]


def test_a_shard_with_a_corrupt_page_is_set_aside_and_redone_though_its_ids_read(tmp_path, caplog):
    store = CheckpointStore(tmp_path, "run", IDENTITY)
    store.open()
    good = store.write_shard(_long_rows(range(10)))
    broken = store.write_shard(_long_rows(range(10, 20)))
    altered = store.write_shard(_long_rows(range(20, 30)))
    corrupt_a_page_of(broken, "text")
    # a byte of one text changed: the shard still decodes, to another text
    first = pq.read_table(altered)["text"][0].as_py()
    alter_the_first_value_of(altered, "text", first)
    assert pq.read_table(broken, columns=["id"])["id"].to_pylist() == [
        str(i) for i in range(10, 20)
    ]
    with pytest.raises((OSError, pa.ArrowException)):  # as collect failed on it in every rerun
        pq.read_table(broken)
    # only a checksum tells this shard is not whole: it reads, another text than was written
    assert pq.read_table(altered)["text"][0].as_py() == "y" + first[1:]

    with caplog.at_level(logging.WARNING, logger="flows.outputs.store"):
        scan = store.open()  # a rerun
    assert scan.shards == [good] and scan.done_ids == {str(i) for i in range(10)}
    for shard in (broken, altered):
        assert not shard.exists() and shard.with_name(f"{shard.name}.unreadable").exists()
        assert f"set aside unreadable shard {shard.name}" in caplog.text
    assert "its rows will be redone" in caplog.text
    store.write_shard(_long_rows(range(10, 30), tag="redo"))
    merged = store.merge(expected_ids={str(i) for i in range(30)})
    assert sorted(merged["id"].to_pylist(), key=int) == [str(i) for i in range(30)]
    assert all(
        t.startswith("redo") for t in merged.filter(pc.field("tokens") >= 10)["text"].to_pylist()
    )


def test_shards_named_without_a_checksum_are_checked_by_reading_them_whole(tmp_path):
    """Shards written before checksums were: a rerun still resumes from them."""
    store = CheckpointStore(tmp_path, "run", IDENTITY)
    store.open()
    old, broken = (store.shards_dir / f"shard-{uuid.uuid4().hex}.parquet" for _ in range(2))
    write_parquet(old, pa.Table.from_pylist(_long_rows(range(5))))
    write_parquet(broken, pa.Table.from_pylist(_long_rows(range(5, 10))))
    corrupt_a_page_of(broken, "text")
    scan = store.open()
    assert scan.shards == [old] and scan.done_ids == {str(i) for i in range(5)}
    assert len(scan.problems) == 1 and broken.name in scan.problems[0]


def test_a_stop_request_reaches_the_runs_copies_and_never_a_later_run(tmp_path):
    run = CheckpointStore(tmp_path, "run", {"a": 1})
    run.lock()
    worker = pickle.loads(pickle.dumps(run))  # what a Dask worker holds
    assert not worker.stop_requested()
    run.request_stop()  # the run's Ctrl-C
    assert worker.stop_requested()
    run.unlock()
    later = CheckpointStore(tmp_path, "run", {"a": 1})
    later.lock()  # a rerun: a new writer token
    assert not pickle.loads(pickle.dumps(later)).stop_requested()
    later.unlock()
