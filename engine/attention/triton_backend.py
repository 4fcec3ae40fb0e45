"""Attention on the Triton kernels of `kernels/`: paged decode (split along the sequence) and
extend over a cached prefix plus new causal tokens, both reading K/V through req_to_token.

Per batch it plans once: the index tensors the kernels take and the host-side length hints
that size their grids, so no kernel launch needs a device-to-host sync.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionLayer
from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.transfer import to_device
from kernels.decode_attention import decode_attention
from kernels.extend_attention import extend_attention


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # NOTE: a CUDA-graph capture has no lengths (seq_lens_cpu is None): the decode kernel then
        # sizes its grid from the table's width, so one capture serves every length.
        self.max_seq_len = None if batch.seq_lens_cpu is None else max(batch.seq_lens_cpu)
        if batch.mode is ForwardMode.EXTEND:
            lens = batch.extend_lens_cpu
            self.max_extend_len = max(lens)
            self.extend_lens = to_device(lens, torch.int64, batch.seq_lens.device)
            self.qo_indptr = torch.zeros(
                len(lens) + 1, dtype=torch.int64, device=batch.seq_lens.device
            )
            torch.cumsum(self.extend_lens, 0, out=self.qo_indptr[1:])

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return decode_attention(
            q, batch.kv_pool.k_buffers[layer.layer_id], batch.kv_pool.v_buffers[layer.layer_id],
            batch.req_to_token, batch.req_pool_indices, batch.seq_lens, layer.scaling,
            max_seq_len=self.max_seq_len,
        )  # fmt: skip

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return extend_attention(
            q, batch.kv_pool.k_buffers[layer.layer_id], batch.kv_pool.v_buffers[layer.layer_id],
            batch.req_to_token, batch.req_pool_indices, batch.seq_lens, self.extend_lens,
            self.qo_indptr, layer.scaling, max_extend_len=self.max_extend_len,
        )  # fmt: skip
