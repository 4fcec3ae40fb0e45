"""Run configuration: one pydantic model, from a YAML file, `--set` overrides or Prefect parameters.

    run_name: reviews-sentiment
    output_dir: runs
    engine: {model_path: /models/Qwen3-0.6B}
    source: {path: data/reviews.jsonl, id_column: review_id}
    prompt: {template: "Review: {{ text }}", chat: true, system: "You label reviews."}
    sampling: {temperature: 0, max_new_tokens: 16}
    parallel: {workers: 4, address: tcp://10.0.0.5:8786}  # optional: engines on many hosts

The models check the shape of a config (types, unknown fields, ranges, template syntax);
`flows.run.preflight` checks it against the world (files, the model folder, the engine's argument
and sampling rules, the whole input: its lines, encoding, ids and columns). Both raise
`ConfigError`, whose message names every bad field, so a config fails in one clear error
before any engine starts.

The three ready flows subclass `RunConfig` (flows/annotate.py, synthesize.py, evaluate.py); what
a subclass changes in the generated rows goes through the hooks at the end of `RunConfig`, so
the fingerprint picks it up without knowing the flow.
"""

from __future__ import annotations

import codecs
import difflib
import encodings.aliases
import re
from pathlib import Path
from typing import Any, Literal

import jinja2
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.engine_sections import EngineConfig, SamplingConfig, form_schema


class ConfigError(ValueError):
    """A config that cannot run; `problems` are (field path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = [f"{where}: {message}" if where else message for where, message in problems]
        head = "invalid config" if len(lines) == 1 else f"invalid config ({len(lines)} problems)"
        super().__init__(f"{head}: " + "; ".join(lines))

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[tuple[str, str]]]]:
        return ConfigError, (self.problems,)  # picklable, for Prefect's states and subprocesses


class Section(BaseModel):
    """A config section: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=form_schema)


class SourceConfig(Section):
    path: Path = Field(
        description="a JSONL, CSV or Parquet file, a folder of them, or a Hugging Face dataset "
        "folder (save_to_disk)"
    )
    format: Literal["jsonl", "csv", "parquet"] | None = Field(
        None, description="default: from the file suffix"
    )
    id_column: str | None = Field(
        None, description="a column of unique row ids; default: the row's position in the input"
    )
    encoding: str = Field("utf-8", description="of a JSONL or CSV file's text, e.g. latin-1")
    split: str | None = Field(
        None,
        description="a split of a Hugging Face dataset folder (save_to_disk, or Parquet shards "
        "named by split); default train",
    )

    @field_validator("encoding")
    @classmethod
    def _is_an_encoding(cls, encoding: str) -> str:
        try:
            codecs.lookup(encoding)
        except LookupError:
            names = sorted({name.replace("_", "-") for name in encodings.aliases.aliases.values()})
            close = difflib.get_close_matches(encoding.lower().replace("_", "-"), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"unknown encoding {encoding!r}: {hint}e.g. utf-8, latin-1, cp1252, utf-16"
            ) from None
        try:
            b"a".decode(encoding)
        except LookupError:  # base64, zlib, ...: codecs of bytes to bytes
            raise ValueError(f"{encoding!r} is not a text encoding") from None
        except UnicodeDecodeError:
            pass  # a text encoding (utf-16 wants two bytes)
        return encoding


class PromptConfig(Section):
    template: str | None = Field(
        None, description="Jinja over the row's columns, e.g. 'Review: {{ text }}'"
    )
    chat: bool = Field(False, description="wrap the rendered text in the model's chat template")
    system: str | None = Field(None, description="a system message (chat only)")
    messages_column: str | None = Field(
        None,
        description="instead of a template: an input column of chat messages (lists of role / "
        "content), rendered with the model's chat template; system first where a row has none",
    )
    image_column: str | None = Field(
        None,
        description="an input column of images (paths from the input's folder, URLs, bytes) "
        "for a vision-language model; the template places each with {{ image }}, else first",
    )

    @field_validator("template")
    @classmethod
    def _parses(cls, template: str | None) -> str | None:
        if template is None:
            return None
        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"not a valid Jinja template (line {e.lineno}: {e.message})") from None
        return template

    @model_validator(mode="after")
    def _one_source_of_prompts(self) -> PromptConfig:
        if (self.template is None) == (self.messages_column is None):
            raise ValueError("give either template or messages_column (a column of chat messages)")
        if self.messages_column is not None and self.image_column is not None:
            raise ValueError("image_column goes with a template, not with messages_column (yet)")
        return self

    @model_validator(mode="after")
    def _system_needs_chat(self) -> PromptConfig:
        if self.system is not None and not self.chat and self.messages_column is None:
            raise ValueError("system needs chat: true (it is a chat message)")
        return self

    @property
    def uses_chat_template(self) -> bool:
        """Whether prompts go through the tokenizer's chat template (chat rows always do)."""
        return self.chat or self.messages_column is not None


