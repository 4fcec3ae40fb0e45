"""Counters of the scheduler, reported by get_server_info()["internal_states"]."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class SchedulerStats:
    requests_finished: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    shared_prefix_steps: int = 0  # decode steps that read a shared prefix once per group
    retractions: int = 0
    # speculative decoding: decode steps that verified drafts, draft tokens, accepted ones
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    busy_seconds: float = 0.0
    # where a step's time goes: planning and launching (host), waiting for the device, reading
    launch_seconds: float = 0.0
    prefill_launch_seconds: float = 0.0  # the part of launch_seconds spent on prefill steps
    wait_seconds: float = 0.0
    collect_seconds: float = 0.0
    # device time between steps with nothing queued (CUDA only): what the host costs the device
    device_idle_seconds: float = 0.0
    # the loop's host work outside the steps: taking in what the caller sent (requests, calls),
    # and sending each step's outputs on
    receive_seconds: float = 0.0
    send_seconds: float = 0.0

    def counters(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)
