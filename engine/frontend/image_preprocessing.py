"""The caller's half of `image_data` for Qwen2-VL / Qwen2.5-VL: images in, patches and tokens out.

Everything a request's images need before the scheduler sees them happens here, in the
caller's process, so a bad image raises in its caller with the request and the field named,
and the scheduler only ever receives well-formed arrays:

* `normalize_image_data` turns SGLang's accepted shapes of `image_data` into a list of raw items
  per prompt;
* `load_image` turns one raw item (path, URL, base64, bytes, PIL image) into an RGB image,
  decoded in full so a truncated file fails here rather than as a garbled picture;
* `ImageProcessor` wraps the model folder's own image processor (resize to a multiple of the
  merged patch size, cut into patches), so the pixels match transformers exactly; they travel
  as bytes and are normalised on the device (engine/multimodal/pixels.py);
* `expand_image_tokens` widens each image's single `<|image_pad|>` of the prompt to the number
  of tokens its patches become;
* `image_hash` names an image's content for the prefix cache, where two prompts whose
  placeholder tokens match must still not share a prefix if their pictures differ.

transformers is imported only when an `ImageProcessor` is made: text-only engines never pay for it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from engine.multimodal.pixels import normalization_table

URL_TIMEOUT_S = 10.0
_ALLOWED = (
    "a file path (str or pathlib.Path), an http(s) URL, a data:image/...;base64 URL, "
    "a base64 string, bytes, or a PIL.Image.Image"
)
_SHAPES = (
    "image_data takes, for one prompt, an image or a list of images; for a batch of n prompts, "
    "one image (given to every prompt) or a list of n entries, each an image, None or a list of "
    "images"
)
# standard and URL-safe alphabets, padding optional: what people paste as "base64"
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]+={0,2}")


# ---------------------------------------------------------------------------------------- loading
def load_image(item: object, where: str) -> Image.Image:
    """One `image_data` item as a fully decoded RGB image; ValueError naming `where` if not one.

    A plain string is a URL if it starts with http(s)://, a data URL if with data:, a file if
    one exists at that path, and otherwise base64 of an image file.
    """
    if isinstance(item, Image.Image):
        return _to_rgb(_fully_loaded(item, where, "the PIL image"), where)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _decode(bytes(item), where, "the bytes")
    if isinstance(item, Path):
        return _decode(_read_file(item, where), where, f"file {str(item)!r}")
    if isinstance(item, str):
        return _load_str(item, where)
    raise ValueError(f"{where}: an image must be {_ALLOWED}; got {type(item).__name__}")


def _load_str(text: str, where: str) -> Image.Image:
    if text.startswith(("http://", "https://")):
        return _decode(_fetch(text, where), where, f"the image at {text}")
    if text.startswith("data:"):
        return _decode(_data_url_bytes(text, where), where, "the data URL's image")
    if os.path.isfile(text):
        return _decode(_read_file(Path(text), where), where, f"file {text!r}")
    raw = _base64_bytes(text)
    if raw is None:
        raise ValueError(f"{where}: no such file: {_preview(text)}")
    # a short string of base64 letters may just as well be a mistyped path: say both
    what = f"{_preview(text)} (not an existing file, so read as base64)"
    return _decode(raw, where, what)


def _read_file(path: Path, where: str) -> bytes:
    if not path.is_file():
        raise ValueError(f"{where}: no such file: {str(path)!r}")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}: cannot read file {str(path)!r}: {exc}") from exc


def _fetch(url: str, where: str) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "gristmill"})
    try:
        with urllib.request.urlopen(request, timeout=URL_TIMEOUT_S) as response:
            return response.read()
    except urllib.error.HTTPError as exc:  # the server answered: the network is fine
        raise ValueError(f"{where}: fetching {url} failed: HTTP {exc.code} {exc.reason}") from exc
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections, bad hosts
        raise ValueError(
            f"{where}: cannot fetch {url}: the network is unreachable from here ({exc})"
        ) from exc


def _data_url_bytes(url: str, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ValueError(
            f"{where}: a data URL must read data:image/<type>;base64,<data>; got {_preview(url)}"
        )
    raw = _base64_bytes(payload)
    if raw is None:
        raise ValueError(f"{where}: the data URL's payload is not valid base64")
    return raw


def _base64_bytes(text: str) -> bytes | None:
    """The bytes `text` encodes in base64 (standard or URL-safe, padding optional), else None."""
    compact = "".join(text.split())  # pasted base64 is often wrapped at 76 columns
    if not _BASE64.fullmatch(compact) or len(compact.rstrip("=")) % 4 == 1:
        return None
    compact = compact.rstrip("=").replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except binascii.Error:
        return None


def _decode(raw: bytes, where: str, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(raw))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{where}: {what} is not a readable image ({exc})") from exc
    return _to_rgb(_fully_loaded(image, where, what), where)


def _fully_loaded(image: Image.Image, where: str, what: str) -> Image.Image:
    # Image.open reads only the header; a truncated or corrupt body shows up in load()
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{where}: {what} is truncated or corrupt ({exc})") from exc
    return image


def _to_rgb(image: Image.Image, where: str) -> Image.Image:
    """RGB as transformers' `convert_to_rgb` makes it: transparency composited onto white.

    The image processor would do the same to the original, so converting here changes nothing
    in the pixels, and the processor (and the hash) see one uniform mode.
    """
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: cannot convert the image to RGB ({exc})") from exc


def _preview(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---------------------------------------------------------------------------------------- shapes
def normalize_image_data(
    image_data: object, num_prompts: int, is_batch: bool
) -> list[list[object]]:
    """SGLang's shapes of `image_data` as one list (possibly empty) of raw items per prompt.

    One prompt: an image, or a list of images. A batch of n prompts: one image, given to every
    prompt; or a list of n entries, each an image, None or a list of images. None, an empty list
    or [None] mean no images, as in SGLang. The items themselves are checked by `load_image`.
    """
    if image_data is None:
        return [[] for _ in range(num_prompts)]
    if not is_batch:
        if num_prompts != 1:
            raise ValueError(f"a single prompt was given, but num_prompts is {num_prompts}")
        return [_images_of_one_prompt(image_data, "image_data")]
    if not _is_list(image_data):
        return [[image_data] for _ in range(num_prompts)]
    if len(image_data) == 0:
        return [[] for _ in range(num_prompts)]
    if len(image_data) != num_prompts:
        raise ValueError(
            f"image_data has {len(image_data)} entries for {num_prompts} prompts; {_SHAPES}"
        )
    return [_images_of_one_prompt(entry, f"image_data[{i}]") for i, entry in enumerate(image_data)]


def _images_of_one_prompt(entry: object, field: str) -> list[object]:
    if entry is None:
        return []
    if not _is_list(entry):
        return [entry]
    if len(entry) == 1 and entry[0] is None:
        return []
    for j, item in enumerate(entry):
        if item is None or _is_list(item):
            got = "None" if item is None else "a list"
            raise ValueError(f"{field}[{j}] is {got} where an image was expected; {_SHAPES}")
    return list(entry)


def _is_list(value: object) -> bool:
    return isinstance(value, (list, tuple))


# ------------------------------------------------------------------------------------ processing
class ImageProcessor:
    """Qwen2-VL's image processing with the model folder's settings (preprocessor_config.json,
    read by transformers with its defaults): each image resized so both sides are whole merge
    blocks within the pixel bounds (bicubic, as transformers' PIL path), then cut into patches.

    `process` returns the patches as bytes, one temporal copy each (engine/multimodal/pixels.py),
    and `table` turns them into the processor's float32 values bit for bit on the device. The
    resize and the patch order are transformers' own, tested against it; done here on the uint8
    image, they cost a fraction of transformers' float32 path (which also repeats each patch
    for the temporal axis), for the thousands of images of a batch run.
    """

    def __init__(self, model_path: str) -> None:
        # (Qwen2-VL's processor, which Qwen2.5-VL folders name: the one family served)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        p = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        self.patch_size = int(p.patch_size)
        self.merge_size = int(p.merge_size)
        self.temporal_patch_size = int(p.temporal_patch_size)
        self.min_pixels = int(_setting(p, "min_pixels", "shortest_edge"))
        self.max_pixels = int(_setting(p, "max_pixels", "longest_edge"))
        self.resample = Image.Resampling(int(p.resample))
        self.channels = 3
        self.table = normalization_table(float(p.rescale_factor), p.image_mean, p.image_std)

    def process(
        self, images: Sequence[Image.Image], where: str = "image_data"
    ) -> tuple[np.ndarray, np.ndarray]:
        """`patches` uint8 [num_patches, C*P*P] and `image_grid_thw` int64 [n, 3]; an image
        the processor refuses (aspect ratio over 200) is named as `{where}[k]`."""
        patches, grids = [], []
        for k, image in enumerate(images):
            try:
                height, width = resized_size(
                    image.height, image.width, self.patch_size * self.merge_size,
                    self.min_pixels, self.max_pixels,
                )  # fmt: skip
            except ValueError as exc:
                raise ValueError(
                    f"{where}[{k}]: the image processor refused the {image.width}x"
                    f"{image.height} image: {exc}"
                ) from exc
            pixels = np.asarray(image.resize((width, height), resample=self.resample))
            patches.append(self._patches(pixels))
            grids.append((1, height // self.patch_size, width // self.patch_size))
        if not patches:
            width = self.channels * self.patch_size**2
            return np.zeros((0, width), dtype=np.uint8), np.zeros((0, 3), dtype=np.int64)
        return np.concatenate(patches), np.asarray(grids, dtype=np.int64)

    def _patches(self, pixels: np.ndarray) -> np.ndarray:
        """[H, W, C] uint8 -> [patches, C*P*P]: merge block by merge block (row-major), the
        block's patches row-major, each patch channel by channel (transformers' order)."""
        p, m = self.patch_size, self.merge_size
        rows, cols = pixels.shape[0] // (p * m), pixels.shape[1] // (p * m)
        blocks = pixels.reshape(rows, m, p, cols, m, p, self.channels)
        # (block row, block col, row in block, col in block, channel, pixel row, pixel col)
        return blocks.transpose(0, 3, 1, 4, 6, 2, 5).reshape(rows * cols * m * m, -1)

    def tokens_per_image(self, grid_thw: np.ndarray) -> list[int]:
        """How many `<|image_pad|>` tokens each image becomes: t*h*w // merge_size**2."""
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        return (grid.prod(axis=1) // self.merge_size**2).tolist()


def _setting(processor: object, name: str, size_key: str) -> int:
    """A pixel bound, by its older attribute name or from the `size` of transformers 5."""
    value = getattr(processor, name, None)
    if value is None:
        size = processor.size
        value = size[size_key] if isinstance(size, dict) else getattr(size, size_key)
    return value


def resized_size(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's rule: each side rounded to a multiple of `factor` (one merge block), then the
    whole scaled, keeping the aspect ratio, into [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got "
            f"{max(height, width) / min(height, width)}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ---------------------------------------------------------------------------------------- tokens
def expand_image_tokens(
    ids: list[int], image_token_id: int, counts: list[int], where: str
) -> list[int]:
    """`ids` with its k-th `image_token_id` repeated counts[k] times (one slot per image)."""
    slots = [i for i, token in enumerate(ids) if token == image_token_id]
    if len(slots) != len(counts):
        raise ValueError(
            f"{where}: the prompt has {len(slots)} image slots (token {image_token_id}, "
            f"<|image_pad|>, one per image inside <|vision_start|>...<|vision_end|>) but "
            f"{len(counts)} images were given"
        )
    out: list[int] = []
    previous = 0
    for slot, count in zip(slots, counts, strict=True):
        out.extend(ids[previous:slot])
        out.extend([image_token_id] * count)
        previous = slot + 1
    out.extend(ids[previous:])
    return out


def image_hash(patches: np.ndarray, grid_thw: Sequence[int] | np.ndarray) -> int:
    """A stable 63-bit hash of one image's patch bytes and grid (fits a signed int64)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.ascontiguousarray(grid_thw, dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(patches, dtype=np.uint8).tobytes())
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)
