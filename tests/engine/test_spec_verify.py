"""engine/speculative/verify.py: greedy verification against a float64 reference loop, the
output distribution of sampled verification against the target's (chi-square, with negative
controls that must fail), and seeded reproducibility whatever else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine.sampling.sampler import SamplingBatch, sample, seeded_uniform
from engine.speculative.verify import (
    ACCEPT_STREAM,
    PAD_TOKEN,
    RESAMPLE_STREAM,
    VerifyResult,
    processed_probs,
    stream_uniform,
    verify_chain,
)

P_MIN = 1e-4
N_ROWS = 20_000
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


def make_batch(
    n: int,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seeds: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
    device: str = "cpu",
) -> SamplingBatch:
    def column(value, dtype):
        if isinstance(value, list):
            return torch.tensor(value, dtype=dtype, device=device)
        return torch.full((n,), value, dtype=dtype, device=device)

    return SamplingBatch(
        temperatures=column(temperature, torch.float32),
        top_ks=column(top_k, torch.int64),
        top_ps=column(top_p, torch.float32),
        min_ps=column(min_p, torch.float32),
        seeds=(torch.arange(n) if seeds is None else seeds).to(device),
        steps=(torch.zeros(n, dtype=torch.int64) if steps is None else steps).to(device),
    )


def reference_probs(logits: np.ndarray, temperature: float, top_k=-1, top_p=1.0, min_p=0.0):
    """The sampler's filtered distribution in float64, from its definitions, over the last axis."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(p)
    for idx in np.ndindex(p.shape[:-1]):
        row = p[idx]
        order = np.argsort(-row, kind="stable")
        ranked = row[order]
        keep = np.ones(len(row), dtype=bool)
        if top_k > 0:
            keep &= np.arange(len(row)) < top_k
        keep &= (np.cumsum(ranked) - ranked <= top_p) | (top_p >= 1)
        keep &= ranked >= min_p * ranked[0]
        out[idx][order[keep]] = ranked[keep]
        out[idx] /= out[idx].sum()
    return out


# ----------------------------------------------------------------------------- greedy
def reference_greedy(logits: np.ndarray, drafts: np.ndarray, lens: np.ndarray) -> list[list[int]]:
    """The loop a non-speculative greedy decoder implies: np.argmax, first index on ties."""
    out = []
    for row, draft, k in zip(logits.astype(np.float64), drafts, lens):
        tokens = []
        for j in range(k + 1):
            best = int(np.argmax(row[j]))
            tokens.append(best)
            if j == k or draft[j] != best:
                break
        out.append(tokens)
    return out


def random_chain_inputs(n: int, k_max: int, vocab: int, gen: torch.Generator, ties: bool = False):
    if ties:  # few distinct values, so most rows have several maxima
        logits = torch.randint(0, 3, (n, k_max + 1, vocab), generator=gen).float()
    else:
        logits = torch.randn(n, k_max + 1, vocab, generator=gen) * 2
    lens = torch.randint(0, k_max + 1, (n,), generator=gen)
    # Drafts that are mostly right, so long accepted runs occur, with padding set to -1.
    drafts = logits[:, :k_max].argmax(-1)
    wrong = torch.rand(n, k_max, generator=gen) < 0.25
    drafts = torch.where(wrong, torch.randint(0, vocab, (n, k_max), generator=gen), drafts)
    drafts = torch.where(torch.arange(k_max) < lens[:, None], drafts, -1)
    return logits, drafts, lens


