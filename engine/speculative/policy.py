"""When to draft, and how many tokens: the policy that keeps speculative decoding from ever
costing a batch job more than it saves.

A verify step costs more than a decode step: it is read before the next step is planned (the
host needs the accepted counts to know each request's KV length), so it gives up overlap
scheduling, and it computes k + 1 positions per request. It pays only when enough drafts are
accepted. Published results say the same at scale: n-gram speculation is slower than none at
hundreds of running requests when drafts miss. So the policy decides at three levels, from
counts alone (never from timings: every tensor-parallel rank must decide alike, and a seeded
run must replay alike):

- **the step**: a verify step runs only when the batch's expected accepted drafts reach
  VERIFY_GAIN per running request, which grows with the batch as a verify step's measured cost
  does (`worth_verifying`); the expected count of a chain of k drafts at per-token acceptance r
  is r + r^2 + ... + r^k;
- **the engine**: while verify steps keep paying, drafting stays on (and every step is read
  before the next is planned). When a step's drafts do not pay, drafting goes off and overlap
  scheduling resumes. It probes again after a pause that doubles each time a probe finds no
  gain, up to MAX_PAUSE steps: a probe drafts from the tokens read so far (one step behind the
  device; nothing is read early for it) and only judges its drafts later against the drawn
  tokens, so a batch whose outputs never repeat (nothing to accept) pays a probe's drafting
  every MAX_PAUSE steps and nothing else (`wants_fresh_tokens`, `probes_now`);
- **the request**: its draft budget grows while all its drafts are accepted and shrinks to what
  was accepted; after drafts that missed entirely it waits 1, 3, 7, ... steps (up to MAX_WAIT)
  before it drafts again.

A draft that a step found not worth verifying is still judged, later, against the tokens the
request drew (`judge_shadow`): its evidence counts in the rate like a verified one's, so a
request whose output turns repetitive (or starts copying) is noticed without paying for it.

A draft model (STANDALONE) pays for its drafts before they are judged, so it decides at the
step before drafting: the batch's expected accepted drafts must cover the verify step's cost and
the draft forwards' (`draft_cost` decode steps per drafted token: the draft's weights over the
target's, a decode step being a read of the weights; `worth_drafting`). Its probe cannot draft
from stale tokens (its K/V must hold every token before it drafts): a probe arms the next step,
which is read first and drafts and verifies whatever the rates say (`arm_probe`), so its outcome
is evidence. Once judged drafts show that even its longest chains, at the engine's acceptance
so far, cannot pay, it probes again only every MAX_DRAFT_PAUSE steps (`could_pay`). A draft model
that could not pay even were every draft accepted (`could_pay`: its forwards and the verify step
cost more than its longest chain gives) never probes: the target as its own draft, say.

`speculative_policy="always"` skips all three (every request drafts every step, as many as it
may): the mechanism's ceiling, and what the tests use to exercise it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Expected accepted drafts per running request that a verify step must promise (adaptive), by
# the running batch: what a verify step costs over a decode step, less the one token a decode
# step gives too. A verify step is read before the next step is planned (no overlap) and drafts
# on the host; its attention is decode's (kernels/verify_attention.py), replayed from CUDA
# graphs of its own. Measured on an H200 (Qwen3-0.6B shape, 1000 tokens in, 4 waves of each
# batch size: `python -m bench.speculative`, its "verify / decode step" column, 2026-11-28):
# when every step verifies, 1.8x a decode step at batch 1, 2.2x at 16, 2.5x at 64, 2.2x at
# 256. The table prices a verify step at that in-run cost: once drafting pays, the policy keeps
# verifying, and a higher bar (a verify step among plain ones costs 2.6-3.7x) made it switch on
# and off, paying each switch's lost overlap (0.93x of no speculation at 256 where verifying
# every step gave 1.12x). 256 keeps 64's entry (it must not fall with the batch).
# (batch at least, gain).
VERIFY_GAIN = ((1, 0.8), (16, 1.2), (64, 1.5), (256, 1.5))
MAX_PAUSE = 64  # steps between probes, at most, while drafting does not pay
# A draft model's probe costs several decode steps (its catch-up forward, its drafts, a verify
# step read first): once probes have shown drafts that cannot pay, it probes again only after
# this many steps (a 1/8-layer dummy draft, probing every MAX_PAUSE steps, cost 5% at batch 1)
MAX_DRAFT_PAUSE = 512
MAX_WAIT = 31  # steps a request waits after a draft that missed, at most
# a request's acceptance rate starts at the engine's, weighted as this many drafted tokens
PRIOR_TOKENS = 4.0


@dataclass(slots=True)
class DraftState:
    """One request's drafting: what the policy adapts, and what meta_info reports."""

    budget: int  # drafts it may take at its next verify
    wait: int = 0  # steps before it drafts again
    misses: int = 0  # verifies in a row with nothing accepted
    verify_ct: int = 0  # verify steps it took part in (SGLang's spec_verify_ct)
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    # a draft not verified (the step did not pay), judged later against the tokens the request
    # drew: (where it started, the draft)
    shadow: tuple[int, list[int]] | None = None
    # drafts judged against the drawn tokens, and how many of them matched (what a verify step
    # would have accepted of a greedy request): the rate's evidence besides verified drafts
    shadow_drafted: int = 0
    shadow_accepted: int = 0
    # where its current draft was copied from in its own tokens (-1: the corpus, or none), and
    # where its next draft goes on from without a search, valid while its tokens number
    # `follow[1]` (engine/scheduler/speculation.py)
    source: int = -1
    follow: tuple[int, int] | None = None


