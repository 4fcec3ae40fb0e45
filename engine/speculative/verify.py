"""Chain verification of drafted tokens: which drafts the target model accepts, and the one token
it adds, so that the output is exactly what decoding without speculation would give (greedy) or
has exactly its distribution (sampled).

Request i drafted k_i tokens d_1..d_k (k_i may be 0; `drafts` is padded to K columns and
`draft_lens` holds each k_i). The target's forward over [last token, d_1..d_k] gives logits at
k_i + 1 positions: position j is the target's distribution of the output token at output index
`batch.steps[i] + j`, had d_1..d_j been accepted. The logits are those the sampler would see
(penalties, grammar masks and min_new_tokens already applied by the caller, each position as if
the drafts before it were accepted). The result: a_i accepted drafts and a_i + 1 tokens, the
drafts followed by one token of the target's, the correction at the first rejection or, when
all k_i are accepted, a bonus token after them.

Greedy rows (temperature 0, or top_k == 1, as in `engine/sampling/sampler.py`) accept d_j while
it equals the argmax of the raw logits at its position, and add the argmax: `logits.float()
.argmax(-1)`, the sampler's own call, so ties go to the lowest index there as here.

Sampled rows use the standard lossless speculative sampling rule (Leviathan et al. 2023; Chen
et al. 2023) on p, the distribution the sampler draws from (temperature, top-k, top-p, min-p:
`processed_probs`, built on the sampler's `sorted_probs`):
- a draft model's drafts (d_j drawn from q_j, given as `draft_probs` [B, K, V]): accept with
  probability min(1, p(d_j) / q_j(d_j)); on rejection draw from max(0, p - q_j) renormalised;
- drafts that are guesses, not draws (n-gram; `draft_probs=None`, a point mass on d_j): accept
  with probability p(d_j); on rejection draw from p with d_j removed, renormalised.
After all k_i are accepted the bonus token is drawn from p at position k_i. Either way each
output token is distributed as sampling from p one token at a time.

Randomness is the sampler's counter hash (splitmix64 keyed by the request's seed and the output
index), on two streams of its own: ACCEPT (one uniform per drafted position) and RESAMPLE (the
exponential race that draws the correction after a rejection); a bonus token (every draft
accepted, or none drafted) is the sampler's own draw at its step, so a row that drafted nothing
gets the very token a step without speculation draws. A seeded row's output therefore
depends on its seed, steps, logits and drafts only: not on the other rows, nor on the padding K,
nor on how many drafts follow a rejection. Neither of the two streams is the sampler's own, so
a draft model that draws d_j with `sample()` at (seed, step + j - 1) stays independent of the
verification's uniforms, as the rule's proof needs; the bonus token's draw, at step + k_i, is
one no draft used. (Sampled output is the non-speculative output's distribution, not its
tokens: acceptances and corrections come from other streams.)

Cost: the drafted positions are judged in a loop over the K columns (K is the draft length, a
handful), each one [B, V] pass like one sampler call (softmax, stable sort, filters); then one
more pass at each row's stopping position for the added token. Peak memory is that of a single
sampler call, not K + 1 of them. An all-greedy batch takes argmaxes only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.sampling.sampler import (
    _GAMMA,
    _UNIFORM_BITS,
    SamplingBatch,
    _mix64,
    _shr,
    sample,
    sorted_probs,
)

# Stream keys mixed into the sampler's (seed, step) row key; digits of pi, so they are nothing
# in particular and differ from the sampler's columns' keys.
ACCEPT_STREAM = 0x243F6A8885A308D3
RESAMPLE_STREAM = 0x13198A2E03707344

PAD_TOKEN = -1  # fills `tokens` past each row's length


@dataclass
class VerifyResult:
    """What the scheduler takes from one verification: per row, accepted drafts and new tokens."""

    accepted: torch.Tensor  # [B] int64, a_i in [0, k_i]
    tokens: torch.Tensor  # [B, K + 1] int64: a_i drafts, then the target's token, then PAD_TOKEN
    lengths: torch.Tensor  # [B] int64, a_i + 1: how many of `tokens` are output


def stream_uniform(seeds: torch.Tensor, steps: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Uniform(0, 1) draws [..., n] float32, open at both ends, depending only on
    (seed, step, stream, column); `seeds` and `steps` broadcast to the leading shape."""
    seeds, steps = torch.broadcast_tensors(seeds.long(), steps.long())
    row = _mix64(_mix64(seeds + _GAMMA) + steps * _GAMMA)  # the sampler's row key
    key = _mix64(row ^ stream)
    cols = torch.arange(1, n + 1, device=seeds.device, dtype=torch.int64) * _GAMMA
    bits = _shr(_mix64(key[..., None] + cols), 64 - _UNIFORM_BITS)
    return (bits.float() + 0.5) * (2.0**-_UNIFORM_BITS)


