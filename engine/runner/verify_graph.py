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
requests (each has a token at least); the largest holds the most tokens a verify step computes
(engine/speculative_args.py: verify_token_limit, 2048).

Static inputs:

    tokens [3, max_tokens]   input ids, positions, out_cache_loc
    reqs   [2, max_bs]       req_pool_indices, seq_lens

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

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend
from engine.batch.forward_batch import ForwardBatch
from engine.memory.kv_pool import KVPool
from engine.memory.req_to_token import ReqToTokenPool
from engine.runner.prefill_graph import TokenBucketGraphs


class VerifyCudaGraphs(TokenBucketGraphs):
    verify = True

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
        max_tokens: int,
        pool: object = None,
        capture: bool = True,
    ) -> None:
        """`max_queries`: tokens a request at most (its last and its drafts); `max_tokens`: a
        step's at most (engine/speculative_args.py: verify_token_limit)."""
        max_tokens = min(max_tokens, max_bs * max_queries)
        super().__init__(
            forward_hidden, kv_pool, req_to_token, hidden_size, dtype, max_tokens, max_bs
        )
        self.reqs[0] = req_to_token.padding_row  # (length 0: the captures' batches read nothing)
        self.backend = backend
        backend.init_verify_graph_capture(max_bs, max_tokens, max_queries)
        backend.init_verify_graph_replay([], [])  # (no request: all padding)
        self._build(capture, pool, "verify steps")

    def fits(self, batch: ForwardBatch) -> bool:
        return (
            batch.verify
            and batch.batch_size <= self.max_requests
            and batch.input_ids.shape[0] <= self.max_tokens
        )

    def requests(self, tokens: int) -> int:
        return min(self.max_requests, tokens)  # (each request has a token at least)

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
        return self._run(padded, num_tokens)
