"""engine/speculative/ngram.py: the n-gram drafter against a brute-force reference (its spec as
the obvious scan over every earlier position), incremental extends against one-shot indexing,
the match windows, the corpus's capacity and oldest-first eviction, freed requests, a count of
index operations that the sequence's length does not change, and the acceptance of drafts on
an extraction-shaped job."""

from __future__ import annotations

import random
from collections import deque

import pytest

from engine.speculative.ngram import NgramDrafter, drafts_from_sglang

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
    """Finished outputs, each after its prompt's last `hi` tokens, newest kept within capacity."""

    def __init__(self, hi, capacity):
        self.hi, self.capacity = hi, capacity
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
        for n in range(min(self.hi, length), lo - 1, -1):
            suffix = tokens[length - n :]
            for entry, first in reversed(self.entries):  # newest entry first
                for end in range(len(entry) - 1, max(first, n) - 1, -1):
                    if entry[end - n : end] == suffix:
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


# -- against the reference -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_own_drafts_equal_the_reference(seed):
    rng = random.Random(seed)
    for _case in range(100):
        lo, hi, k = random_config(rng)
        drafter = NgramDrafter(lo, hi, k, capacity=0)
        vocab = rng.choice([2, 3, 5, 20, 500])
        tokens = planted(rng, rng.randint(0, 80), vocab)
        rest = planted(rng, rng.randint(0, 60), vocab)
        drafter.start("r", tokens)
        corpus = RefCorpus(hi, 0)
        while True:
            bound = rng.choice([None, 0, 1, 3, 100])
            want = ref_draft(tokens, corpus, lo, hi, k if bound is None else min(k, bound))
            assert drafter.draft("r", bound) == want, (lo, hi, k, tokens)
            if not rest:
                break
            cut = rng.randint(1, 4)
            step, rest = rest[:cut], rest[cut:]
            drafter.extend("r", step)
            tokens = tokens + step


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
        for row in range(8):
            prompt = template[: rng.randint(0, 30)] + planted(rng, rng.randint(0, 20), vocab)
            output = planted(rng, rng.randint(0, 15), vocab)
            if rng.random() < 0.5:  # alike outputs: the job's template again
                output = template[rng.randint(0, 10) :][: rng.randint(0, 20)] + output
            rid = f"row{row}"
            drafter.start(rid, prompt)
            tokens = list(prompt)
            for t in output:
                assert drafter.draft(rid) == ref_draft(tokens, corpus, lo, hi, k)
                drafter.extend(rid, [t])
                tokens.append(t)
            if rng.random() < 0.8:
                drafter.finish(rid, output)
                corpus.add(prompt, output)
            else:
                drafter.drop(rid)
            assert drafter.corpus_tokens == sum(len(t) for t, _ in corpus.entries)
            assert drafter.corpus_tokens <= capacity


def test_incremental_extends_equal_one_shot():
    rng = random.Random(7)
    for _case in range(200):
        lo, hi, k = random_config(rng)
        tokens = planted(rng, rng.randint(0, 100), rng.choice([2, 4, 30]))
        cut = rng.randint(0, len(tokens))
        one_shot, incremental = NgramDrafter(lo, hi, k, 0), NgramDrafter(lo, hi, k, 0)
        one_shot.start("r", tokens)
        incremental.start("r", tokens[:cut])
        i = cut
        while i < len(tokens):
            j = i + rng.randint(1, 5)
            incremental.extend("r", tokens[i:j])
            i = j
        assert incremental._seqs["r"].last_end == one_shot._seqs["r"].last_end
        assert incremental.draft("r") == one_shot.draft("r")


# -- the windows and the rule between sources ----------------------------------------------


def test_windows_bound_the_match():
    # suffix [1, 2, 3]: as 3 tokens it occurred ending at 3 (then 9); as [2, 3], most recently
    # ending at 7 (then 7)
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    assert ref_own(tokens, 1, 3, 2) == (3, [9, 5])
    for hi, want in [(3, [9, 5]), (2, [7, 8]), (12, [9, 5])]:
        drafter = NgramDrafter(1, hi, 2, 0)
        drafter.start("r", tokens)
        assert drafter.draft("r") == want
    # min_window: [3] alone recurs, but no suffix of 4 tokens does
    drafter = NgramDrafter(4, 6, 2, 0)
    drafter.start("r", tokens)
    assert drafter.draft("r") == []
    drafter.extend("r", [9, 5, 2, 3, 7])  # now [3, 9, 5, 2, 3, 7] ... [2, 3, 7] recurs
    assert drafter.draft("r") == ref_draft(tokens + [9, 5, 2, 3, 7], RefCorpus(6, 0), 4, 6, 2)


def test_repeating_stretch_is_copied_on_through_the_draft():
    drafter = NgramDrafter(1, 4, 6, 0)
    drafter.start("r", [5, 1, 2, 1, 2])
    assert drafter.draft("r") == [1, 2, 1, 2, 1, 2]
    drafter.start("s", [7, 7])
    assert drafter.draft("s") == [7] * 6


def test_longer_match_wins_and_ties_go_to_the_request():
    drafter = NgramDrafter(1, 4, 3, capacity=1000)
    drafter.start("done", [50, 60, 70])
    drafter.finish("done", [1, 2, 3, 40, 41, 42])  # corpus: ... 1 2 3 -> 40 41 42
    drafter.start("r", [3, 30, 31, 9, 2, 3])  # own: [3] then 30 31 9; corpus: [2, 3] -> 40
    assert drafter.draft("r") == [40, 41, 42]
    drafter.start("t", [2, 3, 30, 31, 9, 2, 3])  # own [2, 3] ties the corpus's [2, 3]
    assert drafter.draft("t") == [30, 31, 9]
    # a prompt's end finds what followed an alike prompt's end
    drafter.start("u", [8, 60, 70])
    assert drafter.draft("u") == [1, 2, 3]


