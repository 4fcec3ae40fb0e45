"""A Prefect database with its schema made, once per test run, for every Prefect server of it.

A server on a new SQLite database first runs Prefect's migrations and registers its block types:
~15 s of one core, ~30 s of a server's start on the 2-core CI machine, against ~8 s on a
database that has them. pytest's first process (the xdist controller, or the only process) makes
the schema in a subprocess of its own as the run starts (`start`), while the workers run other
tests; each session server (tests/flows/conftest.py) starts on a copy (`copy_to`), and the
temporary servers of test_interrupts.py on a copy of their session server's database.

NOTE: a copy is what a server would have made itself: the schema and block types of this
Prefect, no flow, no run. Where the schema could not be made, a server makes its own, as before.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

_NAME = "prefect-schema.db"
_WAIT_S = 180.0  # making it takes ~15 s of one core; the workers share the machine meanwhile

# run in the subprocess: what a new server's start does to its database (prefect/server/api/
# server.py: run_migrations, add_block_types)
_MAKE = """
import asyncio, os, sys
from prefect.server.database import provide_database_interface
from prefect.server.models.block_registration import run_block_auto_registration

async def make():
    db = provide_database_interface()
    await db.create_db()
    async with await db.session() as session:
        await run_block_auto_registration(session=session)
        await session.commit()

asyncio.run(make())
os.replace(sys.argv[1] + ".part", sys.argv[1])  # whole, or not there
"""


def folder(config: pytest.Config) -> Path:
    """The run's folder for the schema, the same in every process of the run."""
    root = Path(config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def start(config: pytest.Config) -> None:
    """In pytest's first process: start making the schema (a subprocess; nothing waits here)."""
    where = folder(config)
    target = where / _NAME
    env = {
        **os.environ,
        "PREFECT_HOME": str(where / "prefect-schema-home"),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{target}.part",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    log = open(where / "prefect-schema.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAKE, str(target)], env=env, stdout=log, stderr=log,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    config._prefect_schema = (proc, log)  # type: ignore[attr-defined]


def stop(config: pytest.Config) -> None:
    """At the end of the run: never leave the subprocess behind."""
    started = getattr(config, "_prefect_schema", None)
    if started:
        proc, log = started
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def copy_to(config: pytest.Config, database: Path) -> bool:
    """Write a copy of the run's schema at `database` (waiting for it to be made); False where
    it was not made, and the server makes its own."""
    target, log = folder(config) / _NAME, folder(config) / "prefect-schema.log"
    deadline = time.monotonic() + _WAIT_S
    while not target.exists():
        if time.monotonic() > deadline or not log.exists() or "Traceback" in log.read_text():
            return False
        time.sleep(0.2)
    with (
        contextlib.closing(sqlite3.connect(target)) as source,
        contextlib.closing(sqlite3.connect(database)) as copy,
    ):
        source.backup(copy)
    return True
