"""Scenes of the synthetic dataset: the palette, shapes and sizes, and the pure sampling of image ``i``'s scene.

All randomness for image ``i`` comes from ``numpy.random.default_rng`` seeded with ``(seed, i, stream)``
(:func:`image_rng`), so an image never depends on how many images are generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "COLOURS",
    "SHAPES",
    "SHAPE_WORDS",
    "SIZE_FRACTIONS",
    "SIZE_WORDS",
    "STREAM_CAPTIONS",
    "STREAM_META",
    "STREAM_RENDER",
    "STREAM_SCENE",
    "Scene",
    "SceneObject",
    "image_rng",
    "scene_for",
]

# Fixed palette of clearly distinct colours (all dark/saturated enough to stand out on a light background).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (214, 39, 40),
    "green": (40, 160, 50),
    "blue": (31, 90, 220),
    "yellow": (240, 200, 10),
    "purple": (128, 50, 170),
    "orange": (245, 125, 15),
    "black": (30, 30, 30),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")
# (singular, plural) nouns usable for each shape.
SHAPE_WORDS: dict[str, tuple[tuple[str, str], ...]] = {
    "circle": (("circle", "circles"), ("disc", "discs"), ("round shape", "round shapes")),
    "square": (("square", "squares"), ("box", "boxes"), ("block", "blocks")),
    "triangle": (("triangle", "triangles"), ("triangular shape", "triangular shapes")),
    "diamond": (("diamond", "diamonds"), ("rhombus", "rhombuses")),
    "cross": (("cross", "crosses"), ("plus sign", "plus signs"), ("plus shape", "plus shapes")),
}
SIZE_WORDS: dict[str, tuple[str, ...]] = {"large": ("large", "big"), "small": ("small", "little", "tiny")}
# Object side length as a fraction of min(width, height): clearly separated ranges.
SIZE_FRACTIONS: dict[str, tuple[float, float]] = {"small": (0.15, 0.21), "large": (0.33, 0.42)}

# Independent random streams per image, so e.g. the split never changes the drawn scene.
STREAM_SCENE, STREAM_RENDER, STREAM_CAPTIONS, STREAM_META = 0, 1, 2, 3


@dataclass(frozen=True)
class SceneObject:
    """One drawn shape. ``bbox`` is half-open ``(x1, y1, x2, y2)`` in pixels."""

    shape: str
    colour: str
    size_word: str
    bbox: tuple[int, int, int, int]
    rgb: tuple[int, int, int]

    @property
    def centre(self) -> tuple[float, float]:
        x1, y1, x2, y2 = self.bbox
        return (x1 + x2) / 2.0, (y1 + y2) / 2.0


@dataclass(frozen=True)
class Scene:
    """A sampled scene: canvas size, light background (gradient from ``background`` to ``background_end``)."""

    width: int
    height: int
    background: tuple[int, int, int]
    objects: list[SceneObject] = field(default_factory=list)
    background_end: tuple[int, int, int] | None = None
    vertical_gradient: bool = True

    def normalised_bbox(self, obj: SceneObject) -> list[float]:
        x1, y1, x2, y2 = obj.bbox
        return [x1 / self.width, y1 / self.height, x2 / self.width, y2 / self.height]


def image_rng(seed: int, index: int, stream: int) -> np.random.Generator:
    """The random stream ``stream`` (``STREAM_*``) of image ``index`` under ``seed``."""
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be non-negative, got seed={seed}, index={index}")
    return np.random.default_rng(np.random.SeedSequence([seed, index, stream]))


def _boxes_clear(a: tuple[int, int, int, int], b: tuple[int, int, int, int], gap: int) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def _place(
    rng: np.random.Generator, side: int, width: int, height: int, placed: Sequence[SceneObject], gap: int
) -> tuple[int, int, int, int] | None:
    margin = 2
    if side + 2 * margin > min(width, height):
        return None
    for _ in range(40):
        x1 = int(rng.integers(margin, width - side - margin + 1))
        y1 = int(rng.integers(margin, height - side - margin + 1))
        box = (x1, y1, x1 + side, y1 + side)
        if all(_boxes_clear(box, o.bbox, gap) for o in placed):
            return box
    return None


def _jitter(
    rgb: tuple[int, int, int], rng: np.random.Generator, amount: int, low: int = 0, high: int = 255
) -> tuple[int, int, int]:
    delta = rng.integers(-amount, amount + 1, size=3)
    r, g, b = (int(v) for v in np.clip(np.asarray(rgb) + delta, low, high))
    return r, g, b


def scene_for(
    index: int, seed: int, *, min_size: int = 96, max_size: int = 192, max_objects: int = 4
) -> Scene:
    """Sample the scene of image ``index`` (pure: depends only on its arguments)."""
    if not 16 <= min_size <= max_size:
        raise ValueError(f"need 16 <= min_size <= max_size, got {min_size}, {max_size}")
    if max_objects < 1:
        raise ValueError(f"max_objects must be >= 1, got {max_objects}")
    rng = image_rng(seed, index, STREAM_SCENE)
    width = int(rng.integers(min_size, max_size + 1))
    height = int(rng.integers(min_size, max_size + 1))

    grey = int(rng.integers(218, 247))
    background = _jitter((grey, grey, grey), rng, 8, low=205, high=252)
    background_end = _jitter(background, rng, 14, low=200, high=252)
    vertical = bool(rng.random() < 0.5)

    base = min(width, height)
    gap = max(2, round(0.03 * base))
    colour_names = list(COLOURS)
    objects: list[SceneObject] = []
    for k in range(int(rng.integers(1, max_objects + 1))):
        if k > 0 and rng.random() < 0.25:  # repeat a colour+shape so that counts ("two red circles") occur
            template = objects[int(rng.integers(len(objects)))]
            shape, colour = template.shape, template.colour
        else:
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            colour = colour_names[int(rng.integers(len(colour_names)))]
        size_word = "large" if rng.random() < 0.5 else "small"
        rgb = _jitter(COLOURS[colour], rng, 10)
        box = None
        for candidate in (size_word, "small") if size_word == "large" else (size_word,):
            lo, hi = SIZE_FRACTIONS[candidate]
            side = max(8, round(base * float(rng.uniform(lo, hi))))
            box = _place(rng, side, width, height, objects, gap)
            if box is not None:
                size_word = candidate
                break
        if box is None:  # canvas is full: fewer objects than planned
            continue
        objects.append(SceneObject(shape=shape, colour=colour, size_word=size_word, bbox=box, rgb=rgb))
    return Scene(width, height, background, objects, background_end, vertical)
