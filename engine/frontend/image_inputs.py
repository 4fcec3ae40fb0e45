"""A generate() call's image_data, made into each request's ImageInputs (the caller's process).

`prepare` decodes, preprocesses and hashes every image of the call on a few threads (decoding
and resizing free the GIL, and a batch of a thousand images is mostly that work), keeping the
error of a bad image for its request; `build` then expands one prompt's image slots and gives
its images their prefix-cache keys and M-RoPE positions. The pieces are in
engine/frontend/image_preprocessing.py and engine/multimodal/.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from engine.model_config import VISION_LANGUAGE_ARCHITECTURES, ModelConfig
from engine.runtime.messages import ImageInputs

if TYPE_CHECKING:
    from engine.frontend.image_preprocessing import ImageProcessor

_THREADS = 8  # threads that decode and preprocess a call's images


class PreparedImage(NamedTuple):
    """One image of a request, preprocessed."""

    patches: np.ndarray  # uint8 [patches, channels * patch**2] (engine/multimodal/pixels.py)
    grid: np.ndarray  # int64 [3]: (t, h, w) in patches
    hash: int  # of its content


class ImageInputsBuilder:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._processor: ImageProcessor | None = None  # the model folder's, at the first image

    def prepare(
        self, image_data: Any, n: int, is_batch: bool
    ) -> list[list[PreparedImage] | ValueError]:
        """Per prompt its images, preprocessed, or the error of its first bad one (the caller
        raises it in that request's turn, where the request is named)."""
        if image_data is None:
            return [[] for _ in range(n)]
        from engine.frontend.image_preprocessing import ImageProcessor, normalize_image_data

        lists = normalize_image_data(image_data, n, is_batch)
        if not any(lists):
            return [[] for _ in range(n)]
        if not self.config.is_vision_language:
            raise ValueError(
                f"image_data needs a vision-language model "
                f"({', '.join(sorted(VISION_LANGUAGE_ARCHITECTURES))}); "
                f"{self.config.architecture} takes text only"
            )
        if self._processor is None:
            self._processor = ImageProcessor(str(self.config.path))
        items = [(i, k, raw) for i, raws in enumerate(lists) for k, raw in enumerate(raws)]
        workers = min(_THREADS, len(items), os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(lambda item: self._prepare_one(item[1], item[2]), items))
        out: list[list[PreparedImage] | ValueError] = [[] for _ in range(n)]
        for (i, _, _), image in zip(items, done):
            if isinstance(out[i], list):  # (after an error, the request's other images no more)
                out[i] = image if isinstance(image, ValueError) else [*out[i], image]
        return out

    def _prepare_one(self, k: int, raw: Any) -> PreparedImage | ValueError:
        from engine.frontend.image_preprocessing import image_hash, load_image

        try:
            picture = load_image(raw, f"image_data[{k}]")
            patches, grid = self._processor.process([picture], f"image_data[{k}]")
        except ValueError as e:
            return e
        return PreparedImage(patches, grid[0], image_hash(patches, grid[0]))

    def build(
        self, ids: list[int], images: list[PreparedImage] | ValueError
    ) -> tuple[list[int], ImageInputs]:
        """The prompt's ids with each image slot expanded to its image's tokens, and the
        request's ImageInputs."""
        from engine.frontend.image_preprocessing import expand_image_tokens
        from engine.multimodal.mrope import mrope_positions

        if isinstance(images, ValueError):
            raise images
        processor, config = self._processor, self.config
        grid_thw = np.stack([image.grid for image in images])
        counts = processor.tokens_per_image(grid_thw)
        ids = expand_image_tokens(ids, config.image_token_id, counts, "image_data")
        array = np.asarray(ids, dtype=np.int64)
        rope, delta = mrope_positions(
            array, grid_thw, config.image_token_id, config.vision_start_token_id,
            processor.merge_size,
        )  # fmt: skip
        # an image's tokens go by its content in the prefix cache: an id past the vocabulary
        keys = [config.vocab_size + image.hash % 2**40 for image in images]
        inputs = ImageInputs(
            patches=np.concatenate([image.patches for image in images]),
            pixel_table=processor.table,
            temporal_patch_size=processor.temporal_patch_size,
            grid_thw=grid_thw,
            token_positions=np.flatnonzero(array == config.image_token_id),
            cache_ids=np.repeat(np.asarray(keys, dtype=np.int64), counts),
            rope_positions=rope,
            rope_delta=int(delta),
        )
        return ids, inputs
