"""The engine's core run in the test's own process: the reference the multi-process Engine must equal."""

from __future__ import annotations

import dataclasses

import torch

from engine.batch.req import Req
from engine.frontend.input_processor import InputProcessor
from engine.model_config import ModelConfig
from engine.runtime.messages import TokenizedRequest
from engine.scheduler.scheduler import Scheduler
from engine.server_args import ServerArgs
from engine.tokenization import load_tokenizer


class InProcessCore:
    """A Scheduler and an InputProcessor on the CPU (or the `device` given), stepped by hand."""

    def __init__(self, model_dir, **kwargs) -> None:
        kwargs.setdefault("device", "cpu")
        self._build(ServerArgs.from_kwargs(model_path=str(model_dir), **kwargs))

    @classmethod
    def like(cls, engine) -> InProcessCore:
        """The same engine arguments, in this process (to look at the model and KV pool it loads)."""
        core = cls.__new__(cls)
        core._build(dataclasses.replace(engine.server_args, device="cpu"))
        return core

    def _build(self, args: ServerArgs) -> None:
        config = ModelConfig.from_folder(args.model_path, args.dtype, args.context_length)
        self.scheduler = Scheduler(args, config, torch.device(args.device))
        self.inputs = InputProcessor(
            args, config, load_tokenizer(args), self.scheduler.max_total_tokens
        )

    @property
    def model(self):
        return self.scheduler.runner.model

    def requests(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict],
        return_logprob: bool = False,
    ) -> list[TokenizedRequest]:
        """The messages the caller's process would send for these prompts."""
        call = self.inputs.make_call(
            None, input_ids, sampling_params, return_logprob, None, None, None
        )
        return call.requests

    def submit(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict],
        return_logprob: bool = False,
    ) -> list[Req]:
        """Queue the prompts in the scheduler; its Req of each."""
        requests = self.requests(input_ids, sampling_params, return_logprob)
        return [self.scheduler.add_request(r) for r in requests]

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict],
        return_logprob: bool = False,
    ) -> list[Req]:
        """Generate to completion; each prompt's finished Req (output_ids, output_logprobs, ...)."""
        reqs = self.submit(input_ids, sampling_params, return_logprob)
        while self.scheduler.has_work():
            self.scheduler.step()
        return reqs

    def run(
        self, input_ids: list[list[int]], sampling_params: dict | list[dict]
    ) -> list[list[int]]:
        """Generate to completion; the output token ids per prompt."""
        return [req.output_ids for req in self.generate(input_ids, sampling_params)]
