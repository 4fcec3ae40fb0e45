"""Check a config against the world before any engine starts: files, model folder, engine and
sampling rules, and the whole input (every line parses and decodes, ids are present and
unique, the columns the config names exist, there is a row). The input streams past once
(flows/inputs/sources.py: load_input); what the checks need of its rows they tally as it passes
(`_tallies`: a column's adapter names, its bad chat messages, its pictures' digest). Every
problem is collected and raised as one ConfigError that names each field, so a user fixes a
config in one round, not one error at a time.

The engine's own validators are the judges (ServerArgs, ModelConfig, SamplingParams): they run
here without starting a process, so the flows never drift from what the engine accepts.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from flows.config import ConfigError, EngineConfig, RunConfig
from flows.inputs.image_column import ImagesDigest
from flows.inputs.prompts import chat_messages, has_chat_template, template_names
from flows.inputs.sources import TEXT_FORMATS, load_input
from flows.inputs.summary import Input, Tallies, column_of, id_problems
from flows.run.gpus import engine_gpus


@dataclass(frozen=True)
class Checked:
    """What the checks learned that later steps use."""

    columns: list[str]
    source_format: str
    tokenizer_path: str
    images_digest: str | None = None  # of prompt.image_column's pictures (inputs/image_column.py)


def preflight(config: RunConfig) -> Checked:
    problems: list[tuple[str, str]] = []
    tokenizer_path = check_engine(config.engine, problems)
    _check_sampling(config, problems)
    loaded = _check_source(config, problems)
    columns = loaded.schema.names if loaded is not None else []
    if loaded is not None:
        _check_columns(config, columns, problems)
        _check_lora(config, loaded, problems)
        _check_messages(config, loaded, problems)
        digest = _check_images(config, loaded, problems)
        id_column = config.source.id_column
        if id_column is not None and id_column in columns:
            problems += id_problems(loaded, id_column)
    if (
        config.prompt.uses_chat_template
        and tokenizer_path
        and not has_chat_template(tokenizer_path)
    ):
        where = "prompt.chat" if config.prompt.chat else "prompt.messages_column"
        problems.append((where, f"the tokenizer in {tokenizer_path} has no chat template"))
    if not any(where.startswith("engine.") for where, _ in problems):
        _check_gpus(config, problems)  # it reads engine arguments that passed their own checks
    problems += config.flow_problems()
    if problems:
        raise ConfigError(problems)
    return Checked(
        columns, loaded.format if loaded else "", tokenizer_path,
        digest if loaded else None,
    )  # fmt: skip


def check_engine(engine: EngineConfig, problems: list[tuple[str, str]]) -> str:
    """The engine section by the engine's own rules (each argument, then all together, then
    the model folder): its tokenizer's folder, or "" with the problems added."""
    from engine import ModelConfig, ServerArgs  # lazily: importing the flows loads no torch

    args = engine.arguments()
    model_path = args.pop("model_path")
    try:
        server_args = ServerArgs.from_kwargs(model_path=model_path, **args)
    except ValueError as whole:
        # one argument at a time, so each message is pinned on the field that caused it (a
        # speculative_* argument with the algorithm it belongs to); else the section's message
        algorithm = {k: v for k, v in args.items() if k == "speculative_algorithm"}
        bad = [
            (f"engine.{name}", str(e))
            for name, value in args.items()
            if (e := _refusal(
                ServerArgs.from_kwargs, model_path=model_path,
                **{**(algorithm if name.startswith("speculative_") else {}), name: value},
            ))
        ]  # fmt: skip
        problems += bad or [("engine", str(whole))]
        return ""
    if e := _refusal(
        ModelConfig.from_folder, model_path, server_args.dtype, server_args.context_length
    ):
        problems.append(("engine.model_path", str(e)))
        return ""
    return str(server_args.tokenizer_path)


