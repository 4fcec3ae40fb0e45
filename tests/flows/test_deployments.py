"""deployments/: prefect.yaml loads (as `prefect deploy` reads it, and as serve.py does), and a
run triggered through the Prefect API, as the UI's "Run" button does, completes; its engine
stays resident for the next run of the same engine section, until serve.py stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from prefect.cli.deploy._models import PrefectYamlModel
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.utilities.callables import parameter_schema
from prefect.utilities.templating import apply_values

from deployments.serve import PREFECT_FILE, ROOT, load_deployments
from engine import resident_engines
from flows.catalog import FLOWS
from tests.flows.fixtures import (
    flow_env,
    flow_run_logs,
    question_rows,
    wait_until,
    write_jsonl,
)
from tests.processes import wait_gone


@pytest.fixture(scope="module")
def spec():
    return yaml.safe_load(PREFECT_FILE.read_text())


def test_prefect_yaml_is_valid_for_prefect_deploy_and_leaves_templates_alone(spec):
    PrefectYamlModel.model_validate(spec)  # the schema `prefect deploy` checks the file with
    for entry in spec["deployments"]:
        # `prefect deploy` fills {{ placeholders }} in the file: none may touch a prompt template
        assert apply_values(entry["parameters"], {}) == entry["parameters"], entry["name"]


def test_each_deployment_runs_its_flow_with_the_config_of_the_same_name(spec):
    by_name = {d.name: d for d in load_deployments()}
    demos = {"demo-annotate", "demo-evaluate", "demo-synthesize", "demo-openai-batch"}
    assert set(by_name) == {"annotate-nightly", "evaluate", "synthesize", *demos}
    for entry in spec["deployments"]:
        deployment = by_name[entry["name"]]
        config = entry["parameters"]["config"]
        flow = FLOWS[config["flow"]]
        assert entry["entrypoint"] == flow.entrypoint
        # a demo deployment is its demo config (test_demo_flows runs those and checks their
        # results); the others are the sample configs for one's own model and data
        name = entry["name"] if entry["name"] in demos else config["flow"]
        assert config == yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
        flow.flow().validate_parameters(entry["parameters"])
        assert deployment.parameters == entry["parameters"]
        assert deployment.flow_name == flow.flow().name
        # the UI renders this schema as a form: the config's fields, typed, with defaults
        schema = parameter_schema(flow.flow()).model_dump()
        form = schema["definitions"][flow.config_class().__name__]
        fields = {"input", "output"} if config["flow"] == "openai_batch" else {"source", "prompt"}
        assert {"run_name", "engine", "shard_size", *fields} <= set(form["properties"])
        (shard_size,) = form["properties"]["shard_size"]["anyOf"]  # its rule: see engine_sections
        assert shard_size == {"type": "integer", "minimum": 1}
    (nightly,) = by_name["annotate-nightly"].schedules
    assert nightly.schedule.cron == "0 2 * * *" and nightly.schedule.timezone == "UTC"
    assert not by_name["evaluate"].schedules and not by_name["synthesize"].schedules
    assert not any(by_name[name].schedules for name in demos)


def test_demo_deployments_run_as_they_are(spec):
    """Their defaults name only what the repository holds (a Quick run needs no edit): the demo
    model and inputs exist, and the whole config passes the checks a run starts with."""
    from flows.config import load_config
    from flows.run.lock import check_config

    demos = [d for d in spec["deployments"] if d["name"].startswith("demo-")]
    assert len(demos) == 4
    for entry in demos:
        config = load_config(entry["parameters"]["config"])
        assert (ROOT / config.engine.model_path).is_dir(), entry["name"]
        inputs = config.input if config.flow == "openai_batch" else config.source.path
        assert (ROOT / inputs).is_file(), entry["name"]
        cwd = os.getcwd()
        os.chdir(ROOT)  # (as deployments/serve.py runs them)
        try:
            check_config(config)
        finally:
            os.chdir(cwd)


def _with_defaults(value: Any, schema: dict, defs: dict) -> Any:
    """A value with every default its JSON schema gives filled in, as the UI's Quick run
    fills them before it validates the parameters."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    for option in schema.get("allOf", []):
        value = _with_defaults(value, option, defs)
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    filled = dict(value)
    for name, prop in schema["properties"].items():
        if name not in filled and "default" in prop:
            filled[name] = prop["default"]
        if name in filled:
            filled[name] = _with_defaults(filled[name], prop, defs)
    return filled


