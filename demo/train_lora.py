"""Train the demo model's LoRA adapter for the rating task and save it as a PEFT folder.

    python -m demo.train_lora              # writes demo/adapters/rating/: ~2 min on one CPU thread
    python -m demo.train_lora --out /tmp/a --steps 50

The task (demo.data.rating): "How many stars does this reviewer give? Answer 1, 3 or 5." + a
review -> "1" (negative), "3" (neutral) or "5" (positive): the reviews the base model labels, in
another labelling scheme, as a team's own annotation schema would be. The base model
(demo/model) never saw the instruction and cannot do it; the adapter (rank 8 on all seven
projections of the frozen base model) learns it. A share of the stream is the base model's
own tasks, so that with the adapter on, the model still does them: the adapter adds a task rather
than replacing the model's.

Everything is seeded (the data stream, the adapter's initialisation) and runs with deterministic
algorithms on one thread, as demo/train.py does, so a rerun on the same kind of CPU reproduces
the weights. ``training_record.json`` keeps the settings, the losses of the first steps (which
tests/flows/test_demo_adapter.py recomputes), the loss curve and the held-out accuracies of the
base model and of the adapter (transformers + peft, greedy, on demo/inputs/).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from demo import data
from demo.train import MODEL_DIR, _print, batches, deterministic_torch, lr_at, reply_loss

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
ADAPTER_DIR = ADAPTERS_DIR / "rating"
# what adapter_config.json names as the base model: the repository-relative folder, not this
# machine's absolute path (peft would write model.config._name_or_path)
BASE_MODEL_NAME = "demo/model"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraTrainConfig:
    seed: int = 0
    steps: int = 200
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    system_prompt_fraction: float = 0.2  # as the base model's training
    threads: int = 1  # as demo/train.py: float sums may depend on the thread count
    # the adapter
    rank: int = 8
    alpha: int = 16  # scaling alpha / rank = 2
    targets: tuple[str, ...] = TARGET_MODULES
    # the stream: the new task, and the base model's tasks so that the adapter keeps them
    task_weights: tuple[tuple[str, float], ...] = (
        ("rating", 0.5),
        ("arithmetic", 0.3),
        ("sentiment", 0.1),
        ("review", 0.1),
    )
    # what the record keeps
    log_every: int = 25
    first_losses: int = 20


@dataclass
class LoraTrainResult:
    model: PeftModel
    tokenizer: PreTrainedTokenizerFast
    losses: list[float]
    seconds: float


def load_base(model_dir: Path = MODEL_DIR) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def lora_config(cfg: LoraTrainConfig) -> LoraConfig:
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=list(cfg.targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def examples(cfg: LoraTrainConfig) -> Iterator[data.Example]:
    """The training split of the adapter's mix: held-out reviews and sums never appear."""
    return data.stream(cfg.seed, held_out=False, task_weights=dict(cfg.task_weights))


# ----------------------------------------------------------------------------- training
def train(
    cfg: LoraTrainConfig,
    max_steps: int | None = None,
    log: Callable[[str], None] | None = _print,
    model_dir: Path = MODEL_DIR,
) -> LoraTrainResult:
    """Train the adapter on the frozen base model; ``max_steps`` stops early on the same schedule."""
    with deterministic_torch(cfg.threads):
        return _train(cfg, cfg.steps if max_steps is None else max_steps, log, model_dir)


