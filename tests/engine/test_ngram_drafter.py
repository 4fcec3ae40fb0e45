"""engine/speculative/ngram.py: the n-gram drafter against a brute-force reference (its spec as
the obvious scan over every earlier position), drafts that depend on the sequence given and the
corpus only, the match windows, the corpus's capacity, oldest-first eviction and its bound on the
candidates a draft reads, counts of the work a draft and an output's indexing do, and the
acceptance of drafts on an extraction-shaped job."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import fields

import numpy as np
import pytest

from engine.speculative.ngram import (
    CORPUS_CANDIDATES,
    OWN_NEWEST_FIRST,
    DraftCost,
    NgramDrafter,
    drafts_from_sglang,
)

# -- the reference: the drafter's rules as plain O(n^2) scans ------------------------------------


def ref_own(tokens, lo, hi, k):
    """(n, draft): the longest suffix (lo..hi tokens) that occurred ending before the last token,
    its most recent occurrence, and the tokens after it, copied on into the draft itself."""
    length = len(tokens)
    for n in range(min(hi, length), lo - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # the occurrence tokens[end-n:end]
            if tokens[end - n : end] == suffix:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[end + j])
                return n, ext[length:]
    return 0, []


class RefCorpus:
    """Finished outputs, each after its prompt's last `hi` tokens, newest kept within capacity.
    A match is looked for among the `limit` most recent occurrences of the suffix's last `lo`
    tokens only (newest entry first, then latest position): the drafter's index keeps no more."""

    def __init__(self, hi, capacity, limit=CORPUS_CANDIDATES):
        self.hi, self.capacity, self.limit = hi, capacity, limit
        self.entries = deque()  # (tokens, first indexed position), oldest first

    def add(self, prompt, output):
        if not output or self.capacity == 0:
            return
        ctx = list(prompt[max(len(prompt) - self.hi, 0) :])
        tokens, first = ctx + list(output), len(ctx)
        if len(tokens) > self.capacity:
            cut = len(tokens) - self.capacity
            tokens, first = tokens[cut:], max(first - cut, 0)
        self.entries.append((tokens, first))
        while sum(len(t) for t, _ in self.entries) > self.capacity:
            self.entries.popleft()

    def match(self, tokens, lo, k):
        length = len(tokens)
        if length < lo:
            return 0, []
        key, recent = tokens[length - lo :], []
        for entry, first in reversed(self.entries):  # newest entry first
            for end in range(len(entry) - 1, max(first, lo) - 1, -1):
                if entry[end - lo : end] == key:
                    recent.append((entry, end))
        recent = recent[: self.limit]
        for n in range(min(self.hi, length), lo - 1, -1):
            suffix = tokens[length - n :]
            for entry, end in recent:
                if end >= n and entry[end - n : end] == suffix:
                    return n, entry[end : end + k]
        return 0, []


def ref_draft(tokens, corpus, lo, hi, k):
    own_n, own = ref_own(tokens, lo, hi, k)
    corpus_n, other = corpus.match(tokens, lo, k)
    if own_n >= corpus_n and own_n > 0:
        return own
    return other


def planted(rng, length, vocab):
    """Random tokens with copies of earlier spans planted in them."""
    out = []
    while len(out) < length:
        if out and rng.random() < 0.4:
            start = rng.randrange(len(out))
            out.extend(out[start : start + rng.randint(1, 12)])
        else:
            out.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 6)))
    return out[:length]


def random_config(rng):
    lo = rng.randint(1, 3)
    return lo, rng.randint(lo, 7), rng.randint(0, 8)


def arr(tokens):
    return np.array(tokens, dtype=np.int64)


