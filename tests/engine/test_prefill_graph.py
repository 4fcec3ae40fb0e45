"""Prefill CUDA graphs compute what the eager prefill computes.

On the CPU the graphs' forwards run eagerly over their static buffers (`capture=False`), on the
Triton kernels under the interpreter: the padding request that owns the padded tokens, the tile
table with its filler rows, the static per-request columns and the logits of the right rows are
what these tests check. The captured graphs themselves run in tests/engine/test_gpu_path.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.runner.prefill_graph import PrefillCudaGraphs, prefill_capture_sizes
from tests.engine.core import InProcessCore
from tests.tiny_models import hf_greedy, random_prompts, special_token_ids

# NOTE: two tokens: the first from the prefill's logits, the second from a decode step that
# reads every KV entry the (padded) prefill wrote, the cached stem's included; later decode
# steps would read only what decode wrote, which is not these tests' subject
NEW = 2
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
# prefill steps of at most 64 tokens, prompts in chunks of 24: token counts of every bucket.
# NOTE: 16 request rows (the default is 256) still hold all 9 prompts at once; the graphs'
# tile tables, sized for the most requests a step can have, then carry filler rows for 17
# requests instead of 257 (still far more than a step fills): each is a program the
# interpreter runs
ARGS = dict(
    dtype="float32",
    attention_backend="triton",
    max_total_tokens=4096,
    chunked_prefill_size=24,
    max_prefill_tokens=64,
    max_running_requests=16,
)


def test_capture_sizes_pad_at_most_a_quarter_above_1024():
    for max_tokens in (1, 16, 100, 1024, 8192, 16384, 20000):
        sizes = prefill_capture_sizes(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
        assert all(b <= 1.25 * a for a, b in zip(sizes, sizes[1:]) if a >= 1024)
    assert prefill_capture_sizes(16384)[:5] == [16, 32, 64, 128, 256]


@pytest.fixture(scope="module")
def prompts():
    stem = random_prompts(512, [40], seed=5, avoid_ids=special_token_ids())[0]
    others = random_prompts(512, [1, 3, 17, 29, 50, 70], seed=6, avoid_ids=special_token_ids())
    # the stem's requests find it cached (a prefix in the table, extend tokens after it)
    return others + [stem + [7], stem + [8, 9, 10], stem[:30] + [11] * 5]


@pytest.fixture(scope="module")
def hf_tokens(llama_dir, prompts):
    """transformers' greedy tokens of each prompt (once for the module's two tests)."""
    return [hf_greedy(llama_dir, p, NEW)[0] for p in prompts]


def static_core(model_dir, max_tokens: int) -> tuple[InProcessCore, list[int]]:
    """A core whose prefill steps run PrefillCudaGraphs' forwards without capture; the list
    collects the (tokens, padded) of each replay."""
    core = InProcessCore(model_dir, **ARGS)
    runner = core.scheduler.runner
    graphs = PrefillCudaGraphs(
        runner.forward_hidden, runner.attn_backend, runner.kv_pool, runner.req_to_token,
        runner.config.hidden_size, torch.float32, max_tokens,
        max_requests=runner.req_to_token.padding_row + 1, capture=False,
    )  # fmt: skip
    replays: list[tuple[int, int]] = []
    replay = graphs.replay

    def counting(batch):
        tokens = batch.input_ids.shape[0]
        replays.append((tokens, graphs.padded_size(tokens)))
        return replay(batch)

    graphs.replay = counting
    runner.prefill_graphs = graphs
    return core, replays


def generate(core: InProcessCore, prompts, input_logprobs: bool) -> list:
    """Finished Reqs; with input_logprobs, each asks for the logprob of every prompt token (so
    every prompt row's logits are computed, and none of its prompt comes from the cache)."""
    start = 0 if input_logprobs else None
    call = core.inputs.make_call(None, prompts, GREEDY, True, start, None, None)
    reqs = [core.scheduler.add_request(r) for r in call.requests]
    while core.scheduler.has_work():
        core.scheduler.step()
    return reqs


def test_padded_static_prefill_equals_eager_and_transformers(llama_dir, prompts, hf_tokens):
    eager = InProcessCore(llama_dir, **ARGS)
    core, replays = static_core(llama_dir, max_tokens=64)
    for input_logprobs in (False, True):
        want = generate(eager, prompts, input_logprobs)
        got = generate(core, prompts, input_logprobs)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.output_ids == w.output_ids, f"prompt {i}"
            torch.testing.assert_close(
                torch.tensor(g.output_logprobs), torch.tensor(w.output_logprobs)
            )
            if input_logprobs:  # every prompt row's logits, gathered from the hidden states
                assert len(g.input_logprobs) == len(prompts[i])
                torch.testing.assert_close(
                    torch.tensor(g.input_logprobs[1:]), torch.tensor(w.input_logprobs[1:])
                )
        if not input_logprobs:
            assert core.scheduler.stats.prefill_tokens_cached > 0
            assert [r.output_ids for r in got] == hf_tokens
    assert any(padded > tokens for tokens, padded in replays), "no step was padded"
    assert len({padded for _, padded in replays}) >= 2, replays
    # the padding request kept the padded rows finite (they share the graph's layers and slot 0)
    assert core.scheduler.runner.prefill_graphs.hidden[: replays[-1][1]].isfinite().all()


def test_steps_beyond_the_largest_graph_run_eagerly(llama_dir, prompts, hf_tokens):
    core, replays = static_core(llama_dir, max_tokens=32)
    outs = core.run(prompts, GREEDY)
    assert outs == hf_tokens
    assert replays and all(tokens <= 32 for tokens, _ in replays)
    assert core.scheduler.stats.prefill_steps > len(replays), "no step ran eagerly"
