"""Repetition, frequency and presence penalties and logit_bias, applied to logits on the device.

Semantics (SGLang's, which follow OpenAI's and transformers'):
  frequency:  logit[t] -= frequency_penalty * (times t was generated)
  presence:   logit[t] -= presence_penalty  * (t was generated at all)
  repetition: for t in the prompt or generated: logit[t] / p if logit[t] > 0 else logit[t] * p
  logit_bias: logit[t] += bias[t]
They change the distribution every sampler draws from, and the reported logprobs with it.

State lives on the device, one row per request-table row: how often each token was generated
and which tokens the prompt holds. Counts are bumped at launch from the sampled tokens
themselves, so a pending token (overlap scheduling) is already counted when the next step is
planned. A row is rebuilt from the host's token lists whenever a penalised request samples
from a row it does not own yet (first prefill, or after a retraction), when nothing of it is
pending. The tables are allocated the first time a request needs them.
"""

from __future__ import annotations

import torch

from engine.batch.req import Req
from engine.transfer import to_device


def has_penalties(req: Req) -> bool:
    sp = req.sampling
    return bool(sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0)


def penalised_rows(reqs: list[Req]) -> list[int]:
    return [i for i, r in enumerate(reqs) if has_penalties(r)]


class PenaltyState:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, device
        self.counts: torch.Tensor | None = None  # [rows, V] int32, generated-token counts
        self.in_prompt: torch.Tensor | None = None  # [rows, V] bool
        # which admission of which request a row's state belongs to (Req.admit_order is unique)
        self.owner: list[int] = [-1] * num_rows

    @staticmethod
    def bytes_for(num_rows: int, vocab_size: int) -> int:
        """Device memory of the state once made: int32 counts and a bool mask per row."""
        return num_rows * vocab_size * (4 + 1)

    def apply(
        self,
        reqs: list[Req],
        logits: torch.Tensor,
        penalised: list[int] | None = None,
        biased: bool = True,
    ) -> None:
        """Penalise and bias, in place, the logits rows [len(reqs), V] of the sampling requests.

        `penalised` (the rows with penalties) and `biased` (whether any row has a logit_bias)
        may come precomputed: a decode batch's requests stay the same for many steps."""
        if biased:
            self._bias(reqs, logits)
        idx = penalised if penalised is not None else penalised_rows(reqs)
        if not idx:
            return
        self._ensure_rows([reqs[i] for i in idx])
        sps = [reqs[i].sampling for i in idx]
        index = to_device(idx, torch.int64, self.device)
        rows = to_device([reqs[i].pool_row for i in idx], torch.int64, self.device)
        params = to_device(
            [
                [s.frequency_penalty for s in sps],
                [s.presence_penalty for s in sps],
                [s.repetition_penalty for s in sps],
            ],
            torch.float32,
            self.device,
        )
        counts = self.counts[rows].float()  # [P, V]
        x = logits[index].float()
        x = x - params[0][:, None] * counts - params[1][:, None] * (counts > 0).float()
        seen = self.in_prompt[rows] | (counts > 0)
        rep = params[2][:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        logits[index] = x.to(logits.dtype)

    def record(
        self, reqs: list[Req], tokens: torch.Tensor, penalised: list[int] | None = None
    ) -> None:
        """Count the tokens just sampled (device tensor, one per request) for penalised requests."""
        idx = penalised if penalised is not None else penalised_rows(reqs)
        if not idx:
            return
        rows = to_device([reqs[i].pool_row for i in idx], torch.int64, self.device)
        chosen = tokens[to_device(idx, torch.int64, self.device)]
        ones = torch.ones_like(chosen, dtype=torch.int32)
        self.counts.index_put_((rows, chosen), ones, accumulate=True)

    # ------------------------------------------------------------------ internals
    def _bias(self, reqs: list[Req], logits: torch.Tensor) -> None:
        rows, cols, values = [], [], []
        for i, req in enumerate(reqs):
            for token, bias in (req.sampling.logit_bias or {}).items():
                rows.append(i)
                cols.append(int(token))
                values.append(float(bias))
        if rows:
            index = to_device([rows, cols], torch.int64, self.device)
            bias = to_device(values, torch.float32, self.device).to(logits.dtype)
            logits.index_put_((index[0], index[1]), bias, accumulate=True)

    def _ensure_rows(self, reqs: list[Req]) -> None:
        if self.counts is None:
            shape = (self.num_rows, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        for req in reqs:
            row = req.pool_row
            if self.owner[row] == req.admit_order:
                continue
            # NOTE: only when nothing of the request is pending: it is sampling from a prefill
            assert req.pending == 0, "a penalty row is rebuilt while a token is pending"
            self.owner[row] = req.admit_order
            self.counts[row].zero_()
            self.in_prompt[row].zero_()
            self.in_prompt[row, to_device(req.request.input_ids, torch.int64, self.device)] = True
            if req.output_ids:
                out = to_device(req.output_ids, torch.int64, self.device)
                self.counts[row].index_put_(
                    (out,), torch.ones_like(out, dtype=torch.int32), accumulate=True
                )
