"""OpenAI batch files: the requests of an OpenAI Batch API input file, answered by the engine,
written as the Batch API's output file. The flow of `gristmill batch` and of `flow: openai_batch`.

    gristmill batch -i requests.jsonl -o results.jsonl --model /models/Qwen3-0.6B

    flow: openai_batch                     # the same as a config, for `gristmill run`
    run_name: reviews-batch
    engine: {model_path: /models/Qwen3-0.6B}
    input: requests.jsonl
    output: results.jsonl

Lines for /v1/chat/completions, /v1/completions and /v1/embeddings (flows/openai_files/requests.py)
get OpenAI's response bodies (flows/openai_files/responses.py). It runs the steps of every gristmill
flow, and so is resumable as they are: each answer lands in a checkpoint shard under
`<output_dir>/<run_name>/<fingerprint>/` keyed by its custom_id, a rerun answers only the
lines no shard has, and the output file is written once every line is answered, in input
order, each custom_id exactly once: the answered lines in the output file, the failed ones
(an error entry each, naming why) in the error file beside it, as OpenAI's Batch API splits
them. A file with a line that is not a JSON object with a custom_id is refused, naming its
lines, before any engine starts (OpenAI validates the file first too). A line without a seed samples with one derived from the run's `seed`
and its custom_id, so a rerun of a sampled line gives the same answer.

An engine either generates or embeds: with embedding lines only, the engine is started as an
embedding engine (is_embedding) unless the config says otherwise; lines the engine cannot
serve get error entries naming why.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field, model_validator

from engine import EngineAPI
from flows.config import ConfigError, EngineConfig, RunBase
from flows.engines.generation import Generated, answer_rows
from flows.engines.progress import Progress, artifact_key
from flows.openai_files.answers import Job, answer, prepare_jobs
from flows.openai_files.requests import BatchRequest, read_batch
from flows.outputs.store import row_seed, write_file, write_parquet
from flows.pipeline import configure, init_engine, shutdown
from flows.run.identity import PERFORMANCE_ARGS, model_identity
from flows.run.interrupts import run_stoppable, sigterm_stops_the_flow
from flows.run.lock import unlock_run
from flows.run.paths import absolute_paths
from flows.run.plan import RunPlan, gpu_costs
from flows.run.preflight import check_engine

# An output row of the checkpoint store: one per input line (NOTE: the on-disk format)
SCHEMA = pa.schema([
    ("id", pa.string()),  # BatchRequest.key
    ("line", pa.int64()),
    ("custom_id", pa.string()),
    ("status_code", pa.int64()),  # 200, or null for an error entry
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("cached_tokens", pa.int64()),
    ("error", pa.string()),
    ("output", pa.string()),  # the output line, as JSON
])  # fmt: skip


class OpenAIBatchConfig(RunBase):
    """An OpenAI batch input file answered into an output file, resumably."""

    flow: Literal["openai_batch"] = Field("openai_batch", description="which flow runs the config")
    input: Path = Field(description="an OpenAI Batch API input file (JSONL request lines)")
    output: Path = Field(
        description="the output file (JSONL): the lines answered, in input order, written once "
        "every line is"
    )
    errors: Path | None = Field(
        None,
        description="the error file (JSONL): the lines that failed, with why (OpenAI's error "
        "file); default beside the output, <output>_errors.jsonl",
    )
    seed: int = Field(0, description="with each custom_id, the seed of lines that give none")
    shard_size: int = Field(1000, ge=1, description="answers per checkpoint shard")
    max_in_flight: int = Field(256, ge=1, description="requests in the engine at once")

    @model_validator(mode="after")
    def _output_is_not_the_input(self) -> OpenAIBatchConfig:
        if self.output.resolve() == self.input.resolve():
            raise ValueError("output must differ from input (the input is read on every rerun)")
        if self.errors_path.resolve() in (self.input.resolve(), self.output.resolve()):
            raise ValueError("errors must differ from input and output")
        return self

    @property
    def errors_path(self) -> Path:
        """Where the lines that failed go: `errors`, or beside the output."""
        if self.errors is not None:
            return self.errors
        return self.output.with_name(f"{self.output.stem}_errors{self.output.suffix or '.jsonl'}")


def batch_config(
    input: Path,
    output: Path,
    model: str,
    run_name: str | None,
    overrides: list[str],
    errors: Path | None = None,
) -> OpenAIBatchConfig:
    """`gristmill batch`'s config: its run is named after the input file unless named."""
    from flows.config import load_config

    name = run_name or re.sub(r"[^A-Za-z0-9._-]+", "-", input.stem).strip("-._") or "batch"
    data = {"flow": "openai_batch", "run_name": name, "engine": {"model_path": model},
            "input": str(input), "output": str(output)}  # fmt: skip
    if errors is not None:
        data["errors"] = str(errors)
    return load_config(data, overrides, kind=OpenAIBatchConfig)


