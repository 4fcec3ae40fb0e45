"""The caller's half of `image_data` (engine/frontend/image_preprocessing.py).

The reference for pixels and token counts is transformers: `Qwen2VLImageProcessorPil` (what
`AutoImageProcessor` gives for a Qwen2.5-VL folder without torchvision) and the full
`Qwen2_5_VLProcessor`, whose prompt expansion counts the `<|image_pad|>` tokens of each image.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.frontend.image_preprocessing import (
    ImageProcessor,
    expand_image_tokens,
    image_hash,
    load_image,
    normalize_image_data,
)
from engine.multimodal.pixels import patch_pixels

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
WORDS = ["[UNK]", "describe", "these", "and", "then", "this"]
VOCAB = {token: i for i, token in enumerate(WORDS + SPECIALS)}
IMAGE_PAD = VOCAB["<|image_pad|>"]
# preprocessor_config.json as Qwen2.5-VL-7B-Instruct ships it (its class name is transformers'
# torchvision one, which AutoImageProcessor swaps for the PIL one when torchvision is missing)
QWEN25_VL_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}
# a small max_pixels, so that big images are scaled down (and tests stay fast)
SMALL_CONFIG = {**QWEN25_VL_CONFIG, "max_pixels": 28 * 28 * 64}
SIZES = [(29, 31), (200, 57), (448, 448), (1000, 13), (1, 1), (57, 3000)]


def _random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", additional_special_tokens=SPECIALS
    )


class _ImageOnlyProcessor(Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor without a video processor.

    transformers 5.24 cannot build the full processor without torchvision: checking the (absent)
    video processor's class looks it up in a VIDEO_PROCESSOR_MAPPING that is a dummy without
    torchvision and raises. Skipping only that check leaves the prompt expansion under test as
    transformers wrote it.
    """

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


@pytest.fixture(scope="module", params=["qwen25vl", "small"])
def folder(request, tmp_path_factory) -> tuple[Path, dict]:
    config = QWEN25_VL_CONFIG if request.param == "qwen25vl" else SMALL_CONFIG
    out = tmp_path_factory.mktemp(request.param)
    (out / "preprocessor_config.json").write_text(json.dumps(config))
    return out, config


def _hf_image_processor(config: dict) -> Qwen2VLImageProcessorPil:
    kwargs = {k: config[k] for k in ("min_pixels", "max_pixels", "patch_size", "merge_size")}
    return Qwen2VLImageProcessorPil(
        **kwargs,
        temporal_patch_size=config["temporal_patch_size"],
        image_mean=config["image_mean"],
        image_std=config["image_std"],
    )


# ------------------------------------------------------------------------------------ processing
def _float_pixels(processor: ImageProcessor, patches: np.ndarray) -> np.ndarray:
    """The patches as the runner rebuilds them on the device (here on the CPU)."""
    table = torch.from_numpy(processor.table)
    return patch_pixels(torch.from_numpy(patches), table, processor.temporal_patch_size).numpy()


