"""The ready flows, each run from its config in configs/ (paths and lengths overridden as with
`--set`), against the engine called directly with the same chat prompts and seeds."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from flows.annotate import AnnotateSpec, constraint_params, match_choice
from flows.catalog import FLOWS
from flows.config import ConfigError, load_config
from flows.evaluate import EvaluateSpec, extract_answer, is_correct
from flows.outputs.store import row_seed
from flows.run.preflight import preflight
from tests.flows.fixtures import question_rows, write_jsonl

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# words the tiny random model happens to emit after these prompts, so that some answers name one
CHOICES = ["morning", "over", "query"]


@pytest.fixture
def engine(shared_llama_engine, resident_engine):
    """The engine called directly, which the flows of the test use too (conftest.py)."""
    return shared_llama_engine


@pytest.fixture(scope="module")
def chat(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)

    def render(user: str, system: str | None = None) -> str:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render


def run_config(name: str, llama_dir: Path, source: Path, out: Path, *overrides: str):
    config = load_config(
        CONFIGS / f"{name}.yaml",
        [
            f"engine.model_path={llama_dir}",
            "engine.max_total_tokens=8192",
            f"source.path={source}",
            f"output_dir={out}",
            "sampling.max_new_tokens=8",
            *overrides,
        ],
    )
    state = FLOWS[name].flow()(config=config, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    return config, summary, pq.read_table(summary["output"])


def test_every_config_loads_as_its_flows_config():
    configs = [p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("demo-")]
    assert {p.stem for p in configs} >= {"generate", "annotate", "synthesize", "evaluate"}
    for path in configs:
        config = load_config(path)
        assert type(config) is FLOWS[config.flow].config_class()


# ---------------------------------------------------------------------- annotate
def test_annotate_labels_each_row_with_the_choice_its_answer_names(
    prefect_api, llama_dir, engine, chat, tmp_path
):
    rows = [
        {"review_id": f"r-{r['n']}", "text": f"  {r['question']} "} for r in question_rows(24, 1)
    ]
    source = write_jsonl(tmp_path / "reviews.jsonl", rows)
    config, summary, table = run_config(
        "annotate", llama_dir, source, tmp_path, f"annotate.choices={CHOICES}"
    )
    system = config.prompt.system
    prompts = [
        chat(f"Review: {r['text'].strip()}\n\nIs this review {', '.join(CHOICES)}?", system)
        for r in rows
    ]
    want = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 8})
    assert table.column("id").to_pylist() == [r["review_id"] for r in rows]
    assert table.column("prompt").to_pylist() == prompts
    assert table.column("text").to_pylist() == [w["text"] for w in want]
    labels = [match_choice(w["text"], CHOICES) for w in want]
    assert table.column("label").to_pylist() == labels
    assert summary["labelled"] == len(rows) - labels.count(None) > 0
    assert summary["label_counts"] == {c: labels.count(c) for c in CHOICES}


def test_match_choice_takes_the_earliest_named_choice_or_a_close_spelling():
    choices = ["positive", "negative", "neutral"]
    assert match_choice("Negative.", choices) == "negative"
    assert match_choice("It is neutral, not positive", choices) == "neutral"
    assert match_choice("positively not", choices) is None  # a whole word, not a prefix
    assert match_choice("  positve ", choices) == "positive"  # a close spelling of the answer
    assert match_choice("", choices) is None and match_choice(None, choices) is None
    assert match_choice("NOT SURE", ["not", "not sure"]) == "not sure"  # the longer at a tie


def test_the_constraint_hook_sends_the_choices_or_the_schema():
    assert constraint_params(AnnotateSpec(choices=["a.b", "c"])) == {}
    assert constraint_params(AnnotateSpec(choices=["a.b", "c"], constrained=True)) == {
        "regex": r"a\.b|c"
    }
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    assert constraint_params(AnnotateSpec(json_schema=schema)) == {
        "json_schema": '{"type": "object", "properties": {"label": {"type": "string"}}}'
    }
    with pytest.raises(ValueError, match="either choices or json_schema"):
        AnnotateSpec()


# ---------------------------------------------------------------------- synthesize
def test_synthesize_makes_n_samples_per_row_each_with_its_own_seed(
    prefect_api, llama_dir, engine, chat, tmp_path
):
    rows = [{"question": r["question"]} for r in question_rows(10, 2)]
    source = write_jsonl(tmp_path / "questions.jsonl", rows)
    config, summary, table = run_config("synthesize", llama_dir, source, tmp_path, "synthesize.n=3")
    ids = [f"{i}/{k}" for i in range(len(rows)) for k in range(3)]
    instruction = (
        "Rewrite this question in other words, keeping its meaning. Reply with the question only."
    )
    prompts = [chat(f"{instruction}\n\n{rows[int(i.split('/')[0])]['question']}") for i in ids]
    params = config.sampling.arguments()
    want = engine.generate(prompts, [{**params, "sampling_seed": row_seed(1234, i)} for i in ids])
    assert table.column("id").to_pylist() == ids
    assert table.column("source_id").to_pylist() == [i.split("/")[0] for i in ids]
    assert table.column("sample").to_pylist() == [int(i.split("/")[1]) for i in ids]
    texts = table.column("text").to_pylist()
    assert texts == [w["text"] for w in want]
    assert summary["distinct_texts"] == len(set(texts)) > len(rows)  # samples of a row differ
    assert summary["rows"] == 30 and summary["seed_rows"] == 10


def test_synthesize_refuses_several_greedy_samples():
    config = load_config(CONFIGS / "synthesize.yaml", ["sampling.temperature=0"])
    with pytest.raises(ConfigError, match="synthesize.n: n > 1 with greedy sampling"):
        preflight(config)


# ---------------------------------------------------------------------- evaluate
def test_evaluate_scores_extracted_answers_against_the_reference_column(
    prefect_api, llama_dir, engine, chat, tmp_path
):
    questions = [r["question"] for r in question_rows(30, 3)]
    system = load_config(CONFIGS / "evaluate.yaml").prompt.system
    want = engine.generate(
        [chat(q, system) for q in questions], {"temperature": 0, "max_new_tokens": 8}
    )
    # every even row's reference is its answer's first word, so exactly those rows are right
    firsts = [(w["text"].split() or [""])[0] for w in want]
    answers = [f if i % 2 == 0 and f else "not-an-answer" for i, f in enumerate(firsts)]
    source = tmp_path / "arithmetic.csv"
    with open(source, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "question", "answer"])
        writer.writerows([i, q, a] for i, (q, a) in enumerate(zip(questions, answers)))
    _, summary, table = run_config(
        "evaluate", llama_dir, source, tmp_path, r"evaluate.extract=^\s*(\S+)"
    )
    right = sum(1 for i, f in enumerate(firsts) if i % 2 == 0 and f)
    assert summary["correct"] == right and summary["accuracy"] == round(right / 30, 6)
    assert table.column("correct").to_pylist() == [
        i % 2 == 0 and bool(f) for i, f in enumerate(firsts)
    ]
    assert table.column("predicted").to_pylist() == [f or None for f in firsts]
    assert table.column("answer").to_pylist() == answers
    assert table.column("id").to_pylist() == [str(i) for i in range(30)]
    assert "input_id" not in table.column_names, "an id column named id is the output's id"


def test_the_three_metrics():
    exact = EvaluateSpec(reference_column="a")
    assert is_correct(" The  Answer ", "the answer", exact)
    assert not is_correct("42", "43", exact) and not is_correct(None, "43", exact)
    regex = EvaluateSpec(reference_column="a", metric="regex")
    assert is_correct("42.0", r"42(\.0+)?", regex) and not is_correct("421", r"42(\.0+)?", regex)
    choice = EvaluateSpec(reference_column="a", metric="choice", choices=["yes", "no"])
    assert is_correct("No, it is not.", "no", choice) and not is_correct("maybe", "no", choice)
    assert extract_answer("so the answer is 12.", r"answer is (\d+)") == "12"
    assert extract_answer("no number", r"answer is (\d+)") is None
    assert extract_answer("  whole  ", None) == "whole"
    with pytest.raises(ValueError, match="metric choice needs choices"):
        EvaluateSpec(reference_column="a", metric="choice")


def test_constrained_annotate_answers_only_with_a_choice_or_schema_json(
    prefect_api, llama_dir, engine, chat, tmp_path
):
    rows = [{"review_id": f"r-{r['n']}", "text": r["question"]} for r in question_rows(12, 6)]
    source = write_jsonl(tmp_path / "reviews.jsonl", rows)
    config, summary, table = run_config(
        "annotate", llama_dir, source, tmp_path, "annotate.constrained=true"
    )
    choices = config.annotate.choices
    prompts = table.column("prompt").to_pylist()
    want = engine.generate(
        prompts, {"temperature": 0, "max_new_tokens": 8, "regex": "|".join(choices)}
    )
    assert table.column("text").to_pylist() == [w["text"] for w in want]
    assert all(text in choices for text in table.column("text").to_pylist())
    assert table.column("label").to_pylist() == table.column("text").to_pylist()
    assert summary["labelled"] == len(rows)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    _, summary, table = run_config(
        "annotate", llama_dir, source, tmp_path / "json", "annotate.choices=null",
        f"annotate.json_schema={json.dumps(schema)}", "sampling.max_new_tokens=16",
        "prompt.template=Review: {{ text | trim }} Is it good? Answer {{ json_schema | tojson }}",
    )  # fmt: skip
    texts, labels = table.column("text").to_pylist(), table.column("label").to_pylist()
    assert all(t.lstrip().startswith("{") for t in texts), "the schema reached the engine"
    for text, label, finish in zip(texts, labels, table.column("finish_reason").to_pylist()):
        if finish == "stop":  # a finished answer is JSON of the schema, and it is the label
            assert label == text and set(json.loads(text)) == {"ok"}
        else:  # cut off by max_new_tokens (a random model likes JSON's free whitespace)
            assert label is None
    assert summary["labelled"] == len(rows) - labels.count(None)
