"""Host lists to device tensors without stalling the device queue.

NOTE: a copy from pageable host memory to the GPU first waits for the stream to drain (CUDA's
rule for pageable transfers), which would undo overlap scheduling; from pinned memory it is
queued like a kernel. Every per-step host-to-device copy goes through here.
"""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
