"""The batch flow end to end on a real Prefect server: exactly-once output equal to the engine's
own outputs, resume after SIGKILL and after a failed step, fingerprints, and config errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from engine import Engine
from flows.cli import describe
from flows.config import ConfigError, load_config
from flows.outputs.store import CheckpointStore, row_seed
from flows.pipeline import generate_batch
from tests.flows.fixtures import (
    QUESTION_ROWS,
    base_config,
    engine_arguments,
    expected_prompt,
    fail_the_120th_request,
    flow_env,
    flow_run_logs,
    leftover_temp_files,
    lent_engine,
    question_rows,
    run_folder,
    settled_task_runs,
    wait_until,
)
from tests.processes import alive, engine_children_of, freeze

ROWS = QUESTION_ROWS
SAMPLED = {"temperature": 1.0, "top_k": 40, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def rows():
    return question_rows(ROWS)


@pytest.fixture(scope="module")
def source(questions):
    """The session's question file: its rows are `rows`."""
    return questions


@pytest.fixture(scope="module")
def reference(shared_llama_engine, rows):
    """The engine called directly, one batch per question: the outputs every run must equal."""
    prompts = [expected_prompt(r) for r in rows]
    greedy = shared_llama_engine.generate(prompts, {"temperature": 0, "max_new_tokens": 8})
    sampled = shared_llama_engine.generate(
        prompts, [{**SAMPLED, "sampling_seed": row_seed(7, r["qid"])} for r in rows]
    )
    return {"greedy": greedy, "sampled": sampled}


def by_id(table):
    return {row["id"]: row for row in table.to_pylist()}


def assert_matches_engine(table, rows, outputs):
    assert table.num_rows == len(rows) and table.column("id").to_pylist() == [
        r["qid"] for r in rows
    ]
    for row, got, want in zip(rows, table.to_pylist(), outputs):
        assert got["prompt"] == expected_prompt(row) and got["question"] == row["question"]
        assert got["n"] == row["n"], "input columns are kept with their types"
        assert got["text"] == want["text"], row["qid"]
        meta = want["meta_info"]
        assert got["finish_reason"] == meta["finish_reason"]["type"]
        assert got["prompt_tokens"] == meta["prompt_tokens"]
        assert got["completion_tokens"] == meta["completion_tokens"]
        assert got["error"] is None and got["latency"] > 0


def folder_bytes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def task_runs(flow_run_id, *steps: str) -> dict[str, str]:
    """{step: its final state} of a flow run, once the server has (at least) `steps`."""
    runs = settled_task_runs(flow_run_id, *steps)
    return {run.name.rsplit("-", 1)[0]: run.state.type.value for run in runs}


# ---------------------------------------------------------------------- a whole run
# greedy_run (conftest.py): the base config over `source`, run by the generate flow
def test_300_rows_equal_the_engines_greedy_outputs(greedy_run, rows, reference):
    config, summary, folder, _ = greedy_run
    table = pq.read_table(folder / "output.parquet")
    assert_matches_engine(table, rows, reference["greedy"])
    assert len(set(table.column("id").to_pylist())) == ROWS
    shards = sorted((folder / "shards").glob("*.parquet"))
    assert len(shards) == ROWS // config.shard_size
    assert all(pq.read_metadata(s).num_rows == config.shard_size for s in shards)
    assert summary["rows"] == summary["rows_generated_now"] == ROWS
    assert summary["completion_tokens"] == sum(
        r["meta_info"]["completion_tokens"] for r in reference["greedy"]
    )
    assert summary["tokens_per_second"] > 0 and summary["generate_seconds"] > 0


