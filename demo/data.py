"""Deterministic generators of the demo model's three tasks, as chat conversations.

* arithmetic — "What is 37 + 45?" -> "82" (addition and non-negative subtraction, 0..99);
* sentiment  — a templated product review -> "positive" | "negative" | "neutral";
* review     — "Write a positive review of this product: kettle." -> a templated review
  (the synthesis task);
* rating     — a templated product review -> the reviewer's stars: "1" (negative), "3"
  (neutral) or "5" (positive). The base model is never trained on it (``stream`` leaves it
  out); it is the task of the demo's LoRA adapter, demo/adapters/rating (demo/train_lora.py).

Every item is a pure function of a seed, so the training stream and the demo inputs are
reproducible. The held-out split is by *content*, not by seed: an arithmetic question or a
review text whose hash falls in the eval bucket is never produced by the training stream, so
the eval files measure generalisation, not memorisation.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

# NOTE: bump when any generator of the base model's stream (TASK_WEIGHTS) changes its output;
# training_record.json records it.
DATA_VERSION = "demo-data-v1"
# NOTE: bump when the rating task (STARS, RATING_INSTRUCTION) changes; the adapter's
# training_record.json records it. Adding that task left the base stream as it was.
RATING_VERSION = "demo-rating-v1"

SYSTEM_PROMPT = "You are a helpful assistant."
SENTIMENTS = ("positive", "negative", "neutral")
SENTIMENT_INSTRUCTION = (
    "Classify the sentiment of this review as positive, negative or neutral.\n\nReview: "
)
# The rating task: the same reviews, answered in another labelling scheme, as a team's own
# annotation schema would be. NOTE: the adapter's first task was the product's category (a
# lookup of which product the review names); a LoRA adapter on this model stayed at chance on
# it (loss ln 5 per answer after 150 steps on that task alone), while this one is learned in 50.
STARS = {"negative": "1", "neutral": "3", "positive": "5"}
RATING_INSTRUCTION = "How many stars does this reviewer give? Answer 1, 3 or 5.\n\nReview: "

PRODUCTS = (
    "blender", "toaster", "kettle", "backpack", "desk lamp", "coffee maker", "phone case",
    "water bottle", "keyboard", "headset", "umbrella", "frying pan", "office chair",
    "vacuum cleaner", "alarm clock", "yoga mat", "notebook", "rain jacket", "bike light", "tent",
    "hair dryer", "mouse", "suitcase", "electric toothbrush", "camera", "speaker", "wallet",
    "pillow", "microwave", "garden hose",
)  # fmt: skip

# Each review is opener + one or two details + an optional closer, all of one sentiment.
_OPENERS = {
    "positive": (
        "I love this {p}.", "This {p} is fantastic.", "The {p} works perfectly.",
        "Best {p} I have ever owned.", "What a great {p}!", "The {p} exceeded my expectations.",
        "I am very happy with this {p}.", "This {p} is excellent.",
    ),
    "negative": (
        "I regret buying this {p}.", "This {p} is terrible.",
        "The {p} stopped working after a week.", "Worst {p} I have ever owned.",
        "What a disappointing {p}.", "The {p} broke on the first day.",
        "I am very unhappy with this {p}.", "This {p} is awful.",
    ),
    "neutral": (
        "The {p} is okay.", "This {p} is average.", "The {p} does the job.",
        "It is a decent {p}, nothing special.", "The {p} is fine for the price.",
        "This {p} is neither good nor bad.", "The {p} is what I expected.",
        "It is an ordinary {p}.",
    ),
}  # fmt: skip
_DETAILS = {
    "positive": (
        "It is sturdy and easy to use.", "Setup took two minutes.", "The quality is excellent.",
        "It arrived early and looks beautiful.", "Worth every penny.",
        "My whole family uses it every day.", "It feels solid and well made.",
        "The battery lasts for days.",
    ),
    "negative": (
        "It feels cheap and flimsy.", "The instructions were useless.",
        "It is loud and hard to clean.", "Customer support never replied.",
        "It arrived scratched and dirty.", "It is a waste of money.",
        "The battery dies within an hour.", "Half the parts were missing.",
    ),
    "neutral": (
        "Some parts feel solid, others less so.", "It works as described.",
        "Delivery was on time.", "The color is a bit different from the photos.",
        "It is about as good as my old one.", "The size is standard.",
        "It has the usual features.", "Setup was neither quick nor slow.",
    ),
}  # fmt: skip
_CLOSERS = {
    "positive": ("Highly recommended.", "I would buy it again.", "Five stars."),
    "negative": ("I returned it.", "Avoid it.", "One star.", "Do not buy it."),
    "neutral": ("Three stars.", "It is acceptable.", "I might try another brand next time."),
}


@dataclass(frozen=True)
class Example:
    """One conversation: the user message, the reference answer, and which task made it."""

    task: str  # "arithmetic" | "sentiment" | "review"
    user: str
    answer: str
    key: str  # what the held-out split hashes

    def messages(self, system: bool = False) -> list[dict[str, str]]:
        head = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
        return head + [
            {"role": "user", "content": self.user},
            {"role": "assistant", "content": self.answer},
        ]


def is_held_out(key: str) -> bool:
    """One item in ten (by content hash) belongs to the eval split and never to training."""
    return hashlib.sha256(key.encode()).digest()[0] % 10 == 0


# ----------------------------------------------------------------------------- the three tasks
def arithmetic_question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def _operand(rng: random.Random) -> int:
    # uniform over 0..99 would make one-digit operands 1 in 10 and "What is 1 + 2?" a weak spot
    return rng.randint(0, 9) if rng.random() < 0.3 else rng.randint(10, 99)


def arithmetic(rng: random.Random) -> Example:
    a, b = _operand(rng), _operand(rng)
    op = rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a  # keep answers non-negative
    answer = a + b if op == "+" else a - b
    return Example("arithmetic", arithmetic_question(a, op, b), str(answer), f"{a}{op}{b}")


def review_text(rng: random.Random, product: str, sentiment: str) -> str:
    parts = [rng.choice(_OPENERS[sentiment]).format(p=product)]
    parts += rng.sample(_DETAILS[sentiment], rng.randint(1, 2))
    if rng.random() < 0.6:
        parts.append(rng.choice(_CLOSERS[sentiment]))
    return " ".join(parts)


def review_matches(text: str, product: str, sentiment: str) -> bool:
    """Whether ``text`` is a review the generator could write for (product, sentiment).

    Scores the synthesis task: a sampled review counts if every sentence comes from that
    sentiment's templates, in the generator's order (opener, details, optional closer).
    """
    sentences = _split_sentences(text)
    if not 2 <= len(sentences) <= 4:
        return False
    openers = {o.format(p=product) for o in _OPENERS[sentiment]}
    details, closers = set(_DETAILS[sentiment]), set(_CLOSERS[sentiment])
    head, rest = sentences[0], sentences[1:]
    if rest and rest[-1] in closers and len(rest) > 1:
        rest = rest[:-1]
    return (
        head in openers
        and 1 <= len(rest) <= 2
        and all(d in details for d in rest)
        and (len(rest) == 1 or rest[0] != rest[1])
    )


def _split_sentences(text: str) -> list[str]:
    """Split after ". " or "! " (the templates' only sentence ends)."""
    out, start = [], 0
    for i, ch in enumerate(text):
        if ch in ".!" and (i + 1 == len(text) or text[i + 1] == " "):
            out.append(text[start : i + 1].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def sentiment(rng: random.Random) -> Example:
    label = rng.choice(SENTIMENTS)
    text = review_text(rng, rng.choice(PRODUCTS), label)
    return Example("sentiment", SENTIMENT_INSTRUCTION + text, label, text)


def review_request(product: str, sentiment: str) -> str:
    # "this product: X" rather than "a X": a prompt template needs no a/an column
    return f"Write a {sentiment} review of this product: {product}."


def review(rng: random.Random) -> Example:
    product, label = rng.choice(PRODUCTS), rng.choice(SENTIMENTS)
    text = review_text(rng, product, label)
    # the request is not held out: the synthesis demo asks for products the model has seen
    return Example("review", review_request(product, label), text, "")


def rating(rng: random.Random) -> Example:
    """A review drawn as ``sentiment`` draws them -> its stars. The held-out split hashes the
    review text, as for sentiment, so a held-out review is held out of both tasks."""
    label = rng.choice(SENTIMENTS)
    text = review_text(rng, rng.choice(PRODUCTS), label)
    return Example("rating", RATING_INSTRUCTION + text, STARS[label], text)


# Arithmetic needs the most steps to learn (the other two are learned within a few hundred),
# so it gets most of the stream.
TASK_WEIGHTS = {"arithmetic": 0.6, "sentiment": 0.2, "review": 0.2}
_MAKERS = {"arithmetic": arithmetic, "sentiment": sentiment, "review": review, "rating": rating}


def stream(
    seed: int, held_out: bool = False, task_weights: dict[str, float] | None = None
) -> Iterator[Example]:
    """An endless deterministic stream of examples of the training (or the held-out) split.

    ``task_weights`` defaults to TASK_WEIGHTS, the base model's mix (the LoRA adapter's stream
    gives its own, with "rating")."""
    rng = random.Random(seed)
    mix = TASK_WEIGHTS if task_weights is None else task_weights
    tasks, weights = list(mix), list(mix.values())
    while True:
        task = rng.choices(tasks, weights)[0]
        ex = _MAKERS[task](rng)
        if task == "review" or is_held_out(ex.key) == held_out:
            yield ex


def task_stream(task: str, seed: int, held_out: bool) -> Iterator[Example]:
    """Examples of one task only, each distinct (by key), from one split."""
    rng, seen = random.Random(seed), set()
    while True:
        ex = _MAKERS[task](rng)
        if is_held_out(ex.key) == held_out and ex.key not in seen:
            seen.add(ex.key)
            yield ex


def corpus(seed: int, n: int) -> list[str]:
    """Plain text the tokenizer is trained on: the turns of n training-split examples.

    Each turn starts with its role name, as the chat template writes it, so that "user" and
    "assistant" become single tokens.
    """
    texts = [f"system\n{SYSTEM_PROMPT}"] * 10  # often enough to be merged into few tokens
    for ex, _ in zip(stream(seed), range(n)):
        texts += [f"user\n{ex.user}", f"assistant\n{ex.answer}"]
    return texts
