"""The n-gram drafter of `speculative_algorithm="NGRAM"`: guesses of a request's next tokens, read
off earlier token sequences that ended the way the request's tokens end now. Pure Python, no
device: the scheduler asks it for drafts, the target model verifies them
(`engine/speculative/verify.py`, drafts given as guesses, `draft_probs=None`).

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
   position followed by an output token; the draft is what followed its most recent occurrence
   (newest entry, then latest position in it), up to the entry's end.

Rule between them: the longer match wins; on a tie the request's own (the row's text is what
an extraction output copies). Either way one source gives the whole draft, a chain of at most
`min(num_draft_tokens, max_tokens)` tokens, possibly empty (no suffix of `min_window` tokens
occurred before).

Cost: each source keeps a dict from n-gram (a tuple, one key per window length) to its most
recent position, so appending a token writes `max_window - min_window + 1` keys and a draft
reads at most as many per source: per step O(new tokens x windows), never O(sequence length).
A prompt is indexed once, at `start`, in C-level bulk updates. Memory: about one dict entry per
token and window length per running request, and the same per corpus token (freed on eviction).

SGLang's arguments: `speculative_ngram_min_match_window_size` and `..._max_match_window_size`
are the windows; `speculative_ngram_capacity` bounds the corpus (here counted in stored tokens,
SGLang counts its trie's nodes); `speculative_num_draft_tokens` counts, in SGLang, the verified
row's last token as well, so the drafter's `num_draft_tokens` is that value minus one (see
`drafts_from_sglang`). The BFS breadths, `match_type` and `branch_length` shape SGLang's draft
*tree*; a chain has one branch, so they do not apply here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

NgramKey = tuple[int, ...]


def drafts_from_sglang(speculative_num_draft_tokens: int) -> int:
    """The drafter's `num_draft_tokens` for SGLang's `speculative_num_draft_tokens`, which
    counts the last verified token as the draft tree's root."""
    return max(speculative_num_draft_tokens - 1, 0)


@dataclass
class _Sequence:
    """One request's tokens and, per n-gram of a window length, the position that followed its
    most recent occurrence (only occurrences that some token already follows)."""

    tokens: list[int]
    prompt_len: int
    last_end: dict[NgramKey, int] = field(default_factory=dict)