def test_processor_matches_transformers_on_odd_sizes(folder):
    path, config = folder
    ours = ImageProcessor(str(path))
    assert ours.merge_size == 2
    images = [_random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    patches, grid = ours.process(images)
    want = _hf_image_processor(config)(images=images, return_tensors="np")
    assert patches.dtype == np.uint8 and grid.dtype == np.int64
    assert patches.shape[1] == 3 * 14 * 14  # one temporal copy: an eighth of the floats
    # rebuilt from bytes and the table, the processor's float32 pixels bit for bit
    np.testing.assert_array_equal(_float_pixels(ours, patches), want["pixel_values"])
    np.testing.assert_array_equal(grid, want["image_grid_thw"])


def test_token_counts_and_expansion_match_the_full_processor(folder):
    path, config = folder
    ours = ImageProcessor(str(path))
    images = [_random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    slot = "<|vision_start|> <|image_pad|> <|vision_end|>"
    text = f"<|im_start|> describe {slot} {slot} and {slot} then {' '.join([slot] * 3)} <|im_end|>"
    tokenizer = _tokenizer()
    hf = _ImageOnlyProcessor(image_processor=_hf_image_processor(config), tokenizer=tokenizer)
    want = hf(text=[text], images=[images], return_tensors="np")

    pixels, grid = ours.process(images)
    counts = ours.tokens_per_image(grid)
    want_ids = want["input_ids"][0].tolist()
    runs = [len(run) for run in _image_pad_runs(want_ids)]
    assert counts == runs
    ids = tokenizer(text)["input_ids"]
    assert expand_image_tokens(ids, IMAGE_PAD, counts, "request 0") == want_ids


def _image_pad_runs(ids: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token in ids + [-1]:
        if token == IMAGE_PAD:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs


def test_transparency_is_composited_onto_white():
    """As transformers 5.24's convert_to_rgb does, checked by hand: transformers 5.17 (the GPU
    machine's) gave other pixels for the same RGBA picture, and the engine's must not depend
    on the installed version."""
    rgba = _random_image(60, 45, seed=3, mode="RGBA")
    loaded = load_image(_png_bytes(rgba), "request 0: image_data")
    assert loaded.mode == "RGB"
    src = np.asarray(rgba, dtype=np.float64)
    alpha = src[..., 3:] / 255
    want = src[..., :3] * alpha + 255 * (1 - alpha)
    assert np.abs(np.asarray(loaded, dtype=np.float64) - want).max() <= 1


def test_an_image_the_processor_refuses_is_named(folder):
    path, _ = folder
    with pytest.raises(ValueError, match=r"request 1: image_data\[1\].*1x300.*aspect ratio"):
        ImageProcessor(str(path)).process(
            [_random_image(8, 8), _random_image(1, 300)], "request 1: image_data"
        )


def test_no_images_give_empty_arrays(folder):
    pixels, grid = ImageProcessor(str(folder[0])).process([])
    assert pixels.shape == (0, 588) and grid.shape == (0, 3)


# --------------------------------------------------------------------------------------- loading
@pytest.fixture(scope="module")
def png(tmp_path_factory) -> tuple[Path, np.ndarray]:
    image = _random_image(23, 17, seed=7)
    path = tmp_path_factory.mktemp("png") / "image.png"
    path.write_bytes(_png_bytes(image))
    return path, np.asarray(image)


def test_every_input_form_gives_the_same_pixels(png):
    path, want = png
    raw = path.read_bytes()
    b64 = base64.b64encode(raw).decode()
    forms = {
        "str path": str(path),
        "pathlib.Path": path,
        "base64": b64,
        "wrapped base64": "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76)),
        "url-safe base64 without padding": base64.urlsafe_b64encode(raw).decode().rstrip("="),
        "data URL": "data:image/png;base64," + b64,
        "bytes": raw,
        "PIL": Image.open(path),
        "PIL, not RGB": Image.open(path).convert("RGBA"),
    }
    for name, item in forms.items():
        image = load_image(item, "request 0: image_data")
        assert image.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(image), want, err_msg=name)


def test_http_url_is_fetched(png):
    path, want = png
    raw = path.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the name http.server calls)
            self.send_response(200 if self.path == "/image.png" else 404)
            self.end_headers()
            self.wfile.write(raw if self.path == "/image.png" else b"")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        np.testing.assert_array_equal(np.asarray(load_image(f"{base}/image.png", "r")), want)
        with pytest.raises(ValueError, match=r"request 3: image_data.*/missing.png.*HTTP 404"):
            load_image(f"{base}/missing.png", "request 3: image_data")
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_url_is_a_quick_value_error():
    url = "http://127.0.0.1:9/x.png"
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"request 2: image_data\[1\].*127\.0\.0\.1:9/x\.png.*unr"):
        load_image(url, "request 2: image_data[1]")
    assert time.monotonic() - start < 5


def test_bad_images_are_value_errors_naming_where(png, tmp_path):
    path, _ = png
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(path.read_bytes()[:200])
    where = "request 4: image_data[2]"
    cases = [
        (str(truncated), "truncated or corrupt"),
        (truncated, "truncated or corrupt"),
        (str(tmp_path / "missing.jpg"), "no such file"),
        (tmp_path / "missing.jpg", "no such file"),
        (b"this is not an image at all", "not a readable image"),
        (base64.b64encode(b"not an image either").decode(), "not a readable image"),
        ("data:image/png;base64,@@@not base64@@@", "not valid base64"),
        ("data:image/png,rawbytes", "data URL must read"),
        (12, "must be a file path.*bytes.*PIL.Image.Image; got int"),
        (None, "got NoneType"),
        ({"url": "x"}, "got dict"),
    ]
    for item, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(where)}: .*{message}"):
            load_image(item, where)
    with pytest.raises(ValueError, match=f"^{re.escape(where)}: .*truncated"):
        load_image(Image.open(truncated), where)


