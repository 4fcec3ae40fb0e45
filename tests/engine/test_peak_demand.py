"""PeakDemand's closed form against a step-by-step simulation of the pool.

The simulation follows the scheduler: every decode step, each request with draws left takes one
more slot (a new page when its last one is full); a request is given back one step after its
last draw (with overlap, its last step is read while the next one runs), and the pool gets back
the pages it held alone. The peak is the most pages taken beyond what is held now.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.scheduler.peak_demand import PeakDemand


def _simulated_peak(kv_len, remaining, alone, page_size) -> int:
    pages = lambda tokens: -(-tokens // page_size)  # noqa: E731
    held = pages(kv_len)
    peak = 0
    for t in range(1, int(remaining.max(initial=0)) + 3):
        holding = remaining >= t - 1  # given back before step r + 2
        grown = pages(kv_len + np.minimum(t, remaining)) - held
        peak = max(peak, int(grown[holding].sum() - alone[~holding].sum()))
    return peak


def _requests(rng, n, page_size, aligned):
    remaining = rng.integers(0, 60, n)
    kv_len = rng.integers(1, 200, n)
    if aligned:
        kv_len = kv_len * page_size
    held = -(-kv_len // page_size)
    alone = rng.integers(0, held + 1)  # a request may share some of its pages
    return kv_len, remaining, alone


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_peak_is_the_simulated_peak_when_pages_start_empty(page_size):
    """KV that ends on a page boundary: each request's growth is exactly ceil(t / page_size)."""
    rng = np.random.default_rng(page_size)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        kv_len, remaining, alone = _requests(rng, n, page_size, aligned=True)
        peak = PeakDemand(remaining, alone, page_size).pages
        assert peak == _simulated_peak(kv_len, remaining, alone, page_size), trial


def test_the_peak_bounds_the_simulated_peak_from_any_page_offset():
    rng = np.random.default_rng(7)
    tight = 0
    for _ in range(300):
        kv_len, remaining, alone = _requests(rng, int(rng.integers(1, 40)), 16, aligned=False)
        peak = PeakDemand(remaining, alone, 16).pages
        simulated = _simulated_peak(kv_len, remaining, alone, 16)
        assert simulated <= peak <= simulated + len(kv_len)
        tight += peak == simulated
    assert tight > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_joining_request_changes_the_peak_as_a_rebuild_says(page_size):
    """pages_with answers without changing anything; add then equals a PeakDemand built anew;
    both equal the simulation of the pool with the newcomer in it."""
    rng = np.random.default_rng(11 + page_size)
    for trial in range(200):
        kv_len, remaining, alone = _requests(rng, int(rng.integers(0, 30)), page_size, True)
        peak = PeakDemand(remaining, alone, page_size)
        for _ in range(3):
            r = (
                int(rng.choice(remaining))
                if len(remaining) and rng.random() < 0.3
                else int(rng.integers(0, 70))
            )
            h = int(rng.integers(0, 20))
            kv_len = np.append(kv_len, page_size * int(rng.integers(1, 50)))
            remaining, alone = np.append(remaining, r), np.append(alone, h)
            expected = _simulated_peak(kv_len, remaining, alone, page_size)
            before = peak.pages
            assert peak.pages_with(r, h) == expected, trial
            assert peak.pages == before
            peak.add(r, h)
            assert peak.pages == expected == PeakDemand(remaining, alone, page_size).pages


def test_fixed_lengths_admitted_together_need_all_of_their_tokens():
    """Requests that all end at the same step give nothing back before they peak: the exact
    peak is the full reservation."""
    remaining = np.full(10, 100)
    assert PeakDemand(remaining, np.full(10, 50), 1).pages == 10 * 100


def test_staggered_requests_need_about_half():
    """Requests a step apart in a steady stream: what those ending early give back serves
    those ending late, about half of the full reservation (the steady state of a busy pool)."""
    n, length, prompt = 200, 200, 100
    remaining = np.arange(1, n + 1) * length // n  # evenly spread over their lifetimes
    alone = prompt + length - remaining  # prompt and what each has generated so far
    peak = PeakDemand(remaining, alone, 1).pages
    assert peak == _simulated_peak(np.full(n, 1), remaining, alone, 1)
    assert peak < remaining.sum() / 2