@dataclass
class _Entry:
    """A finished output in the corpus: `tokens` = prompt tail + output; n-grams are indexed at
    the positions `first..len(tokens)-1` (those followed by an output token)."""

    tokens: list[int]
    first: int


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
        self.ops = 0  # n-gram index reads and writes so far: the cost the tests bound
        self._seqs: dict[str, _Sequence] = {}
        self._entries: deque[_Entry] = deque()
        self._corpus_index: dict[NgramKey, tuple[_Entry, int]] = {}
        self._corpus_tokens = 0

    # -- requests ------------------------------------------------------------------------------

    def start(self, rid: str, prompt_ids: Sequence[int]) -> None:
        """Admit a request: index its prompt, once."""
        if rid in self._seqs:
            raise KeyError(f"request {rid!r} already started in the n-gram drafter")
        seq = _Sequence(tokens=[int(t) for t in prompt_ids], prompt_len=len(prompt_ids))
        toks = seq.tokens
        for n in range(self.min_window, self.max_window + 1):
            if len(toks) <= n:
                break
            # keys tokens[e-n:e] -> e for e = n..len-1, later positions overwriting earlier ones
            keys = zip(*(islice(toks, i, len(toks) - n + i) for i in range(n)))
            seq.last_end.update(zip(keys, range(n, len(toks))))
            self.ops += len(toks) - n
        self._seqs[rid] = seq

    def extend(self, rid: str, new_ids: Iterable[int]) -> None:
        """Append a request's new output tokens (accepted drafts and the target's token)."""
        seq = self._seqs[rid]
        toks, index = seq.tokens, seq.last_end
        lo, hi = self.min_window, self.max_window
        for t in new_ids:
            end = len(toks)  # the new token follows the n-grams that end here
            for n in range(lo, min(hi, end) + 1):
                index[tuple(toks[end - n : end])] = end
            self.ops += max(min(hi, end) - lo + 1, 0)
            toks.append(int(t))

    def draft(self, rid: str, max_tokens: int | None = None) -> list[int]:
        """Up to `min(num_draft_tokens, max_tokens)` guessed next tokens of a request."""
        k = self.num_draft_tokens if max_tokens is None else min(self.num_draft_tokens, max_tokens)
        if k <= 0:
            return []
        toks = self._seqs[rid].tokens
        own_n, own_end = self._match(toks, self._seqs[rid].last_end)
        corpus_n, corpus_hit = self._match(toks, self._corpus_index)
        if own_n >= corpus_n and own_n > 0:
            return _copy_forward(toks, own_end, k)
        if corpus_n > 0:
            entry, end = corpus_hit
            return entry.tokens[end : end + k]
        return []

    def draft_batch(self, rids: Sequence[str], max_tokens: Sequence[int] | int | None = None):
        """`draft` for each request; `max_tokens` one bound for all or one per request."""
        if max_tokens is None or isinstance(max_tokens, int):
            return [self.draft(rid, max_tokens) for rid in rids]
        return [self.draft(rid, m) for rid, m in zip(rids, max_tokens, strict=True)]

    def finish(self, rid: str, output_ids: Sequence[int]) -> None:
        """A request finished with `output_ids` (its whole output): the output joins the
        corpus, after its prompt's last `max_window` tokens, and the request's index is freed."""
        seq = self._seqs.pop(rid)
        self.add_output(seq.tokens[: seq.prompt_len], output_ids)

    def drop(self, rid: str) -> None:
        """Forget a request without learning from it (aborted, retracted for good)."""
        self._seqs.pop(rid, None)

    def __contains__(self, rid: str) -> bool:
        return rid in self._seqs

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    # -- corpus --------------------------------------------------------------------------------

    @property
    def corpus_tokens(self) -> int:
        """Tokens the corpus holds (prompt tails + outputs): never above `capacity`."""
        return self._corpus_tokens

    def add_output(self, prompt_tail: Sequence[int], output_ids: Sequence[int]) -> None:
        """Add one output to the corpus, after the last tokens of its prompt."""
        if len(output_ids) == 0 or self.capacity == 0:
            return
        ctx = [int(t) for t in prompt_tail[max(len(prompt_tail) - self.max_window, 0) :]]
        tokens = ctx + [int(t) for t in output_ids]
        first = len(ctx)
        if len(tokens) > self.capacity:  # keep the newest part of an entry larger than all
            cut = len(tokens) - self.capacity
            tokens, first = tokens[cut:], max(first - cut, 0)
        while self._corpus_tokens + len(tokens) > self.capacity:
            self._evict_oldest()
        entry = _Entry(tokens, first)
        self._entries.append(entry)
        self._corpus_tokens += len(tokens)
        index = self._corpus_index
        for end, key in self._entry_keys(entry):
            index[key] = (entry, end)
            self.ops += 1

    def _entry_keys(self, entry: _Entry):
        toks = entry.tokens
        for end in range(entry.first, len(toks)):
            for n in range(self.min_window, min(self.max_window, end) + 1):
                yield end, tuple(toks[end - n : end])

    def _evict_oldest(self) -> None:
        entry = self._entries.popleft()
        self._corpus_tokens -= len(entry.tokens)
        index = self._corpus_index
        for _end, key in self._entry_keys(entry):
            hit = index.get(key)
            # a newer entry (or a later position of this one) may have taken the key over
            if hit is not None and hit[0] is entry:
                del index[key]
            self.ops += 1

    # -- matching ------------------------------------------------------------------------------

    def _match(self, toks: list[int], index: dict):
        """(n, value) of the longest suffix of `toks` within the windows found in `index`, else
        (0, None)."""
        for n in range(min(self.max_window, len(toks)), self.min_window - 1, -1):
            self.ops += 1
            hit = index.get(tuple(toks[len(toks) - n :]))
            if hit is not None:
                return n, hit
        return 0, None


def _copy_forward(toks: list[int], end: int, k: int) -> list[int]:
    """k tokens copied from position `end` on, reading past the end of `toks` into the copy
    itself (an overlapping copy, as LZ77's): (toks + draft)[end + j] for j < k."""
    draft = toks[end : end + k]
    period = len(toks) - end
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft
