"""Rows with an image (prompt.image_column) on a tiny Qwen2.5-VL: each row's text is what the
engine gives for the row's prompt and picture (the engine's own image path is checked against
transformers in tests/engine/test_vision_language.py); annotate labels images with constrained
choices; the fingerprint follows the pictures' content; a missing picture or a text-only model
is refused before any engine starts."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from engine import Engine
from flows.annotate import annotate
from flows.config import ConfigError, load_config
from flows.inputs.image_column import image_placeholder
from flows.pipeline import generate_batch
from flows.run.identity import run_identity
from flows.run.preflight import preflight
from tests.flows.fixtures import base_config, lent_engine, run_folder, write_jsonl
from tests.tiny_models import make_tiny_vl_model

TEMPLATE = "What is in the picture? {{ question }}"


ENGINE = {"max_total_tokens": 8192}  # the arguments of every engine here


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def vl_engine(vl_dir):
    """One engine for the module: lent to the flows (lent_engine), and the reference."""
    with Engine(model_path=str(vl_dir), **ENGINE) as engine:
        yield engine


def _run(flow, config: dict, engine) -> object:
    with lent_engine(engine, {"model_path": config["engine"]["model_path"], **ENGINE}):
        return flow(config=load_config(config), return_state=True)


def _picture(path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (56, 70, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def _rows(folder, count: int) -> list[dict]:
    """Rows with pictures under folder/images (relative paths), the last one without."""
    rows = []
    for i in range(count):
        name = f"images/{i}.png" if i < count - 1 else None
        if name:
            _picture(folder / name, seed=i)
        rows.append({"qid": f"q{i}", "question": f"Say {i}.", "image": name})
    return rows


def _config(vl_dir, folder, rows, **fields) -> dict:
    source = write_jsonl(folder / "rows.jsonl", rows)
    config = base_config(vl_dir, source, folder / "runs", **fields)
    config["engine"] = {"model_path": str(vl_dir), **ENGINE}
    config["prompt"] = {"template": TEMPLATE, "image_column": "image"}
    return config


def test_rows_with_images_are_what_the_engine_gives(prefect_api, vl_dir, vl_engine, tmp_path):
    rows = _rows(tmp_path, 5)
    state = _run(generate_batch, _config(vl_dir, tmp_path, rows), vl_engine)
    assert state.is_completed(), state.message
    table = pq.read_table(run_folder(tmp_path / "runs") / "output.parquet")
    got = dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))
    assert table.column("error").null_count == len(rows)
    # the reference: the engine called directly, the image slot before the text
    slot = image_placeholder(vl_dir, vl_dir)
    assert slot == "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [(slot if r["image"] else "") + f"What is in the picture? {r['question']}" for r in rows]  # fmt: skip
    images = [str(tmp_path / r["image"]) if r["image"] else None for r in rows]
    outs = vl_engine.generate(prompts, {"temperature": 0, "max_new_tokens": 8}, image_data=images)
    assert got == {r["qid"]: o["text"] for r, o in zip(rows, outs)}
    # the image rows' prompts hold their image tokens (the engine's count, as in the output)
    assert table.column("prompt_tokens").to_pylist() == [
        o["meta_info"]["prompt_tokens"] for o in outs
    ]


def test_annotate_labels_pictures(prefect_api, vl_dir, vl_engine, tmp_path):
    rows = _rows(tmp_path, 4)
    choices = ["red", "green", "blue"]
    config = _config(vl_dir, tmp_path, rows, flow="annotate", run_name="colours")
    config["annotate"] = {"choices": choices, "constrained": True}
    config["prompt"]["template"] = "{{ image }}Which colour? One of {{ choices | join(', ') }}."
    state = _run(annotate, config, vl_engine)
    assert state.is_completed(), state.message
    table = pq.read_table(run_folder(tmp_path / "runs", "colours") / "output.parquet")
    assert set(table.column("label").to_pylist()) <= set(choices)
    assert table.column("label").null_count == 0


def test_fingerprint_follows_the_pictures(vl_dir, tmp_path):
    rows = _rows(tmp_path, 3)
    config = load_config(_config(vl_dir, tmp_path, rows))
    before = run_identity(config, preflight(config))
    assert run_identity(config, preflight(config)) == before
    _picture(tmp_path / "images/1.png", seed=99)  # the same name, another picture
    after = run_identity(config, preflight(config))
    assert after["images"] != before["images"]
    assert {k: v for k, v in after.items() if k != "images"} == {
        k: v for k, v in before.items() if k != "images"
    }


def test_missing_pictures_and_text_only_models_are_refused(vl_dir, llama_dir, tmp_path):
    rows = _rows(tmp_path, 3)
    rows[0]["image"] = "images/nowhere.png"
    with pytest.raises(
        ConfigError, match=r"prompt\.image_column.*row 0: no file 'images/nowhere\.png'"
    ):
        preflight(load_config(_config(vl_dir, tmp_path, rows)))
    rows = _rows(tmp_path / "text", 3)
    config = _config(vl_dir, tmp_path / "text", rows)
    config["engine"]["model_path"] = str(llama_dir)
    with pytest.raises(ConfigError, match=r"prompt\.image_column.*takes text only"):
        preflight(load_config(config))
    config = _config(vl_dir, tmp_path / "text", rows)
    config["prompt"]["image_column"] = "picture"
    with pytest.raises(ConfigError, match=r"prompt\.image_column.*'picture'"):
        preflight(load_config(config))