_SCHEDULER_ADDRESS = re.compile(r"^((tcp|tls|ucx|ws|wss)://)?[^\s/]+:\d{1,5}$")


class ParallelConfig(Section):
    """Where the engines run: one engine in the flow's process, or one per Dask worker.

    Many GPUs of one host: one engine, in the flow's own process, over all of them, through
    the engine section: `engine.tp_size` GPUs per model copy, `engine.dp_size` copies, each
    request sent to one copy by `engine.load_balance_method` (default prefix_aware: where its
    prefix is cached). Leave this section out.

    Many hosts: `address`, the scheduler of a running Dask cluster, and `workers` engines, each
    resident in one Dask worker (flows/parallel/generate.py). The rows still to do are handed out in
    batches of `batch_rows` as engines become free, so one that finishes early takes more and
    none waits for a slow one at the end; every engine writes shards into the same run folder,
    which must be on a filesystem all hosts share (every path of the config is made absolute
    in the calling process: flows/run/paths.py). Each Dask worker is assumed to see only its own
    GPUs (CUDA_VISIBLE_DEVICES set by the cluster, as dask-cuda does), so the engine section is
    used as given, and should run one thread.

    `workers` > 1 without an `address` starts a local cluster of `workers` processes for the
    run, part i's engine on GPUs of its own (flows/run/gpus.py: base_gpu_id + i * gpus_per_worker
    onward). None of these fields changes a row, so none is in the fingerprint: a run resumes
    whatever its worker count was before.
    """

    workers: int = Field(
        1, ge=1, description="engines generating at once, one per Dask worker (1: in the flow)"
    )
    gpus_per_worker: int | None = Field(
        None,
        ge=1,
        description="GPUs per engine: engine.tp_size x engine.dp_size (its default); sets "
        "tp_size when that is unset",
    )
    address: str | None = Field(
        None,
        description="a Dask scheduler for engines on many hosts, e.g. tcp://10.0.0.5:8786; "
        "none: a local cluster of `workers` processes",
    )
    batch_rows: int | None = Field(
        None, ge=1, description="rows an engine takes at a time; default max_in_flight"
    )

    @field_validator("address")
    @classmethod
    def _is_a_scheduler_address(cls, address: str | None) -> str | None:
        if address is not None and not _SCHEDULER_ADDRESS.match(address):
            raise ValueError(
                f"must be a Dask scheduler address like tcp://10.0.0.5:8786, got {address!r}"
            )
        return address

    @property
    def on_dask(self) -> bool:
        """Whether generation goes to Dask workers rather than an engine in the flow's process."""
        return self.workers > 1 or self.address is not None


class RunBase(Section):
    """What every run's config names: its flow, its results folder and its engine."""

    flow: str = Field(description="which flow runs the config")  # a Literal in each flow's
    run_name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        title="Results folder name",
        description="names the run's folder in output_dir (not Prefect's flow-run name): "
        "letters, digits, '.', '_', '-'",
    )
    output_dir: Path = Field(
        Path("runs"),
        description="where results go; a relative path starts at the run's working directory",
    )
    engine: EngineConfig = Field(description="the inference engine: its model and arguments")
    price_per_gpu_hour: float | None = Field(
        None,
        ge=0,
        description="what one GPU-hour costs (any currency): the summary then gives the run's "
        "cost, and --dry-run the most it can cost",
    )

    @property
    def gpus(self) -> int:
        """GPUs the run's engine holds: tensor-parallel size x data-parallel size."""
        arguments = self.engine.arguments()
        return int(arguments.get("tp_size", 1)) * int(arguments.get("dp_size", 1))


