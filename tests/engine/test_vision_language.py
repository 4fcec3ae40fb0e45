"""generate(image_data=...) on a tiny random Qwen2.5-VL, against transformers (float32) on the
same folder: greedy tokens and logprobs with 1 and 3 images a prompt beside text-only prompts in
one batch, the prefix cache on a repeated and on a different image, streaming and n > 1, and
every kind of bad input."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from engine import Engine
from tests.tiny_models import IMAGE_PAD, VISION_END, VISION_START, make_tiny_vl_model

MAX_NEW = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_vl_model(tmp_path_factory.mktemp("tiny-qwen2_5_vl"))


@pytest.fixture(scope="module")
def hf(vl_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        vl_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # (the PIL path, as the engine's: where torchvision is installed, transformers' default
    # image processor resizes otherwise)
    return model, Qwen2VLImageProcessorPil.from_pretrained(vl_dir), build_vl_tokens(vl_dir)


def build_vl_tokens(folder) -> dict[str, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END)}


@pytest.fixture(scope="module")
def engine(vl_dir):
    with Engine(model_path=str(vl_dir), dtype="float32", max_total_tokens=8192) as engine:
        yield engine


def picture(height: int, width: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def prompt_ids(tokens: dict[str, int], images: int, seed: int, length: int = 12) -> list[int]:
    """Random text with `images` image slots spread through it (one token each)."""
    rng = np.random.default_rng(seed)
    text = rng.integers(10, 500, length).tolist()
    slot = [tokens[VISION_START], tokens[IMAGE_PAD], tokens[VISION_END]]
    ids = []
    cut = sorted(rng.choice(np.arange(1, length), images, replace=False).tolist())
    for start, end in zip([0, *cut], [*cut, length]):
        ids += text[start:end] + (slot if end != length else [])
    return ids


def hf_greedy(hf, ids: list[int], images: list) -> tuple[list[int], torch.Tensor, list[int]]:
    """transformers' greedy tokens (no KV cache: every step a full forward), the log-softmax of
    every position of prompt + output, and the expanded prompt."""
    model, processor, tokens = hf
    kwargs, expanded = {}, list(ids)
    if images:
        pixels = processor(images=images, return_tensors="pt")
        grid = pixels["image_grid_thw"]
        counts = (grid.prod(-1) // 4).tolist()
        expanded, k = [], 0
        for t in ids:
            if t == tokens[IMAGE_PAD]:
                expanded += [t] * counts[k]
                k += 1
            else:
                expanded.append(t)
        kwargs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": grid}
    seq = list(expanded)

    def forward(seq: list[int]) -> torch.Tensor:
        ids = torch.tensor([seq])
        # NOTE: without mm_token_type_ids (1: an image token) transformers 5 falls back to
        # plain positions for every token instead of M-RoPE's
        types = (ids == tokens[IMAGE_PAD]).int() if images else None
        return model(input_ids=ids, mm_token_type_ids=types, **kwargs).logits[0]

    with torch.no_grad():
        for _ in range(MAX_NEW):
            seq.append(int(forward(seq)[-1].argmax()))
        logits = forward(seq)
    return seq[len(expanded) :], torch.log_softmax(logits.float(), -1), expanded


def test_greedy_and_logprobs_equal_transformers(engine, hf):
    tokens = hf[2]
    cases = [  # (prompt, images): one image, three (two of one size), text only, a wide one
        (prompt_ids(tokens, 1, seed=1), [picture(56, 84, 1)]),
        (prompt_ids(tokens, 3, seed=2), [picture(70, 70, 2), picture(29, 113, 3), picture(70, 70, 4)]),
        (prompt_ids(tokens, 0, seed=3), []),
        (prompt_ids(tokens, 1, seed=4, length=30), [picture(40, 250, 5)]),
    ]  # fmt: skip
    outs = engine.generate(
        input_ids=[ids for ids, _ in cases],
        image_data=[images or None for _, images in cases],
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
    )
    for i, ((ids, images), out) in enumerate(zip(cases, outs)):
        want, logprobs, expanded = hf_greedy(hf, ids, images)
        meta = out["meta_info"]
        assert out["output_ids"] == want, f"prompt {i}"
        assert meta["prompt_tokens"] == len(expanded)
        got = [lp for lp, _, _ in meta["output_token_logprobs"]]
        ref = [logprobs[len(expanded) - 1 + j, t].item() for j, t in enumerate(want)]
        assert np.allclose(got, ref, atol=LOGPROB_TOL), f"prompt {i}"
        # prompt logprobs, image tokens included (each the logprob of the image token itself)
        got_in = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
        ref_in = [logprobs[p - 1, expanded[p]].item() for p in range(1, len(expanded))]
        assert np.allclose(got_in, ref_in, atol=LOGPROB_TOL), f"prompt {i}"


def test_image_forms_give_the_same_tokens(engine, hf, tmp_path):
    """A path, bytes, base64, a data URL and a PIL image of one picture: one answer."""
    image = picture(56, 56, 9)
    path = tmp_path / "x.png"
    image.save(path)
    raw = path.read_bytes()
    b64 = base64.b64encode(raw).decode()
    forms = [str(path), raw, b64, f"data:image/png;base64,{b64}", image]
    ids = prompt_ids(hf[2], 1, seed=9)
    outs = engine.generate(input_ids=[ids] * len(forms), image_data=forms, sampling_params=GREEDY)
    want, _, _ = hf_greedy(hf, ids, [image])
    assert all(out["output_ids"] == want for out in outs)


def test_repeated_image_hits_the_prefix_cache_and_a_different_one_misses(engine, hf):
    tokens = hf[2]
    ids = prompt_ids(tokens, 1, seed=11, length=40)
    first_image = ids.index(tokens[IMAGE_PAD])
    a, b = picture(84, 84, 11), picture(84, 84, 12)  # same size: same token count
    engine.flush_cache()
    first = engine.generate(input_ids=ids, image_data=a, sampling_params=GREEDY)
    again = engine.generate(input_ids=ids, image_data=a, sampling_params=GREEDY)
    other = engine.generate(input_ids=ids, image_data=b, sampling_params=GREEDY)
    assert again["output_ids"] == first["output_ids"]
    # the whole prompt but its last token comes from the cache (36 image tokens among them)
    assert again["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 16
    # the different image: at most the text before it
    assert other["meta_info"]["cached_tokens"] <= first_image
    assert other["output_ids"] == hf_greedy(hf, ids, [b])[0]


def test_streaming_and_parallel_samples_with_an_image(engine, hf):
    ids = prompt_ids(hf[2], 1, seed=13)
    image = picture(56, 70, 13)
    want, _, _ = hf_greedy(hf, ids, [image])
    chunks = list(
        engine.generate(input_ids=ids, image_data=image, sampling_params=GREEDY, stream=True)
    )
    assert [t for c in chunks for t in c["output_ids"]] == want
    outs = engine.generate(input_ids=ids, image_data=image, sampling_params={**GREEDY, "n": 3})
    assert [out["output_ids"] for out in outs] == [want] * 3


def test_bad_image_inputs_name_the_request_and_field(engine, hf, tmp_path):
    tokens = hf[2]
    one, two = prompt_ids(tokens, 1, seed=20), prompt_ids(tokens, 2, seed=21)
    truncated = tmp_path / "cut.png"
    buffer = io.BytesIO()
    picture(56, 56, 20).save(buffer, format="PNG")
    truncated.write_bytes(buffer.getvalue()[:200])
    bad = [
        (b"not an image at all", "request 1"),
        (str(truncated), "request 1"),
        (str(tmp_path / "missing.png"), "request 1"),
        (12345, "request 1"),
    ]
    for item, where in bad:
        with pytest.raises(ValueError, match=f"{where}.*image_data"):
            engine.generate(
                input_ids=[one, one], image_data=[picture(56, 56, 1), item], sampling_params=GREEDY
            )
    with pytest.raises(ValueError, match="request 0.*image"):  # 2 images, 1 slot
        engine.generate(
            input_ids=[one], image_data=[[picture(56, 56, 1)] * 2], sampling_params=GREEDY
        )
    with pytest.raises(ValueError, match="image"):  # 1 image, 2 slots
        engine.generate(input_ids=two, image_data=picture(56, 56, 1), sampling_params=GREEDY)
    # the engine serves on
    out = engine.generate(input_ids=one, image_data=picture(56, 56, 1), sampling_params=GREEDY)
    assert len(out["output_ids"]) == MAX_NEW


def test_image_on_a_text_only_model_is_refused(llama_engine):
    with pytest.raises(ValueError, match="image_data needs a vision-language model"):
        llama_engine.generate(input_ids=[5, 6, 7], image_data=picture(56, 56, 1))


def test_chunked_prefill_cuts_through_images(vl_dir, hf):
    """Chunks of 16 tokens: images of 6 to 24 tokens start and end inside chunks, and each
    chunk finds the embeddings of its image tokens (encoded once, at the image's first chunk)."""
    tokens = hf[2]
    cases = [
        (prompt_ids(tokens, 2, seed=30, length=25), [picture(84, 84, 30), picture(56, 84, 31)]),
        (prompt_ids(tokens, 1, seed=31, length=7), [picture(98, 112, 32)]),
    ]
    with Engine(
        model_path=str(vl_dir), dtype="float32", max_total_tokens=8192, chunked_prefill_size=16
    ) as chunked:
        outs = chunked.generate(
            input_ids=[ids for ids, _ in cases],
            image_data=[images for _, images in cases],
            sampling_params=GREEDY,
        )
    for (ids, images), out in zip(cases, outs):
        assert out["output_ids"] == hf_greedy(hf, ids, images)[0]


def test_json_labels_for_images(engine, hf):
    """Structured output beside images: every answer is JSON of the (bounded) schema, and
    ends by itself (sampled: greedy, the random model would pad JSON with whitespace)."""
    import json

    pytest.importorskip("xgrammar")  # (the GPU machine has none)
    schema = {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "shape": {"enum": ["circle", "square"]},
        },
        "required": ["colour", "shape"],
        "additionalProperties": False,
    }
    ids = prompt_ids(hf[2], 1, seed=40)
    images = [picture(56, 56, 40 + k) for k in range(3)]
    params = [
        {"temperature": 1.0, "sampling_seed": k, "max_new_tokens": 200, "json_schema": json.dumps(schema)}
        for k in range(3)
    ]  # fmt: skip
    outs = engine.generate(input_ids=[ids] * 3, image_data=images, sampling_params=params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        label = json.loads(out["text"])
        assert label["colour"] in ("red", "green", "blue")
        assert label["shape"] in ("circle", "square")


@pytest.mark.gpu
def test_gpu_bf16_logprobs_close_to_transformers(vl_dir, hf):
    """Teacher-forced, as for text (tests/engine/test_gpu_path.py): transformers in bf16 on the
    GPU scores the bf16 engine's own tokens, with 1 and 3 images beside a text-only prompt, and
    the engine's decode CUDA graphs on (its default there)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokens = hf[2]
    cases = [
        (prompt_ids(tokens, 1, seed=50), [picture(56, 84, 50)]),
        (prompt_ids(tokens, 3, seed=51), [picture(70, 70, k) for k in range(51, 54)]),
        (prompt_ids(tokens, 0, seed=52), []),
    ]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(model_path=str(vl_dir), dtype="bfloat16", max_total_tokens=8192) as engine:
        outs = engine.generate(
            input_ids=[ids for ids, _ in cases],
            image_data=[images or None for _, images in cases],
            sampling_params=params,
            return_logprob=True,
        )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.bfloat16)
    model = model.cuda().eval()
    processor = hf[1]
    diffs = []
    for (ids, images), out in zip(cases, outs):
        _, _, expanded = hf_greedy(hf, ids, images)  # (its expansion of the image slots)
        seq = torch.tensor([expanded + out["output_ids"]], device="cuda")
        kwargs = {}
        if images:
            pixels = processor(images=images, return_tensors="pt")
            kwargs = {
                "pixel_values": pixels["pixel_values"].cuda(),
                "image_grid_thw": pixels["image_grid_thw"].cuda(),
                "mm_token_type_ids": (seq == tokens[IMAGE_PAD]).int(),
            }
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=seq, **kwargs).logits[0].float(), -1)
        for step, (value, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            diffs.append(abs(value - lp[len(expanded) - 1 + step, token].item()))
    diffs = torch.tensor(diffs)
    assert diffs.max() < 0.15 and diffs.mean() < 0.03, (diffs.max(), diffs.mean())


def test_tensor_parallel_with_images_equals_transformers(vl_dir, hf):
    """tp_size 2 (two scheduler ranks, gloo on the CPU): images in and beside text-only prompts
    give transformers' greedy tokens, as one rank does."""
    tokens = hf[2]
    cases = [
        (prompt_ids(tokens, 1, seed=1), [picture(56, 84, 1)]),
        (prompt_ids(tokens, 3, seed=2), [picture(70, 70, 2), picture(29, 113, 3), picture(70, 70, 4)]),
        (prompt_ids(tokens, 0, seed=3), []),
    ]  # fmt: skip
    with Engine(
        model_path=str(vl_dir), dtype="float32", max_total_tokens=8192, tp_size=2
    ) as engine:
        assert engine.get_server_info()["tp_size"] == 2
        outs = engine.generate(
            input_ids=[ids for ids, _ in cases],
            image_data=[images or None for _, images in cases],
            sampling_params=GREEDY,
        )
    for i, ((ids, images), out) in enumerate(zip(cases, outs)):
        assert out["output_ids"] == hf_greedy(hf, ids, images)[0], f"prompt {i}"
