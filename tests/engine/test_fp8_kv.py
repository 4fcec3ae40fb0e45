"""A float8 KV cache end to end, against transformers with K and V rounded through float8.

The reference is independent of the engine: transformers runs the same folder with an
attention function (registered with its AttentionInterface) that rounds the keys and values
it is given, the whole cache at every step, as fp8(clamp(x / scale)) * scale, then calls the
eager attention; nothing of the engine's quantization code is used. That is exactly what the
engine computes (it stores each token's K/V rounded once and reads them back dequantized), so
with the torch backend in bfloat16 the tokens and logprobs come out bit for bit the same on this
machine. The tolerances below only leave room for a different CPU's summation order; the plain
(unrounded) reference differs by far more, which shows that the cache really is float8.
"""

from __future__ import annotations

import pytest
import torch

import engine.runner.model_runner as model_runner
from engine import Engine
from engine.layers.attention import attention_layers
from tests.engine.core import InProcessCore
from tests.tiny_models import make_tiny_model, random_prompts, special_token_ids

MAX_NEW = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
# NOTE: the engine here takes token ids and is checked on tokens and logprobs: without a
# tokenizer (skip_tokenizer_init) its detokenizer skips an import of transformers, about 5 of
# the 8 CPU-seconds of a start; the cache it quantizes does not depend on it
IDS_ONLY = {"skip_tokenizer_init": True}
LENGTHS = [1, 5, 40, 120, 250]
# |engine - reference| of a logprob in bfloat16, torch backend (measured: 0)
LOGPROB_TOL = 1e-3
# the least the unrounded reference must differ by somewhere (measured: 0.07 to 0.3)
FP8_SHOWS = 0.02
# float16 (the interpreter's tl.dot is wrong for bfloat16): the torch backend computes what
# eager attention does (measured: 0); the kernels accumulate in float32 where eager rounds
# scores and probabilities to float16 (measured: 0.039 here, and 0.011 for the same kernels
# on a float16 cache; the kernels themselves are within 3e-4 of float64, tests/kernels)
FLOAT16_TOL = {"torch": 1e-3, "triton": 0.06}


# The first rows of the sequence whose queries attend over unrounded K/V in
# `fp8_rounded_attention`: on the triton backend, a prompt with nothing cached attends over its
# own K/V of the step that prefills it (its first chunk) as they are, not through the pool.
# With "qk" (prefill_attention_fp8="qk") every prompt row multiplies q and k in float8 instead,
# q rounded with a scale per (token, head): the first chunk's rows over k at the layer's scale
# and v as it is, the later chunks' (the first "prompt" rows) over the float8 cache.
_FRESH_ROWS = {"rows": 0, "qk": False, "prompt": 0}


def fp8_rounded_attention(fp8: torch.dtype, scales: dict[int, tuple[float, float]]) -> str:
    """Register (once) an attention function that rounds K and V through ``fp8`` with each
    layer's (k_scale, v_scale) (1.0 where not given) before the eager attention, but for the
    first ``_FRESH_ROWS["rows"]`` queries; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    name = f"test_fp8_{str(fp8).split('_')[-1]}_" + "_".join(
        f"{i}-{k}-{v}" for i, (k, v) in sorted(scales.items())
    )
    limit = torch.finfo(fp8).max

    def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
        s = torch.tensor(scale, dtype=torch.float32)  # the scale as the engine holds it
        return ((x.float() / s).clamp(-limit, limit).to(fp8).float() * s).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        out, weights = eager_attention_forward(
            module, query, rounded(key, k_scale), rounded(value, v_scale), attention_mask, **kwargs
        )
        fresh = _FRESH_ROWS["rows"]
        if fresh and _FRESH_ROWS["qk"]:  # the prompt's rows: float8 q ([B, H, T, D] in)
            row_scale = (query.float().abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
            q8 = (query.float() / row_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            q8 = (q8.float() * row_scale).to(value.dtype)
            key8, value8 = rounded(key, k_scale), rounded(value, v_scale)
            first, _ = eager_attention_forward(module, q8, key8, value, attention_mask, **kwargs)
            later, _ = eager_attention_forward(module, q8, key8, value8, attention_mask, **kwargs)
            prompt = _FRESH_ROWS["prompt"]
            out = torch.cat([first[:, :fresh], later[:, fresh:prompt], out[:, prompt:]], dim=1)
        elif fresh:  # those queries attend over the unrounded K/V ([B, T, H, D] out)
            plain, _ = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
            out = torch.cat([plain[:, :fresh], out[:, fresh:]], dim=1)
        return out, weights

    AttentionInterface.register(name, attention)
    # NOTE: without a mask function of its own, transformers builds no mask at all for a
    # custom attention (no causal mask: every prompt token would see the later ones)
    AttentionMaskInterface.register(name, eager_mask)
    return name


@torch.no_grad()
def hf_greedy_with(model_dir, prompt: list[int], dtype: torch.dtype, attn: str):
    """transformers' greedy tokens and each step's float32 log-softmax, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    model.eval().generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, min_new_tokens=None,
        do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=None,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), logprobs