def as_lists(result: VerifyResult) -> list[list[int]]:
    tokens, lengths = result.tokens.cpu().tolist(), result.lengths.cpu().tolist()
    return [row[:n] for row, n in zip(tokens, lengths)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ties", [False, True])
def test_greedy_matches_reference_loop(device: str, ties: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    n, k_max, vocab = 400, 5, 11
    logits, drafts, lens = random_chain_inputs(n, k_max, vocab, gen, ties)
    # top_k == 1 with a temperature is greedy in the sampler, and so here.
    top_ks = [1 if i % 3 == 0 else -1 for i in range(n)]
    temps = [0.0 if i % 3 else 0.7 for i in range(n)]
    batch = make_batch(n, temps, top_ks, device=device)
    result = verify_chain(logits.to(device), drafts.to(device), lens.to(device), batch)

    expected = reference_greedy(logits.numpy(), drafts.numpy(), lens.numpy())
    assert as_lists(result) == expected
    assert (result.accepted.cpu() <= lens).all() and (lens == 0).any()
    assert result.tokens.shape == (n, k_max + 1) and result.tokens.dtype == torch.int64
    past = torch.arange(k_max + 1) >= result.lengths.cpu()[:, None]
    assert (result.tokens.cpu()[past] == PAD_TOKEN).all()
    # The added token is what the sampler itself draws from the stopping position's logits.
    stop = logits[torch.arange(n), result.accepted.cpu()].to(device)
    assert torch.equal(result.tokens[torch.arange(n), result.accepted], sample(stop, batch))


def test_greedy_rows_ignore_sampled_neighbours_and_draft_probs() -> None:
    gen = torch.Generator().manual_seed(2)
    n, k_max, vocab = 300, 4, 9
    logits, drafts, lens = random_chain_inputs(n, k_max, vocab, gen, ties=True)
    greedy_alone = verify_chain(logits, drafts, lens, make_batch(n, 0.0))
    temps = [0.0 if i % 2 else 1.3 for i in range(n)]
    q = torch.softmax(torch.randn(n, k_max, vocab, generator=gen), -1)
    mixed = verify_chain(logits, drafts, lens, make_batch(n, temps, top_p=0.8), q)
    odd = slice(1, None, 2)
    assert torch.equal(mixed.tokens[odd], greedy_alone.tokens[odd])
    assert torch.equal(mixed.accepted[odd], greedy_alone.accepted[odd])


def test_no_drafts_at_all() -> None:
    logits = torch.randn(5, 1, 7, generator=torch.Generator().manual_seed(3))
    empty = torch.zeros(5, 0, dtype=torch.int64)
    lens = torch.zeros(5, dtype=torch.int64)
    for batch in (make_batch(5, 0.0), make_batch(5, 1.0)):
        result = verify_chain(logits, empty, lens, batch)
        assert result.tokens.shape == (5, 1) and (result.accepted == 0).all()
        assert (result.lengths == 1).all() and (result.tokens >= 0).all()


def test_a_row_that_drafted_nothing_draws_what_the_sampler_draws() -> None:
    """Beside rows with drafts, a row with none gets the sampler's own token at its step, so a
    request that never drafts is reproducible with speculation on or off."""
    n, k_max, vocab = 400, 3, 11
    gen = torch.Generator().manual_seed(8)
    logits = 3 * torch.randn(n, k_max + 1, vocab, generator=gen)  # peaked: drafts often pass
    drafts = logits[:, :k_max].argmax(-1)
    lens = torch.tensor([0 if i % 2 else k_max for i in range(n)])
    steps = torch.randint(50, (n,), generator=gen)
    batch = make_batch(n, 0.9, top_p=0.9, steps=steps)
    result = verify_chain(logits, drafts, lens, batch)
    alone = sample(logits[:, 0], batch)
    odd = slice(1, None, 2)
    assert torch.equal(result.tokens[odd, 0], alone[odd])
    assert (result.lengths[odd] == 1).all()
    # and rows whose drafts were all accepted got their bonus at step + k from the sampler too
    full = result.accepted == lens
    full[odd] = False
    bonus = sample(logits[:, k_max], make_batch(n, 0.9, top_p=0.9, steps=steps + k_max))
    assert full.sum() > 0
    assert torch.equal(result.tokens[full, k_max], bonus[full])


def test_shapes_are_checked() -> None:
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="drafts must be"):
        verify_chain(logits, torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2), make_batch(2))
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_chain(
            logits,
            torch.zeros(2, 2, dtype=torch.int64),
            torch.zeros(2),
            make_batch(2),
            torch.zeros(2, 2, 4),
        )


