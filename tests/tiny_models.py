"""Tiny Hugging Face model folders for tests, built entirely offline.

Everything here is deterministic and small enough to run on a laptop CPU:

* :func:`build_tokenizer` trains a byte-level BPE tokenizer (vocab ~512) on a corpus generated
  in-process and saves it with ``save_pretrained`` (loadable with ``AutoTokenizer``).
* :func:`make_tiny_model` writes a complete model folder (config.json, generation_config.json,
  safetensors weights -- optionally sharded with an index -- and the tokenizer) for one of the
  architectures llama / mistral / qwen2 / qwen3, with random weights.
* :func:`hf_greedy` is the ``transformers`` reference for greedy decoding (float32, eager attention).
* :func:`random_prompts` draws random token-id prompts that avoid special tokens.

Notes on transformers 5:

* RoPE settings live in ``config.rope_parameters`` (serialized as ``"rope_parameters"`` in
  config.json, with ``rope_theta`` inside it), not in the old top-level ``rope_theta`` /
  ``rope_scaling`` keys. We therefore build ``rope_parameters={"rope_type": ..., "rope_theta": ...,
  **scaling}`` and pass that to the config class.
* ``PreTrainedTokenizerFast`` is an alias of ``TokenizersBackend``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

# The arguments (besides model_path) of the session's shared engine on a tiny model
# (tests/conftest.py: shared_llama_engine). The flow tests' configs ask for exactly these, so
# their flows can borrow it; a tiny model's dtype is float32, so "auto" is float32.
SHARED_ENGINE_ARGS = {"max_total_tokens": 8192}

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

_WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or have not are "
    "but all they we you he she one two three model token engine batch cache prompt text "
    "answer question query request server request value number list table water river stone "
    "mill grist wheat flour bread house garden window light night morning evening quick brown "
    "fox jumps over lazy dog hello world python tensor kernel memory page block attention "
    "layer head rotary position embedding vocabulary sample greedy decode prefill chunk"
).split()
_ACCENTED = (
    "café naïve résumé façade jalapeño crème brûlée über straße smörgåsbord São Paulo "
    "Ångström déjà vu coöperate piñata Zürich Kraków Øresund"
).split()
_CJK = "你好 世界 模型 推理 引擎 こんにちは 東京 日本語 한국어 안녕하세요".split()
_RARE = ["龍", "鬱", "齉", "𝔘𝔫𝔦", "Ꙫ", "ﷺ", "܀"]
_EMOJI = ["😀", "🚀", "🎉", "👍🏽", "🧪", "🌍", "❤️", "👩‍💻"]
_PUNCT = [".", ",", "!", "?", ";", ":", "...", " -", " (ok)", ' "quoted"', "'s"]


def _corpus() -> list[str]:
    """A small deterministic corpus: English-ish sentences, numbers, code-ish text, multi-byte."""
    rng = random.Random(1234)
    lines: list[str] = []
    for _ in range(600):
        n = rng.randint(3, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 99999)))
        if rng.random() < 0.25:
            words.insert(rng.randrange(len(words) + 1), rng.choice(_ACCENTED))
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words) + 1), rng.choice(_CJK))
        if rng.random() < 0.1:
            words.append(rng.choice(_EMOJI))
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice(_PUNCT)
        lines.append(s)
    for i in range(50):
        lines.append(f"x_{i} = {i * 37 % 101} + {i * i} * 3.{i % 10}  # {i:04d}")
    lines.append(" ".join(_RARE))
    lines.append("\n".join(_EMOJI))
    lines.append("\t\tindent\n  two spaces\r\nwindows line")
    return lines


_TOKENIZER_JSON: str | None = None


def _trained_tokenizer_json() -> str:
    """Train (once per process) and return the serialized ``tokenizers.Tokenizer``."""
    global _TOKENIZER_JSON
    if _TOKENIZER_JSON is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            min_frequency=2,
            special_tokens=SPECIAL_TOKENS,  # ids 0..4, in this order
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        _TOKENIZER_JSON = tok.to_str()
    return _TOKENIZER_JSON


def build_tokenizer(out_dir=None):
    """Build the tiny byte-level BPE tokenizer; save it to ``out_dir`` if given.

    Returns a ``PreTrainedTokenizerFast``. No BOS is prepended automatically (like Qwen);
    the special tokens are ``<|bos|>`` ``<|eos|>`` ``<|pad|>`` ``<|im_start|>`` ``<|im_end|>``
    with ids 0..4.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json())
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(out_dir))
    return tok


# Qwen2's pre-tokenizer regex (GPT-4-like; digits one at a time)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


