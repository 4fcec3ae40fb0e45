"""Fixtures of the flow tests. The tiny model folders (llama_dir, ...) come from tests/conftest.py.

What is slow to make is made once per session (under xdist, once per worker): the Prefect
server, the engine on the tiny llama (shared_llama_engine, tests/conftest.py, which flows
borrow where the engine's own life is not the point), the engine on the demo model
(shared_demo_engine, for test_demo_model and test_demo_flows), and one plain run of the
generate flow over 300 questions, which test_pipeline checks and test_parallel compares its
Dask runs with.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.flows import prefect_schema
from tests.flows.fixtures import (
    DEMO_ENGINE,
    QUESTION_ROWS,
    base_config,
    engine_arguments,
    lent_engine,
    question_rows,
    run_folder,
    write_jsonl,
)


@pytest.fixture(scope="session")
def prefect_api(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a temporary Prefect server (SQLite) that every flow in the session reports to.

    One per session (under xdist, per worker), on a free port of its own, started on a copy of
    the run's Prefect schema (tests/flows/prefect_schema.py): ~8 s, not ~30, on 2 cores."""
    import tempfile

    import prefect.testing.utilities as harness

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
    def with_schema() -> str:  # the harness's folder for its database, made with the copy in it
        folder = tempfile.mkdtemp()
        prefect_schema.copy_to(request.config, Path(folder) / "prefect-test.db")
        return folder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "mkdtemp", with_schema)
        stack = contextlib.ExitStack()
        stack.enter_context(prefect_test_harness(server_startup_timeout=120))
    with stack, temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield PREFECT_API_URL.value()


# ---------------------------------------------------------------------- the engine
@pytest.fixture
def resident_engine(shared_llama_engine: Any, llama_dir: Path) -> Iterator[list[dict[str, Any]]]:
    """The flows this test runs in its own process use the session's engine instead of starting
    one each (~4 s, more on a busy machine); yields the arguments each flow asked for.

    For tests of what flows write. How a flow's own engine lives and dies (started in
    init_engine, stopped by shutdown after a failure, gone with a SIGKILLed flow or Dask worker)
    is checked with engines of their own: test_pipeline's exception and SIGKILL tests,
    test_parallel's workers and test_deployments."""
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)) as asked:
        yield asked


@pytest.fixture(scope="session")
def shared_demo_engine() -> Iterator[Any]:
    """One engine on the demo model with the demo configs' engine arguments, for the session
    (under xdist, one per worker): test_demo_model asks it for answers, test_demo_flows lends
    it to the demo runs (each started one of its own: ~3 s, more on a busy machine)."""
    from engine import Engine

    model = Path(__file__).resolve().parents[2] / DEMO_ENGINE["model_path"]
    with Engine(**{**DEMO_ENGINE, "model_path": str(model)}) as engine:
        yield engine


@pytest.fixture(scope="module")
def demo_engine(shared_demo_engine: Any) -> Any:
    """The shared demo engine, idle and with an empty prefix cache, for this module (as
    tests/engine/conftest.py gives the session's llama engine to each module)."""
    deadline = time.monotonic() + 30
    while not shared_demo_engine.flush_cache():  # refused while requests run
        assert time.monotonic() < deadline, "the demo engine stayed busy after its last module"
        time.sleep(0.05)
    return shared_demo_engine


# ---------------------------------------------------------------------- the shared run
@pytest.fixture(scope="session")
def questions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """QUESTION_ROWS question rows as JSONL (ids in column qid): the input of base_config's runs."""
    path = tmp_path_factory.mktemp("input") / "questions.jsonl"
    return write_jsonl(path, question_rows(QUESTION_ROWS))


@pytest.fixture(scope="session")
def greedy_run(
    prefect_api: str,
    shared_llama_engine: Any,
    llama_dir: Path,
    questions: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Any, dict[str, Any], Path, Any]:
    """base_config over the questions, run by the generate flow on the session's engine:
    (config, summary, run folder, flow run id). Nothing may write into its folder."""
    from flows.config import load_config
    from flows.pipeline import generate_batch

    out = tmp_path_factory.mktemp("greedy")
    config = load_config(base_config(llama_dir, questions, out))
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        state = generate_batch(config=config, return_state=True)
    assert state.is_completed(), state.message
    return config, state.result(), run_folder(out), state.state_details.flow_run_id
