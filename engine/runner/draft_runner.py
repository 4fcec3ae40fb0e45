"""STANDALONE speculative decoding's draft model: a small model of the same vocabulary that
drafts each request's next tokens, one forward per drafted token, for the target to verify.

It owns what ModelRunner owns for the target, in small: the weights, a K/V pool of its own
(page size 1) and a request->slot table whose rows are the target's request rows. A request's
draft K/V catches up on the tokens it has not seen (its prompt at its first draft, then the
target's tokens since) in the draft's first forward of a step; that forward's last row gives
the first draft, and each further forward takes one draft in and gives the next. After the
verify step, `kept` cuts the request's draft K/V back to the tokens that stood.

Drafts are drawn as the target's sampler draws: argmax for greedy rows, else `sample()` at
the request's seed and the output step the draft stands for, with the distribution it drew
from (`processed_probs`) kept for the lossless acceptance rule (engine/speculative/verify.py).

Memory: ModelRunner loads the draft's weights (`load_draft`) beside the target's, before it
sizes the target's pool, and counts the draft's K/V bytes in each pooled token; so the target's
pool and this one (as many tokens, and each row's drafts besides) share what
`mem_fraction_static` gives, and the activation headroom the target measured stays free. A
catch-up forward takes at most `max_prefill_tokens` tokens (a wave of new requests brings all
their prompts at once), the size of the forward that headroom was measured on.

NOTE: no prefix cache here: every request prefills its whole prompt in the draft, eagerly. Rows whose request has gone are reclaimed when the pool runs short, and a step
it still cannot hold decodes without drafts (requests that share a cached prefix in the target
each hold a copy of it here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import create_backend
from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.layers.attention import attention_layers, use_backend
from engine.memory.kv_pool import KVPool
from engine.memory.page_allocator import PageAllocator
from engine.memory.req_to_token import ReqToTokenPool
from engine.model_config import ModelConfig
from engine.runner.batch_builder import decode_forward_batch
from engine.runner.cuda_graph import DecodeCudaGraphs
from engine.runner.decode_inputs import DecodeInputs
from engine.runner.loader import load_model
from engine.sampling.sampler import SamplingBatch, sample
from engine.server_args import ServerArgs
from engine.speculative.verify import processed_probs
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.batch.req import Req

logger = logging.getLogger(__name__)
DRAFT_SLACK_BYTES = 1 << 30  # left free beside the draft's pool (its activations, the target's)
# unseen tokens up to which a request catches up in decode forwards (one a token) rather than
# an EXTEND: what a verify step leaves (its bonus token, and the last draft when all stood)
DECODE_CATCH_UP = 2


@dataclass(frozen=True)
class DraftWeights:
    """The draft model, loaded; `kv_bytes_per_token`: what each token costs in its K/V pool."""

    config: ModelConfig
    model: torch.nn.Module
    kv_bytes_per_token: int


def load_draft(args: ServerArgs, target: ModelConfig, device) -> DraftWeights:
    """The draft model of `speculative_draft_model_path`, which must share the target's vocabulary."""
    path = args.speculative_draft_model_path
    config = ModelConfig.from_folder(path, args.dtype, None)
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_draft_model_path {path!r} has a vocabulary of {config.vocab_size} "
            f"tokens, the model {target.vocab_size}: a draft model must share the target's "
            "tokenizer and vocabulary"
        )
    model = load_model(config, args.load_format, device)
    kv_heads = attention_layers(model)[0].num_kv_heads
    return DraftWeights(config, model, config.kv_bytes_per_token(config.dtype, kv_heads))