# -- against the reference -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_own_drafts_equal_the_reference(seed):
    rng = random.Random(seed)
    for _case in range(100):
        lo, hi, k = random_config(rng)
        drafter = NgramDrafter(lo, hi, k, capacity=0)
        vocab = rng.choice([2, 3, 5, 20, 500])
        tokens = planted(rng, rng.randint(0, 140), vocab)
        buffer = arr(tokens)  # the scheduler's array: drafts read views of its prefixes
        corpus = RefCorpus(hi, 0)
        for length in range(len(tokens) + 1):
            bound = rng.choice([None, 0, 1, 3, 100])
            prefix = tokens[:length]
            want = ref_draft(prefix, corpus, lo, hi, k if bound is None else min(k, bound))
            assert drafter.draft(buffer[:length], bound) == want, (lo, hi, k, prefix)
        assert buffer.tolist() == tokens  # read, never written


def test_many_candidates_equal_the_reference():
    """Small vocabularies: hundreds of earlier occurrences of the last token, past
    OWN_NEWEST_FIRST, where the newest are tried first and the rest only without a full match."""
    rng = random.Random(9)
    for _case in range(30):
        lo = rng.randint(1, 3)
        hi, k = rng.randint(lo, 14), rng.randint(1, 8)
        tokens = planted(rng, rng.randint(600, 900), rng.choice([2, 3]))
        drafter, buffer = NgramDrafter(lo, hi, k, 0), arr(tokens)
        for length in range(len(tokens) - 15, len(tokens) + 1):
            want = ref_draft(tokens[:length], RefCorpus(hi, 0), lo, hi, k)
            assert drafter.draft(buffer[:length]) == want, (lo, hi, k, length)


@pytest.mark.parametrize("seed", range(3))
def test_drafts_with_the_corpus_equal_the_reference(seed):
    """Several requests of one job, finishing one after another into a small corpus."""
    rng = random.Random(100 + seed)
    for _case in range(30):
        lo, hi, k = random_config(rng)
        capacity = rng.choice([0, 5, 40, 200, 10_000])
        vocab = rng.choice([3, 8, 50])
        drafter, corpus = NgramDrafter(lo, hi, k, capacity), RefCorpus(hi, capacity)
        template = planted(rng, 30, vocab)
        for _row in range(8):
            prompt = template[: rng.randint(0, 30)] + planted(rng, rng.randint(0, 20), vocab)
            output = planted(rng, rng.randint(0, 15), vocab)
            if rng.random() < 0.5:  # alike outputs: the job's template again
                output = template[rng.randint(0, 10) :][: rng.randint(0, 20)] + output
            tokens = list(prompt)
            for t in output:
                assert drafter.draft(arr(tokens)) == ref_draft(tokens, corpus, lo, hi, k)
                tokens.append(t)
            if rng.random() < 0.8:  # finished (else aborted: nothing learnt)
                drafter.add_output(rng.choice([prompt, arr(prompt)]), output)
                corpus.add(prompt, output)
            assert drafter.corpus_tokens == sum(len(t) for t, _ in corpus.entries)
            assert drafter.corpus_tokens <= capacity


@pytest.mark.parametrize("newest_first", [None, 2])
def test_batch_search_equals_the_reference(newest_first, monkeypatch):
    """draft_many (one search over a batch's sequences) against the brute-force reference,
    with a corpus (down to fewer tokens than a window), k = 0 and empty sequences in the
    batch, and few candidates tried first."""
    import engine.speculative.ngram as ngram

    if newest_first is not None:
        monkeypatch.setattr(ngram, "OWN_NEWEST_FIRST", newest_first)
        monkeypatch.setattr(ngram, "CORPUS_NEWEST_FIRST", newest_first)
    rng = random.Random(7)
    for _case in range(40):
        lo, hi, k = random_config(rng)
        capacity = rng.choice([5, 300])
        drafter, corpus = NgramDrafter(lo, hi, k, capacity), RefCorpus(hi, capacity)
        vocab = rng.choice([2, 3, 8, 50])
        for _row in range(rng.randint(0, 5)):
            prompt, output = planted(rng, rng.randint(0, 20), vocab), planted(rng, 12, vocab)
            drafter.add_output(prompt, output)
            corpus.add(prompt, output)
        seqs = [planted(rng, rng.choice([0, 1, 5, 40, 300]), vocab) for _ in range(9)]
        bounds = [rng.choice([0, 1, k, 100]) for _ in seqs]
        got = drafter.draft_many([arr(t) for t in seqs], bounds)
        for tokens, bound, (draft, source) in zip(seqs, bounds, got):
            assert draft == ref_draft(tokens, corpus, lo, hi, min(k, bound))
            if source >= 0:  # an own draft: copied on from its source
                assert draft == drafter.follow(arr(tokens), source, bound)


