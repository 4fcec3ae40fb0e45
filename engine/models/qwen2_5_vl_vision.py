"""Qwen2.5-VL vision tower: a ViT with 2-D rotary and window attention, then a 2x2 patch merger.

Data flow for a call with several images (or video clips) packed together:

  pixel_values [N, C*T*P*P]   the image processor's patches: image after image, frame after
                              frame, merge blocks (m x m patches, m = spatial_merge_size) in
                              row-major order over the merged grid, the m*m patches of a block
                              row-major inside it
  -> patch embedding [N, D]   the Conv3d has kernel == stride, so it is one matmul per patch
  -> window order             merge blocks regrouped so that every window (a square of
                              window_size // patch_size // m blocks a side, cut per frame from
                              the top-left, ragged at the right and bottom edges) is contiguous
  -> depth blocks             pre-RMSNorm attention + SwiGLU MLP; attention runs inside each
                              window, or inside each frame in the `fullatt_block_indexes` blocks
  -> merger [N / m^2, out]    RMSNorm, the m*m patches of a block concatenated, a GELU MLP
  -> original order           merged tokens put back in row-major merged-grid order, the order
                              of the language model's image placeholder tokens

Why the permutation instead of masking: once the windows are contiguous, window attention and
full attention are both attention over contiguous segments of one packed sequence, so no mask
and no padding are ever materialised. A window holds whole merge blocks, so the merger still
finds each block's m*m patches side by side, and the permutation is undone only once, on the
m^2-times smaller merged output. Each patch's rotary position is its (row, col) in its image,
which the permutation does not change; it is computed directly in window order.

Everything that depends only on grid_thw (window order, segments, rotary positions) is planned
on the host once per forward with numpy, O(num_patches), and shared by all blocks. Parameter
names follow the Hugging Face checkpoints (after their `visual.` / `model.visual.` prefix), so
loading is a copy by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.norm import RMSNorm
from kernels.dispatch import use_triton

_MLP_ALIGN = 64  # the MLP's intermediate size is padded to a multiple of this (_VisionMLP)
_BLOCK_MLP = re.compile(r"blocks\.\d+\.mlp\.")
# transformers' Qwen2_5_VLVisionConfig defaults, for keys a config.json leaves out
_DEFAULTS: dict[str, object] = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": (7, 15, 23, 31),
}
_ROPE_THETA = 10000.0
_NORM_EPS = 1e-6  # hard-coded in transformers for every norm of the tower

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


# ---------------------------------------------------------------------------- host-side plan
@dataclass(frozen=True)
class _Plan:
    """What one forward needs from grid_thw, on the compute device."""

    order: torch.Tensor  # [N] patch rows of the input, in window order
    restore: torch.Tensor  # [N / m^2] merged rows in window order, for each original token
    patch_rc: torch.Tensor  # [N, 2] (row, col) of each window-ordered patch in its image
    window_groups: list[torch.Tensor]  # per segment length L: [segments, L] token rows
    frame_groups: list[torch.Tensor]


def _window_tiles(frames: int, rows: int, cols: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """One image's merge blocks (ids t*rows*cols + r*cols + c) in window order, and the
    number of blocks in each window. Windows tile each frame from the top-left; those on the
    right and bottom edges are cut short, never shifted, as in transformers."""
    tiles_r, tiles_c = -(-rows // side), -(-cols // side)
    padded = np.full((frames, tiles_r * side, tiles_c * side), -1, dtype=np.int64)
    padded[:, :rows, :cols] = np.arange(frames * rows * cols).reshape(frames, rows, cols)
    windows = padded.reshape(frames, tiles_r, side, tiles_c, side).transpose(0, 1, 3, 2, 4)
    windows = windows.reshape(-1, side * side)
    valid = windows >= 0
    return windows[valid], valid.sum(axis=1)


def _segment_groups(lengths: np.ndarray) -> list[np.ndarray]:
    """Contiguous segments of the given lengths, batched by length: one [count, L] array of
    token rows per distinct L, so attention is a handful of batched calls, not one per window."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return [starts[lengths == n][:, None] + np.arange(n) for n in np.unique(lengths)]


