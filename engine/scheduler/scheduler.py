"""Continuous batching: the loop that owns KV memory and decides what each forward computes.

Each `step()` launches one forward, planned by one of two planners:
  - PrefillPlanner (EXTEND): the next chunk of a chunked prompt, then newly admitted requests;
  - DecodePlanner (DECODE): one token for every running request, retracting when pages run short.
Prefill goes first, so new requests join between steps — except right after a chunk, when a
decode step runs first, so a long prompt never stalls the requests already decoding.

The model runner does the device work of a step in one call (`runner.step`): the forward and
everything that becomes of its logits (penalties, grammar masks, the draw, logprobs). What the
scheduler gets back is a LaunchedStep; reading it (`_collect`) appends the tokens, finishes
the requests that are done and releases their KV.

Overlap (unless `disable_overlap_schedule`): a step launches forward N+1 before it reads the
tokens of forward N, so the host plans and builds while the device computes. This works
because the host never needs a token's value to plan: a decode input is gathered on the
device from the last sampled token of its request row, and a request whose pending token
ends it by length is left out of the next decode. One that ends by EOS or a stop string is
found a step late; the extra token it computed is dropped. All device work runs on one
stream, so pages freed or reused by the host are touched only after the launched work.
The exception is structured output: a grammar mask needs the token drawn before it, so a
step that drew for a constrained request is read before the next one is planned.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.batch.forward_batch import ForwardMode
from engine.batch.req import Req
from engine.batch.scheduled_batch import ScheduledBatch
from engine.model_config import ModelConfig
from engine.runner.launched_step import LaunchedStep
from engine.runner.model_runner import ModelRunner
from engine.runtime.messages import TokenizedRequest
from engine.sampling.grammar import GrammarBackend, grammar_key
from engine.scheduler.decode import DecodePlanner
from engine.scheduler.device_idle import DeviceIdleClock
from engine.scheduler.kv_cache import KVCache
from engine.scheduler.new_tokens import NewTokenEstimate
from engine.scheduler.prefill import PrefillPlanner
from engine.scheduler.queues import RequestQueues
from engine.scheduler.sessions import Sessions
from engine.scheduler.speculation import Speculation
from engine.scheduler.stats import SchedulerStats
from engine.server_args import ServerArgs
from engine.tokenization import IncrementalDecoder, TokenizerOnDemand

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, config: ModelConfig, device: torch.device) -> None:
        self.args = args
        self.config = config
        self.runner = ModelRunner(args, config, device)
        self.kv = KVCache(
            self.runner.kv_pool, self.runner.req_to_token, not args.disable_radix_cache
        )
        self.max_running_requests = self.runner.max_running_requests
        self.queues = RequestQueues()
        self.stats = SchedulerStats()
        self.estimate = estimate = NewTokenEstimate(self.kv, args.schedule_conservativeness)
        self.prefill = PrefillPlanner(
            args, self.kv, self.queues, estimate, self.stats, self.max_running_requests
        )
        self.decode = DecodePlanner(
            self.kv, self.queues, estimate, self.stats, args.shared_prefix_attention
        )
        # decodes the text of requests with stop strings; builds the grammars' token tables
        self.tokenizer = TokenizerOnDemand(args)
        self.grammar = GrammarBackend(args, self.tokenizer, config.vocab_size)
        self.overlap = not args.disable_overlap_schedule
        self._after_chunk = False
        self._inflight: LaunchedStep | None = None  # launched, not yet read (overlap only)
        self._finished_since_filter = False
        # finished on arrival, or aborted here: the next step reports them
        self._refused: list[Req] = []
        self.sessions = Sessions(self.kv)  # open_session / session_params
        # speculative decoding (speculative_algorithm): drafts, and when they are worth a verify
        self.speculation = (
            Speculation(args, self.grammar.forced_tokens, self.runner) if args.speculative else None
        )
        self.idle_clock = DeviceIdleClock(device)

    @property
    def max_total_tokens(self) -> int:
        return self.runner.kv_pool.num_tokens

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: TokenizedRequest) -> Req:
        """Queue a request the caller validated (engine/frontend/input_processor.py)."""
        refusal, turn = None, False
        if request.session_params is not None:  # a turn: its session's history comes first
            try:
                request, turn = self.sessions.continue_turn(request), True
                self._check_fits(request)
            except ValueError as e:
                refusal = str(e)
            for rid in self.sessions.take_replaced():  # running turns `replace` dropped
                self._abort(rid, "replaced by a later turn of its session (session_params.replace)")
        lora = self.runner.lora
        if request.lora_name is not None and (
            lora is None or request.lora_name not in lora.adapters
        ):
            refusal = f"lora_path {request.lora_name!r} names no loaded adapter"  # (unloaded since)
        req = Req(request, self.config.context_length)
        if refusal is not None:
            if not turn:  # no turn was made for it: none of the session's to drop
                req.session_id = None
            return self._refuse(req, refusal)
        sp = req.sampling
        stage = "load the tokenizer"
        try:  # NOTE: the caller validated the request; never let one request kill the loop
            if sp.stop_strings and self.tokenizer.available:
                # (the tokenizer loads here the first time, and its files may be gone since)
                req.stop_decoder = IncrementalDecoder(
                    self.tokenizer.get(), sp.skip_special_tokens, sp.spaces_between_special_tokens
                )
            stage = "compile the grammar"
            if grammar_key(sp) is not None:
                self.grammar.attach(req)
        except Exception as e:
            return self._refuse(req, f"cannot {stage}: {e}")
        self.queues.waiting.append(req)
        return req

    def _refuse(self, req: Req, message: str) -> Req:
        req.finish({"type": "abort", "message": message})
        self._refused.append(req)
        self._session_turn_ended(req)
        return req

    def _check_fits(self, request: TokenizedRequest) -> None:
        """A session turn's history with its new input must fit the context and the pool."""
        need = request.prompt_len + request.sampling.max_new_tokens
        for limit, name in ((self.config.context_length, "the context length"),
                            (self.max_total_tokens, "the KV pool (max_total_tokens)")):  # fmt: skip
            if need > limit:
                raise ValueError(
                    f"the session's history and this turn need {need} tokens ({request.prompt_len} "
                    f"input + max_new_tokens {request.sampling.max_new_tokens}), more than {name} "
                    f"({limit})"
                )

    def _session_turn_ended(self, req: Req) -> None:
        if req.session_id is not None:
            self.sessions.finished(req)

    # ------------------------------------------------------------------ aborts, idle, the cache
    def _abort(self, rid: str, message: str) -> None:
        """Abort a request of the scheduler's own accord; the next step reports it."""
        req = self.abort_request(rid, message)
        if req is not None:
            self._refused.append(req)

    def abort_request(self, rid: str, message: str = "aborted by the caller") -> Req | None:
        """Drop a waiting or admitted request, freeing its pages; returns it, finished as aborted."""
        reason = {"type": "abort", "message": message}
        for req in self.queues.waiting:
            if req.request.rid == rid:
                self.queues.waiting.remove(req)
                req.finish(reason)
                req.grammar = None
                self._session_turn_ended(req)
                return req
        for req in self.queues.admitted():
            if req.request.rid == rid:
                self._retire(req, reason)
                self.queues.drop(req)
                return req
        return None

    def has_work(self) -> bool:
        q = self.queues
        return bool(q.waiting or q.running or q.chunked or self._inflight or self._refused)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused while requests are queued or running. (The other
        management calls are answered between steps by engine/scheduler/control.py.)"""
        if self.has_work():
            logger.warning(
                "cache not flushed: %d request(s) are queued or running",
                len(self.queues.waiting) + len(self.queues.running),
            )
            return False
        self.sessions.drop_kv()  # (their next turns prefill their history again)
        self.kv.flush()
        return True

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Launch one forward and read one; return the requests that advanced (tokens added or
        finished). With overlap the step read is the one launched before; else this one."""
        t0 = time.perf_counter()
        advanced, self._refused = self._refused, []
        if self._inflight is not None and self._read_first(self._inflight):
            # NOTE: a grammar mask needs its matcher to have accepted every drawn token, and a
            # draft the tokens before it (and a verify step's KV lengths its accepted count), so
            # such a step is read before the next is planned
            advanced += self._collect(self._inflight)
            self._inflight = None
            self._filter_finished()
        t_launch = time.perf_counter()
        batch = self._schedule()
        launched = self._launch(batch) if batch is not None else None
        launch = time.perf_counter() - t_launch
        self.stats.launch_seconds += launch
        if batch is not None and batch.mode is ForwardMode.EXTEND and not batch.verifies:
            self.stats.prefill_launch_seconds += launch
        if self._inflight is not None:
            advanced += self._collect(self._inflight)
        self._inflight = launched
        if launched is not None and not self.overlap:
            advanced += self._collect(launched)
            self._inflight = None
        self._filter_finished()
        if batch is None and self._inflight is None and not advanced:
            advanced = self.prefill.refuse_unadmittable()
        if self._inflight is None and not self.has_work():
            self.stats.device_idle_seconds += self.idle_clock.idle()
        self.stats.busy_seconds += time.perf_counter() - t0
        return advanced

    def _read_first(self, step: LaunchedStep) -> bool:
        spec = self.speculation
        return (
            step.constrained
            or step.verify is not None
            or (spec is not None and spec.wants_fresh_tokens())
        )

    def _schedule(self) -> ScheduledBatch | None:
        q = self.queues
        if not (self._after_chunk and q.running):
            batch = self.prefill.plan()
            if batch is not None:
                self.stats.prefill_steps += 1
                self._after_chunk = q.chunked is not None
                return batch
        if q.running:
            self._after_chunk = False
            return self.decode.plan(self.speculation)
        return None

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the step's device work; nothing here waits for the device."""
        gap = self.idle_clock.around_launch()
        step = self.runner.step(batch)
        step.idle_gap = gap
        if batch.verifies:  # (its draws are counted when it is read: _collect_verify)
            self.stats.draft_tokens += sum(batch.extend_lens) - len(batch.reqs)
            self.idle_clock.launched(step.ready)
            return step
        if batch.mode is ForwardMode.EXTEND:
            self.stats.prefill_tokens_computed += sum(batch.extend_lens)
            for req in batch.reqs:  # later requests find what this step computed
                self.kv.cache_prefix(req)
        if batch.rows is not None:  # decode: every request drew
            self.kv.rows.drawn[batch.rows] += 1
        else:
            for req in step.sample_reqs:
                req.drawn += 1
        self.idle_clock.launched(step.ready)
        return step

    def _collect(self, step: LaunchedStep) -> list[Req]:
        """Read a launched step: append its tokens and logprobs, finish and retire who is done."""
        t0 = time.perf_counter()
        tokens, chosen, top_values, top_ids = step.fetch()
        t1 = time.perf_counter()
        self.stats.wait_seconds += t1 - t0
        self.stats.device_idle_seconds += self.idle_clock.seconds(step.idle_gap)
        advanced = [r for r in step.reqs if r.finish_reason is None]
        if step.verify is not None:
            self._collect_verify(step, tokens, chosen, top_values, top_ids)
            self.stats.collect_seconds += time.perf_counter() - t1
            return advanced
        for lp in step.input_logprobs:
            if lp.req.finish_reason is None:
                lp.req.input_logprobs += lp.chosen.tolist()
                lp.req.input_top_logprobs += list(zip(lp.top_values.tolist(), lp.top_ids.tolist()))
        for req, values in step.label_logprobs:
            req.label_logprobs = values.tolist()
        for req in step.zero_length:
            if req.finish_reason is None:
                self._retire(req, {"type": "length", "length": 0})
        if step.logprob_rows:
            self._append_logprobs(step, chosen, top_values, top_ids)
        # NOTE: one Python pass, the cheapest form at hundreds of requests (measured against
        # array-column checks, which cost more in gathers than the loop's attribute reads)
        for req, token in zip(step.sample_reqs, tokens.tolist()):
            if req.finish_reason is not None:  # aborted, or ended a step ago
                continue
            req.append_token(token)
            if req.grammar is None or not self.grammar.accept(req, token):
                req.check_finished(token)
            if req.finish_reason is not None:
                self._retire(req, req.finish_reason)
        self.stats.generated_tokens += len(tokens)
        self.stats.collect_seconds += time.perf_counter() - t1
        return advanced

    def _collect_verify(
        self, step: LaunchedStep, tokens: np.ndarray, chosen: list, top_values: list, top_ids: list
    ) -> None:
        """Read a verify step: each request's accepted drafts and the target's token, appended
        up to the one that ends it; its KV cut back to the tokens it now holds."""
        batch = step.verify
        logprobs = dict(zip(step.logprob_rows, range(len(step.logprob_rows))))
        lengths = (tokens >= 0).sum(1).tolist()
        cut_rows, cut_lens = [], []  # the KV lengths of requests that go on, cut back at once
        for i, (req, n) in enumerate(zip(step.reqs, lengths)):
            if req.finish_reason is not None:  # aborted meanwhile (its KV is released)
                continue
            new = tokens[i, :n].tolist()
            j = logprobs.get(i)
            if req.stop_decoder is None and req.grammar is None and j is None:
                kept = self._append_plain(req, new)
            else:
                kept = self._append_one_by_one(req, new, j, chosen, top_values, top_ids)
            # NOTE: its K/V holds its last token and the accepted drafts (the new token's is
            # computed by its next step); past a token that ended it, nothing is kept
            req.drawn = req.drawn + n
            self.speculation.verified(req, len(batch.drafts[i]), new)
            self.stats.accepted_draft_tokens += n - 1
            self.stats.generated_tokens += kept
            if req.finish_reason is None:
                cut_rows.append(req.pool_row)
                cut_lens.append(int(batch.starts[i]) + kept)
            else:  # (cut back before the pages it keeps are cached)
                self.kv.truncate(req, int(batch.starts[i]) + kept)
                self._retire(req, req.finish_reason)
        if cut_rows:
            self.kv.truncate_rows(np.asarray(cut_rows), np.asarray(cut_lens))

    @staticmethod
    def _append_plain(req: Req, new: list[int]) -> int:
        """Append a verify step's tokens to a request with no stop strings, grammar or
        logprobs: up to its first stop id (once min_new_tokens are out) or its limit, then
        `check_finished` on the last, as appending them one by one would end it."""
        keep = min(len(new), req.draw_limit - len(req.output_ids))
        stop_ids = req.sampling.stop_ids
        if stop_ids:
            first = len(req.output_ids) + 1  # the count once new[0] is appended
            wait = req.sampling.min_new_tokens
            keep = next(
                (i + 1 for i, t in enumerate(new[:keep]) if t in stop_ids and first + i >= wait),
                keep,
            )
        req.output_ids += new[:keep]
        req.check_finished(new[keep - 1])
        return keep

    def _append_one_by_one(
        self, req: Req, new: list[int], j: int | None, chosen: list, top_values: list, top_ids: list
    ) -> int:
        """Append a verify step's tokens one at a time (stop strings, a grammar, logprobs),
        up to the one that ends the request."""
        kept = 0
        for token in new:
            req.append_token(token)
            if j is not None:
                k = req.top_logprobs_num
                req.output_logprobs.append(chosen[j][kept])
                req.output_top_logprobs.append((top_values[j][kept][:k], top_ids[j][kept][:k]))
            kept += 1
            if req.grammar is None or not self.grammar.accept(req, token):
                req.check_finished(token)
            if req.finish_reason is not None:
                break
        return kept

    @staticmethod
    def _append_logprobs(step: LaunchedStep, chosen: list, top_values: list, top_ids: list) -> None:
        """Output logprobs of the requests that asked, for the token each drew this step."""
        for j, i in enumerate(step.logprob_rows):
            req = step.sample_reqs[i]
            if req.finish_reason is None:
                k = req.top_logprobs_num
                req.output_logprobs.append(chosen[j])
                req.output_top_logprobs.append((top_values[j][:k], top_ids[j][:k]))

    def _retire(self, req: Req, reason: dict) -> None:
        if not req.finished:
            req.finish(reason)
        if req.finish_reason["type"] in ("length", "stop"):
            self.estimate.finished(req)
            if self.speculation is not None:
                self.speculation.finished(req)
        req.grammar = None
        if req.pool_row < 0:  # retracted while its last token was pending: it holds nothing
            self.queues.waiting.remove(req)
        else:
            self.kv.release(req)
        self._session_turn_ended(req)  # (after release: the turn's tokens are cached by now)
        self.stats.requests_finished += 1
        self._finished_since_filter = True

    def _filter_finished(self) -> None:
        if self._finished_since_filter:
            self.queues.running = [r for r in self.queues.running if r.finish_reason is None]
            self._finished_since_filter = False