def _check_gpus(config: RunConfig, problems: list[tuple[str, str]]) -> None:
    """A local cluster's engines take GPUs of their own (flows/run/gpus.py): they must exist."""
    parallel, args = config.parallel, config.engine.arguments()
    if not parallel.on_dask or parallel.address is not None or args.get("device") == "cpu":
        return
    if args.get("device") not in (None, "cuda"):
        problems.append(
            ("engine.device", f"names one device ({args['device']}); parallel workers each "
             "take their own GPUs from base_gpu_id: use device 'cuda' or leave it unset")
        )  # fmt: skip
        return
    import torch

    if not torch.cuda.is_available():
        return  # the engines run on the CPU
    gpus = [gpu for part in range(parallel.workers) for gpu in engine_gpus(config, part)]
    if max(gpus) >= torch.cuda.device_count():
        step = args.get("gpu_id_step", 1)
        problems.append(
            ("parallel.workers", f"{parallel.workers} workers of {config.gpus_per_worker} GPU(s) "
             f"from base_gpu_id {min(gpus)}{f' (gpu_id_step {step})' if step != 1 else ''} "
             f"need GPUs {min(gpus)}..{max(gpus)}, but {torch.cuda.device_count()} are visible")
        )  # fmt: skip


def _refusal(check: Any, *args: Any, **kwargs: Any) -> ValueError | None:
    try:
        check(*args, **kwargs)
    except ValueError as e:
        return e
    return None


def _check_sampling(config: RunConfig, problems: list[tuple[str, str]]) -> None:
    from engine import SamplingParams

    params = config.sampling.arguments()
    if "sampling_seed" in params:
        problems.append(
            ("sampling.sampling_seed", "set by the flow from seed and each row's id; set seed")
        )
        return
    for where, sampling in (("sampling", params), (config.flow, config.sampling_params())):
        try:
            SamplingParams.from_dict(sampling)
        except ValueError as e:
            problems.append((where, str(e)))
            return


def _check_source(config: RunConfig, problems: list[tuple[str, str]]) -> Input | None:
    """The input summed up, every row read once (the summary stays for the run:
    flows/inputs/sources.py), or None."""
    try:
        loaded = load_input(config.source, _tallies(config))
    except ConfigError as e:
        problems += e.problems
        return None
    if loaded.format not in TEXT_FORMATS and codecs.lookup(loaded.encoding).name != "utf-8":
        problems.append(("source.encoding", f"applies to JSONL and CSV; {loaded.format} is UTF-8"))
    return loaded


def _check_columns(config: RunConfig, columns: list[str], problems: list[tuple[str, str]]) -> None:
    have = set(columns)
    id_column = config.source.id_column
    if id_column is not None and id_column not in have:
        problems.append(("source.id_column", _missing(id_column, columns)))
    extras = set(config.template_variables()) | {"row"}
    if config.prompt.image_column is not None:
        extras.add("image")
    for name in sorted(template_names(config.prompt.template or "") - have - extras):
        problems.append(("prompt.template", _missing(name, columns)))
    for column, where in config.needed_columns().items():
        if column not in have:
            problems.append((where, _missing(column, columns)))


def _check_lora(config: RunConfig, loaded: Input, problems: list[tuple[str, str]]) -> None:
    """`lora` names an adapter of engine.lora_paths; `lora_column` exists and names only them."""
    if config.lora is None and config.lora_column is None:
        return
    from engine import ServerArgs

    try:
        names = set(ServerArgs.from_kwargs(**config.engine.arguments()).lora_adapters)
    except ValueError:
        return  # (the engine section's own problem, reported by check_engine)
    known = f"engine.lora_paths has {sorted(names)}" if names else "engine.lora_paths is empty"
    if config.lora is not None and config.lora not in names:
        problems.append(("lora", f"names adapter {config.lora!r}, which is not loaded: {known}"))
    column = config.lora_column
    if column is None:
        return
    if column not in loaded.schema.names:
        problems.append(("lora_column", _missing(column, loaded.schema.names)))
        return
    values = {v for v in _tally(loaded, "lora", column).values if v}
    unknown = sorted(str(v) for v in values - names)
    if unknown:
        problems.append(
            ("lora_column", f"column {column!r} names adapters that are not loaded: "
             f"{', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}; {known}")
        )  # fmt: skip


