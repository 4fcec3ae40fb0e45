"""Owns the model weights, the KV pool tensors and the attention backend; runs one step.

`step(batch)` is the scheduler's one call per step: build the batch's tensors
(batch_builder), run the forward (a CUDA-graph replay when one fits: cuda_graph.py for decode,
prefill_graph.py for prefill), and hand the logits to the logits step, which samples on the
device and returns a LaunchedStep. Logits never leave this object.

Start-up on a GPU, in order:
  1. load the weights (and a STANDALONE draft model's: engine/runner/draft_runner.py);
  2. a warm-up forward of the largest prefill step (`max_prefill_tokens`) over a throw-away
     pool measures the activation peak (and compiles the prefill kernels);
  3. the KV pool takes what `mem_fraction_static` allows for weights + pool, and never more
     than what is free minus that peak and the decode graphs' share (a draft model's pool
     holds as many tokens: each pooled token counts both);
  4. CUDA graphs are captured over the real pool (unless disabled): prefill first, then
     decode, in one memory pool (a replay never overlaps another).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.attention import create_backend
from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.batch.scheduled_batch import ScheduledBatch
from engine.layers.attention import attention_layers, kv_scales, use_backend
from engine.layers.distributed import agree_min
from engine.lora.manager import LoraManager
from engine.memory.kv_pool import KVPool
from engine.memory.req_to_token import ReqToTokenPool
from engine.model_config import ModelConfig
from engine.quantization import resolve_quantization
from engine.quantization.fp8 import check_device
from engine.runner.batch_builder import build_forward_batch
from engine.runner.cuda_graph import DecodeCudaGraphs
from engine.runner.decode_inputs import DecodeInputs
from engine.runner.draft_runner import DraftWeights, load_draft
from engine.runner.image_embedder import ImageEmbedder
from engine.runner.launched_step import LaunchedStep
from engine.runner.loader import load_model, reload_weights
from engine.runner.logits_step import LogitsStep
from engine.runner.prefill_graph import PrefillCudaGraphs, prefill_capture_sizes
from engine.runner.verify_graph import VerifyCudaGraphs
from engine.sampling.penalties import PenaltyState
from engine.server_args import ServerArgs
from engine.speculative_args import MAX_VERIFY_TOKENS, verify_token_limit
from engine.transfer import to_device

logger = logging.getLogger(__name__)

# CPU default pool: a tenth of the machine's memory, at most this many tokens.
_CPU_MAX_DEFAULT_TOKENS = 65536
_GPU_SLACK_BYTES = 512 * 2**20  # allocator fragmentation, library workspaces


class ModelRunner:
    def __init__(self, args: ServerArgs, config: ModelConfig, device: torch.device) -> None:
        self.args = args
        self.config = config
        self.device = device
        loading = time.perf_counter()
        # FP8 linear layers (engine/quantization/): quantized at load, or an FP8 checkpoint's
        self.fp8 = resolve_quantization(args.quantization, config, args.kv_cache_dtype, device.type)
        if self.fp8 is not None:
            check_device(device)
        self.model = load_model(config, args.load_format, device, self.fp8)
        # a draft model's weights, here so that the pool below is sized beside them
        self.draft: DraftWeights | None = None
        if args.speculative_algorithm == "STANDALONE":
            self.draft = load_draft(args, config, device)
        logger.info("weights loaded in %.1fs", time.perf_counter() - loading)
        # LoRA adapters (engine/lora/): a LoraLinear on each projection they may target
        self.lora = LoraManager(args, config, self.model, device) if args.lora_enabled else None
        # a vision-language model's image embeddings and M-RoPE positions, per prefill
        self.images: ImageEmbedder | None = None
        if config.is_vision_language:
            self.model.set_request_rows(args.max_request_rows + 1)
            self.images = ImageEmbedder(self.model, config.hidden_size, device)
        # (a float8 cache holds K/V scaled by each layer's k_scale / v_scale: engine/memory/kv_pool.py)
        kv_name = args.kv_cache_dtype_name
        self.kv_dtype = getattr(torch, kv_name) if kv_name is not None else config.dtype
        attn = attention_layers(self.model)[0]
        self.num_kv_heads = attn.num_kv_heads
        rows = args.max_request_rows  # (how many of them run is decided once the pool is)
        self.req_to_token = ReqToTokenPool(rows, config.context_length, device)
        # the last token sampled for each request row: the input of its next decode step
        self.next_token = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        # a decode step's columns, read by its graph in place
        self.decode_inputs = DecodeInputs(rows, self.req_to_token.padding_row, device)
        self.attn_backend = create_backend(
            args.attention_backend,
            device,
            attn,
            config.dtype,
            args.shared_prefix_attention,
            args.prefill_attention_fp8,
        )
        use_backend(self.model, self.attn_backend)
        self._logit_buckets = prefill_capture_sizes(args.max_prefill_tokens)
        activation_peak = self._warm_up() if device.type == "cuda" else 0
        self.max_total_tokens = self._pool_tokens(activation_peak)
        self.max_running_requests = args.running_requests_for(self.max_total_tokens)
        self.kv_pool = self._new_pool(self.max_total_tokens // args.page_size)
        self.kv_pool.set_scales(*kv_scales(self.model))  # a float8 cache's, per layer
        logger.info(
            "KV pool: %d tokens in pages of %d (%.1f MiB), %d request rows",
            self.kv_pool.num_tokens,
            args.page_size,
            self.kv_pool.nbytes() / 2**20,
            self.max_running_requests,
        )
        self.logits_step = LogitsStep(rows + 1, config.vocab_size, device, self.next_token)
        self.graphs: DecodeCudaGraphs | None = None
        self.prefill_graphs: PrefillCudaGraphs | None = None
        self.verify_graphs: VerifyCudaGraphs | None = None
        if self._use_cuda_graphs():
            pool = torch.cuda.graph_pool_handle()
            if self._prefill_graph_tokens():
                self.prefill_graphs = PrefillCudaGraphs(
                    self.forward_hidden, self.attn_backend, self.kv_pool, self.req_to_token,
                    config.hidden_size, config.dtype, self._prefill_graph_tokens(),
                    max_requests=rows + 1, pool=pool,
                    lora_batch=self.lora.batch if self.lora is not None else None,
                )  # fmt: skip
            self.graphs = DecodeCudaGraphs(
                self.forward_eager, self.attn_backend, self.kv_pool, self.req_to_token,
                self.decode_inputs, config.vocab_size, config.dtype,
                max_bs=min(args.cuda_graph_max_bs, self.max_running_requests), pool=pool,
                lora_batch=self.lora.batch if self.lora is not None else None,
            )  # fmt: skip
            if self._verifies_on_graphs():
                self.verify_graphs = VerifyCudaGraphs(
                    self.forward_hidden, self.attn_backend, self.kv_pool, self.req_to_token,
                    config.hidden_size, config.dtype, self.graphs.max_bs,
                    args.speculative_num_draft_tokens, verify_token_limit(args.max_prefill_tokens),
                    pool=pool,
                )  # fmt: skip

    # ------------------------------------------------------------------ weights
    def update_weights(self, model_path: str, load_format: str | None) -> None:
        """Another checkpoint of the same shapes into the weights in service (ValueError, and
        the old weights kept, if it does not fit): engine/runner/loader.py: reload_weights."""
        self.config = reload_weights(
            self.model, self.config, model_path, load_format or self.args.load_format, self.fp8
        )
        # NOTE: in place, so the CUDA graphs that read the scales by pointer stay right
        self.kv_pool.set_scales(*kv_scales(self.model))

    def weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """A checkpoint tensor as it is loaded (its first `truncate_size` rows, float32 lists),
        by its Hugging Face name: get_weights_by_name. With tensor parallelism the layer gathers
        its shards from every rank (NOTE: every rank runs this, as every rank runs controls)."""
        tied = name.removeprefix("model.") == "lm_head.weight" and self.config.tie_word_embeddings
        mapped = ("embed_tokens.weight", None) if tied else self.model.checkpoint_to_param(name)
        params = dict(self.model.named_parameters())
        if mapped is None or mapped[0] not in params:
            raise ValueError(f"no weight named {name!r} in the model (Hugging Face tensor names)")
        param_name, shard = mapped
        param = params[param_name]
        layer = self.model.get_submodule(param_name.rsplit(".", 1)[0])
        read = getattr(layer, "checkpoint_tensor", None)  # (a sharded layer's; else replicated)
        tensor = read(param, shard) if read is not None else param.data
        return tensor[:truncate_size].float().cpu().tolist()

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the batch's forward and everything its logits become; nothing here waits."""
        n = len(batch.reqs)
        graphed = self.graphs is not None and n <= self.graphs.max_bs
        width = self.graphs.padded_size(n) if graphed else n  # (decode columns)
        forward, plan = build_forward_batch(
            batch, self.kv_pool, self.req_to_token, self.decode_inputs, width
        )
        if self.images is not None and forward.mode is ForwardMode.EXTEND:
            forward.images = self.images.image_batch(batch)
        if self.lora is not None:  # each request's adapter in a slot, and the block table
            names = [r.lora_name for r in batch.reqs]
            self.lora.prepare(names, list(batch.extend_lens), self._graph_size(forward, width))
        if batch.verifies:  # every row, on a bucket of rows (below): counts vary every step
            n = forward.input_ids.shape[0]
            rows = torch.arange(self._logit_rows_bucket(n), device=self.device).clamp_(max=n - 1)
            logits = self.forward(forward, rows)[:n]
        elif plan.rows is None:  # every row (decode)
            logits = self.forward(forward, None)
        else:
            n = len(plan.rows)
            # NOTE: the LM head runs on a bucket of rows (the last one repeated): each new row
            # count costs cuBLAS a heuristic lookup, and a new kernel a lazy load (~4 ms on an
            # H100); the buckets are few, and warmed up at start-up
            padded = plan.rows + plan.rows[-1:] * (self._logit_rows_bucket(n) - n)
            logits = self.forward(forward, to_device(padded, torch.int64, self.device))[:n]
        return self.logits_step.launch(batch, plan, logits, forward.req_pool_indices)

    def _graph_size(self, batch: ForwardBatch, width: int) -> tuple[int, int] | None:
        """(tokens, requests) of the CUDA graph `forward` will replay for the batch, or None."""
        if self.graphs is not None and self.graphs.fits(batch):
            return width, width
        graphs = self.prefill_graphs
        if self._prefill_graph_fits(batch):
            return graphs.padded_size(batch.input_ids.shape[0]), graphs.max_requests
        return None

    def _prefill_graph_fits(self, batch: ForwardBatch) -> bool:
        """Whether `forward` replays a prefill graph for the batch (else it runs eagerly)."""
        graphs = self.prefill_graphs
        if graphs is None or not graphs.fits(batch):
            return False
        # (a backend with a verify kernel runs verify steps on it: the prefill graphs hold the
        # extend kernel)
        if batch.verify and self.attn_backend.has_verify_kernel:
            return False
        return self.attn_backend.prefill_graph_takes(batch)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """Run the batch; logits [len(logit_rows), vocab] of the chosen token rows (all rows when
        None), in the model's dtype: argmax needs no float32 copy, log-softmax makes one."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.replay(batch)
        if self._prefill_graph_fits(batch):
            return self._logits(self.prefill_graphs.replay(batch), logit_rows)
        if self.verify_graphs is not None and self.verify_graphs.fits(batch):
            return self._logits(self.verify_graphs.replay(batch), logit_rows)
        return self.forward_eager(batch, logit_rows)

    def forward_eager(
        self, batch: ForwardBatch, logit_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The forward itself (the decode graphs capture this)."""
        return self._logits(self.forward_hidden(batch), logit_rows)

    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The model up to its last hidden states (the prefill graphs capture this)."""
        if batch.mode is ForwardMode.DECODE:
            # NOTE: a decode's new slots go into the table here, in the forward that the decode
            # graphs capture: a replay writes them at no host cost (an indexed write launched
            # from the host cost ~70 us a step). A prefill's are written by the batch builder.
            self.req_to_token.write_slots(
                batch.req_pool_indices, batch.positions, batch.out_cache_loc
            )
        self.attn_backend.init_forward_metadata(batch)
        input_ids = batch.input_ids
        if input_ids is None:  # decode: each request's last sampled token, gathered on the device
            input_ids = self.next_token[batch.req_pool_indices]
        return self.model(input_ids, batch.positions, batch)

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    def _logit_rows_bucket(self, rows: int) -> int:
        """The row count the LM head runs for `rows` rows of a prefill step (on the CPU, `rows`:
        there the padding would only add work)."""
        if rows == 0 or self.device.type != "cuda":
            return rows
        return next((b for b in self._logit_buckets if b >= rows), rows)

    # ------------------------------------------------------------------ memory
    def image_counters(self) -> dict[str, float]:
        """A vision-language model's images encoded and vision-tower seconds (else nothing)."""
        return self.images.counters() if self.images is not None else {}

    def allocator_counters(self) -> dict[str, int]:
        """PyTorch's CUDA allocator: device allocations and frees, and retries after a failed
        allocation. Each free (and retry) synchronises the device, so a step that triggers one
        waits for the work in flight: in a step's launch time that looks like host time."""
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {
            "cuda_mallocs": stats.get("num_device_alloc", 0),
            "cuda_frees": stats.get("num_device_free", 0),
            "cuda_alloc_retries": stats.get("num_alloc_retries", 0),
        }

    def _new_pool(self, num_pages: int) -> KVPool:
        c = self.config
        return KVPool(
            num_pages, self.args.page_size, c.num_layers, self.num_kv_heads, c.head_dim,
            self.kv_dtype, self.device, grouped_v=self.args.grouped_v,
        )  # fmt: skip

    def _pool_tokens(self, activation_peak: int) -> int:
        per_token = self.config.kv_bytes_per_token(self.kv_dtype, self.num_kv_heads)
        if (
            self.draft is not None
        ):  # (its pool holds the same tokens: engine/runner/draft_runner.py)
            per_token += self.draft.kv_bytes_per_token
        if self.args.max_total_tokens is not None:
            tokens = self.args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = self.args.mem_fraction_static
            static_budget = total * fraction - (total - free)  # weights + pool <= fraction
            graphs = self._graph_bytes_estimate(activation_peak) if self._use_cuda_graphs() else 0
            # the penalty counts of every request row, made at the first penalised request
            penalties = PenaltyState.bytes_for(
                self.req_to_token.padding_row + 1, self.config.vocab_size
            )
            headroom = free - activation_peak - graphs - penalties - _GPU_SLACK_BYTES
            tokens = int(min(static_budget, headroom) // per_token)
            logger.info(
                "GPU memory: %.1f GiB total, %.1f GiB free after weights; activation peak "
                "%.2f GiB, CUDA graphs ~%.2f GiB; mem_fraction_static %.2f",
                total / 2**30, free / 2**30, activation_peak / 2**30, graphs / 2**30, fraction,
            )  # fmt: skip
        else:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            tokens = min(int(ram * 0.1 // per_token), _CPU_MAX_DEFAULT_TOKENS)
        tokens = agree_min(tokens, self.device)  # tensor-parallel ranks must hold the same pool
        tokens -= tokens % self.args.page_size
        if tokens < self.args.page_size:
            raise ValueError(
                f"the KV pool would hold {tokens} tokens: raise max_total_tokens or mem_fraction_static "
                f"({per_token} bytes per token)"
            )
        return tokens

    def _use_cuda_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.args.disable_cuda_graph
            and self.attn_backend.supports_cuda_graph
        )

    def _verifies_on_graphs(self) -> bool:
        """Whether verify steps get graphs of their own (engine/runner/verify_graph.py). With
        LoRA they run eagerly (its block table would need capturing per size too), and on a
        vision-language model (an EXTEND step's M-RoPE positions come with its ImageBatch,
        which no graph captures: as its prefills, engine/runner/image_embedder.py)."""
        return (
            self.args.speculative
            and self.attn_backend.has_verify_kernel
            and self.lora is None
            and self.images is None
        )

    def _prefill_graph_tokens(self) -> int:
        """The largest prefill step a graph replays (0: none), never above what a step holds."""
        if not self.attn_backend.supports_prefill_cuda_graph or self.images is not None:
            return 0  # (a vision-language prefill scatters image rows: it runs eagerly)
        tokens = min(self.args.prefill_cuda_graph_max_tokens, self.args.max_prefill_tokens)
        # a capture's warm-up batch is padding requests of at most one table row each
        return min(tokens, self.config.context_length * self.args.max_request_rows)

    def _graph_bytes_estimate(self, activation_peak: int) -> int:
        """The decode graphs keep a logits buffer and share one pool sized by the largest batch.
        The prefill graphs' pool holds the activations of their largest step, which the eager
        peak already reserves, unless eager prefills of more tokens still run beside them."""
        # (a draft model's decode graphs too: engine/runner/draft_runner.py)
        configs = [self.config] + ([self.draft.config] if self.draft is not None else [])
        per_row = sum(
            c.vocab_size * (2 + 4 + 4) + 16 * (c.hidden_size + c.intermediate_size) * 4
            for c in configs
        )
        prefill = self._prefill_graph_tokens()
        beside = prefill < self.args.max_prefill_tokens
        prefill_pool = activation_peak * prefill // self.args.max_prefill_tokens if beside else 0
        return self.args.cuda_graph_max_bs * per_row + prefill_pool

    def _warm_up(self) -> int:
        """Forwards over a throw-away pool: the largest prefill step, whose activation peak it
        returns (bytes allocated during the forward beyond what was allocated before), then two
        small odd-sized ones, so the kernels' size specialisations (one token; a count that is
        no multiple of 16) compile now rather than inside the first real steps."""
        tokens = self.args.max_prefill_tokens
        width = self.config.context_length
        lens = [min(width, tokens - start) for start in range(0, tokens, width)]
        lens = lens[: self.req_to_token.padding_row]  # one table row each
        pool = self._new_pool(-(-sum(lens) // self.args.page_size))
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warm_up_forward(pool, lens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        for small in ([1], [3, 14]):
            self._warm_up_forward(pool, small)
        self._warm_up_lm_head()
        del pool
        torch.cuda.empty_cache()
        logger.info(
            "warm-up prefill of %d tokens: activation peak %.2f GiB", sum(lens), peak / 2**30
        )
        return peak

    @torch.inference_mode()
    def _warm_up_lm_head(self) -> None:
        """The LM head at every row bucket a prefill's sampled rows can take (at most one per
        running request) or a verify step's rows, so its kernels load now rather than in the
        first steps."""
        most = self._logit_rows_bucket(self.req_to_token.padding_row)
        if self.args.speculative:  # a verify step's rows: every token it computes
            most = max(most, self._logit_rows_bucket(MAX_VERIFY_TOKENS))
        hidden = torch.zeros(
            most, self.config.hidden_size, dtype=self.config.dtype, device=self.device
        )
        for rows in self._logit_buckets:
            if rows <= most:
                self.model.compute_logits(hidden[:rows])

    @torch.inference_mode()
    def _warm_up_forward(self, pool: KVPool, lens: list[int]) -> None:
        """An extend forward of random tokens, request r (table row r) with lens[r] tokens."""
        dev, page = self.device, self.args.page_size
        slots = torch.arange(page, page + sum(lens), device=dev)
        rows = torch.cat([torch.full((n,), r, device=dev) for r, n in enumerate(lens)])
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        self.req_to_token.write_slots(rows, positions, slots)
        gen = torch.Generator(device=dev).manual_seed(0)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.randint(
                self.config.vocab_size, (sum(lens),), device=dev, generator=gen
            ),
            positions=positions,
            out_cache_loc=slots,
            req_pool_indices=torch.arange(len(lens), device=dev),
            seq_lens=torch.tensor(lens, device=dev),
            seq_lens_cpu=lens,
            extend_lens_cpu=lens,
            kv_pool=pool,
            req_to_token=self.req_to_token.table,
        )
        self.forward_eager(batch, torch.cumsum(batch.seq_lens, 0) - 1).float()
