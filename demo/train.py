"""Train gristmill's built-in demo model from scratch on CPU and save it as a Hugging Face folder.

    python -m demo.train                 # writes demo/model/: 3000 steps on one CPU thread
    python -m demo.train --out /tmp/m --steps 200

One thread at about 0.35 s a step takes ~18 minutes on an idle core; the shipped model took 40
on a shared 2-core machine under heavy load. Fewer steps is a worse model: the held-out sums are
learned late (an abrupt drop in loss somewhere between steps 1300 and 1800, depending on the seed
and the CPU), and the steps after it make them exact.

Everything is seeded and the data order is fixed, so a rerun with the same settings on the same
kind of CPU reproduces the weights; ``training_record.json`` keeps the settings, the per-step losses
of the first steps (which tests/flows/test_demo_model.py recomputes) and the loss curve.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import platform
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from demo import data
from demo.tokenizer import CHAT_TEMPLATE, ENDOFTEXT, IM_END, build_tokenizer

MODEL_DIR = Path(__file__).resolve().parent / "model"
DRAFT_DIR = Path(__file__).resolve().parent / "draft"
IGNORE = -100  # label of tokens the loss skips (everything but the assistant's reply)


def _print(line: str) -> None:
    print(line, flush=True)  # flushed, so a log redirected to a file shows progress


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 3000
    batch_size: int = 48
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    system_prompt_fraction: float = 0.2  # conversations that start with data.SYSTEM_PROMPT
    # NOTE: float sums may depend on the thread count, so it is part of the config (and the test
    # uses it). One thread: on a shared 2-core machine, two threads ran 3.5x slower, not faster.
    threads: int = 1
    # the model (Qwen3, tied embeddings)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 256
    # what the record keeps
    log_every: int = 50
    first_losses: int = 20


# The demo's draft model (speculative decoding, STANDALONE): one layer of half the width, the
# same tokenizer and data, so it drafts the demo model's replies cheaply and often right.
DRAFT = TrainConfig(
    hidden_size=64, intermediate_size=192, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip


@dataclass
class TrainResult:
    model: Qwen3ForCausalLM
    tokenizer: PreTrainedTokenizerFast
    losses: list[float]  # one per step
    seconds: float


# ----------------------------------------------------------------------------- model and data
def build_model(cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    config = Qwen3Config(
        vocab_size=_round_up(len(tokenizer), 64),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        attn_implementation="sdpa",
    )
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config)


def encode_example(
    tokenizer: PreTrainedTokenizerFast, ex: data.Example, system: bool
) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that keep only the assistant's reply.

    The prompt is tokenized exactly as the engine will tokenize it (the chat template with
    add_generation_prompt, then ``encode``), and must be a prefix of the whole conversation's ids.
    """
    messages = ex.messages(system)
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True
    )
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt_ids, ids = tokenizer.encode(prompt), tokenizer.encode(full)
    if ids[: len(prompt_ids)] != prompt_ids:
        raise AssertionError(
            f"the prompt's tokens are not a prefix of the conversation's: {full!r}"
        )
    # the reply and its <|im_end|>; the "\n" after it is the template's, not the model's
    reply_end = len(ids) - 1
    labels = [IGNORE] * len(prompt_ids) + ids[len(prompt_ids) : reply_end] + [IGNORE]
    return ids, labels