def test_prompts_render_as_the_engine_takes_rows_not_all_up_front(
    prefect_api, shared_llama_engine, llama_dir, questions, rows, reference, tmp_path, monkeypatch
):
    """The run's memory is a window, not the dataset: a prompt is rendered only when its row is
    about to be submitted, so rendered-but-unfinished rows never exceed what is in flight plus
    one render batch; the merged output is still every row once, in input order."""
    import flows.engines.generation
    import flows.run.plan
    from flows.inputs.prompts import PromptRenderer

    monkeypatch.setattr(flows.run.plan, "RENDER_BATCH", 16)
    counts = {"rendered": 0, "finished": 0, "ahead": []}
    render_many, request = PromptRenderer.render_many, flows.engines.generation.request

    def counting_render(self, batch):
        counts["ahead"].append(counts["rendered"] - counts["finished"])
        counts["rendered"] += len(batch)
        return render_many(self, batch)

    async def counting_request(*args, **kwargs):
        row = await request(*args, **kwargs)
        counts["finished"] += 1
        return row

    monkeypatch.setattr(PromptRenderer, "render_many", counting_render)
    monkeypatch.setattr(flows.engines.generation, "request", counting_request)
    config = load_config(base_config(llama_dir, questions, tmp_path / "runs", max_in_flight=8))
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        generate_batch(config=config)
    assert counts["rendered"] == ROWS and len(counts["ahead"]) == ROWS // 16 + 1
    assert max(counts["ahead"]) <= 8 + 16, counts["ahead"]
    table = pq.read_table(run_folder(tmp_path / "runs") / "output.parquet")
    assert_matches_engine(table, rows, reference["greedy"])


def test_summary_and_progress_are_prefect_artifacts(greedy_run):
    *_, flow_run_id = greedy_run
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    by_key = {a.key: a for a in artifacts}
    assert by_key["questions-progress"].type == "progress"
    assert by_key["questions-progress"].data == 100.0
    # the UI shows the progress line with the bar: rows, rates, time left
    assert f"{ROWS}/{ROWS} rows (100%)" in by_key["questions-progress"].description
    assert "rows/s" in by_key["questions-progress"].description
    summary = by_key["questions-summary"]
    assert summary.type == "table"
    table = {row["metric"]: row["value"] for row in json.loads(summary.data)}
    assert table["rows"] == str(ROWS) and float(table["tokens_per_second"].replace(",", "")) > 0


def test_a_rerun_of_a_finished_run_generates_nothing_and_shows_its_progress_full(
    greedy_run, shared_llama_engine, llama_dir, tmp_path
):
    config, summary, folder, _ = greedy_run
    out = tmp_path / "copy"
    shutil.copytree(folder.parent.parent, out)  # greedy_run's own folder stays as it is
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        state = generate_batch(config=config.model_copy(update={"output_dir": out}),
                               return_state=True)  # fmt: skip
    again = state.result()
    assert again["rows_generated_now"] == 0 and again["rows_from_earlier_runs"] == ROWS
    assert again["completion_tokens"] == summary["completion_tokens"]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
            )
        )
    (progress,) = [a for a in artifacts if a.type == "progress"]
    assert progress.data == 100.0  # the run's page shows it finished, as any finished run's


# ---------------------------------------------------------------------- crash and resume
@pytest.fixture(scope="module")
def sampled_config(llama_dir, source):
    """The sampled config; shard_size and max_in_flight only change speed (not the fingerprint)."""

    def make(out: Path, max_in_flight: int = 64, shard_size: int = 25):
        return base_config(
            llama_dir,
            source,
            out,
            seed=7,
            sampling=SAMPLED,
            shard_size=shard_size,
            max_in_flight=max_in_flight,
        )

    return make


@pytest.fixture(scope="module")
def uninterrupted(greedy_run, sampled_config, rows, reference, shared_llama_engine, llama_dir):
    """The sampled config run straight through, beside the greedy run's results: a changed config."""
    config, _, greedy_folder, _ = greedy_run
    greedy_before = folder_bytes(greedy_folder)
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        state = generate_batch(
            config=load_config(sampled_config(config.output_dir)), return_state=True
        )
    assert state.is_completed(), state.message
    folder = Path(state.result()["output"]).parent
    table = pq.read_table(folder / "output.parquet")
    assert_matches_engine(table, rows, reference["sampled"])  # each row's seed is its own
    return {
        "table": table,
        "folder": folder,
        "flow_run_id": state.state_details.flow_run_id,
        "greedy_before": greedy_before,
    }


