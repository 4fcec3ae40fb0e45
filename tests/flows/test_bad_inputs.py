"""Bad input files: found whole before anything starts, reported as exit 2 naming the file, the
line, the column and the value, with no traceback and no engine or flow started.

The messages are checked against lines found independently here (where the test wrote them),
not against what pyarrow reports: its JSON reader names a row within a block of the file."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pa_json
import pytest
import yaml

from flows.cli import main
from flows.config import ConfigError, load_config
from flows.inputs.sources import read_rows
from flows.run.preflight import preflight
from tests.flows.fixtures import base_config, flow_env, question_rows, write_jsonl

# A review with Latin-1 bytes: "été" is b"\xe9t\xe9"; the other rows are plain ASCII.
REVIEWS = [("r1", "The kettle is fine."), ("r2", "Boils fast.\nQuiet too."), ("r3", "Un \xe9t\xe9 chaud."),
           ("r4", "Lid rattles.")]  # fmt: skip


def write_reviews(path: Path, encoding: str = "latin-1") -> Path:
    """A CSV of REVIEWS; r2's text spans two lines, so r3 is on line 5, not on row 3's line 4."""
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([("qid", "review"), *REVIEWS])
    path.write_bytes(text.getvalue().encode(encoding))
    return path


def review_config(llama_dir, source, tmp_path, **source_fields):
    config = base_config(llama_dir, source, tmp_path / "runs")
    config["source"].update(source_fields)
    config["prompt"]["template"] = "Review: {{ review }}"
    return config


def big_jsonl_with_a_bad_line(path: Path) -> tuple[Path, int]:
    """Questions with long texts (over 1 MiB in all) and one line that is not JSON, past the
    first MiB, so pyarrow reads it in a later block; returns the file and that line's number."""
    rows = [{**row, "question": row["question"] * 200} for row in question_rows(400)]
    lines = [json.dumps(row) for row in rows]
    lines.insert(180, '{"qid": "q9999", "question": "no closing quote}')
    lines.insert(3, "")  # a blank line: read past, but counted
    path.write_text("\n".join(lines) + "\n")
    bad_line = 182
    assert len("\n".join(lines[: bad_line - 1]).encode()) > 1 << 20
    return path, bad_line


def refused(config: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as error:
        preflight(load_config(config))
    return error.value.problems


@pytest.fixture
def no_flow(monkeypatch):
    """`gristmill run` must stop before any flow (and so any engine or Prefect server) starts."""

    def refuse(self):
        raise AssertionError("a flow started for a bad input")

    monkeypatch.setattr("flows.catalog.FlowEntry.flow", refuse)


def run_cli(config: dict, tmp_path: Path, capsys) -> tuple[int, list[str]]:
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config))
    code = main(["run", str(config_file)])
    return code, capsys.readouterr().err.splitlines()


# ---------------------------------------------------------------------- each bad input, by the CLI
def test_a_header_only_csv_exits_2_before_anything_starts(llama_dir, tmp_path, capsys, no_flow):
    source = tmp_path / "reviews.csv"
    source.write_text("qid,review\n")
    code, err = run_cli(review_config(llama_dir, source, tmp_path), tmp_path, capsys)
    assert code == 2
    assert err == [
        "gristmill: invalid config",
        "  source.path: reviews.csv has a header but no rows",
    ]


def test_non_utf8_bytes_exit_2_naming_the_line_the_column_and_the_bytes(
    llama_dir, tmp_path, capsys, no_flow
):
    source = write_reviews(tmp_path / "reviews.csv")
    code, err = run_cli(review_config(llama_dir, source, tmp_path), tmp_path, capsys)
    assert code == 2
    assert err[1:] == [
        "  source.path: reviews.csv line 5, column 'review': bytes b'\\xe9t\\xe9' are not valid "
        "utf-8 (set source.encoding if the file is not utf-8)"
    ]
    assert not (tmp_path / "runs").exists()


def test_non_utf8_bytes_in_jsonl_name_the_key(llama_dir, tmp_path):
    source = tmp_path / "questions.jsonl"
    rows = question_rows(4)
    rows[2]["question"] = "caf\xe9 au lait"
    source.write_bytes(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("latin-1")
    )
    assert refused(base_config(llama_dir, source, tmp_path)) == [
        ("source.path", "questions.jsonl line 3, column 'question': bytes b'caf\\xe9' are not "
         "valid utf-8 (set source.encoding if the file is not utf-8)")
    ]  # fmt: skip


def test_duplicate_and_missing_ids_exit_2_naming_their_lines(llama_dir, tmp_path, capsys, no_flow):
    rows = question_rows(12)
    rows[8]["qid"] = rows[2]["qid"]  # lines 3 and 9
    rows[10]["qid"] = None  # line 11
    source = write_jsonl(tmp_path / "questions.jsonl", rows)
    code, err = run_cli(base_config(llama_dir, source, tmp_path / "runs"), tmp_path, capsys)
    assert code == 2
    assert err[1:] == [
        "  source.id_column: line 11 of questions.jsonl has no value in column 'qid'",
        f"  source.id_column: id {rows[2]['qid']!r} repeats: lines 3 and 9 of questions.jsonl",
    ]


