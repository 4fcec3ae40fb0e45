"""Turn the scheduler's decision (a ScheduledBatch) into one ForwardBatch of device tensors.

Besides the tensors, it plans which rows of the batch need logits: a request's last row when
this step completes its input (it samples its next token), and the rows whose logits give
prompt-token logprobs the request asked for.

A decode step names no token ids: each request's input is the token sampled for it last,
which the model runner gathers on the device (ModelRunner.next_token), so the host need not
know it yet (overlap scheduling). Its per-request columns travel to the device in one copy,
into the buffer the decode CUDA graphs read. A prefill's token columns travel in one copy too,
and its new tokens' slots (allocated by the scheduler) are written into the request->slot
table with them; so are the slots of the cached prefixes the batch's requests were just
admitted with (one more copy for the batch, none per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.batch.scheduled_batch import ScheduledBatch
from engine.memory.kv_pool import KVPool
from engine.memory.req_to_token import ReqToTokenPool
from engine.runner.decode_inputs import DecodeInputs
from engine.transfer import to_device


@dataclass
class LogitPlan:
    """Which logits rows belong to whom: rows [start, start + n_input) are input-logprob rows, then
    one sampling row if `samples`. `rows` None means every batch row, in order (a decode; a
    verify step, whose every row judges a draft)."""

    starts: list[int] = field(default_factory=list)
    n_input: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    rows: list[int] | None = field(default_factory=list)  # batch token rows to compute logits for


def build_forward_batch(
    batch: ScheduledBatch,
    kv_pool: KVPool,
    req_to_token: ReqToTokenPool,
    decode_inputs: DecodeInputs,
    decode_width: int,
) -> tuple[ForwardBatch, LogitPlan]:
    """`decode_width`: the columns a decode's inputs take (its batch, then padding up to the size
    of the decode graph that will run it)."""
    if batch.mode is ForwardMode.DECODE:
        return _build_decode(batch, kv_pool, req_to_token, decode_inputs, decode_width)
    return _build_extend(batch, kv_pool, req_to_token)


_ALL_ROWS = LogitPlan(rows=None)  # every row samples (decode) or judges a draft (verify)


def _build_decode(
    batch: ScheduledBatch,
    kv_pool: KVPool,
    req_to_token: ReqToTokenPool,
    decode_inputs: DecodeInputs,
    width: int,
) -> tuple[ForwardBatch, LogitPlan]:
    """One host-to-device copy, straight into the buffer the forward (or its graph) reads. The
    new slots are written into the table by the forward itself (ModelRunner.forward_hidden)."""
    forward = decode_forward_batch(
        batch.starts, batch.slots, batch.rows, kv_pool, req_to_token, decode_inputs, width
    )
    forward.shared_prefixes = batch.shared_prefixes
    return forward, _ALL_ROWS


def decode_forward_batch(
    starts: np.ndarray,
    slots: np.ndarray,
    rows: np.ndarray,
    kv_pool: KVPool,
    req_to_token: ReqToTokenPool,
    decode_inputs: DecodeInputs,
    width: int,
) -> ForwardBatch:
    """A decode of one token per request row `rows[i]` at position `starts[i]` into `slots[i]`,
    its columns sent into `decode_inputs` padded to `width` (a draft model's decodes too)."""
    packed, (positions, slots_d, rows_d, seq_lens), seq_lens_cpu = decode_inputs.write(
        starts, slots, rows, width
    )
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=None,
        positions=positions,
        out_cache_loc=slots_d,
        req_pool_indices=rows_d,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        extend_lens_cpu=[1] * len(rows),
        kv_pool=kv_pool,
        req_to_token=req_to_token.table,
        packed=packed,
    )