# ----------------------------------------------------------------------------- distribution
# A Markov chain stands in for the target model: its logits for the next token depend on the
# previous token only, so the joint law of two output tokens is known exactly.
VOCAB = 7
TARGET = np.array(
    [
        [1.0, 0.2, 2.0, -0.5, 0.8, 0.0, 1.4],
        [0.3, 1.5, -0.2, 1.1, 0.0, 0.9, -1.0],
        [2.2, 0.0, 0.5, 1.0, -0.4, 1.3, 0.1],
        [0.0, 0.7, 1.2, 0.4, 1.9, -0.6, 0.8],
        [1.1, -0.3, 0.6, 2.1, 0.2, 0.9, 0.0],
        [0.4, 1.6, 0.0, -0.2, 1.0, 0.5, 1.2],
        [1.3, 0.1, 0.9, 0.6, -0.5, 1.8, 0.3],
    ]
)
GUESS = np.array([2, 3, 0, 4, 3, 1, 5])  # an n-gram guess of the next token after each token
DRAFT_Q = np.array(  # a draft model: near the target in places, far in others
    [[0.1, 0.05, 0.4, 0.05, 0.1, 0.1, 0.2]] * 2
    + [[0.5, 0.05, 0.05, 0.2, 0.05, 0.1, 0.05]] * 2
    + [[0.05, 0.05, 0.1, 0.5, 0.1, 0.1, 0.1]] * 3
)
START = 4  # the last token before the output
K = 2
PROCESSING = {
    "plain": dict(temperature=1.0),
    "filtered": dict(temperature=0.8, top_k=5, top_p=0.85, min_p=0.1),
}


def draft_chain(prev: torch.Tensor, mode: str, gen: torch.Generator):
    """K drafts after `prev` and, for a draft model, the q they were drawn from."""
    drafts, qs = [], []
    for _ in range(K):
        if mode == "ngram":
            prev = torch.as_tensor(GUESS)[prev]
        else:
            q = torch.as_tensor(DRAFT_Q, dtype=torch.float32)[prev]
            prev = torch.multinomial(q, 1, generator=gen).squeeze(-1)
            qs.append(q)
        drafts.append(prev)
    return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)


def verify_round(prev, seeds, step, mode, params, gen, rule):
    n = prev.shape[0]
    drafts, q = draft_chain(prev, mode, gen)
    lens = torch.randint(0, K + 1, (n,), generator=gen)  # ragged, 0 included
    context = torch.cat([prev[:, None], drafts], 1)
    logits = torch.as_tensor(TARGET, dtype=torch.float32)[context]  # [n, K + 1, V]
    batch = make_batch(n, seeds=seeds, steps=torch.full((n,), step), **params)
    return rule(logits, drafts, lens, batch, q)


def first_two_tokens(mode: str, params: dict, rule=verify_chain, seed_base: int = 0):
    """Each row's first two output tokens; a row that stopped after one token verifies again."""
    gen = torch.Generator().manual_seed(seed_base + 7)
    seeds = torch.arange(N_ROWS, dtype=torch.int64) + seed_base
    first = verify_round(torch.full((N_ROWS,), START), seeds, 0, mode, params, gen, rule)
    x1 = first.tokens[:, 0]
    again = verify_round(x1, seeds, 1, mode, params, gen, rule)
    x2 = torch.where(first.lengths >= 2, first.tokens[:, 1], again.tokens[:, 0])
    return x1.numpy(), x2.numpy()


def chi_square_pvalues(x1: np.ndarray, x2: np.ndarray, params: dict) -> tuple[float, float]:
    """p-values of the first token's counts and of the first two tokens' joint counts."""
    probs = reference_probs(TARGET, **params)  # row t: the next token's law after token t
    marginal = probs[START]
    joint = marginal[:, None] * probs
    pvalues = []
    for counts, expected in (
        (np.bincount(x1, minlength=VOCAB), marginal),
        (np.bincount(x1 * VOCAB + x2, minlength=VOCAB * VOCAB), joint.ravel()),
    ):
        kept = expected > 0
        if counts[~kept].any():  # a token the target never gives
            pvalues.append(0.0)
            continue
        assert (expected[kept] * len(x1)).min() >= 5, "too few expected counts per cell"
        pvalues.append(stats.chisquare(counts[kept], expected[kept] * len(x1)).pvalue)
    return pvalues[0], pvalues[1]


