"""CUDA graphs for prefill: one captured forward per token-count bucket, replayed with the batch
padded up to its bucket.

A prefill forward is about ten launches a layer whatever its size: ~300 for a 28-layer model,
15-50 ms of host time on a busy CPU. When every row is a short item after a long cached prefix
(the shape of annotation and eval runs), that is longer than the device needs for the step, and
the launches, not the GPU, set the pace. A replay costs a handful of launches instead.

The graphs read their inputs from static buffers:

    tokens [3, max_tokens]   input ids, positions, out_cache_loc
    reqs   [2, max_requests] req_pool_indices, seq_lens

A replay copies the batch's T tokens and B requests into the front of them. The padded tokens
[T, padded) are one more request, the padding request: token 0 at position 0, stored to slot 0
(the pool's scratch page, owned by nobody), its table row the padding row (all slot 0), its
seq_len = extend_len = padded - T. So padded rows attend only to slot 0, never to a real
request's keys, and every value stays finite. The attention backend's own per-batch tensors
(for triton: extend lengths, query offsets, the tile table) are refilled by
`init_prefill_graph_replay`.

The graphs write the last layer's hidden states into one buffer; a replay's rows are valid until
the next replay, and the caller computes the logits of the rows it needs from them at once
(eagerly: which rows varies per batch, and they are few).

NOTE: padded rows run through every layer alongside the real ones; that is sound because every
layer but attention works row by row, and attention keeps the padding request to itself.

`capture=False` runs the same forwards over the same static buffers eagerly instead of
replaying graphs: the CPU tests check the padding and the static metadata that way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBackend
from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_pool import KVPool
from engine.memory.req_to_token import ReqToTokenPool
from engine.runner.cuda_graph import capture_graph

if TYPE_CHECKING:
    from engine.lora.layer import LoraBatch

logger = logging.getLogger(__name__)


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: powers of two up to 256 (a short step is host-bound, padding it
    costs nothing), then two sizes an octave to 1024 and four above (at most 25% padding where
    the device time grows with the tokens)."""
    sizes = [16, 32, 64, 128, 256, 384, 512, 768]
    size = 1024
    while size < max_tokens:
        sizes.append(size)
        size += 1 << (size.bit_length() - 3)  # a quarter of the octave it is in
    capped = [s for s in sizes if s < max_tokens]
    return capped + [max_tokens]


class TokenBucketGraphs:
    """Forwards of EXTEND batches over static buffers, one per token-count bucket (`sizes`),
    captured as CUDA graphs (or, `capture=False`, run eagerly over the same buffers): what the
    prefill graphs and the verify graphs (engine/runner/verify_graph.py) share. A subclass
    says how many requests the bucket of `tokens` holds (`requests`), prepares the static
    buffers before each capture (`_before_capture`) and fills them before each replay."""

    verify = False  # the ForwardBatch flag of the captured batches

    def __init__(
        self,
        forward_hidden: Callable[[ForwardBatch], torch.Tensor],
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        hidden_size: int,
        dtype: torch.dtype,
        max_tokens: int,
        max_requests: int,
    ) -> None:
        self.forward_hidden = forward_hidden
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.sizes = prefill_capture_sizes(max_tokens)
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.device = device = req_to_token.table.device
        self.tokens = torch.zeros((3, max_tokens), dtype=torch.int64, device=device)
        self.reqs = torch.zeros((2, max_requests), dtype=torch.int64, device=device)
        self.hidden = torch.empty((max_tokens, hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def requests(self, tokens: int) -> int:
        """The requests the graph of `tokens` tokens holds (its static request columns)."""
        return self.max_requests

    def padded_size(self, tokens: int) -> int:
        return next(s for s in self.sizes if s >= tokens)

    def _run(self, padded: int, num_tokens: int) -> torch.Tensor:
        """Replay (or run) the `padded` bucket; the first `num_tokens` rows of its output."""
        if self.graphs:
            self.graphs[padded].replay()
        else:
            self.forwards[padded]()
        # NOTE: a view of the shared buffer: valid until the next replay (the caller computes
        # the logits from it first; device work runs in launch order)
        return self.hidden[:num_tokens]

    # ------------------------------------------------------------------ capture
    def _build(self, capture: bool, pool: object, name: str) -> None:
        self.forwards = {tokens: self._forward_fn(tokens) for tokens in self.sizes}
        if not capture:
            return
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)
        # largest first: later, smaller graphs reuse the memory pool the first one grew
        for tokens in reversed(self.sizes):
            self._before_capture(tokens)
            self.graphs[tokens] = capture_graph(self.forwards[tokens], pool, stream, warm_ups=1)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured %d CUDA graphs for %s (up to %d tokens) in %.1fs (%.0f MiB)",
            len(self.sizes),
            name,
            self.max_tokens,
            time.perf_counter() - started,
            used / 2**20,
        )

    def _before_capture(self, tokens: int) -> None:
        """The static buffers a capture of `tokens` runs over (a harmless batch)."""

    def _forward_fn(self, tokens: int) -> Callable[[], None]:
        static, bs = self.tokens, self.requests(tokens)
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
            verify=self.verify,
        )
        out, forward_hidden = self.hidden[:tokens], self.forward_hidden

        def forward() -> None:
            out.copy_(forward_hidden(batch))

        return forward