def _build_extend(
    batch: ScheduledBatch, kv_pool: KVPool, req_to_token: ReqToTokenPool
) -> tuple[ForwardBatch, LogitPlan]:
    """The token columns come from numpy (one concatenation of the requests' token slices,
    repeats and ranges): a prefill of 16k tokens costs a few array calls, not 16k list appends,
    and the loop over requests only plans their logits rows."""
    lens = np.asarray(batch.extend_lens, dtype=np.int64)
    starts = np.asarray(batch.starts, dtype=np.int64)
    rows = np.asarray([r.pool_row for r in batch.reqs], dtype=np.int64)
    offsets = np.cumsum(lens) - lens  # where each request's first new token sits in the batch
    total = int(lens.sum())
    host = np.empty((4, total), dtype=np.int64)  # ids, positions, slots, table rows
    if batch.drafts is None:
        np.concatenate(
            [r.fill_ids[s : s + n] for r, s, n in zip(batch.reqs, batch.starts, batch.extend_lens)],
            out=host[0],
        )
        plan = _plan_logits(batch, offsets.tolist())
    else:  # a verify step: each request's last token, then its drafts; every row has logits
        host[0] = [t for r, s, d in zip(batch.reqs, batch.starts, batch.drafts)
                   for t in (r.fill_ids[s], *d)]  # fmt: skip
        plan = _ALL_ROWS
    np.add(np.arange(total), np.repeat(starts - offsets, lens), out=host[1])
    host[2] = batch.slots
    host[3] = np.repeat(rows, lens)
    device = req_to_token.table.device
    tokens = to_device(host, torch.int64, device)
    seq_lens = (starts + lens).tolist()
    per_req = to_device(np.stack([rows, starts + lens]), torch.int64, device)
    _write_cached_prefixes(batch, req_to_token)
    req_to_token.write_slots(tokens[3], tokens[1], tokens[2])
    forward = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=tokens[0],
        positions=tokens[1],
        out_cache_loc=tokens[2],
        req_pool_indices=per_req[0],
        seq_lens=per_req[1],
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=list(batch.extend_lens),
        kv_pool=kv_pool,
        req_to_token=req_to_token.table,
        packed=tokens,
        verify=batch.drafts is not None,
        shared_prefixes=batch.shared_prefixes if batch.drafts is None else None,
    )
    return forward, plan


def _plan_logits(batch: ScheduledBatch, offsets: list[int]) -> LogitPlan:
    """A prefill's logits rows: each request's input-logprob rows, then its sampling row if this
    step completes its input."""
    plan = LogitPlan()
    for req, n, start, offset in zip(batch.reqs, batch.extend_lens, batch.starts, offsets):
        end = start + n
        plan.starts.append(len(plan.rows))
        # logits at position p give the logprob of prompt token p + 1 (batch row offset + p - start)
        if req.wants_input_logprobs:
            lp_rows = range(max(start, req.input_logprob_next), min(end, req.prompt_len - 1))
            plan.rows.extend(offset - start + p for p in lp_rows)
            plan.n_input.append(len(lp_rows))
        else:
            plan.n_input.append(0)
        samples = end == req.fill_len
        if samples:
            plan.rows.append(offset + n - 1)
        plan.samples.append(samples)
    return plan


def _write_cached_prefixes(batch: ScheduledBatch, req_to_token: ReqToTokenPool) -> None:
    """The table rows of newly admitted requests get the slots of their cached prefixes: one
    transfer of [rows, lengths, where each prefix starts, the distinct prefixes] for the batch.
    Requests admitted with one prefix share its array (the planner's doing), so a batch of 256
    items after one 2000-token instruction ships 2000 slots, not 512k."""
    rows, lens, sources = [], [], []
    distinct: dict[int, tuple[int, np.ndarray]] = {}  # id(array) -> (its start, the array)
    shipped = 0
    for req, prefix in zip(batch.reqs, batch.cached_slots):
        if not len(prefix):
            continue
        if id(prefix) not in distinct:
            distinct[id(prefix)] = (shipped, prefix)
            shipped += len(prefix)
        rows.append(req.pool_row)
        lens.append(len(prefix))
        sources.append(distinct[id(prefix)][0])
    if not rows:
        return
    k = len(rows)
    host = np.concatenate([rows, lens, sources] + [p for _, p in distinct.values()])
    packed = to_device(host, torch.int64, req_to_token.table.device)
    req_to_token.write_prefixes(
        packed[:k], packed[k : 2 * k], packed[2 * k : 3 * k], packed[3 * k :], sum(lens)
    )
