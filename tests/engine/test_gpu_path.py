"""The GPU fast path (Triton kernels, CUDA graphs, overlap scheduling) computes what the
CPU reference path computes: greedy tokens identical in float32, bf16 logprobs close to
transformers'. Decode batch sizes sweep every value from the batch down to 1 as requests end,
so every captured graph size and every amount of padding is replayed."""

from __future__ import annotations

import time

import pytest
import torch

from engine import Engine
from engine.frontend.input_processor import InputProcessor
from engine.model_config import ModelConfig
from engine.scheduler.device_idle import DeviceIdleClock
from engine.scheduler.scheduler import Scheduler
from engine.server_args import ServerArgs
from tests.engine.core import InProcessCore
from tests.tiny_models import random_prompts, special_token_ids

LENGTHS = [1, 2, 5, 9, 17, 31, 47, 64, 80, 99, 120, 160, 200, 250] * 3  # 42 prompts


@pytest.fixture(scope="module")
def workload():
    prompts = random_prompts(512, LENGTHS, seed=21, avoid_ids=special_token_ids())
    # one request ends after each step, so the decode batch takes every size from 42 to 1
    params = [
        {"temperature": 0.0, "max_new_tokens": 2 + i, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    return prompts, params


@pytest.fixture(scope="module")
def cpu_reference(llama_dir, workload):
    prompts, params = workload
    return InProcessCore(llama_dir, dtype="float32").run(prompts, params)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"disable_cuda_graph": True},
        {"disable_overlap_schedule": True},
        # prefill steps of many token counts (prompts in chunks of 64, each over the request's
        # earlier chunks): most small buckets of the prefill graphs, each padded differently
        {"chunked_prefill_size": 64, "max_prefill_tokens": 300},
        {"prefill_cuda_graph_max_tokens": 0},
    ],
    ids=["graphs+overlap", "eager", "no-overlap", "prefill-graphs", "decode-graphs-only"],
)
def test_gpu_greedy_equals_cpu_reference(llama_dir, workload, cpu_reference, flags):
    prompts, params = workload
    # a small pool: several test engines may share the GPU (pytest-xdist)
    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=16384, **flags
    ) as engine:
        assert engine.get_server_info()["device"].startswith("cuda")
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    for i, (out, ref) in enumerate(zip(outs, cpu_reference)):
        assert out["output_ids"] == ref, f"prompt {i} ({len(prompts[i])} tokens)"


@pytest.mark.gpu
def test_gpu_long_prompts_over_gathered_runs(tmp_path_factory):
    """Prompts of 1,200-3,100 tokens in chunks of 1024 (GATHER_MIN_NEW): each later chunk
    attends over its earlier chunks gathered out of the pool (kernels/context_gather.py), in
    eager steps between graph-replayed ones; greedy tokens as the CPU reference's."""
    from engine.attention.extend_plan import GATHER_MIN_NEW
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("llama_8k"), "llama",
                            max_position_embeddings=8192)  # fmt: skip
    prompts = random_prompts(512, [2500, 3100, 1200], seed=5, avoid_ids=special_token_ids())
    params = [{"temperature": 0.0, "max_new_tokens": 4 + i, "ignore_eos": True} for i in range(3)]
    ref = InProcessCore(model, dtype="float32").run(prompts, params)
    flags = {"chunked_prefill_size": GATHER_MIN_NEW, "max_prefill_tokens": 2 * GATHER_MIN_NEW}
    with Engine(model_path=str(model), dtype="float32", max_total_tokens=16384, **flags) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [out["output_ids"] for out in outs] == ref