def test_a_template_column_the_input_lacks_exits_2_naming_it(llama_dir, tmp_path, capsys, no_flow):
    source = write_reviews(tmp_path / "reviews.csv")
    config = review_config(llama_dir, source, tmp_path, encoding="latin-1")
    config["prompt"]["template"] = "Review: {{ reviw }}"
    code, err = run_cli(config, tmp_path, capsys)
    assert code == 2
    assert err[1:] == [
        "  prompt.template: names column 'reviw', which the input does not have "
        "(columns: qid, review)"
    ]


def test_a_bad_line_past_the_first_mib_exits_2_naming_its_line(llama_dir, tmp_path):
    """The whole command, as a user runs it: no traceback, no run folder, no Prefect server
    contacted (there is none at the address), only the time of its imports."""
    source, bad_line = big_jsonl_with_a_bad_line(tmp_path / "questions.jsonl")
    with pytest.raises(pa.ArrowInvalid) as arrow:
        pa_json.read_json(source)
    row = int(re.search(r"in row (\d+)", str(arrow.value))[1])
    assert row < bad_line - 2, "pyarrow names a row of the later block that fails, not the line"
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(base_config(llama_dir, source, tmp_path / "runs")))
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(config_file)],
        capture_output=True,
        text=True,
        env=flow_env("http://127.0.0.1:9/api"),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "gristmill: invalid config",
        f"  source.path: questions.jsonl line {bad_line}: not valid JSON (Unterminated string "
        """starting at character 30): '{"qid": "q9999", "question": "no closing quote}'""",
    ]
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------- more bad inputs, in-process
def test_csv_rows_with_the_wrong_number_of_fields_are_named_by_line(llama_dir, tmp_path):
    source = tmp_path / "questions.csv"
    source.write_text('qid,question\nq1,"two\nlines"\n\nq2,fine\nq3,one,too many\n')
    assert refused(base_config(llama_dir, source, tmp_path)) == [
        ("source.path", "questions.csv line 6: 3 fields, but the header has 2: 'q3,one,too many'")
    ]


def test_a_jsonl_value_of_another_type_than_the_columns_is_named(llama_dir, tmp_path):
    rows = question_rows(5)
    rows[3]["n"] = "four"
    source = write_jsonl(tmp_path / "questions.jsonl", rows)
    assert refused(base_config(llama_dir, source, tmp_path)) == [
        ("source.path", "questions.jsonl line 4, column 'n': \"four\" is a string, "
         "but line 1 has a number")
    ]  # fmt: skip


def test_every_bad_file_of_a_folder_is_named_and_ids_repeat_across_files(llama_dir, tmp_path):
    folder = tmp_path / "parts"
    write_jsonl(folder / "a.jsonl", question_rows(3))
    (folder / "b.jsonl").write_text('{"qid": "x"}\nnot json\n')
    (folder / "c.jsonl").write_bytes(b'{"qid": "y", "question": "\xff"}\n')
    assert refused(base_config(llama_dir, folder, tmp_path)) == [
        ("source.path", "parts/b.jsonl line 2: not valid JSON (Expecting value at character 1): "
         "'not json'"),
        ("source.path", "parts/c.jsonl line 1, column 'question': bytes b'\\xff' are not valid "
         "utf-8 (set source.encoding if the file is not utf-8)"),
    ]  # fmt: skip
    (folder / "b.jsonl").unlink()
    write_jsonl(folder / "c.jsonl", question_rows(5)[3:])
    write_jsonl(folder / "b.jsonl", [question_rows(3)[1]])
    assert refused(base_config(llama_dir, folder, tmp_path)) == [
        ("source.id_column", "id 'q0001' repeats: line 2 of parts/a.jsonl and line 1 of "
         "parts/b.jsonl")
    ]  # fmt: skip


def test_an_empty_input_and_an_unknown_encoding_are_refused(llama_dir, tmp_path):
    empty = tmp_path / "questions.jsonl"
    empty.write_text("\n\n")
    assert refused(base_config(llama_dir, empty, tmp_path)) == [
        ("source.path", "questions.jsonl is empty")
    ]
    config = base_config(llama_dir, empty, tmp_path)
    config["source"]["encoding"] = "latin1x"
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert error.value.problems == [
        ("source.encoding", "unknown encoding 'latin1x': did you mean 'latin-1'? "
         "e.g. utf-8, latin-1, cp1252, utf-16")
    ]  # fmt: skip


def test_the_configured_encoding_reads_the_text_as_text(llama_dir, tmp_path):
    source = write_reviews(tmp_path / "reviews.csv")
    config = load_config(review_config(llama_dir, source, tmp_path, encoding="latin-1"))
    preflight(config)
    table = read_rows(config.source)
    assert table.schema.field("review").type == pa.string()
    assert table.to_pylist() == [{"qid": q, "review": r} for q, r in REVIEWS]