class RunConfig(RunBase):
    """A batch run: every row of `source` rendered by `prompt` and generated with `sampling`."""

    flow: Literal["generate"] = Field("generate", description="which flow runs the config")
    source: SourceConfig = Field(description="the input rows")
    prompt: PromptConfig = Field(description="how a row becomes a prompt")
    sampling: SamplingConfig = Field(
        SamplingConfig(), description="how tokens are chosen (SGLang's sampling parameters)"
    )
    seed: int = Field(0, description="with each row's id, gives the row's sampling seed")
    shard_size: int = Field(1000, ge=1, description="rows per checkpoint shard")
    max_in_flight: int = Field(256, ge=1, description="requests in the engine at once")
    logprobs: bool = Field(False, description="keep the generated tokens' logprobs")
    top_logprobs: int = Field(
        0, ge=0, description="keep the top-k logprobs per token (needs logprobs)"
    )
    parallel: ParallelConfig = Field(
        ParallelConfig(),
        description="engines on many hosts, through Dask (default: one engine in the flow; "
        "many GPUs of one host: engine.dp_size / tp_size)",
    )
    lora: str | None = Field(
        None, description="the LoRA adapter every row uses: a name of engine.lora_paths"
    )
    lora_column: str | None = Field(
        None, description="an input column naming each row's LoRA adapter (empty: the base model)"
    )

    @model_validator(mode="after")
    def _one_way_to_name_an_adapter(self) -> RunConfig:
        if self.lora is not None and self.lora_column is not None:
            raise ValueError("lora and lora_column both name adapters: give one of them")
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> RunConfig:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("parallel")
    @classmethod
    def _gpus_per_worker_is_tp_times_dp(cls, parallel: ParallelConfig, info: Any) -> ParallelConfig:
        engine = info.data.get("engine")  # validated before parallel (fields go in order)
        if engine is None or parallel.gpus_per_worker is None:
            return parallel
        gpus, tp_size = parallel.gpus_per_worker, getattr(engine, "tp_size", None)
        dp_size = getattr(engine, "dp_size", None) or 1
        if not all(isinstance(n, int) and n >= 1 for n in (tp_size or 1, dp_size)):
            return parallel  # (a bad size is the engine's checks' to report, in preflight)
        if tp_size is not None and gpus != tp_size * dp_size:
            raise ValueError(
                f"gpus_per_worker ({gpus}) and engine.tp_size ({tp_size}) x engine.dp_size "
                f"({dp_size}) disagree: each worker's engine runs on its own GPUs; set one side"
            )
        if tp_size is None and gpus % dp_size:
            raise ValueError(
                f"gpus_per_worker ({gpus}) is not a multiple of engine.dp_size ({dp_size}): "
                "each of the engine's dp_size copies of the model takes tp_size GPUs"
            )
        # NOTE: only a size other than the engine's default 1 goes into the engine's arguments:
        # tp_size is in the fingerprint, and an explicit 1 would move every existing run.
        if tp_size is None and gpus // dp_size > 1:
            engine.tp_size = gpus // dp_size
        return parallel

    # ------------------------------------------------------------------ hooks for the ready flows
    def template_variables(self) -> dict[str, Any]:
        """Names the template may use besides the row's columns."""
        return {}

    @property
    def samples_per_row(self) -> int:
        return 1

    def constraint(self) -> dict[str, Any]:
        """Sampling parameters that constrain the output (regex / json_schema), if any."""
        return {}

    def added_columns(self) -> tuple[str, ...]:
        """Columns the flow's finish step adds to the merged rows."""
        return ()

    def needed_columns(self) -> dict[str, str]:
        """Input columns the flow needs besides the template's: {column: the field naming it}."""
        return {}

    def flow_problems(self) -> list[tuple[str, str]]:
        """Cross-field checks of the flow's own section."""
        return []

    # ------------------------------------------------------------------ derived values
    def sampling_params(self) -> dict[str, Any]:
        return {**self.sampling.arguments(), **self.constraint()}

    @property
    def gpus_per_worker(self) -> int:
        """GPUs of one engine: tensor-parallel size x data-parallel size (its scheduler ranks)."""
        if self.parallel.gpus_per_worker is not None:
            return self.parallel.gpus_per_worker
        arguments = self.engine.arguments()
        return int(arguments.get("tp_size", 1)) * int(arguments.get("dp_size", 1))

    @property
    def gpus(self) -> int:
        """GPUs the run's engines hold: one engine's, times the Dask workers' engines."""
        return self.gpus_per_worker * (self.parallel.workers if self.parallel.on_dask else 1)

    @property
    def batch_rows(self) -> int:
        """Rows a Dask worker's engine takes at a time (flows/parallel/handout.py)."""
        return self.parallel.batch_rows or self.max_in_flight


# ---------------------------------------------------------------------- loading
def load_config(
    data: dict[str, Any] | str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    kind: type[RunConfig] | None = None,
) -> RunConfig:
    """A config from a mapping or a YAML file, with `key.sub=value` overrides (values read as YAML).

    The `flow` key picks the config class among the registered flows unless `kind` is given.
    """
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.is_file():
            raise ConfigError([("", f"config file not found: {path}")])
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError([("", f"{path} is not valid YAML: {e}")]) from None
        if not isinstance(data, dict):
            raise ConfigError([("", f"{path} must hold a mapping of config fields")])
    data = _with_overrides(data, overrides)
    if kind is None:
        kind = config_class(data.get("flow", "generate"))
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_problems(e)) from None


def config_class(flow: object) -> type[RunConfig]:
    from flows.catalog import FLOWS  # the catalog imports the flows, which import this module

    if flow not in FLOWS:
        raise ConfigError([("flow", f"must be one of {', '.join(FLOWS)}; got {flow!r}")])
    return FLOWS[flow].config_class()


def _with_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    data = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError([("--set", f"expected key=value, got {item!r}")])
        value = _yaml_or_text(raw)
        node = data
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([(".".join(parents[: i + 1]), "is not a section")])
            node = child
        node[leaf] = value
    return data


def _yaml_or_text(raw: str) -> Any:
    """A --set value read as YAML (numbers, booleans, lists), else taken as the text it is."""
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def _problems(error: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for e in error.errors():
        where = ".".join(str(part) for part in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            message = "unknown field"
        problems.append((where, message))
    return problems
