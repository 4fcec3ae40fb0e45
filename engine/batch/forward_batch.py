"""The tensors one model forward needs, built by the model runner, read by the model and kernels.

NOTE: the batch carries the memory it reads (the KV pool, the request->slot table) but not the
attention backend: that is fixed per engine and held by the attention layers themselves
(engine/layers/attention.py), so this module depends on no backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.batch.prefix_groups import SharedPrefix
    from engine.memory.kv_pool import KVPool


@dataclass
class ImageBatch:
    """A vision-language model's inputs beyond the tokens, for one prefill (built by
    engine/runner/image_embedder.py; decode steps need none: the model keeps each request's delta)."""

    rope_positions: torch.Tensor  # [3, T] int64: each token's (t, h, w) M-RoPE positions
    rope_deltas: torch.Tensor  # [B] int64: each request's generated-token position offset
    rows: torch.Tensor  # [K] int64: the batch's token rows that are image tokens
    embeds: torch.Tensor  # [K, H]: their embeddings, from the vision tower


class ForwardMode(Enum):
    EXTEND = auto()  # prefill: several new tokens per request, after an optional cached prefix
    DECODE = auto()  # one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    # one entry per token of the batch (requests concatenated in batch order)
    input_ids: torch.Tensor | None  # [T] int64; None in decode: the model runner gathers them
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    out_cache_loc: torch.Tensor  # [T] int64, pool slot receiving each token's K/V
    # one entry per request
    req_pool_indices: torch.Tensor  # [B] int64, the request's row in req_to_token
    seq_lens: torch.Tensor  # [B] int64, KV length once this step's tokens are stored
    seq_lens_cpu: list[int] | None  # None while a CUDA graph is captured (lengths vary per replay)
    extend_lens_cpu: list[int] | None  # new tokens per request (all 1 in decode); None: captured
    kv_pool: KVPool
    req_to_token: torch.Tensor  # [max_requests, max_context] int32
    # the fields above as rows of one tensor, which a CUDA-graph replay copies in one go:
    # decode [positions, out_cache_loc, req_pool_indices, seq_lens] ([4, B]);
    # extend [input_ids, positions, out_cache_loc, each token's table row] ([4, T])
    packed: torch.Tensor | None = None
    # decode and eager extend: requests that share a cached prefix, which attention may read
    # once per group
    shared_prefixes: list[SharedPrefix] | None = None
    # extend, on a vision-language model: M-RoPE positions and image embeddings
    images: ImageBatch | None = None
    # extend, a speculative verify step: each request's last token and its few drafts
    verify: bool = False

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]
