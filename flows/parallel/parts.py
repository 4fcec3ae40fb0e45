"""One part of a Dask run: an engine in a Dask worker that takes batches of the run's rows
(handout.py) until none is left, writing shards into the run's folder.

    start: the batches a lost attempt of this part took (rows in shards skipped)
    engine ─► take a batch ─► its rows into the engine ─► take the next ─► ... ─► none left
                                                                                 └► shutdown

The engine starts once and stays up across the batches: rows are pulled from the batches as
the engine has room for them (generate_rows keeps max_in_flight requests in flight), so the
next batch is taken while the last rows of this one are still generating, and the engine
never drains between batches. A part that finds no batch left starts no engine.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.engines.generation import Generated, RequestOptions, generate_rows
from flows.engines.progress import Progress
from flows.engines.slots import GpuSlots, slot_names
from flows.outputs.store import CheckpointStore
from flows.parallel.handout import Handout
from flows.run.gpus import engine_arguments
from flows.run.plan import RunPlan

STOP_POLL_SECONDS = 0.2  # how often a part looks for the run's request to stop


@dataclass
class PartReport:
    """What one part did (its last attempt): for the run's log."""

    index: int
    host: str
    pid: int
    batches: int = 0  # batches taken from the pool
    redone: int = 0  # batches of a lost attempt finished
    rows: int = 0


@task(cache_policy=NO_CACHE, task_run_name="generate-part-{index}")
def generate_part(
    plan: RunPlan, handout: Handout, index: int, schema: pa.Schema, local: bool
) -> PartReport:
    """Batches of the run's rows through an engine started for them in this Dask worker."""
    from engine import Engine

    logger = get_run_logger()
    config, store = plan.config, plan.store
    report = PartReport(index, socket.gethostname(), os.getpid())
    earlier = handout.claimed_by(index)
    if not earlier and (handout.left() == 0 or store.stop_requested()):
        logger.info("part %d: no batch left, or the run is stopping: no engine started", index)
        return report
    arguments = engine_arguments(config, index, local)
    slots = GpuSlots(slot_names(arguments))  # (flows/engines/slots.py: this machine's GPUs)
    slots.take(logger)
    try:
        engine = Engine(**arguments)
    except BaseException:
        slots.give_back()
        raise
    try:
        logger.info(
            "part %d: on %s of %s (pid %d), engine ready in %.1fs",
            index,
            engine.get_server_info()["device"],
            report.host,
            report.pid,
            engine.startup_seconds,
        )
        rows = _part_rows(handout, store, index, earlier, report, logger)
        progress = Progress(handout.rows, 0, config.run_name, logger, bar=False)
        asyncio.run(
            _until_stopped(
                generate_rows(
                    engine,
                    rows,
                    RequestOptions.of(config),
                    max_in_flight=config.max_in_flight,
                    shard_size=config.shard_size,
                    write_shard=lambda rows: store.write_shard(rows, schema, store.check_writer),
                    progress=progress,
                ),
                store,
            )
        )
        # NOTE: said before the engine's shutdown, which can take seconds on a loaded machine:
        # a stopping run waits STOP_GRACE_SECONDS for its parts, and the rows are written by now
        report.rows = progress.rows
        if store.stop_requested():
            logger.info("part %d: stopped by the run's Ctrl-C, its finished rows written", index)
        else:
            logger.info("part %d: generated %s", index, progress.line())
    finally:
        engine.shutdown()
        slots.give_back()
    return report


def _part_rows(
    handout: Handout,
    store: CheckpointStore,
    index: int,
    earlier: list[int],
    report: PartReport,
    logger: Any,
) -> Iterator[dict[str, Any]]:
    """The rows this part generates, batch by batch, each batch taken when the engine has room
    for its first row: first what a lost attempt of this part took and did not write, then
    batches from the pool, until none is left or the run asks its parts to stop."""
    if earlier:
        # NOTE: repair=False: the dot-named files there are other parts' shards being written
        done = store.scan(repair=False).done()
        for batch in earlier:
            rows = handout.read(batch)
            todo = rows.filter(pc.invert(pc.is_in(rows.column("id"), done)))
            logger.info(
                "part %d: batch %d, taken by an earlier attempt: %d of its %d rows are in shards "
                "already (written by an earlier attempt)",
                index, batch, rows.num_rows - todo.num_rows, rows.num_rows,
            )  # fmt: skip
            report.redone += 1
            yield from todo.to_pylist()
    while not store.stop_requested():
        batch = handout.claim(index)
        if batch is None:
            return
        report.batches += 1
        yield from handout.read(batch).to_pylist()


async def _until_stopped(rows: Coroutine[Any, Any, Generated], store: CheckpointStore) -> Generated:
    """A part's rows, until done or until the run asks its parts to stop (a Ctrl-C): then the
    rows in flight are dropped (redone on resume), the finished ones written (generate_rows)."""
    task = asyncio.ensure_future(rows)
    while not task.done():
        await asyncio.wait({task}, timeout=STOP_POLL_SECONDS)
        if not task.done() and store.stop_requested():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        # NOTE: an ending, not a failure: the run reports the stop (its rows count from shards)
        return Generated()