def greedy_rows(batch: SamplingBatch) -> torch.Tensor:
    """[B] bool: the rows the sampler decides by argmax of the raw logits."""
    return (batch.temperatures == 0) | (batch.top_ks == 1)


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float32: the distribution `sample()` draws row i from, filtered and renormalised
    (the sampler's own `sorted_probs`, put back in vocabulary order). Greedy rows get this too
    (it is not their distribution: they take the argmax)."""
    probs_sorted, order, keep = sorted_probs(logits.float(), batch, batch.temperatures == 0)
    kept = torch.where(keep, probs_sorted, 0.0)
    filtered = torch.zeros_like(probs_sorted).scatter_(-1, order, kept)
    return filtered / filtered.sum(-1, keepdim=True)


def _race(weights: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Draw i with probability weights_i / sum(weights) per row (weights >= 0, not normalised):
    the sampler's exponential race, on the RESAMPLE stream; [B] int64."""
    exp_noise = -torch.log(stream_uniform(seeds, steps, RESAMPLE_STREAM, weights.shape[-1]))
    race = torch.where(weights > 0, weights / exp_noise, -1.0)
    return race.argmax(-1)


def verify_chain(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor,
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Accept or reject each row's chain of drafts against the target's logits.

    logits [B, K + 1, V] (any float dtype): the target at each position, K the padded draft
    length; drafts [B, K] int64 (columns past a row's length are ignored, any value);
    draft_lens [B] int64 in [0, K]; batch: the rows' sampling parameters, `steps` the output
    index of the token at position 0; draft_probs [B, K, V] or None: the draft model's
    distributions q_j the drafts were drawn from, None for guessed drafts (a point mass).
    """
    if logits.dim() != 3 or drafts.dim() != 2:
        raise ValueError(
            f"logits must be [B, K+1, V] and drafts [B, K], got "
            f"{tuple(logits.shape)} and {tuple(drafts.shape)}"
        )
    n_rows, width, vocab = logits.shape
    k_max = width - 1
    if drafts.shape != (n_rows, k_max) or draft_lens.shape != (n_rows,):
        raise ValueError(
            f"drafts must be [{n_rows}, {k_max}] and draft_lens [{n_rows}], got "
            f"{tuple(drafts.shape)} and {tuple(draft_lens.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (n_rows, k_max, vocab):
        raise ValueError(
            f"draft_probs must be [{n_rows}, {k_max}, {vocab}], got {tuple(draft_probs.shape)}"
        )
    device = logits.device
    all_greedy = batch.all_greedy
    greedy = greedy_rows(batch)
    rows = torch.arange(n_rows, device=device)
    draft_lens = draft_lens.long()
    # Padding columns may hold anything, -1 included: make them safe to gather with.
    drafts = drafts.long().clamp(0, vocab - 1)

    # 1. Judge every drafted position; a loop over the K columns, each a sampler-sized pass.
    ok = torch.zeros(n_rows, k_max, dtype=torch.bool, device=device)
    if k_max and not all_greedy:
        accept_u = stream_uniform(
            batch.seeds[:, None],
            batch.steps[:, None] + torch.arange(k_max, device=device),
            ACCEPT_STREAM,
            1,
        ).squeeze(-1)  # [B, K]
    for j in range(k_max):
        position = logits[:, j].float()
        draft = drafts[:, j]
        by_argmax = draft == position.argmax(-1)
        if all_greedy:
            ok[:, j] = by_argmax
            continue
        p_draft = processed_probs(position, batch).gather(-1, draft[:, None]).squeeze(-1)
        if draft_probs is None:
            by_chance = accept_u[:, j] < p_draft
        else:
            q_draft = draft_probs[:, j].float().gather(-1, draft[:, None]).squeeze(-1)
            by_chance = accept_u[:, j] * q_draft < p_draft  # u < min(1, p / q), q may be 0
        ok[:, j] = torch.where(greedy, by_argmax, by_chance)
    ok &= torch.arange(k_max, device=device) < draft_lens[:, None]
    accepted = ok.long().cumprod(-1).sum(-1)  # the leading run of accepted drafts

    # 2. The target's own token at each row's stopping position.
    stop = logits[rows, accepted].float()  # [B, V]
    extra = stop.argmax(-1)
    if not all_greedy:
        p = processed_probs(stop, batch)
        rejected = accepted < draft_lens
        if k_max:
            at = accepted.clamp(max=k_max - 1)
            if draft_probs is None:
                removed = torch.zeros_like(p).scatter_(-1, drafts[rows, at][:, None], 1.0)
                residual = torch.where(removed.bool(), 0.0, p)
            else:
                residual = (p - draft_probs[rows, at].float()).clamp_min(0.0)
            weights = torch.where(rejected[:, None], residual, p)
            # A rejection that float rounding left nothing to draw from keeps p itself.
            weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, p)
        else:
            weights = p
        corrected = _race(weights, batch.seeds, batch.steps + accepted)
        # NOTE: a bonus token (no rejection) is the sampler's own draw at its step, so a row
        # with nothing drafted gets exactly the token a step without speculation would draw
        bonus = sample(stop, dataclasses.replace(batch, steps=batch.steps + accepted))
        extra = torch.where(greedy, extra, torch.where(rejected, corrected, bonus))

    return _result(drafts, accepted, extra)


def verify_greedy(
    argmax: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor
) -> VerifyResult:
    """`verify_chain` of an all-greedy batch from each position's argmax alone ([B, K + 1]
    int64, the target's `logits.float().argmax(-1)`): no [B, K + 1, V] logits are gathered."""
    k_max = argmax.shape[1] - 1
    drafts = drafts.long()
    ok = drafts == argmax[:, :k_max]
    ok &= torch.arange(k_max, device=argmax.device) < draft_lens[:, None]
    accepted = ok.long().cumprod(-1).sum(-1)
    extra = argmax[torch.arange(argmax.shape[0], device=argmax.device), accepted]
    return _result(drafts, accepted, extra)


def _result(drafts: torch.Tensor, accepted: torch.Tensor, extra: torch.Tensor) -> VerifyResult:
    """Each row's accepted drafts, then the target's token, then PAD_TOKEN."""
    n_rows, k_max = drafts.shape
    columns = torch.arange(k_max + 1, device=drafts.device)
    tokens = torch.cat([drafts, drafts.new_zeros(n_rows, 1)], -1)
    tokens = torch.where(columns < accepted[:, None], tokens, PAD_TOKEN)
    tokens[torch.arange(n_rows, device=drafts.device), accepted] = extra
    return VerifyResult(accepted=accepted, tokens=tokens, lengths=accepted + 1)
