"""The scheduler's LoRA adapters: loaded ones (on the host), the device slots they take turns
in, and each forward's block table.

    manager = LoraManager(args, config, model, device)     # adds a LoraLinear to each target
    manager.load("sql", "/adapters/sql")                     # checked, kept on the host
    manager.prepare(reqs, token_counts)                      # before a forward: slots, blocks
    manager.unload("sql")

A forward can use at most `max_loras_per_batch` distinct adapters (the slots): admission keeps
a batch within it (engine/scheduler/prefill.py). An adapter enters a free slot, or the slot of the adapter used
longest ago that this batch does not use; a `pinned` adapter keeps its slot once it has one.

NOTE: slots are rewritten on the device stream, after the work already launched, so a forward
still in flight (overlap scheduling) reads the weights it was launched with.
"""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import torch
from torch import nn

from engine.lora.adapter import LoraAdapter
from engine.lora.layer import LoraBatch, LoraLinear
from engine.model_config import ModelConfig
from engine.server_args import ServerArgs
from engine.tensor_parallel import tp_rank
from kernels.lora import LORA_BLOCK_M, lora_max_blocks

logger = logging.getLogger(__name__)

# fused projections of the models, their parts (adapter modules) in the fused order, and
# whether they are row-parallel
_GROUPS = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), False),
    "o_proj": (("o_proj",), True),
    "gate_up_proj": (("gate_proj", "up_proj"), False),
    "down_proj": (("down_proj",), True),
}
_SHARD_IDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1}


