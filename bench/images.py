"""Image-captioning throughput on a vision-language model, with the time split between the
vision tower and the rest (prefill and decode of the language model):

    python -m bench.images --model-config qwen2.5-vl-3b --num-images 1000 --image-size 448 --output-len 64
    python -m bench.images --model /models/Qwen2.5-VL-3B-Instruct --num-images 200

Each request is one image in Qwen's chat format with a short instruction after it, greedy
`--output-len` tokens (ignore_eos). The images are random pictures made here, all different,
so the prefix cache holds only the chat header before each image. With `--model-config` the
weights are random (load_format="dummy") and the folder gets Qwen2-VL's image processor
settings. The caller's share (decoding and preprocessing the images, in the caller's process,
before any request is sent) is timed apart on the same images.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.throughput import dummy_folder, print_table
from engine.model_config import ModelConfig

# Qwen2-VL's image processor as published (preprocessor_config.json of the Qwen2.5-VL folders)
_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136, "max_pixels": 12845056,
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
}  # fmt: skip
# <|im_start|>user\n ... : the chat template's tokens around one image (Qwen2 vocabulary)
_IM_START, _IM_END, _NEWLINE = 151644, 151645, 198
_INSTRUCTION = [74785, 419, 2168, 13]  # "Describe this image." (any ids serve dummy weights)


def pictures(count: int, size: int, seed: int) -> list:
    """`count` distinct size x size RGB pictures: smooth colour fields with noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    grid = np.linspace(0, 1, size, dtype=np.float32)
    out = []
    for _ in range(count):
        base = rng.random(3) * 255
        tilt = (rng.random((2, 3)) - 0.5) * 200
        field = base + grid[:, None, None] * tilt[0] + grid[None, :, None] * tilt[1]
        field += rng.normal(0, 12, (size, size, 3))
        out.append(Image.fromarray(field.clip(0, 255).astype(np.uint8)))
    return out


def prompt(config: ModelConfig) -> list[int]:
    """One image between a user turn's header and its instruction, then the assistant's
    header (Qwen2's ids; below the vision tokens of a smaller test vocabulary)."""
    user = [_IM_START, 872, _NEWLINE]  # "user"
    tail = [_IM_END, _NEWLINE, _IM_START, 77091, _NEWLINE]  # "assistant"
    text = [t % config.vision_start_token_id for t in user + _INSTRUCTION + tail]
    end = int(config.hf["vision_end_token_id"])
    image = [config.vision_start_token_id, config.image_token_id, end]
    return text[:3] + image + text[3:]


def run(model_path: str, images: list, ids: list[int], output_len: int, engine_args: dict) -> dict:
    from engine import Engine

    t0 = time.perf_counter()
    engine = Engine(model_path=model_path, skip_tokenizer_init=True, **engine_args)
    startup = time.perf_counter() - t0
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    try:
        engine.generate(input_ids=[ids] * 2, image_data=images[:2], sampling_params=params)
        engine.flush_cache()
        before = engine.get_server_info()["internal_states"][0]
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=[ids] * len(images), image_data=images, sampling_params=params)  # fmt: skip
        wall = time.perf_counter() - t0
        after = engine.get_server_info()["internal_states"][0]
    finally:
        engine.shutdown()
    return {
        "wall": wall,
        "startup": startup,
        "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "prompt_tokens": outs[0]["meta_info"]["prompt_tokens"],
        "vision_seconds": after["vision_seconds"] - before["vision_seconds"],
        "images_encoded": after["images_encoded"] - before["images_encoded"],
        "steps": (after["prefill_steps"] - before["prefill_steps"],
                  after["decode_steps"] - before["decode_steps"]),
    }  # fmt: skip


def caller_seconds(config: ModelConfig, images: list) -> float:
    """What the caller's process spends on the images before it sends them (decoding is none
    here: they are PIL images already): preprocessing and hashing, on the engine's threads."""
    from engine.frontend.image_inputs import ImageInputsBuilder

    builder = ImageInputsBuilder(config)
    builder.prepare(images[:1], 1, True)  # (loads the processor)
    t0 = time.perf_counter()
    builder.prepare(images, len(images), True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(
        prog="python -m bench.images", description=__doc__.split("\n\n")[0]
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Qwen2.5-VL model folder")
    src.add_argument("--model-config", help="a shipped vision-language config, dummy weights")
    ap.add_argument("--num-images", type=int, default=1000)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--engine-args", default="{}", help="JSON of extra Engine arguments")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    model_path = args.model or dummy_folder(args.model_config)
    if args.model_config:
        (Path(model_path) / "preprocessor_config.json").write_text(json.dumps(_PROCESSOR))
    engine_args = {"load_format": "auto" if args.model else "dummy", **json.loads(args.engine_args)}
    config = ModelConfig.from_folder(model_path, engine_args.get("dtype", "auto"))
    images = pictures(args.num_images, args.image_size, args.seed)
    result = run(model_path, images, prompt(config), args.output_len, engine_args)
    preprocess = caller_seconds(config, images)
    wall, vision = result["wall"], result["vision_seconds"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = [
        ("device", device),
        ("model", f"{args.model_config or args.model} ({config.dtype_name})"),
        ("images", f"{args.num_images} of {args.image_size}x{args.image_size}, "
                   f"{result['prompt_tokens']} prompt tokens each"),
        ("output tokens", f"{result['output_tokens']} ({args.output_len} each)"),
        ("engine start-up (s)", f"{result['startup']:.1f}"),
        ("wall time (s)", f"{wall:.2f}"),
        ("images/s | output tok/s", f"{args.num_images / wall:.1f} | {result['output_tokens'] / wall:.0f}"),
        ("caller: image preprocessing, timed apart (s)", f"{preprocess:.2f} (in the wall)"),
        ("vision tower on the device (s) | images", f"{vision:.2f} | {result['images_encoded']}"),
        ("the rest of the wall: prefill, decode, host (s)", f"{wall - vision:.2f}"),
        ("steps: prefill | decode", "{} | {}".format(*result["steps"])),
    ]  # fmt: skip
    print_table(rows, args.json)


if __name__ == "__main__":
    main()
