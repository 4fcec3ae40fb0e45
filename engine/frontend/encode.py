"""encode(): validate an embedding call and build its requests (prefill-only, pooled, not sampled).

An embedding request is a generation request with max_new_tokens 0 that the embedding scheduler
(engine/scheduler/embedding.py) runs as one forward and answers with its pooled hidden state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.frontend.input_processor import GenerateCall, InputProcessor


def make_encode_call(
    inputs: InputProcessor, prompt: Any, dimensions: Any, rid: str | list[str] | None
) -> GenerateCall:
    size = inputs.config.hidden_size
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool):
            raise ValueError(f"dimensions must be an int, got {type(dimensions).__name__}.")
        if not 1 <= dimensions <= size:
            raise ValueError(
                f"dimensions must be between 1 and the model's embedding size {size}, got {dimensions}."
            )
        allowed = inputs.config.hf.get("matryoshka_dimensions")
        if allowed and dimensions not in allowed:
            raise ValueError(
                f"dimensions must be one of the model's matryoshka_dimensions {allowed}, got {dimensions}."
            )
    if isinstance(prompt, list) and prompt and not all(isinstance(p, str) for p in prompt):
        raise ValueError("prompt must be a str or a list of str.")
    call = inputs.make_call(prompt, None, {"max_new_tokens": 0}, False, None, None, rid)
    call.requests = [dataclasses.replace(r, embed_dimensions=dimensions) for r in call.requests]
    return call
