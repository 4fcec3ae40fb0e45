"""One GPU, many runs (flows/engines/slots.py): a run that starts an engine of its own takes its
GPU's slot first; while another run's engine holds it, the run waits, says so in its log, and
completes once the slot is given back; its own engine's stop gives the slot back. The GPU is
a name here (the CPU test machine has none); the slots are the Prefect server's own global
concurrency limits."""

from __future__ import annotations

import logging
import threading

from flows.config import load_config
from flows.engines.slots import GpuSlots, slot_names
from tests.flows.fixtures import (
    base_config,
    engine_arguments,
    lent_engine,
    question_rows,
    run_folder,
    wait_until,
    write_jsonl,
)

SLOT = "gristmill-gpu-test"


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_second_run_waits_for_the_gpu_then_completes(
    prefect_api, shared_llama_engine, llama_dir, tmp_path, monkeypatch
):
    from flows.pipeline import generate_batch

    monkeypatch.setattr("flows.engines.resident.slot_names", lambda arguments: [SLOT])
    source = write_jsonl(tmp_path / "q.jsonl", question_rows(6, seed=51))
    config = load_config(base_config(llama_dir, source, tmp_path / "runs"))
    other = GpuSlots([SLOT])
    other.take()  # another run's engine holds the GPU
    said = _Said()
    logging.getLogger("prefect").addHandler(said)
    states = []

    def run() -> None:
        with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
            states.append(generate_batch(config=config, return_state=True))

    second = threading.Thread(target=run)
    try:
        second.start()
        wait_until(lambda: any("waiting for GPU slot(s) gristmill-gpu-test" in line
                               for line in said.lines), timeout=60, what="the wait")  # fmt: skip
        second.join(timeout=3)
        assert second.is_alive() and not states, "the run went on without the slot"
        assert not (tmp_path / "runs").exists() or not any(
            (tmp_path / "runs").rglob("output.parquet")
        )
    finally:
        other.give_back()
        second.join(timeout=120)
        logging.getLogger("prefect").removeHandler(said)
    (state,) = states
    assert state.is_completed(), state.message
    assert (run_folder(tmp_path / "runs") / "output.parquet").is_file()
    # the run's engine stopped and gave its slot back: free at once
    said.lines.clear()
    again = GpuSlots([SLOT])
    again.take(logging.getLogger("prefect.slot-check"))
    again.give_back()
    assert not any("waiting" in line for line in said.lines)


def test_slots_are_per_gpu_and_none_on_the_cpu(llama_dir, monkeypatch):
    assert slot_names({"model_path": str(llama_dir), "device": "cpu"}) == []
    monkeypatch.setattr("engine.platform.cuda_available", lambda: True)
    monkeypatch.setattr("engine.server_args.cuda_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("socket.gethostname", lambda: "node_7")
    args = {"model_path": str(llama_dir), "tp_size": 2, "base_gpu_id": 2}
    assert slot_names(args) == ["gristmill-node-7-gpu-2", "gristmill-node-7-gpu-3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert slot_names(args) == ["gristmill-node-7-gpu-6", "gristmill-node-7-gpu-7"]
    one = {"model_path": str(llama_dir), "device": "cuda:1"}
    assert slot_names(one) == ["gristmill-node-7-gpu-5"]