def test_corpus_reads_the_most_recent_candidates_only():
    """A long match behind CORPUS_CANDIDATES newer occurrences of the suffix's last `min_window`
    tokens is not found: the index keeps no more, and the reference applies the same bound."""
    for newer, want in [(CORPUS_CANDIDATES - 1, [40, 41, 42]), (CORPUS_CANDIDATES, [113])]:
        drafter, corpus = NgramDrafter(1, 4, 3, capacity=10_000), RefCorpus(4, 10_000)
        outputs = [([], [1, 2, 3, 40, 41, 42])] + [([9], [3, 50 + i]) for i in range(newer)]
        for prompt, output in outputs:
            drafter.add_output(prompt, output)
            corpus.add(prompt, output)
        tokens = [7, 1, 2, 3]  # own: no earlier 3; corpus: [1, 2, 3] -> 40, or [3] -> 50 + i
        assert ref_draft(tokens, corpus, 1, 4, 3) == want
        before = drafter.cost.corpus_candidates
        assert drafter.draft(arr(tokens)) == want
        assert drafter.cost.corpus_candidates - before == CORPUS_CANDIDATES


# -- the windows and the rule between sources ----------------------------------------------


def test_windows_bound_the_match():
    # suffix [1, 2, 3]: as 3 tokens it occurred ending at 3 (then 9); as [2, 3], most recently
    # ending at 7 (then 7)
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    assert ref_own(tokens, 1, 3, 2) == (3, [9, 5])
    for hi, want in [(3, [9, 5]), (2, [7, 8]), (12, [9, 5])]:
        assert NgramDrafter(1, hi, 2, 0).draft(arr(tokens)) == want
    # min_window: [3] alone recurs, but no suffix of 4 tokens does
    drafter = NgramDrafter(4, 6, 2, 0)
    assert drafter.draft(arr(tokens)) == []
    longer = tokens + [9, 5, 2, 3, 7]  # now [3, 9, 5, 2, 3, 7] ... [2, 3, 7] recurs
    assert drafter.draft(arr(longer)) == ref_draft(longer, RefCorpus(6, 0), 4, 6, 2) == [8, 1]


def test_repeating_stretch_is_copied_on_through_the_draft():
    drafter = NgramDrafter(1, 4, 6, 0)
    assert drafter.draft(arr([5, 1, 2, 1, 2])) == [1, 2, 1, 2, 1, 2]
    assert drafter.draft(arr([7, 7])) == [7] * 6
    assert drafter.draft(arr([7] * 3000)) == [7] * 6  # thousands of candidates, newest first
    assert drafter.draft(arr([7] * 3000), 2) == [7, 7]


def test_tiny_sequences_and_empty_bounds():
    for lo, hi in [(1, 1), (1, 4), (2, 3)]:
        drafter = NgramDrafter(lo, hi, 4, capacity=100)
        drafter.add_output([], [5, 5, 5, 6])
        for tokens in [[], [5], [6], [5, 5], [4, 6]]:
            want = ref_draft(tokens, _ref_with(hi, 100, [([], [5, 5, 5, 6])]), lo, hi, 4)
            assert drafter.draft(arr(tokens)) == want, (lo, hi, tokens)
            assert drafter.draft(tokens) == want  # a list is taken as well
            assert drafter.draft(arr(tokens), 0) == [] and drafter.draft(arr(tokens), -1) == []
    assert NgramDrafter(1, 4, 4, 100).draft(arr([5])) == []
    assert NgramDrafter(1, 4, 0, 100).draft(arr([5, 5])) == []


