"""LoRA in the flows: one adapter for every row (`lora`) or one per row (`lora_column`), over
engine.lora_paths. Each row must be what the engine gives for its prompt under its adapter
(the engine's own LoRA is checked against peft in tests/engine/test_lora.py); the fingerprint
follows the adapters' files; names that no adapter has are refused before any engine starts.
"""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from engine import Engine
from flows.config import ConfigError, load_config
from flows.pipeline import generate_batch
from flows.run.lock import lock_run, unlock_run
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
from tests.tiny_models import make_lora

ROWS = 12


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "terse": str(make_lora(llama_dir, root / "terse", 4, ["q_proj", "v_proj"], seed=11)),
        "wordy": str(make_lora(llama_dir, root / "wordy", 8, ["o_proj", "down_proj"], seed=12)),
    }


@pytest.fixture(scope="module")
def lora_engine(llama_dir, adapters):
    """The engine of this module's configs (engine.lora_paths: both adapters): the reference's,
    and lent to the runs (lent_engine checks that a run asks for exactly these arguments; how a
    flow's own engine starts and stops is test_pipeline's). One start, not one per run."""
    with Engine(**_engine_arguments(llama_dir, adapters)) as engine:
        yield engine


def _engine_arguments(llama_dir, adapters) -> dict:
    return {**engine_arguments(llama_dir), "lora_paths": adapters}


def _config(llama_dir, tmp_path, adapters, rows, **fields):
    source = write_jsonl(tmp_path / "q.jsonl", rows)
    config = base_config(llama_dir, source, tmp_path / "runs", **fields)
    config["engine"] = {**config["engine"], "lora_paths": adapters}
    return config


def _reference(engine, rows, names) -> dict[str, str]:
    """Each row's text from the engine called directly with the row's adapter."""
    outs = engine.generate(
        [expected_prompt(r) for r in rows],
        {"temperature": 0, "max_new_tokens": 8},
        lora_path=names,
    )
    return {r["qid"]: o["text"] for r, o in zip(rows, outs)}


def test_an_adapter_per_run_and_per_row(prefect_api, llama_dir, adapters, lora_engine, tmp_path):
    rows = question_rows(ROWS, seed=21)
    names = [("terse", "wordy", "")[i % 3] for i in range(ROWS)]
    for row, name in zip(rows, names):
        row["adapter"] = name
    reference = _reference(lora_engine, rows, [n or None for n in names])
    arguments = _engine_arguments(llama_dir, adapters)
    per_row = load_config(
        _config(llama_dir, tmp_path / "per_row", adapters, rows, lora_column="adapter")
    )
    with lent_engine(lora_engine, arguments) as asked:
        state = generate_batch(config=per_row, return_state=True)
    assert state.is_completed(), state.message
    assert asked == [arguments], "the run asked for its own engine, with both adapters"
    table = pq.read_table(run_folder(tmp_path / "per_row" / "runs") / "output.parquet")
    assert dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist())) == reference
    # one adapter for every row: the rows of that adapter, and only they, are as above
    per_run = load_config(_config(llama_dir, tmp_path / "per_run", adapters, rows, lora="wordy"))
    with lent_engine(lora_engine, arguments):
        state = generate_batch(config=per_run, return_state=True)
    assert state.is_completed(), state.message
    table = pq.read_table(run_folder(tmp_path / "per_run" / "runs") / "output.parquet")
    texts = dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))
    wordy = [r["qid"] for r, n in zip(rows, names) if n == "wordy"]
    assert all(texts[q] == reference[q] for q in wordy)
    assert texts != reference, "the other rows ran under the same adapter too"


def _fingerprint(config) -> str:
    plan = lock_run(config)
    try:
        return plan.store.fingerprint
    finally:
        unlock_run(plan)


def test_the_fingerprint_follows_the_adapter_files(llama_dir, adapters, tmp_path):
    rows = question_rows(4, seed=22)
    copies = {name: str(tmp_path / "copies" / name) for name in adapters}
    for name, folder in adapters.items():
        shutil.copytree(folder, copies[name])
    config = _config(llama_dir, tmp_path, copies, rows, lora="terse")
    before = _fingerprint(load_config(config))
    assert _fingerprint(load_config(config)) == before
    weights = tmp_path / "copies" / "terse" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight of the adapter
    weights.write_bytes(bytes(data))
    assert _fingerprint(load_config(config)) != before
    no_adapter = _config(llama_dir, tmp_path, copies, rows)
    assert _fingerprint(load_config(no_adapter)) != before


def test_names_no_adapter_has_are_refused_before_any_engine(llama_dir, adapters, tmp_path):
    rows = question_rows(3, seed=23)
    rows[1]["adapter"] = "chatty"
    with pytest.raises(ConfigError) as refused:
        preflight(load_config(_config(llama_dir, tmp_path, adapters, rows, lora="chatty")))
    assert refused.value.problems == [
        (
            "lora",
            "names adapter 'chatty', which is not loaded: engine.lora_paths has ['terse', 'wordy']",
        )
    ]
    with pytest.raises(ConfigError) as refused:
        preflight(load_config(_config(llama_dir, tmp_path, adapters, rows, lora_column="adapter")))
    assert refused.value.problems == [
        ("lora_column", "column 'adapter' names adapters that are not loaded: 'chatty'; "
         "engine.lora_paths has ['terse', 'wordy']")
    ]  # fmt: skip
    with pytest.raises(ValueError, match="lora and lora_column both name adapters"):
        load_config(
            _config(llama_dir, tmp_path, adapters, rows, lora="terse", lora_column="adapter")
        )
