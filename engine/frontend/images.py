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
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from engine.multimodal.pixels import normalization_table, patch_bytes

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
    """The model folder's image processor (preprocessor_config.json), its numpy (PIL) path.

    `process` returns each image's patches as bytes (engine/multimodal/pixels.py: what the
    processor's float pixels are before rescale and normalize, one copy per patch), with the
    table that turns them into the processor's float32 values bit for bit. NOTE: always the
    PIL path, whatever transformers would choose: its resized pixels are whole bytes, and the
    same on every machine (the torchvision path resizes otherwise).
    """

    def __init__(self, model_path: str) -> None:
        # (Qwen2-VL's processor, which Qwen2.5-VL folders name: the one family served)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        self._processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        p = self._processor
        self.merge_size = int(p.merge_size)
        self.temporal_patch_size = int(p.temporal_patch_size)
        self.channels = 3
        self.table = normalization_table(float(p.rescale_factor), p.image_mean, p.image_std)

    def process(
        self, images: Sequence[Image.Image], where: str = "image_data"
    ) -> tuple[np.ndarray, np.ndarray]:
        """`patches` uint8 [num_patches, C*P*P] and `image_grid_thw` int64 [n, 3].

        One image at a time, so a refused image (too thin: aspect ratio over 200) is named as
        `{where}[k]`; the concatenation equals what one call on the whole list returns.
        """
        patches, grids = [], []
        for k, image in enumerate(images):
            try:
                out = self._processor(
                    images=[image], return_tensors="np", do_rescale=False, do_normalize=False
                )
            except ValueError as exc:
                raise ValueError(
                    f"{where}[{k}]: the image processor refused the {image.width}x"
                    f"{image.height} image: {exc}"
                ) from exc
            raw = np.asarray(out["pixel_values"], dtype=np.float32)
            patches.append(patch_bytes(raw, self.channels, self.temporal_patch_size))
            grids.append(np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3))
        width = self.channels * int(self._processor.patch_size) ** 2
        if not patches:
            return np.zeros((0, width), dtype=np.uint8), np.zeros((0, 3), dtype=np.int64)
        return np.concatenate(patches), np.concatenate(grids)

    def tokens_per_image(self, grid_thw: np.ndarray) -> list[int]:
        """How many `<|image_pad|>` tokens each image becomes: t*h*w // merge_size**2."""
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        return (grid.prod(axis=1) // self.merge_size**2).tolist()


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