@pytest.mark.parametrize("processing", sorted(PROCESSING))
@pytest.mark.parametrize("mode", ["ngram", "draft_model"])
def test_output_distribution_is_the_targets(mode: str, processing: str) -> None:
    params = PROCESSING[processing]
    x1, x2 = first_two_tokens(mode, params)
    p_first, p_joint = chi_square_pvalues(x1, x2, params)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


def always_accept(logits, drafts, lens, batch, q):
    """Wrong: every draft is kept, and the bonus is drawn from the target after them."""
    rows = torch.arange(len(lens))
    bonus = torch.multinomial(processed_probs(logits[rows, lens], batch), 1).squeeze(-1)
    tokens = torch.cat([drafts, bonus[:, None]], 1)
    tokens[rows, lens] = bonus
    return VerifyResult(accepted=lens, tokens=tokens, lengths=lens + 1)


def uniform_q(logits, drafts, lens, batch, q):
    """Wrong: drafts drawn from a draft model, judged as if q were uniform."""
    return verify_chain(logits, drafts, lens, batch, torch.full_like(q, 1.0 / VOCAB))


@pytest.mark.parametrize(
    "mode, rule",
    [("ngram", always_accept), ("draft_model", always_accept), ("draft_model", uniform_q)],
)
def test_the_chi_square_check_catches_a_wrong_rule(mode: str, rule) -> None:
    torch.manual_seed(0)  # always_accept's bonus draw
    params = PROCESSING["filtered"]
    p_first, p_joint = chi_square_pvalues(*first_two_tokens(mode, params, rule), params)
    assert min(p_first, p_joint) < P_MIN, (p_first, p_joint)


def test_point_mass_is_a_one_hot_draft_distribution() -> None:
    """q=None decides exactly as the draft probabilities one_hot(d) would."""
    gen = torch.Generator().manual_seed(4)
    n, k_max, vocab = 2000, 3, 8
    logits = torch.randn(n, k_max + 1, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (n, k_max), generator=gen)
    lens = torch.randint(0, k_max + 1, (n,), generator=gen)
    batch = make_batch(n, 0.9, top_k=6)
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    point = verify_chain(logits, drafts, lens, batch)
    given = verify_chain(logits, drafts, lens, batch, one_hot)
    assert torch.equal(point.tokens, given.tokens)
    assert 0 < point.accepted.float().mean() < lens.float().mean()  # some of each


def test_processed_probs_are_the_samplers_distribution() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 10, generator=gen) * 2
    for params in PROCESSING.values():
        got = processed_probs(logits, make_batch(64, **params))
        want = reference_probs(logits.numpy(), **params)
        np.testing.assert_allclose(got.double().numpy(), want, atol=1e-6)
        # and the sampler never leaves that support
        drawn = sample(logits, make_batch(64, **params, seeds=torch.arange(64) + 99))
        assert (got[torch.arange(64), drawn] > 0).all()


# ----------------------------------------------------------------------------- reproducibility
def mixed_inputs(n: int, k_max: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k_max + 1, vocab, generator=gen)
    drafts = logits[:, :k_max].argmax(-1)  # often accepted, so later positions matter
    wrong = torch.rand(n, k_max, generator=gen) < 0.3
    drafts = torch.where(wrong, torch.randint(0, vocab, (n, k_max), generator=gen), drafts)
    lens = torch.randint(0, k_max + 1, (n,), generator=gen)
    q = torch.softmax(torch.randn(n, k_max, vocab, generator=gen), -1)
    temps = (torch.rand(n, generator=gen) * 1.5).tolist()
    temps[::7] = [0.0] * len(temps[::7])
    batch = make_batch(
        n,
        temps,
        [-1, 5, 1, 20][seed % 4],
        top_p=0.9,
        min_p=0.02,
        seeds=torch.randint(0, 2**62, (n,), generator=gen),
        steps=torch.randint(0, 500, (n,), generator=gen),
    )
    return logits, drafts, lens, q, batch


FIELDS = ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "steps")