class PrefillCudaGraphs(TokenBucketGraphs):
    def __init__(
        self,
        forward_hidden: Callable[[ForwardBatch], torch.Tensor],
        backend: AttentionBackend,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        hidden_size: int,
        dtype: torch.dtype,
        max_tokens: int,
        max_requests: int,
        pool: object = None,
        capture: bool = True,
        lora_batch: LoraBatch | None = None,
    ) -> None:
        # (max_requests: the batch's requests and the padding request)
        super().__init__(
            forward_hidden, kv_pool, req_to_token, hidden_size, dtype, max_tokens, max_requests
        )
        self.lora_batch = lora_batch  # LoRA's block table, captured at each bucket's length
        self.backend = backend
        backend.init_prefill_graph_capture(max_requests, max_tokens)
        self._build(capture, pool, "prefill")

    def fits(self, batch: ForwardBatch) -> bool:
        if batch.mode is not ForwardMode.EXTEND or batch.input_ids is None:
            return False
        tokens = batch.input_ids.shape[0]
        if tokens > self.max_tokens or batch.batch_size + 1 > self.max_requests:
            return False
        # the padding request's positions must fit in the table's padding row
        return self.padded_size(tokens) - tokens <= self.req_to_token.table.shape[1]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the prefill batch; returns the last layer's hidden states [T, hidden]."""
        assert batch.packed is not None and batch.seq_lens_cpu is not None
        num_tokens, bs = batch.input_ids.shape[0], batch.batch_size
        padded = self.padded_size(num_tokens)
        pad = padded - num_tokens
        self.tokens[:, :num_tokens].copy_(batch.packed[:3])
        self.reqs[0, :bs].copy_(batch.req_pool_indices)
        self.reqs[1, :bs].copy_(batch.seq_lens)
        extend_lens, seq_lens = batch.extend_lens_cpu, batch.seq_lens_cpu
        if pad:
            self.tokens[:, num_tokens:padded].zero_()  # token 0, position 0, slot 0
            self.reqs[0, bs : bs + 1].fill_(self.req_to_token.padding_row)
            self.reqs[1, bs : bs + 1].fill_(pad)
            extend_lens, seq_lens = [*extend_lens, pad], [*seq_lens, pad]
        self.backend.init_prefill_graph_replay(extend_lens, seq_lens, padded)
        return self._run(padded, num_tokens)

    def _before_capture(self, tokens: int) -> None:
        # the warm-up's batch is padding requests alone (each at most a table row long), so it
        # reads and writes only slot 0
        width = self.req_to_token.table.shape[1]
        lens = [min(width, tokens - start) for start in range(0, tokens, width)]
        self.backend.init_prefill_graph_replay(lens, lens, tokens)
        self.reqs[0, : len(lens)] = self.req_to_token.padding_row
        self.reqs[1, : len(lens)] = torch.tensor(lens)
        if self.lora_batch is not None:  # the LoRA kernels read a table of this bucket's length
            self.lora_batch.for_graph(tokens, self.max_requests)