def _check_messages(config: RunConfig, loaded: Input, problems: list[tuple[str, str]]) -> None:
    """Every row of `prompt.messages_column` is a list of chat messages (the first few bad
    rows named)."""
    column = config.prompt.messages_column
    if column is None:
        return
    if column not in loaded.schema.names:
        problems.append(("prompt.messages_column", _missing(column, loaded.schema.names)))
        return
    bad = _tally(loaded, "messages", column)
    if bad.count:
        more = f" (and {bad.count - 5} more)" if bad.count > 5 else ""
        problems.append(("prompt.messages_column", "; ".join(bad.first) + more))


def _check_images(config: RunConfig, loaded: Input, problems: list[tuple[str, str]]) -> str | None:
    """`prompt.image_column` exists, every file it names does, and the model takes images:
    the digest of its pictures for the fingerprint."""
    column = config.prompt.image_column
    if column is None:
        return None
    from engine import ModelConfig

    # NOTE: taken out of the summary, which outlives this check while the input is unchanged:
    # a picture may change while the input does not, so every check hashes them anew
    images = loaded.tallies.pop(("images", column))
    where = "prompt.image_column"
    if column not in loaded.schema.names:
        problems.append((where, _missing(column, loaded.schema.names)))
        return None
    model_path = config.engine.arguments()["model_path"]
    try:
        model = ModelConfig.from_folder(str(model_path))
    except ValueError:
        return None  # (engine.model_path's own problem, reported by check_engine)
    if not model.is_vision_language:
        problems.append(
            (where, f"the model in {model_path} ({model.architecture}) takes text only: images "
             "need a vision-language model (Qwen2.5-VL)")
        )  # fmt: skip
    digest, unreadable = images.value(), images.problems
    if unreadable:
        more = f" (and {len(unreadable) - 5} more)" if len(unreadable) > 5 else ""
        problems.append((where, "; ".join(unreadable[:5]) + more))
    return digest


# ---------------------------------------------------------------------- what the checks tally
def _tallies(config: RunConfig) -> Tallies:
    """What the checks keep of the rows as they stream past, by (check, column)."""
    wanted: dict[Any, Any] = {}
    if (column := config.lora_column) is not None:
        wanted[("lora", column)] = partial(_Distinct, column)
    if (column := config.prompt.messages_column) is not None:
        wanted[("messages", column)] = partial(_BadMessages, column)
    if (column := config.prompt.image_column) is not None:
        wanted[("images", column)] = partial(_Images, column, config.source.path.parent)
    return wanted


def _tally(loaded: Input, check: str, column: str) -> Any:
    return loaded.tallies[(check, column)]


class _Distinct:
    """A column's distinct values (an adapter name per row: a few)."""

    def __init__(self, column: str) -> None:
        self.column, self.values = column, set()

    def add(self, table: pa.Table, first: int) -> None:
        self.values.update(pc.unique(column_of(table, self.column)).to_pylist())


class _BadMessages:
    """The rows whose cell is no list of chat messages: how many, the first few worded."""

    def __init__(self, column: str) -> None:
        self.column, self.count, self.first = column, 0, []

    def add(self, table: pa.Table, first: int) -> None:
        for row, value in enumerate(column_of(table, self.column).to_pylist(), first):
            try:
                chat_messages(value)
            except ValueError as e:
                self.count += 1
                if len(self.first) < 5:
                    self.first.append(f"row {row}: {e}")


class _Images(ImagesDigest):
    """The digest of a column's pictures, row by row (flows/inputs/image_column.py)."""

    def __init__(self, column: str, base: Path) -> None:
        super().__init__(base)
        self.column = column

    def add(self, table: pa.Table, first: int) -> None:  # type: ignore[override]
        self.add_values(column_of(table, self.column).to_pylist(), first)


def _missing(column: str, columns: list[str]) -> str:
    return f"names column {column!r}, which the input does not have (columns: {', '.join(columns)})"
