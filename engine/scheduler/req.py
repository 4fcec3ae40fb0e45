"""One generation request as the scheduler sees it, from admission to its last token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from engine.tokenization import IncrementalDecoder, find_stop


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int  # the request's sampling_seed, or one drawn for it by the engine
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only (SGLang's default)
    top_logprobs_num: int = 0
    stream: bool = False

    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    created_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None

    # KV memory, owned by engine.memory.KVCache
    pool_row: int = -1
    kv_pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens of fill_ids whose K/V are in the pool
    prefix_len: int = 0  # of those, served by the prefix cache at admission
    last_node: Any = field(default=None, repr=False)  # the cache node locked for this request
    admitted_once: bool = False
    admit_order: int = -1  # retraction takes the newest first
    input_logprob_next: int = -1  # next prompt position whose logits still feed input logprobs
    # NOTE: with overlap scheduling a sampled token reaches output_ids one step after it was
    # drawn on the device; meanwhile it is pending (its value lives in ModelRunner.next_token).
    drawn: int = 0  # output tokens drawn on the device, pending ones included
    # drawn tokens that end the request by length whatever they are: min(max_new_tokens,
    # context_length - prompt_len), set by the scheduler when the request arrives
    draw_limit: int = 1 << 62

    # progress already sent to the caller (scheduler process)
    sent_len: int = 0
    sent_first: bool = False
    # the text so far, kept only for requests with stop strings (scheduler process)
    stop_decoder: IncrementalDecoder | None = field(default=None, repr=False)
    # xgrammar GrammarMatcher of a json_schema / regex / ebnf request, attached by the scheduler
    # (never before pickling: the Req crosses processes without one); None when free or finished
    grammar: Any = field(default=None, repr=False)

    # encode(): a prefill-only request whose result is its pooled hidden state (is_embedding)
    embed_dimensions: int | None = None  # keep this many leading values (None: all)
    embedding: list[float] | None = None
    # score(): log-probabilities of these token ids at the position after the prompt
    label_token_ids: list[int] | None = None
    label_logprobs: list[float] | None = None

    # logprobs: value, and top-k (values, ids) per position; None where SGLang gives None
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[tuple[list[float], list[int]] | None] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[tuple[list[float], list[int]]] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def fill_ids(self) -> list[int]:
        """Every token the model has seen or will see next: the prompt, then the output so far."""
        return self.input_ids + self.output_ids

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.input_logprob_next < self.prompt_len - 1

    @property
    def pending(self) -> int:
        """Drawn tokens whose values the host has not read yet."""
        return self.drawn - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def input_logprob_start(self) -> int:
        """First prompt position whose logprob is reported (SGLang: -1 means the last prompt token)."""
        if self.logprob_start_len < 0:
            return self.prompt_len - 1
        return min(self.logprob_start_len, self.prompt_len - 1)

    def finish(self, reason: dict[str, Any]) -> None:
        self.finish_reason = reason
        self.finished_at = time.perf_counter()

    def check_finished(self, token: int) -> None:
        """Called after `token` was appended to output_ids (the per-token hot path: keep it lean)."""
        n = len(self.output_ids)
        if self.stop_decoder is not None:
            new_text = self.stop_decoder.push([token])
            stop_string = find_stop(
                self.stop_decoder.text, len(new_text), self.sampling.stop_strings
            )
        else:
            stop_string = None
        if token in self.sampling.stop_ids and n >= self.sampling.min_new_tokens:
            self.finish({"type": "stop", "matched": token})
        elif stop_string is not None:
            self.finish({"type": "stop", "matched": stop_string})
        elif n >= self.draw_limit:
            self.finish({"type": "length", "length": n})