def _plan(
    grid_thw: list[tuple[int, int, int]], merge: int, side: int, device: torch.device
) -> _Plan:
    unit = merge * merge
    blocks, block_rc, window_lens, frame_lens = [], [], [], []
    offset = 0
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        ids, counts = _window_tiles(t, rows, cols, side)
        in_frame = ids % (rows * cols)
        blocks.append(ids + offset)
        block_rc.append(np.stack((in_frame // cols, in_frame % cols), axis=1))
        window_lens.append(counts * unit)
        frame_lens.append(np.full(t, h * w))
        offset += t * rows * cols

    window_order = np.concatenate(blocks)
    # the patches of a block are consecutive rows of the input: block b holds rows b*m^2 ...
    order = (window_order[:, None] * unit + np.arange(unit)).reshape(-1)
    restore = np.empty_like(window_order)
    restore[window_order] = np.arange(len(window_order))

    within = np.arange(unit)
    offsets = np.stack((within // merge, within % merge), axis=1)  # (row, col) inside a block
    patch_rc = (np.concatenate(block_rc)[:, None, :] * merge + offsets).reshape(-1, 2)

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return _Plan(
        order=to_device(order),
        restore=to_device(restore),
        patch_rc=to_device(patch_rc),
        window_groups=[to_device(g) for g in _segment_groups(np.concatenate(window_lens))],
        frame_groups=[to_device(g) for g in _segment_groups(np.concatenate(frame_lens))],
    )


# ---------------------------------------------------------------------------- rotary
def _axial_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # each of the two axes gets a quarter of the head's frequencies (half of its rotary pairs);
    # computed on the CPU in float32 exactly as transformers does
    axis_dim = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32) / axis_dim))


def _rotary_cos_sin(
    patch_rc: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, head_dim / 2] float32 cos and sin, [row freqs | col freqs]: frequency i turns dims
    i and i + head_dim/2 together (rotate-half convention)."""
    angles = (patch_rc.float()[:, :, None] * inv_freq.to(patch_rc.device)).flatten(1)
    return angles.cos(), angles.sin()


def _rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [N, heads, head_dim] rotated in float32 with float32 tables (as transformers), back
    in their dtype; on the GPU one kernel for both (the engine's rotary, unrounded tables)."""
    if use_triton(q):
        from kernels.rotary import apply_rotary

        rows = torch.arange(q.shape[0], device=q.device)
        return apply_rotary(q, k, rows, cos, sin, round_tables=False)
    cos2, sin2 = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]

    def one(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        first, second = x32.chunk(2, dim=-1)
        return (x32 * cos2 + torch.cat((-second, first), dim=-1) * sin2).to(x.dtype)

    return one(q), one(k)


# ---------------------------------------------------------------------------- attention
def _segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor]
) -> torch.Tensor:
    """q, k, v [N, heads, head_dim]; every token attends to the tokens of its own segment."""
    out = torch.empty_like(q)
    for rows in groups:  # rows [segments, L]
        qs, ks, vs = (x[rows].transpose(1, 2) for x in (q, k, v))  # [segments, heads, L, d]
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class _VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: list[torch.Tensor],
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, k, cos, sin)
        return self.proj(_segment_attention(q, k, v, groups).reshape(n, -1))


class _VisionMLP(nn.Module):
    """SwiGLU with biases. NOTE: the intermediate size is padded to a multiple of 64 with zero
    rows of gate/up and zero columns of down (silu(0) * 0 adds nothing): Qwen2.5-VL's 3420 is
    no multiple of 8, and cuBLAS then falls back to Ampere kernels that took half the tower's
    time on an H100 (load_weights fills the leading part)."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"vision hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
            )
        self.act = _ACTIVATIONS[act]
        padded = -(-intermediate // _MLP_ALIGN) * _MLP_ALIGN
        self.gate_proj = nn.Linear(hidden, padded)
        self.up_proj = nn.Linear(hidden, padded)
        self.down_proj = nn.Linear(padded, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _VisionBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden, _NORM_EPS)
        self.norm2 = RMSNorm(hidden, _NORM_EPS)
        self.attn = _VisionAttention(hidden, num_heads)
        self.mlp = _VisionMLP(hidden, intermediate, act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


# ---------------------------------------------------------------------------- embed, merger
class _Conv3dKernel(nn.Module):
    """Holds the Conv3d weight [hidden, C, T, P, P] under the checkpoint's name `proj.weight`."""

    def __init__(self, hidden: int, channels: int, frames: int, patch: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, channels, frames, patch, patch))
        nn.init.normal_(self.weight, std=0.02)