def test_a_quick_run_with_every_default_filled_in_validates(spec):
    """The UI's Quick run sends the deployment's parameters with the schema's defaults filled
    in, and Prefect validates them against the schema: a default the field's own type refuses
    (null, say) would block every Quick run of every deployment."""
    from prefect.utilities.schema_tools.validation import validate

    for entry in spec["deployments"]:
        flow = FLOWS[entry["parameters"]["config"]["flow"]].flow()
        schema = parameter_schema(flow).model_dump(by_alias=True)
        defs = schema.get("definitions") or schema.get("$defs") or {}
        filled = _with_defaults(entry["parameters"], schema, defs)
        assert filled["config"].get("sampling", {}) is not None
        errors = validate(filled, schema, raise_on_error=False)
        assert not errors, (entry["name"], [e.message for e in errors])


def test_a_run_triggered_through_the_api_completes(prefect_api, llama_dir, tmp_path, spec):
    serve = subprocess.Popen(
        [sys.executable, str(ROOT / "deployments" / "serve.py")],
        env=flow_env(prefect_api, PREFECT_RUNNER_POLL_FREQUENCY="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with get_client(sync_client=True) as client:

            def registered() -> bool:
                assert serve.poll() is None, "serve.py exited"
                try:
                    client.read_deployment_by_name("evaluate/evaluate")
                except Exception:
                    return False
                return True

            wait_until(
                registered, timeout=120, what="serve.py to register the deployments", every=0.5
            )
        rows = question_rows(12, 4)
        source = write_jsonl(
            tmp_path / "data.jsonl",
            [{"id": r["qid"], "question": r["question"], "answer": "x"} for r in rows],
        )
        (evaluate,) = [d for d in spec["deployments"] if d["name"] == "evaluate"]
        config = evaluate["parameters"]["config"] | {
            "engine": {"model_path": str(llama_dir), "max_total_tokens": 8192},
            "source": {"path": str(source), "id_column": "id"},
            "sampling": {"temperature": 0, "max_new_tokens": 4},
            "output_dir": str(tmp_path / "runs"),
        }
        started = time.monotonic()
        flow_run = run_deployment(
            "evaluate/evaluate", parameters={"config": config}, timeout=300, poll_interval=0.5
        )
        assert flow_run.state.is_completed(), (flow_run.state, time.monotonic() - started)
        # the engine stayed resident: a run of the same engine section attaches to it
        (kept,) = resident_engines()
        again = config | {"output_dir": str(tmp_path / "again")}
        second = run_deployment(
            "evaluate/evaluate", parameters={"config": again}, timeout=300, poll_interval=0.5
        )
        assert second.state.is_completed(), second.state
        started_it, attached = (
            f"started resident engine {kept.id}",
            f"attached to resident engine {kept.id}",
        )
        assert started_it in flow_run_logs(flow_run.id, waiting_for=started_it)
        assert attached in flow_run_logs(second.id, waiting_for=attached)
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    assert not resident_engines(), "serve.py stops the engines it kept"
    assert not wait_gone([kept.pid, *kept.info["pids"].values()])
    (summary_file,) = (tmp_path / "runs" / "arithmetic-eval").glob("*/summary.json")
    summary = json.loads(summary_file.read_text())
    table = pq.read_table(summary["output"])
    assert table.column("id").to_pylist() == [r["qid"] for r in rows]
    assert summary["metric"] == "exact_match" and summary["accuracy"] == 0.0
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.id)
    assert run.parameters["config"]["run_name"] == "arithmetic-eval"
    assert Path(summary["output"]).is_file()