class DraftRunner:
    def __init__(
        self, args: ServerArgs, target: ModelConfig, weights: DraftWeights, rows: int,
        pool_tokens: int, device,
    ) -> None:  # fmt: skip
        config = self.config = weights.config
        self.device = device
        self.model = weights.model
        self.chunk = args.max_prefill_tokens  # tokens a catch-up forward takes at most
        attn = attention_layers(self.model)[0]
        self.backend = create_backend(args.attention_backend, device, attn, config.dtype)
        use_backend(self.model, self.backend)
        if device.type == "cuda":  # (the plan left room: this guards a plan gone wrong)
            per_token = weights.kv_bytes_per_token
            free = torch.cuda.mem_get_info(device)[0] - DRAFT_SLACK_BYTES
            if pool_tokens * per_token > free:
                pool_tokens = max(int(free // per_token), 1)
                logger.warning(
                    "the draft model's K/V pool holds %d tokens (what GPU memory has left): "
                    "steps it cannot hold decode without drafts", pool_tokens,
                )  # fmt: skip
        self.pool = KVPool(
            pool_tokens, 1, config.num_layers, attn.num_kv_heads, config.head_dim,
            config.dtype, device,
        )  # fmt: skip
        self.allocator = PageAllocator(pool_tokens)
        context = max(target.context_length, config.context_length)
        self.table = ReqToTokenPool(rows, context, device)
        self.lens = np.zeros(rows + 1, dtype=np.int64)  # draft K/V tokens of each row
        # NOTE: token i of row r's draft K/V is in pool slot slots[i, r] for i < lens[r] (the
        # host's copy of the draft's table, to free a row's slots): position-major, so a draft
        # forward writes one token of every row in one assignment, and a row never copies its
        # slots as it grows. Zeros are never written, so the OS maps only the positions used.
        self.slots = np.zeros((context, rows + 1), dtype=np.int32)
        self.owner: list[Req | None] = [None] * (rows + 1)
        self.base = np.zeros(rows + 1, dtype=np.int64)  # each row's tokens at its last draft
        self.steps = 0  # drafts per request of the last draft call
        # each row's input token of its next decode forward (the graphs gather it by row)
        self.next_token = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        # NOTE: a draft call writes decode columns up to DECODE_CATCH_UP + steps - 1 times before
        # it reads its drafts (its one wait): a pinned buffer is not rewritten before that
        buffers = DECODE_CATCH_UP + args.speculative_num_steps + 1
        self.decode_inputs = DecodeInputs(rows, self.table.padding_row, device, buffers)
        self.graphs: DecodeCudaGraphs | None = None
        if (
            device.type == "cuda"
            and not args.disable_cuda_graph
            and self.backend.supports_cuda_graph
        ):
            self.graphs = DecodeCudaGraphs(
                self._forward_decode, self.backend, self.pool, self.table, self.decode_inputs,
                config.vocab_size, config.dtype, max_bs=min(args.cuda_graph_max_bs, rows),
                pool=torch.cuda.graph_pool_handle(),
            )  # fmt: skip

    # ------------------------------------------------------------------ a step's drafts
    @torch.inference_mode()
    def draft(
        self, reqs: list[Req], k: int, sampling: SamplingBatch | None
    ) -> tuple[list[list[int]] | None, torch.Tensor | None]:
        """`k` drafts for each request, from its tokens (none pending); `sampling`: the rows'
        sampling parameters at the step of their first draft (None: all greedy). Returns the
        drafts and, unless all greedy, the distributions they were drawn from [B, k, V]; no
        drafts (None) when the draft's pool cannot hold the step."""
        rows = [r.pool_row for r in reqs]
        for req, row in zip(reqs, rows):
            if self.owner[row] is not req:  # (the row's last request has gone)
                self.release(row)
                self.owner[row] = req
        need = sum(r.fill_len - int(self.lens[row]) for r, row in zip(reqs, rows))
        if not self._room(need + len(reqs) * (k - 1)):
            return None, None  # (the step decodes without drafts)
        # forward 1: each request's unseen tokens, its last token among them
        ids = []
        for req, row in zip(reqs, rows):
            tokens = req.fill_ids
            ids.append(np.asarray(tokens[self.lens[row] :]))
            self.base[row] = len(tokens)
        logits = self._catch_up(rows, ids)
        drafts, probs = [], []
        for j in range(k):
            if j:  # (the draft stays on the device: nothing waits until the drafts are read)
                logits = self._decode(np.asarray(rows), drafts[-1])
            token, q = self._draw(logits, sampling, j)
            drafts.append(token)
            if q is not None:
                probs.append(q)
        self.steps = k
        chains = torch.stack(drafts, 1).tolist() if drafts else [[] for _ in reqs]
        return chains, (torch.stack(probs, 1) if probs else None)

    def _catch_up(self, rows: list[int], ids: list[np.ndarray]) -> torch.Tensor:
        """Each row's unseen tokens `ids[i]` through the draft; the logits of each row's last
        token [B, V]. Rows of at most DECODE_CATCH_UP tokens take decode forwards, one token a
        pass; the others EXTEND forwards of at most `self.chunk` tokens (a long one split).
        NOTE: every row has an unseen token (its last, at least): fill_ids grows each step."""
        out = torch.empty(
            (len(rows), self.config.vocab_size), dtype=self.config.dtype, device=self.device
        )
        short = [i for i, t in enumerate(ids) if len(t) <= DECODE_CATCH_UP]
        for t in range(max((len(ids[i]) for i in short), default=0)):
            members = [i for i in short if len(ids[i]) > t]
            tokens = to_device([ids[i][t] for i in members], torch.int64, self.device)
            logits = self._decode(np.asarray([rows[i] for i in members]), tokens)
            last = [j for j, i in enumerate(members) if len(ids[i]) == t + 1]
            where = to_device([members[j] for j in last], torch.int64, self.device)
            out[where] = logits[to_device(last, torch.int64, self.device)]
        todo = [(i, t) for i, t in enumerate(ids) if len(t) > DECODE_CATCH_UP]
        while todo:
            budget, part, rest = self.chunk, [], []
            for i, tokens in todo:
                n = min(len(tokens), budget)
                if n:
                    part.append((i, tokens[:n]))
                    budget -= n
                if n < len(tokens):
                    rest.append((i, tokens[n:]))
            lens = np.asarray([len(t) for _, t in part], dtype=np.int64)
            logits = self._extend(
                [rows[i] for i, _ in part], np.concatenate([t for _, t in part]), lens
            )
            unfinished = {i for i, _ in rest}
            done = [(i, j) for j, (i, _) in enumerate(part) if i not in unfinished]
            where = to_device([i for i, _ in done], torch.int64, self.device)
            out[where] = logits[to_device([j for _, j in done], torch.int64, self.device)]
            todo = rest
        return out

    def _decode(self, rows: np.ndarray, tokens: torch.Tensor) -> torch.Tensor:
        """One token a row (`tokens`, on the device) after its draft K/V: a decode forward, a
        CUDA-graph replay where one is captured; the logits [n, V], valid until the next."""
        n = len(rows)
        starts = self.lens[rows].copy()
        slots = self.allocator.alloc(n)  # (draft() made room: _room)
        self.slots[starts, rows] = slots
        self.lens[rows] = starts + 1
        graphed = self.graphs is not None and n <= self.graphs.max_bs
        width = self.graphs.padded_size(n) if graphed else n
        batch = decode_forward_batch(
            starts, slots, rows, self.pool, self.table, self.decode_inputs, width
        )
        self.next_token[batch.req_pool_indices] = tokens
        return self.graphs.replay(batch) if graphed else self._forward_decode(batch)

    def _forward_decode(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode forward, eager (the graphs capture it): the new slots into the table, each
        row's token gathered from `next_token`."""
        self.table.write_slots(batch.req_pool_indices, batch.positions, batch.out_cache_loc)
        self.backend.init_forward_metadata(batch)
        ids = self.next_token[batch.req_pool_indices]
        return self.model.compute_logits(self.model(ids, batch.positions, batch))

    def _draw(self, logits: torch.Tensor, sampling: SamplingBatch | None, j: int):
        if sampling is None:
            return logits.float().argmax(-1), None
        at = SamplingBatch(
            sampling.temperatures, sampling.top_ks, sampling.top_ps, sampling.min_ps,
            sampling.seeds, sampling.steps + j, greedy_hint=sampling.greedy_hint,
        )  # fmt: skip
        return sample(logits, at), processed_probs(logits, at)

    def _extend(self, rows: list[int], ids: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        """An EXTEND forward of the draft: `lens[i]` tokens of `ids` for request row rows[i],
        after its draft K/V; the logits of each request's last token [B, V]."""
        starts = self.lens[rows]
        slots = self.allocator.alloc(int(lens.sum()))  # (draft() made room: _room)
        self.lens[rows] = starts + lens
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
        row_of = np.repeat(rows, lens)
        self.slots[positions, row_of] = slots
        host = np.stack([ids, positions, slots, row_of])
        dev = to_device(host, torch.int64, self.device)
        self.table.write_slots(dev[3], dev[1], dev[2])
        seq_lens = (starts + lens).tolist()
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=dev[0],
            positions=dev[1],
            out_cache_loc=dev[2],
            req_pool_indices=to_device(rows, torch.int64, self.device),
            seq_lens=to_device(seq_lens, torch.int64, self.device),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=lens.tolist(),
            kv_pool=self.pool,
            req_to_token=self.table.table,
        )
        self.backend.init_forward_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        last = to_device(np.cumsum(lens) - 1, torch.int64, self.device)
        return self.model.compute_logits(hidden[last])

    # ------------------------------------------------------------------ after the verify step
    def kept(self, req: Req, accepted: int) -> None:
        """The request's verify step accepted `accepted` of its drafts: its draft K/V keeps its
        tokens up to the last draft both drafted from and accepted."""
        row = req.pool_row
        base = int(self.base[row])
        self._cut(row, min(base + accepted, base + max(self.steps - 1, 0)))

    def release(self, row: int) -> None:
        """The row's request has gone: its draft K/V too."""
        self._cut(row, 0)
        self.owner[row] = None

    def _cut(self, row: int, length: int) -> None:
        held = int(self.lens[row])
        if held > length:
            self.allocator.free(self.slots[length:held, row])
            self.lens[row] = length

    def _room(self, n: int) -> bool:
        """Whether `n` slots are free, once the rows whose request has left them are reclaimed."""
        if n > self.allocator.num_free:
            for row, req in enumerate(self.owner):
                if req is not None and req.pool_row != row:
                    self.release(row)
        return n <= self.allocator.num_free