def batches(
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerFast,
    examples: Iterator[data.Example] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, labels) batches from the training split, in a fixed order
    (``examples``: another stream than the base model's, as demo/train_lora.py gives).

    Right padding needs no attention mask: in causal attention, real tokens never see the pads.
    """
    examples = data.stream(cfg.seed) if examples is None else examples
    use_system = random.Random(cfg.seed + 1)
    pad = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    while True:
        rows = [
            encode_example(
                tokenizer, next(examples), use_system.random() < cfg.system_prompt_fraction
            )
            for _ in range(cfg.batch_size)
        ]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(rows):
            ids[i, : len(row_ids)] = torch.tensor(row_ids)
            labels[i, : len(row_labels)] = torch.tensor(row_labels)
        yield ids, labels


def reply_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the reply tokens of the batch (the rest are labelled IGNORE)."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE
    )


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# ----------------------------------------------------------------------------- training
def train(
    cfg: TrainConfig,
    max_steps: int | None = None,
    log: Callable[[str], None] | None = _print,
) -> TrainResult:
    """Train from scratch; ``max_steps`` stops early on the same schedule (the reproducibility test)."""
    with deterministic_torch(cfg.threads):
        return _train(cfg, cfg.steps if max_steps is None else max_steps, log)


@contextlib.contextmanager
def deterministic_torch(threads: int) -> Iterator[None]:
    """Deterministic algorithms on `threads` threads for the block (float sums depend on the
    thread count), the caller's settings back after it: what makes a training rerun exact."""
    before, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(before)


def _train(cfg: TrainConfig, steps: int, log: Callable[[str], None] | None) -> TrainResult:
    started = time.perf_counter()
    tokenizer = build_tokenizer(cfg.seed)
    model = build_model(cfg, tokenizer).train()
    # no weight decay on norms (the only 1-d parameters)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.98),
        foreach=False,  # the plain loop: one summation order whatever the parameter count
    )
    losses: list[float] = []
    for step, (ids, labels) in zip(range(steps), batches(cfg, tokenizer)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        loss = reply_loss(model(input_ids=ids).logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if log and (step % cfg.log_every == 0 or step == steps - 1):
            recent = losses[-cfg.log_every :]
            log(
                f"step {step:5d}  loss {losses[-1]:.4f}  mean {sum(recent) / len(recent):.4f}  "
                f"lr {lr_at(cfg, step):.2e}  {time.perf_counter() - started:6.0f}s"
            )
    return TrainResult(model.eval(), tokenizer, losses, time.perf_counter() - started)


# ----------------------------------------------------------------------------- saving
def save(result: TrainResult, cfg: TrainConfig, out_dir: Path) -> dict:
    """Write the model folder and its training_record.json; returns the record."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = result.model, result.tokenizer
    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    model.config.eos_token_id = eos
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=model.config.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _portable_tokenizer_config(out_dir)
    weights = (out_dir / "model.safetensors").read_bytes()
    record = {
        "command": "python -m demo.train",
        "config": dataclasses.asdict(cfg),
        "data_version": data.DATA_VERSION,
        "steps": len(result.losses),
        "first_losses": result.losses[: cfg.first_losses],
        "loss_every": {
            str(s): round(
                sum(result.losses[s : s + cfg.log_every])
                / len(result.losses[s : s + cfg.log_every]),
                5,
            )
            for s in range(0, len(result.losses), cfg.log_every)
        },
        "final_loss": result.losses[-1],
        "final_loss_mean_last_100": sum(result.losses[-100:]) / len(result.losses[-100:]),
        "wall_seconds": round(result.seconds, 1),
        "model_safetensors_sha256": hashlib.sha256(weights).hexdigest(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    (out_dir / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _portable_tokenizer_config(out_dir: Path) -> None:
    """Keep the chat template in tokenizer_config.json and name the class transformers 4 knows.

    transformers 5 writes the template to chat_template.jinja and the class as
    "TokenizersBackend"; older transformers and other tools read neither.
    """
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=f"default {MODEL_DIR} ({DRAFT_DIR} with --draft)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument(
        "--draft", action="store_true",
        help="the demo's draft model instead (DRAFT: 1 layer of half the width, the same data "
        "and tokenizer), for speculative_algorithm='STANDALONE'",
    )  # fmt: skip
    args = parser.parse_args(argv)
    base = DRAFT if args.draft else TrainConfig()
    cfg = dataclasses.replace(base, steps=args.steps, seed=args.seed)
    result = train(cfg)
    out = args.out or (DRAFT_DIR if args.draft else MODEL_DIR)
    record = save(result, cfg, out)
    if args.draft:  # (what the record says, beside the model)
        record["command"] = "python -m demo.train --draft"
        (out / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {out}: final loss {record['final_loss']:.4f} in {record['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
