"""Train gristmill's demo vision-language model from scratch on CPU and save it as a Hugging Face
folder: a tiny Qwen2.5-VL that names the colour of the shape in demo/shapes.py's pictures.

    python -m demo.train_vision                 # writes demo/vision_model/: ~1 min on one thread
    python -m demo.train_vision --out /tmp/v --steps 100

The model answers one chat prompt, the picture first in the user message (the engine's and the
flows' image slot `<|vision_start|><|image_pad|><|vision_end|>`, then the question):
"What colour is the shape? Answer red, green, blue or yellow." -> "red" (or green, blue, yellow).
It does not know the shape: a second question, "What shape is it? Answer circle, square or
triangle.", stayed near chance at this size (demo/README.md has the numbers).

The tokenizer is the demo model's (demo/model/tokenizer.json) with Qwen's three vision tokens
added, so prompts read as the demo's ChatML; the decoder and the vision tower are Qwen2.5-VL's,
small (see VisionTrainConfig). Everything is seeded and runs with deterministic algorithms on one
thread, as demo/train.py does, so a rerun on the same kind of CPU reproduces the weights;
``training_record.json`` keeps the settings, the losses of the first steps (which
tests/flows/test_demo_vision.py recomputes), the loss curve and the held-out accuracy of
transformers' greedy answers on demo/inputs/shapes.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import platform
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
import transformers
from PIL import Image
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from demo import data, shapes
from demo.tokenizer import ENDOFTEXT, IM_END
from demo.train import (
    IGNORE,
    MODEL_DIR,
    _portable_tokenizer_config,
    _print,
    _round_up,
    deterministic_torch,
    lr_at,
    reply_loss,
)

VISION_MODEL_DIR = Path(__file__).resolve().parent / "vision_model"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# never in a prompt (the model takes no videos), but Qwen2.5-VL's config needs a video token id
VIDEO_PAD = "<|video_pad|>"
# one image's slot in a prompt, as image_placeholder (flows/inputs/image_column.py) reads it
# from the folder
IMAGE_SLOT = VISION_START + IMAGE_PAD + VISION_END
COLOUR_QUESTION = "What colour is the shape? Answer red, green, blue or yellow."


@dataclass(frozen=True)
class VisionTrainConfig:
    seed: int = 0
    steps: int = 400
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    system_prompt_fraction: float = 0.2  # as demo/train.py: data.SYSTEM_PROMPT first
    threads: int = 1  # as demo/train.py: float sums may depend on the thread count
    # the decoder (Qwen2, tied embeddings, M-RoPE)
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4  # head_dim 32: 16 rotary frequencies
    num_key_value_heads: int = 2
    # of the 16 rotary frequencies, how many follow the (temporal, height, width) positions:
    # Qwen2.5-VL's proportions (16, 24, 24 of 64)
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    max_position_embeddings: int = 256
    # the vision tower: 14-pixel patches, 2 x 2 merged into one token of the decoder's width
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_num_heads: int = 2
    window_size: int = 56  # window attention over 2 x 2 merge blocks in block 0, full in block 1
    # what the record keeps
    log_every: int = 25
    first_losses: int = 20


@dataclass
class VisionTrainResult:
    model: Qwen2_5_VLForConditionalGeneration
    tokenizer: PreTrainedTokenizerFast
    processor: Qwen2VLImageProcessorPil
    losses: list[float]
    seconds: float


# ----------------------------------------------------------------------------- the parts
def build_tokenizer(base_dir: Path = MODEL_DIR) -> PreTrainedTokenizerFast:
    """The demo model's tokenizer and ChatML template, with Qwen's vision tokens (ids 886-889).

    Added as special tokens, so that text holding them encodes each as one id and replies
    decode without them."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]}
    )
    return tokenizer