def qwen_style_tokenizer(lines: list[str], vocab_size: int):
    """A Qwen-style fast tokenizer trained on `lines`: NFC, Qwen's split regex, byte-level BPE
    of `vocab_size` tokens, with <|endoftext|>, <|im_start|> and <|im_end|>."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)  # fmt: skip


def special_token_ids() -> list[int]:
    backend_vocab = json.loads(_trained_tokenizer_json())["added_tokens"]
    return sorted(t["id"] for t in backend_vocab if t["special"])


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Init (see _reinit). The default HF init (normal std 0.02 everywhere, norms = 1, biases = 0) gives
# tiny logit spreads on models this small (logit std ~0.16, ~0.2% of positions with a top-2 gap
# < 1e-4, ~2% < 1e-3) and, for tied embeddings, a model that mostly repeats its input token
# (the e_tok . e_tok self term dominates the logits). We overwrite every parameter, in name order,
# from torch.Generator().manual_seed(seed + 1):
#   * embed_tokens: std EMBED_STD (small, so the residual stream is dominated by the blocks and the
#     prediction depends on the context, not just on the last token),
#   * lm_head (untied): std LM_HEAD_STD -> logits = rmsnorm(h) @ W_lm have std ~LM_HEAD_STD*sqrt(H)
#     (~4 for H=64): median top-2 gap ~0.85, no measured gap < 1e-4 on thousands of positions,
#   * tied models: the final norm weight is multiplied by LM_HEAD_STD / EMBED_STD instead, giving
#     the same logit scale while the embedding stays small,
#   * every other matrix: std LINEAR_GAIN / sqrt(fan_in) (each block contributes O(1)),
#   * biases (qwen2 q/k/v): std BIAS_STD, non-zero so that a loader that drops them is caught,
#   * RMSNorm weights (incl. qwen3 q_norm/k_norm): 1 + NORM_STD * N(0,1), so that a loader that
#     ignores them is caught.
EMBED_STD = 0.1
LM_HEAD_STD = 0.5
LINEAR_GAIN = 1.0
BIAS_STD = 0.1
NORM_STD = 0.2


def _config_and_model_cls(arch: str):
    import transformers as tf

    table = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }
    if arch not in table:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    return table[arch]


@torch.no_grad()
def _reinit(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    seen: set[int] = set()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "norm" in name:
            scale = 1.0
            if name == "model.norm.weight" and tied:
                scale = LM_HEAD_STD / EMBED_STD
            p.copy_(scale * (1.0 + NORM_STD * torch.randn(p.shape, generator=gen)))
        elif name.endswith(".bias"):
            p.copy_(BIAS_STD * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(EMBED_STD * torch.randn(p.shape, generator=gen))
        elif name.startswith("lm_head"):
            p.copy_(LM_HEAD_STD * torch.randn(p.shape, generator=gen))
        elif p.dim() == 2:
            p.copy_(LINEAR_GAIN / p.shape[1] ** 0.5 * torch.randn(p.shape, generator=gen))
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(p.shape)}")


def make_tiny_model(
    out_dir,
    arch: str,
    *,
    tie_word_embeddings: bool = False,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    seed: int = 0,
    **config_overrides,
) -> Path:
    """Write a tiny random ``arch`` model folder (weights, config, generation config, tokenizer).

    ``rope_scaling`` (e.g. ``{"rope_type": "linear", "factor": 2.0}``) is merged into the
    transformers-5 ``rope_parameters`` dict together with ``rope_theta`` (a config override,
    default 10000.0). ``max_shard_size`` (e.g. ``"20KB"``) produces several safetensors shards plus
    ``model.safetensors.index.json``.
    """
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    config_cls, model_cls = _config_and_model_cls(arch)

    if head_dim is None:
        head_dim = hidden_size // num_attention_heads
    rope_theta = float(config_overrides.pop("rope_theta", 10000.0))
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        scaling = dict(rope_scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        rope_parameters.update(scaling)
    rope_parameters = config_overrides.pop("rope_parameters", rope_parameters)

    kwargs = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
        kwargs["sliding_window"] = None
    kwargs.update(config_overrides)
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _reinit(model, seed)
    model = model.to(dtype)
    model.config.dtype = dtype

    # save_pretrained does not remove stale shards from a previous build in the same folder
    for old in list(out_dir.glob("model*.safetensors")) + list(out_dir.glob("*.index.json")):
        old.unlink()
    save_kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    try:
        model.save_pretrained(str(out_dir), **save_kwargs)
    except TypeError:  # newer transformers always writes safetensors
        save_kwargs.pop("safe_serialization")
        model.save_pretrained(str(out_dir), **save_kwargs)

    GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
    ).save_pretrained(str(out_dir))
    return out_dir


# ---------------------------------------------------------------------------------------------
# transformers reference
# ---------------------------------------------------------------------------------------------

_HF_MODELS: dict[str, object] = {}


def load_hf_model(model_dir):
    """Load (and cache per folder) a float32, eager-attention ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM

    key = str(Path(model_dir).resolve())
    if key not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager"
        )
        # transformers 5 fills unset generation options (eos_token_id=None included) from the
        # model's own generation_config, so EOS must be removed there for hf_greedy not to stop.
        model.generation_config.eos_token_id = None
        _HF_MODELS[key] = model.eval()
    return _HF_MODELS[key]


