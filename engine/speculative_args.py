"""The speculative decoding arguments of ServerArgs: each one's rule (a part of ServerArgs'
table, engine/server_args.py) and the rules between them (`check_speculative`, which
ServerArgs' validation calls): which algorithms are built, what applies to NGRAM, the
windows' order."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.rules import Rule, one_of

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
SPECULATIVE_BUILT = ("NGRAM", "STANDALONE")
SPECULATIVE_POLICIES = ("adaptive", "always")
DEFAULT_NUM_DRAFT_TOKENS = 8  # speculative_num_draft_tokens: 7 drafts and the root
DEFAULT_DRAFT_STEPS = 3  # speculative_num_steps of a draft model (STANDALONE), as SGLang's
# The most tokens (each request's last token and its drafts) a verify step computes: the LM
# head runs on every one of them, [tokens, vocab] logits (1.2 GB at 4096 tokens of a 152k
# vocabulary in bfloat16), which start-up's activation peak (a prefill's last rows) does not
# hold; the scheduler drafts within it (engine/scheduler/speculation.py), and start-up warms
# the LM head's row buckets up to it (engine/runner/model_runner.py).
MAX_VERIFY_TOKENS = 2048


def verify_token_limit(max_prefill_tokens: int) -> int:
    """The most tokens one verify step computes: MAX_VERIFY_TOKENS, and never more than a
    prefill step may (`max_prefill_tokens`, whose activations start-up measured)."""
    return min(MAX_VERIFY_TOKENS, max_prefill_tokens)


_POSITIVE = Rule(("a positive integer",), minimum=1)
# each argument's rule, part of ServerArgs' table (engine/server_args.py: _RULES)
SPECULATIVE_RULES: dict[str, Rule] = {
    "speculative_algorithm": one_of(SPECULATIVE_ALGORITHMS),
    "speculative_draft_model_path": Rule(("a non-empty path to a model folder",), non_empty=True),
    "speculative_num_steps": _POSITIVE,
    "speculative_eagle_topk": _POSITIVE,
    "speculative_num_draft_tokens": Rule(
        ("an integer >= 2 (the last token and at least one draft)",), minimum=2
    ),
    "speculative_ngram_min_match_window_size": _POSITIVE,
    "speculative_ngram_max_match_window_size": _POSITIVE,
    "speculative_ngram_capacity": Rule(("a non-negative integer",), minimum=0),
    "speculative_policy": one_of(SPECULATIVE_POLICIES),
}


def check_speculative(args: Any) -> None:
    """`args`: a ServerArgs being validated (not imported here: it imports this module)."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        given = [
            f.name for f in dataclasses.fields(args)
            if f.name.startswith("speculative_") and f.name != "speculative_algorithm"
            and getattr(args, f.name) != f.default
        ]  # fmt: skip
        if given:
            raise ValueError(
                f"{', '.join(given)} set without speculative_algorithm: set "
                f"speculative_algorithm (one of {', '.join(SPECULATIVE_BUILT)}) or drop them"
            )
        return
    if algorithm not in SPECULATIVE_BUILT:
        raise ValueError(
            f"speculative_algorithm={algorithm!r} is not built in this version (a draft head); "
            f"use one of {', '.join(SPECULATIVE_BUILT)}: drafts from each request's own tokens "
            "and the engine's finished outputs, or from a draft model"
        )
    if args.speculative_eagle_topk not in (None, 1):
        raise ValueError(
            f"speculative_eagle_topk must be 1 (a chain of drafts), got "
            f"{args.speculative_eagle_topk}: tree verification is not built in this version"
        )
    if args.is_embedding:
        raise ValueError("speculative_algorithm needs a generation engine (is_embedding=False)")
    if algorithm == "STANDALONE":
        _check_standalone(args)
        return
    for name, why in (
        ("speculative_draft_model_path", "a draft model's (STANDALONE)"),
        ("speculative_num_steps", "the drafting steps of a draft model (STANDALONE); NGRAM "
         "drafts speculative_num_draft_tokens - 1 tokens"),
    ):  # fmt: skip
        if getattr(args, name) is not None:
            raise ValueError(f"{name} does not apply to speculative_algorithm='NGRAM': {why}")
    lo = args.speculative_ngram_min_match_window_size
    hi = args.speculative_ngram_max_match_window_size
    if lo > hi:
        raise ValueError(
            f"speculative_ngram_min_match_window_size ({lo}) must be <= "
            f"speculative_ngram_max_match_window_size ({hi})"
        )


def _check_standalone(args: Any) -> None:
    """A draft model's: its folder, and its steps and draft tokens, which a chain makes one
    apart (num_draft_tokens = num_steps + 1, the root counted); the one not given follows."""
    if args.speculative_draft_model_path is None:
        raise ValueError(
            "speculative_algorithm='STANDALONE' needs speculative_draft_model_path: a model "
            "folder with the target's tokenizer and vocabulary"
        )
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is not None and tokens is not None and tokens != steps + 1:
        raise ValueError(
            f"speculative_num_draft_tokens ({tokens}) must be speculative_num_steps ({steps}) "
            "+ 1 for a chain of drafts (speculative_eagle_topk 1): set one of them"
        )
    steps = steps if steps is not None else (tokens - 1 if tokens else DEFAULT_DRAFT_STEPS)
    object.__setattr__(args, "speculative_num_steps", steps)
    object.__setattr__(args, "speculative_num_draft_tokens", steps + 1)
    for f in dataclasses.fields(args):
        if f.name.startswith("speculative_ngram_") and getattr(args, f.name) != f.default:
            raise ValueError(f"{f.name} applies to speculative_algorithm='NGRAM', not STANDALONE")
