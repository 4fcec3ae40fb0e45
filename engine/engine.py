"""The offline Engine, with the public API of SGLang's `sglang.Engine`.

    engine = Engine(model_path="/models/Qwen3-0.6B")
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 16})
    print(out["text"], out["meta_info"]["finish_reason"])

The path of a request: `generate` -> TokenizerManager.make_call (tokenize, validate, build Req)
-> Scheduler.add_request -> Scheduler.step (batching, KV pages, ModelRunner.forward -> model ->
attention backend over the paged pool, sampling) -> TokenizerManager.format (detokenize, meta_info).
In this version the scheduler runs in the caller's process.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engine.model_config import ModelConfig
from engine.scheduler import Scheduler
from engine.server_args import ServerArgs
from engine.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# generate() arguments of SGLang that this engine does not serve; passing them is an error, not a no-op
_UNSUPPORTED_GENERATE_ARGS = (
    "image_data",
    "audio_data",
    "video_data",
    "lora_path",
    "custom_logit_processor",
    "token_ids_logprob",
    "return_hidden_states",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "data_parallel_rank",
)


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        logging.getLogger("engine").setLevel(args.log_level.upper())
        started = time.perf_counter()
        self.model_config = ModelConfig.from_folder(
            args.model_path, args.dtype, args.context_length
        )
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.scheduler = Scheduler(args, self.model_config, self.device)
        self.tokenizer_manager = TokenizerManager(
            args, self.model_config, self.scheduler.max_total_tokens
        )
        self.startup_seconds = time.perf_counter() - started
        self._closed = False
        logger.info("engine ready in %.1fs on %s", self.startup_seconds, self.device)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **unsupported: Any,
    ) -> dict | list[dict]:
        """Generate for one prompt (returns a dict) or a list of prompts (a list of dicts, in input order)."""
        self._check_open()
        _refuse(unsupported)
        if stream:
            raise ValueError("stream=True is not supported by this engine version yet.")
        call = self.tokenizer_manager.make_call(
            prompt,
            input_ids,
            sampling_params,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            return_text_in_logprobs,
        )
        for req in call.reqs:
            self.scheduler.add_request(req)
        pending = {req.rid for req in call.reqs}
        try:
            while pending:
                for req in self.scheduler.step():
                    if req.finished:
                        pending.discard(req.rid)
                if pending and not self.scheduler.has_work():
                    raise RuntimeError(
                        f"scheduler went idle with {len(pending)} request(s) unfinished"
                    )
        except BaseException:
            for rid_ in pending:  # leave the engine clean for the next call
                self.scheduler.abort_request(rid_)
            raise
        outputs = [
            self.tokenizer_manager.format(req, call.return_text_in_logprobs) for req in call.reqs
        ]
        _raise_if_aborted(call.reqs)
        return outputs if call.is_batch else outputs[0]

    # ------------------------------------------------------------------ management
    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run. Nothing is cached across calls yet."""
        self._check_open()
        return not self.scheduler.has_work()

    def get_server_info(self) -> dict[str, Any]:
        self._check_open()
        stats = self.scheduler.stats
        return {
            **self.server_args.to_dict(),
            "model_config": self.model_config.hf,
            "device": str(self.device),
            "max_total_num_tokens": self.scheduler.max_total_tokens,
            "max_running_requests": self.scheduler.max_running_requests,
            "startup_seconds": self.startup_seconds,
            "internal_states": [
                {
                    "requests_finished": stats.requests_finished,
                    "prompt_tokens": stats.prompt_tokens,
                    "generated_tokens": stats.generated_tokens,
                    "prefill_steps": stats.prefill_steps,
                    "decode_steps": stats.decode_steps,
                    "gen_throughput": stats.generated_tokens / stats.busy_seconds
                    if stats.busy_seconds
                    else 0.0,
                }
            ],
        }

    def shutdown(self) -> None:
        """Release the model and KV memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        del self.scheduler
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down")


def _refuse(unsupported: dict[str, Any]) -> None:
    unknown = [k for k in unsupported if k not in _UNSUPPORTED_GENERATE_ARGS]
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(unknown)}")
    used = [k for k, v in unsupported.items() if v not in (None, False)]
    if used:
        raise ValueError(
            f"generate() argument(s) {', '.join(used)} are not supported by this engine."
        )


def _raise_if_aborted(reqs: list) -> None:
    """A request the scheduler had to fail surfaces as an error in its caller, as in SGLang."""
    for req in reqs:
        if req.finish_reason and req.finish_reason.get("type") == "abort":
            raise ValueError(f"request {req.rid} failed: {req.finish_reason.get('message')}")
