"""Prompts cut after a shared prefix tokenize exactly as whole prompts (engine/frontend/prompt_tokens.py).

The reference is brute force: `tokenizer.encode(whole_prompt)`, on real tokenizer types built
here with the `tokenizers` library (no hub): the tests' tiny byte-level BPE, the demo model's,
a Qwen-style one (NFC, a Split regex, byte-level BPE), a Llama-3-style one (a BOS template), and
two that must never be cut: a BERT WordPiece ([SEP] after the text) and a sentencepiece-style
Metaspace one ("▁" prepended at the text's start). Prompts and cuts are drawn from adversarial
pieces: spaces, newlines, "\\r\\n", digits, punctuation, combining characters, Hangul jamo,
emoji, and special tokens whole and in halves at, before and after the cut.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
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
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.frontend import prompt_tokens
from engine.frontend.prompt_tokens import MAX_PREFIXES, PromptTokens
from engine.frontend.token_seam import SeamRules
from tests.tiny_models import QWEN_SPLIT, build_tokenizer, qwen_style_tokenizer

LLAMA3_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
DEMO_DIR = Path(__file__).resolve().parents[2] / "demo" / "model"

_WORDS = ("the a of to and in is model token cache prompt answer question river stone mill "
          "flour bread window light night quick brown fox jumps lazy dog hello world").split()  # fmt: skip
_ODD = ["café", "naïve", "東京", "안녕", "😀", "👩‍💻", "x_1 = 3.5", "'s", "(ok)", "...", "e\u0301"]
PIECES = [" ", "  ", "   ", "\n", "\n\n", "\r\n", " \n", "\t", "\u00a0", "x", "the", " cat", "Word",
          " Word", "1", "12", "2024", " 7", "!", "?!", "...", ",", ":", "'s", "'", '"', "-", "é",
          "e\u0301", "\u0301", "\u0308", "가", "\u1100", "\u1161", "\u11a8", "😀", "👩‍💻", "東京",
          "<", "|>", "<|"]  # fmt: skip


def _corpus() -> list[str]:
    rng = random.Random(7)
    lines = []
    for _ in range(400):
        words = [rng.choice(_WORDS + _ODD) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.insert(0, str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ":", "\n", "\n\n", "\r\n"]))
    return lines


def _train(tok: Tokenizer, specials: list[str], byte_level: bool = True) -> None:
    if byte_level:
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    else:
        trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=specials,
                                            show_progress=False)  # fmt: skip
    tok.train_from_iterator(_corpus(), trainer=trainer)


@functools.cache
def qwen_style() -> PreTrainedTokenizerFast:
    return qwen_style_tokenizer(_corpus(), 700)


@functools.cache
def llama3_style() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]  # fmt: skip
    _train(tok, specials)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      special_tokens=[("<|begin_of_text|>", 0)]),
    ])  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", clean_up_tokenization_spaces=False)  # fmt: skip


def bert_style() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    _train(tok, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], byte_level=False)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", pad_token="[PAD]")  # fmt: skip


def metaspace_style() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")  # fmt: skip


def demo_model() -> PreTrainedTokenizerFast:
    if not (DEMO_DIR / "tokenizer.json").is_file():
        pytest.skip("demo/model has no tokenizer")
    return AutoTokenizer.from_pretrained(DEMO_DIR)


CUT = {"tiny": build_tokenizer, "demo": demo_model, "qwen": qwen_style, "llama3": llama3_style}
WHOLE = {"bert": bert_style, "metaspace": metaspace_style}


@pytest.fixture(scope="module", params=sorted(CUT))
def cut_tokenizer(request):
    return CUT[request.param]()


@pytest.fixture(scope="module", params=sorted(CUT) + sorted(WHOLE))
def any_tokenizer(request):
    return {**CUT, **WHOLE}[request.param]()


def _pieces(tok) -> list[str]:
    """PIECES and the tokenizer's own special tokens, whole and in halves."""
    specials = [t for t in tok.all_special_tokens if len(t) > 1]
    halves = [h for t in specials for h in (t[: len(t) // 2], t[len(t) // 2 :])]
    return PIECES + specials + halves


def _text(rng: random.Random, pieces: list[str], n: int) -> str:
    return "".join(rng.choice(pieces) for _ in range(n))


def _instructions(tok) -> list[str]:
    """Long shared starts: plain, a chat template with special tokens, ending in odd places."""
    special = next((t for t in tok.all_special_tokens if t.startswith("<|")), "")
    body = ("You are a careful annotator. Read the item and answer in one word. " * 4
            + "Examples:\n\n1. The river runs.\nAnswer: yes\r\n2. 42 stones!\nAnswer: no\n")  # fmt: skip
    return [
        "Item:\n" + body + "\nItem:",
        f"{special}system\n{body}{special}user\n",
        "Item 12\n" + body + "Item 12",
        "café\n" + body + "café e\u0301",
    ]


# ------------------------------------------------------------------ the seam rules, directly
def test_a_cut_the_rules_allow_tokenizes_as_the_whole_text(cut_tokenizer):
    """For random prefixes and rests ending and starting in adversarial ways: wherever
    SeamRules.joins says yes, prefix ids + rest ids (no specials) == the whole text's ids."""
    tok, rng = cut_tokenizer, random.Random(3)
    rules = SeamRules.for_tokenizer(tok.backend_tokenizer)
    assert isinstance(rules, SeamRules), rules
    pieces, bases = _pieces(tok), _instructions(tok)
    joined = 0
    for i in range(1500):
        prefix = rng.choice(bases)[: rng.randint(1, 300)] + _text(rng, pieces, rng.randint(0, 3))
        rest = _text(rng, pieces, rng.randint(0, 5))
        if i % 4 == 0:  # an ordinary item after an ordinary end
            prefix, rest = prefix + rng.choice(["Item:", "word", "!"]), rng.choice([" a", " The"])
        if rules.joins(rules.tail(prefix), rest):
            joined += 1
            split = tok.encode(prefix) + tok.encode(rest, add_special_tokens=False)
            assert split == tok.encode(prefix + rest), (prefix[-20:], rest)
    assert joined > 500  # the rules cut most prompts, or this test would check nothing


@pytest.mark.parametrize(
    "name, prefix_end, rest, joins",
    [
        ("qwen", "word", " next", True),  # a space starts the next pre-token
        ("qwen", "word ", "next", False),  # ... so a cut after it never joins
        ("qwen", "word", "s and more", False),  # a word cut in two
        ("qwen", "12", "34", True),  # one digit a pre-token
        ("llama3", "12", "34", False),  # up to 3 digits a pre-token: "123" "4"
        ("llama3", "123", "45", True),
        ("qwen", "<|im_", "start|>user", False),  # a special token straddling the cut ...
        ("qwen", "<|im_end", "|>\n", False),  # ... where the pre-tokenizer alone would split
        ("qwen", "<|im_start|>", "user\n", True),  # a special token ends the prefix
        ("qwen", "answer:", "<|im_end|>\n", True),  # ... or starts the rest
        ("qwen", "e", "\u0301 acute", False),  # a combining mark joins its base (NFC)
        ("qwen", "\u1100", "\u1161", False),  # Hangul jamo compose (NFC)
        ("llama3", "e", "\u0301 acute", True),  # no normalizer: a mark is a pre-token's start
        ("qwen", "word", "", True),  # nothing after the prefix
        ("qwen", "word", "  \n ", True),  # a short all-whitespace rest: the window holds it whole
        ("qwen", "word", " " * 80 + "x", False),  # no ink in the rest's first 64 characters
    ],
)
def test_seams_at_known_places(name, prefix_end, rest, joins):
    tok = CUT[name]()
    prefix = "You are a careful annotator. " * 10 + prefix_end
    rules = SeamRules.for_tokenizer(tok.backend_tokenizer)
    assert rules.joins(rules.tail(prefix), rest) is joins
    if joins:
        split = tok.encode(prefix) + tok.encode(rest, add_special_tokens=False)
        assert split == tok.encode(prefix + rest)


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_bert_and_metaspace_tokenizers_are_never_cut(name):
    tok = WHOLE[name]()
    assert isinstance(SeamRules.for_tokenizer(tok.backend_tokenizer), str)


# ------------------------------------------------------------------ the cache
def test_prompts_encode_as_whole_prompts(any_tokenizer):
    """Rows of several shared instructions, interleaved, through encode_batch and per prompt:
    every prompt's ids are tokenizer.encode's; tokenizers the rules admit cut most rows."""
    tok, rng = any_tokenizer, random.Random(5)
    pieces = _pieces(tok)
    prompts = [rng.choice(_instructions(tok)) + rng.choice(["", " row", " 42:"])
               + _text(rng, pieces, rng.randint(0, 6)) for _ in range(400)]  # fmt: skip
    prompts += ["short prompt", "", "x" * 300]
    reference = [tok.encode(p) for p in prompts]
    batched, one_by_one = PromptTokens(tok), PromptTokens(tok)
    assert batched.encode_batch(prompts) == reference
    assert [one_by_one.encode(p) for p in prompts] == reference
    for cache in (batched, one_by_one):
        if isinstance(SeamRules.for_tokenizer(tok.backend_tokenizer), str):
            assert cache.refused and cache.stats.split == 0
        else:
            assert cache.refused is None and cache.stats.registered >= 1
            assert cache.stats.split > len(prompts) // 2, cache.stats


def test_a_row_that_joins_the_prefix_is_tokenized_whole():
    tok = llama3_style()  # (digits make pre-tokens of up to three: "12" + "3" is "123")
    shared = "You are a careful annotator. " * 10 + "Item 12"
    rows = [" a", " b", " c", "3 apples", " d"]
    cache = PromptTokens(tok)
    assert [cache.encode(shared + row) for row in rows] == [tok.encode(shared + r) for r in rows]
    assert next(iter(cache._prefixes)) == shared
    # " a" waits for a match, " b" registers (tokenized whole to check the cut), "3" joins
    assert (cache.stats.split, cache.stats.whole) == (2, 3)


def test_the_prefix_cache_is_bounded():
    tok, rng = build_tokenizer(), random.Random(9)
    instructions = [f"Task {i}: " + " ".join(rng.choice(_WORDS) for _ in range(80)) + "\nItem:"
                    for i in range(3 * MAX_PREFIXES)]  # fmt: skip
    cache = PromptTokens(tok)
    prompts = [instr + f" row {j}" for instr in instructions for j in range(4)]
    assert cache.encode_batch(prompts) == [tok.encode(p) for p in prompts]
    assert cache.stats.registered >= 2 * MAX_PREFIXES
    assert len(cache._prefixes) == MAX_PREFIXES


def test_a_cut_that_changes_tokens_turns_cutting_off(monkeypatch):
    """If the seam rules ever let a bad cut through, the registration's check (whole prompt vs
    prefix + rest) catches it, and the ids stay exact."""
    tok = build_tokenizer()
    monkeypatch.setattr(SeamRules, "joins", lambda self, tail, rest: True)
    monkeypatch.setattr(prompt_tokens, "_PROBES", ())
    shared = "the quick brown fox jumps over the lazy dog " * 8 + "wor"
    prompts = [shared + "ds", shared + "ld", shared + "ding"]  # the cut splits a word
    cache = PromptTokens(tok)
    assert [cache.encode(p) for p in prompts] == [tok.encode(p) for p in prompts]
    assert cache.refused and cache.stats.split == 0


# ------------------------------------------------------------------ through the engine
def test_engine_generate_on_prompts_equals_their_input_ids(llama_engine, llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    shared = "You are a careful annotator of rivers and mills. " * 7 + "\nItem:"
    prompts = [f"{shared} {w} {i}" for i, w in enumerate(_WORDS[:8])]
    cache = llama_engine.tokenizer_manager.inputs.prompt_tokens
    before = cache.stats.split
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    outs = llama_engine.generate(prompt=prompts, sampling_params=params)
    refs = llama_engine.generate(input_ids=[tok.encode(p) for p in prompts], sampling_params=params)
    assert cache.stats.split - before >= len(prompts) - 2  # (two prompts find the prefix)
    for out, ref, prompt in zip(outs, refs, prompts):
        assert out["meta_info"]["prompt_tokens"] == len(tok.encode(prompt))
        assert out["meta_info"]["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
        assert out["output_ids"] == ref["output_ids"]
