"""Owns the model weights, the KV pool tensors and the attention backend; runs one forward."""

from __future__ import annotations

import logging
import os

import torch

from engine.attention import create_backend
from engine.forward_batch import ForwardBatch
from engine.memory.kv_pool import KVPool
from engine.memory.req_to_token import ReqToTokenPool
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

# CPU default pool: a tenth of the machine's memory, at most this many tokens.
_CPU_MAX_DEFAULT_TOKENS = 65536
_GPU_DEFAULT_MEM_FRACTION = 0.85


class ModelRunner:
    def __init__(self, args: ServerArgs, config: ModelConfig, device: torch.device) -> None:
        self.args = args
        self.config = config
        self.device = device
        self.model = load_model(config, args.load_format, device)
        self.kv_dtype = config.dtype
        self.max_total_tokens = self._pool_tokens()
        self.max_running_requests = args.max_running_requests or min(256, self.max_total_tokens)
        page = args.page_size
        self.kv_pool = KVPool(
            self.max_total_tokens // page,
            page,
            config.num_layers,
            self.model.layers[0].self_attn.attn.num_kv_heads,
            config.head_dim,
            self.kv_dtype,
            device,
        )
        self.req_to_token = ReqToTokenPool(self.max_running_requests, config.context_length, device)
        self.attn_backend = create_backend(args.attention_backend, device)
        logger.info(
            "KV pool: %d tokens in pages of %d (%.1f MiB), %d request rows",
            self.kv_pool.num_tokens,
            page,
            self.kv_pool.nbytes() / 2**20,
            self.max_running_requests,
        )

    def _pool_tokens(self) -> int:
        per_token = self.config.kv_bytes_per_token(self.kv_dtype)
        if self.args.max_total_tokens is not None:
            tokens = self.args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = self.args.mem_fraction_static or _GPU_DEFAULT_MEM_FRACTION
            tokens = int((total * fraction - (total - free)) // per_token)
        else:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            tokens = min(int(ram * 0.1 // per_token), _CPU_MAX_DEFAULT_TOKENS)
        tokens -= tokens % self.args.page_size
        if tokens < self.args.page_size:
            raise ValueError(
                f"the KV pool would hold {tokens} tokens: raise max_total_tokens or mem_fraction_static "
                f"({per_token} bytes per token)"
            )
        return tokens

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run the batch; return float32 logits [len(logit_rows), vocab] of the chosen token rows."""
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[logit_rows]).float()
