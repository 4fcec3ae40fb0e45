"""Host arrays to device tensors, and back, without stalling the device queue.

NOTE: a copy from pageable host memory to the GPU first waits for the stream to drain (CUDA's
rule for pageable transfers), which would undo overlap scheduling; from pinned memory it is
queued like a kernel. Every per-step host-to-device copy goes through here.

Pinned buffers are reused in turn (PinnedRing), not allocated per copy: `pin_memory()` cost the
host ~50 us a call on a busy H100 machine (the caching host allocator and its events), several
times the copy itself, and a decode step makes its copies every few milliseconds.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# numpy builds an array from a Python list 3-4x faster than torch.tensor does (per-step columns
# of a few hundred ints cost ~4 us instead of ~14 us); the tensor then shares its memory
_NUMPY_DTYPES = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.uint8: np.uint8,
}


class PinnedRing:
    """Pinned host buffers used in turn for host-to-device copies, each grown to the largest
    copy it has held.

    NOTE: a buffer is handed out again only after the copy that last read it has run: `used()`
    records an event behind that copy, and `take` waits for the event of the buffer it hands
    out (long past, unless the ring is shallower than the copies in flight)."""

    def __init__(self, depth: int) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned tensor of `shape` and `dtype`; call `used()` once its copy is queued."""
        i = self._next
        event = self._events[i]
        if event is not None:
            event.synchronize()
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
            self._buffers[i] = buffer
        return buffer[:nbytes].view(dtype).view(shape)

    def used(self) -> None:
        """The copy from the buffer last taken is queued on the current stream."""
        event = self._events[self._next] or torch.cuda.Event()
        event.record()
        self._events[self._next] = event
        self._next = (self._next + 1) % len(self._buffers)


# NOTE: a prefill step makes a handful of copies through here; a decode step none (its columns
# go through engine/runner/decode_inputs.py, its tokens back through launched_step.HostBuffers)
_TO_DEVICE = PinnedRing(16)


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        # np.array copies (also an ndarray given): the tensor never aliases the caller's array
        return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))
    host = np.asarray(values, dtype=_NUMPY_DTYPES[dtype])
    pinned = _TO_DEVICE.take(host.shape, dtype)
    pinned.numpy()[...] = host
    out = pinned.to(device, non_blocking=True)
    _TO_DEVICE.used()
    return out
