"""Generation on Dask workers: engines on many hosts (or a local cluster of several), each
resident in one Dask worker, taking batches of the run's rows as they free up, all writing
shards into the run's one checkpoint store.

    prepare_prompts ─► the hand-out: the rows still to do, rendered as they stream to a file
    (flow process)       in batches (handout.py)
                       ─► generate-on-workers (a nested flow on a DaskTaskRunner) ─► collect
                         ├─ generate-part-0: its engine takes batch 0, then 2, 3, 5, ... ─┐
                         ├─ generate-part-1: its engine takes batch 1, then 4, ...       ─┼─► shards/
                         └─ ...                                                           ─┘

The task runner is built at run time from the config (a local cluster of `workers` processes,
or the scheduler at `parallel.address`), so the flows, deployments and the CLI are the same
for one engine or many. Meanwhile the flow process watches the shards land and shows one
progress for the whole run. Every path in the plan the parts get is absolute (made so in this
process, flows/run/paths.py): a worker runs in a folder of its own, maybe on another host.

Why a few long-lived parts that pull batches (parts.py), not a Dask task per batch: an
engine takes seconds to minutes to start, so it must outlive a batch; a part holds its engine
for the whole run and stops it in its own `finally`, on a local or a remote cluster alike,
where an engine cached in a worker between tasks would need a release on every worker (and
would stay up, holding its GPUs, if the flow process died). A part takes its next batch while
the last rows of the current one still generate, so its engine never drains between batches;
a task per batch would drain it at every batch's end. And Prefect records one task run per
engine, not thousands.

Exactly once: the flow process alone holds the store's lock; a batch is generated only by the
part that claimed it (handout.py), and shards are atomic and uuid-named. When a worker
dies, Dask runs its part again (`distributed.scheduler.allowed-failures` times, then gives up
with KilledWorker); the new attempt first finishes the batches its lost attempt claimed,
skipping the ids already in shards, while the other parts go on taking batches. The engine of
a killed worker dies with it (its lifeline), and a local cluster's workers die with the flow
process. Every part is waited for, failed or not, before the flow moves on, so no part writes
after the lock is let go; a part stranded on a remote cluster by a dead flow process is
stopped by the store's writer check once a rerun writes.

NOTE: Dask starts a local cluster's workers with multiprocessing's spawn, which imports the
calling script again: a script that calls a flow with several local workers must do so under
`if __name__ == "__main__":` (the `gristmill` command and deployments need nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import flow, get_run_logger

from flows.config import RunConfig
from flows.engines.generation import Generated
from flows.engines.progress import Progress
from flows.outputs.store import CheckpointStore
from flows.parallel.handout import Handout
from flows.parallel.parts import STOP_POLL_SECONDS, generate_part
from flows.run.interrupts import run_stoppable, sigterm_stops_the_flow
from flows.run.plan import RunPlan, Work

if TYPE_CHECKING:
    from prefect_dask import DaskTaskRunner

POLL_SECONDS = 1.0  # how often the flow process looks for new shards while the parts run
STOP_GRACE_SECONDS = 5.0  # how long a stopping run waits for its parts to write and end


def generate_in_parallel(plan: RunPlan, work: Work) -> Generated:
    """The generate step on Dask workers: a nested flow on a task runner made for this run."""
    if work.todo_count == 0:
        Progress.nothing_left(work.total, plan.config.run_name, get_run_logger())
        return Generated()
    # the work streams into the hand-out here (a prompt is rendered, written and let go):
    # the parts, and Prefect's context that Dask sends them, get the file, never the rows
    handout = Handout.write(plan.store, work.tables(), plan.config.batch_rows)
    runner = task_runner(plan.config)
    with _api_for_workers():
        return generate_on_workers.with_options(task_runner=runner)(
            plan, handout, work.schema, work.total, work.done_before
        )


def task_runner(config: RunConfig) -> DaskTaskRunner:
    """A runner on the scheduler at `parallel.address`, or on a local cluster made for the run."""
    from prefect_dask import DaskTaskRunner

    parallel = config.parallel
    if parallel.address is not None:
        return DaskTaskRunner(address=parallel.address)
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": parallel.workers,
            "threads_per_worker": 1,  # one part, so one engine, per worker at a time
            "processes": True,
            # the engine is the worker's whole job and keeps its memory in its own processes:
            # Dask's share of RAM per worker (meant for Dask's data) must not restart it
            "memory_limit": 0,
            # a terminal's Ctrl-C is the run's to handle, not the workers' (dask_worker.py)
            "preload": ["flows.parallel.dask_worker"],
        }
    )


@flow(name="generate-on-workers", validate_parameters=False)
def generate_on_workers(
    plan: RunPlan, handout: Handout, schema: pa.Schema, total: int, done_before: int
) -> Generated:
    """Generate the hand-out's rows on `parallel.workers` engines, which take them in batches
    (`total` requests in the run, `done_before` of them in shards before it began).

    Returns what the run's new shards hold, whichever attempt of a part wrote them (a part's
    own count misses the rows of an attempt Dask lost), over the whole step's wall time,
    engines' start-up included.
    """
    logger = get_run_logger()
    config, store = plan.config, plan.store
    parts = min(config.parallel.workers, handout.batches)
    local = config.parallel.address is None
    logger.info(
        "%d rows in %d batches of up to %d, taken by %d engines as they free up, on %s",
        handout.rows,
        handout.batches,
        config.batch_rows,
        parts,
        f"a local Dask cluster of {config.parallel.workers} workers"
        if local
        else f"the Dask cluster at {config.parallel.address}",
    )
    shards = NewShards(store)
    started = time.perf_counter()
    progress = Progress(total, done_before, config.run_name, logger)
    # a stop signal asks the parts to stop: each writes the rows it finished (_watch)
    stopping = asyncio.Event()
    with sigterm_stops_the_flow():  # (Prefect's handler is back in for a nested flow)
        futures = [
            generate_part.submit(plan, handout, index, schema, local) for index in range(parts)
        ]
        try:
            run_stoppable(_watch(futures, shards, progress, store, stopping), stop=stopping.set)
        finally:
            if all(f.wrapped_future.done() for f in futures):
                handout.remove()  # (else a part still reads it: the next run removes it)
    failures = []
    for index, future in enumerate(futures):
        try:
            report = future.result()
        except Exception as e:  # every part is asked, failed or not
            logger.error("part %d failed: %s: %s", index, type(e).__name__, e)
            failures.append((index, e))
            continue
        logger.info(
            "part %d: %d batches taken (%d of a lost attempt finished), %d rows, on %s (pid %d)",
            index, report.batches, report.redone, report.rows, report.host, report.pid,
        )  # fmt: skip
    generated = shards.generated(seconds=time.perf_counter() - started)
    if failures:
        index, first = failures[0]
        raise RuntimeError(
            f"{len(failures)} of {parts} parts failed (part {index}: "
            f"{type(first).__name__}: {first}); the rows they finished are in shards: "
            "rerun to do the rest"
        ) from first
    return generated


# ---------------------------------------------------------------------- helpers
class NewShards:
    """The rows of shards that appeared since the run began, whichever worker wrote them."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.seen = set(self._names())
        self.stats = Generated()
        self.first_error: str | None = None  # of the run's first refused row, once seen

    def _names(self) -> Iterator[str]:
        for path in self.store.shards_dir.glob("shard-*.parquet"):  # dot-named: not yet whole
            yield path.name

    def poll(self) -> tuple[int, int, int]:
        """(rows, completion tokens, refused rows) of the shards that landed since the last poll."""
        rows = tokens = refused = 0
        for name in sorted(set(self._names()) - self.seen):
            table = pq.read_table(
                self.store.shards_dir / name,
                columns=["prompt_tokens", "completion_tokens", "error"],
            )
            self.seen.add(name)
            completion = int(pc.sum(table.column("completion_tokens")).as_py() or 0)
            rows, tokens = rows + table.num_rows, tokens + completion
            self.stats.rows += table.num_rows
            self.stats.shards += 1
            errors = int(pc.sum(pc.is_valid(table.column("error"))).as_py() or 0)
            refused += errors
            if errors and self.first_error is None:
                self.first_error = table.column("error").drop_null()[0].as_py()
            self.stats.errors += errors
            self.stats.prompt_tokens += int(pc.sum(table.column("prompt_tokens")).as_py() or 0)
            self.stats.completion_tokens += completion
        return rows, tokens, refused

    def generated(self, seconds: float) -> Generated:
        self.poll()
        return Generated(**{**vars(self.stats), "seconds": seconds})


