"""Seeded, batch-independent token sampling with SGLang's temperature/top-k/top-p/min-p semantics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.transfer import to_device

# splitmix64 constants, as signed int64 (torch has no uint64 arithmetic).
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)
# 23 random bits make (k + 0.5) / 2**23 exact in float32, so u can be neither 0 nor 1.
_UNIFORM_BITS = 23


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one batch, as tensors on the logits' device."""

    temperatures: torch.Tensor  # [B] float32; 0 means greedy for that row
    top_ks: torch.Tensor  # [B] int64; >= vocab size or <= 0 disables
    top_ps: torch.Tensor  # [B] float32 in (0, 1]; 1 disables
    min_ps: torch.Tensor  # [B] float32 in [0, 1]; 0 disables
    seeds: torch.Tensor  # [B] int64, the request's sampling seed
    steps: torch.Tensor  # [B] int64, index of the output token being drawn
    # Known on the host when the batch is built from request parameters; None means "look".
    greedy_hint: bool | None = field(default=None, compare=False)

    @classmethod
    def from_rows(
        cls,
        temperatures: list[float],
        top_ks: list[int],
        top_ps: list[float],
        min_ps: list[float],
        seeds: list[int],
        steps: list[int],
        device: torch.device,
    ) -> SamplingBatch:
        """Two host-to-device copies for the whole batch; greediness is decided on the host."""
        floats = to_device([temperatures, top_ps, min_ps], torch.float32, device)
        ints = to_device([top_ks, seeds, steps], torch.int64, device)
        return cls(
            floats[0], ints[0], floats[1], floats[2], ints[1], ints[2],
            greedy_hint=all(t == 0 for t in temperatures),
        )  # fmt: skip

    @property
    def all_greedy(self) -> bool:
        """True when every row is greedy, so the random path can be skipped."""
        if self.greedy_hint is not None:
            return self.greedy_hint
        return bool((self.temperatures == 0).all())  # a host sync


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64: torch's `>>` is arithmetic, so clear the sign-extended bits."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser; int64 multiply wraps mod 2**64 on CPU and CUDA alike."""
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform(0, 1) draws [B, V] float32, open at both ends, depending only on (seed, step, column)."""
    row = _mix64(_mix64(seeds.long() + _GAMMA) + steps.long() * _GAMMA)
    # Column c is the c-th output of a splitmix64 stream keyed by the row, so no row sees another.
    cols = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GAMMA
    bits = _shr(_mix64(row[:, None] + cols), 64 - _UNIFORM_BITS)
    return (bits.float() + 0.5) * (2.0**-_UNIFORM_BITS)


def _keep_sorted(probs_sorted: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Which descending-sorted tokens survive top-k, top-p and min-p, each judged on the unfiltered probs."""
    vocab = probs_sorted.shape[-1]
    rank = torch.arange(vocab, device=probs_sorted.device)
    top_ks = batch.top_ks[:, None]
    keep = (top_ks <= 0) | (rank < top_ks)
    # Mass strictly before each token; top_p == 1 is exempt because float32 cumsum can pass 1.
    mass_before = probs_sorted.cumsum(-1) - probs_sorted
    top_ps = batch.top_ps[:, None]
    keep &= (mass_before <= top_ps) | (top_ps >= 1)
    return keep & (probs_sorted >= batch.min_ps[:, None] * probs_sorted[:, :1])


def sorted_probs(
    logits: torch.Tensor, batch: SamplingBatch, greedy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's distribution before filtering, sorted: (probs_sorted, order, keep) [B, V],
    `keep` the ranks top-k / top-p / min-p leave. float32 `logits`; `greedy`: the rows of
    temperature 0, which get temperature 1 here (they take the argmax of the raw logits)."""
    temps = torch.where(greedy, torch.ones_like(batch.temperatures), batch.temperatures)
    # NaN logits are never sampled and +inf ones are clamped, so softmax is NaN-free
    # unless a row has no usable logit at all.
    scaled = torch.nan_to_num(
        logits / temps[:, None],
        nan=float("-inf"),
        posinf=torch.finfo(torch.float32).max,
        neginf=float("-inf"),
    )
    probs = torch.softmax(scaled, -1)
    # Stable sort: ties keep index order, so top-k cuts identically on every device.
    probs_sorted, order = probs.sort(dim=-1, descending=True, stable=True)
    return probs_sorted, order, _keep_sorted(probs_sorted, batch)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Draw one token per row of `logits` [B, V]; returns [B] int64."""
    logits = logits.float()
    greedy_tokens = logits.argmax(-1)
    if batch.all_greedy:
        return greedy_tokens

    greedy = batch.temperatures == 0
    probs_sorted, order, keep = sorted_probs(logits, batch, greedy)

    # Exponential race: argmax p_i / E_i picks i with probability p_i / sum(p), so the
    # filtered distribution needs no renormalisation. The noise is keyed by column, not rank.
    # Should invalid parameters filter out everything, argmax of the all -1 row picks rank 0.
    exp_noise = -torch.log(seeded_uniform(batch.seeds, batch.steps, logits.shape[-1]))
    race = torch.where(keep, probs_sorted / exp_noise.gather(-1, order), -1.0)
    drawn = order.gather(-1, race.argmax(-1, keepdim=True)).squeeze(-1)
    # top_k == 1 is greedy on the raw logits, matching the temperature-0 path bit for bit.
    return torch.where(greedy | (batch.top_ks == 1), greedy_tokens, drawn)
