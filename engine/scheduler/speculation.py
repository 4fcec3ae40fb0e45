"""Speculative decoding in the scheduler: which requests draft at a decode step, and what they
draft (`speculative_algorithm`: "NGRAM" or "STANDALONE").

The n-gram drafter (engine/speculative/ngram.py) reads each request's own tokens and a corpus
of the engine's finished outputs; a draft model (engine/runner/draft_runner.py) drafts with
its own forwards instead. The policy (engine/speculative/policy.py) decides from acceptance
counts whether a step verifies drafts at all and how many each request takes. A step that
verifies is an EXTEND forward of each request's last token and its drafts
(engine/scheduler/decode.py plans it, engine/runner/logits_step.py accepts the drafts on the
device: engine/speculative/verify.py), read before the next step is planned.

A request drafts only where its draws need nothing a draft would get wrong without the tokens
before it: no penalties or logit_bias (they count the tokens drawn before), and min_new_tokens
met. The others take one token in the verify step, drawn exactly as a decode step draws it. A
request under a grammar drafts what its grammar forces (the tokens it allows one way only:
a JSON key, punctuation), never n-grams: those drafts are sure to be accepted, and its draw
after them sees the grammar's mask at that point (engine/runner/logits_step.py).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.batch.req import Req
from engine.runner.draft_runner import DraftRunner
from engine.runner.logits_step import sampling_batch
from engine.runner.model_runner import ModelRunner
from engine.sampling.penalties import has_penalties
from engine.server_args import ServerArgs
from engine.speculative.ngram import NgramDrafter, drafts_from_sglang
from engine.speculative.policy import DraftPolicy, DraftState
from engine.speculative_args import verify_token_limit


class Speculation:
    def __init__(
        self,
        args: ServerArgs,
        forced: Callable[[Req, int], list[int]],
        runner: ModelRunner,
    ) -> None:
        """`forced`: a constrained request's tokens its grammar allows one way only, up to a
        limit (GrammarBackend.forced_tokens): its drafts, sure to be accepted. `runner`: the
        target's, whose request rows and pool a draft model's mirror."""
        self.forced = forced
        self.vocab_size = runner.config.vocab_size
        self.draft_model: DraftRunner | None = None
        self.draft_probs = None  # the last drafts' distributions (a draft model's), or None
        standalone = args.speculative_algorithm == "STANDALONE"
        if standalone:
            rows = args.max_request_rows
            # every row's whole context, and each row's drafts beyond it
            tokens = runner.max_total_tokens + (rows + 1) * args.speculative_num_draft_tokens
            self.draft_model = DraftRunner(
                args, runner.config, runner.draft, rows, tokens, runner.device
            )
        drafts = drafts_from_sglang(args.speculative_num_draft_tokens)
        # (a draft model drafts alone: no n-gram drafter, and no corpus built at every finish)
        self.drafter = (
            None
            if standalone
            else NgramDrafter(
                args.speculative_ngram_min_match_window_size,
                args.speculative_ngram_max_match_window_size,
                drafts,
                args.speculative_ngram_capacity,
            )
        )
        always = args.speculative_policy == "always"
        self.policy = DraftPolicy(drafts, always, draft_cost(runner) if standalone else 0.0)
        self.max_tokens = verify_token_limit(args.max_prefill_tokens)

    def wants_fresh_tokens(self) -> bool:
        """Whether the next decode step may draft: then the step before it is read first."""
        return self.policy.wants_fresh_tokens()

    def drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """Each request's drafts for a verify step (possibly none for some), or None: a plain
        decode step. Called for every decode step: it drafts when `wants_fresh_tokens` said so
        before the step was planned (every request's tokens read), or, drafting off, when the
        policy probes (from the tokens read so far: drafts judged later, never verified)."""
        policy = self.policy
        fresh = policy.wants_fresh_tokens()  # (what the scheduler asked before this plan)
        probe = policy.probes_now()
        policy.tick()  # NOTE: every decode step counts, drafting or not: pauses are in steps
        if fresh and any(r.pending for r in reqs):
            fresh, probe = False, True  # (a step the scheduler could not read first)
        if not (fresh or probe):
            return None
        if self.draft_model is not None:
            if fresh:
                return self._model_drafts(reqs)
            if policy.could_pay(len(reqs)):
                policy.arm_probe()  # (its K/V needs every token: the next step is read first)
            else:
                policy.after_probe(False)  # (it could not pay: no probe, and the pause grows)
            return None
        drafts, expected = self._drafts(reqs)
        drafted = sum(map(len, drafts))
        worth = policy.worth_verifying(expected, len(reqs), drafted)
        if fresh:
            policy.after_plan(worth)
        else:
            policy.after_probe(worth)
        if fresh and worth:
            return drafts
        for req, draft in zip(reqs, drafts):  # judged later, against what the request draws
            if draft and req.spec.shadow is None and req.grammar is None:
                req.spec.shadow = (req.fill_len, draft)
        return None

    def _drafts(self, reqs: list[Req]) -> tuple[list[list[int]], float]:
        """Each request's draft from the tokens read so far, and the accepted tokens the batch's
        drafts are expected to give. A request with tokens still pending drafts its pending
        token first (a probe's draft, only judged later)."""
        policy = self.policy
        per_request = self._per_request(reqs)
        drafts: list[list[int]] = []
        expected = 0.0
        searches: list[tuple[int, Req, int]] = []  # (index, request, k): one search for all
        for i, req in enumerate(reqs):
            state = req.spec
            if state is None:
                state = req.spec = policy.new_state()
            elif state.shadow is not None:
                policy.judge_shadow(state, req.fill_ids)
            k = policy.budget(state, req.draw_limit - req.drawn) if _may_draft(req) else 0
            k = min(k, per_request)
            draft: list[int] = []
            if req.grammar is not None:  # what its grammar forces: accepted whatever is drawn
                draft = self.forced(req, k) if k and not req.pending else []
                expected += len(draft)
            elif k:
                draft = self._follow(req, state, k)
                if draft is None:
                    searches.append((i, req, k))
                    draft = []
                else:
                    expected += policy.expected(state, len(draft))
            drafts.append(draft)
        if searches:
            found = self.drafter.draft_many(
                [r.fill_ids for _, r, _ in searches], [k for *_, k in searches]
            )
            for (i, req, _), (draft, source) in zip(searches, found):
                req.spec.source = source
                drafts[i] = draft
                if draft:
                    expected += policy.expected(req.spec, len(draft))
        return drafts, expected

    def _model_drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """The draft model's drafts: as many for every request as the one that may take the
        most, each then cut to what its own limits allow (none for a request that may not
        draft: engine/runner/draft_runner.py runs the batch as one)."""
        policy, per_request = self.policy, self._per_request(reqs)
        ks = []
        for req in reqs:
            if req.spec is None:
                req.spec = policy.new_state()
            may = _may_draft(req) and req.grammar is None
            ks.append(
                min(policy.budget(req.spec, req.draw_limit - req.drawn), per_request) if may else 0
            )
        k = max(ks)
        # (drafting every step, the policy asks for no expectation: none is computed)
        expected = (
            0.0 if policy.always else sum(policy.expected(r.spec, n) for r, n in zip(reqs, ks) if n)
        )
        worth = policy.worth_drafting(expected, len(reqs), k)
        policy.after_plan(worth)
        if not worth:
            self.draft_probs = None
            return None
        greedy = all(r.sampling.is_greedy for r in reqs)
        drawn = [r.drawn for r in reqs]
        sampling = (
            None
            if greedy
            else sampling_batch(reqs, self.vocab_size, drawn, self.draft_model.device)
        )
        chains, self.draft_probs = self.draft_model.draft(reqs, k, sampling)
        if chains is None:
            return None
        return [chain[:n] for chain, n in zip(chains, ks)]

    def _per_request(self, reqs: list[Req]) -> int:
        """Drafts a request may take within the batch's verify_token_limit."""
        return max((self.max_tokens - len(reqs)) // max(len(reqs), 1), 0)

    def _follow(self, req: Req, state: DraftState, k: int) -> list[int] | None:
        """Where the request's last draft was all accepted and its source went on as its output
        did, the same source's next tokens (no search: the common case of a long copied span);
        else None: its tokens and the corpus are searched (NgramDrafter.draft_many, one search
        for the batch's requests)."""
        tokens = req.fill_ids
        follow = state.follow
        if follow is None or follow[1] != len(tokens):
            return None
        state.source = follow[0]
        return self.drafter.follow(tokens, follow[0], k)

    def verified(self, req: Req, drafted: int, new: list[int]) -> None:
        """A verify step's outcome for a request whose `new` tokens were appended (its accepted
        drafts, then the target's own token)."""
        state = req.spec
        accepted = len(new) - 1
        self.policy.verified(state, drafted, accepted)
        if self.draft_model is not None:  # (every row of its verify step ran in the draft)
            self.draft_model.kept(req, accepted)
            return
        state.follow = None
        if drafted and accepted == drafted and state.source >= 0:
            # the source's token after the draft is the one the target added: it goes on alike
            tokens = req.fill_ids
            after = state.source + drafted
            if after < len(tokens) - 1 and tokens[after] == new[-1]:
                state.follow = (after + 1, len(tokens))

    def finished(self, req: Req) -> None:
        """A request that ended by its stop or length: its output joins the drafter's corpus."""
        if self.drafter is not None and req.output_ids:
            self.drafter.add_output(req.request.input_ids, req.output_ids)


def draft_cost(runner: ModelRunner) -> float:
    """Decode steps of the target a draft model's forward costs: its weights over the target's
    (a decode step reads the weights; both read K/V of the same tokens, in proportion alike)."""
    return sum(runner.draft.config.decode_weight_counts()) / sum(
        runner.config.decode_weight_counts()
    )


def _may_draft(req: Req) -> bool:
    sp = req.sampling
    return not sp.logit_bias and not has_penalties(req) and req.drawn >= sp.min_new_tokens