def build_processor() -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor with bounds that keep demo/shapes.py's pictures as they are
    (56 x 56: 16 patches, 4 image tokens)."""
    return Qwen2VLImageProcessorPil(min_pixels=shapes.MIN_PIXELS, max_pixels=shapes.MAX_PIXELS)


def build_model(
    cfg: VisionTrainConfig, tokenizer: PreTrainedTokenizerFast
) -> Qwen2_5_VLForConditionalGeneration:
    token = tokenizer.convert_tokens_to_ids
    ends = {"bos_token_id": None, "eos_token_id": token(IM_END), "pad_token_id": token(ENDOFTEXT)}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=_round_up(len(tokenizer), 64),
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": list(cfg.mrope_section),
            },
            tie_word_embeddings=True,
            **ends,
        ),
        vision_config=dict(
            depth=cfg.vision_depth,
            hidden_size=cfg.vision_hidden_size,
            intermediate_size=cfg.vision_intermediate_size,
            num_heads=cfg.vision_num_heads,
            out_hidden_size=cfg.hidden_size,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=cfg.window_size,
            fullatt_block_indexes=[cfg.vision_depth - 1],
        ),
        image_token_id=token(IMAGE_PAD),
        vision_start_token_id=token(VISION_START),
        vision_end_token_id=token(VISION_END),
        video_token_id=token(VIDEO_PAD),
        tie_word_embeddings=True,
        **ends,
    )
    torch.manual_seed(cfg.seed)
    return Qwen2_5_VLForConditionalGeneration(config)


# ----------------------------------------------------------------------------- data
def user_message(question: str) -> str:
    """The picture first, then the question: what the flows render for `{{ image }}question`."""
    return IMAGE_SLOT + question


def conversation(picture: shapes.Picture, system: bool) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": data.SYSTEM_PROMPT}] if system else []
    return [
        *messages,
        {"role": "user", "content": user_message(COLOUR_QUESTION)},
        {"role": "assistant", "content": picture.colour},
    ]


def encode_conversation(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, str]], image_tokens: int
) -> tuple[list[int], list[int]]:
    """Ids of the whole conversation, its one image slot widened to ``image_tokens`` pads, and
    labels that keep only the assistant's reply and its <|im_end|>.

    The prompt is tokenized as the engine tokenizes it (the chat template with
    add_generation_prompt, then ``encode``) and must be a prefix of the conversation's ids."""
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True
    )
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt_ids, ids = tokenizer.encode(prompt), tokenizer.encode(full)
    if ids[: len(prompt_ids)] != prompt_ids:
        raise AssertionError(
            f"the prompt's tokens are not a prefix of the conversation's: {full!r}"
        )
    reply_end = len(ids) - 1  # the "\n" after <|im_end|> is the template's, not the model's
    labels = [IGNORE] * len(prompt_ids) + ids[len(prompt_ids) : reply_end] + [IGNORE]
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    widen = [image_tokens if t == pad else 1 for t in ids]
    return _widen(ids, widen), _widen(labels, widen)


def _widen(values: list[int], counts: list[int]) -> list[int]:
    return [v for v, n in zip(values, counts) for _ in range(n)]