def _train(
    cfg: LoraTrainConfig, steps: int, log: Callable[[str], None] | None, model_dir: Path
) -> LoraTrainResult:
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = load_base(model_dir)
    torch.manual_seed(cfg.seed)  # lora_A's initialisation (lora_B starts at zero)
    model = get_peft_model(base, lora_config(cfg)).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay, foreach=False
    )
    losses: list[float] = []
    for step, (ids, labels) in zip(range(steps), batches(cfg, tokenizer, examples(cfg))):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        loss = reply_loss(model(input_ids=ids).logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if log and (step % cfg.log_every == 0 or step == steps - 1):
            recent = losses[-cfg.log_every :]
            log(
                f"step {step:4d}  loss {losses[-1]:.4f}  mean {sum(recent) / len(recent):.4f}  "
                f"lr {lr_at(cfg, step):.2e}  {time.perf_counter() - started:5.0f}s"
            )
    return LoraTrainResult(model.eval(), tokenizer, losses, time.perf_counter() - started)


# ----------------------------------------------------------------------------- held-out accuracy
def greedy_replies(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, users: list[str], max_new: int = 16
) -> list[str]:
    """Greedy replies of transformers (one prompt at a time: no padding), as the demo configs
    prompt: the chat template with the generation prompt, no system message."""
    replies = []
    with torch.no_grad():
        for user in users:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            replies.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return replies


def held_out_accuracy(model: PeftModel, tokenizer: PreTrainedTokenizerFast) -> dict:
    """Accuracy on the demo's held-out inputs (demo/make_inputs.py), with the adapter and without.

    rating: the LoRA demo (configs/demo-lora.yaml) on inputs/reviews.jsonl; arithmetic and
    sentiment: the base model's own demos, to show that the adapter keeps them."""
    from demo.make_inputs import arithmetic_rows, review_rows

    reviews, sums = review_rows(), arithmetic_rows()
    tasks = {
        "rating": (
            [data.RATING_INSTRUCTION + r["review"] for r in reviews],
            [r["stars"] for r in reviews],
        ),
        "sentiment": (
            [data.SENTIMENT_INSTRUCTION + r["review"] for r in reviews],
            [r["sentiment"] for r in reviews],
        ),
        "arithmetic": ([r["question"] for r in sums], [r["answer"] for r in sums]),
    }

    def score(task: str) -> str:
        users, references = tasks[task]
        replies = greedy_replies(model, tokenizer, users)
        return f"{sum(a.strip() == b for a, b in zip(replies, references))}/{len(references)}"

    adapter = {task: score(task) for task in tasks}
    with model.disable_adapter():
        base = {task: score(task) for task in tasks}
    return {"adapter": adapter, "base_model": base}


# ----------------------------------------------------------------------------- saving
def save(result: LoraTrainResult, cfg: LoraTrainConfig, out_dir: Path, accuracy: dict) -> dict:
    """Write the adapter folder (peft's save_pretrained) and its training_record.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = result.model
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_NAME
    model.save_pretrained(out_dir)  # adapter_config.json, adapter_model.safetensors (float32)
    (out_dir / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
    weights = (out_dir / "adapter_model.safetensors").read_bytes()
    steps = len(result.losses)
    record = {
        "command": "python -m demo.train_lora",
        "base_model": BASE_MODEL_NAME,
        "base_model_safetensors_sha256": hashlib.sha256(
            (MODEL_DIR / "model.safetensors").read_bytes()
        ).hexdigest(),
        "config": dataclasses.asdict(cfg),
        "data_version": data.DATA_VERSION,
        "rating_version": data.RATING_VERSION,
        "steps": steps,
        "first_losses": result.losses[: cfg.first_losses],
        "loss_every": {
            str(s): round(
                sum(result.losses[s : s + cfg.log_every])
                / len(result.losses[s : s + cfg.log_every]),
                5,
            )
            for s in range(0, steps, cfg.log_every)
        },  # fmt: skip
        "final_loss": result.losses[-1],
        "held_out_accuracy": accuracy,
        "wall_seconds": round(result.seconds, 1),
        "adapter_model_safetensors_sha256": hashlib.sha256(weights).hexdigest(),
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    (out_dir / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ADAPTER_DIR)
    parser.add_argument("--steps", type=int, default=LoraTrainConfig.steps)
    parser.add_argument("--seed", type=int, default=LoraTrainConfig.seed)
    args = parser.parse_args(argv)
    cfg = LoraTrainConfig(steps=args.steps, seed=args.seed)
    result = train(cfg)
    started = time.perf_counter()
    accuracy = held_out_accuracy(result.model, result.tokenizer)
    _print(f"held-out accuracy {json.dumps(accuracy)} ({time.perf_counter() - started:.0f}s)")
    record = save(result, cfg, args.out, accuracy)
    print(
        f"saved {args.out}: final loss {record['final_loss']:.4f} in {record['wall_seconds']:.0f}s"
    )


if __name__ == "__main__":
    main()
