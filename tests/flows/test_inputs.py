"""Inputs of a run without an engine: sources, row ids, prompts, fingerprints, the progress bar."""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

import flows.inputs.batches
import flows.run.plan
from flows.config import PromptConfig, SourceConfig, load_config
from flows.engines.progress import Progress
from flows.inputs.prompts import PromptRenderer, template_names
from flows.inputs.sources import content_digest, input_for_run, load_input, read_rows
from flows.inputs.summary import row_ids
from flows.run.identity import run_identity
from flows.run.plan import plan_requests
from flows.run.preflight import preflight
from tests.flows.fixtures import base_config, expected_prompt, question_rows, write_jsonl

ROWS = [{"qid": "a", "text": "x", "n": 1}, {"qid": "b", "text": "y", "n": 2}]


def write_all_formats(folder):
    table = pa.Table.from_pylist(ROWS)
    write_jsonl(folder / "rows.jsonl", ROWS)
    (folder / "rows.csv").write_text("qid,text,n\na,x,1\nb,y,2\n")
    pq.write_table(table, folder / "rows.parquet")
    parts = folder / "parts"
    parts.mkdir()
    pq.write_table(table.slice(0, 1), parts / "part-0.parquet")
    pq.write_table(table.slice(1, 1), parts / "part-1.parquet")
    (parts / "_SUCCESS").write_text("")
    (parts / ".part-2.parquet.crc").write_text("not data")


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.csv", "rows.parquet", "parts"])
def test_every_source_format_reads_the_same_rows_in_order(tmp_path, name):
    write_all_formats(tmp_path)
    table = read_rows(SourceConfig(path=tmp_path / name))
    assert table.to_pylist() == ROWS
    assert row_ids(table, "qid").to_pylist() == ["a", "b"]
    assert row_ids(table, None).to_pylist() == ["0", "1"]  # positions, as strings
    assert row_ids(table, "n").to_pylist() == ["1", "2"]  # any column, as strings


def test_ids_must_be_present_and_unique(tmp_path):
    source = SourceConfig(
        path=write_jsonl(tmp_path / "r.jsonl", [{"k": "a"}, {"k": "a"}, {"k": None}])
    )
    table = read_rows(source)
    with pytest.raises(ValueError, match="1 row\\(s\\) have no value in id column 'k'"):
        row_ids(table, "k")
    with pytest.raises(ValueError, match="must be unique: 1 repeat, e.g. 'a' appears 2 times"):
        row_ids(table.slice(0, 2), "k")


def test_the_content_digest_follows_the_bytes_not_the_path(tmp_path):
    first = write_jsonl(tmp_path / "a" / "r.jsonl", ROWS)
    moved = write_jsonl(tmp_path / "b" / "r.jsonl", ROWS)
    assert content_digest(SourceConfig(path=first)) == content_digest(SourceConfig(path=moved))
    write_jsonl(moved, ROWS[:1])
    assert content_digest(SourceConfig(path=first)) != content_digest(SourceConfig(path=moved))


