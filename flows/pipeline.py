"""The six steps of every gristmill flow, as Prefect tasks, and the plain batch-generation flow.

    configure ─► init_engine ─► prepare_prompts ─► generate ─► collect ─► shutdown

One engine per flow run stays resident from init_engine to shutdown, and shutdown runs whether
or not a step failed. The steps hand on what they decided as a RunPlan and a Work
(flows/run/plan.py). Rows land in the checkpoint store (flows/outputs/store.py) as they finish,
so a rerun of the same config after a crash, a failure or a cancel does only the rows still
missing.
With `parallel.workers` > 1 (or a Dask `parallel.address`) no engine runs in the flow's process:
generate hands the rows to engines on Dask workers (flows/parallel/generate.py), which write the
same shards, and collect merges and checks them as it does its own.
The ready flows (annotate, synthesize, evaluate) are this same flow with their own config
class and a `finish` step that adds their columns (labels, scores) to the merged rows.

Tasks take unhashable things (an Engine, Arrow tables), so none caches (NO_CACHE); none
retries on its own either: the retry of a batch run is a rerun, which resumes. (Dask alone runs
a part again, when the worker running it died: flows/parallel/generate.py.)
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from engine import EngineAPI
from flows.config import EngineConfig, RunConfig
from flows.engines.generation import Generated, RequestOptions, generate_rows
from flows.engines.progress import Progress, artifact_key
from flows.engines.resident import give_back_gpus, open_engine
from flows.inputs.image_column import image_placeholder
from flows.inputs.prompts import ChatTemplate, PromptRenderer
from flows.inputs.sources import input_for_run
from flows.outputs.merge import ordered_chunks
from flows.outputs.store import CheckpointStore, write_parquet_chunks
from flows.parallel.generate import generate_in_parallel
from flows.run.interrupts import run_stoppable, sigterm_stops_the_flow
from flows.run.lock import lock_run, unlock_run
from flows.run.plan import Finish, Finisher, RunPlan, Work, gpu_costs, plan_requests


# ---------------------------------------------------------------------- the flow
@flow(name="generate-batch", flow_run_name="{config.run_name}")
def generate_batch(config: RunConfig, fresh: bool = False) -> dict[str, Any]:
    """Generate a completion for every row of an input file: resumable, each row written once."""
    return run_steps(config, fresh)


def run_steps(
    config: RunConfig, fresh: bool = False, finish: Finish | None = None
) -> dict[str, Any]:
    """The six steps in order; the body of every gristmill flow. On Dask workers the engines
    start and stop inside generate, one per worker, instead of in init_engine and shutdown.

    A Ctrl-C or a SIGTERM (Prefect cancelling the run, a `kill`) stops it: generate writes the
    rows it finished, shutdown stops or detaches the engine (flows/run/interrupts.py)."""
    plan, engine = None, None
    with sigterm_stops_the_flow():
        try:
            plan = configure(config)
            if config.parallel.on_dask:
                work = prepare_prompts(plan, None, fresh)
                generated = generate_in_parallel(plan, work)
            else:
                engine = init_engine(plan)
                work = prepare_prompts(plan, engine, fresh)
                generated = generate(plan, engine, work)
            return collect(plan, work, generated, finish)
        finally:
            shutdown(engine)
            if plan is not None:
                unlock_run(plan)


# ---------------------------------------------------------------------- the steps
@task(cache_policy=NO_CACHE)
def configure(config: RunConfig) -> RunPlan:
    """Check the config against the world, fix the run's folder by its fingerprint and lock it
    (held until the flow ends): a second run of this config stops here, before any engine."""
    plan = lock_run(config)
    store = plan.store
    get_run_logger().info(
        "run %s, fingerprint %s, in %s", config.run_name, store.fingerprint, store.folder
    )
    return plan


@task(cache_policy=NO_CACHE)
def init_engine(plan: RunPlan, section: EngineConfig | None = None) -> EngineAPI:
    """The engine of the whole run: a resident engine that serves this config's engine section
    (or `section`, where the checks settled another), attached to in a moment, or else one of
    the run's own."""
    started = time.perf_counter()
    engine, how = open_engine(section or plan.config.engine, get_run_logger())
    info = engine.get_server_info()
    get_run_logger().info(
        "engine %s: ready in %.1fs on %s (scheduler and detokenizer pids %s)",
        how,
        time.perf_counter() - started,
        info["device"],
        sorted(info["pids"].values()),
    )
    return engine


