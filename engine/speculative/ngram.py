"""The n-gram drafter of `speculative_algorithm="NGRAM"`: guesses of a request's next tokens, read
off earlier token sequences that ended the way the request's tokens end now. Host-side numpy,
no device: the scheduler asks it for drafts at every decode step, the target model verifies
them (`engine/speculative/verify.py`, drafts given as guesses, `draft_probs=None`).

Two sources, for the batch work gristmill serves (thousands of rows of one job, outputs that
copy spans of their own row and resemble the other rows' outputs):

1. **The request's own tokens** (prompt + output so far). The match is the longest suffix of the
   tokens, n tokens with `min_window <= n <= max_window`, that also occurred earlier in them (an
   occurrence ending before the last token); the draft is what followed its most recent earlier
   occurrence. When that continuation runs into the suffix itself (a repeating stretch: a list,
   a run of one token), it goes on with the draft's own tokens, as a copy of an overlapping span
   does: draft[j] = (tokens + draft)[e + j], e the position after the earlier occurrence.
2. **A corpus of this engine's finished outputs**: each finished request's output with the last
   `max_window` tokens of its prompt in front (so that the suffix that ends a prompt finds the
   outputs that followed alike prompts), bounded by `capacity` tokens in all, oldest evicted
   first. Its match is the longest suffix (same windows) that occurred in a stored entry at a
   position followed by an output token, among the `CORPUS_CANDIDATES` (64) most recent
   occurrences of the suffix's last `min_window` tokens; the draft is what followed the most
   recent of the longest (newest entry, then latest position in it), up to the entry's end.

Rule between them: the longer match wins; on a tie the request's own (the row's text is what
an extraction output copies). Either way one source gives the whole draft, a chain of at most
`min(num_draft_tokens, max_tokens)` tokens, possibly empty (no suffix of `min_window` tokens
occurred before).

Cost. The own source keeps no state: `draft` gets the request's whole token sequence (the
scheduler's array, no copy) and searches it, so no request is ever started, extended or freed
here, and a prompt costs nothing until it drafts. The search is numpy: the positions where the
last token occurred before (one O(length) compare, ~1 ns a token), then every candidate's match
length at once, a [candidates, max_window] gather-compare. A frequent last token (a run of one
token) has thousands of candidates; then the newest `OWN_NEWEST_FIRST` go first, and a match of
full width among them ends the search (an older one could only tie, and ties go to the newest).
The scheduler searches its whole batch in one call (`draft_many`: the sequences end to end):
about 3 ms for 256 sequences of 1,200 tokens on a 2-core CPU. (The per-request index this
replaced cost ~115 ms and 5.7 MB to build for a 3,000-token prompt: seconds per batch job
before any token was drafted.)

The corpus keeps an index, written once per output: `min_window`-gram -> the global positions
that followed its occurrences, ascending, at most `CORPUS_CANDIDATES` (older ones dropped, so a
draft reads a bounded list). One index write per token, not per window length: ~0.6 us a
token, eviction included (~130 us for a 200-token output). The longer matches are found at
draft time by comparing backwards from those candidates, a [candidates, max_window]
gather-compare. The tokens live in a ring of global positions (slot =
position % ring size, grown by doubling up to `capacity`), with each position's entry start
beside it (a match stops at its entry's start, a draft at its end). Evicting an entry drops its
positions from the index (they lead every list they are in: the entry is the oldest). Memory:
16 bytes a ring slot (at most `capacity`) and a list slot and int per stored position, with a
key per distinct n-gram: ~60-250 bytes a stored token in all (measured: 104 with single-token
keys, 251 with 3-token keys, at a 32k vocabulary), freed on eviction; the old index of one
tuple key per window length took ~2 KB a token.

SGLang's arguments: `speculative_ngram_min_match_window_size` and `..._max_match_window_size`
are the windows; `speculative_ngram_capacity` bounds the corpus (here counted in stored tokens,
SGLang counts its trie's nodes); `speculative_num_draft_tokens` counts, in SGLang, the verified
row's last token as well, so the drafter's `num_draft_tokens` is that value minus one (see
`drafts_from_sglang`). The BFS breadths, `match_type` and `branch_length` shape SGLang's draft
*tree*; a chain has one branch, so they do not apply here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from engine.speculative.ngram_match import (
    Batch,
    copy_forward,
    longest_newest_each,
    ranks,
    run_lengths,
)

# The corpus's index keeps, per `min_window`-gram, the positions after its most recent
# occurrences only: a draft compares that many candidates at most, whatever the corpus holds.
CORPUS_CANDIDATES = 64
# Past this many earlier occurrences of the last token, the own search tries the newest first.
OWN_NEWEST_FIRST = 256
# ...and a batch's corpus search this many of each suffix's candidates (draft_many).
CORPUS_NEWEST_FIRST = 8


def drafts_from_sglang(speculative_num_draft_tokens: int) -> int:
    """The drafter's `num_draft_tokens` for SGLang's `speculative_num_draft_tokens`, which
    counts the last verified token as the draft tree's root."""
    return max(speculative_num_draft_tokens - 1, 0)


