"""The runner's half of image_data: a vision-language model's prefill inputs beyond the tokens.

For each prefill step on such a model, `ImageEmbedder.image_batch` builds the ImageBatch the
model reads (engine/batch/forward_batch.py):

* every new token's three M-RoPE positions: a prompt token's come with its request
  (ImageInputs.rope_positions, computed by the caller); a token past the prompt (a request
  prefilled again after retraction) and every token of a text-only request sits at
  ``index + delta`` on all three axes (delta 0 without images);
* which of the step's token rows are image tokens, and their embeddings.

When a step first needs image tokens of a request, all of that request's images are encoded
(the vision tower attends within whole images), together with those of the step's other such
requests in one call. The embeddings stay with the request while its prompt is prefilled chunk
by chunk and are dropped once a step has passed its last image token; image tokens that the
prefix cache already holds (the same image before the same text) need none at all.

NOTE: host work per step is O(requests + image tokens of the step): a request's image tokens
are found by bisecting its sorted token positions, never by scanning its prompt.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.batch.forward_batch import ImageBatch
from engine.multimodal.pixels import patch_pixels
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.batch.req import Req
    from engine.batch.scheduled_batch import ScheduledBatch


class ImageEmbedder:
    def __init__(self, model: torch.nn.Module, hidden_size: int, device: torch.device) -> None:
        self.model = model  # a vision-language model: encode_images(pixel_values, grid_thw)
        self.hidden_size = hidden_size
        self.device = device
        # how many images the vision tower encoded, and its device time (the benchmark's split)
        self.images_encoded = 0
        self._seconds = 0.0
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def image_batch(self, batch: ScheduledBatch) -> ImageBatch:
        spans = [
            (req, int(s), int(n)) for req, s, n in zip(batch.reqs, batch.starts, batch.extend_lens)
        ]
        self._encode([req for req, s, n in spans if _needs_embeds(req, s, s + n)])
        positions, rows, embeds = [], [], []
        offset = 0  # the batch row of the request's first new token
        for req, start, n in spans:
            positions.append(_rope_positions(req, start, n))
            images = req.request.images
            if images is not None:
                lo, hi = np.searchsorted(images.token_positions, [start, start + n])
                if hi > lo:
                    rows.append(images.token_positions[lo:hi] - start + offset)
                    embeds.append(req.image_embeds[lo:hi])
                if start + n > images.token_positions[-1]:
                    req.image_embeds = None  # its prefill is past its images (slices live on)
            offset += n
        deltas = [
            req.request.images.rope_delta if req.request.images is not None else 0
            for req in batch.reqs
        ]
        return ImageBatch(
            rope_positions=to_device(np.concatenate(positions, axis=1), torch.int64, self.device),
            rope_deltas=to_device(deltas, torch.int64, self.device),
            rows=to_device(np.concatenate(rows) if rows else [], torch.int64, self.device),
            embeds=torch.cat(embeds) if embeds else self._no_embeds(),
        )

    def _encode(self, reqs: list[Req]) -> None:
        """Every image of `reqs` through the vision tower in one call; each request keeps its
        rows of the output (one per image token, in prompt order)."""
        if not reqs:
            return
        patches = np.concatenate([r.request.images.patches for r in reqs])
        grids = np.concatenate([r.request.images.grid_thw for r in reqs])
        first = reqs[0].request.images  # (one processor, so one table for every request)
        with self._timed():
            table = to_device(first.pixel_table, torch.float32, self.device)
            pixels = patch_pixels(
                to_device(patches, torch.uint8, self.device), table, first.temporal_patch_size
            )
            out = self.model.encode_images(pixels, torch.from_numpy(grids))
        sizes = [len(r.request.images.token_positions) for r in reqs]
        if out.shape[0] != sum(sizes):
            raise RuntimeError(
                f"the vision tower gave {out.shape[0]} embeddings for {sum(sizes)} image tokens"
            )
        for req, part in zip(reqs, out.split(sizes)):
            req.image_embeds = part
        self.images_encoded += len(grids)

    def counters(self) -> dict[str, float]:
        """For get_server_info: images encoded, and the vision tower's seconds on the device
        (of the encodes that have finished; NOTE: read without waiting for the device)."""
        self._fold_finished()
        return {"images_encoded": self.images_encoded, "vision_seconds": self._seconds}

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Device time of the block: CUDA events read once they have passed (no sync)."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - start
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((start, end))
        self._fold_finished()

    def _fold_finished(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._seconds += start.elapsed_time(end) / 1e3

    def _no_embeds(self) -> torch.Tensor:
        dtype = self.model.embed_tokens.weight.dtype
        return torch.empty(0, self.hidden_size, dtype=dtype, device=self.device)


def _needs_embeds(req: Req, start: int, end: int) -> bool:
    """Whether tokens [start, end) hold image tokens of `req` and nothing has encoded them."""
    images = req.request.images
    if images is None or req.image_embeds is not None:
        return False
    lo, hi = np.searchsorted(images.token_positions, [start, end])
    return bool(hi > lo)


def _rope_positions(req: Req, start: int, n: int) -> np.ndarray:
    """[3, n] M-RoPE positions of `req`'s tokens [start, start + n)."""
    images = req.request.images
    if images is None:
        return np.broadcast_to(np.arange(start, start + n), (3, n))
    prompt_len = images.rope_positions.shape[1]
    head = images.rope_positions[:, start : min(start + n, prompt_len)]
    past = np.arange(max(start, prompt_len), start + n) + images.rope_delta
    return np.concatenate([head, np.broadcast_to(past, (3, len(past)))], axis=1)
