"""Seeded pictures of one coloured shape, for the demo vision-language model (demo/train_vision.py).

Each picture is a circle, square or triangle in red, green, blue or yellow, of random size and
position, on a white or light-grey background with a little pixel noise. The four colours are far
apart in RGB and the jitter is small, so the colour is never ambiguous; the noise and the jitter
make every picture's pixels differ, so a model cannot learn a lookup of exact values.

*Held out* is by content, as in demo/data.py: a picture whose geometry, colour and background
(`Picture.key`) fall in the held-out bucket of `data.is_held_out` is never produced by the training
stream, so the eval pictures (demo/make_vision_inputs.py) measure generalisation, not recall.

Pictures are 56 x 56: two 28-pixel merge blocks a side, so Qwen2-VL's image processor keeps them
as they are (with `MIN_PIXELS`..`MAX_PIXELS`) and each becomes 16 patches and 4 image tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from demo import data

SHAPES_VERSION = "demo-shapes-v1"  # bump when a picture for a given seed changes
SIZE = 56  # pixels a side: a multiple of 28 (one merge block of 2 x 2 patches of 14 pixels)
# the image processor's bounds: 56 x 56 is within them, so it is never resized
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

SHAPES = ("circle", "square", "triangle")
# far apart in RGB: with COLOUR_JITTER per channel no two colours come near each other
COLOURS = {
    "red": (215, 35, 35),
    "green": (35, 165, 55),
    "blue": (40, 70, 215),
    "yellow": (235, 205, 30),
}
COLOUR_JITTER = 15
BACKGROUNDS = {"white": (255, 255, 255), "grey": (228, 228, 228)}
NOISE_STD = 4.0  # Gaussian pixel noise, so no two pictures have the same pixels
MIN_HALF, MAX_HALF = 7, 20  # the shape's half width in pixels
MARGIN = 2  # pixels between the shape and the picture's edge


@dataclass(frozen=True)
class Picture:
    """What a picture shows (and the seed of its jitter and noise); `render` draws it."""

    shape: str
    colour: str
    half: int  # half the shape's width
    cx: int  # the centre
    cy: int
    background: str
    noise_seed: int

    @property
    def key(self) -> str:
        """The content that decides the held-out split: everything but the jitter and noise,
        so a held-out picture's geometry and colour are never trained on under other noise."""
        return f"{self.shape} {self.colour} {self.half} {self.cx} {self.cy} {self.background}"

    def render(self) -> Image.Image:
        rng = np.random.default_rng(self.noise_seed)
        jitter = rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, 3)
        fill = tuple(int(c) for c in np.clip(np.array(COLOURS[self.colour]) + jitter, 0, 255))
        image = Image.new("RGB", (SIZE, SIZE), BACKGROUNDS[self.background])
        _draw_shape(ImageDraw.Draw(image), self.shape, self.cx, self.cy, self.half, fill)
        pixels = np.asarray(image, dtype=np.float64) + rng.normal(0, NOISE_STD, (SIZE, SIZE, 3))
        return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, cx: int, cy: int, half: int, fill: tuple[int, ...]
) -> None:
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":  # pointing up, its base the box's bottom edge
        draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def random_picture(rng: random.Random) -> Picture:
    """A uniformly drawn shape, colour, size, position (wholly inside) and background."""
    half = rng.randint(MIN_HALF, MAX_HALF)
    low, high = MARGIN + half, SIZE - 1 - MARGIN - half
    return Picture(
        shape=rng.choice(SHAPES),
        colour=rng.choice(list(COLOURS)),
        half=half,
        cx=rng.randint(low, high),
        cy=rng.randint(low, high),
        background=rng.choice(list(BACKGROUNDS)),
        noise_seed=rng.getrandbits(32),
    )


def is_held_out(picture: Picture) -> bool:
    return data.is_held_out(picture.key)


def stream(seed: int, held_out: bool = False) -> Iterator[Picture]:
    """Pictures of one split, in a fixed order for a seed."""
    rng = random.Random(f"{SHAPES_VERSION}/{seed}")
    while True:
        picture = random_picture(rng)
        if is_held_out(picture) == held_out:
            yield picture
