"""Hugging Face datasets in and out, through the `datasets` library (imported only when used).

In: `source.path` may be a folder that `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
wrote (read with `datasets.load_from_disk`; `source.split` picks a split of a DatasetDict,
default `train`), or a folder of Parquet shards named by split as the Hub lays them out
(`data/train-00000-of-00002.parquet`, ...), whose files of `source.split` datasets' own
split patterns pick (flows/sources.py then reads them as any Parquet folder).

Out: `gristmill export RUN --to hf-dataset DIR` writes a run's merged output as a dataset
that `datasets.load_from_disk(DIR)` opens, with the rows and columns of output.parquet.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pyarrow as pa


def is_saved_dataset(path: Path) -> bool:
    """A folder written by save_to_disk: a Dataset's state.json, or a DatasetDict's index."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("state.json", "dataset_dict.json")
    )


def load_saved_dataset(path: Path, split: str | None) -> tuple[pa.Table, str, str]:
    """(its rows as an Arrow table, in order; the split read, or "" for a Dataset; a sha256 of
    its data files and the split). ValueError saying what is wrong, naming the splits."""
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
        dataset, split = loaded[chosen], chosen
    elif split is not None:
        raise ValueError(f"{path} is a single dataset, with no splits: leave source.split unset")
    else:
        dataset, split = loaded, ""
    table = dataset.with_format("arrow")[:]  # (the rows in the dataset's order, indices applied)
    digest = hashlib.sha256(f"split:{split}\0".encode())
    for entry in sorted(dataset.cache_files, key=lambda f: f["filename"]):
        file = Path(entry["filename"])
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return table, split, digest.hexdigest()


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
