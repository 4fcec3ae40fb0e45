"""engine/speculative/policy.py: when drafting pauses and resumes, how a request's budget
follows its acceptance, and the expected-acceptance arithmetic (against a direct sum)."""

from __future__ import annotations

import pytest

from engine.speculative.policy import (
    MAX_DRAFT_PAUSE,
    MAX_PAUSE,
    MAX_WAIT,
    VERIFY_GAIN,
    DraftPolicy,
    gain_for,
)


def test_expected_acceptance_is_the_sum_of_the_chain_probabilities():
    policy = DraftPolicy(max_drafts=7)
    state = policy.new_state()
    state.drafted, state.accepted = 40, 30
    r = policy.rate(state)
    for k in range(8):
        assert policy.expected(state, k) == pytest.approx(sum(r**j for j in range(1, k + 1)))


def test_drafting_pauses_when_it_does_not_pay_and_probes_ever_more_rarely():
    policy = DraftPolicy(max_drafts=4)
    assert not policy.wants_fresh_tokens()  # off until a probe finds drafts worth verifying
    probes = []
    for step in range(400):
        assert not policy.wants_fresh_tokens()  # (a probe never makes a step be read early)
        if policy.probes_now():
            probes.append(step)
            policy.tick()
            policy.after_probe(worth=False)  # every probe finds nothing worth verifying
        else:
            policy.tick()
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # the plain (overlapped) steps between two probes: 1, 2, 4, ... up to MAX_PAUSE
    assert [g - 1 for g in gaps[:6]] == [1, 2, 4, 8, 16, 32]
    assert {g - 1 for g in gaps[6:]} == {MAX_PAUSE}
    # a probe that finds a gain turns drafting on: every step is then read first and drafts,
    # until one step's drafts are not worth verifying
    while not policy.probes_now():
        policy.tick()
    policy.tick()
    policy.after_probe(worth=True)
    for _ in range(3):
        assert policy.wants_fresh_tokens() and not policy.probes_now()
        policy.tick()
        policy.after_plan(verified=True)
    policy.tick()
    policy.after_plan(verified=False)
    assert not policy.wants_fresh_tokens() and not policy.probes_now()
    policy.tick()
    assert policy.probes_now()  # (the pause starts again from one step)


def test_a_step_verifies_only_when_expected_acceptance_reaches_the_gain():
    policy = DraftPolicy(max_drafts=4)
    for batch in (1, 7, 16, 100, 256, 1000):
        need = gain_for(batch) * batch
        assert not policy.worth_verifying(need - 0.01, batch, drafted=50)
        assert policy.worth_verifying(need, batch, drafted=50)
        assert not policy.worth_verifying(1e9, batch, drafted=0)
    # the gain asked grows with the batch, as a verify step's measured cost does
    gains = [gain_for(b) for b in range(1, 1025)]
    assert gains == sorted(gains) and gains[0] == VERIFY_GAIN[0][1]
    always = DraftPolicy(max_drafts=4, always=True)
    assert always.worth_verifying(0.0, 256, drafted=1)


def test_a_requests_budget_grows_while_all_is_accepted_and_waits_after_misses():
    policy = DraftPolicy(max_drafts=8)
    state = policy.new_state()
    state.budget = 2
    policy.verified(state, drafted=2, accepted=2)
    assert state.budget == 4
    policy.verified(state, drafted=4, accepted=4)
    assert state.budget == 8
    policy.verified(state, drafted=8, accepted=3)
    assert state.budget == 4 and state.wait == 0
    waits = []
    for _ in range(7):
        policy.verified(state, drafted=state.budget, accepted=0)
        waits.append(state.wait)
        state.wait = 0
    assert waits == [min(2**m - 1, MAX_WAIT) for m in range(1, 8)]
    assert state.budget == 1
    assert (state.verify_ct, state.drafted) == (10, 2 + 4 + 8 + 4 + 2 + 1 + 1 + 1 + 1 + 1)


def test_budget_respects_the_length_limit_and_the_wait():
    policy = DraftPolicy(max_drafts=5)
    state = policy.new_state()
    assert policy.budget(state, left=1) == 0  # its last token: nothing to draft after it
    assert policy.budget(state, left=3) == 2
    state.wait = 2
    assert [policy.budget(state, left=50) for _ in range(3)] == [0, 0, 5]
    always = DraftPolicy(max_drafts=5, always=True)
    waiting = always.new_state()
    waiting.wait = 9
    assert always.budget(waiting, left=50) == 5


def test_a_draft_model_drafts_only_when_acceptance_covers_verify_and_draft_forwards():
    policy = DraftPolicy(max_drafts=4, draft_cost=0.25)
    for batch in (1, 16, 256):
        need = (gain_for(batch) + 3 * 0.25) * batch
        assert not policy.worth_drafting(need - 0.01, batch, drafts=3)
        assert policy.worth_drafting(need, batch, drafts=3)
        assert not policy.worth_drafting(1e9, batch, drafts=0)
    # a dearer draft asks for more
    dear = DraftPolicy(max_drafts=4, draft_cost=1.0)
    assert not dear.worth_drafting((gain_for(1) + 3 * 0.25), 1, drafts=3)
    # one whose longest chain could not pay, all of it accepted, is not worth probing
    assert not dear.could_pay(1) and policy.could_pay(1)
    assert DraftPolicy(max_drafts=4, draft_cost=1.0, always=True).could_pay(256)
    assert DraftPolicy(max_drafts=8, draft_cost=0.25).could_pay(1)


@pytest.mark.parametrize("accepted", [0, 4])
def test_a_draft_models_probes_verify_and_stop_when_nothing_is_accepted(accepted):
    """Drafting off, a probe arms the next step (read first), which drafts and verifies
    whatever the rates say (speculation.py's order of calls). With nothing accepted, the
    engine's acceptance cannot pay for the next probe: it comes after MAX_DRAFT_PAUSE steps,
    once (the pauses between the checks doubling up to MAX_PAUSE, never reset by the probe's
    own verify step). With every draft accepted, it verifies every step after the probe."""
    policy = DraftPolicy(max_drafts=4, draft_cost=0.5)
    state = policy.new_state()
    verifies = []
    for step in range(600):
        fresh, probe = policy.wants_fresh_tokens(), policy.probes_now()
        policy.tick()
        if fresh:
            worth = policy.worth_drafting(policy.expected(state, 4), 1, drafts=4)
            policy.after_plan(worth)
            if worth:
                verifies.append(step)
                policy.verified(state, drafted=4, accepted=accepted)
                state.wait = 0
        elif probe:
            if policy.could_pay(1):
                policy.arm_probe()
            else:
                policy.after_probe(False)
    if accepted:
        assert verifies == list(range(1, 600))
    else:
        assert len(verifies) == 2 and MAX_DRAFT_PAUSE <= verifies[1] - verifies[0] < 600
