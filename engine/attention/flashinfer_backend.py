"""Attention on FlashInfer's paged-KV wrappers (an optional dependency: `pip install
flashinfer-python`; its kernels compile on first use).

gristmill's pool has one slot per token, so FlashInfer sees pages of one token: a request's
page list is its row of req_to_token (packed on the device by kernels/kv_indices.py), every
last page is full, and the K/V buffers [slots, Hkv, D] are FlashInfer's NHD layout with
page_size 1. Per batch, `init_forward_metadata` plans the decode or the prefill wrapper once
(FlashInfer's plan is host work: the CSR offsets come from the host's lengths, in pinned
memory, so nothing waits on the device); per layer, `run` reads the pool.

Decode runs eagerly: FlashInfer's plan must be redone on the host before every step, which
the decode CUDA graphs of engine/cuda_graph.py do not do, so this backend does not offer them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBackend
from engine.forward_batch import ForwardBatch, ForwardMode
from kernels.kv_indices import gather_kv_indices

if TYPE_CHECKING:
    from engine.layers.attention import Attention

_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k scratch, one per wrapper
DTYPES = (torch.float16, torch.bfloat16)


def check_available(device: torch.device, dtype: torch.dtype) -> None:
    """ValueError naming attention_backend unless FlashInfer can run this model here."""
    if device.type != "cuda":
        raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got {device}.")
    if dtype not in DTYPES:
        raise ValueError(
            f"attention_backend='flashinfer' needs dtype float16 or bfloat16, got {dtype}."
        )
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "attention_backend='flashinfer' needs the flashinfer-python package "
            f"(`pip install flashinfer-python`): {e}"
        ) from None


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = False  # see the module docstring

    def __init__(self, attn: Attention, dtype: torch.dtype, device: torch.device) -> None:
        import flashinfer

        check_available(device, dtype)
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scaling, self.dtype = attn.head_dim, attn.scaling, dtype

        def workspace() -> torch.Tensor:
            return torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)

        # tensor cores pay off once a KV head serves several query heads (as SGLang decides)
        group = self.num_heads // self.num_kv_heads
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace(), "NHD", use_tensor_cores=group >= 4
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        lens = batch.seq_lens_cpu
        assert lens is not None, "the flashinfer backend does not run inside CUDA graphs"
        kv_indptr = _pinned_offsets(lens)
        total = int(kv_indptr[-1])
        indices = gather_kv_indices(
            batch.req_to_token,
            batch.req_pool_indices,
            kv_indptr.to(batch.seq_lens.device, non_blocking=True),
            total,
        )
        last_page_len = _pinned(torch.ones(len(lens), dtype=torch.int32))
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, 1)  # page_size 1
        dtypes = {"q_data_type": self.dtype, "kv_data_type": self.dtype}
        if batch.mode is ForwardMode.DECODE:
            self.decode.plan(
                kv_indptr, indices, last_page_len, *shape, sm_scale=self.scaling, **dtypes
            )
        else:
            qo_indptr = _pinned_offsets(batch.extend_lens_cpu)
            self.prefill.plan(
                qo_indptr, kv_indptr, indices, last_page_len, *shape,
                causal=True, sm_scale=self.scaling, **dtypes,
            )  # fmt: skip

    def forward_decode(
        self, q: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.decode.run(q.contiguous(), _paged(batch, layer))

    def forward_extend(
        self, q: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.prefill.run(q.contiguous(), _paged(batch, layer))


def _paged(batch: ForwardBatch, layer: Attention) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K/V buffers [slots, Hkv, D] as FlashInfer's [pages, page_size=1, Hkv, D]."""
    pool = batch.kv_pool
    return pool.k_buffers[layer.layer_id].unsqueeze(1), pool.v_buffers[layer.layer_id].unsqueeze(1)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t


def _pinned_offsets(lengths: list[int]) -> torch.Tensor:
    """CSR offsets [len+1] int32 on the host (pinned, so FlashInfer's copy is asynchronous)."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=offsets[1:])
    return _pinned(offsets)