def _ref_with(hi, capacity, outputs):
    corpus = RefCorpus(hi, capacity)
    for prompt, output in outputs:
        corpus.add(prompt, output)
    return corpus


def test_longer_match_wins_and_ties_go_to_the_request():
    drafter = NgramDrafter(1, 4, 3, capacity=1000)
    drafter.add_output([50, 60, 70], [1, 2, 3, 40, 41, 42])  # corpus: ... 1 2 3 -> 40 41 42
    # own: [3] then 30 31 9; corpus: [2, 3] -> 40
    assert drafter.draft(arr([3, 30, 31, 9, 2, 3])) == [40, 41, 42]
    # own [2, 3] ties the corpus's [2, 3]
    assert drafter.draft(arr([2, 3, 30, 31, 9, 2, 3])) == [30, 31, 9]
    # a prompt's end finds what followed an alike prompt's end
    assert drafter.draft(arr([8, 60, 70])) == [1, 2, 3]


def test_draft_keeps_no_state_per_request():
    """The answer for a sequence depends on the sequence (and the corpus) only: a drafter that
    drafted hundreds of other sequences answers as a fresh one, for a view as for a copy."""
    rng = random.Random(5)
    lo, hi, k = 2, 9, 6
    tokens = planted(rng, 2_990, 60)
    tokens += tokens[1_000:1_010]  # ends with a copy: a draft of 3,000 tokens is not empty
    used, fresh = NgramDrafter(lo, hi, k, 0), NgramDrafter(lo, hi, k, 0)
    for _ in range(300):
        other = arr(planted(rng, rng.randint(0, 3_000), 60))
        used.draft(other, rng.choice([None, 2]))
    buffer = arr(tokens + planted(rng, 500, 60))
    for length in [3_000, 2_999, 1_500, 3_000]:
        want = ref_draft(tokens[:length], RefCorpus(hi, 0), lo, hi, k)
        assert want or length != 3_000
        assert used.draft(buffer[:length]) == fresh.draft(arr(tokens[:length])) == want


# -- the corpus's bound and eviction ---------------------------------------------------------


def live_positions(drafter):
    return [g for found in drafter._index.values() for g in found]


def test_corpus_stays_within_capacity_and_evicts_oldest_first():
    drafter = NgramDrafter(2, 3, 4, capacity=30)
    outputs = [[100 * i + j for j in range(8)] for i in range(1, 8)]  # each n-gram unique
    for out in outputs:
        drafter.add_output([0], out)
        assert drafter.corpus_tokens <= 30 and len(drafter._ring) <= 30
    # 9 tokens each (1 prompt token + 8): the newest three fit in 30, the oldest are gone
    assert drafter.corpus_tokens == 27
    assert sum(stop - start for start, _, stop in drafter._entries) == drafter.corpus_tokens
    for i, out in enumerate(outputs):
        assert drafter.draft(arr(out[:3])) == (out[3:7] if i >= 4 else []), i
    # no position of an evicted output stays in the index
    oldest = drafter._entries[0][0]
    assert min(live_positions(drafter)) >= oldest
    assert len(live_positions(drafter)) == 3 * (8 + 1 - 2)  # positions after a whole 2-gram
    # an output larger than the whole corpus keeps its newest tokens only
    drafter.add_output([], list(range(1000, 1050)))
    assert drafter.corpus_tokens == 30 and len(drafter._entries) == 1
    start, _, stop = drafter._entries[0]
    ring = drafter._ring
    assert ring[np.arange(start, stop) % len(ring)].tolist() == list(range(1020, 1050))
    assert min(live_positions(drafter)) >= start and len(drafter._index) == 28
    assert drafter.draft(arr([7, 1020, 1021])) == [1022, 1023, 1024, 1025]
    assert drafter.draft(arr([7, 1000, 1001])) == []