# ---------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize(
    "image_data, num_prompts, is_batch, want",
    [
        (None, 1, False, [[]]),
        ("a.png", 1, False, [["a.png"]]),
        (["a.png", b"b"], 1, False, [["a.png", b"b"]]),
        ([], 1, False, [[]]),
        ([None], 1, False, [[]]),
        (None, 3, True, [[], [], []]),
        ("a.png", 3, True, [["a.png"], ["a.png"], ["a.png"]]),
        ([], 2, True, [[], []]),
        (["a.png", None, ["b", "c"]], 3, True, [["a.png"], [], ["b", "c"]]),
        ([[None], []], 2, True, [[], []]),
        ([["a", "b"]], 1, True, [["a", "b"]]),
        (("a", "b"), 2, True, [["a"], ["b"]]),
    ],
)
def test_normalize_image_data_shapes(image_data, num_prompts, is_batch, want):
    assert normalize_image_data(image_data, num_prompts, is_batch) == want


def test_a_single_image_for_a_batch_is_given_to_every_prompt_separately():
    lists = normalize_image_data("a.png", 2, True)
    lists[0].append("b.png")
    assert lists[1] == ["a.png"]


@pytest.mark.parametrize(
    "image_data, num_prompts, is_batch, message",
    [
        (["a", "b"], 3, True, r"image_data has 2 entries for 3 prompts.*list of n entries"),
        ([["a", ["b"]]], 1, True, r"image_data\[0\]\[1\] is a list.*image_data takes"),
        (["a", None], 1, False, r"image_data\[1\] is None"),
        ([["a"], "b"], 1, False, r"image_data\[0\] is a list.*for one prompt, an image or"),
        ("a", 2, False, "num_prompts is 2"),
    ],
)
def test_normalize_image_data_errors(image_data, num_prompts, is_batch, message):
    with pytest.raises(ValueError, match=message):
        normalize_image_data(image_data, num_prompts, is_batch)


# ---------------------------------------------------------------------------------------- tokens
def test_expand_one_and_three_images():
    assert expand_image_tokens([1, 8, 7, 9, 2], 7, [3], "r") == [1, 8, 7, 7, 7, 9, 2]
    # 8 and 9 stand for <|vision_start|> and <|vision_end|>; the last two images back to back
    ids = [1, 8, 7, 9, 3, 8, 7, 9, 8, 7, 9]
    want = [1, 8, 7, 7, 9, 3, 8, 7, 9, 8, 7, 7, 7, 9]
    assert expand_image_tokens(ids, 7, [2, 1, 3], "r") == want
    assert expand_image_tokens([7, 1], 7, [2], "r") == [7, 7, 1]
    assert expand_image_tokens([1, 2], 7, [], "r") == [1, 2]


@pytest.mark.parametrize(
    "ids, counts, numbers",
    [([1, 7, 2], [4, 4], "1 image slots.*2 images"), ([7, 7, 7], [1, 1], "3 image slots.*2 ima")],
)
def test_expand_refuses_too_few_or_too_many_slots(ids, counts, numbers):
    with pytest.raises(ValueError, match=f"^request 5: the prompt has {numbers}"):
        expand_image_tokens(ids, 7, counts, "request 5")


def test_expand_is_linear():
    ids = [1, 7, 2] * 20_000
    start = time.perf_counter()
    out = expand_image_tokens(ids, 7, [64] * 20_000, "r")
    assert len(out) == 2 * 20_000 + 64 * 20_000
    assert time.perf_counter() - start < 1.0


def test_image_hash(folder):
    processor = ImageProcessor(str(folder[0]))
    image = _random_image(40, 30, seed=1)
    changed = image.copy()
    changed.putpixel((5, 5), tuple((v + 1) % 256 for v in image.getpixel((5, 5))))
    pixels, grid = processor.process([image, image.copy(), changed])
    n = processor.tokens_per_image(grid)[0] * 4  # patches of one image
    hashes = [image_hash(pixels[k * n : (k + 1) * n], grid[k]) for k in range(3)]
    assert hashes[0] == hashes[1] != hashes[2]
    assert all(0 <= h < 2**63 for h in hashes)
    # the grid is part of the content: the same patches in another layout are another image
    assert grid[0][1] != grid[0][2]
    assert image_hash(pixels[:n], grid[0][[0, 2, 1]]) != hashes[0]
