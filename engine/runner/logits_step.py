"""The one logits step: everything that becomes of a forward's logits, on the device, in one place.

For the rows that sample, in this order: repetition / frequency / presence penalties and
logit_bias; grammar masks of constrained requests; min_new_tokens (stop ids cannot win yet);
the seeded draw, stored as each request row's next decode input; output logprobs. For a
prefill it also takes prompt-token logprobs and score()'s label logprobs from their rows.
Then it queues the copy of what the host will read. Nothing here waits for the device.

Output logprobs are the log-softmax at temperature 1 of the logits the draw sees (penalties
and masks applied, before temperature / top-k / top-p), as SGLang reports them by default;
prompt-token logprobs are the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.batch.forward_batch import ForwardMode
from engine.batch.req import Req
from engine.batch.scheduled_batch import ScheduledBatch
from engine.runner.batch_builder import LogitPlan
from engine.runner.launched_step import HostBuffers, InputLogprobs, LaunchedStep
from engine.sampling.grammar import GrammarMasks
from engine.sampling.penalties import PenaltyState, penalised_rows
from engine.sampling.sampler import SamplingBatch, sample
from engine.speculative.verify import verify_chain, verify_greedy
from engine.transfer import to_device


class LogitsStep:
    def __init__(
        self, num_rows: int, vocab_size: int, device: torch.device, next_token: torch.Tensor
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.next_token = next_token  # [rows] the input of each request row's next decode
        self.penalties = PenaltyState(num_rows, vocab_size, device)
        self.grammar_masks = GrammarMasks(vocab_size, device)
        self._decode_asks: _Asks | None = None
        self._to_host = HostBuffers()

    def launch(
        self,
        batch: ScheduledBatch,
        plan: LogitPlan,
        logits: torch.Tensor,
        decode_rows: torch.Tensor,
    ) -> LaunchedStep:
        """Queue the step's logits work; `decode_rows` are a decode batch's request rows (device)."""
        if batch.verifies:
            return self._verify(batch, logits, decode_rows)
        step = LaunchedStep(batch.reqs)
        if batch.mode is ForwardMode.DECODE:  # every request samples; nothing else to plan
            step.sample_reqs = batch.reqs
            sample_logits, pool_rows = logits, decode_rows
        else:
            sample_rows = self._prefill_outputs(step, plan, logits)
            sample_logits = logits[to_device(sample_rows, torch.int64, self.device)]
            pool_rows = to_device([r.pool_row for r in step.sample_reqs], torch.int64, self.device)
        if step.sample_reqs:
            reqs = step.sample_reqs
            asks = self._asks_of(reqs) if batch.mode is ForwardMode.DECODE else _Asks.of(reqs)
            self.penalties.apply(reqs, sample_logits, asks.penalised, asks.biased)
            if asks.maybe_constrained:
                step.constrained = self.grammar_masks.apply(reqs, sample_logits)
            _suppress_early_stops(reqs, asks.min_new_tokens, sample_logits)
            self._sample(step, sample_logits, pool_rows, asks, batch.drawn)
            self.penalties.record(reqs, step.tokens, asks.penalised)
        step.copy_to_host(self._to_host)
        return step

    def _verify(self, batch: ScheduledBatch, logits: torch.Tensor, pool_rows: torch.Tensor):
        """A verify step: accept each request's drafts against its logits [T, V] (the rows of
        its last token and drafts, in batch order), and store its last new token as its next
        decode input. `step.tokens` is [B, K + 1]: each row's new tokens, then PAD_TOKEN.

        Requests that draft have no penalties, bias, grammar or min_new_tokens to meet
        (engine/scheduler/speculation.py); the others drafted nothing and get those applied at
        their one position, as a decode step would."""
        reqs = batch.reqs
        step = LaunchedStep(reqs, sample_reqs=reqs, verify=batch)
        lens = np.asarray(batch.extend_lens)
        width = int(lens.max())
        # row j of request i: its position min(j, k_i) (padding repeats its last)
        index = (np.cumsum(lens) - lens)[:, None] + np.minimum(np.arange(width), lens[:, None] - 1)
        index = to_device(index, torch.int64, self.device)
        drafts = to_device(
            [d + [0] * (width - 1 - len(d)) for d in batch.drafts], torch.int64, self.device
        ).view(len(reqs), width - 1)
        draft_lens = to_device(lens - 1, torch.int64, self.device)
        asks = _Asks.of(reqs)
        plain = not (asks.penalised or asks.biased or asks.maybe_constrained or asks.min_new_tokens)
        if asks.all_greedy and plain and not asks.logprob_rows:
            result = verify_greedy(logits.argmax(-1)[index], drafts, draft_lens)
        else:
            padded = logits[index]  # [B, K + 1, V]
            # each row's last position: the first for a row without drafts (what a decode step
            # would sample from), the one after a constrained row's forced drafts; penalties,
            # bias and min_new_tokens only ever touch rows without drafts
            rows = torch.arange(len(reqs), device=self.device)
            ends = draft_lens
            last = padded[rows, ends]
            self.penalties.apply(reqs, last, asks.penalised, asks.biased)
            if asks.maybe_constrained:
                step.constrained = self._grammar_masks(batch, padded, last)
            _suppress_early_stops(reqs, asks.min_new_tokens, last)
            padded[rows, ends] = last
            sampling = self._sampling_batch(reqs, asks, batch.drawn)
            probs = batch.draft_probs  # a draft model's distributions (STANDALONE), or None
            if probs is not None:
                probs = probs[:, : width - 1]
            result = verify_chain(padded, drafts, draft_lens, sampling, probs)
            if asks.logprob_rows:
                self._verify_logprobs(step, padded, result.tokens, asks.logprob_rows)
        last = result.tokens[torch.arange(len(reqs), device=self.device), result.accepted]
        self.next_token.index_copy_(0, pool_rows, last)
        self.penalties.record(reqs, result.tokens[:, 0], asks.penalised)  # (they drafted none)
        step.tokens = result.tokens
        step.copy_to_host(self._to_host)
        return step

    def _grammar_masks(self, batch: ScheduledBatch, padded: torch.Tensor, last: torch.Tensor):
        """A verify step's grammar masks: a constrained row's forced drafts (the only token
        its grammar allows at each of their positions) as one-hot logits, so they are accepted
        whatever the draw; its last position masked as its grammar stands after them (each
        matcher advanced through its drafts for the mask, then rolled back: reading the step
        feeds it every token kept)."""
        reqs, drafts = batch.reqs, batch.drafts
        forced = [i for i, r in enumerate(reqs) if r.grammar is not None and drafts[i]]
        for i in forced:
            for token in drafts[i]:
                reqs[i].grammar.accept_token(token)
        constrained = self.grammar_masks.apply(reqs, last)
        for i in forced:
            reqs[i].grammar.rollback(len(drafts[i]))
        if forced:
            at = [(i, j, t) for i in forced for j, t in enumerate(drafts[i])]
            rows, cols, tokens = to_device(list(zip(*at)), torch.int64, self.device)
            padded[rows, cols] = float("-inf")
            padded[rows, cols, tokens] = 0.0
        return constrained

    def _verify_logprobs(
        self, step: LaunchedStep, padded: torch.Tensor, tokens: torch.Tensor, rows: list[int]
    ) -> None:
        """Output logprobs at every position of the requests that asked ([R, K + 1], and top
        [R, K + 1, k]); the host keeps those of the tokens it appends."""
        k = max(step.reqs[i].top_logprobs_num for i in rows)
        index = to_device(rows, torch.int64, padded.device)
        lp = torch.log_softmax(padded[index].float(), dim=-1)
        chosen = tokens[index].clamp_min(0)
        step.logprob_rows = rows
        step.chosen = lp.gather(-1, chosen[..., None]).squeeze(-1)
        step.top_values, step.top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)

    def _asks_of(self, reqs: list[Req]) -> _Asks:
        """A decode batch's asks, computed again only when its requests change (the decode
        planner hands out the same list while they stay: engine/scheduler/decode.py)."""
        if self._decode_asks is None or self._decode_asks.reqs is not reqs:
            self._decode_asks = _Asks.of(reqs)
        return self._decode_asks

    def _prefill_outputs(
        self, step: LaunchedStep, plan: LogitPlan, logits: torch.Tensor
    ) -> list[int]:
        """Queue input logprobs and score labels of a prefill; returns the rows that sample."""
        sample_rows = []
        for req, start, n_input, samples in zip(step.reqs, plan.starts, plan.n_input, plan.samples):
            if n_input:
                step.input_logprobs.append(_input_logprobs(req, logits[start : start + n_input]))
            if not samples:
                continue
            labels = req.request.label_token_ids
            if labels is not None:
                row = logits[start + n_input]
                step.label_logprobs.append((req, self._label_logprobs(row, labels)))
            if req.sampling.max_new_tokens == 0:
                step.zero_length.append(req)
            else:
                sample_rows.append(start + n_input)
                step.sample_reqs.append(req)
        return sample_rows

    def _sample(
        self,
        step: LaunchedStep,
        logits: torch.Tensor,
        pool_rows: torch.Tensor,
        asks: _Asks,
        step_drawn: np.ndarray | None,
    ) -> None:
        """Draw the step's tokens, store them as the next decode inputs of their request rows,
        and compute the output logprobs asked for (all before the next launch can run)."""
        reqs = step.sample_reqs
        if asks.all_greedy:  # what sample() does for an all-greedy batch, without its inputs
            tokens = logits.argmax(-1)
        else:
            drawn = step_drawn if step_drawn is not None else [r.drawn for r in reqs]
            tokens = sample(logits, self._sampling_batch(reqs, asks, drawn))
        self.next_token.index_copy_(0, pool_rows, tokens)  # (cheaper to launch than [] =)
        step.tokens = tokens
        rows = asks.logprob_rows
        if rows:
            k = max(reqs[i].top_logprobs_num for i in rows)
            index = to_device(rows, torch.int64, logits.device)
            lp = torch.log_softmax(logits[index].float(), dim=-1)
            step.logprob_rows = rows
            step.chosen = lp.gather(1, tokens[index].view(-1, 1)).view(-1)
            step.top_values, step.top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)

    def _sampling_batch(
        self, reqs: list[Req], asks: _Asks, drawn: np.ndarray | list[int]
    ) -> SamplingBatch:
        """`drawn`: each request's draws so far, pending ones included (the draw's step)."""
        return sampling_batch(reqs, self.vocab_size, drawn, self.device, asks.seeds)

    def _label_logprobs(self, row: torch.Tensor, label_token_ids: list[int]) -> torch.Tensor:
        """score(): [len(label_token_ids)] log-softmax values of one logits row (read later)."""
        ids = to_device(label_token_ids, torch.int64, row.device)
        return torch.log_softmax(row.float(), dim=-1)[ids]


def sampling_batch(
    reqs: list[Req],
    vocab_size: int,
    drawn: np.ndarray | list[int],
    device: torch.device,
    seeds: list[int] | None = None,
) -> SamplingBatch:
    """The requests' sampling parameters as the sampler reads them, at output step `drawn`
    (each request's draws so far); `seeds` when known (all greedy: none needed)."""
    sp = [r.sampling for r in reqs]
    return SamplingBatch.from_rows(
        temperatures=[0.0 if s.is_greedy else s.temperature for s in sp],
        top_ks=[vocab_size if s.top_k == -1 else s.top_k for s in sp],
        top_ps=[s.top_p for s in sp],
        min_ps=[s.min_p for s in sp],
        seeds=seeds if seeds is not None and len(seeds) else [r.request.seed for r in reqs],
        steps=drawn,
        device=device,
    )


def _input_logprobs(req: Req, logits: torch.Tensor) -> InputLogprobs:
    """logits[j] is at prompt position input_logprob_next + j and gives the logprob of the token
    after it; advances input_logprob_next past these rows."""
    first = req.input_logprob_next + 1
    prompt = req.request.input_ids
    targets = to_device(prompt[first : first + logits.shape[0]], torch.int64, logits.device)
    req.input_logprob_next += logits.shape[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = lp.topk(min(req.top_logprobs_num, lp.shape[-1]), dim=-1)
    return InputLogprobs(req, lp.gather(1, targets.view(-1, 1)).view(-1), values, ids)


def _suppress_early_stops(reqs: list[Req], rows: list[int], logits: torch.Tensor) -> None:
    """min_new_tokens: the stop ids cannot win before enough tokens exist (`rows`: the requests
    that set min_new_tokens and have stop ids)."""
    for i in rows:
        sp = reqs[i].sampling
        if reqs[i].drawn < sp.min_new_tokens:
            logits[i, list(sp.stop_ids)] = float("-inf")


@dataclass(frozen=True)
class _Asks:
    """What the sampling requests of a step ask of it, by row; fixed for given requests (their
    sampling parameters never change), so a decode batch keeps it while its requests stay.

    NOTE: a decode batch's list of requests is never changed after planning, so the list's
    identity names its requests."""

    reqs: list[Req]
    all_greedy: bool
    penalised: list[int]
    biased: bool
    maybe_constrained: bool  # a grammar can only end (finish), so none now means none later
    min_new_tokens: list[int]
    logprob_rows: list[int]
    seeds: list[int]  # each row's sampling seed (none when all are greedy: argmax needs none)

    @classmethod
    def of(cls, reqs: list[Req]) -> _Asks:
        sps = [r.sampling for r in reqs]
        all_greedy = all(sp.is_greedy for sp in sps)
        return cls(
            reqs=reqs,
            all_greedy=all_greedy,
            penalised=penalised_rows(reqs),
            biased=any(sp.logit_bias for sp in sps),
            maybe_constrained=any(r.grammar is not None for r in reqs),
            min_new_tokens=[i for i, sp in enumerate(sps) if sp.min_new_tokens and sp.stop_ids],
            logprob_rows=[i for i, r in enumerate(reqs) if r.request.return_logprob],
            seeds=[] if all_greedy else [r.request.seed for r in reqs],
        )