@task(cache_policy=NO_CACHE)
def prepare_prompts(plan: RunPlan, engine: EngineAPI, fresh: bool = False) -> Work:
    """Plan the run from the input's summary (its ids; the rows stream again as `Work.tables`
    reaches them), skip rows already in shards, render the prompts of the rest as the engine
    takes them (chat ones with the engine's chat template: _chat_template)."""
    logger = get_run_logger()
    config, store = plan.config, plan.store
    if fresh and store.folder.exists():
        logger.warning("--fresh: deleting the earlier results in %s", store.folder)
        shutil.rmtree(store.folder)
    # crash leftovers and a changed config, in the run log
    with _relay_to(logger, "flows.outputs.store"):
        scan = store.open()
    rows = input_for_run(config.source)
    renderer = PromptRenderer(
        config.prompt, config.template_variables(), _chat_template(config, engine),
        _image_placeholder(config),
    )  # fmt: skip
    work = plan_requests(config, rows, rows.row_ids(), scan.done(), renderer)
    store.write_json(
        "run.json", {"config": config.model_dump(mode="json"), "total_rows": work.total}
    )
    logger.info(
        "%d rows: %d done by earlier runs, %d to generate (prompts rendered as the engine "
        "takes them)",
        work.total,
        work.done_before,
        work.todo_count,
    )
    return work


@task(cache_policy=NO_CACHE)
def generate(plan: RunPlan, engine: EngineAPI, work: Work) -> Generated:
    """Stream the remaining rows through the engine, writing a shard per shard_size rows."""
    logger = get_run_logger()
    config, store = plan.config, plan.store
    if work.todo_count == 0:
        Progress.nothing_left(work.total, config.run_name, logger)
        return Generated()
    options = RequestOptions.of(config)
    progress = Progress(work.total, work.done_before, config.run_name, logger)

    async def run() -> Generated:
        await progress.open()
        try:
            return await generate_rows(
                engine,
                work.rows(),
                options,
                max_in_flight=config.max_in_flight,
                shard_size=config.shard_size,
                write_shard=lambda rows: store.write_shard(rows, work.schema),
                progress=progress,
            )
        finally:
            await progress.close()

    # a stop signal (Ctrl-C, a cancel's SIGTERM) cancels the rows: no new ones start, the
    # finished ones are written, the engine drops the rest (redone on resume, with their seeds)
    generated = run_stoppable(run(), say=logger)
    if generated.errors:
        logger.warning(
            "%d row(s) were refused by the engine: see their error column", generated.errors
        )
    return generated


@task(cache_policy=NO_CACHE)
def collect(
    plan: RunPlan, work: Work, generated: Generated, finish: Finish | None
) -> dict[str, Any]:
    """Merge the shards into one Parquet file in input order, streamed a chunk at a time
    (flows/outputs/merge.py), check every row is there exactly once, and publish the run's
    summary."""
    logger = get_run_logger()
    config, store = plan.config, plan.store
    finisher = finish(config) if finish is not None else Finisher()
    totals = _Totals()
    chunks = (totals.add(finisher.rows(chunk)) for chunk in ordered_chunks(store, work.ids))
    write_parquet_chunks(store.output_path, chunks)
    summary = _summary(config, store, totals, generated) | finisher.summary()
    store.write_json("summary.json", summary)
    logger.info(
        "summary: %s", ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items() if k != "output")
    )
    logger.info("output: %s", store.output_path)
    create_table_artifact(
        key=artifact_key(config.run_name, "summary"),
        table=[{"metric": k, "value": _fmt(v)} for k, v in summary.items()],
        description=f"gristmill run {config.run_name} ({store.fingerprint})",
    )
    return summary


