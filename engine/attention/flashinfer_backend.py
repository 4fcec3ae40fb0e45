"""Attention on FlashInfer's paged-KV wrappers (an optional dependency: `pip install
flashinfer-python`; its kernels compile on first use).

gristmill's pool has one slot per token, so FlashInfer sees pages of one token: a request's
page list is its row of req_to_token (packed on the device by kernels/kv_indices.py), every
last page is full, and the K/V buffers [slots, Hkv, D] are FlashInfer's NHD layout with
page_size 1. Per batch, `init_forward_metadata` plans the decode or the prefill wrapper once
(FlashInfer's plan is host work: the CSR offsets come from the host's lengths, in pinned
memory, so nothing waits on the device); per layer, `run` reads the pool.

Decode CUDA graphs: each captured batch size gets its own decode wrapper in FlashInfer's
CUDA-graph mode, whose page table lives in fixed buffers. It is planned with placeholder
lengths before its capture, and re-planned with the batch's real lengths (padded rows: one
token in the scratch slot) right before every replay, so the captured kernels read this
step's pages.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.backend import AttentionBackend, AttentionLayer
from engine.batch.forward_batch import ForwardBatch, ForwardMode
from kernels.kv_indices import gather_kv_indices

_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k scratch
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
    supports_cuda_graph = True

    def __init__(self, attn: AttentionLayer, dtype: torch.dtype, device: torch.device) -> None:
        check_available(device, dtype)
        import flashinfer

        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scaling, self.dtype = attn.head_dim, attn.scaling, dtype
        self.device = device
        # split-k scratch: one for eager decode, one for prefill, one shared by the graphs'
        # wrappers (only one graph replays at a time; the layout measured on the H100)
        self._workspaces = [
            torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device) for _ in range(3)
        ]
        # tensor cores pay off once a KV head serves several query heads (as SGLang decides)
        self.tensor_cores = self.num_heads // self.num_kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspaces[0], "NHD", use_tensor_cores=self.tensor_cores
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspaces[1], "NHD")
        self.active_decode = self.decode  # the wrapper whose plan the next decode runs
        self.graph_decode: dict[int, Any] = {}  # captured batch size -> its graph-mode wrapper
        self._graph_indices: torch.Tensor | None = None  # the graph wrappers' shared page list
        self._ones = _pinned(torch.ones(0, dtype=torch.int32))  # every last page is full

    @property
    def _shape(self) -> tuple[int, int, int, int]:
        return (self.num_heads, self.num_kv_heads, self.head_dim, 1)  # page_size 1

    @property
    def _dtypes(self) -> dict[str, Any]:
        return {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": self.scaling}

    def _last_page_lens(self, n: int) -> torch.Tensor:
        if self._ones.numel() < n:
            self._ones = _pinned(torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.int32))
        return self._ones[:n]

    def _page_table(
        self, lens: list[int], rows: torch.Tensor, req_to_token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(CSR offsets on the host, page list on the device) of requests in table `rows`."""
        kv_indptr = _pinned_offsets(lens)
        device_indptr = kv_indptr.to(self.device, non_blocking=True)
        return kv_indptr, gather_kv_indices(req_to_token, rows, device_indptr, int(kv_indptr[-1]))

    # ------------------------------------------------------------------ CUDA graphs
    def init_graph_capture(self, bs: int, max_kv_entries: int, kind: int = 0) -> None:
        import flashinfer

        if self._graph_indices is None or self._graph_indices.numel() < max_kv_entries:
            self._graph_indices = torch.zeros(max_kv_entries, dtype=torch.int32, device=self.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspaces[2], "NHD", use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=self.device),
        )  # fmt: skip
        # placeholder plan: what the capture batch is (every row one token in slot 0)
        placeholder = torch.zeros(bs, dtype=torch.int32, device=self.device)
        wrapper.plan(
            _pinned_offsets([1] * bs), placeholder, self._last_page_lens(bs),
            *self._shape, **self._dtypes,
        )  # fmt: skip
        self.graph_decode[bs] = wrapper

    def init_graph_replay(self, batch: ForwardBatch, padded: int, static: torch.Tensor) -> None:
        # NOTE: the page list is gathered from the table now, before the graph runs; the graph
        # writes the step's new slots into the table (ModelRunner.forward_hidden) too late for
        # that, so they are written here first (the graph's write then changes nothing)
        batch.req_to_token[batch.req_pool_indices, batch.positions] = batch.out_cache_loc.to(
            torch.int32
        )
        lens = list(batch.seq_lens_cpu) + [1] * (padded - batch.batch_size)
        # the padded rows' table row maps every position to the scratch slot 0
        kv_indptr, indices = self._page_table(lens, static[2, :padded], batch.req_to_token)
        self.graph_decode[padded].plan(
            kv_indptr, indices, self._last_page_lens(padded), *self._shape, **self._dtypes
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        lens = batch.seq_lens_cpu
        if lens is None:  # a graph capture (and its warm-up runs): planned before, replanned later
            self.active_decode = self.graph_decode[batch.batch_size]
            return
        kv_indptr, indices = self._page_table(lens, batch.req_pool_indices, batch.req_to_token)
        last_page_len = self._last_page_lens(len(lens))
        if batch.mode is ForwardMode.DECODE:  # eager: graphs disabled, or a batch above them
            self.decode.plan(kv_indptr, indices, last_page_len, *self._shape, **self._dtypes)
            self.active_decode = self.decode
        else:
            qo_indptr = _pinned_offsets(batch.extend_lens_cpu)
            self.prefill.plan(
                qo_indptr, kv_indptr, indices, last_page_len, *self._shape, causal=True,
                **self._dtypes,
            )  # fmt: skip

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.active_decode.run(q.contiguous(), _paged(batch, layer))

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return self.prefill.run(q.contiguous(), _paged(batch, layer))


def _paged(batch: ForwardBatch, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K/V buffers [slots, Hkv, D] as FlashInfer's [pages, page_size=1, Hkv, D]."""
    pool = batch.kv_pool
    return pool.k_buffers[layer.layer_id].unsqueeze(1), pool.v_buffers[layer.layer_id].unsqueeze(1)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()  # the backend runs on CUDA only (check_available)


def _pinned_offsets(lengths: list[int]) -> torch.Tensor:
    """CSR offsets [len+1] int32 on the host (pinned, so FlashInfer's copy is asynchronous)."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=offsets[1:])
    return _pinned(offsets)