def test_capacity_zero_keeps_no_corpus():
    drafter = NgramDrafter(1, 3, 4, capacity=0)
    drafter.add_output([1, 2], [3, 4, 5])
    assert drafter.corpus_tokens == 0 and not drafter._index and len(drafter._ring) == 0
    assert drafter.draft(arr([1, 2])) == []


def test_batch_drafts_and_bounds():
    drafter = NgramDrafter(1, 2, 4, 0)
    seqs = [arr([1, 2, 3, 4, 5, 1]), arr([9, 8, 9])]
    assert drafter.draft_many(seqs, [4, 9]) == [([2, 3, 4, 5], 1), ([8, 9, 8, 9], 1)]
    assert drafter.draft_many(seqs, [2, 2]) == [([2, 3], 1), ([8, 9], 1)]
    assert drafter.draft_many(seqs, [1, 0]) == [([2], 1), ([], -1)]
    assert drafter.draft_many([], []) == []
    with pytest.raises(ValueError, match="max_tokens: 1 bounds for 2 sequences"):
        drafter.draft_many(seqs, [1])
    assert drafts_from_sglang(8) == 7 and drafts_from_sglang(0) == 0
    for args in [(0, 3, 4, 10), (3, 2, 4, 10), (1, 2, -1, 10), (1, 2, 4, -1)]:
        with pytest.raises(ValueError):
            NgramDrafter(*args)


# -- cost: what a draft and an output's indexing do, counted ---------------------------------


def cost_delta(drafter, before):
    return {f.name: getattr(drafter.cost, f.name) - before[f.name] for f in fields(DraftCost)}


def cost_now(drafter):
    return {f.name: getattr(drafter.cost, f.name) for f in fields(DraftCost)}


def test_work_per_call_is_bounded():
    """A draft: one compare per token of the sequence, then candidates x window cells (the
    request's earlier occurrences of its last token, at most CORPUS_CANDIDATES of the corpus).
    An output: one index write per token, not per window length; its eviction one visit per
    key. Nothing per request is kept, so nothing grows with the number of requests."""
    lo, hi = 2, 9
    rng = random.Random(3)
    drafter = NgramDrafter(lo, hi, 5, capacity=2_000)
    evictions = 0
    for _ in range(16):  # a small vocabulary: the corpus's 2-grams recur far past the cap
        prompt, output = planted(rng, 40, 3), planted(rng, 150, 3)
        before = cost_now(drafter)
        drafter.add_output(prompt, output)
        delta = cost_delta(drafter, before)
        assert delta["indexed"] == len(output)  # one write per output token
        assert delta["evicted_keys"] <= 3 * 3  # one per 2-gram of the evicted entry
        evictions += delta["evicted_keys"] > 0
    assert evictions > 0
    assert drafter.corpus_tokens <= 2_000 and len(drafter._ring) <= 2_000
    assert all(len(found) <= CORPUS_CANDIDATES for found in drafter._index.values())
    assert len(live_positions(drafter)) <= drafter.corpus_tokens
    assert min(live_positions(drafter)) >= drafter._entries[0][0]
    assert max(len(f) for f in drafter._index.values()) == CORPUS_CANDIDATES  # the cap is hit
    # tokens the corpus lacks, then [0, 1]: no own match, the corpus's capped list of [0, 1]
    sequence = arr([100 + t for t in planted(rng, 3_000, 50)] + [0, 1])
    for length in [*range(2_500, 3_000, 7), 3_002]:
        seq = sequence[:length]
        before = cost_now(drafter)
        drafter.draft(seq)
        delta = cost_delta(drafter, before)
        candidates = int(np.count_nonzero(seq[:-1] == seq[-1]))
        assert delta["scanned"] == length - 1
        assert delta["corpus_candidates"] <= CORPUS_CANDIDATES
        assert delta["compared"] <= (candidates + delta["corpus_candidates"]) * hi
    assert delta["corpus_candidates"] == CORPUS_CANDIDATES  # [0, 1]: the corpus's capped list
    # a run of one token: thousands of candidates, but a full match among the newest ends it
    before = cost_now(drafter)
    assert drafter.draft(arr([4] * 3_000)) == [4] * 5
    assert cost_delta(drafter, before)["compared"] == OWN_NEWEST_FIRST * hi


