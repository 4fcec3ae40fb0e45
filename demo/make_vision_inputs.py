"""Write the demo vision model's inputs from the held-out split of demo/shapes.py.

    python -m demo.make_vision_inputs

* inputs/shapes/NNNN.png — 100 pictures training never saw (by content: shapes.is_held_out);
* inputs/shapes.jsonl    — {"id", "image", "colour", "shape"}: `image` is the picture's path
  relative to the JSONL's folder (the flows read relative paths from there), `colour` and
  `shape` what the generator drew: the references, never a model's answers.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

from demo import shapes

INPUTS_DIR = Path(__file__).resolve().parent / "inputs"
SHAPES_SEED = 1003  # the text demos' inputs use 1001 and 1002
N_SHAPES = 100


def shape_pictures(n: int = N_SHAPES) -> list[shapes.Picture]:
    """The held-out pictures of the inputs, in their order."""
    return list(islice(shapes.stream(SHAPES_SEED, held_out=True), n))


def shape_rows(n: int = N_SHAPES) -> list[dict[str, str]]:
    return [
        {
            "id": f"shape-{i:03d}",
            "image": f"shapes/{i:04d}.png",
            "colour": p.colour,
            "shape": p.shape,
        }
        for i, p in enumerate(shape_pictures(n))
    ]


def main(out_dir: Path = INPUTS_DIR) -> None:
    folder = out_dir / "shapes"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.png"):  # a smaller N_SHAPES must not leave old pictures behind
        stale.unlink()
    rows = shape_rows()
    for row, picture in zip(rows, shape_pictures()):
        picture.render().save(out_dir / row["image"], optimize=True)
    (out_dir / "shapes.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {out_dir / 'shapes.jsonl'} and {len(rows)} pictures in {folder}")


if __name__ == "__main__":
    main()
