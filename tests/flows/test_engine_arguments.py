"""A config's engine arguments are judged by the engine's own rules (ServerArgs) before anything
starts: `gristmill run` exits 2 naming each bad `engine.<field>`, with no traceback."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.flows.fixtures import base_config, flow_env, question_rows, write_jsonl


def test_engine_arguments_of_a_wrong_type_exit_2_naming_each_field(llama_dir, tmp_path):
    source = write_jsonl(tmp_path / "q.jsonl", question_rows(3))
    config = base_config(llama_dir, source, tmp_path / "runs")
    config["engine"].update(chunked_prefill_size="big", disable_radix_cache="maybe")
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(config_file)],
        capture_output=True,
        text=True,
        env=flow_env("http://127.0.0.1:9/api"),  # no server: nothing may be contacted
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "gristmill: invalid config"
    assert (
        "  engine.chunked_prefill_size: chunked_prefill_size must be -1 (no chunks), "
        "a positive integer or None, got 'big' (str)."
    ) in lines
    assert (
        "  engine.disable_radix_cache: disable_radix_cache must be True or False, "
        "got 'maybe' (str)."
    ) in lines
    assert not (tmp_path / "runs").exists()  # no run folder: no engine, no flow started
