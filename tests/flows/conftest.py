"""Fixtures of the flow tests. The tiny model folders (llama_dir, ...) come from tests/conftest.py.

What is slow to make is made once per session (under xdist, once per worker): the Prefect server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """The URL of a temporary Prefect server (SQLite) that every flow in the session reports to.

    It takes ~15 s to start: one per session, on a free port of its own."""
    # the server's telemetry write races its own start-up on SQLite ("database is locked")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    # NOTE: a flow run's heartbeat thread sleeps in 1 s steps and is joined when the run ends,
    # which adds up to a second to every flow run in this process. Heartbeats only let a server
    # mark a crashed run; no test reads them (subprocesses keep them: None has no env spelling).
    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
    ):
        yield PREFECT_API_URL.value()
