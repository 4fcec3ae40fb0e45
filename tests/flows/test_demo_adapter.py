"""The demo's LoRA adapter (demo/adapters/rating): it reproduces from its training script, and
it does a task the base model cannot.

* demo/train_lora.py, rerun for a few steps from scratch, gives the per-step losses recorded
  when the shipped adapter was trained, on the shipped base model.
* `gristmill run configs/demo-lora.yaml` (the annotate flow, `lora: rating`) gives the held-out
  reviews their stars; the reference is the demo generator's own (the input's `stars` column,
  from the sentiment each review was written with), never the model's.
* The base model on the same prompts does not: the adapter is what knows the task. With the
  adapter on, the model still does its own tasks (the adapter adds a task, it does not
  replace the model's).
* The engine's greedy tokens under the adapter equal transformers + peft on the same folders.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo import data
from demo.make_inputs import review_rows
from demo.train import MODEL_DIR
from demo.train_lora import ADAPTER_DIR, LoraTrainConfig, train
from engine import Engine
from tests.flows.fixtures import run_config_with

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo-lora.yaml"
REPRO_STEPS = 3
GREEDY = {"temperature": 0, "max_new_tokens": 4}


def _record() -> dict:
    return json.loads((ADAPTER_DIR / "training_record.json").read_text())


def _prompts(tokenizer, users: list[str]) -> list[str]:
    """As the demo configs render them: the chat template with the generation prompt."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": u}], tokenize=False, add_generation_prompt=True
        )
        for u in users
    ]


# ----------------------------------------------------------------------------- reproducibility
def test_training_script_reproduces_the_recorded_losses():
    record = _record()
    assert record["rating_version"] == data.RATING_VERSION
    assert record["data_version"] == data.DATA_VERSION
    weights = (MODEL_DIR / "model.safetensors").read_bytes()
    assert record["base_model_safetensors_sha256"] == hashlib.sha256(weights).hexdigest()
    fields = dict(record["config"])
    fields["targets"] = tuple(fields["targets"])
    fields["task_weights"] = tuple((task, w) for task, w in fields["task_weights"])
    result = train(LoraTrainConfig(**fields), max_steps=REPRO_STEPS, log=None)
    assert result.losses == pytest.approx(record["first_losses"][:REPRO_STEPS], rel=1e-5)


def test_adapter_folder_is_a_peft_adapter_of_the_demo_model():
    config = json.loads((ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "demo/model"
    assert set(config["target_modules"]) == set(LoraTrainConfig.targets)
    assert (ADAPTER_DIR / "adapter_model.safetensors").stat().st_size <= 2**20


# ----------------------------------------------------------------------------- the run
@pytest.fixture(scope="module")
def rating_engine():
    with Engine(
        model_path=str(MODEL_DIR), dtype="float32", lora_paths={"rating": str(ADAPTER_DIR)}
    ) as engine:
        yield engine


def test_demo_lora_run_gives_the_stars_the_base_model_cannot(
    prefect_api, rating_engine, tmp_path, capsys, monkeypatch
):
    rows = run_config_with(rating_engine, CONFIG, tmp_path, capsys, monkeypatch)
    assert len(rows) == 100 and len({r["id"] for r in rows}) == 100
    stars = {r["id"]: data.STARS[r["sentiment"]] for r in review_rows()}
    assert sum(r["label"] == stars[r["id"]] for r in rows) / len(rows) >= 0.9

    # the base model, the same prompts and engine: no adapter, no stars
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    reviews = review_rows()
    outs = rating_engine.generate(
        _prompts(tokenizer, [data.RATING_INSTRUCTION + r["review"] for r in reviews]), GREEDY
    )
    base = sum(o["text"].strip() == stars[r["id"]] for o, r in zip(outs, reviews)) / len(reviews)
    assert base <= 0.4, f"the base model already answers {base:.0%}"


def test_the_adapter_keeps_the_models_own_task(rating_engine):
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    reviews = review_rows()
    prompts = _prompts(tokenizer, [data.SENTIMENT_INSTRUCTION + r["review"] for r in reviews])
    outs = rating_engine.generate(prompts, GREEDY, lora_path="rating")
    right = sum(o["text"].strip() == r["sentiment"] for o, r in zip(outs, reviews))
    assert right / len(reviews) >= 0.9


def test_engine_with_the_adapter_equals_transformers_with_peft(rating_engine):
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    reviews = review_rows()[:6]
    users = [data.RATING_INSTRUCTION + r["review"] for r in reviews[:4]]
    users += [data.SENTIMENT_INSTRUCTION + r["review"] for r in reviews[4:]]
    prompts = _prompts(tokenizer, users)
    params = {"temperature": 0, "max_new_tokens": 8}
    outs = rating_engine.generate(prompts, params, lora_path="rating")
    base = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, ADAPTER_DIR).eval()
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=8, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        assert out["output_ids"] == ref[0, ids.shape[1] :].tolist()
