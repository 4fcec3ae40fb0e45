"""Hugging Face datasets in and out, through the `datasets` library (imported only when used).

In: `source.path` may be a folder that `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
wrote (opened with `datasets.load_from_disk`, which memory-maps its Arrow files, and read a
batch at a time; `source.split` picks a split of a DatasetDict, default `train`), or a folder of Parquet shards named by split as the Hub lays them out
(`data/train-00000-of-00002.parquet`, ...), whose files of `source.split` datasets' own
split patterns pick (flows/inputs/sources.py then reads them as any Parquet folder).

Out: `gristmill export RUN --to hf-dataset DIR` writes a run's merged output as a dataset
that `datasets.load_from_disk(DIR)` opens, with the rows and columns of output.parquet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

BATCH_ROWS = 65_536  # rows of a batch read from a saved dataset
_READ_BYTES = 16 << 20  # bytes of a data file hashed at a time


def is_saved_dataset(path: Path) -> bool:
    """A folder written by save_to_disk: a Dataset's state.json, or a DatasetDict's index."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("state.json", "dataset_dict.json")
    )


def open_saved_dataset(path: Path, split: str | None) -> tuple[Any, str]:
    """(the dataset, memory-mapped: no row is read yet; the split opened, or "" for a Dataset).
    ValueError saying what is wrong, naming the splits."""
    import datasets

    try:
        loaded: Any = datasets.load_from_disk(str(path))
    except Exception as e:  # (datasets raises FileNotFoundError, ValueError, json errors, ...)
        raise ValueError(
            f"{path} is not a dataset that datasets.load_from_disk opens: {e}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        chosen = split or ("train" if "train" in loaded else None)
        if chosen not in loaded:
            hint = f"source.split {split!r} is not one of them" if split else "set source.split"
            raise ValueError(f"{path} holds the splits {splits}: {hint}")
        return loaded[chosen], chosen
    if split is not None:
        raise ValueError(f"{path} is a single dataset, with no splits: leave source.split unset")
    return loaded, ""


def saved_dataset_digest(dataset: Any, split: str) -> str:
    """A sha256 of the dataset's data files (their names and bytes, read a piece at a time) and
    the split."""
    digest = hashlib.sha256(f"split:{split}\0".encode())
    for entry in sorted(dataset.cache_files, key=lambda f: f["filename"]):
        file = Path(entry["filename"])
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_READ_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def saved_dataset_batches(dataset: Any) -> Iterator[pa.Table]:
    """The rows in the dataset's order (indices applied), BATCH_ROWS at a time: slices of its
    memory-mapped files, so only the pages of the rows in hand are read."""
    yield from dataset.with_format("arrow").iter(batch_size=BATCH_ROWS)


def split_files(folder: Path, split: str) -> list[Path]:
    """The data files of `split` in a folder laid out as on the Hub, by datasets' own rules."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        patterns = get_data_patterns(str(folder))
    except Exception:  # (EmptyDatasetError: no data files at all)
        patterns = {}
    if split not in patterns:
        names = sorted(patterns) or "none"
        raise ValueError(f"folder {folder} has no files of split {split!r} (splits: {names})")
    files = DataFilesDict.from_patterns(patterns, base_path=str(folder))[split]
    return sorted(Path(f) for f in files)


def export_dataset(output: Path, destination: Path) -> int:
    """A run's output.parquet as a dataset saved to `destination`; the number of rows."""
    import datasets

    dataset = datasets.Dataset.from_parquet(str(output), keep_in_memory=True)
    dataset.save_to_disk(str(destination))
    return dataset.num_rows