@torch.no_grad()
def hf_greedy(model_dir, input_ids: list[int], max_new_tokens: int):
    """Greedy continuation with transformers, never stopping at EOS.

    Returns ``(new_token_ids, logprobs)`` where ``logprobs[i]`` is the float32 log-softmax over the
    vocabulary of the logits that produced ``new_token_ids[i]``.
    """
    model = load_hf_model(model_dir)
    gen_cfg = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    gen_cfg.eos_token_id = None  # not enough on its own in transformers 5, see load_hf_model
    gen_cfg.do_sample = False
    gen_cfg.num_beams = 1
    gen_cfg.max_new_tokens = max_new_tokens
    gen_cfg.min_new_tokens = None
    gen_cfg.max_length = None
    gen_cfg.temperature = None
    gen_cfg.top_p = None
    gen_cfg.top_k = None
    gen_cfg.output_logits = True
    gen_cfg.return_dict_in_generate = True
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        generation_config=gen_cfg,
    )
    new_tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    assert len(new_tokens) == max_new_tokens == len(logprobs), (len(new_tokens), len(logprobs))
    return new_tokens, logprobs


def random_prompts(vocab_size: int, lengths, seed: int = 0, avoid_ids=None) -> list[list[int]]:
    """Random prompts (lists of token ids) of the given lengths, avoiding ``avoid_ids``
    (default: the tokenizer's special token ids)."""
    if avoid_ids is None:
        avoid_ids = special_token_ids()
    avoid = set(avoid_ids)
    allowed = [i for i in range(vocab_size) if i not in avoid]
    rng = random.Random(seed)
    return [[rng.choice(allowed) for _ in range(int(n))] for n in lengths]


def never_generated(outputs: list[list[int]], vocab_size: int = 512) -> int:
    """A token id in none of `outputs` (nor special): as a stop id it never ends a request,
    yet makes it one that could end early, whose KV admission can only guess (and may have to
    retract); a request with no stop id at all has the exact peak of its
    length reserved, and is never retracted. (Admission's
    guess also learns from finished requests: see `guess_like_sglang`.)"""
    seen = {t for out in outputs for t in out} | set(special_token_ids())
    return next(t for t in range(vocab_size) if t not in seen)


def guess_like_sglang(monkeypatch) -> None:
    """Admission's estimate of what running requests will generate, as SGLang's at its most
    optimistic: its floor ratio from the start, without the floor of what finished requests
    used. Tests of retraction need a guess a small pool can prove wrong, whatever ran before."""
    from engine.scheduler import new_tokens

    monkeypatch.setattr(new_tokens.NewTokenEstimate, "finished", lambda self, req: None)
    monkeypatch.setattr(new_tokens, "INIT_NEW_TOKEN_RATIO", new_tokens.MIN_NEW_TOKEN_RATIO)


def make_lora(model_dir, out, rank: int, targets: list[str], seed: int, alpha: float | None = None):
    """A PEFT adapter folder for model_dir with random A and B (peft's own writer)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, lora_dropout=0.0,
        init_lora_weights=False,
    )  # fmt: skip
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough to change the greedy tokens of a random model
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out


_PEFT: dict = {}


@torch.no_grad()
def peft_greedy(model_dir, adapter_dir, ids: list[int], n: int):
    """Greedy tokens and their float32 logprobs of transformers with the adapter applied by peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = str(adapter_dir)
    if key not in _PEFT:
        base = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        )
        _PEFT[key] = PeftModel.from_pretrained(base, adapter_dir).eval()
    model, tokens, logprobs = _PEFT[key], list(ids), []
    for _ in range(n):
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
    return tokens[len(ids) :], logprobs


# ---------------------------------------------------------------------------------------------
# A vision-language model
# ---------------------------------------------------------------------------------------------

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


def make_tiny_vl_model(folder) -> Path:
    """A Qwen2.5-VL folder: the tiny BPE tokenizer with Qwen's vision tokens added, a 2-layer
    decoder with M-RoPE (head_dim 16: sections 4, 2, 2), a 2-block vision tower (one window
    block, one full) of 14-pixel patches merged 2 x 2, random weights, and Qwen2-VL's image
    processor limited to at most 192 patches an image."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    folder = Path(folder)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [IM_START, IM_END, VISION_START, IMAGE_PAD, VISION_END]}
    )
    tokenizer.save_pretrained(folder)
    token = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=544, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
            rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]
            },
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=token(IMAGE_PAD), vision_start_token_id=token(VISION_START),
        vision_end_token_id=token(VISION_END), video_token_id=token(IMAGE_PAD),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # sharper logits than the 0.02 init: greedy ties would be luck
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=14 * 14 * 4 * 48)
    processor.save_pretrained(folder)
    return folder
