"""Multimodal rotary positions (M-RoPE) of Qwen2-VL and Qwen2.5-VL prompts.

These models rotate each query/key with three position ids instead of one: temporal, height and
width. Text tokens carry the same id on all three axes and advance it by one per token. An image's
tokens (one per merged patch, laid out row-major over a `t x h x w` grid) instead share a start
position `s` and take `s + t_idx`, `s + h_idx`, `s + w_idx`; the text after the image resumes at
`s + max(t, h, w)`, so an image takes up as much "position room" as its longest side, not as many
positions as it has tokens. Every token after the prompt is text, so its position is its index
plus a fixed `delta` (negative when images are bigger than they are long); the scheduler keeps
`delta` per request instead of the positions of generated tokens.

The rule is transformers' `Qwen2_5_VLModel.get_rope_index` for images (videos, with their
time-scaled temporal axis, are not handled). Everything is computed with whole-array numpy
operations, O(prompt length), since a prompt can hold many thousands of image tokens.
"""

from __future__ import annotations

import numpy as np


def mrope_positions(
    input_ids: np.ndarray | list[int],
    image_grid_thw: np.ndarray | None,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """Positions [3, L] (temporal, height, width), int64, of a prompt, and its `delta`.

    `image_grid_thw` holds one (t, h, w) row per image in prompt order, in vision-encoder patches
    (as the image processor returns it); the prompt must hold each image's
    `t * h * w // spatial_merge_size**2` image tokens in one run right after a
    `vision_start_token_id`, as Qwen's chat template and the expanded prompt lay them out.
    A generated token at sequence index i >= L has position i + delta on all three axes.
    Raises ValueError when the prompt and the grids disagree.
    """
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    grids = _llm_grids(image_grid_thw, spatial_merge_size)
    counts = grids.prod(axis=1)
    starts = _image_starts(ids, counts, image_token_id, vision_start_token_id)
    # the text after image k resumes `span` positions after its start, having used `count` tokens
    spans = grids.max(axis=1)
    shift = np.zeros(len(ids) + 1, dtype=np.int64)
    np.add.at(shift, starts + counts, spans - counts)
    # every token's position as if it were text: its index plus what the images before it shift
    base = np.arange(len(ids), dtype=np.int64) + np.cumsum(shift)[: len(ids)]
    positions = np.broadcast_to(base, (3, len(ids))).copy()
    if len(counts):
        token_at, offsets = _image_token_offsets(starts, counts, grids)
        positions[:, token_at] = np.repeat(base[starts], counts)[None, :] + offsets
    return positions, int((spans - counts).sum())


def _llm_grids(image_grid_thw: np.ndarray | None, merge: int) -> np.ndarray:
    """Each image's grid in language-model tokens: (t, h // merge, w // merge), int64 [n, 3]."""
    if image_grid_thw is None:
        return np.zeros((0, 3), dtype=np.int64)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    if (grids <= 0).any() or (grids[:, 1:] % merge).any():
        raise ValueError(
            f"image_grid_thw must hold positive (t, h, w) rows with h and w multiples of the "
            f"spatial merge size {merge}, got {grids.tolist()}"
        )
    return grids // np.array([1, merge, merge], dtype=np.int64)


def _image_starts(
    ids: np.ndarray, counts: np.ndarray, image_token_id: int, vision_start_token_id: int
) -> np.ndarray:
    """The index of each image's first token; checks each image is one run after a vision start.

    The vision start is what Qwen's template (and SGLang's and transformers 4.x's rules) mark each
    image with; requiring it also refuses two images with nothing between them, whose split
    would rest on the grids alone (transformers 5.x fails on those too).
    """
    token_at = np.flatnonzero(ids == image_token_id)
    if len(token_at) != counts.sum():
        raise ValueError(
            f"the prompt holds {len(token_at)} image tokens but its {len(counts)} image grids "
            f"need {int(counts.sum())}"
        )
    first = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    starts = token_at[first] if len(counts) else np.zeros(0, dtype=np.int64)
    ends = token_at[first + counts - 1] if len(counts) else starts
    if (ends - starts + 1 != counts).any():
        raise ValueError("an image's tokens are split by other tokens in the prompt")
    if (starts == 0).any() or (ids[np.maximum(starts - 1, 0)] != vision_start_token_id).any():
        raise ValueError(
            f"every image's tokens must follow a vision start token ({vision_start_token_id})"
        )
    return starts


def _image_token_offsets(
    starts: np.ndarray, counts: np.ndarray, grids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The index of every image token, and its (t, h, w) offsets from its image's start [3, N]."""
    image_start = np.repeat(starts, counts)
    rank = np.arange(counts.sum(), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    height = np.repeat(grids[:, 1], counts)
    width = np.repeat(grids[:, 2], counts)
    offsets = np.stack((rank // (height * width), rank // width % height, rank % width))
    return image_start + rank, offsets
