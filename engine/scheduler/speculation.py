"""Speculative decoding in the scheduler: which requests draft at a decode step, and what they
draft (`speculative_algorithm="NGRAM"`).

The drafter (engine/speculative/ngram.py) reads each request's own tokens and a corpus of the
engine's finished outputs; the policy (engine/speculative/policy.py) decides from acceptance
counts whether a step verifies drafts at all and how many each request takes. A step that
verifies is an EXTEND forward of each request's last token and its drafts
(engine/scheduler/decode.py plans it, engine/runner/logits_step.py accepts the drafts on the
device: engine/speculative/verify.py), read before the next step is planned.

A request drafts only where its draws need nothing a draft would get wrong without the tokens
before it: no grammar (its mask follows each accepted token), no penalties or logit_bias
(they count the tokens drawn before), and min_new_tokens met. The others take one token in the
verify step, drawn exactly as a decode step draws it.
"""

from __future__ import annotations

from engine.batch.req import Req
from engine.sampling.penalties import has_penalties
from engine.server_args import ServerArgs
from engine.speculative.ngram import NgramDrafter, drafts_from_sglang
from engine.speculative.policy import DraftPolicy

# The most tokens (each request's last token and its drafts) a verify step computes: the LM
# head runs on every one of them, [tokens, vocab] logits (1.2 GB at 4096 tokens of a 152k
# vocabulary in bfloat16), which start-up's activation peak (a prefill's last rows) does not hold.
MAX_VERIFY_TOKENS = 2048


class Speculation:
    def __init__(self, args: ServerArgs) -> None:
        drafts = drafts_from_sglang(args.speculative_num_draft_tokens)
        self.drafter = NgramDrafter(
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
            drafts,
            args.speculative_ngram_capacity,
        )
        self.policy = DraftPolicy(drafts, always=args.speculative_policy == "always")
        self.max_tokens = min(MAX_VERIFY_TOKENS, args.max_prefill_tokens)

    def wants_fresh_tokens(self) -> bool:
        """Whether the next decode step may draft: then the step before it is read first."""
        return self.policy.wants_fresh_tokens()

    def drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """Each request's drafts for a verify step (possibly none for some), or None: a plain
        decode step. NOTE: needs every request's tokens read (none pending)."""
        policy = self.policy
        policy.tick()
        if any(r.pending for r in reqs):
            return None
        per_request = max((self.max_tokens - len(reqs)) // max(len(reqs), 1), 0)
        drafts: list[list[int]] = []
        expected, drafted = 0.0, 0
        for req in reqs:
            if req.spec is None:
                req.spec = policy.new_state()
            k = policy.budget(req.spec, req.draw_limit - req.drawn) if _may_draft(req) else 0
            draft = self.drafter.draft(req.fill_ids, min(k, per_request)) if k else []
            if draft:
                expected += policy.expected(req.spec, len(draft))
                drafted += len(draft)
            drafts.append(draft)
        verify = policy.worth_verifying(expected, len(reqs), drafted)
        policy.after_plan(verify)
        return drafts if verify else None

    def verified(self, req: Req, drafted: int, accepted: int) -> None:
        self.policy.verified(req.spec, drafted, accepted)

    def finished(self, req: Req) -> None:
        """A request that ended by its stop or length: its output joins the drafter's corpus."""
        if req.output_ids:
            self.drafter.add_output(req.request.input_ids, req.output_ids)


def _may_draft(req: Req) -> bool:
    sp = req.sampling
    return (
        req.grammar is None
        and not sp.logit_bias
        and not has_penalties(req)
        and req.drawn >= sp.min_new_tokens
    )