def test_graph_sizes_cover_the_batch():
    from engine.runner.cuda_graph import capture_sizes

    for max_bs in (1, 3, 42, 160, 256, 300, 1024, 1500):
        sizes = capture_sizes(max_bs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_bs and sizes[0] == 1
        assert all(b <= 1.25 * a for a, b in zip(sizes, sizes[1:]) if a >= 256)


@pytest.mark.gpu
def test_bf16_logprobs_close_to_transformers(qwen3_dir, workload):
    """Teacher-forced: transformers in bf16 on the GPU scores the engine's own tokens."""
    from transformers import AutoModelForCausalLM

    prompts, _ = workload
    prompts = prompts[:12]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(model_path=str(qwen3_dir), dtype="bfloat16", max_total_tokens=16384) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.bfloat16).cuda().eval()
    diffs = []
    for prompt, out in zip(prompts, outs):
        seq = torch.tensor([prompt + out["output_ids"]], device="cuda")
        with torch.no_grad():
            logits = model(seq).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        for step, (value, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            diffs.append(abs(value - lp[len(prompt) - 1 + step, token].item()))
    diffs = torch.tensor(diffs)
    # bf16 rounds logits to ~3 significant digits; different kernels round differently
    assert diffs.max() < 0.15 and diffs.mean() < 0.03, (diffs.max(), diffs.mean())


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A random BERT saved as a sentence-transformers model: mean pooling, then Normalize."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    out = tmp_path_factory.mktemp("tiny_bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + sorted(set(WORDS))
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(out / "vocab.txt")).save_pretrained(out)
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128)  # fmt: skip
    torch.manual_seed(0)
    BertModel(config, add_pooling_layer=False).save_pretrained(out)
    modules = [models.Transformer(str(out)), models.Pooling(64, "mean"), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(out / "st"))
    return out / "st"


WORDS = "seven curious otters build bridges across cold mountain streams at dawn".split()


@pytest.mark.gpu
def test_bert_embeddings_on_the_gpu_match_sentence_transformers(tiny_bert_dir):
    import random

    from sentence_transformers import SentenceTransformer

    rng = random.Random(0)
    sentences = [" ".join(rng.choices(WORDS, k=rng.randint(1, 60))) + "." for _ in range(40)]
    ref = SentenceTransformer(str(tiny_bert_dir), device="cpu").encode(
        sentences, convert_to_tensor=True
    )
    with Engine(model_path=str(tiny_bert_dir), is_embedding=True, dtype="float32") as engine:
        assert engine.get_server_info()["device"].startswith("cuda")
        outs = engine.encode(sentences[:7]) + engine.encode(sentences[7:])
    got = torch.tensor([o["embedding"] for o in outs], dtype=torch.float64)
    cos = torch.nn.functional.cosine_similarity(got, ref.double(), dim=-1)
    assert cos.min() >= 0.9999, (cos.argmin().item(), cos.min().item())


@pytest.mark.gpu
def test_device_idle_reads_a_gap_once_its_events_have_passed():
    """A step that copies nothing back (a long prompt's middle chunk) is collected before its
    device work has run: its gap is kept and read later (CUDA refuses the time of an event that
    has not passed), then a host delay between steps is read as device idle time."""
    clock = DeviceIdleClock(torch.device("cuda"))
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device work: the previous step
    clock.launched(None)
    gap = clock.around_launch()  # queued at once behind it
    assert clock.seconds(gap) == 0.0 and not gap[1].query()  # kept, not read
    assert 0.0 <= clock.idle() < 0.01  # read once passed: back to back
    clock.launched(None)
    time.sleep(0.05)  # the host late with the next step
    gap = clock.around_launch()
    torch.cuda.synchronize()
    assert 0.04 <= clock.seconds(gap) <= 0.2


@pytest.mark.gpu
def test_device_idle_is_the_host_time_between_steps(llama_dir, workload):
    """A delay injected before each step's planning leaves the device idle for about that long
    per step (the tiny model's steps take far less); without it, the device idles much less."""
    prompts, params = workload
    delay = 0.02

    def idle_and_steps(pause: float) -> tuple[float, int]:
        args = ServerArgs.from_kwargs(
            model_path=str(llama_dir), dtype="float32", max_total_tokens=16384
        )
        config = ModelConfig.from_folder(args.model_path, args.dtype, args.context_length)
        sched = Scheduler(args, config, torch.device("cuda"))
        inputs = InputProcessor(args, config, None, sched.max_total_tokens)
        schedule = sched._schedule
        sched._schedule = lambda: time.sleep(pause) or schedule()
        for request in inputs.make_call(None, prompts, params, False, None, None, None).requests:
            sched.add_request(request)
        while sched.has_work():
            sched.step()
        s = sched.stats
        return s.device_idle_seconds, s.prefill_steps + s.decode_steps

    idle, steps = idle_and_steps(delay)
    assert delay * (steps - 1) * 0.9 <= idle <= delay * steps + 0.5
    quick, _ = idle_and_steps(0.0)
    assert quick < idle / 4
