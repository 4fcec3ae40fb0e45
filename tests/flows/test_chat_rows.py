"""Chat rows (prompt.messages_column): each row's messages are rendered with the tokenizer's chat
template (transformers' apply_chat_template is the reference), the config's system message
first where a row has none; every ready flow takes them; a malformed row is refused before the
engine starts, naming the row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from flows.annotate import annotate
from flows.config import ConfigError, load_config
from flows.pipeline import generate_batch
from flows.run.preflight import preflight
from tests.flows.fixtures import base_config, run_folder, write_jsonl

SYSTEM = "You answer briefly."
ROWS = [
    {"qid": "a", "messages": [{"role": "user", "content": "hello there"}]},
    {
        "qid": "b",
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "what is a mill"},
        ],
    },
    {
        "qid": "c",
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
        ],
    },
]
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def _config(llama_dir, source, tmp_path, **prompt) -> dict:
    config = base_config(llama_dir, source, tmp_path / "runs")
    config["prompt"] = {"messages_column": "messages", "system": SYSTEM, **prompt}
    return config


def _expected_prompts(llama_dir) -> dict[str, str]:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompts = {}
    for row in ROWS:
        messages = row["messages"]
        if not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": SYSTEM}, *messages]
        prompts[row["qid"]] = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    return prompts


@pytest.mark.parametrize("source_format", ["jsonl", "parquet", "csv"])
def test_chat_rows_go_through_the_chat_template(
    prefect_api, resident_engine, shared_llama_engine, llama_dir, tmp_path, source_format
):
    if source_format == "jsonl":
        source = write_jsonl(tmp_path / "chats.jsonl", ROWS)
    elif source_format == "parquet":  # messages: a list of structs
        source = tmp_path / "chats.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), source)
    else:  # messages: JSON text in a CSV cell
        source = tmp_path / "chats.csv"
        lines = ["qid,messages"] + [
            f'{r["qid"]},"{json.dumps(r["messages"]).replace(chr(34), chr(34) * 2)}"' for r in ROWS
        ]
        source.write_text("\n".join(lines) + "\n")
    state = generate_batch(
        config=load_config(_config(llama_dir, source, tmp_path)), return_state=True
    )
    assert state.is_completed(), state.message
    table = pq.read_table(run_folder(tmp_path / "runs") / "output.parquet")
    got = dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))
    prompts = _expected_prompts(llama_dir)
    outs = shared_llama_engine.generate([prompts[r["qid"]] for r in ROWS], GREEDY)
    assert got == {r["qid"]: o["text"] for r, o in zip(ROWS, outs)}


def test_an_annotate_run_takes_chat_rows(prefect_api, resident_engine, llama_dir, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", ROWS)
    config = _config(llama_dir, source, tmp_path)
    config.update(flow="annotate", run_name="questions", annotate={"choices": ["yes", "no"]})
    state = annotate(config=load_config(config), return_state=True)
    assert state.is_completed(), state.message
    table = pq.read_table(run_folder(tmp_path / "runs") / "output.parquet")
    assert table.num_rows == len(ROWS) and "label" in table.column_names


def test_bad_chat_rows_are_refused_naming_the_row(llama_dir, tmp_path):
    rows = [
        ROWS[0],
        {"qid": "x", "messages": [{"role": "wizard", "content": "hi"}]},
        {"qid": "y", "messages": []},
    ]
    source = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError) as refused:
        preflight(load_config(_config(llama_dir, source, tmp_path)))
    message = str(refused.value)
    assert "prompt.messages_column" in message
    assert "row 1: message 0 has role 'wizard'" in message and "row 2: not a list" in message
    with pytest.raises(ConfigError, match="give either template or messages_column"):
        load_config(_config(llama_dir, source, tmp_path, template="{{ qid }}"))