class _PatchEmbed(nn.Module):
    def __init__(self, hidden: int, channels: int, frames: int, patch: int) -> None:
        super().__init__()
        self.proj = _Conv3dKernel(hidden, channels, frames, patch)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # kernel == stride: each output is the dot product of one whole patch with the kernel,
        # and the processor flattens patches in the kernel's (C, T, P, P) order
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.flatten(1))


class _PatchMerger(nn.Module):
    def __init__(self, hidden: int, out_hidden: int, merge: int) -> None:
        super().__init__()
        self.merged = hidden * merge * merge
        self.ln_q = RMSNorm(hidden, _NORM_EPS)
        # a Sequential so the checkpoint's names mlp.0 / mlp.2 fit as they are
        self.mlp = nn.Sequential(
            nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], each merge block's patches consecutive -> [N / m^2, out_hidden]."""
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


# ---------------------------------------------------------------------------- the tower
class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, vision_config: dict) -> None:
        super().__init__()
        cfg = {**_DEFAULTS, **vision_config}
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_heads"])
        self.patch_size = int(cfg["patch_size"])
        self.merge = int(cfg["spatial_merge_size"])
        self.window_side = int(cfg["window_size"]) // self.merge // self.patch_size
        if self.window_side < 1:
            raise ValueError(
                f"window_size {cfg['window_size']} is smaller than one merge block "
                f"({self.merge} x {self.patch_size} pixels)"
            )
        self.fullatt_blocks = frozenset(int(i) for i in cfg["fullatt_block_indexes"])
        rope = cfg.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", _ROPE_THETA)))
        # a plain attribute, not a buffer: module.to(bfloat16) must not round the frequencies
        self._inv_freq = _axial_inv_freq(hidden // heads, theta)

        self.patch_embed = _PatchEmbed(
            hidden, int(cfg["in_channels"]), int(cfg["temporal_patch_size"]), self.patch_size
        )
        self.blocks = nn.ModuleList(
            _VisionBlock(hidden, heads, int(cfg["intermediate_size"]), str(cfg["hidden_act"]))
            for _ in range(int(cfg["depth"]))
        )
        self.merger = _PatchMerger(hidden, int(cfg["out_hidden_size"]), self.merge)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*T*P*P], grid_thw [images, 3] (t, h, w in patches) -> merged
        tokens [N / m^2, out_hidden_size], image after image, each in row-major merged order."""
        grid = self._check_grid(grid_thw, pixel_values.shape[0])
        plan = _plan(grid, self.merge, self.window_side, pixel_values.device)
        cos, sin = _rotary_cos_sin(plan.patch_rc, self._inv_freq)

        x = self.patch_embed(pixel_values[plan.order])
        for i, block in enumerate(self.blocks):
            groups = plan.frame_groups if i in self.fullatt_blocks else plan.window_groups
            x = block(x, cos, sin, groups)
        return self.merger(x)[plan.restore]

    def _check_grid(self, grid_thw: torch.Tensor, num_patches: int) -> list[tuple[int, int, int]]:
        grid = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        for t, h, w in grid:
            if min(t, h, w) < 1 or h % self.merge or w % self.merge:
                raise ValueError(
                    f"grid_thw ({t}, {h}, {w}): h and w must be positive multiples of "
                    f"spatial_merge_size {self.merge}"
                )
        expected = sum(t * h * w for t, h, w in grid)
        if expected != num_patches:
            raise ValueError(
                f"grid_thw describes {expected} patches, pixel_values has {num_patches}"
            )
        return grid

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (names without the `visual.` / `model.visual.` prefix) into
        the parameters of the same name, cast to the parameter's dtype. Returns the names
        loaded; the caller compares them with `named_parameters()` to find missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the vision tower")
            target = _unpadded(param, tensor.shape) if _BLOCK_MLP.match(name) else param
            if target is None or target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r}: the checkpoint has {tuple(tensor.shape)}, "
                    f"the vision tower expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.zero_()  # (an MLP's padding stays zero)
                target.copy_(tensor.to(param.dtype))
            loaded.add(name)
        return loaded


def _unpadded(param: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """The part of a block MLP's parameter that holds a checkpoint tensor of `shape` (the rest
    is _VisionMLP's alignment padding), or None if `shape` is not what it pads."""
    padded = tuple(-(-n // _MLP_ALIGN) * _MLP_ALIGN for n in shape)
    if len(shape) != param.dim() or any(
        p not in (n, m) for n, m, p in zip(shape, padded, param.shape)
    ):
        return None
    return param[tuple(slice(0, n) for n in shape)]