def test_prompts_render_columns_the_row_and_the_chat_template(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    row = {"text": "hi", "star rating": 5}
    plain = PromptRenderer(
        PromptConfig(template='{{ text }} {{ row["star rating"] }} {{ choices[0] }}'),
        {"choices": ["c"]},
        None,
    )
    assert plain.render(row) == "hi 5 c"
    assert plain.render({**row, "text": None}) == " 5 c", "a null column renders empty"
    chat = PromptRenderer(
        PromptConfig(template="{{ text }}", chat=True, system="Be brief."),
        {},
        tokenizer.apply_chat_template,
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert chat.render(row) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    # many rows in one call of the chat template: each as it renders alone
    rows = [{"text": f"q{i}"} for i in range(5)]
    assert chat.render_many(rows) == [chat.render(r) for r in rows]
    assert chat.render_many([]) == []
    with pytest.raises(Exception, match="'missing' is undefined"):
        PromptRenderer(PromptConfig(template="{{ missing }}"), {}, None).render(row)
    assert template_names("{{ a }}{% for x in b %}{{ x }}{% endfor %}") == {"a", "b"}


def test_the_fingerprint_changes_with_what_changes_rows_and_only_that(llama_dir, tmp_path):
    source = write_jsonl(tmp_path / "q.jsonl", question_rows(5))

    def identity_of(output_dir=tmp_path / "runs", **fields):
        config = load_config(base_config(llama_dir, source, output_dir, **fields))
        return run_identity(config, preflight(config))

    base = identity_of()
    # what the Prefect form sends for a custom run: every field it shows, untouched ones at the
    # engine's defaults; those rows are the command line's, and so is the run
    form = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": False, "top_p": 1.0,
            "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "skip_special_tokens": True}  # fmt: skip
    engine = {**base_config(llama_dir, source, tmp_path)["engine"], "kv_cache_dtype": "auto"}
    same = [
        identity_of(max_in_flight=3, shard_size=7, output_dir=tmp_path / "elsewhere"),
        identity_of(engine={"max_running_requests": 8, "max_total_tokens": 4096}),
        identity_of(run_name="renamed"),
        identity_of(sampling=form, engine=engine),
    ]
    # (a config that leaves the defaults out hashes what it did before this rule)
    assert base["sampling"] == {"temperature": 0, "max_new_tokens": 8}
    assert all(identity == base for identity in same)
    changed = [
        identity_of(seed=1),
        identity_of(sampling={"temperature": 0.5}),
        identity_of(sampling={**form, "ignore_eos": True}),
        identity_of(prompt={"template": "Q: {{ question }}"}),
        identity_of(engine={"dtype": "bfloat16"}),
        identity_of(logprobs=True),
    ]
    assert all(identity != base for identity in changed)
    write_jsonl(source, question_rows(6))
    assert identity_of() != base, "the input's content is part of the identity"


def test_the_encoding_is_part_of_the_datasets_identity_unless_it_is_utf8(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", ROWS)
    # the digest as it was before encodings: the runs made then keep their folders
    before = hashlib.sha256(b"q.jsonl\0" + path.read_bytes()).hexdigest()
    assert content_digest(SourceConfig(path=path)) == before
    assert content_digest(SourceConfig(path=path, encoding="UTF8")) == before
    latin = content_digest(SourceConfig(path=path, encoding="latin-1"))
    assert latin != before and latin != content_digest(SourceConfig(path=path, encoding="cp1252"))


def test_the_input_is_read_once_per_run_and_again_once_it_changes(llama_dir, tmp_path, monkeypatch):
    """preflight reads the input once (both of a command's checks); the fingerprint takes its
    digest from that read and prepare_prompts its summary; the rows are read again only as
    the run streams them, and a file changed after the check is read anew."""
    source = write_jsonl(tmp_path / "q.jsonl", question_rows(5))
    config = load_config(base_config(llama_dir, source, tmp_path))
    reads = []
    open_input = flows.inputs.batches.open_input
    monkeypatch.setattr(
        flows.inputs.batches, "open_input", lambda p: reads.append(p) or open_input(p)
    )

    checked = preflight(config)  # by `gristmill run`, then again by the flow's configure step
    identity = run_identity(config, preflight(config))
    loaded = input_for_run(config.source)  # prepare_prompts
    assert reads.count(source) == 1 and checked.columns == ["qid", "question", "n"]
    assert (
        identity["source"]["sha256"]
        == hashlib.sha256(b"q.jsonl\0" + source.read_bytes()).hexdigest()
    )
    assert pa.concat_tables(loaded.batches()).to_pylist() == question_rows(5)
    assert reads.count(source) == 2, "the run streams the rows: one read more"
    assert read_rows(config.source).num_rows == 5 and reads.count(source) == 4, "none kept after"
    preflight(config)
    write_jsonl(source, question_rows(6))  # changed after the check: its new rows are read
    assert read_rows(config.source).to_pylist() == question_rows(6)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_on_a_terminal_and_logs_lines_elsewhere(caplog):
    logger = logging.getLogger("test.progress")
    bar = Progress(100, 40, "r", logger, stream=Terminal(), log_every=0.0)
    lines = Progress(100, 40, "r", logger, stream=io.StringIO(), log_every=0.0)
    bar._drawn = lines._logged = 0.0  # draw and log at the first advance

    async def advance() -> None:
        for progress in (bar, lines):
            await progress.advance(10, 80)

    with caplog.at_level(logging.INFO, logger="test.progress"):
        asyncio.run(advance())
    drawn = bar.stream.getvalue()
    assert (
        drawn.startswith("\r")
        and "50/100 rows (50%)" in drawn
        and "rows/s" in drawn
        and "tok/s" in drawn
    )
    assert lines.stream is None and "50/100 rows (50%)" in caplog.text and "tok/s" in caplog.text


def test_progress_says_how_many_rows_were_refused_and_why_at_the_first(caplog):
    """A run whose rows the engine refuses (prompts longer than the context, say) finishes
    rows fast and generates nothing: the line says so, and the first refusal is logged at once."""
    logger = logging.getLogger("test.progress")
    progress = Progress(100, 0, "r", logger, stream=io.StringIO(), log_every=0.0)
    progress._logged = 0.0

    async def advance() -> None:
        await progress.advance(1, 0, 1, "The input (329 tokens) is longer than the context")
        await progress.advance(1, 0, 1, "The input (400 tokens) is longer than the context")
        await progress.advance(1, 7)

    with caplog.at_level(logging.INFO, logger="test.progress"):
        asyncio.run(advance())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "329 tokens" in warnings[0]
    assert "3/100 rows (3%) (2 refused)" in progress.line()
    assert progress.tokens == 7


def test_input_columns_named_like_the_flows_columns_are_kept_as_input_name(llama_dir, tmp_path):
    from flows.outputs.rows import output_column
    from flows.synthesize import SynthesizeConfig

    config = load_config(base_config(llama_dir, tmp_path / "q.jsonl", tmp_path))
    assert [output_column(config, c) for c in ("question", "text", "prompt", "seed", "sample")] == [
        "question", "input_text", "input_prompt", "input_seed", "sample"
    ]  # fmt: skip
    synthesize = SynthesizeConfig.model_validate({**config.model_dump(), "flow": "synthesize",
                                                  "synthesize": {"n": 2}})  # fmt: skip
    assert output_column(synthesize, "sample") == "input_sample"


def test_requests_skip_done_ids_and_share_a_rows_prompt_across_batches(
    llama_dir, tmp_path, monkeypatch
):
    """Prompts render RENDER_BATCH rows per call (a resident engine's round trip): the requests
    are still every (row, sample) not done, in input order, each with its own row's prompt."""
    rows = question_rows(7)
    source = write_jsonl(tmp_path / "q.jsonl", rows)
    fields = {"flow": "synthesize", "sampling": {"temperature": 0.7}}
    config = load_config(
        base_config(llama_dir, source, tmp_path / "runs", **fields) | {"synthesize": {"n": 2}}
    )
    loaded = load_input(config.source)
    ids = loaded.row_ids()
    done = {"q0000/0", "q0000/1", "q0003/1", "q0005/0"}
    renderer = PromptRenderer(config.prompt, {}, None)
    batches = []
    render_many = renderer.render_many
    monkeypatch.setattr(renderer, "render_many", lambda r: batches.append(len(r)) or render_many(r))
    monkeypatch.setattr(flows.run.plan, "RENDER_BATCH", 2)
    work = plan_requests(config, loaded, ids, pa.array(sorted(done)), renderer)
    assert batches == [], "planning renders nothing: prompts render as the work is taken"
    expected = [
        (f"{row['qid']}/{k}", row["qid"], k, expected_prompt(row))
        for row in rows
        for k in range(2)
        if f"{row['qid']}/{k}" not in done
    ]
    todo = pa.concat_tables(work.tables()).to_pydict()
    assert list(zip(todo["id"], todo["source_id"], todo["sample"], todo["prompt"])) == expected
    assert work.done_before == len(done) and work.total == 14 and work.todo_count == 10
    # windows of 2 input rows; row 0 is done, so its window renders row 1 alone
    assert batches == [1, 2, 2, 1]
    assert [r["id"] for r in work.rows()] == [e[0] for e in expected]


@pytest.mark.parametrize(
    "template",
    [
        "{{ text }} and {{ row['star rating'] }}",
        "{% for i in range(2) %}{{ loop.index }}:{{ text | upper }} {% endfor %}",
        "{% set ns = namespace(n=0) %}{% for c in choices %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }} {{ cycler('a', 'b').next() }}",
        "{{ text if text else 'none' }} {{ row.get('range', range(1) | list) }}",
    ],
)
def test_prompts_render_as_jinja_renders_them(template):
    import jinja2

    from flows.inputs.prompts import _ENV

    rows = [{"text": "hi", "star rating": 5}, {"text": None, "star rating": 1}]
    renderer = PromptRenderer(PromptConfig(template=template), {"choices": ["x", "y"]}, None)
    reference = _ENV.from_string(template)
    for row in rows:
        expected = reference.render({**row, "row": row, "choices": ["x", "y"]})
        assert renderer.render(row) == expected
    # a column named as one of jinja's globals is the column, as in jinja
    named = PromptRenderer(PromptConfig(template="{{ range }}"), {}, None)
    assert named.render({"range": "r"}) == _ENV.from_string("{{ range }}").render(range="r") == "r"
    with pytest.raises(jinja2.UndefinedError, match="'nope' is undefined"):
        PromptRenderer(PromptConfig(template="{{ nope }}"), {}, None).render(rows[0])