def image_inputs(
    processor: Qwen2VLImageProcessorPil, images: list[Image.Image]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """pixel_values, image_grid_thw and the number of image tokens of each image (t*h*w/4)."""
    out = processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    merge = processor.merge_size**2
    return out["pixel_values"], grid, (grid.prod(-1) // merge).tolist()


def batches(
    cfg: VisionTrainConfig,
    tokenizer: PreTrainedTokenizerFast,
    processor: Qwen2VLImageProcessorPil,
) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches of the training split, in a fixed order: the model's forward
    arguments and `labels`. Right padding needs no attention mask (causal attention)."""
    pictures = shapes.stream(cfg.seed, held_out=False)
    rng = random.Random(f"vision/{cfg.seed}")
    pad = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    while True:
        batch = list(islice(pictures, cfg.batch_size))
        pixels, grid, counts = image_inputs(processor, [p.render() for p in batch])
        rows = []
        for picture, count in zip(batch, counts):
            system = rng.random() < cfg.system_prompt_fraction
            rows.append(encode_conversation(tokenizer, conversation(picture, system), count))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(rows):
            ids[i, : len(row_ids)] = torch.tensor(row_ids)
            labels[i, : len(row_labels)] = torch.tensor(row_labels)
        yield {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "labels": labels}


def forward_logits(
    model: Qwen2_5_VLForConditionalGeneration,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
) -> torch.Tensor:
    """The model's logits with M-RoPE positions.

    NOTE: transformers 5 computes M-RoPE's positions only when given mm_token_type_ids (1 at
    image tokens); without them every token silently gets plain 1-D positions, which the
    engine (and Qwen2.5-VL) do not use."""
    types = (input_ids == model.config.image_token_id).int()
    return model(
        input_ids=input_ids,
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        mm_token_type_ids=types,
    ).logits


# ----------------------------------------------------------------------------- training
def train(
    cfg: VisionTrainConfig,
    max_steps: int | None = None,
    log: Callable[[str], None] | None = _print,
) -> VisionTrainResult:
    """Train from scratch; ``max_steps`` stops early on the same schedule (the reproducibility test)."""
    with deterministic_torch(cfg.threads):
        return _train(cfg, cfg.steps if max_steps is None else max_steps, log)


def _train(
    cfg: VisionTrainConfig, steps: int, log: Callable[[str], None] | None
) -> VisionTrainResult:
    started = time.perf_counter()
    tokenizer, processor = build_tokenizer(), build_processor()
    model = build_model(cfg, tokenizer).train()
    # no weight decay on norms and biases (the 1-d parameters)
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
    for step, batch in zip(range(steps), batches(cfg, tokenizer, processor)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        labels = batch.pop("labels")
        loss = reply_loss(forward_logits(model, **batch), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if log and (step % cfg.log_every == 0 or step == steps - 1):
            recent = losses[-cfg.log_every :]
            log(
                f"step {step:4d}  loss {losses[-1]:.4f}  mean {sum(recent) / len(recent):.4f}  "
                f"lr {lr_at(cfg, step):.2e}  {time.perf_counter() - started:5.0f}s"
            )
    return VisionTrainResult(
        model.eval(), tokenizer, processor, losses, time.perf_counter() - started
    )


# ----------------------------------------------------------------------------- held-out accuracy
def greedy_reply(
    result: VisionTrainResult, image: Image.Image, question: str = COLOUR_QUESTION, max_new: int = 8
) -> str:
    """transformers' greedy reply to the chat prompt the demo config renders (no system
    message), a full forward per token: no KV cache, so no rope-delta bookkeeping to trust."""
    tokenizer, model = result.tokenizer, result.model
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message(question)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    pixels, grid, counts = image_inputs(result.processor, [image])
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    ids = tokenizer.encode(prompt)
    ids = _widen(ids, [counts[0] if t == pad else 1 for t in ids])
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = forward_logits(model, torch.tensor([ids + new]), pixels, grid)
            new.append(int(logits[0, -1].argmax()))
            if new[-1] == tokenizer.convert_tokens_to_ids(IM_END):
                break
    return tokenizer.decode(new, skip_special_tokens=True)


def held_out_accuracy(result: VisionTrainResult) -> dict[str, str]:
    """Greedy colour accuracy on the held-out pictures of demo/inputs/shapes.jsonl."""
    from demo.make_vision_inputs import shape_pictures

    pictures = shape_pictures()
    right = sum(greedy_reply(result, p.render()).strip() == p.colour for p in pictures)
    return {"colour": f"{right}/{len(pictures)}"}


# ----------------------------------------------------------------------------- saving
def save(result: VisionTrainResult, cfg: VisionTrainConfig, out_dir: Path, accuracy: dict) -> dict:
    """Write the model folder (weights, tokenizer, image processor) and training_record.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = result.model, result.tokenizer
    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    model.config.eos_token_id = model.config.text_config.eos_token_id = eos
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=model.config.text_config.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _portable_tokenizer_config(out_dir)
    _drop_loading_keys(out_dir)
    result.processor.save_pretrained(out_dir)
    weights = (out_dir / "model.safetensors").read_bytes()
    steps = len(result.losses)
    record = {
        "command": "python -m demo.train_vision",
        "config": dataclasses.asdict(cfg),
        "shapes_version": shapes.SHAPES_VERSION,
        "base_tokenizer_sha256": hashlib.sha256(
            (MODEL_DIR / "tokenizer.json").read_bytes()
        ).hexdigest(),
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
        "model_safetensors_sha256": hashlib.sha256(weights).hexdigest(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    (out_dir / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _drop_loading_keys(out_dir: Path) -> None:
    """tokenizer_config.json without the keys of how the base tokenizer was loaded (is_local,
    local_files_only), which transformers 5 writes back: they describe this machine's load,
    not the tokenizer, and demo/model's file has none."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=VISION_MODEL_DIR)
    parser.add_argument("--steps", type=int, default=VisionTrainConfig.steps)
    parser.add_argument("--seed", type=int, default=VisionTrainConfig.seed)
    args = parser.parse_args(argv)
    cfg = VisionTrainConfig(steps=args.steps, seed=args.seed)
    result = train(cfg)
    started = time.perf_counter()
    accuracy = held_out_accuracy(result)
    _print(f"held-out accuracy {json.dumps(accuracy)} ({time.perf_counter() - started:.0f}s)")
    record = save(result, cfg, args.out, accuracy)
    print(
        f"saved {args.out}: final loss {record['final_loss']:.4f} in {record['wall_seconds']:.0f}s"
    )


if __name__ == "__main__":
    main()