@dataclass(slots=True)
class DraftCost:
    """Work done so far, in elements: what the tests bound (cheap counters, always on)."""

    scanned: int = 0  # request tokens compared with their sequence's last token
    compared: int = 0  # candidate x window cells compared, own and corpus
    corpus_candidates: int = 0  # corpus positions read at draft time
    indexed: int = 0  # corpus positions written to the index
    evicted_keys: int = 0  # index keys visited when evicting entries


class NgramDrafter:
    """Drafts by suffix match against each request's own tokens and a corpus of finished
    outputs; one per engine (per model). Not thread-safe: the scheduler loop owns it."""

    def __init__(self, min_window: int, max_window: int, num_draft_tokens: int, capacity: int):
        if not 1 <= min_window <= max_window:
            raise ValueError(
                f"the n-gram match windows need 1 <= min_window <= max_window, got "
                f"min_window={min_window}, max_window={max_window}"
            )
        if num_draft_tokens < 0 or capacity < 0:
            raise ValueError(
                f"num_draft_tokens and capacity must be >= 0, got {num_draft_tokens}, {capacity}"
            )
        self.min_window = min_window
        self.max_window = max_window
        self.num_draft_tokens = num_draft_tokens
        self.capacity = capacity
        self.cost = DraftCost()
        self._offsets = np.arange(max_window, dtype=np.int64)
        # the corpus: global position g (counted over all outputs ever added) is ring slot
        # g % len(ring); the live positions are [next - corpus_tokens, next)
        self._ring = np.zeros(0, dtype=np.int64)  # tokens
        self._ring_start = np.zeros(0, dtype=np.int64)  # the position where g's entry starts
        self._entries: deque[tuple[int, int, int]] = deque()  # (start, first indexed, stop)
        self._stops: dict[int, int] = {}  # entry start -> stop
        self._index: dict[int | tuple[int, ...], list[int]] = {}
        self._next = 0
        self._corpus_tokens = 0

    # -- drafts --------------------------------------------------------------------------------

    def draft(self, tokens: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to `min(num_draft_tokens, max_tokens)` guessed tokens to follow `tokens`, a
        request's whole sequence (prompt + output so far; int64, a view will do, not written):
        `draft_many` of one sequence."""
        k = self.num_draft_tokens if max_tokens is None else max_tokens
        return self.draft_many([np.asarray(tokens, dtype=np.int64)], [k])[0][0]

    def follow(self, tokens: np.ndarray, source: int, max_tokens: int | None = None) -> list[int]:
        """The draft copied from `source` on (a position of `tokens`, as `draft_many` gives),
        without a search: for a request whose last draft was all accepted and whose
        source went on as its output did (the scheduler's shortcut, engine/scheduler/
        speculation.py). Up to `min(num_draft_tokens, max_tokens)` tokens."""
        k = self.num_draft_tokens if max_tokens is None else min(self.num_draft_tokens, max_tokens)
        return copy_forward(tokens, source, k) if k > 0 else []

    def draft_many(
        self, seqs: Sequence[np.ndarray], max_tokens: Sequence[int]
    ) -> list[tuple[list[int], int]]:
        """For each sequence (a request's whole tokens, int64 arrays), up to `min(num_draft_tokens,
        max_tokens[i])` guessed tokens to follow it, and where a draft from its own tokens was
        copied from (the position after its match: the draft is `follow(seqs[i], source, k)`;
        -1 for a draft from the corpus, or none). Searched as one batch: a few numpy calls over
        all the sequences' tokens at once, instead of a dozen small ones per sequence (~50 us
        each at batch 256)."""
        if len(max_tokens) != len(seqs):
            raise ValueError(f"max_tokens: {len(max_tokens)} bounds for {len(seqs)} sequences")
        out: list[tuple[list[int], int]] = [([], -1)] * len(seqs)
        ks = np.minimum(np.asarray(max_tokens, dtype=np.int64), self.num_draft_tokens)
        live = np.flatnonzero((ks > 0) & (np.fromiter(map(len, seqs), np.int64, len(seqs)) > 0))
        if len(live) == 0:
            return out
        group = [seqs[i] for i in live]
        lens = np.fromiter(map(len, group), np.int64, len(group))
        batch = Batch(np.concatenate(group), lens)
        own_n, own_end = self._own_match_many(batch)
        corpus_n, corpus_at = np.zeros_like(own_n), np.zeros_like(own_n)
        if self._index:  # the corpus can only win with a longer match: none past the full window
            need = np.flatnonzero(own_n < np.minimum(self.max_window, lens))
            corpus_n[need], corpus_at[need] = self._corpus_match_many(batch, need)
        for j, i in enumerate(live.tolist()):
            k = int(ks[i])
            if corpus_n[j] > own_n[j]:
                out[i] = (self._corpus_draft(int(corpus_at[j]), k), -1)
            elif own_n[j]:
                end = int(own_end[j])
                out[i] = (copy_forward(group[j], end, k), end)
        return out

    def _own_match_many(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """(n [B], e [B]) of each sequence: its longest suffix within the windows that occurred
        earlier in it, e the position after its most recent earlier occurrence; (0, 0) if
        none. The newest OWN_NEWEST_FIRST candidates of each go first; only a sequence with no
        full-width match among them compares its older ones (which must be longer to win)."""
        n, end = np.zeros(len(batch.lens), np.int64), np.zeros(len(batch.lens), np.int64)
        cat, last = batch.tokens, batch.ends - 1
        width = np.minimum(self.max_window, batch.lens - 1)
        hits = cat == np.repeat(cat[last], batch.lens)  # where each sequence's last token is
        hits[last] = False  # (an earlier occurrence only)
        cands = np.flatnonzero(hits)
        seq = np.searchsorted(batch.ends, cands, side="right")
        keep = width[seq] >= self.min_window
        cands, seq = cands[keep], seq[keep]
        self.cost.scanned += int((batch.lens - 1)[width >= self.min_window].sum())
        run = np.bincount(seq, minlength=len(width))[seq]  # each one's sequence's candidates
        first = ranks(seq) >= run - OWN_NEWEST_FIRST
        rows, (best, at) = self._best_own(batch, cands[first], seq[first], width)
        n[rows], end[rows] = best, at
        older = ~first & np.isin(seq, rows[best < width[rows]])
        if older.any():
            rows, (best, at) = self._best_own(batch, cands[older], seq[older], width)
            longer = best > n[rows]
            n[rows[longer]], end[rows[longer]] = best[longer], at[longer]
        return n, end

    def _best_own(
        self, batch: Batch, cands: np.ndarray, seq: np.ndarray, width: np.ndarray
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """(sequences with a candidate, (n, e) of each): the longest-newest match among its
        candidates `cands` (positions of the batch's tokens holding the sequence's last)."""
        if len(cands) == 0:
            return seq, (seq, seq)
        self.cost.compared += len(cands) * self.max_window
        start = batch.ends[seq] - batch.lens[seq]
        # cell [c, j]: the token j before candidate c against the token j before the last
        back = np.maximum(cands[:, None] - self._offsets, start[:, None])
        tail = np.maximum(batch.ends[seq][:, None] - 1 - self._offsets, start[:, None])
        local = cands - start
        lengths = run_lengths(
            batch.tokens[back] == batch.tokens[tail], self.max_window,
            np.minimum(width[seq], local + 1),
        )  # fmt: skip
        rows, (n, at) = longest_newest_each(seq, lengths, local)
        found = n >= self.min_window
        return rows, (np.where(found, n, 0), np.where(found, at + 1, 0))

    def _corpus_match_many(self, batch: Batch, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n, g) of the batch's sequences `which`: the longest suffix within the windows that
        occurred in the corpus among the indexed candidates, g the global position that
        followed it; (0, 0) if none. Each one's newest CORPUS_NEWEST_FIRST candidates go
        first; only a sequence with no full-width match among them compares its older ones."""
        lo, n, at = self.min_window, np.zeros(len(which), np.int64), np.zeros(len(which), np.int64)
        ends, lens, cat = batch.ends[which], batch.lens[which], batch.tokens
        found = [
            self._index.get(int(cat[e - 1]) if lo == 1 else tuple(cat[e - lo : e].tolist()))
            if length >= lo else None
            for e, length in zip(ends.tolist(), lens.tolist())
        ]  # fmt: skip
        found = [f or () for f in found]
        width = np.minimum(self.max_window, lens)
        # each sequence's last max_window tokens, newest first (cells past its start: capped)
        suffix = cat[np.maximum(ends[:, None] - 1 - self._offsets, (ends - lens)[:, None])]
        rows, best, g = self._best_corpus([f[-CORPUS_NEWEST_FIRST:] for f in found], suffix, width)
        n[rows], at[rows] = best, g
        rest = [i for i in rows[best < width[rows]].tolist() if len(found[i]) > CORPUS_NEWEST_FIRST]
        if rest:
            older = [found[i][:-CORPUS_NEWEST_FIRST] for i in rest]
            rows, best, g = self._best_corpus(older, suffix[rest], width[rest])
            rows = np.asarray(rest)[rows]
            longer = best > n[rows]
            n[rows[longer]], at[rows[longer]] = best[longer], g[longer]
        return n, at

    def _best_corpus(
        self, found: list, suffix: np.ndarray, width: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sequences with a candidate, the longest match of each, its global position): the
        longest-newest among each sequence's candidate list `found[i]` (ascending)."""
        counts = np.fromiter(map(len, found), np.int64, len(found))
        if not counts.any():
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        cands = np.fromiter(chain.from_iterable(found), np.int64, int(counts.sum()))
        seq = np.repeat(np.arange(len(found)), counts)
        size = len(self._ring)
        self.cost.corpus_candidates += len(cands)
        self.cost.compared += len(cands) * self.max_window
        slots = cands % size
        back = (slots - 1)[:, None] - self._offsets  # ring slots before each candidate
        if size > self.max_window:  # (one wrap at most: cheaper than a modulo of every cell)
            back[back < 0] += size
        else:
            back %= size
        # the first `lo` cells are the key, equal; a match stops at its entry's start
        cap = np.minimum(width[seq], cands - self._ring_start[slots])
        lengths = run_lengths(self._ring[back] == suffix[seq], self.max_window, cap)
        rows, (best, rank) = longest_newest_each(seq, lengths, ranks(seq))
        return rows, best, cands[np.searchsorted(seq, rows) + rank]

    def _corpus_draft(self, at: int, k: int) -> list[int]:
        size = len(self._ring)
        stop = self._stops[int(self._ring_start[at % size])]
        return self._ring[np.arange(at, min(at + k, stop)) % size].tolist()

    # -- corpus --------------------------------------------------------------------------------

    @property
    def corpus_tokens(self) -> int:
        """Tokens the corpus holds (prompt tails + outputs): never above `capacity`."""
        return self._corpus_tokens

    def add_output(self, prompt_tail: Sequence[int], output_ids: Sequence[int]) -> None:
        """Add one finished output to the corpus, after the last `max_window` tokens of its
        prompt (`prompt_tail` may be the whole prompt)."""
        if len(output_ids) == 0 or self.capacity == 0:
            return
        ctx = np.asarray(prompt_tail[max(len(prompt_tail) - self.max_window, 0) :], np.int64)
        tokens = np.concatenate([ctx.reshape(-1), np.asarray(output_ids, np.int64).reshape(-1)])
        first = len(ctx)
        if len(tokens) > self.capacity:  # keep the newest part of an entry larger than all
            cut = len(tokens) - self.capacity
            tokens, first = tokens[cut:], max(first - cut, 0)
        n = len(tokens)
        while self._corpus_tokens + n > self.capacity:
            self._evict_oldest()
        self._reserve(self._corpus_tokens + n)
        start, size = self._next, len(self._ring)
        slots = np.arange(start, start + n) % size
        self._ring[slots] = tokens
        self._ring_start[slots] = start
        self._next += n
        self._corpus_tokens += n
        first = max(first, self.min_window)  # positions that follow a whole key in the entry
        self._entries.append((start, start + first, start + n))
        self._stops[start] = start + n
        index, limit = self._index, CORPUS_CANDIDATES
        for g, key in zip(range(start + first, start + n), self._keys(tokens.tolist(), first)):
            found = index.get(key)
            if found is None:
                index[key] = [g]
            else:
                found.append(g)
                if len(found) > limit:
                    del found[0]
        self.cost.indexed += max(n - first, 0)

    def _keys(self, toks: list[int], first: int):
        """The `min_window`-grams that end before positions first..len(toks)-1 of an entry."""
        lo, n = self.min_window, len(toks)
        if lo == 1:
            return toks[first - 1 : n - 1]
        return zip(*(toks[first - lo + i : n - lo + i] for i in range(lo)))

    def _evict_oldest(self) -> None:
        start, first, stop = self._entries.popleft()
        del self._stops[start]
        self._corpus_tokens -= stop - start
        toks = self._ring[np.arange(start, stop) % len(self._ring)].tolist()
        index = self._index
        # the entry is the oldest: its positions lead every index list they are in
        for key in dict.fromkeys(self._keys(toks, first - start)):
            found = index[key]
            cut = bisect_left(found, stop)
            if cut == len(found):
                del index[key]
            else:
                del found[:cut]
            self.cost.evicted_keys += 1

    def _reserve(self, live: int) -> None:
        """Grow the ring to hold `live` tokens (at most `capacity`), keeping the live ones."""
        size = len(self._ring)
        if live <= size:
            return
        new = min(self.capacity, max(live, 2 * size, 1024))
        kept = np.arange(self._next - self._corpus_tokens, self._next)
        ring, ring_start = np.zeros(new, np.int64), np.zeros(new, np.int64)
        if size:
            ring[kept % new] = self._ring[kept % size]
            ring_start[kept % new] = self._ring_start[kept % size]
        self._ring, self._ring_start = ring, ring_start