@torch.no_grad()
def teacher_forced(model_dir, prompt: list[int], tokens: list[int], dtype: torch.dtype, attn: str):
    """transformers' float32 log-softmax at each of ``tokens`` after ``prompt`` and the tokens
    before it (one forward over the whole sequence), in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    logits = model.eval()(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), -1)


def largest_gap(outputs: list[tuple[list[int], list[float]]], refs) -> float:
    """The largest |logprob - the reference's logprob of the same token| over the steps up to
    the first token that differs (its context is still the reference's)."""
    gap = 0.0
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(outputs, refs):
        for token, ref_token, lp, ref in zip(tokens, ref_tokens, logprobs, ref_logprobs):
            gap = max(gap, abs(lp - ref[token].item()))
            if token != ref_token:
                break
    return gap


def engine_outputs(outs: list[dict]) -> list[tuple[list[int], list[float]]]:
    return [
        (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        for o in outs
    ]


def test_engine_on_a_float8_cache_equals_transformers_on_rounded_kv(llama_dir):
    """bfloat16 model, float8_e4m3fn cache, torch backend: tokens and logprobs of the rounded
    reference, then the same prompts again, read from the prefix cache."""
    prompts = random_prompts(512, LENGTHS, seed=11, avoid_ids=special_token_ids())
    fp8_attn = fp8_rounded_attention(torch.float8_e4m3fn, {})
    refs = [hf_greedy_with(llama_dir, p, torch.bfloat16, fp8_attn) for p in prompts]
    plain = [hf_greedy_with(llama_dir, p, torch.bfloat16, "eager") for p in prompts]
    # NOTE: on the CPU, as the reference: bit for bit only holds for the same machine's sums
    args = dict(
        dtype="bfloat16", attention_backend="torch", kv_cache_dtype="fp8_e4m3", device="cpu"
    )
    with Engine(model_path=str(llama_dir), max_total_tokens=4096, **args, **IDS_ONLY) as engine:
        assert engine.get_server_info()["kv_cache_dtype"] == "fp8_e4m3"
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        again = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)

    tol = LOGPROB_TOL
    for outs in (first, again):
        got = engine_outputs(outs)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in refs]
        assert largest_gap(got, refs) <= tol
    assert largest_gap(engine_outputs(first), plain) > FP8_SHOWS
    # the second run's prompts came from the cache: their K/V read back as float8
    cached = [o["meta_info"]["cached_tokens"] for o in again]
    assert all(c >= n - 1 for c, n in zip(cached, LENGTHS) if n > 1), cached
    assert sum(cached) > 0


def test_float8_pool_takes_half_the_bytes(llama_dir):
    pools = {}
    for kv in ("auto", "fp8_e5m2"):
        core = InProcessCore(llama_dir, dtype="bfloat16", kv_cache_dtype=kv, max_total_tokens=512)
        pools[kv] = core.scheduler.runner.kv_pool
    assert pools["auto"].dtype == torch.bfloat16 and pools["fp8_e5m2"].dtype == torch.float8_e5m2
    assert pools["auto"].num_tokens == pools["fp8_e5m2"].num_tokens
    assert 2 * pools["fp8_e5m2"].nbytes() == pools["auto"].nbytes()


# a checkpoint's K/V scales per layer: K here spans about ±2, V ±1 (none of them a power of two,
# so each rounds differently from a unit scale)
SCALES = {0: (0.013, 0.0071), 1: (0.021, 0.0093)}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_checkpoint_scales_reach_the_cache(llama_dir, monkeypatch, backend):
    """Scales the loader sets on the attention layers go to the pool when it is made, and
    both backends quantize and read with them (float16 model, float8_e5m2 cache; triton under
    the interpreter here, its V grouped: kernels/v_groups.py), with prefill chunks of 16 tokens
    and a shared stem: extends over cached float8 prefixes (and on triton, a fresh prompt's
    first chunk over its unrounded K/V: the reference's first rows then attend unrounded). Teacher-forced: the reference scores the engine's own tokens,
    each of which must be its greedy choice up to a near tie (float16 runs differ that much)."""
    load_model = model_runner.load_model

    def load_with_scales(*args, **kwargs):
        model = load_model(*args, **kwargs)
        for layer in attention_layers(model):
            layer.k_scale, layer.v_scale = SCALES[layer.layer_id]
        return model

    monkeypatch.setattr(model_runner, "load_model", load_with_scales)
    core = InProcessCore(
        llama_dir, dtype="float16", attention_backend=backend, kv_cache_dtype="fp8_e5m2",
        max_total_tokens=1024, chunked_prefill_size=16,
    )  # fmt: skip
    pool = core.scheduler.runner.kv_pool
    # the triton backend's float8 pool holds V in groups of 16 token-major slots (pages of 16)
    assert pool.grouped_v == (backend == "triton") and pool.page_size == (
        16 if pool.grouped_v else 1
    )
    f32 = [[torch.tensor(s, dtype=torch.float32).item() for s in SCALES[i]] for i in (0, 1)]
    assert pool.scales.tolist() == f32

    stem = random_prompts(512, [40], seed=12, avoid_ids=special_token_ids())[0]
    prompts = random_prompts(512, [1, 23], seed=13, avoid_ids=special_token_ids())
    prompts += [stem + [5], stem + [6, 7]]
    # one prompt at a time, so a prompt's first chunk is the first 16 tokens (or all of it)
    reqs = [core.generate([p], GREEDY, return_logprob=True)[0] for p in prompts]
    assert core.scheduler.stats.prefill_tokens_cached > 0

    fp8_attn = fp8_rounded_attention(torch.float8_e5m2, SCALES)
    gaps, ties, plain_gaps = [], [], []
    for prompt, req in zip(prompts, reqs):
        # triton: a prompt's first chunk (16 tokens) read its K/V unrounded when it was first
        # prefilled; a cached stem was first prefilled that way too, by the prompt before
        monkeypatch.setitem(_FRESH_ROWS, "rows", min(16, len(prompt)) if backend == "triton" else 0)
        ref = teacher_forced(llama_dir, prompt, req.output_ids, torch.float16, fp8_attn)
        plain = teacher_forced(llama_dir, prompt, req.output_ids, torch.float16, "eager")
        for token, lp, r, p in zip(req.output_ids, req.output_logprobs, ref, plain):
            gaps.append(abs(lp - r[token].item()))
            ties.append(r.max().item() - r[token].item())  # 0: the reference's greedy token
            plain_gaps.append(abs(lp - p[token].item()))
    tol = FLOAT16_TOL[backend]
    assert max(gaps) <= tol and max(ties) <= tol, (max(gaps), max(ties))
    assert max(plain_gaps) > 4 * tol, max(plain_gaps)


