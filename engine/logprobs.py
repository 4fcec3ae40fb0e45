"""Log-probabilities for meta_info: of the chosen tokens, and the top-k alternatives.

They are the model's log-softmax at temperature 1, before temperature / top-k / top-p
filtering, as SGLang reports them by default.
"""

from __future__ import annotations

import torch

TopLogprobs = tuple[list[float], list[int]]


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[float]:
    """logprobs [R, V], token_ids [R] -> the logprob of each row's token."""
    return logprobs.gather(1, token_ids.view(-1, 1)).view(-1).tolist()


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[TopLogprobs]:
    """The k most probable tokens of each row, as (values, ids), most probable first."""
    if k <= 0:
        return [([], []) for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return list(zip(values.tolist(), ids.tolist()))
