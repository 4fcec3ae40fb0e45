"""The match arithmetic of the n-gram drafter (engine/speculative/ngram.py), vectorised: the
length of each candidate's match from a [candidates, window] comparison, the longest and newest
of a sequence's candidates (or of each sequence's, for a batch searched at once), and a
draft copied on from its source. Pure numpy, no state."""

from __future__ import annotations

import numpy as np


def run_lengths(eq: np.ndarray, width: int, cap: np.ndarray) -> np.ndarray:
    """Per row of `eq` (cell 0 always True): the leading run of Trues, at most `cap`."""
    lengths = eq.argmin(axis=1)  # the first mismatch; 0 where there is none
    lengths[lengths == 0] = width
    return np.minimum(lengths, cap, out=lengths)


class Batch:
    """Sequences searched together: their tokens end to end, and each one's length and end."""

    __slots__ = ("ends", "lens", "tokens")

    def __init__(self, tokens: np.ndarray, lens: np.ndarray) -> None:
        self.tokens, self.lens, self.ends = tokens, lens, np.cumsum(lens)


def ranks(seq: np.ndarray) -> np.ndarray:
    """Each entry's index within its run of equal values (`seq` sorted)."""
    if len(seq) == 0:
        return seq
    firsts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    return np.arange(len(seq)) - np.repeat(firsts, np.diff(np.r_[firsts, len(seq)]))


def longest_newest_each(
    seq: np.ndarray, lengths: np.ndarray, order: np.ndarray
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Per run of equal `seq` (sorted): (the run's value, (the longest length, and the largest
    `order` among the longest)): each sequence's longest match, the newest among equals, at once."""
    scale = int(order.max()) + 1
    firsts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    best = np.maximum.reduceat(lengths * scale + order, firsts)
    return seq[firsts], (best // scale, best % scale)


def copy_forward(toks: np.ndarray, end: int, k: int) -> list[int]:
    """k tokens copied from position `end` on, reading past the end of `toks` into the copy
    itself (an overlapping copy, as LZ77's): (toks + draft)[end + j] for j < k."""
    draft = toks[end : end + k].tolist()
    period = len(toks) - end
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft
