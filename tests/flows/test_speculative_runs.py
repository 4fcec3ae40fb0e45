"""Speculative decoding in the flows: `engine.speculative_algorithm` in a config reaches the
engine, and every row is the text the engine gives without speculation; a wrong value is
refused by name before any engine starts."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from engine import Engine
from flows.config import ConfigError, load_config
from flows.pipeline import generate_batch
from flows.run.preflight import preflight
from tests.flows.fixtures import (
    base_config,
    engine_arguments,
    expected_prompt,
    lent_engine,
    question_rows,
    run_folder,
    write_jsonl,
)

SPEC = {"speculative_algorithm": "NGRAM", "speculative_policy": "always"}


def _config(llama_dir, tmp_path, rows, **engine):
    config = base_config(llama_dir, write_jsonl(tmp_path / "q.jsonl", rows), tmp_path / "runs")
    config["engine"] = {**config["engine"], **engine}
    config["sampling"] = {"temperature": 0, "max_new_tokens": 24}
    return config


def test_a_run_with_ngram_gives_the_rows_of_decoding_without(
    prefect_api, llama_dir, shared_llama_engine, tmp_path
):
    rows = question_rows(10, seed=31)
    reference = shared_llama_engine.generate(
        [expected_prompt(r) for r in rows], {"temperature": 0, "max_new_tokens": 24}
    )
    arguments = {**engine_arguments(llama_dir), **SPEC}
    with Engine(**arguments) as engine:
        with lent_engine(engine, arguments) as asked:
            state = generate_batch(config=load_config(_config(llama_dir, tmp_path, rows, **SPEC)),
                                   return_state=True)  # fmt: skip
        verified = engine.get_server_info()["internal_states"][0]["verify_steps"]
    assert state.is_completed(), state.message
    assert asked == [arguments], "the run's engine did not get the speculative arguments"
    assert verified > 0
    table = pq.read_table(run_folder(tmp_path / "runs") / "output.parquet")
    texts = dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))
    assert texts == {r["qid"]: o["text"] for r, o in zip(rows, reference)}


def test_a_wrong_speculative_setting_is_refused_by_name(llama_dir, tmp_path):
    rows = question_rows(2, seed=32)
    with pytest.raises(Exception) as refused:
        preflight(load_config(_config(llama_dir, tmp_path, rows, speculative_algorithm="EAGLE")))
    assert "speculative_algorithm" in str(refused.value)
    with pytest.raises(Exception) as refused:
        config = _config(llama_dir, tmp_path, rows, speculative_algorithm="ngram")
        preflight(load_config(config))
    assert "speculative_algorithm" in str(refused.value) and "NGRAM" in str(refused.value)
    assert isinstance(refused.value, (ConfigError, ValueError))