# ---------------------------------------------------------------------- checks
@dataclass
class BatchChecked:
    """What the checks learned: the requests (read once, from the bytes the identity hashes)
    and the engine section the run uses."""

    requests: list[BatchRequest]
    engine: EngineConfig
    tokenizer_path: str
    kinds: set[str] = field(default_factory=set)  # of the lines that parsed


def check_batch(config: OpenAIBatchConfig) -> tuple[BatchChecked, dict[str, Any]]:
    """The input read and the engine section checked, before the run folder is locked:
    (what was learned, the run's identity). ConfigError names every problem."""
    problems: list[tuple[str, str]] = []
    try:
        data = config.input.read_bytes()
    except OSError as e:
        raise ConfigError([("input", f"cannot read {config.input}: {e.strerror or e}")]) from None
    requests = read_batch(data)
    if not requests:
        problems.append(("input", f"{config.input} has no request lines"))
    # NOTE: as OpenAI validates a batch file before it runs any of it: a line that is not a
    # JSON object with a custom_id cannot be answered or even named in an output line
    unnamed = [r for r in requests if r.custom_id is None]
    if unnamed:
        problems.append(("input", f"{config.input}: " + "; ".join(
            f"line {r.line}: {r.error}" for r in unnamed[:20]
        ) + (f"; and {len(unnamed) - 20} more lines" if len(unnamed) > 20 else "")))  # fmt: skip
    kinds = {r.kind for r in requests if r.error is None and r.kind is not None}
    engine = config.engine
    if "is_embedding" not in engine.arguments() and _embeds(engine, kinds):
        engine = engine.model_copy(update={"is_embedding": True})
    tokenizer_path = check_engine(engine, problems)
    generates = not engine.arguments().get("is_embedding")
    if generates and "chat" in kinds and tokenizer_path:
        from flows.inputs.prompts import has_chat_template

        if not has_chat_template(tokenizer_path):
            problems.append(("input", f"it has /v1/chat/completions lines and the tokenizer in "
                             f"{tokenizer_path} has no chat template"))  # fmt: skip
    if problems:
        raise ConfigError(problems)
    args = engine.arguments()
    identity = {
        "flow": "openai_batch",
        "model": model_identity(args["model_path"], tokenizer_path),
        "engine": {k: v for k, v in args.items() if k not in PERFORMANCE_ARGS},
        "input": hashlib.sha256(data).hexdigest(),
        "seed": config.seed,
    }
    # NOTE: the identity is of the engine section as written; the run's engine has its paths
    # made absolute, as every run's plan has (flows/run/paths.py, flows/run/lock.py)
    return BatchChecked(requests, absolute_paths(engine), tokenizer_path, kinds), identity


def _embeds(engine: EngineConfig, kinds: set[str]) -> bool:
    """Whether the engine should embed: every line that parsed is an embedding, or the model
    can only embed (an encoder, such as BERT)."""
    if kinds == {"embedding"}:
        return True
    from engine import ModelConfig

    try:
        return ModelConfig.from_folder(str(engine.model_path)).is_encoder
    except ValueError:
        return False  # (the model folder's own problem, reported by check_engine)


# ---------------------------------------------------------------------- the flow
@flow(name="openai-batch", flow_run_name="{config.run_name}")
def openai_batch(config: OpenAIBatchConfig, fresh: bool = False) -> dict[str, Any]:
    """Answer every request of an OpenAI batch file; write the batch's output file."""
    plan, engine = None, None
    with sigterm_stops_the_flow():  # (a `kill` of `gristmill batch` stops it as Ctrl-C does)
        try:
            plan = configure(config)
            engine = init_engine(plan, plan.checked.engine)
            jobs = read_requests(plan, engine, fresh)
            answered = answer_requests(plan, engine, jobs)
            return write_output(plan, answered)
        finally:
            shutdown(engine)
            if plan is not None:
                unlock_run(plan)


@dataclass
class Jobs:
    todo: list[Job]
    total: int
    done_before: int


