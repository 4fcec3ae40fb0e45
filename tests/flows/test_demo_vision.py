"""The demo vision-language model (demo/vision_model): it reproduces from its training script, it
labels pictures it never saw, and the engine answers as transformers does.

* demo/train_vision.py, rerun for a few steps from scratch, gives the per-step losses recorded
  when the shipped model was trained.
* `gristmill run configs/demo-vision.yaml` (the annotate flow over pictures, `image_column`)
  names the colour of the held-out shapes; the reference is the generator's own (the input's
  `colour` column: what demo/shapes.py drew), never a model's.
* The engine's greedy tokens equal transformers' (float32, M-RoPE positions) on a few pictures.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from demo import shapes
from demo.data import SYSTEM_PROMPT
from demo.make_vision_inputs import INPUTS_DIR, shape_pictures, shape_rows
from demo.train import MODEL_DIR
from demo.train_vision import (
    COLOUR_QUESTION,
    IMAGE_PAD,
    IMAGE_SLOT,
    VISION_MODEL_DIR,
    VisionTrainConfig,
    train,
)
from engine import Engine
from flows.inputs.image_column import image_placeholder
from tests.flows.fixtures import run_config_with

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo-vision.yaml"
REPRO_STEPS = 3
MAX_NEW = 8


def _record() -> dict:
    return json.loads((VISION_MODEL_DIR / "training_record.json").read_text())


def _prompt(tokenizer, system: bool) -> str:
    """As configs/demo-vision.yaml renders it: the image slot, then the question, as the chat's
    user message with the generation prompt (after the system message the model knows)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    messages.append({"role": "user", "content": IMAGE_SLOT + COLOUR_QUESTION})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------- reproducibility
def test_training_script_reproduces_the_recorded_losses():
    record = _record()
    assert record["shapes_version"] == shapes.SHAPES_VERSION
    base_tokenizer = (MODEL_DIR / "tokenizer.json").read_bytes()
    assert record["base_tokenizer_sha256"] == hashlib.sha256(base_tokenizer).hexdigest()
    fields = dict(record["config"])
    fields["mrope_section"] = tuple(fields["mrope_section"])
    result = train(VisionTrainConfig(**fields), max_steps=REPRO_STEPS, log=None)
    assert result.losses == pytest.approx(record["first_losses"][:REPRO_STEPS], rel=1e-5)


def test_inputs_are_the_generators_held_out_pictures():
    rows = [json.loads(line) for line in (INPUTS_DIR / "shapes.jsonl").read_text().splitlines()]
    assert rows == shape_rows()
    pictures = shape_pictures()
    assert all(shapes.is_held_out(p) for p in pictures)
    assert {r["colour"] for r in rows} == set(shapes.COLOURS)


def test_vision_model_folder_is_small_and_names_its_image_slot():
    files = {p.name for p in VISION_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "preprocessor_config.json", "training_record.json"} <= files  # fmt: skip
    assert sum(p.stat().st_size for p in VISION_MODEL_DIR.iterdir()) <= 4 * 2**20
    assert image_placeholder(VISION_MODEL_DIR, VISION_MODEL_DIR) == IMAGE_SLOT


# ----------------------------------------------------------------------------- the run
@pytest.fixture(scope="module")
def vision_engine():
    with Engine(model_path=str(VISION_MODEL_DIR), dtype="float32") as engine:
        yield engine


def test_demo_vision_run_names_the_colours(
    prefect_api, vision_engine, tmp_path, capsys, monkeypatch
):
    rows = run_config_with(vision_engine, CONFIG, tmp_path, capsys, monkeypatch)
    assert len(rows) == 100 and len({r["id"] for r in rows}) == 100
    colour = {r["id"]: r["colour"] for r in shape_rows()}
    assert sum(r["label"] == colour[r["id"]] for r in rows) / len(rows) >= 0.9


# ----------------------------------------------------------------------------- against transformers
def _transformers_greedy(model, processor, tokenizer, prompt: str, image_path: Path) -> list[int]:
    """transformers' greedy tokens, a full forward per token (no KV cache), with the image slot
    widened to the image's tokens and M-RoPE positions (mm_token_type_ids: 1 at image tokens;
    without them transformers 5 silently gives every token plain positions)."""
    from PIL import Image

    pixels = processor(images=[Image.open(image_path)], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    ids = []
    for t in tokenizer.encode(prompt):
        ids += [t] * (int(grid.prod()) // processor.merge_size**2 if t == pad else 1)
    start, eos = len(ids), set(model.generation_config.eos_token_id)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            seq = torch.tensor([ids])
            logits = model(
                input_ids=seq, pixel_values=pixels["pixel_values"], image_grid_thw=grid,
                mm_token_type_ids=(seq == pad).int(),
            ).logits  # fmt: skip
            ids.append(int(logits[0, -1].argmax()))
            if ids[-1] in eos:
                break
    return ids[start:]


def test_engine_greedy_equals_transformers(vision_engine):
    tokenizer = AutoTokenizer.from_pretrained(VISION_MODEL_DIR)
    processor = Qwen2VLImageProcessorPil.from_pretrained(VISION_MODEL_DIR)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        VISION_MODEL_DIR, dtype=torch.float32
    ).eval()
    rows = shape_rows()[:3]
    cases = [(_prompt(tokenizer, s), INPUTS_DIR / r["image"]) for r in rows for s in (False, True)]
    outs = vision_engine.generate(
        [prompt for prompt, _ in cases],
        {"temperature": 0, "max_new_tokens": MAX_NEW},
        image_data=[str(path) for _, path in cases],
    )
    for (prompt, path), out in zip(cases, outs):
        want = _transformers_greedy(model, processor, tokenizer, prompt, path)
        assert out["output_ids"] == want, f"{path.name}: {prompt!r}"
