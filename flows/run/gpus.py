"""Which GPUs each engine of a local Dask cluster takes.

One engine runs engine.tp_size * engine.dp_size scheduler ranks, rank i on GPU
base_gpu_id + i * gpu_id_step (the engine's rule: ServerArgs.gpu_ids). The engines of a local
cluster share the host's GPUs, so part k's engine gets a base_gpu_id of its own, chosen so that
no two engines share a GPU and, with a gpu_id_step of s, the GPUs between one engine's are the
next engines' (s=1: 0-3, 4-7, ...; s=2 with 2 ranks: 0,2 / 1,3 / 4,6 / 5,7).

On a cluster at `parallel.address` each worker sees only its own GPUs (CUDA_VISIBLE_DEVICES,
as dask-cuda sets it), so every engine takes the engine section's arguments as they are.
"""

from __future__ import annotations

from typing import Any

from flows.config import RunConfig


def engine_base_gpu(config: RunConfig, index: int) -> int:
    """The base_gpu_id of part `index`'s engine on a local cluster.

    NOTE: part k = q * s + r (s: gpu_id_step) starts at base + r + q * ranks * s: the s
    engines of one group interleave, each group takes ranks * s GPUs after the last one's."""
    arguments = config.engine.arguments()
    step = int(arguments.get("gpu_id_step", 1))
    group, offset = divmod(index, step)
    return int(arguments.get("base_gpu_id", 0)) + offset + group * config.gpus_per_worker * step


def engine_gpus(config: RunConfig, index: int) -> list[int]:
    """The GPUs of part `index`'s engine on a local cluster, one per scheduler rank."""
    step = int(config.engine.arguments().get("gpu_id_step", 1))
    base = engine_base_gpu(config, index)
    return [base + rank * step for rank in range(config.gpus_per_worker)]


def engine_arguments(config: RunConfig, index: int, local: bool) -> dict[str, Any]:
    """Part `index`'s Engine(...) arguments: on a local cluster its own GPUs (above); on a
    remote one each worker sees only its own GPUs, so the engine section as configured."""
    arguments = config.engine.arguments()
    if local:
        arguments["base_gpu_id"] = engine_base_gpu(config, index)
    return arguments
