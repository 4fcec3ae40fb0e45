"""Fixtures of the flow tests. The tiny model folders (llama_dir, ...) come from tests/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """The URL of a temporary Prefect server (SQLite) that every flow in the session reports to.

    It takes ~15 s to start: one per session (per xdist worker), on a free port of its own."""
    # the server's telemetry write races its own start-up on SQLite ("database is locked")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()