def test_sigkill_mid_generate_then_rerun_gives_the_uninterrupted_rows(
    prefect_api,
    sampled_config,
    uninterrupted,
    tmp_path,
    resident_engine,
):
    out = tmp_path / "runs"
    config_file = tmp_path / "config.yaml"
    # one row in flight: slow enough, on any machine, to be killed with shards landed and to go;
    # small shards, so the first lands early (the rerun resumes with shards of 25)
    config_file.write_text(yaml.safe_dump(sampled_config(out, max_in_flight=1, shard_size=5)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", str(config_file)],
        env=flow_env(prefect_api),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        shards = out / "questions"
        wait_until(
            lambda: proc.poll() is None and any(shards.glob("*/shards/shard-*.parquet")),
            timeout=180,
            what="the first shard of the run in the subprocess",
        )
        # frozen mid-generate, its lock held: the checks below take seconds (a refused lock waits
        # 2 s for its holder), in which the run would go on one row at a time (rows the rerun
        # does 64 at once) and could even end; a frozen process dies by SIGKILL all the same
        freeze(proc.pid)
        children = engine_children_of(proc.pid)
        with pytest.raises(ValueError, match=f"another run \\(pid {proc.pid}\\) is writing"):
            CheckpointStore.at(run_folder(out)).lock()  # a second run of this config would stop
        assert f"writer   pid {proc.pid} is writing to it now" in "\n".join(
            describe(run_folder(out))
        )
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert len(children) == 2, "the killed flow ran an engine with two child processes"
    wait_until(
        lambda: not any(map(alive, children)), timeout=30, what="the engine's children to exit"
    )

    folder = run_folder(out)
    landed = len(list((folder / "shards").glob("*.parquet")))
    assert 1 <= landed < ROWS // 5, "killed mid-generate: some shards landed, not all"
    assert not (folder / "output.parquet").exists()

    state = generate_batch(config=load_config(sampled_config(out)), return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["rows_from_earlier_runs"] == 5 * landed
    assert summary["rows_generated_now"] == ROWS - 5 * landed
    resumed = pq.read_table(folder / "output.parquet")
    assert len(set(resumed.column("id").to_pylist())) == resumed.num_rows == ROWS
    keep = ["id", "prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens"]
    assert resumed.select(keep).equals(uninterrupted["table"].select(keep))
    assert leftover_temp_files(folder) == []


# ---------------------------------------------------------------------- a failing step
def test_exception_in_generate_fails_the_run_shuts_the_engine_and_a_rerun_resumes(
    prefect_api,
    llama_dir,
    source,
    rows,
    reference,
    tmp_path,
    monkeypatch,
    shared_llama_engine,
):
    started: list[Engine] = []

    class RecordedEngine(Engine):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            started.append(self)

    monkeypatch.setattr("engine.Engine", RecordedEngine)
    fail_the_120th_request(monkeypatch)
    config = load_config(base_config(llama_dir, source, tmp_path, shard_size=25, max_in_flight=8))
    state = generate_batch(config=config, return_state=True)

    assert state.is_failed() and "injected failure" in state.message
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).state.is_failed()
    steps = task_runs(flow_run_id, "generate", "shutdown")
    assert steps["generate"] == "FAILED" and steps["shutdown"] == "COMPLETED"
    assert "collect" not in steps
    (engine,) = started
    assert all(p.poll() is not None for p in engine.tokenizer_manager.children.procs.values())

    folder = run_folder(tmp_path)
    done = sum(pq.read_metadata(s).num_rows for s in (folder / "shards").glob("*.parquet"))
    # the 120 rows before the failing one were written, but for the seven (at most) in flight
    assert 113 <= done <= 120, "the finished rows were written before the failure propagated"

    monkeypatch.undo()
    # the failed run's own engine was the one to check; the rerun may borrow the session's
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        state = generate_batch(
            config=config.model_copy(update={"max_in_flight": 64}), return_state=True
        )
    assert state.is_completed(), state.message
    assert state.result()["rows_from_earlier_runs"] == done
    assert run_folder(tmp_path) == folder, "max_in_flight is not in the fingerprint: same folder"
    assert_matches_engine(pq.read_table(folder / "output.parquet"), rows, reference["greedy"])


# ---------------------------------------------------------------------- fingerprints
def test_a_changed_config_writes_a_new_folder_and_leaves_the_old_one(greedy_run, uninterrupted):
    *_, old_folder, _ = greedy_run
    new_folder = uninterrupted["folder"]
    assert new_folder.parent == old_folder.parent and new_folder != old_folder
    assert folder_bytes(old_folder) == uninterrupted["greedy_before"]
    logs = flow_run_logs(uninterrupted["flow_run_id"])
    assert "config changed" in logs and old_folder.name in logs


# ---------------------------------------------------------------------- bad configs
@pytest.fixture
def changed_config(llama_dir, source, tmp_path):
    """The base config as a dict, with some fields (or fields of a section) changed."""

    def change(changes: dict) -> dict:
        data = base_config(llama_dir, source, tmp_path)
        for key, value in changes.items():
            data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
        return data

    return change


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(**kwargs):
        raise AssertionError("the engine must not start for a bad config")

    monkeypatch.setattr("engine.Engine", refuse)


WRONG_SHAPE = [
    ({"bogus": 1}, "bogus", "unknown field"),
    ({"shard_size": "many"}, "shard_size", "valid integer"),
    ({"prompt": {"template": "{{ question"}}, "prompt.template", "not a valid Jinja template"),
]


@pytest.mark.parametrize("change,field,message", WRONG_SHAPE, ids=[f for _, f, _ in WRONG_SHAPE])
def test_a_config_of_the_wrong_shape_is_refused_before_the_flow_starts(
    prefect_api, changed_config, no_engine, change, field, message
):
    data = changed_config(change)
    with pytest.raises(ConfigError) as refused:
        load_config(data)
    assert refused.value.problems == [(field, refused.value.problems[0][1])]
    assert message in str(refused.value)
    # the same dict as Prefect parameters (a deployment, the UI): refused by Prefect's validation
    state = generate_batch(config=data, return_state=True)
    assert state.is_failed() and field.split(".")[-1] in state.message
    assert task_runs(state.state_details.flow_run_id) == {}


WRONG_FOR_THE_WORLD = [
    ({"source": {"path": "/nonexistent/rows.jsonl"}}, "source.path: file not found"),
    ({"prompt": {"template": "{{ question }} {{ nope }}"}}, "prompt.template: names column 'nope'"),
    ({"source": {"id_column": "qid2"}}, "source.id_column: names column 'qid2'"),
    ({"engine": {"max_runing_requests": 4}}, "engine.max_runing_requests: Unknown engine argument"),
    (
        {"engine": {"model_path": "/nonexistent"}},
        "engine.model_path: model_path '/nonexistent' is not a folder",
    ),
    # (a single value out of range is the config model's to refuse: test_config_schema.py;
    # what spans fields is the engine's rule, checked here)
    (
        {"sampling": {"min_new_tokens": 9, "max_new_tokens": 4}},
        "sampling: min_new_tokens must be in [0, max_new_tokens(4)]",
    ),
]


@pytest.mark.parametrize(
    "change,message", WRONG_FOR_THE_WORLD, ids=[m.split(":")[0] for _, m in WRONG_FOR_THE_WORLD]
)
def test_a_config_that_does_not_fit_fails_in_configure_before_the_engine_starts(
    prefect_api, changed_config, no_engine, tmp_path, change, message
):
    config = load_config(changed_config(change))
    state = generate_batch(config=config, return_state=True)
    assert state.is_failed() and message in state.message
    assert "invalid config:" in state.message and message.split(":")[0] in state.message
    assert task_runs(state.state_details.flow_run_id, "configure", "shutdown") == {
        "configure": "FAILED",
        "shutdown": "COMPLETED",
    }
    assert not (tmp_path / "questions").exists(), "nothing is written for a bad config"
