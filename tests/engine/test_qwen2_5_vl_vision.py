"""The Qwen2.5-VL vision tower against transformers' on a tiny random config (float32, CPU).

The window is 2x2 merge blocks (window_size 56 / patch 14 / merge 2), so the grids below are
split into several windows, some cut short at the right or bottom edge; blocks 1 and 3 attend
over whole frames, blocks 0 and 2 within windows only.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)

from engine.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer

VISION_CONFIG = dict(
    depth=4,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1, 3],
    out_hidden_size=48,
    in_channels=3,
    hidden_act="silu",
)
PATCH_DIM = 3 * 2 * 14 * 14


@pytest.fixture(scope="module")
def towers() -> tuple[torch.nn.Module, Qwen2_5_VisionTransformer]:
    """transformers' tower with random non-trivial weights, and ours loaded from its state."""
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION_CONFIG)
    reference = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        config.vision_config, torch_dtype=torch.float32
    ).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight"))
            param.copy_(1 + 0.1 * noise if is_norm else 0.05 * noise)

    ours = Qwen2_5_VisionTransformer(VISION_CONFIG).eval()
    loaded = ours.load_weights(reference.state_dict().items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    return reference, ours


def _compare(towers, grids: list[tuple[int, int, int]], seed: int) -> None:
    reference, ours = towers
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    num_patches = int(grid_thw.prod(dim=1).sum())
    pixels = torch.randn(num_patches, PATCH_DIM, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = reference(pixels, grid_thw).pooler_output
        got = ours(pixels, grid_thw)
    assert got.shape == (num_patches // 4, VISION_CONFIG["out_hidden_size"])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_one_image(towers) -> None:
    _compare(towers, [(1, 8, 12)], seed=1)  # 4 x 6 merged: 2 x 3 whole windows


def test_images_with_ragged_windows(towers) -> None:
    # 3 x 5 merged (edge windows cut on both axes), 7 x 2 (cut at the bottom), a single block
    _compare(towers, [(1, 6, 10), (1, 14, 4), (1, 2, 2)], seed=2)


def test_video_frames_attend_separately(towers) -> None:
    # full-attention blocks attend within each frame of a clip, windows are cut per frame
    _compare(towers, [(2, 6, 8), (1, 4, 4), (3, 2, 6)], seed=3)


def test_load_weights_rejects_unknown_and_misshapen() -> None:
    fresh = Qwen2_5_VisionTransformer(VISION_CONFIG)
    with pytest.raises(ValueError, match=r"blocks\.9\.attn\.qkv\.weight"):
        fresh.load_weights([("blocks.9.attn.qkv.weight", torch.zeros(192, 64))])
    with pytest.raises(ValueError, match=r"merger\.mlp\.0\.weight"):
        fresh.load_weights([("merger.mlp.0.weight", torch.zeros(256, 255))])
    with pytest.raises(ValueError, match=r"visual\.merger\.ln_q\.weight"):
        fresh.load_weights([("visual.merger.ln_q.weight", torch.ones(64))])  # prefix not stripped


def test_grid_must_match_pixels(towers) -> None:
    _, ours = towers
    with pytest.raises(ValueError, match="patches"):
        ours(torch.zeros(15, PATCH_DIM), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="multiples"):
        ours(torch.zeros(12, PATCH_DIM), torch.tensor([[1, 3, 4]]))


def test_bfloat16_follows_float32(towers) -> None:
    """Cast to bfloat16 (the rotary stays float32), the tower still tracks the float32 one."""
    reference, ours = towers
    half = Qwen2_5_VisionTransformer(VISION_CONFIG)
    half.load_weights(reference.state_dict().items())
    half = half.to(torch.bfloat16).eval()
    grid_thw = torch.tensor([(1, 6, 10), (1, 2, 2)])
    pixels = torch.randn(64, PATCH_DIM, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = half(pixels, grid_thw)
        expected = ours(pixels, grid_thw)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.05)


@pytest.mark.gpu
def test_gpu_tower_equals_transformers(towers) -> None:
    """On CUDA (float32): the rotary kernel with float32 tables and the padded MLP's GEMMs."""
    reference, ours = towers
    grid_thw = torch.tensor([(1, 8, 12), (1, 6, 10)])
    pixels = torch.randn(156, PATCH_DIM, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(pixels, grid_thw).pooler_output
        got = copy.deepcopy(ours).cuda()(pixels.cuda(), grid_thw).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
