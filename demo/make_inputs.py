"""Write the demo input files in demo/inputs/ from the held-out split of the generators.

    python -m demo.make_inputs

* arithmetic_eval.jsonl — {"id", "question", "answer"}: questions training never saw;
* reviews.jsonl         — {"id", "review", "sentiment", "stars"}: reviews training never saw,
  with their label (not called "label": the annotate flow writes its own `label` column) and
  the same label as stars (the LoRA adapter's task, demo/train_lora.py);
* products.csv          — id, product, sentiment: seeds for synthesizing reviews;
* arithmetic_batch.jsonl — the first 100 of arithmetic_eval's questions as an OpenAI Batch API
  input file (chat completion requests; custom_id the question's id): the OpenAI batch demo.
"""

from __future__ import annotations

import csv
import json
from itertools import islice
from pathlib import Path

from demo import data

INPUTS_DIR = Path(__file__).resolve().parent / "inputs"
ARITHMETIC_SEED, REVIEWS_SEED = 1001, 1002
N_ARITHMETIC, N_REVIEWS = 200, 100


def arithmetic_rows(n: int = N_ARITHMETIC) -> list[dict[str, str]]:
    examples = islice(data.task_stream("arithmetic", ARITHMETIC_SEED, held_out=True), n)
    return [
        {"id": f"arith-{i:03d}", "question": ex.user, "answer": ex.answer}
        for i, ex in enumerate(examples)
    ]


def review_rows(n: int = N_REVIEWS) -> list[dict[str, str]]:
    examples = islice(data.task_stream("sentiment", REVIEWS_SEED, held_out=True), n)
    return [
        {
            "id": f"review-{i:03d}",
            "review": ex.key,
            "sentiment": ex.answer,
            "stars": data.STARS[ex.answer],
        }
        for i, ex in enumerate(examples)
    ]


def product_rows() -> list[dict[str, str]]:
    """Twenty products, the three sentiments in turn."""
    return [
        {"id": f"product-{i:02d}", "product": product, "sentiment": data.SENTIMENTS[i % 3]}
        for i, product in enumerate(data.PRODUCTS[:20])
    ]


N_BATCH = 100


def batch_lines(rows: list[dict[str, str]]) -> list[dict]:
    """Questions as OpenAI Batch API request lines, answered greedily in at most 8 tokens."""
    return [
        {"custom_id": row["id"], "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gristmill-demo", "max_tokens": 8, "temperature": 0,
                  "messages": [{"role": "user", "content": row["question"]}]}}
        for row in rows
    ]  # fmt: skip


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(out_dir: Path = INPUTS_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out_dir / "arithmetic_eval.jsonl", arithmetic_rows())
    _write_jsonl(out_dir / "arithmetic_batch.jsonl", batch_lines(arithmetic_rows()[:N_BATCH]))
    _write_jsonl(out_dir / "reviews.jsonl", review_rows())
    with (out_dir / "products.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "product", "sentiment"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(product_rows())
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    main()
