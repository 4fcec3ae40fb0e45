"""Tokenizing prompts that share a long instruction: whole, one by one, against PromptTokens.

1,000 prompts, each one ~4.5 KB instruction + a short item, on a byte-level BPE tokenizer built
here (Qwen-style: NFC, its pre-tokenizer regex, byte-level BPE of 8k tokens trained on generated
text). Tokenized (a) one by one, whole, as InputProcessor did before PromptTokens; (b) one by one
through PromptTokens.encode, as flows call the engine (a prompt per call); (c) as one list
through PromptTokens.encode_batch; and, for comparison, (d) one batch call of the tokenizer on
the whole prompts. Every way's ids are checked against (a). Prints a markdown table of prompts/s
(best of 3 runs; a fresh PromptTokens per run, so each run finds the instruction itself).

    python -m bench.prompt_tokens
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from transformers import PreTrainedTokenizerFast

from engine.frontend.prompt_tokens import PromptTokens
from tests.tiny_models import qwen_style_tokenizer

PROMPTS = 1000
WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or have not are but "
    "all they we you he she one two three item label answer question review product customer "
    "order shipping quality price return service support positive negative neutral rating star "
    "example output input text sentence word reason because however therefore always never "
    "must should only each every first second last short long clear careful exactly format json"
).split()


def corpus(rng: random.Random, lines: int) -> list[str]:
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        out.append(" ".join(words).capitalize() + rng.choice([".", ",", ":", "!", "?\n", ".\n\n"]))
    return out


def byte_level_bpe() -> PreTrainedTokenizerFast:
    return qwen_style_tokenizer(corpus(random.Random(0), 20000), 8192)


def prompts(rng: random.Random) -> list[str]:
    instruction = "<|im_start|>system\nYou label customer reviews.\n"
    while len(instruction) < 4500:
        instruction += " ".join(corpus(rng, 4)) + "\n"
    instruction += "<|im_end|>\n<|im_start|>user\nReview:"
    items = corpus(rng, PROMPTS)
    return [f"{instruction} {item}<|im_end|>\n<|im_start|>assistant\n" for item in items]


def best_of(runs: int, work: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    best, ids = float("inf"), []
    for _ in range(runs):
        start = time.perf_counter()
        ids = work()
        best = min(best, time.perf_counter() - start)
    return best, ids


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m bench.prompt_tokens", description=__doc__.split("\n\n")[0]
    ).parse_args(argv)
    tok = byte_level_bpe()
    texts = prompts(random.Random(1))
    whole_s, reference = best_of(3, lambda: [tok.encode(p) for p in texts])
    tokens = sum(map(len, reference)) / len(texts)
    rows = [("(a) one by one, whole (tokenizer.encode)", whole_s)]
    ways: list[tuple[str, Callable[[], list[list[int]]]]] = [
        ("(b) one by one, PromptTokens.encode", lambda: list(map(PromptTokens(tok).encode, texts))),
        ("(c) one list, PromptTokens.encode_batch", lambda: PromptTokens(tok).encode_batch(texts)),
        ("(d) one list, whole (tokenizer(list))", lambda: tok(texts)["input_ids"]),
    ]
    for name, work in ways:
        seconds, ids = best_of(3, work)
        assert ids == reference, f"{name}: ids differ from tokenizer.encode"
        rows.append((name, seconds))
    print(f"{len(texts)} prompts of {len(texts[0])} characters, {tokens:.0f} tokens on average\n")
    print("| tokenization | seconds | prompts/s | vs (a) |")
    print("| --- | ---: | ---: | ---: |")
    for name, seconds in rows:
        print(
            f"| {name} | {seconds:.3f} | {len(texts) / seconds:,.0f} | {whole_s / seconds:.1f}x |"
        )


if __name__ == "__main__":
    main()
