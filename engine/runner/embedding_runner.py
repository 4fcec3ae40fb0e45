"""Runs an embedding model: token id lists in, one pooled hidden state per list out (on the device).

Two kinds of model embed:
  - encoders (BERT): one bidirectional forward over the packed tokens; no KV cache at all;
  - decoders (Llama, Qwen): the causal model of the generation path, run by a ModelRunner as a
    prefill whose K/V go to a scratch region of its pool and are forgotten after the step.
Either way the final hidden states are pooled as the folder's sentence-transformers config
says (engine.runner.pooling). Nothing here waits for the device.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.model_config import ModelConfig
from engine.runner.loader import load_model
from engine.runner.model_runner import ModelRunner
from engine.runner.pooling import PoolingConfig, pool
from engine.server_args import ServerArgs
from engine.transfer import to_device

logger = logging.getLogger(__name__)


class EmbeddingRunner:
    def __init__(self, args: ServerArgs, config: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.is_encoder = config.is_encoder
        self.pooling = PoolingConfig.from_folder(config.path, self.is_encoder)
        self.runner: ModelRunner | None = None
        if self.is_encoder:
            self.model = load_model(config, args.load_format, device)
            self.max_batch_tokens = args.max_prefill_tokens
            self.max_requests = args.max_request_rows
        else:
            # decode never runs here, so no decode graphs
            self.runner = ModelRunner(
                dataclasses.replace(args, disable_cuda_graph=True), config, device
            )
            self.model = self.runner.model
            self.max_batch_tokens = min(args.max_prefill_tokens, self.runner.kv_pool.num_tokens)
            self.max_requests = self.runner.max_running_requests
        logger.info(
            "embedding model %s: %s pooling%s",
            config.architecture,
            self.pooling.method,
            ", normalized" if self.pooling.normalize else "",
        )

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]]) -> torch.Tensor:
        """[B, H] float32 pooled hidden states, before normalization."""
        lengths = to_device([len(t) for t in token_lists], torch.int64, self.device)
        starts = torch.cumsum(lengths, 0) - lengths
        if self.is_encoder:
            ids = [t for seq in token_lists for t in seq]
            positions = [p for seq in token_lists for p in range(len(seq))]
            packed = to_device([ids, positions], torch.int64, self.device)
            hidden = self.model(packed[0], packed[1], [len(t) for t in token_lists])
        else:
            hidden = self._prefill(token_lists)
        return pool(hidden, starts, lengths, self.pooling.method)

    def _prefill(self, token_lists: list[list[int]]) -> torch.Tensor:
        """A causal forward of the sequences over the pool's first slots (request i in table row i)."""
        runner = self.runner
        page = runner.args.page_size
        lens = [len(t) for t in token_lists]
        total = sum(lens)
        ids = [t for seq in token_lists for t in seq]
        positions = [p for n in lens for p in range(n)]
        rows = [r for r, n in enumerate(lens) for _ in range(n)]
        packed = to_device([ids, positions, rows], torch.int64, self.device)
        # NOTE: slots from the second page on: page 0 is the pool's scratch page
        slots = torch.arange(page, page + total, device=self.device)
        runner.req_to_token.write_slots(packed[2], packed[1], slots)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=packed[0],
            positions=packed[1],
            out_cache_loc=slots,
            req_pool_indices=torch.arange(len(lens), device=self.device),
            seq_lens=to_device(lens, torch.int64, self.device),
            seq_lens_cpu=lens,
            extend_lens_cpu=lens,
            kv_pool=runner.kv_pool,
            req_to_token=runner.req_to_token.table,
        )
        runner.attn_backend.init_forward_metadata(batch)
        return self.model(batch.input_ids, batch.positions, batch)  # [T, H]
