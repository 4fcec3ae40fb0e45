"""CUDA graphs for speculative verify steps: one captured forward per token count, replayed with
the batch padded up.

A verify step (engine/speculative/) is an EXTEND forward of each request's last token and its
few drafts: a decode step's shape with a handful of tokens a request. Launched eagerly, its
~300 launches cost 15-50 ms of host time (engine/runner/prefill_graph.py says why), more than
the device needs; the prefill graphs would replay it, but they capture the extend kernel, built
for long runs of new tokens. So the attention backends that have a verify kernel
(kernels/verify_attention.py, `AttentionBackend.has_verify_kernel`) get graphs of their own.
They are keyed by token count, with the prefill graphs' buckets (at most 25% padding), not by
batch size: a step's tokens are its requests' last tokens and drafts, from one to
`max_queries` each (speculative_num_draft_tokens), so a graph per batch size would compute
up to `max_queries` times the tokens. The graph of N tokens holds at most min(max_bs, N)
requests (each has a token at least).

Static inputs:

    tokens [3, max_bs * max_queries]   input ids, positions, out_cache_loc
    reqs   [2, max_bs]                 req_pool_indices, seq_lens

A replay copies the batch's T tokens and B requests into the front of them. Requests [B, R)
of the graph's R are padding: the table's padding row and length 0 (attention reads nothing
for them); tokens [T, N) belong to no request: token 0 at position 0, stored to slot 0 (the
pool's scratch page, owned by nobody). The backend's own per-batch tensors (each request's first
query row and query count, each row's request length) are refilled by
`init_verify_graph_replay`; rows of no request come out of attention as zeros, so every value
stays finite. The graphs write the last layer's hidden states into one buffer, valid until the
next replay; the caller computes the logits of the rows it needs from them at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend
from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_pool import KVPool
from engine.memory.req_to_token import ReqToTokenPool
from engine.runner.cuda_graph import capture_graph
from engine.runner.prefill_graph import prefill_capture_sizes

logger = logging.getLogger(__name__)


class VerifyCudaGraphs:
    def __init__(
        self,
        forward_hidden: Callable[[ForwardBatch], torch.Tensor],
        backend: AttentionBackend,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        hidden_size: int,
        dtype: torch.dtype,
        max_bs: int,
        max_queries: int,
        pool: object = None,
        capture: bool = True,
    ) -> None:
        self.forward_hidden = forward_hidden
        self.backend = backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        max_tokens = max_bs * max_queries
        self.sizes = prefill_capture_sizes(max_tokens)
        self.max_bs = max_bs
        self.max_tokens = max_tokens
        self.device = device = req_to_token.table.device
        self.tokens = torch.zeros((3, max_tokens), dtype=torch.int64, device=device)
        self.reqs = torch.zeros((2, max_bs), dtype=torch.int64, device=device)
        self.reqs[0] = req_to_token.padding_row
        self.hidden = torch.empty((max_tokens, hidden_size), dtype=dtype, device=device)
        backend.init_verify_graph_capture(max_bs, max_tokens, max_queries)
        self.forwards = {tokens: self._forward_fn(tokens) for tokens in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all(pool)

    def fits(self, batch: ForwardBatch) -> bool:
        return (
            batch.verify
            and batch.batch_size <= self.max_bs
            and batch.input_ids.shape[0] <= self.max_tokens
        )

    def padded_size(self, tokens: int) -> int:
        return next(s for s in self.sizes if s >= tokens)

    def requests(self, tokens: int) -> int:
        """The requests the graph of `tokens` tokens holds."""
        return min(self.max_bs, tokens)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the verify batch; returns the last layer's hidden states [T, hidden]."""
        assert batch.packed is not None and batch.seq_lens_cpu is not None
        num_tokens, bs = batch.input_ids.shape[0], batch.batch_size
        padded = self.padded_size(num_tokens)
        requests = self.requests(padded)
        self.tokens[:, :num_tokens].copy_(batch.packed[:3])
        if padded > num_tokens:
            self.tokens[:, num_tokens:padded].zero_()  # token 0, position 0, slot 0
        self.reqs[0, :bs].copy_(batch.req_pool_indices)
        self.reqs[1, :bs].copy_(batch.seq_lens)
        if requests > bs:
            self.reqs[0, bs:requests].fill_(self.req_to_token.padding_row)
            self.reqs[1, bs:requests].zero_()
        self.backend.init_verify_graph_replay(batch.extend_lens_cpu, batch.seq_lens_cpu)
        if self.graphs:
            self.graphs[padded].replay()
        else:
            self.forwards[padded]()
        # NOTE: a view of the shared buffer: valid until the next replay (the caller computes
        # the logits from it first; device work runs in launch order)
        return self.hidden[:num_tokens]

    # ------------------------------------------------------------------ capture
    def _capture_all(self, pool: object) -> None:
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)
        self.backend.init_verify_graph_replay([], [])  # (no request: all padding)
        # largest first: later, smaller graphs reuse the memory pool the first one grew
        for tokens in reversed(self.sizes):
            self.graphs[tokens] = capture_graph(self.forwards[tokens], pool, stream, warm_ups=1)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured %d CUDA graphs for verify steps (up to %d tokens of %d requests) in "
            "%.1fs (%.0f MiB)",
            len(self.sizes),
            self.max_tokens,
            self.max_bs,
            time.perf_counter() - started,
            used / 2**20,
        )

    def _forward_fn(self, tokens: int) -> Callable[[], None]:
        bs = self.requests(tokens)
        static = self.tokens
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=static[0, :tokens],
            positions=static[1, :tokens],
            out_cache_loc=static[2, :tokens],
            req_pool_indices=self.reqs[0, :bs],
            seq_lens=self.reqs[1, :bs],
            seq_lens_cpu=None,
            extend_lens_cpu=None,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token.table,
            verify=True,
        )
        out, forward_hidden = self.hidden[:tokens], self.forward_hidden

        def forward() -> None:
            out.copy_(forward_hidden(batch))

        return forward
