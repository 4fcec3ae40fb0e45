"""What makes a run's rows what they are: the identity its fingerprint hashes.

Everything that can change an output row is in: the model (its config and tokenizer files,
and a sampled hash of each weight file), the LoRA adapters' files, the engine arguments that
change numerics, the input's content, the prompt, the flow's prompt variables, the sampling parameters, the seed.
A value set to the engine's default counts as not set (the Prefect form writes out every
field it shows). What only changes speed or memory (max_running_requests, max_in_flight, shard_size, ...), how
many engines share the work (the `parallel` section; an engine's data-parallel copies: dp_size,
load_balance_method; which GPUs: base_gpu_id, gpu_id_step) and where results go (output_dir,
run_name) are out, so tuning them resumes the same run, whatever the worker count was before.
tp_size is in: a tensor-parallel engine sums its partial products in another order.

NOTE: the identity is of the config as written (flows/run/lock.py), never of its copy whose
paths were made absolute (flows/run/paths.py): the text of engine.lora_paths is in it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from flows.config import RunConfig
from flows.inputs.sources import content_digest
from flows.run.preflight import Checked

# Engine arguments that change speed or memory, never a row's tokens.
PERFORMANCE_ARGS = frozenset({
    "mem_fraction_static", "max_total_tokens", "max_running_requests", "max_prefill_tokens",
    "chunked_prefill_size", "schedule_policy", "page_size", "disable_radix_cache",
    "cuda_graph_max_bs", "prefill_cuda_graph_max_tokens", "disable_cuda_graph",
    "disable_overlap_schedule", "log_level",
    "stream_interval", "base_gpu_id", "random_seed", "model_path", "tokenizer_path",
    "dp_size", "load_balance_method", "gpu_id_step",
})  # fmt: skip

_SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "chat_template.json")  # fmt: skip
_SAMPLE_BYTES = 1 << 20


def run_identity(config: RunConfig, checked: Checked) -> dict[str, Any]:
    from engine import SamplingParams, ServerArgs  # (lazily: importing the flows loads no torch)

    engine_args = config.engine.arguments()
    engine = {k: v for k, v in engine_args.items() if k not in PERFORMANCE_ARGS}
    identity = {
        "model": model_identity(engine_args["model_path"], checked.tokenizer_path),
        "engine": _set_apart_from_defaults(engine, ServerArgs.rules()),
        "source": {
            "sha256": content_digest(config.source),
            "format": checked.source_format,
            "id_column": config.source.id_column,
        },
        "prompt": _prompt_identity(config),
        "template_variables": config.template_variables(),
        "samples_per_row": config.samples_per_row,
        "sampling": _set_apart_from_defaults(config.sampling_params(), SamplingParams.rules()),
        "seed": config.seed,
        "logprobs": [config.logprobs, config.top_logprobs],
    }
    # NOTE: only where adapters are used: the runs of earlier versions keep their fingerprints
    if config.lora is not None or config.lora_column is not None:
        identity["lora"] = [config.lora, config.lora_column]
    if adapters := adapters_identity(engine_args):
        identity["adapters"] = adapters
    if config.prompt.image_column is not None:  # the pictures themselves (inputs/image_column.py)
        identity["images"] = checked.images_digest
    return identity


def _set_apart_from_defaults(values: dict[str, Any], rules: dict[str, Any]) -> dict[str, Any]:
    """The values a config sets to other than the engine's defaults: a value written out as
    the default (the Prefect form sends every untouched toggle: `ignore_eos: false`) makes the
    same rows as one left out, so it is the same run. (A run whose config left defaults out
    keeps its fingerprint.)"""
    return {k: v for k, v in values.items() if k not in rules or v != rules[k].default}


def _prompt_identity(config: RunConfig) -> dict[str, Any]:
    prompt = config.prompt.model_dump()
    for field in ("image_column", "messages_column"):
        if prompt[field] is None:  # (the runs of earlier versions keep their fingerprints)
            del prompt[field]
    return prompt


def adapters_identity(engine_args: dict[str, Any]) -> dict[str, Any]:
    """Of each LoRA adapter of engine.lora_paths, by name: hashes of its config and weights
    (adapters are small: read whole), so a retrained adapter starts a new run folder."""
    from engine import ServerArgs

    adapters = ServerArgs.from_kwargs(**engine_args).lora_adapters
    identity = {}
    for name, folder in sorted(adapters.items()):
        files = sorted(Path(folder).glob("adapter_model*.safetensors"))
        files += [Path(folder) / "adapter_config.json"]
        identity[name] = {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()
        }
    return identity


def model_identity(model_path: str, tokenizer_path: str) -> dict[str, Any]:
    """Hashes of the small files; of each weight file its size and a hash of its first and last
    MiB, which tells retrained weights apart without reading gigabytes."""
    files: dict[str, str] = {}
    for folder in dict.fromkeys((Path(model_path), Path(tokenizer_path))):
        for name in _SMALL_FILES:
            path = folder / name
            if path.is_file():
                files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    weights = {p.name: _sampled_hash(p) for p in sorted(Path(model_path).glob("*.safetensors"))}
    return {"files": files, "weights": weights}


def _sampled_hash(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, size - _SAMPLE_BYTES))
        digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()
