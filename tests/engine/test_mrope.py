"""M-RoPE positions (engine/multimodal/mrope.py) against transformers' `get_rope_index`.

The reference is `Qwen2_5_VLModel.get_rope_index` of a tiny random Qwen2.5-VL model (its
weights play no part): the same prompts and image grids must give the same [3, L] positions
and the same `mrope_position_deltas`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

from engine.multimodal.mrope import mrope_positions

IMAGE, VISION_START, VISION_END, VIDEO = 5, 9, 8, 6
MERGE = 2


@pytest.fixture(scope="module")
def hf_model():
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            bos_token_id=1,
            eos_token_id=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=16,
            spatial_merge_size=MERGE,
            fullatt_block_indexes=[0],
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
    )
    return Qwen2_5_VLModel(config).eval()


def _prompt(*parts) -> tuple[list[int], list[list[int]]]:
    """Token ids and grids from parts: a list is text, a (t, h, w) tuple an image with markers."""
    ids, grids = [], []
    for part in parts:
        if isinstance(part, tuple):
            ids += [VISION_START] + [IMAGE] * (int(np.prod(part)) // MERGE**2) + [VISION_END]
            grids.append(list(part))
        else:
            ids += part
    return ids, grids


def _reference(model, ids: list[int], grids: list[list[int]]) -> tuple[np.ndarray, int]:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        positions, deltas = model.get_rope_index(
            input_ids,
            mm_token_type_ids=(input_ids == IMAGE).int(),
            image_grid_thw=torch.tensor(grids) if grids else None,
        )
    return positions[:, 0].numpy(), int(deltas.reshape(-1)[0])


def _ours(ids: list[int], grids: list[list[int]]) -> tuple[np.ndarray, int]:
    grid = np.array(grids, dtype=np.int64).reshape(-1, 3)
    return mrope_positions(np.array(ids), grid, IMAGE, VISION_START, MERGE)


CASES = {
    "text only": _prompt([1, 2, 3, 4, 7]),
    "one image in the middle": _prompt([1, 2, 3], (1, 4, 6), [4, 7, 3]),
    "three images, two back to back": _prompt(
        [1, 2], (1, 6, 4), (1, 2, 2), [3, 4, 7], (1, 8, 12), [3, 3]
    ),
    "image at the very start": _prompt((1, 10, 4), [1, 2, 3]),
    "prompt ends with an image": _prompt([1, 2], (1, 4, 14)),
    "wide then tall": _prompt([7], (1, 2, 20), [3], (1, 20, 2), [4]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_positions_and_delta_equal_transformers(hf_model, case):
    ids, grids = CASES[case]
    want_positions, want_delta = _reference(hf_model, ids, grids)
    positions, delta = _ours(ids, grids)
    assert positions.dtype == np.int64 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, want_positions)
    assert delta == want_delta


def test_random_layouts_equal_transformers(hf_model):
    rng = np.random.default_rng(0)
    for _ in range(25):
        parts = []
        for _ in range(rng.integers(1, 6)):
            if rng.random() < 0.5:
                parts.append(rng.integers(10, 60, size=rng.integers(0, 5)).tolist())
            else:
                parts.append((1, 2 * int(rng.integers(1, 8)), 2 * int(rng.integers(1, 8))))
        ids, grids = _prompt(*parts)
        if not ids:
            continue
        want_positions, want_delta = _reference(hf_model, ids, grids)
        positions, delta = _ours(ids, grids)
        np.testing.assert_array_equal(positions, want_positions, err_msg=str(parts))
        assert delta == want_delta


def test_generated_tokens_continue_at_index_plus_delta():
    ids, grids = _prompt([1, 2], (1, 6, 8), [3])
    positions, delta = _ours(ids, grids)
    # the first generated token follows the prompt's last text position
    assert len(ids) + delta == positions[:, -1].max() + 1
    assert (positions[:, -1] == len(ids) - 1 + delta).all()


def test_accepts_a_list_and_no_grid():
    positions, delta = mrope_positions([4, 7, 3], None, IMAGE, VISION_START, MERGE)
    np.testing.assert_array_equal(positions, np.tile(np.arange(3), (3, 1)))
    assert delta == 0


@pytest.mark.parametrize(
    "ids, grids, message",
    [
        ([1, VISION_START, IMAGE, IMAGE, VISION_END], [[1, 4, 4]], "2 image tokens"),
        ([1, VISION_START, IMAGE, 3, IMAGE, VISION_END], [[1, 2, 4]], "split"),
        ([1, IMAGE, VISION_END], [[1, 2, 2]], "vision start"),
        ([IMAGE, VISION_END], [[1, 2, 2]], "vision start"),
        ([VISION_START, IMAGE, VISION_END], [[1, 3, 2]], "multiples"),
    ],
)
def test_prompt_and_grids_that_disagree_are_refused(ids, grids, message):
    with pytest.raises(ValueError, match=message):
        _ours(ids, grids)
