"""A config's relative paths are made absolute once, in the process that starts the run
(flows/run/paths.py, in flows/run/lock.py), and its fingerprint stays what it was: the identity
is the config's as written, so a rerun of an existing config finds its old run folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flows.config import load_config
from flows.outputs.store import fingerprint
from flows.run.identity import run_identity
from flows.run.lock import lock_run, unlock_run
from flows.run.paths import absolute_paths
from flows.run.preflight import preflight
from tests.flows.fixtures import base_config


def _project(root: Path, llama_dir: Path, questions: Path) -> dict:
    """A folder with a model, an input file and a LoRA adapter's files, and a config that names
    them (and its output_dir) by paths relative to it."""
    (root / "models").mkdir(parents=True)
    (root / "models" / "llama").symlink_to(llama_dir)
    (root / "data").mkdir()
    shutil.copy(questions, root / "data" / "questions.jsonl")
    adapter = root / "adapters" / "terse"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    config = base_config(Path("models/llama"), Path("data/questions.jsonl"), Path("runs"))
    config["engine"] |= {
        "tokenizer_path": "models/llama",
        "lora_paths": {"terse": "adapters/terse"},
    }
    return config


def test_relative_paths_are_absolute_in_the_plan_and_the_fingerprint_is_unchanged(
    llama_dir, questions, tmp_path, monkeypatch
):
    data = _project(tmp_path, llama_dir, questions)
    monkeypatch.chdir(tmp_path)
    config = load_config(data)
    # the fingerprint as it has always been computed: from the config as written
    written = run_identity(config, preflight(config))
    assert written["engine"]["lora_paths"] == {"terse": "adapters/terse"}

    plan = lock_run(config)
    try:
        assert plan.store.fingerprint == fingerprint(written)
        assert plan.store.identity == written
        assert plan.store.folder == tmp_path / "runs" / "questions" / fingerprint(written)
        resolved = plan.config
        assert resolved.output_dir == tmp_path / "runs"
        assert resolved.source.path == tmp_path / "data" / "questions.jsonl"
        engine = resolved.engine.arguments()
        assert engine["model_path"] == engine["tokenizer_path"] == str(tmp_path / "models/llama")
        assert engine["lora_paths"] == {"terse": str(tmp_path / "adapters/terse")}
        # nothing else moved
        assert resolved.model_dump(exclude={"output_dir", "source", "engine"}) == (
            config.model_dump(exclude={"output_dir", "source", "engine"})
        )
        assert {k: v for k, v in engine.items() if k not in data["engine"]} == {}
    finally:
        unlock_run(plan)
    # the lock went with unlock_run, found by the plan whose config is not the one written
    again = lock_run(config)
    unlock_run(again)


def test_absolute_paths_stay_as_they_are_and_a_list_of_adapters_keeps_its_names(tmp_path):
    data = base_config(tmp_path / "model", tmp_path / "in.jsonl", tmp_path / "runs")
    config = load_config(data)
    assert absolute_paths(config, cwd=Path("/elsewhere")) == config
    listed = load_config(data | {"engine": {**data["engine"], "lora_paths": ["a/b/", "c"]}})
    paths = absolute_paths(listed, cwd=Path("/p")).engine.arguments()["lora_paths"]
    assert paths == ["/p/a/b/", "/p/c"]  # named b and c, as written (ServerArgs.lora_adapters)
