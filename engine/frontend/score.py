"""score(), the caller's half: the probabilities of label tokens right after (query + item), as
SGLang's Engine.score.

Each item becomes one prefill-only request (max_new_tokens 0) of query + item (item + query with
`item_first`) that carries `label_token_ids`. At the step that completes its prompt, the model
runner's logits step takes the log-softmax over the whole vocabulary of the last position's
logits and keeps the label ids' values (engine/runner/logits_step.py). Then, here, as SGLang:
`apply_softmax` renormalizes over the label tokens only (a softmax of their logprobs, which is
the softmax of their logits); otherwise each label's logprob is exponentiated — its probability
among the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from engine.frontend.input_processor import GenerateCall, InputProcessor


@dataclass
class ScoreResult:
    scores: list[list[float]]  # per item, one probability per label token id, in their order
    prompt_tokens: int  # tokens of every (query + item) prompt together


def make_score_call(
    inputs: InputProcessor,
    query: str | list[int] | None,
    items: str | list[str] | list[list[int]] | None,
    label_token_ids: list[int] | None,
    item_first: bool,
) -> GenerateCall:
    """Validate a score() call and build one request per item; raises ValueError naming the field."""
    if query is None:
        raise ValueError("query must be given: a str or a list of token ids.")
    if items is None:
        raise ValueError("items must be given: a str, a list of str, or a list of token-id lists.")
    _check_label_ids(label_token_ids, inputs.config.vocab_size)
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise ValueError("items must be a non-empty list (or one str).")
    params = {"max_new_tokens": 0}
    if isinstance(query, str) and all(isinstance(i, str) for i in items):
        prompts = [item + query if item_first else query + item for item in items]
        call = inputs.make_call(prompts, None, params, False, None, None, None)
    elif _is_ids(query) and all(isinstance(i, list) and _is_ids(i) for i in items):
        ids = [item + query if item_first else query + item for item in items]
        call = inputs.make_call(None, ids, params, False, None, None, None)
    else:
        raise ValueError(
            "query and items must both be text (a str and a list of str) or both token ids "
            "(a list of int and a list of int lists)."
        )
    labels = list(label_token_ids)
    call.requests = [dataclasses.replace(r, label_token_ids=labels) for r in call.requests]
    return call


def score_result(results: list[dict[str, Any]], apply_softmax: bool) -> ScoreResult:
    scores = []
    for result in results:
        logprobs = result["label_logprobs"]
        if apply_softmax:
            top = max(logprobs)
            weights = [math.exp(x - top) for x in logprobs]
            scores.append([w / sum(weights) for w in weights])
        else:
            scores.append([math.exp(x) for x in logprobs])
    return ScoreResult(scores, sum(r["meta_info"]["prompt_tokens"] for r in results))


def _check_label_ids(label_token_ids: Any, vocab_size: int) -> None:
    if not isinstance(label_token_ids, list) or not label_token_ids or not _is_ids(label_token_ids):
        raise ValueError("label_token_ids must be a non-empty list of int token ids.")
    bad = [t for t in label_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"label_token_ids contain token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )
