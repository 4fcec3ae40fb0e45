"""CUDA graphs for decode: one captured forward per batch size, replayed with the batch padded up.

A decode step of a small model is hundreds of short kernels; launching them from Python costs
more than running them. Each captured size replays all of them in one launch. The graph of
size P reads its inputs from the [4, P] view of the runner's decode input buffer
(engine/runner/decode_inputs.py):

    [0] positions   [1] out_cache_loc   [2] req_pool_indices   [3] seq_lens

The batch builder has already filled that view: the batch's B columns, then padding columns
[B, P) of a harmless request: position 0, slot 0, the table's padding row (all slot 0) and
length 1. Slot 0 is the pool's scratch page, owned by nobody, so padded rows read and write
only there. So a replay copies nothing. The graphs write logits into one shared buffer; a
replay's logits are valid until the next replay, so the caller reads them (samples) before then.

Token ids are gathered inside the graph from ModelRunner.next_token by request row, so no
host value enters the graph at all.

A backend whose kernels differ by batch asks for several kinds of graph per size
(AttentionBackend.decode_graph_kinds; the triton backend's stage-1 tile for short suffixes) and
names the kind each batch replays (graph_kind); the kinds share one memory pool.

What the graphs capture is handed in (the runner's eager forward, its backend, pool and
table), so this module knows nothing of the model runner.
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
from engine.runner.decode_inputs import DecodeInputs

if TYPE_CHECKING:
    from engine.lora.layer import LoraBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: dense where padding would waste a large fraction, sparser above
    (beyond 256, at most 25% padding: four sizes an octave keep the capture short)."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    sizes += list(range(80, 257, 16))
    size = 320
    while size < max_bs:
        sizes.append(size)
        size += 1 << (size.bit_length() - 3)
    capped = [s for s in sizes if s < max_bs]
    return capped + [max_bs]


def capture_graph(
    forward: Callable[[], None], pool: object, stream: torch.cuda.Stream, warm_ups: int
) -> torch.cuda.CUDAGraph:
    """Run `forward` `warm_ups` times on `stream` (compiling its kernels and creating library
    handles outside the capture), then capture it into a graph that allocates from `pool`."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warm_ups):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        forward()
    return graph


class DecodeCudaGraphs:
    def __init__(
        self,
        forward_eager: Callable[[ForwardBatch], torch.Tensor],
        backend: AttentionBackend,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        decode_inputs: DecodeInputs,
        vocab_size: int,
        dtype: torch.dtype,
        max_bs: int,
        pool: object,
        lora_batch: LoraBatch | None = None,
    ) -> None:
        self.forward_eager = forward_eager
        self.lora_batch = lora_batch  # LoRA's block table, captured at each size's length
        self.backend = backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.decode_inputs = decode_inputs
        self.sizes = capture_sizes(max_bs)
        self.max_bs = max_bs
        self.device = device = req_to_token.table.device
        self.logits = torch.empty((max_bs, vocab_size), dtype=dtype, device=device)
        # keyed (size, kind): several kinds at a size where the backend's kernels differ by batch
        # (its graph_kind: the triton backend's short-suffix tile), else kind 0 alone
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._capture_all(pool)

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def padded_size(self, bs: int) -> int:
        return next(s for s in self.sizes if s >= bs)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the decode batch; returns logits [B, vocab] in the model's dtype."""
        bs = batch.batch_size
        padded = self.padded_size(bs)
        static = self.decode_inputs.columns(padded)
        # NOTE: the builder wrote the batch (and its padding) into the graph's own inputs
        assert batch.packed.stride(0) == padded
        self.backend.init_graph_replay(batch, padded, static)
        self.graphs[padded, self.backend.graph_kind(batch)].replay()
        # NOTE: a view of the shared buffer: valid until the next replay (the scheduler samples
        # from it first; device work runs in launch order)
        return self.logits[:bs]

    # ------------------------------------------------------------------ capture
    def _capture_all(self, pool: object) -> None:
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "capturing CUDA graphs for decode: %d batch sizes up to %d",
            len(self.sizes),
            self.max_bs,
        )
        stream = torch.cuda.Stream(self.device)
        # largest first: later, smaller graphs reuse the memory pool the first one grew
        for i, bs in enumerate(reversed(self.sizes)):
            for kind in range(self.backend.decode_graph_kinds(self.kv_pool, bs)):
                self.graphs[bs, kind] = self._capture(bs, kind, pool, stream)
            logger.debug("captured decode graph %d/%d (batch size %d)", i + 1, len(self.sizes), bs)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured %d CUDA graphs in %.1fs (%.0f MiB)",
            len(self.graphs),
            time.perf_counter() - started,
            used / 2**20,
        )

    def _capture(
        self, bs: int, kind: int, pool: object, stream: torch.cuda.Stream
    ) -> torch.cuda.CUDAGraph:
        forward = self._forward_fn(bs)
        # the most K/V entries a decode batch of bs can read: the pool, plus a slot per padded row
        self.backend.init_graph_capture(bs, self.kv_pool.num_tokens + bs, kind)
        if self.lora_batch is not None:  # the LoRA kernels read a table of this size's length
            self.lora_batch.for_graph(bs, bs)
        return capture_graph(forward, pool, stream, warm_ups=2)

    def _forward_fn(self, bs: int) -> Callable[[], None]:
        static = self.decode_inputs.columns(bs)
        static.copy_(torch.from_numpy(self.decode_inputs.padding).expand(4, bs))
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=None,
            positions=static[0, :bs],
            out_cache_loc=static[1, :bs],
            req_pool_indices=static[2, :bs],
            seq_lens=static[3, :bs],
            seq_lens_cpu=None,
            extend_lens_cpu=[1] * bs,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token.table,
        )
        out, forward_eager = self.logits[:bs], self.forward_eager

        def forward() -> None:
            out.copy_(forward_eager(batch))

        return forward