@task(cache_policy=NO_CACHE)
def shutdown(engine: EngineAPI) -> None:
    """Stop the run's own engine, or detach from a resident one, which stays up; runs also
    when an earlier step failed."""
    from engine import ResidentEngine

    if engine is None:
        get_run_logger().info("no engine to stop")
        return
    engine.shutdown()
    give_back_gpus(engine)
    if isinstance(engine, ResidentEngine):
        get_run_logger().info("detached from resident engine %s: it stays up", engine.record.id)
    else:
        get_run_logger().info("engine stopped")


# ---------------------------------------------------------------------- helpers
def _image_placeholder(config: RunConfig) -> str | None:
    """The model's image slot, for rows with an image (prompt.image_column)."""
    if config.prompt.image_column is None:
        return None
    from engine import ServerArgs

    args = ServerArgs.from_kwargs(**config.engine.arguments())
    return image_placeholder(args.model_path, args.tokenizer_path)


def _chat_template(config: RunConfig, engine: EngineAPI) -> ChatTemplate | None:
    """The engine's chat template, for chat prompts: a resident engine renders them with its
    own tokenizer (this process then loads none: transformers alone takes a second to import);
    an engine of the run's own lends its tokenizer; without an engine (Dask: the engines are on
    the workers) the same tokenizer is loaded here, as the engine loads it."""
    from engine import ResidentEngine, ServerArgs, load_tokenizer

    if not config.prompt.uses_chat_template:
        return None
    if isinstance(engine, ResidentEngine):
        return engine.apply_chat_template
    if engine is not None:
        return engine.tokenizer.apply_chat_template

    return load_tokenizer(ServerArgs.from_kwargs(**config.engine.arguments())).apply_chat_template


class _Totals:
    """The merged rows' counts, summed as the chunks pass."""

    COLUMNS = ("prompt_tokens", "completion_tokens", "cached_tokens")

    def __init__(self) -> None:
        self.rows = self.errors = 0
        self.sums = dict.fromkeys(self.COLUMNS, 0)

    def add(self, chunk: pa.Table) -> pa.Table:
        self.rows += chunk.num_rows
        self.errors += int(pc.sum(pc.is_valid(chunk.column("error"))).as_py() or 0)
        for column in self.COLUMNS:
            self.sums[column] += int(pc.sum(chunk.column(column)).as_py() or 0)
        return chunk


def _summary(
    config: RunConfig, store: CheckpointStore, totals: _Totals, generated: Generated
) -> dict[str, Any]:
    return {
        "run_name": config.run_name,
        "fingerprint": store.fingerprint,
        "rows": totals.rows,
        "rows_generated_now": generated.rows,
        "rows_from_earlier_runs": totals.rows - generated.rows,
        "error_rows": totals.errors,
        **totals.sums,
        "generate_seconds": round(generated.seconds, 3),
        "rows_per_second": round(generated.rows / generated.seconds, 2)
        if generated.seconds
        else 0.0,
        "tokens_per_second": round(generated.tokens_per_second, 1),
        **gpu_costs(config, generated.seconds, totals.sums["completion_tokens"]),
        # (counted by name: the merge has just checked every shard whole)
        "shards": sum(1 for _ in store.shards_dir.glob("shard-*.parquet")),
        "output": str(store.output_path),
    }


def _fmt(value: Any) -> str:
    return f"{value:,.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


@contextmanager
def _relay_to(target: logging.Logger | logging.LoggerAdapter, name: str) -> Iterator[None]:
    """Send a library logger's records to the run logger (and so to the Prefect UI) for a while."""

    class Relay(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            target.log(record.levelno, record.getMessage())

    source = logging.getLogger(name)
    handler, propagate = Relay(), source.propagate
    source.addHandler(handler)
    source.propagate = False  # printed once, by the run logger
    try:
        yield
    finally:
        source.removeHandler(handler)
        source.propagate = propagate
