"""Where the Qwen2.5-VL vision tower's device time goes (the bench's "vision tower" share):
one forward of a batch of 448x448 images on the 3B model's tower, bf16, random weights.

    python -m bench.profile_vision [--images 64]

Prints the time a forward, its matmul TFLOP/s, and torch.profiler's largest CUDA kernels.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.throughput import CONFIGS
from engine.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_vision")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--size", type=int, default=448)
    args = ap.parse_args(argv)
    config = json.loads((CONFIGS / "qwen2.5-vl-3b.json").read_text())
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        tower = Qwen2_5_VisionTransformer(config["vision_config"]).eval()
        torch.set_default_dtype(torch.float32)
    side = args.size // 14
    grid = torch.tensor([[1, side, side]] * args.images)
    pixels = torch.randn(args.images * side * side, 3 * 2 * 14 * 14, device="cuda")
    params = sum(p.numel() for p in tower.parameters())
    flops = (
        2 * params * pixels.shape[0]
    )  # (the merger runs on a quarter of the rows: an upper bound)
    with torch.inference_mode():
        for _ in range(2):
            tower(pixels, grid)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            tower(pixels, grid)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 3e3
        print(
            f"{args.images} images of {args.size}^2: {seconds * 1e3:.1f} ms a forward, "
            f"{seconds / args.images * 1e3:.2f} ms an image, <= {flops / seconds / 1e12:.0f} TFLOP/s"
        )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tower(pixels, grid)
            torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
    )


if __name__ == "__main__":
    main()
