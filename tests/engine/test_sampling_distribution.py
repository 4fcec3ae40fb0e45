"""Statistical and exactness tests of engine.sampling against float64 references built here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from operator import itemgetter

import numpy as np
import pytest
import torch
from scipy import stats

from engine.sampling.sampler import SamplingBatch, sample, seeded_uniform

N_DRAWS = 20_000
P_MIN = 1e-3
# Distinct values in shuffled order, so "most probable" is never simply "lowest index".
LOGITS = [0.2, -0.8, 1.5, 0.0, 2.0, -1.0, 1.0, -0.3, 1.2, 0.5]
VOCAB = len(LOGITS)


# ----------------------------------------------------------------------------- helpers
def make_batch(
    n: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seeds: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
) -> SamplingBatch:
    return SamplingBatch(
        temperatures=torch.full((n,), temperature, dtype=torch.float32),
        top_ks=torch.full((n,), top_k, dtype=torch.int64),
        top_ps=torch.full((n,), top_p, dtype=torch.float32),
        min_ps=torch.full((n,), min_p, dtype=torch.float32),
        seeds=torch.arange(n, dtype=torch.int64) if seeds is None else seeds,
        steps=torch.zeros(n, dtype=torch.int64) if steps is None else steps,
    )


def reference_probs(
    logits: list[float], temperature: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The filtered, renormalised distribution, in float64, from the definitions."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    n_keep = len(p)
    if 0 < top_k < len(p):
        n_keep = min(n_keep, top_k)
    if top_p < 1.0:
        # Smallest prefix whose mass reaches top_p.
        n_keep = min(n_keep, int(np.argmax(np.cumsum(p[order]) >= top_p)) + 1)
    keep = np.zeros(len(p), dtype=bool)
    keep[order[:n_keep]] = True
    keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def draw_counts(batch: SamplingBatch, logits: list[float] = LOGITS) -> np.ndarray:
    n = batch.temperatures.shape[0]
    rows = torch.tensor(logits, dtype=torch.float32).expand(n, -1).contiguous()
    tokens = sample(rows, batch)
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    return np.bincount(tokens.numpy(), minlength=len(logits))


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"filtered-out tokens drawn: {counts}"
    result = stats.chisquare(counts[kept], expected[kept] * counts.sum())
    assert result.pvalue > P_MIN, f"counts {counts} vs expected {expected}: p={result.pvalue:.2e}"


def python_splitmix_uniform(seed: int, step: int, col: int) -> float:
    """The documented hash with Python's unbounded ints, to check torch's int64 emulation."""
    mask = (1 << 64) - 1
    gamma = 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    row = mix(mix(seed + gamma) + step * gamma)
    bits = mix(row + (col + 1) * gamma) >> 41
    return (bits + 0.5) / 2**23


# ----------------------------------------------------------------------------- seeded_uniform
def _grid_uniform(n_seeds: int = 200, vocab: int = 1000) -> torch.Tensor:
    seeds = torch.arange(n_seeds, dtype=torch.int64) * 7919 + 12345
    steps = torch.arange(n_seeds, dtype=torch.int64) % 5
    return seeded_uniform(seeds, steps, vocab)


def test_seeded_uniform_range_and_moments() -> None:
    u = _grid_uniform().double().numpy().ravel()
    assert u.size >= 100_000
    assert (u > 0).all() and (u < 1).all()
    # Standard errors at n=200k: mean 6.5e-4, variance 1.7e-4.
    assert abs(u.mean() - 0.5) < 3e-3
    assert abs(u.var() - 1 / 12) < 1e-3


def test_seeded_uniform_ks() -> None:
    u = _grid_uniform().double().numpy().ravel()
    assert stats.kstest(u, "uniform").pvalue > P_MIN


def test_seeded_uniform_extreme_inputs_stay_open_interval() -> None:
    seeds = torch.tensor([0, -1, 2**63 - 1, -(2**63), 1], dtype=torch.int64)
    steps = torch.tensor([0, 2**62, 5, -3, 2**63 - 1], dtype=torch.int64)
    u = seeded_uniform(seeds, steps, 50_000)
    assert u.dtype == torch.float32 and u.shape == (5, 50_000)
    assert bool((u > 0).all()) and bool((u < 1).all())


def test_seeded_uniform_matches_python_int_reference() -> None:
    seeds = [0, 1, 42, -1, 2**63 - 1, -(2**62) + 17]
    steps = [0, 3, 1, 2**40, 7, 0]
    u = seeded_uniform(torch.tensor(seeds), torch.tensor(steps), 64)
    for row, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        for col in (0, 1, 31, 63):
            assert u[row, col].item() == python_splitmix_uniform(seed % 2**64, step % 2**64, col)


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


def test_seeded_uniform_neighbour_columns_uncorrelated() -> None:
    u = _grid_uniform().double().numpy()
    left, right = u[:, :-1], u[:, 1:]
    # 1/sqrt(n) ~ 2.2e-3; allow about 5 standard errors.
    assert abs(_corr(left, right)) < 0.012
    # Joint 8x8 histogram of neighbouring pairs must be flat, which catches non-linear dependence.
    joint, _, _ = np.histogram2d(left.ravel(), right.ravel(), bins=8, range=[[0, 1], [0, 1]])
    assert stats.chisquare(joint.ravel()).pvalue > P_MIN


def test_seeded_uniform_consecutive_steps_and_seeds_uncorrelated() -> None:
    n, vocab = 200, 1000
    seeds = torch.arange(n, dtype=torch.int64) + 99
    steps = torch.full((n,), 10, dtype=torch.int64)
    base = seeded_uniform(seeds, steps, vocab).double().numpy()
    next_step = seeded_uniform(seeds, steps + 1, vocab).double().numpy()
    next_seed = seeded_uniform(seeds + 1, steps, vocab).double().numpy()
    assert abs(_corr(base, next_step)) < 0.012
    assert abs(_corr(base, next_seed)) < 0.012
    assert stats.kstest((base - next_step).ravel() % 1.0, "uniform").pvalue > P_MIN


def test_seeded_uniform_independent_of_batch() -> None:
    seeds = torch.tensor([5, 123456789, -7, 5, 0, 2**40], dtype=torch.int64)
    steps = torch.tensor([0, 3, 9, 1, 0, 1000], dtype=torch.int64)
    full = seeded_uniform(seeds, steps, 300)
    for i in range(len(seeds)):
        alone = seeded_uniform(seeds[i : i + 1], steps[i : i + 1], 300)
        assert torch.equal(alone[0], full[i])
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    assert torch.equal(seeded_uniform(seeds[perm], steps[perm], 300), full[perm])
    # Same seed, different step (rows 0 and 3) must not share a stream.
    assert not torch.equal(full[0], full[3])


# ----------------------------------------------------------------------------- distributions
DIST_CASES = {
    "temperature_0.5": dict(temperature=0.5),
    "temperature_1.0": dict(temperature=1.0),
    "temperature_2.0": dict(temperature=2.0),
    "top_k_4": dict(temperature=1.0, top_k=4),
    "top_p_0.6_cuts_mid": dict(temperature=1.0, top_p=0.6),
    "top_p_0.85_t2": dict(temperature=2.0, top_p=0.85),
    "min_p_0.2": dict(temperature=1.0, min_p=0.2),
    "combo_top_p_binds": dict(temperature=0.8, top_k=5, top_p=0.6, min_p=0.05),
    "combo_min_p_binds": dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.25),
    "combo_top_k_binds": dict(temperature=2.0, top_k=3, top_p=0.95, min_p=0.1),
    # Joint filtering: top_p judges the unfiltered mass, so 3 tokens survive, not 2.
    "combo_joint_top_k_top_p": dict(temperature=1.0, top_k=3, top_p=0.6),
}


@pytest.mark.parametrize("case", list(DIST_CASES))
@pytest.mark.parametrize("vary", ["seed", "step"])
def test_distribution_chi_square(case: str, vary: str) -> None:
    params = DIST_CASES[case]
    idx = torch.arange(N_DRAWS, dtype=torch.int64)
    if vary == "seed":
        batch = make_batch(N_DRAWS, **params, seeds=idx * 31 + 1000)
    else:
        batch = make_batch(N_DRAWS, **params, seeds=torch.full_like(idx, 2024), steps=idx)
    expected = reference_probs(LOGITS, **params)
    assert_matches(draw_counts(batch), expected)


def test_chi_square_has_power() -> None:
    """The checks above would fail for a sampler that ignored top_p or misread the temperature."""
    top_p = dict(temperature=1.0, top_p=0.6)
    counts = draw_counts(make_batch(N_DRAWS, **top_p))
    assert (reference_probs(LOGITS, **top_p) > 0).sum() == 3
    unfiltered = reference_probs(LOGITS, temperature=1.0)
    assert stats.chisquare(counts, unfiltered * N_DRAWS).pvalue < 1e-12
    # A 10% temperature error is detected.
    counts = draw_counts(make_batch(N_DRAWS, temperature=1.0))
    assert stats.chisquare(counts, reference_probs(LOGITS, 1.1) * N_DRAWS).pvalue < 1e-6


def test_masked_and_extreme_logits_never_drawn() -> None:
    n = N_DRAWS
    logits = [float("-inf")] * VOCAB
    logits[2], logits[5], logits[8] = 1.0, 0.0, -1.0
    assert_matches(
        draw_counts(make_batch(n, temperature=1.5), logits), reference_probs(logits, 1.5)
    )

    # Overflowing logits/temperature, NaN and -inf: only the dominant token (index 3) may come out.
    huge = [1e30, -1e30, float("nan"), 3e38, float("-inf"), 0.0, -3e38, 1e-30, 5.0, 2.0]
    for params in (dict(temperature=1e-6), dict(temperature=1e3, top_k=2), dict(temperature=1.0)):
        counts = draw_counts(make_batch(1000, **params), huge)
        assert counts[3] == 1000, params
    # Logits near the float32 limit, brought back into range by a huge temperature.
    close = [3e38, 2.9e38, -3e38] + [float("-inf")] * 7
    counts = draw_counts(make_batch(n, temperature=1e37, top_k=2), close)
    assert_matches(counts, reference_probs(close, 1e37, top_k=2))


def test_tightest_filters_keep_only_most_probable() -> None:
    n = 2000
    counts = draw_counts(make_batch(n, temperature=1.0, top_k=0, top_p=1.0, min_p=1.0))
    assert counts[int(np.argmax(LOGITS))] == n
    counts = draw_counts(make_batch(n, temperature=1.0, top_k=10_000, top_p=1e-9))
    assert counts[int(np.argmax(LOGITS))] == n
    # Invalid values that would filter out everything still yield the most probable token.
    counts = draw_counts(make_batch(n, temperature=1.0, top_p=0.0, min_p=1.5))
    assert counts[int(np.argmax(LOGITS))] == n


def test_top_k_ties_keep_lowest_indices() -> None:
    logits = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, -1.0]
    counts = draw_counts(make_batch(N_DRAWS, temperature=1.0, top_k=3), logits)
    assert_matches(counts, reference_probs(logits, 1.0, top_k=3))
    assert counts[[1, 3, 4]].min() > 0


# ----------------------------------------------------------------------------- exact behaviour
def _random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3


def test_greedy_rows_take_argmax_lowest_index_on_ties() -> None:
    logits = _random_logits(32, 200, seed=1)
    logits[0, [7, 50, 150]] = 100.0  # ties: lowest index wins
    logits[1, :] = 0.0
    tokens = sample(logits, make_batch(32, temperature=0.0))
    assert tokens.tolist() == np.argmax(logits.double().numpy(), axis=1).tolist()
    assert tokens[0].item() == 7 and tokens[1].item() == 0


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0, 100.0])
def test_top_k_one_is_argmax(temperature: float) -> None:
    logits = _random_logits(64, 500, seed=2)
    # Both overflow to +inf once divided by 0.1, yet the raw argmax is column 3.
    logits[0, 1], logits[0, 3] = 1e38, 3e38
    batch = make_batch(64, temperature=temperature, top_k=1, top_p=0.9, min_p=0.0)
    tokens = sample(logits, batch)
    assert tokens.tolist() == np.argmax(logits.double().numpy(), axis=1).tolist()


def _varied_batch(n: int, seed: int) -> SamplingBatch:
    gen = torch.Generator().manual_seed(seed)
    temps = torch.rand(n, generator=gen) * 2
    temps[::4] = 0.0
    return SamplingBatch(
        temperatures=temps,
        top_ks=torch.randint(-1, 40, (n,), generator=gen),
        top_ps=torch.rand(n, generator=gen) * 0.9 + 0.1,
        min_ps=torch.rand(n, generator=gen) * 0.2,
        seeds=torch.randint(0, 2**62, (n,), generator=gen),
        steps=torch.randint(0, 1000, (n,), generator=gen),
    )


def _map(batch: SamplingBatch, fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingBatch:
    tensors = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(
        batch, **{k: fn(v) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    )


def test_draw_is_exponential_race_on_column_noise() -> None:
    """token = argmax over kept i of p_i / -log(u_i), u from the documented hash of (seed, step, i)."""
    n, vocab = 48, 40
    logits = _random_logits(n, vocab, seed=7)
    batch = _varied_batch(n, seed=7)
    tokens = sample(logits, batch).tolist()
    for row in range(n):
        seed, step = batch.seeds[row].item(), batch.steps[row].item()
        temperature = batch.temperatures[row].item()
        if temperature == 0:
            continue
        params = dict(
            top_k=batch.top_ks[row].item(),
            top_p=batch.top_ps[row].item(),
            min_p=batch.min_ps[row].item(),
        )
        p = reference_probs(logits[row].tolist(), temperature, **params)
        noise = -np.log([python_splitmix_uniform(seed, step, col) for col in range(vocab)])
        assert tokens[row] == int(np.argmax(p / noise)), row


def test_mixed_batch_greedy_and_random_rows() -> None:
    n, vocab = 64, 300
    logits = _random_logits(n, vocab, seed=3) * 0.3
    batch = _varied_batch(n, seed=3)
    batch.top_ks.fill_(-1)
    batch.top_ps.fill_(1.0)
    batch.min_ps.fill_(0.0)
    tokens = sample(logits, batch)
    greedy = batch.temperatures == 0
    argmax = torch.from_numpy(np.argmax(logits.double().numpy(), axis=1))
    assert torch.equal(tokens[greedy], argmax[greedy])
    # Flat-ish logits and no filtering: random rows almost never hit the argmax.
    assert (tokens[~greedy] != argmax[~greedy]).sum() > (~greedy).sum() // 2
    assert not batch.all_greedy
    assert make_batch(4, temperature=0.0).all_greedy


def test_row_independent_of_batch_composition() -> None:
    n, vocab = 64, 300
    logits = _random_logits(n, vocab, seed=4)
    batch = _varied_batch(n, seed=4)
    together = sample(logits, batch)
    for i in range(n):
        idx = torch.tensor([i])
        assert sample(logits[idx], _map(batch, itemgetter(idx))).item() == together[i].item(), i
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5))
    assert torch.equal(sample(logits[perm], _map(batch, itemgetter(perm))), together[perm])


def test_seed_and_step_determine_token() -> None:
    steps = 50
    logits = torch.zeros(steps, 1000)  # uniform: every token equally likely
    sequences = []
    for seed in (1, 2, 3):
        batch = make_batch(
            steps,
            seeds=torch.full((steps,), seed, dtype=torch.int64),
            steps=torch.arange(steps, dtype=torch.int64),
        )
        first = sample(logits, batch)
        assert torch.equal(sample(logits, batch), first)
        assert len(set(first.tolist())) > 1
        sequences.append(first.tolist())
    assert sequences[0] != sequences[1] and sequences[1] != sequences[2]
    assert sequences[0] != sequences[2]


# ----------------------------------------------------------------------------- CUDA parity
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_and_cuda_agree() -> None:
    n, vocab = 256, 5000
    batch = _varied_batch(n, seed=6)
    logits = _random_logits(n, vocab, seed=6)
    cuda_batch = _map(batch, lambda t: t.cuda())
    assert torch.equal(
        seeded_uniform(batch.seeds, batch.steps, vocab),
        seeded_uniform(cuda_batch.seeds, cuda_batch.steps, vocab).cpu(),
    )
    assert torch.equal(sample(logits, batch), sample(logits.cuda(), cuda_batch).cpu())
