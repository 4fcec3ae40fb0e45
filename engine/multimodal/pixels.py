"""Image patches as they travel: the resized pixels as bytes, normalized where they are used.

The image processor's float32 output (a 448 x 448 image: 1024 patches x 1176 values, 4.8 MB)
is its resized uint8 pixels after two steps that depend only on each byte's value and channel
(rescale by 1/255, then normalize by the channel's mean and std) and a copy of each patch per
temporal slot (an image repeats itself `temporal_patch_size` times). So the caller sends each
patch's bytes once (588 bytes a patch, an eighth) with a [channels, 256] table of what every
byte value becomes, and the scheduler's runner rebuilds the float patches on the device with
one lookup (`patch_pixels`). The table is computed as transformers' numpy path computes each
value (the rescale in float64 then float32, the normalization in float32), so the rebuilt
pixels equal the processor's bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch


def normalization_table(rescale_factor: float, mean: list[float], std: list[float]) -> np.ndarray:
    """float32 [channels, 256]: the processor's value for each byte value of each channel."""
    values = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)
    mean32, std32 = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return ((values[None, :] - mean32[:, None]) / std32[:, None]).astype(np.float32)


def patch_pixels(patches: torch.Tensor, table: torch.Tensor, temporal: int) -> torch.Tensor:
    """uint8 patches [N, C*P*P] -> the processor's float32 pixel_values [N, C*T*P*P]."""
    channels = table.shape[0]
    n = patches.shape[0]
    per_channel = patches.view(n, channels, -1).long()
    rows = torch.arange(channels, device=patches.device)[None, :, None]
    values = table[rows, per_channel]  # [N, C, P*P]
    return values[:, :, None, :].expand(n, channels, temporal, -1).reshape(n, -1)
