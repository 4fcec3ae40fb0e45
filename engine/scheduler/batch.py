"""Turn a scheduling decision (which requests, how many new tokens each) into one ForwardBatch.

Besides the tensors, it plans which rows of the batch need logits: a request's last row when
this step completes its input (it samples its next token), and the rows whose logits give
prompt-token logprobs the request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_cache import KVCache
from engine.model_runner import ModelRunner
from engine.request import Req


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request this step


@dataclass
class LogitPlan:
    """Which logits rows belong to whom: rows [start, start + n_input) are input-logprob rows, then
    one sampling row if `samples`."""

    starts: list[int] = field(default_factory=list)
    n_input: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # batch token rows to compute logits for


def build(
    batch: ScheduledBatch, kv: KVCache, runner: ModelRunner, device: torch.device
) -> tuple[ForwardBatch, LogitPlan]:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    plan = LogitPlan()
    for req, n in zip(batch.reqs, batch.extend_lens):
        start, end = req.kv_len, req.kv_len + n
        offset = len(ids) - start  # token position p sits at batch row offset + p
        ids.extend(req.fill_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(kv.extend(req, n))
        rows.extend([req.pool_row] * n)
        plan.starts.append(len(plan.rows))
        # logits at position p give the logprob of prompt token p + 1
        lp_rows = (
            range(max(start, req.input_logprob_next), min(end, req.prompt_len - 1))
            if req.wants_input_logprobs
            else range(0)
        )
        plan.rows.extend(offset + p for p in lp_rows)
        plan.n_input.append(len(lp_rows))
        samples = end == len(req.fill_ids)
        if samples:
            plan.rows.append(offset + end - 1)
        plan.samples.append(samples)
    # one host-to-device copy for the per-token columns of the whole batch
    host = torch.tensor([ids, positions, slots], dtype=torch.int64).to(device, non_blocking=True)
    kv.write_table(rows, positions, host[2])
    forward = ForwardBatch(
        mode=batch.mode,
        input_ids=host[0],
        positions=host[1],
        out_cache_loc=host[2],
        req_pool_indices=torch.tensor(
            [r.pool_row for r in batch.reqs], dtype=torch.int64, device=device
        ),
        seq_lens=torch.tensor([r.kv_len for r in batch.reqs], dtype=torch.int64, device=device),
        seq_lens_cpu=[r.kv_len for r in batch.reqs],
        extend_lens_cpu=list(batch.extend_lens),
        kv_pool=runner.kv_pool,
        req_to_token=runner.req_to_token.table,
        attn_backend=runner.attn_backend,
    )
    return forward, plan