def take(batch: SamplingBatch, index: torch.Tensor) -> SamplingBatch:
    return SamplingBatch(*(getattr(batch, f)[index] for f in FIELDS))


def cat(a: SamplingBatch, b: SamplingBatch) -> SamplingBatch:
    return SamplingBatch(*(torch.cat([getattr(a, f), getattr(b, f)]) for f in FIELDS))


def moved(batch: SamplingBatch, device: str) -> SamplingBatch:
    return SamplingBatch(*(getattr(batch, f).to(device) for f in FIELDS))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_q", [False, True])
def test_seeded_rows_reproduce_whatever_the_batch(device: str, with_q: bool) -> None:
    n, k_max, vocab = 500, 4, 12
    logits, drafts, lens, q, batch = mixed_inputs(n, k_max, vocab, seed=6)
    q = q if with_q else None

    def run(logits, drafts, lens, batch, q):
        q = None if q is None else q.to(device)
        result = verify_chain(
            logits.to(device), drafts.to(device), lens.to(device), moved(batch, device), q
        )
        return result.tokens.cpu(), result.accepted.cpu()

    tokens, accepted = run(logits, drafts, lens, batch, q)
    assert 0 < accepted.float().mean() < lens.float().mean()

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(8))
    p_tokens, _ = run(
        logits[perm], drafts[perm], lens[perm], take(batch, perm), None if q is None else q[perm]
    )
    assert torch.equal(p_tokens, tokens[perm])

    # More rows beside them, and every row padded to a longer draft with garbage past its length.
    o_logits, o_drafts, o_lens, o_q, o_batch = mixed_inputs(300, k_max + 2, vocab, seed=9)
    wide_logits = torch.cat([torch.cat([logits, torch.randn(n, 2, vocab)], 1), o_logits])
    wide_drafts = torch.cat([torch.cat([drafts, torch.randint(0, vocab, (n, 2))], 1), o_drafts])
    wide_q = (
        None
        if q is None
        else torch.cat([torch.cat([q, torch.softmax(torch.randn(n, 2, vocab), -1)], 1), o_q])
    )
    w_tokens, _ = run(
        wide_logits, wide_drafts, torch.cat([lens, o_lens]), cat(batch, o_batch), wide_q
    )
    assert torch.equal(w_tokens[:n, : k_max + 1], tokens)
    assert (w_tokens[:n, k_max + 1 :] == PAD_TOKEN).all()


def test_a_shorter_draft_gives_the_same_tokens_up_to_its_rejection() -> None:
    """The uniforms are keyed by output index, not by the draft: a row rejected at position j
    gives the same tokens with any draft longer than j."""
    n, k_max, vocab = 2000, 4, 10
    logits, drafts, lens, q, batch = mixed_inputs(n, k_max, vocab, seed=10)
    full = torch.full((n,), k_max)
    long = verify_chain(logits, drafts, full, batch, q)
    cut = verify_chain(logits, drafts, full - 1, batch, q)
    early = long.accepted < k_max - 1
    assert early.sum() > n // 4
    assert torch.equal(cut.tokens[early], long.tokens[early])


def test_streams_are_distinct_from_each_other_and_from_the_samplers() -> None:
    seeds, steps = torch.arange(50), torch.arange(50) * 3
    sampler_u = seeded_uniform(seeds, steps, 16)
    accept_u = stream_uniform(seeds, steps, ACCEPT_STREAM, 16)
    resample_u = stream_uniform(seeds, steps, RESAMPLE_STREAM, 16)
    for a, b in ((sampler_u, accept_u), (sampler_u, resample_u), (accept_u, resample_u)):
        assert (a == b).float().mean() < 0.01
    assert ((accept_u > 0) & (accept_u < 1)).all()
    # broadcast shapes: one uniform per (row, position)
    grid = stream_uniform(seeds[:, None], steps[:, None] + torch.arange(4), ACCEPT_STREAM, 1)
    assert grid.shape == (50, 4, 1)
    assert torch.equal(grid[:, 2, 0], stream_uniform(seeds, steps + 2, ACCEPT_STREAM, 1)[:, 0])
