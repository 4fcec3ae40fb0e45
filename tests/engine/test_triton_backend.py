"""The engine on the Triton attention backend gives transformers' greedy tokens (CPU: under the interpreter)."""

from __future__ import annotations

import pytest

from tests.engine.core import InProcessCore
from tests.tiny_models import hf_greedy, random_prompts, special_token_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_equals_transformers(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    stem = random_prompts(512, [40], seed=3, avoid_ids=special_token_ids())[0]
    prompts = random_prompts(512, [1, 9, 33], seed=4, avoid_ids=special_token_ids()) + [
        stem + [5],
        stem + [6, 7],
    ]
    # chunks of 16 and a shared stem: extend over cached prefixes, then decode, all on the kernels
    core = InProcessCore(
        model_dir,
        dtype="float32",
        max_total_tokens=2048,
        attention_backend="triton",
        chunked_prefill_size=16,
    )
    outs = core.run(prompts, GREEDY)
    assert outs == [hf_greedy(model_dir, p, 8)[0] for p in prompts]
    assert core.scheduler.stats.prefill_tokens_cached > 0