async def _watch(
    futures: list[Any],
    shards: NewShards,
    progress: Progress,
    store: CheckpointStore,
    stopping: asyncio.Event,
) -> None:
    """Feed the run's progress from the shards that land, until every part has ended.

    A stop signal sets `stopping` (run_stoppable): this asks the parts to stop
    (CheckpointStore.request_stop) and waits for them a while longer: each writes the rows it
    has finished and ends within STOP_POLL_SECONDS."""
    loop = asyncio.get_running_loop()
    stop_by: float | None = None
    await progress.open()
    try:
        while True:
            ended = all(f.wrapped_future.done() for f in futures)
            rows, tokens, refused = shards.poll()
            if rows:
                await progress.advance(rows, tokens, refused, shards.first_error)
            if ended or (stop_by is not None and loop.time() > stop_by):
                return
            if stopping.is_set() and stop_by is None:
                store.request_stop()
                stop_by = loop.time() + STOP_GRACE_SECONDS
            if stopping.is_set():
                await asyncio.sleep(STOP_POLL_SECONDS)
            else:
                with contextlib.suppress(asyncio.TimeoutError):  # a stop signal ends the wait
                    await asyncio.wait_for(stopping.wait(), POLL_SECONDS)
    finally:
        await progress.close()


def _api_for_workers() -> AbstractContextManager[Any]:
    """Point the workers at the flow's Prefect API.

    A task on a Dask worker reports to the API in the settings the flow sends with it. With no
    PREFECT_API_URL the flow runs on a temporary local server, which those settings do not
    name: each worker would start its own (and a killed worker would leave it running).
    """
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        return nullcontext()
    with get_client(sync_client=True) as client:
        url = str(client.api_url).rstrip("/")
    return temporary_settings({PREFECT_API_URL: url})
