"""The scheduler's answers to management calls: one handler per message type.

    caller: the Engine's method --ControlReq(id, call)--> SchedulerProcess._receive
            (a call that waits_for_idle is held until the requests before it have finished)
            --> SchedulerControls.answer(call) --ControlReply(id, value)--> the caller

A call is a ControlCall of engine/runtime/messages.py, whose fields are the arguments of the
Engine method of its name; the caller checked them (engine/frontend/engine.py). The
scheduler's step (engine/scheduler/scheduler.py) knows nothing of these: they reach into its
KV cache, sessions, runner and queues between steps, on every tensor-parallel rank alike.
A ValueError, TypeError or RuntimeError raised here is the caller's, sent back as the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.runtime.messages import (
    CloseSession,
    ControlCall,
    FlushCache,
    GetInfo,
    GetWeightsByName,
    LoadLoraAdapter,
    OpenSession,
    StartProfile,
    StopProfile,
    UnloadLoraAdapter,
    UpdateWeightsFromDisk,
)
from engine.scheduler.embedding import EmbeddingScheduler
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.trace import TorchTrace

logger = logging.getLogger(__name__)

Handler = Callable[[Any], object]


class SchedulerControls:
    """What every scheduler answers alike: the cache flush and profiles."""

    def __init__(
        self,
        scheduler: Scheduler | EmbeddingScheduler,
        trace: TorchTrace,
        tp_rank: int,
        dp_rank: int,
    ) -> None:
        self.trace = trace
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.handlers: dict[type[ControlCall], Handler] = {
            FlushCache: lambda call: scheduler.flush_cache(),
            StartProfile: self.start_profile,
            StopProfile: lambda call: self.trace.stop(),
        }

    @staticmethod
    def of(
        scheduler: Scheduler | EmbeddingScheduler, trace: TorchTrace, tp_rank: int, dp_rank: int
    ) -> SchedulerControls:
        if isinstance(scheduler, EmbeddingScheduler):
            return EmbeddingControls(scheduler, trace, tp_rank, dp_rank)
        return GenerationControls(scheduler, trace, tp_rank, dp_rank)

    def answer(self, call: ControlCall) -> object:
        handler = self.handlers.get(type(call))
        if handler is None:
            raise ValueError(f"unknown control request {call.kind!r}")
        return handler(call)

    def start_profile(self, call: StartProfile) -> str:
        return self.trace.start(
            self.tp_rank, self.dp_rank, call.output_dir, call.num_steps, call.activities,
            call.with_stack, call.record_shapes, call.profile_id,
        )  # fmt: skip


class GenerationControls(SchedulerControls):
    def __init__(self, scheduler: Scheduler, trace: TorchTrace, tp_rank: int, dp_rank: int):
        super().__init__(scheduler, trace, tp_rank, dp_rank)
        self.scheduler = scheduler
        self.handlers |= {
            GetInfo: lambda call: self.state(),
            UpdateWeightsFromDisk: self.update_weights_from_disk,
            GetWeightsByName: lambda call: scheduler.runner.weights_by_name(
                call.name, call.truncate_size
            ),
            LoadLoraAdapter: self.load_lora_adapter,
            UnloadLoraAdapter: self.unload_lora_adapter,
            OpenSession: lambda call: scheduler.sessions.open(
                call.capacity_of_str_len, call.session_id, call.streaming, call.timeout
            ),
            CloseSession: lambda call: scheduler.sessions.close(call.session_id),
        }

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(self, call: LoadLoraAdapter) -> dict:
        self._lora().load(call.lora_name, call.lora_path, call.pinned)
        return self.lora_adapters()

    def unload_lora_adapter(self, call: UnloadLoraAdapter) -> dict:
        """Refused while a queued or running request uses it, or an open session holds KV of
        it; its cached prefixes go with it (an adapter loaded later under the name differs)."""
        lora, lora_name, queues = self._lora(), call.lora_name, self.scheduler.queues
        users = [r for r in (*queues.waiting, *queues.admitted()) if r.lora_name == lora_name]
        if users:
            raise ValueError(
                f"lora_name {lora_name!r} is used by {len(users)} queued or running request(s); "
                "unload it once they have finished"
            )
        tree = self.scheduler.kv.tree
        if tree is not None and tree.namespace_locked(lora_name):
            raise ValueError(
                f"lora_name {lora_name!r} has KV held by an open session: close it first"
            )
        lora.unload(lora_name)
        if tree is not None:
            tree.drop_namespace(lora_name)
        return self.lora_adapters()

    def lora_adapters(self) -> dict:
        lora = self.scheduler.runner.lora
        return {name: a.path for name, a in lora.adapters.items()} if lora else {}

    def _lora(self):
        if self.scheduler.runner.lora is None:
            raise ValueError(
                "this engine serves no LoRA adapters: start it with enable_lora=True or lora_paths"
            )
        return self.scheduler.runner.lora

    # ------------------------------------------------------------------ weights
    def update_weights_from_disk(self, call: UpdateWeightsFromDisk) -> tuple[bool, str]:
        """Another checkpoint of the model's shapes into service; (success, message), as SGLang.

        NOTE: runs with no request queued or running: the scheduler process holds the call
        (and what arrives after it) until the requests in flight have finished. The prefix
        cache is emptied: its KV was computed with the old weights."""
        scheduler = self.scheduler
        assert not scheduler.has_work(), "weights are swapped only on an idle engine"
        try:
            scheduler.runner.update_weights(call.model_path, call.load_format)
        except ValueError as e:
            return False, f"Failed to update weights: {e}. The weights in service are unchanged."
        scheduler.sessions.drop_kv()
        scheduler.kv.flush()
        logger.info("weights updated from %s", call.model_path)
        return True, "Succeeded to update model weights."

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        """Counters and queue lengths for get_server_info()."""
        scheduler = self.scheduler
        s, queues, runner = scheduler.stats, scheduler.queues, scheduler.runner
        prefill = s.prefill_tokens_computed + s.prefill_tokens_cached
        return {
            "num_running_reqs": queues.num_running,
            "num_waiting_reqs": len(queues.waiting),
            "open_sessions": len(scheduler.sessions.open_sessions),
            "kv_free_tokens": scheduler.kv.free_tokens,
            "kv_total_tokens": scheduler.max_total_tokens,
            "prefix_cache_tokens": scheduler.kv.cached_tokens,
            **s.counters(),
            "cache_hit_rate": s.prefill_tokens_cached / prefill if prefill else 0.0,
            "gen_throughput": s.generated_tokens / s.busy_seconds if s.busy_seconds else 0.0,
            "overlap_schedule": scheduler.overlap,
            "cuda_graph_max_bs": runner.graphs.max_bs if runner.graphs else 0,
            "prefill_graph_max_tokens": (
                runner.prefill_graphs.max_tokens if runner.prefill_graphs else 0
            ),
            **runner.allocator_counters(),
            **runner.image_counters(),
        }


def _refuse(message: str) -> Handler:
    def refuse(call: ControlCall) -> object:
        raise ValueError(message)

    return refuse


class EmbeddingControls(SchedulerControls):
    """An embedding engine's: no prefix cache, weights, adapters or sessions in this version."""

    def __init__(
        self, scheduler: EmbeddingScheduler, trace: TorchTrace, tp_rank: int, dp_rank: int
    ):
        super().__init__(scheduler, trace, tp_rank, dp_rank)
        lora = _refuse("LoRA adapters serve generation engines in this version")
        sessions = _refuse("sessions are for generation engines; this one embeds")
        self.handlers |= {
            GetInfo: lambda call: scheduler.state(),
            UpdateWeightsFromDisk: _refuse(
                "update_weights_from_disk serves generation engines in this version"
            ),
            GetWeightsByName: _refuse(
                "get_weights_by_name serves generation engines in this version"
            ),
            LoadLoraAdapter: lora,
            UnloadLoraAdapter: lora,
            OpenSession: sessions,
            CloseSession: sessions,
        }