# -- a realistic job: extraction outputs that copy spans of their row ------------------------


def extraction_job(rng, rows, vocab=5_000):
    """Rows of one job: (prompt, output, segments). The prompt is a shared instruction and the
    row's text; the output fills the job's field names with spans copied from the row's text,
    then a closing token; `segments` are the output's pieces as (kind, length)."""
    instruction = [rng.randrange(vocab) for _ in range(300)]
    fields = [[rng.randrange(vocab) for _ in range(rng.randint(2, 5))] for _ in range(6)]
    job = []
    for _ in range(rows):
        text = [rng.randrange(vocab) for _ in range(400)]
        output, segments = [], []
        for name in fields:
            start = rng.randrange(len(text) - 30)
            span = text[start : start + rng.randint(8, 30)]
            output += name + span
            segments += [("name", len(name)), ("span", len(span))]
        job.append((instruction + text, output + [0], segments))
    return job


def simulate(job, draft):
    """Greedy speculative decoding against the true outputs, one row after another: each step
    drafts, accepts the matching prefix and adds the target's one token. `draft(row, tokens,
    left)` sees the row's tokens so far; returns (accepted, drafted)."""
    accepted = drafted = 0
    for row, (prompt, output, _) in enumerate(job):
        done = 0
        while done < len(output):
            guess = draft(row, prompt + output[:done], len(output) - done - 1)
            a = 0
            while a < len(guess) and guess[a] == output[done + a]:
                a += 1
            accepted, drafted = accepted + a, drafted + len(guess)
            done += a + 1
    return accepted, drafted


def drafter_run(job, lo, hi, k, capacity):
    drafter, added = NgramDrafter(lo, hi, k, capacity), set()

    def draft(row, tokens, left):
        if row > 0 and row not in added:  # the row before finished: its output joins the corpus
            drafter.add_output(*job[row - 1][:2])
            added.add(row)
        return drafter.draft(arr(tokens), left)

    return simulate(job, draft)


def reference_run(job, lo, hi, k, capacity):
    corpus, added = RefCorpus(hi, capacity), set()

    def draft(row, tokens, left):
        if row > 0 and row not in added:
            corpus.add(*job[row - 1][:2])
            added.add(row)
        return ref_draft(tokens, corpus, lo, hi, min(k, left))

    return simulate(job, draft)


def copy_floor(job, k, corpus):
    """What a copier must accept at least: in each copied segment, all tokens but the first two
    (the first is the target's correction where the last segment ended; the second may still
    be ambiguous, a single token matching elsewhere), less one token in k + 1 (after k accepted
    drafts the target adds the next). Spans are copied from the row's own text; the field names
    only from earlier rows' outputs, so only with the corpus and not in the first row."""
    total = 0.0
    for row, (_, _, segments) in enumerate(job):
        for kind, length in segments:
            if kind == "span" or (corpus and row > 0):
                total += max(length - 2, 0) * k / (k + 1)
    return total


def test_extraction_drafts_are_mostly_accepted():
    lo, hi, k = 1, 8, 6
    job = extraction_job(random.Random(11), rows=12)
    with_corpus = drafter_run(job, lo, hi, k, capacity=50_000)
    assert with_corpus == reference_run(job, lo, hi, k, capacity=50_000)  # as the spec
    own_only = drafter_run(job, lo, hi, k, capacity=0)
    assert own_only == reference_run(job, lo, hi, k, capacity=0)
    for (accepted, drafted), corpus in [(with_corpus, True), (own_only, False)]:
        assert accepted / drafted > 0.5  # most drafted tokens are the next true tokens
        assert accepted >= copy_floor(job, k, corpus)
    assert with_corpus[0] > own_only[0]  # the job's finished rows predict its field names