def test_fresh_prompts_on_float8_products_equal_transformers_on_rounded_q_and_k(
    llama_dir, tmp_path, monkeypatch
):
    """prefill_attention_fp8="qk" (float16 model, float8_e4m3fn cache, triton under the
    interpreter, prefill chunks of 16): every prompt row multiplies q and k in float8 (q rounded
    per token and head), the first chunk's over its own k at the layer's scale, the later
    chunks' over the float8 cache; decode steps read the cache as without it. Teacher-forced
    against transformers rounding the same. A float8 dot is at least 32 deep: head_dim 32
    (llama_dir's 16 is refused, naming the setting)."""
    import engine.attention.triton_backend as triton_backend

    fp8_args = dict(
        dtype="float16", attention_backend="triton", kv_cache_dtype="fp8_e4m3",
        max_total_tokens=1024, chunked_prefill_size=16, prefill_attention_fp8="qk",
    )  # fmt: skip
    with pytest.raises(ValueError, match="prefill_attention_fp8='qk' needs a head_dim of at le"):
        InProcessCore(llama_dir, **fp8_args)
    model_dir = make_tiny_model(tmp_path, "llama", head_dim=32, seed=15)

    modes: dict[str, list] = {"prefill_attention": [], "extend_attention": []}

    def spy(real, seen: list):
        def call(*args, **kwargs):
            seen.append(kwargs.get("fp8"))
            return real(*args, **kwargs)

        return call

    for name, seen in modes.items():
        monkeypatch.setattr(triton_backend, name, spy(getattr(triton_backend, name), seen))
    core = InProcessCore(model_dir, **fp8_args)
    prompts = random_prompts(512, [1, 23, 40], seed=14, avoid_ids=special_token_ids())
    reqs = [core.generate([p], GREEDY, return_logprob=True)[0] for p in prompts]
    # first chunks on the one kernel, later ones on the other: both multiply in float8
    assert all(seen and set(seen) == {"qk"} for seen in modes.values()), modes

    fp8_attn = fp8_rounded_attention(torch.float8_e4m3fn, {})
    monkeypatch.setitem(_FRESH_ROWS, "qk", True)
    gaps, ties = [], []
    for prompt, req in zip(prompts, reqs):
        monkeypatch.setitem(_FRESH_ROWS, "rows", min(16, len(prompt)))
        monkeypatch.setitem(_FRESH_ROWS, "prompt", len(prompt))
        ref = teacher_forced(model_dir, prompt, req.output_ids, torch.float16, fp8_attn)
        for token, lp, r in zip(req.output_ids, req.output_logprobs, ref):
            gaps.append(abs(lp - r[token].item()))
            ties.append(r.max().item() - r[token].item())
    tol = FLOAT16_TOL["triton"]
    assert max(gaps) <= tol and max(ties) <= tol, (max(gaps), max(ties))


def test_float8_prefill_products_need_a_float8_cache_on_triton():
    from engine.server_args import _TABLE, ServerArgs
    from kernels.extend_attention import FP8_MODES

    # the setting's values are the kernel's modes
    assert _TABLE["prefill_attention_fp8"].choices == FP8_MODES
    with pytest.raises(ValueError, match="prefill_attention_fp8 needs a float8 kv_cache_dtype"):
        ServerArgs(model_path="m", prefill_attention_fp8="qk", attention_backend="triton")
    with pytest.raises(ValueError, match="did you mean 'qk_pv'"):
        ServerArgs(model_path="m", prefill_attention_fp8="qk-pv", kv_cache_dtype="fp8_e4m3")