@task(cache_policy=NO_CACHE)
def read_requests(plan: RunPlan, engine: EngineAPI, fresh: bool = False) -> Jobs:
    """The lines no shard holds yet, each ready for the engine: chat lines rendered with the
    engine's chat template, lines the engine cannot serve with their errors."""
    logger = get_run_logger()
    config, store, checked = plan.config, plan.store, plan.checked
    if fresh and store.folder.exists():
        logger.warning("--fresh: deleting the earlier results in %s", store.folder)
        shutil.rmtree(store.folder)
    done = store.open().done_ids
    requests = checked.requests
    todo = [r for r in requests if r.key not in done]
    store.write_json(
        "run.json", {"config": config.model_dump(mode="json"), "total_rows": len(requests)}
    )
    jobs = prepare_jobs(todo, engine, checked.engine, checked.tokenizer_path)
    errors = sum(job.error is not None for job in jobs)
    logger.info("%d requests: %d answered by earlier runs, %d to answer (%d of them errors)",
                len(requests), len(requests) - len(todo), len(todo), errors)  # fmt: skip
    return Jobs(jobs, len(requests), len(requests) - len(todo))


@task(cache_policy=NO_CACHE)
def answer_requests(plan: RunPlan, engine: EngineAPI, jobs: Jobs) -> Generated:
    """The engine answers each job, at most max_in_flight at once; answers land in shards."""
    logger = get_run_logger()
    config, store = plan.config, plan.store
    if not jobs.todo:
        Progress.nothing_left(jobs.total, config.run_name, logger)
        return Generated()
    progress = Progress(jobs.total, jobs.done_before, config.run_name, logger)
    model = Path(config.engine.model_path).name

    async def run() -> Generated:
        await progress.open()
        try:
            return await answer_rows(
                lambda job: answer(engine, job, model, row_seed(config.seed, job.request.key)),
                jobs.todo, max_in_flight=config.max_in_flight, shard_size=config.shard_size,
                write_shard=lambda rows: store.write_shard(rows, SCHEMA), progress=progress,
            )  # fmt: skip
        finally:
            await progress.close()

    # a stop signal (Ctrl-C, a cancel's SIGTERM): no new lines start, the answered ones are written
    answered = run_stoppable(run(), say=logger)
    if answered.errors:
        logger.warning("%d request(s) got error entries: see their error field", answered.errors)
    return answered


@task(cache_policy=NO_CACHE)
def write_output(plan: RunPlan, answered: Generated) -> dict[str, Any]:
    """Merge the shards, check every line is answered exactly once, and write the output file
    in input order (whole or not at all)."""
    logger = get_run_logger()
    config, store = plan.config, plan.store
    keys = {r.key for r in plan.checked.requests}
    merged = store.merge(expected_ids=keys)
    merged = merged.take(pc.sort_indices(merged.column("line")))
    write_parquet(store.output_path, merged)
    # the answered lines in the output file, the failed ones in the error file (OpenAI's
    # output_file_id and error_file_id; the error file is written empty when none failed, so
    # no earlier run's is left there)
    failed_rows = pc.is_valid(merged.column("error"))
    for path, rows in ((config.output, pc.invert(failed_rows)), (config.errors_path, failed_rows)):
        path.parent.mkdir(parents=True, exist_ok=True)
        chosen = merged.filter(rows).column("output").to_pylist()
        write_file(path, "".join(line + "\n" for line in chosen).encode("utf-8"))

    def total(column: str) -> int:
        return int(pc.sum(merged.column(column)).as_py() or 0)

    failed = int(pc.sum(pc.is_valid(merged.column("error"))).as_py() or 0)
    summary = {
        "run_name": config.run_name,
        "fingerprint": store.fingerprint,
        "requests": merged.num_rows,
        "succeeded": merged.num_rows - failed,
        "failed": failed,
        "answered_now": answered.rows,
        "from_earlier_runs": merged.num_rows - answered.rows,
        "prompt_tokens": total("prompt_tokens"),
        "completion_tokens": total("completion_tokens"),
        "cached_tokens": total("cached_tokens"),
        "seconds": round(answered.seconds, 3),
        "tokens_per_second": round(answered.tokens_per_second, 1),
        **gpu_costs(config, answered.seconds, total("completion_tokens")),
        "output": str(config.output),
        "errors": str(config.errors_path),
    }
    store.write_json("summary.json", summary)
    logger.info("summary: %s", ", ".join(f"{k}={v}" for k, v in summary.items()))
    create_table_artifact(
        key=artifact_key(config.run_name, "summary"),
        table=[{"metric": k, "value": str(v)} for k, v in summary.items()],
        description=f"gristmill OpenAI batch {config.run_name} ({store.fingerprint})",
    )
    return summary
