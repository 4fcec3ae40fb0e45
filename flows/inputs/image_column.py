"""Rows with an image: `prompt.image_column` names an input column whose value goes to the
engine as the row's `image_data` (a vision-language model: engine/frontend/image_inputs.py).

A value is a file path (a relative one is read from the input file's folder), an http(s) or
data URL, a base64 string, or bytes (a Parquet binary column); null or empty: a text-only row.
The prompt holds the model's image placeholder where the template writes `{{ image }}`, or
before the row's text when it does not.

What the run's fingerprint takes of the images (`ImagesDigest`): the bytes of every file and
every bytes value, and URLs as written (their content is not fetched before the run), so an
edited picture under the same name starts a new run folder.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# how load_image reads a str that is not a file (the rest of a str is a path)
_NOT_A_PATH = ("http://", "https://", "data:")
_IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".ppm"}
)


def image_placeholder(model_path: str | Path, tokenizer_path: str | Path) -> str:
    """The text the model's tokenizer turns into one image slot: Qwen's
    `<|vision_start|><|image_pad|><|vision_end|>`, by the ids config.json names and the
    added tokens of tokenizer.json (read without loading transformers)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    ids = [config.get(name) for name in names]
    if None in ids:
        raise ValueError(f"{model_path} names no image tokens ({', '.join(names)}) in config.json")
    added = json.loads((Path(tokenizer_path) / "tokenizer.json").read_text()).get("added_tokens")
    text = {token["id"]: token["content"] for token in added or []}
    missing = [i for i in ids if i not in text]
    if missing:
        raise ValueError(f"the tokenizer in {tokenizer_path} has no added tokens {missing}")
    return "".join(text[i] for i in ids)


def resolve_image(value: Any, base: Path) -> Any:
    """A cell of the image column as image_data: None for no image, a relative path made
    absolute from the input's folder, anything else as it is."""
    if value is None or (isinstance(value, (str, bytes)) and not value):
        return None
    if isinstance(value, str) and not value.startswith(_NOT_A_PATH):
        path = Path(value)
        if not path.is_absolute() and (base / path).is_file():
            return str(base / path)
    return value


class ImagesDigest:
    """A sha256 over the images of a column, in row order, fed a batch of rows at a time
    (`add_values`, from row `first` on), and what cannot be read, by row (a path that names
    no file, a value of another type)."""

    def __init__(self, base: Path) -> None:
        self.base, self.sha = base, hashlib.sha256()
        self.problems: list[str] = []

    def add_values(self, values: Iterable[Any], first: int) -> None:
        for row, value in enumerate(values, first):
            self._add(row, resolve_image(value, self.base))

    def value(self) -> str:
        return self.sha.hexdigest()

    def _add(self, row: int, value: Any) -> None:
        if value is None:
            self.sha.update(b"\0none")
        elif isinstance(value, bytes):
            self.sha.update(b"\0bytes" + hashlib.sha256(value).digest())
        elif not isinstance(value, str):
            self.problems.append(
                f"row {row}: {type(value).__name__} is not an image (path, URL, bytes)"
            )
        elif not value.startswith(_NOT_A_PATH) and Path(value).is_file():
            self.sha.update(b"\0file" + hashlib.sha256(Path(value).read_bytes()).digest())
        elif _names_a_file(value):
            self.problems.append(f"row {row}: no file {value!r} (relative paths: from {self.base})")
        else:  # a URL, or base64
            self.sha.update(b"\0text" + value.encode())


def _names_a_file(value: str) -> bool:
    """A str meant as an image file's name (base64 of an image is long, and has no suffix)."""
    return len(value) < 1024 and Path(value).suffix.lower() in _IMAGE_SUFFIXES