class LoraManager:
    def __init__(
        self, args: ServerArgs, config: ModelConfig, model: nn.Module, device: torch.device
    ) -> None:
        self.args, self.config, self.device = args, config, device
        initial = {
            name: LoraAdapter.from_folder(name, path, config)
            for name, path in args.lora_adapters.items()
        }
        # (what the adapters read at start settle: ServerArgs decides how)
        self.max_rank = args.lora_rank_for([a.rank for a in initial.values()])
        self.targets = args.lora_targets_for([a.targets for a in initial.values()])
        self.num_slots = args.max_loras_per_batch
        self.slots: list[str | None] = [None] * self.num_slots
        self.adapters: dict[str, LoraAdapter] = {}
        self.pinned: set[str] = set()
        self._used: dict[str, int] = {}  # adapter -> when a batch last used it
        self._clock = itertools.count()
        rows = -(-args.max_prefill_tokens // LORA_BLOCK_M) + args.max_request_rows + 1
        self.batch = LoraBatch(rows, device)
        self.scaling = torch.zeros(self.num_slots, dtype=torch.float32, device=device)
        self.layers: list[tuple[int, list[str], nn.Module, LoraLinear]] = []
        self._attach(model, config.dtype)
        for name, adapter in initial.items():
            self.load(name, adapter.path, adapter=adapter)

    # ------------------------------------------------------------------ adapters
    def load(
        self, name: str, path: str, pinned: bool = False, adapter: LoraAdapter | None = None
    ) -> None:
        if name in self.adapters:
            raise ValueError(f"lora_name {name!r} is already loaded (unload_lora_adapter first)")
        adapter = adapter or LoraAdapter.from_folder(name, path, self.config)
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"adapter {name!r} has rank r={adapter.rank}, above max_lora_rank={self.max_rank}"
            )
        unserved = [t for t in adapter.targets if t not in self.targets]
        if unserved:
            raise ValueError(
                f"adapter {name!r} targets {unserved}, which this engine was not started for "
                f"(lora_target_modules: {list(self.targets)})"
            )
        self.adapters[name] = adapter
        if pinned:
            self.pinned.add(name)
        logger.info("LoRA adapter %s loaded from %s (rank %d)", name, path, adapter.rank)

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"lora_name {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        del self.adapters[name]
        self.pinned.discard(name)
        self._used.pop(name, None)
        if name in self.slots:
            self.slots[self.slots.index(name)] = None

    # ------------------------------------------------------------------ a forward
    def prepare(
        self,
        adapters: list[str | None],
        token_counts: list[int],
        graph_size: tuple[int, int] | None = None,
    ) -> None:
        """Put the batch's adapters in slots and write its block table: request i uses
        adapters[i] (None: none) for its token_counts[i] tokens, in batch order. `graph_size`:
        (tokens, requests) of the graph the forward replays (its table has that graph's length)."""
        wanted = set(adapters) - {None}
        assert len(wanted) <= self.num_slots, "admission keeps a batch within the slots"
        stamp = next(self._clock)
        for name in wanted:
            self._used[name] = stamp
            if name not in self.slots:
                self._place(name, wanted)
        slot_of = {name: i for i, name in enumerate(self.slots) if name is not None}
        slots = [slot_of[a] if a is not None else -1 for a in adapters]
        rows = lora_max_blocks(*graph_size) if graph_size is not None else None
        self.batch.set(token_counts, slots, rows)

    def _place(self, name: str, wanted: set[str]) -> None:
        free = [i for i, held in enumerate(self.slots) if held is None]
        if not free:  # the slot of the adapter used longest ago, outside this batch and unpinned
            movable = [
                i
                for i, held in enumerate(self.slots)
                if held not in wanted and held not in self.pinned
            ]
            if not movable:
                movable = [i for i, held in enumerate(self.slots) if held not in wanted]
            free = sorted(movable, key=lambda i: self._used.get(self.slots[i], -1))
        slot = free[0]
        self._write(slot, self.adapters[name])
        self.slots[slot] = name

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """The adapter's weights into a slot of every layer's buffers (zeros where it has none),
        each rank's part cut as the base weights are cut."""
        r = adapter.rank
        for layer_index, parts, base, lora in self.layers:
            a, b = lora.a[slot], lora.b[slot]
            a.zero_()
            b.zero_()
            for j, module in enumerate(parts):
                found = adapter.weights.get((layer_index, module))
                if found is None:
                    continue
                wa, wb = found
                rows = slice(j * self.max_rank, j * self.max_rank + r)
                if lora.reduce:  # row-parallel: this rank's input columns of A, all of B
                    cols = a.shape[-1]
                    start = tp_rank() * cols
                    a[rows].copy_(wa[:, start : start + cols])
                    b[:, :r].copy_(wb)
                else:  # column-parallel: all of A, this rank's output rows of B
                    a[rows].copy_(wa)
                    padded = torch.zeros(wb.shape[0], self.max_rank, dtype=b.dtype)
                    padded[:, :r] = wb
                    # the base layer's own loader cuts this rank's rows into the slot's B
                    base.weight_loader(SimpleNamespace(data=b), padded, _SHARD_IDS.get(module))
        self.scaling[slot] = adapter.scaling

    # ------------------------------------------------------------------ the model
    def _attach(self, model: nn.Module, dtype: torch.dtype) -> None:
        """A LoraLinear on every projection that a served target module is part of."""
        S, R = self.num_slots, self.max_rank
        for path, module in model.named_modules():
            group = path.rsplit(".", 1)[-1]
            if group not in _GROUPS or not hasattr(module, "weight"):
                continue
            parts, row_parallel = _GROUPS[group]
            if not any(p in self.targets for p in parts):
                continue
            layer_index = int(path.split("layers.")[1].split(".")[0])
            out_local, in_local = module.weight.shape
            offsets = _offsets(module, parts)
            a = torch.zeros(S, len(parts) * R, in_local, dtype=dtype, device=self.device)
            b = torch.zeros(S, out_local, R, dtype=dtype, device=self.device)
            lora = LoraLinear(
                a, b, torch.tensor(offsets, dtype=torch.int32, device=self.device),
                self.scaling, self.batch, reduce=row_parallel,
            )  # fmt: skip
            module.lora = lora
            self.layers.append((layer_index, list(parts), module, lora))


def _offsets(module: nn.Module, parts: tuple[str, ...]) -> list[int]:
    """The output columns of each part of a (fused) projection on this rank."""
    if len(parts) == 1:
        return [0, module.weight.shape[0]]
    bounds = [module.shard_rows(_SHARD_IDS[p]) for p in parts]
    return [offset for offset, _ in bounds] + [bounds[-1][0] + bounds[-1][1]]