# -- the corpus's bound, eviction, freed requests ------------------------------------------


def test_corpus_stays_within_capacity_and_evicts_oldest_first():
    drafter = NgramDrafter(2, 3, 4, capacity=30)
    outputs = [[100 * i + j for j in range(8)] for i in range(1, 8)]  # each n-gram unique
    for i, out in enumerate(outputs):
        drafter.start(f"r{i}", [0])
        drafter.finish(f"r{i}", out)
        assert drafter.corpus_tokens <= 30
    # 9 tokens each (1 prompt token + 8): the newest three fit in 30, the oldest are gone
    assert drafter.corpus_tokens == 27
    assert sum(len(e.tokens) for e in drafter._entries) == drafter.corpus_tokens
    for i, out in enumerate(outputs):
        drafter.start("q", out[:3])
        assert drafter.draft("q") == (out[3:7] if i >= 4 else []), i
        drafter.drop("q")
    # no key of an evicted output stays in the index
    kept = {id(e) for e in drafter._entries}
    assert all(id(entry) in kept for entry, _ in drafter._corpus_index.values())
    # an output larger than the whole corpus keeps its newest tokens only
    drafter.start("big", [])
    drafter.finish("big", list(range(1000, 1050)))
    assert drafter.corpus_tokens == 30 and len(drafter._entries) == 1
    assert drafter._entries[0].tokens == list(range(1020, 1050))


def test_capacity_zero_keeps_no_corpus():
    drafter = NgramDrafter(1, 3, 4, capacity=0)
    drafter.start("a", [1, 2])
    drafter.finish("a", [3, 4, 5])
    assert drafter.corpus_tokens == 0 and not drafter._corpus_index
    drafter.start("b", [1, 2])
    assert drafter.draft("b") == []


def test_finish_and_drop_free_the_request():
    drafter = NgramDrafter(1, 4, 3, capacity=100)
    drafter.start("a", list(range(50)) * 2)
    drafter.start("b", [1, 2, 3])
    assert drafter.num_requests == 2
    drafter.finish("a", [7, 8])
    drafter.drop("b")
    drafter.drop("never-started")  # an abort of something never admitted is no error
    assert drafter.num_requests == 0 and "a" not in drafter and "b" not in drafter
    for call in (lambda: drafter.draft("a"), lambda: drafter.extend("b", [1])):
        with pytest.raises(KeyError):
            call()
    with pytest.raises(KeyError):
        drafter.finish("b", [1])
    drafter.start("c", [1])
    with pytest.raises(KeyError, match="already started"):
        drafter.start("c", [1])


def test_batch_drafts_and_bounds():
    drafter = NgramDrafter(1, 2, 4, 0)
    drafter.start("a", [1, 2, 3, 4, 5, 1])
    drafter.start("b", [9, 8, 9])
    assert drafter.draft_batch(["a", "b"]) == [[2, 3, 4, 5], [8, 9, 8, 9]]
    assert drafter.draft_batch(["a", "b"], 2) == [[2, 3], [8, 9]]
    assert drafter.draft_batch(["a", "b"], [1, 0]) == [[2], []]
    assert drafts_from_sglang(8) == 7 and drafts_from_sglang(0) == 0
    for args in [(0, 3, 4, 10), (3, 2, 4, 10), (1, 2, -1, 10), (1, 2, 4, -1)]:
        with pytest.raises(ValueError):
            NgramDrafter(*args)


# -- cost: index operations per step, whatever the length ------------------------------------


def test_index_operations_per_step_do_not_grow_with_the_sequence():
    lo, hi = 2, 9
    windows = hi - lo + 1
    rng = random.Random(3)
    drafter = NgramDrafter(lo, hi, 5, capacity=2_000)
    prompt = planted(rng, 3_000, 50)
    before = drafter.ops
    drafter.start("r", prompt)
    assert drafter.ops - before <= len(prompt) * windows  # indexed once, one write per window
    per_extend, per_draft = [], []
    for _ in range(2_000):
        before = drafter.ops
        drafter.draft("r")
        per_draft.append(drafter.ops - before)
        before = drafter.ops
        drafter.extend("r", [rng.randrange(50)])
        per_extend.append(drafter.ops - before)
    assert max(per_extend) == windows  # not the 3,000-5,000 tokens of the sequence
    assert max(per_draft) <= 2 * windows  # one look-up per window and source
    index = drafter._seqs["r"].last_end
    assert len(index) <= len(drafter._seqs["r"].tokens) * windows
    # the corpus: each output costs a write per token and window, eviction as much again
    output = planted(rng, 1_500, 50)
    before = drafter.ops
    drafter.finish("r", output)
    assert drafter.ops - before <= (len(output) + hi) * windows
    drafter.start("s", [1])
    before = drafter.ops
    drafter.finish("s", planted(rng, 1_500, 50))  # evicts the first output
    assert drafter.ops - before <= 2 * (1_500 + hi) * windows


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
    drafter = NgramDrafter(lo, hi, k, capacity)
    seen = {}  # row -> tokens given to the drafter so far

    def draft(row, tokens, left):
        if row not in seen:
            if row > 0:
                drafter.finish(f"row{row - 1}", job[row - 1][1])
            drafter.start(f"row{row}", tokens)
            seen[row] = len(tokens)
        drafter.extend(f"row{row}", tokens[seen[row] :])
        seen[row] = len(tokens)
        return drafter.draft(f"row{row}", left)

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