class DraftPolicy:
    def __init__(self, max_drafts: int, always: bool = False, draft_cost: float = 0.0) -> None:
        """`draft_cost`: decode steps of the target one drafted token costs (0: an n-gram draft,
        found on the host)."""
        self.max_drafts = max_drafts
        self.always = always
        self.draft_cost = draft_cost
        self._armed = False  # a draft model's probe: the next step drafts and verifies
        self._probing = False  # the step being planned is that probe
        # drafting on: every decode step is planned with fresh tokens (read before it)
        self.active = False
        self._steps = 0
        self._resume_at = 0  # while off: the step of the next probe
        self._last_probe = 0  # a draft model's: the step that armed it
        self._pause = 1
        # the engine's acceptance so far (counts of drafted and accepted tokens)
        self._drafted = PRIOR_TOKENS
        self._accepted = PRIOR_TOKENS / 2

    def new_state(self) -> DraftState:
        return DraftState(budget=self.max_drafts)

    # ------------------------------------------------------------------ the engine
    def wants_fresh_tokens(self) -> bool:
        """Whether the next decode step may verify drafts (so the step before it is read first)."""
        return self.always or self.active

    def probes_now(self) -> bool:
        """Whether this step, drafting off, drafts from the tokens read so far (its drafts are
        judged later against the drawn ones, and never verified): no step is read early for it."""
        return not self.always and not self.active and self._steps >= self._resume_at

    def tick(self) -> None:
        """One decode step planned."""
        self._steps += 1

    def after_plan(self, verified: bool) -> None:
        """A decode step planned with fresh tokens either verified drafts or did not (then
        drafting goes off until a probe finds it worth it again)."""
        probe, self._probing = self._probing, False
        if self.always:
            return
        if verified:
            if not probe:  # (a probe's verify step is evidence, not a step that paid)
                self._pause = 1
        else:
            self.active = False
            self._pause_more()

    def arm_probe(self) -> None:
        """A draft model's probe: the next step is read first, then drafts and verifies."""
        self.active = self._armed = True
        self._last_probe = self._steps

    def after_probe(self, worth: bool) -> None:
        """A probe's drafts would have been worth a verify step (drafting goes on) or not."""
        if worth:
            self.active, self._pause = True, 1
        else:
            self._pause_more()

    def _pause_more(self) -> None:
        self._resume_at = self._steps + self._pause
        self._pause = min(2 * self._pause, MAX_PAUSE)

    # ------------------------------------------------------------------ the request
    def budget(self, state: DraftState, left: int) -> int:
        """Drafts the request may take this step; `left`: draws before its length limit ends it,
        this step's own token included (a verify adds its drafts plus one)."""
        room = min(self.max_drafts, left - 1)
        if self.always:
            return max(room, 0)
        if state.wait > 0:
            state.wait -= 1
            return 0
        return max(min(state.budget, room), 0)

    def expected(self, state: DraftState, drafts: int) -> float:
        """Expected accepted tokens of a chain of `drafts` drafts of this request."""
        r = self.rate(state)
        return r * (1 - r**drafts) / (1 - r) if r < 1 else float(drafts)

    def rate(self, state: DraftState) -> float:
        """The request's per-token acceptance, starting from the engine's: its verified drafts
        and those judged against its drawn tokens alike."""
        engine = self._accepted / self._drafted
        drafted = state.drafted + state.shadow_drafted
        accepted = state.accepted + state.shadow_accepted
        return (accepted + PRIOR_TOKENS * engine) / (drafted + PRIOR_TOKENS)

    def judge_shadow(self, state: DraftState, tokens) -> None:
        """Judge the request's unverified draft against its tokens since (once they reach past
        it, or differ): what a verify step would have accepted, were the request greedy. So the
        rate recovers when a request's output turns to text its drafts predict, without paying
        a verify step to find out."""
        at, draft = state.shadow
        drawn = tokens[at : at + len(draft)].tolist()
        matched = 0
        while matched < len(drawn) and drawn[matched] == draft[matched]:
            matched += 1
        if matched == len(drawn) < len(draft):
            return  # (all it could be compared with matched: wait for more tokens)
        state.shadow = None
        judged = min(matched + 1, len(draft))  # (a chain stops at its first miss)
        state.shadow_drafted += judged
        state.shadow_accepted += matched
        self._drafted += judged
        self._accepted += matched
        if matched:
            state.misses, state.wait = 0, 0
            state.budget = max(state.budget, min(matched + 1, self.max_drafts))

    def worth_verifying(self, expected: float, batch: int, drafted: int) -> bool:
        if self.always:
            return drafted > 0
        return drafted > 0 and expected >= gain_for(batch) * batch

    def could_pay(self, batch: int) -> bool:
        """Whether a draft model's longest chains would pay at `batch` (so a probe is worth it):
        every draft accepted, while no draft has been judged or MAX_DRAFT_PAUSE steps have
        passed since the last probe (a job's outputs may have turned predictable); otherwise at
        the engine's acceptance so far."""
        drafts = self.max_drafts
        cost = gain_for(batch) + drafts * self.draft_cost
        if self.always:
            return True
        if drafts < cost:
            return False
        if self._drafted <= PRIOR_TOKENS or self._steps - self._last_probe >= MAX_DRAFT_PAUSE:
            return True
        r = self._accepted / self._drafted
        return (r * (1 - r**drafts) / (1 - r) if r < 1 else drafts) >= cost

    def worth_drafting(self, expected: float, batch: int, drafts: int) -> bool:
        """Whether a draft model's `drafts` drafts per request, expected to give `expected`
        accepted tokens in all, pay for themselves and the verify step (an armed probe drafts
        whatever the rates say: its outcome is the evidence)."""
        self._probing, self._armed = self._armed, False
        if self.always or self._probing:
            return drafts > 0
        return drafts > 0 and expected >= (gain_for(batch) + drafts * self.draft_cost) * batch

    def verified(self, state: DraftState, drafted: int, accepted: int) -> None:
        """A verify step's outcome for one request (drafted 0: it only took its one token)."""
        state.verify_ct += 1
        if drafted == 0:
            return
        state.drafted += drafted
        state.accepted += accepted
        self._drafted += drafted
        self._accepted += accepted
        if self.always:
            return
        if accepted == drafted:
            state.budget = min(2 * state.budget, self.max_drafts)
            state.misses = 0
        elif accepted == 0:
            state.misses += 1
            state.budget = max(state.budget // 2, 1)
            state.wait = min(2**state.misses - 1, MAX_WAIT)
        else:
            state.budget = max(accepted + 1, 1)
            state.misses = 0


def gain_for(batch: int) -> float:
    """VERIFY_GAIN's entry for a running batch of `batch` requests."""
    return next(gain for least, gain in reversed(VERIFY_GAIN) if batch >= least)
