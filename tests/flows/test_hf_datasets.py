"""Hugging Face datasets: a save_to_disk folder (a Dataset, or a DatasetDict by split) and a
folder of Parquet shards named by split as sources, read by `datasets` itself; a run's output
exported with `gristmill export --to hf-dataset` reads back equal through load_from_disk."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.cli import main
from flows.config import ConfigError, load_config
from flows.inputs.sources import load_input, read_rows
from flows.pipeline import generate_batch
from flows.run.identity import run_identity
from flows.run.preflight import preflight
from tests.flows.fixtures import base_config, expected_prompt, question_rows, run_folder

ROWS = question_rows(12, seed=5)


def _config(llama_dir, path, tmp_path, **source) -> dict:
    config = base_config(llama_dir, path, tmp_path / "runs")
    config["source"] = {"path": str(path), "id_column": "qid", **source}
    return config


def test_a_saved_dataset_is_a_source(prefect_api, resident_engine, shared_llama_engine, llama_dir, tmp_path):  # fmt: skip
    folder = tmp_path / "questions-ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    config = load_config(_config(llama_dir, folder, tmp_path))
    assert read_rows(config.source).to_pylist() == ROWS
    state = generate_batch(config=config, return_state=True)
    assert state.is_completed(), state.message
    table = pq.read_table(run_folder(tmp_path / "runs") / "output.parquet")
    got = dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))
    outs = shared_llama_engine.generate(
        [expected_prompt(r) for r in ROWS], {"temperature": 0, "max_new_tokens": 8}
    )
    assert got == {r["qid"]: o["text"] for r, o in zip(ROWS, outs)}
    # and the output exported as a dataset reads back equal
    destination = tmp_path / "exported"
    assert main(["export", str(tmp_path / "runs" / "questions"), "--to", "hf-dataset", str(destination)]) == 0  # fmt: skip
    exported = datasets.load_from_disk(str(destination))
    assert exported.to_list() == table.to_pylist()
    assert main(["export", str(tmp_path / "runs" / "questions"), "--to", "hf-dataset", str(destination)]) == 2  # fmt: skip


def test_a_dataset_dicts_split_is_chosen(llama_dir, tmp_path):
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS[:8]),
            "test": datasets.Dataset.from_list(ROWS[8:]),
        }
    ).save_to_disk(str(folder))
    train = load_config(_config(llama_dir, folder, tmp_path))
    test = load_config(_config(llama_dir, folder, tmp_path, split="test"))
    assert read_rows(train.source).to_pylist() == ROWS[:8]  # (the default: train)
    assert read_rows(test.source).to_pylist() == ROWS[8:]
    # each split is its own input: its own fingerprint
    ids = [run_identity(c, preflight(c))["source"]["sha256"] for c in (train, test)]
    assert ids[0] != ids[1]
    with pytest.raises(ConfigError, match=r"source\.split.*'valid' is not one of them.*\['test', 'train'\]|splits \['test', 'train'\]"):  # fmt: skip
        preflight(load_config(_config(llama_dir, folder, tmp_path, split="valid")))


def test_parquet_shards_by_split(llama_dir, tmp_path):
    """A folder laid out as on the Hub: data/<split>-0000i-of-0000n.parquet."""
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    for name, rows in (("train-00000-of-00002", ROWS[:4]), ("train-00001-of-00002", ROWS[4:9]),
                       ("test-00000-of-00001", ROWS[9:])):  # fmt: skip
        pq.write_table(pa.Table.from_pylist(rows), folder / "data" / f"{name}.parquet")
    train = load_config(_config(llama_dir, folder, tmp_path, split="train"))
    assert read_rows(train.source).to_pylist() == ROWS[:9]
    test = load_config(_config(llama_dir, folder, tmp_path, split="test"))
    assert read_rows(test.source).to_pylist() == ROWS[9:]
    with pytest.raises(ConfigError, match=r"no files of split 'dev'"):
        load_input(load_config(_config(llama_dir, folder, tmp_path, split="dev")).source)
