"""A Dask worker preload of tests/flows/test_dask_cluster.py (`dask worker --preload
tests.flows.slow_worker`): every row this worker's engine generates waits SLOW_S first, so the
other worker's engine gets through its batches several times faster."""

from __future__ import annotations

import asyncio
from typing import Any

SLOW_S = 2.0


def dask_setup(worker: Any) -> None:
    import flows.engines.generation

    answer = flows.engines.generation.request  # generate_rows looks it up at each row

    async def slow_request(engine: Any, row: dict[str, Any], options: Any) -> dict[str, Any]:
        await asyncio.sleep(SLOW_S)
        return await answer(engine, row, options)

    flows.engines.generation.request = slow_request
