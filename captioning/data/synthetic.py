"""Deterministic synthetic captioning dataset: coloured shapes on a light canvas.

Every image is drawn with PIL and described by captions that are *true* for what is drawn (colours, shapes,
sizes, counts, relative positions, coarse regions), so a captioning model can only score well by looking at
the pixels. Annotations are written in the Karpathy ``dataset_coco.json`` layout.

All randomness for image ``i`` comes from ``numpy.random.default_rng`` seeded with ``(seed, i, stream)``, so
an image never depends on how many images are generated, and the same seed always gives byte-identical files.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from captioning.data.text import tokenize

__all__ = [
    "COLOURS",
    "SHAPES",
    "SHAPE_WORDS",
    "SIZE_WORDS",
    "Scene",
    "SceneObject",
    "captions_for",
    "generate_synthetic",
    "render_scene",
    "scene_for",
    "tokenize",
]

logger = logging.getLogger(__name__)

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
NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
)

IMAGE_SUBDIR = "shapes"
MAX_CAPTION_WORDS = 16
RESTVAL_FRACTION = 0.05
COCOID_OFFSET = 100000
JPEG_QUALITY = 90

# Independent random streams per image, so e.g. the split never changes the drawn scene.
_STREAM_SCENE, _STREAM_RENDER, _STREAM_CAPTIONS, _STREAM_META = 0, 1, 2, 3



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


def _rng(seed: int, index: int, stream: int) -> np.random.Generator:
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be non-negative, got seed={seed}, index={index}")
    return np.random.default_rng(np.random.SeedSequence([seed, index, stream]))


# ----------------------------------------------------------------------------------------------------
# Scene sampling
# ----------------------------------------------------------------------------------------------------


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
    rng = _rng(seed, index, _STREAM_SCENE)
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


# ----------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    x1, y1, x2, y2 = obj.bbox
    xe, ye = x2 - 1, y2 - 1  # inclusive corners for PIL
    cx, cy = (x1 + xe) / 2.0, (y1 + ye) / 2.0
    fill = obj.rgb
    if obj.shape == "circle":
        draw.ellipse([x1, y1, xe, ye], fill=fill)
    elif obj.shape == "square":
        draw.rectangle([x1, y1, xe, ye], fill=fill)
    elif obj.shape == "triangle":
        draw.polygon([(x1, ye), (xe, ye), (cx, y1)], fill=fill)
    elif obj.shape == "diamond":
        draw.polygon([(cx, y1), (xe, cy), (cx, ye), (x1, cy)], fill=fill)
    elif obj.shape == "cross":
        side = x2 - x1
        thick = max(3, round(side * 0.34))
        off = (side - thick) // 2
        draw.rectangle([x1, y1 + off, xe, y1 + off + thick - 1], fill=fill)
        draw.rectangle([x1 + off, y1, x1 + off + thick - 1, ye], fill=fill)
    else:
        raise ValueError(f"unknown shape {obj.shape!r}")


def render_scene(scene: Scene, rng: np.random.Generator) -> Image.Image:
    """Draw ``scene``: light gradient background with mild integer noise, then flat-coloured shapes."""
    w, h = scene.width, scene.height
    start = np.asarray(scene.background, dtype=np.float64)
    end = np.asarray(scene.background_end or scene.background, dtype=np.float64)
    if scene.vertical_gradient:
        t = np.linspace(0.0, 1.0, h, dtype=np.float64)[:, None, None]
    else:
        t = np.linspace(0.0, 1.0, w, dtype=np.float64)[None, :, None]
    base = np.broadcast_to(np.rint(start + (end - start) * t).astype(np.int16), (h, w, 3))
    noise = rng.integers(-3, 4, size=(h, w, 3), dtype=np.int16)
    pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, mode="RGB")
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        _draw_object(draw, obj)
    return image


# ----------------------------------------------------------------------------------------------------
# Captions
# ----------------------------------------------------------------------------------------------------

_REL_PHRASES: dict[str, tuple[str, ...]] = {
    "left": ("to the left of", "left of", "on the left of"),
    "right": ("to the right of", "right of", "on the right of"),
    "above": ("above", "over"),
    "below": ("below", "under", "beneath"),
}
_REGION_PHRASES: dict[tuple[str, str], tuple[str, ...]] = {
    ("top", "left"): ("in the top left corner",),
    ("top", "right"): ("in the top right corner",),
    ("bottom", "left"): ("in the bottom left corner",),
    ("bottom", "right"): ("in the bottom right corner",),
    ("top", "middle"): ("at the top",),
    ("bottom", "middle"): ("at the bottom",),
    ("middle", "left"): ("on the left side",),
    ("middle", "right"): ("on the right side",),
    ("middle", "middle"): ("in the centre", "in the middle"),
}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _count_word(n: int) -> str:
    return NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else str(n)


def _third(frac: float, low: str, high: str) -> str | None:
    """Which third ``frac`` falls in, or None when too close to a boundary to be stated safely."""
    margin = 0.04
    if frac < 1 / 3 - margin:
        return low
    if 1 / 3 + margin < frac < 2 / 3 - margin:
        return "middle"
    if frac > 2 / 3 + margin:
        return high
    return None


def _relation(a: SceneObject, b: SceneObject) -> str | None:
    """Spatial relation of ``a`` w.r.t. ``b`` along the dominant separated axis (bboxes strictly apart)."""
    candidates: list[tuple[float, str]] = []
    if a.bbox[2] <= b.bbox[0]:
        candidates.append((b.bbox[0] - a.bbox[2], "left"))
    if b.bbox[2] <= a.bbox[0]:
        candidates.append((a.bbox[0] - b.bbox[2], "right"))
    if a.bbox[3] <= b.bbox[1]:
        candidates.append((b.bbox[1] - a.bbox[3], "above"))
    if b.bbox[3] <= a.bbox[1]:
        candidates.append((a.bbox[1] - b.bbox[3], "below"))
    if not candidates:
        return None
    return max(candidates)[1]


class _Captioner:
    """Caption templates for one scene; every template returns a true statement or None."""

    def __init__(self, scene: Scene, rng: np.random.Generator) -> None:
        self.scene = scene
        self.rng = rng
        self.objects = scene.objects

    # ---- small helpers ----
    def choice(self, options: Sequence[str]) -> str:
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def noun(self, shape: str, plural: bool = False) -> str:
        singular, plural_form = SHAPE_WORDS[shape][int(self.rng.integers(len(SHAPE_WORDS[shape])))]
        return plural_form if plural else singular

    def size(self, size_word: str) -> str:
        return self.choice(SIZE_WORDS[size_word])

    def phrase(self, obj: SceneObject, with_size: bool, determiner: str = "a") -> str:
        words = ([self.size(obj.size_word)] if with_size else []) + [obj.colour, self.noun(obj.shape)]
        body = " ".join(words)
        det = _article(body) if determiner == "a" else determiner
        return f"{det} {body}"

    def referring(self, obj: SceneObject, determiner: str = "a", size_p: float = 0.4) -> str | None:
        """A phrase that identifies ``obj`` uniquely in the scene, or None if impossible."""
        same = [o for o in self.objects if o.colour == obj.colour and o.shape == obj.shape]
        if len(same) == 1:
            return self.phrase(obj, self.chance(size_p), determiner)
        if sum(o.size_word == obj.size_word for o in same) == 1:
            return self.phrase(obj, True, determiner)
        return None

    def shapes_word(self, n: int) -> str:
        return f"{_count_word(n)} {self.choice(('shapes', 'objects')) if n > 1 else 'shape'}"

    @staticmethod
    def join(items: Sequence[str]) -> str:
        if len(items) == 1:
            return items[0]
        return ", ".join(items[:-1]) + " and " + items[-1]

    def groups(self) -> list[str]:
        """Group phrases ("two red circles", "a big blue box") covering every object exactly once."""
        by_size = self.chance(0.3)
        keyed: dict[tuple[str, ...], list[SceneObject]] = {}
        for o in self.objects:
            key = (o.colour, o.shape, o.size_word) if by_size else (o.colour, o.shape)
            keyed.setdefault(key, []).append(o)
        items = []
        for key, members in keyed.items():
            first = members[0]
            uniform = all(m.size_word == first.size_word for m in members)
            # when grouping by size, two groups of the same colour+shape must be told apart by their size word
            needs_size = by_size and any(k[:2] == key[:2] and k != key for k in keyed)
            with_size = needs_size or (uniform and self.chance(0.4))
            if len(members) == 1:
                items.append(self.phrase(first, with_size))
            else:
                words = [_count_word(len(members))]
                words += [self.size(first.size_word)] if with_size else []
                words += [first.colour, self.noun(first.shape, plural=True)]
                items.append(" ".join(words))
        order = self.rng.permutation(len(items))
        return [items[int(i)] for i in order]

    # ---- templates ----
    def t_list(self) -> str | None:
        items = self.groups()
        body = self.join(items)
        n = len(self.objects)
        if n == 1:
            intro = self.choice(("", "there is ", "a picture of ", "an image showing ", "a single shape: "))
        else:
            intro = self.choice(
                (
                    "",
                    f"a picture of {self.shapes_word(n)}: ",
                    f"an image with {self.shapes_word(n)}: ",
                    f"{self.shapes_word(n)}: ",
                    "there is " if items[0].split()[0] in ("a", "an") else "there are ",
                    "a drawing of ",
                    "this image shows ",
                )
            )
        suffix = self.choice(("", "", " on a light background", " on a plain background"))
        return intro + body + suffix

    def t_single(self) -> str | None:
        if len(self.objects) != 1:
            return None
        obj = self.objects[0]
        with_size = self.chance(0.6)
        words = ([self.size(obj.size_word)] if with_size else []) + [obj.colour, self.noun(obj.shape)]
        core = " ".join(words)
        frame = self.choice(
            (
                "a single {c}",
                "just one {c} on a light background",
                "only one {c} in the picture",
                "one lone {c}",
                "a picture of a single {c}",
            )
        )
        return frame.format(c=core)

    def t_relation(self) -> str | None:
        eligible = [o for o in self.objects if self.referring(o) is not None]
        if len(eligible) < 2:
            return None
        i, j = (int(k) for k in self.rng.choice(len(eligible), size=2, replace=False))
        a, b = eligible[i], eligible[j]
        rel = _relation(a, b)
        if rel is None:
            return None
        subj, obj = self.referring(a), self.referring(b)
        assert subj is not None and obj is not None
        prep = self.choice(_REL_PHRASES[rel])
        frame = self.choice(
            (
                "{s} {r} {o}",
                "there is {s} {r} {o}",
                "{s} is {r} {o}",
                "a picture of {s} {r} {o}",
                "{s} sits {r} {o}",
                "{s} placed {r} {o}",
            )
        )
        text = frame.format(s=subj, r=prep, o=obj)
        n = len(self.objects)
        if n > 2 and self.chance(0.35):
            text += f", in a scene of {self.shapes_word(n)}"
        return text

    def t_compare_size(self) -> str | None:
        eligible = [o for o in self.objects if self.referring(o) is not None]
        larges = [o for o in eligible if o.size_word == "large"]
        smalls = [o for o in eligible if o.size_word == "small"]
        pairs = [(a, b) for a in larges for b in smalls]
        if not pairs:
            return None
        big, small = pairs[int(self.rng.integers(len(pairs)))]
        if self.chance(0.5):
            first, second, cmp_word = big, small, self.choice(("bigger", "larger"))
        else:
            first, second, cmp_word = small, big, "smaller"
        s, o = self.referring(first, "the", 0.0), self.referring(second, "the", 0.0)
        assert s is not None and o is not None
        frame = self.choice(
            ("{s} is {c} than {o}", "{s} looks {c} than {o}", "in this picture {s} is {c} than {o}")
        )
        return frame.format(s=s, c=cmp_word, o=o)

    def t_region(self) -> str | None:
        placed = []
        for o in self.objects:
            cx, cy = o.centre
            v = _third(cy / self.scene.height, "top", "bottom")
            hz = _third(cx / self.scene.width, "left", "right")
            if v is not None and hz is not None:
                placed.append((o, self.choice(_REGION_PHRASES[(v, hz)])))
        if not placed:
            return None
        obj, region = placed[int(self.rng.integers(len(placed)))]
        mention = self.phrase(obj, self.chance(0.5))
        if self.chance(0.4):
            region += self.choice((" of the image", " of the picture"))
        frame = self.choice(
            ("{m} {r}", "there is {m} {r}", "an image with {m} {r}", "the picture shows {m} {r}")
        )
        return frame.format(m=mention, r=region)

    def t_order(self) -> str | None:
        if len(self.objects) < 2:
            return None
        horizontal = self.chance(0.6)
        lo, hi = (0, 2) if horizontal else (1, 3)
        ordered = sorted(self.objects, key=lambda o: o.bbox[lo])
        if any(p.bbox[hi] > q.bbox[lo] for p, q in itertools.pairwise(ordered)):
            return None  # not strictly ordered along this axis
        body = self.join([self.phrase(o, self.chance(0.3)) for o in ordered])
        direction = "from left to right" if horizontal else "from top to bottom"
        return f"{direction}: {body}" if self.chance(0.5) else f"{body}, {direction}"


def captions_for(scene: Scene, rng: np.random.Generator, n: int) -> list[str]:
    """``n`` varied, true captions (raw strings, at most 16 words) for ``scene``."""
    if not scene.objects:
        raise ValueError("scene has no objects")
    cap = _Captioner(scene, rng)
    templates: list[Callable[[], str | None]] = [
        cap.t_list,
        cap.t_relation,
        cap.t_region,
        cap.t_relation,
        cap.t_compare_size,
        cap.t_order,
        cap.t_single,
        cap.t_list,
    ]
    order = [templates[int(i)] for i in rng.permutation(len(templates))]
    captions: list[str] = []
    seen: set[tuple[str, ...]] = set()
    attempt = 0
    fallback: list[str] = []
    while len(captions) < n and attempt < 40 * n:
        text = order[attempt % len(order)]()
        attempt += 1
        if text is None or len(text.split()) > MAX_CAPTION_WORDS:
            continue
        fallback.append(text)
        key = tuple(tokenize(text))
        if key in seen:
            continue
        seen.add(key)
        if rng.random() < 0.5:
            text = text[0].upper() + text[1:]
        if rng.random() < 0.5:
            text += "."
        captions.append(text)
    while len(captions) < n:  # tiny scenes may run out of distinct sentences; repeat rather than fail
        if not fallback:
            raise RuntimeError("could not build any caption")  # pragma: no cover - every scene has t_list
        captions.append(fallback[len(captions) % len(fallback)])
    return captions


# ----------------------------------------------------------------------------------------------------
# Dataset generation
# ----------------------------------------------------------------------------------------------------


def _split_and_format(
    seed: int, index: int, png_fraction: float, val_fraction: float, test_fraction: float
) -> tuple[str, str]:
    rng = _rng(seed, index, _STREAM_META)
    u = float(rng.random())
    if u < test_fraction:
        split = "test"
    elif u < test_fraction + val_fraction:
        split = "val"
    else:
        split = "train"
    restval = rng.random() < RESTVAL_FRACTION
    if split == "train" and restval:
        split = "restval"
    ext = "png" if rng.random() < png_fraction else "jpg"
    return split, ext


def _save(image: Image.Image, path: Path, ext: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if ext == "png":
        image.save(tmp, format="PNG", optimize=False, compress_level=6)
    else:
        image.save(tmp, format="JPEG", quality=JPEG_QUALITY, optimize=False, subsampling=0)
    os.replace(tmp, path)


def generate_synthetic(
    out_dir: str | Path,
    num_images: int,
    seed: int = 0,
    *,
    min_size: int = 96,
    max_size: int = 192,
    max_objects: int = 4,
    png_fraction: float = 0.3,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    captions_per_image: int = 5,
    progress: bool = False,
) -> Path:
    """Writes out_dir/images/<split-agnostic subfolder>/<name>.{jpg,png} and out_dir/dataset.json.

    Returns the JSON path. Image ``i`` depends only on ``(seed, i)`` and the drawing parameters, never on
    ``num_images``; the same arguments always produce byte-identical files.
    """
    if num_images < 0:
        raise ValueError(f"num_images must be >= 0, got {num_images}")
    if captions_per_image < 1:
        raise ValueError(f"captions_per_image must be >= 1, got {captions_per_image}")
    fractions = {"png_fraction": png_fraction, "val_fraction": val_fraction, "test_fraction": test_fraction}
    for name, value in fractions.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if val_fraction + test_fraction > 1.0:
        raise ValueError("val_fraction + test_fraction must be <= 1")

    out = Path(out_dir)
    image_dir = out / "images" / IMAGE_SUBDIR
    image_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    entries: list[dict] = []
    sentid = 0
    for i in tqdm(range(num_images), desc="synthetic images", disable=not progress, unit="img"):
        scene = scene_for(i, seed, min_size=min_size, max_size=max_size, max_objects=max_objects)
        split, ext = _split_and_format(seed, i, png_fraction, val_fraction, test_fraction)
        filename = f"synthetic_{i:06d}.{ext}"
        _save(render_scene(scene, _rng(seed, i, _STREAM_RENDER)), image_dir / filename, ext)
        raws = captions_for(scene, _rng(seed, i, _STREAM_CAPTIONS), captions_per_image)
        sentences = []
        for raw in raws:
            sentences.append({"tokens": tokenize(raw), "raw": raw, "imgid": i, "sentid": sentid})
            sentid += 1
        entries.append(
            {
                "filepath": IMAGE_SUBDIR,
                "filename": filename,
                "imgid": i,
                "split": split,
                "cocoid": COCOID_OFFSET + i,
                "sentids": [s["sentid"] for s in sentences],
                "sentences": sentences,
                "objects": [
                    {
                        "shape": o.shape,
                        "colour": o.colour,
                        "size": o.size_word,
                        "bbox": [round(v, 6) for v in scene.normalised_bbox(o)],
                    }
                    for o in scene.objects
                ],
                "width": scene.width,
                "height": scene.height,
            }
        )
    json_path = out / "dataset.json"
    tmp = json_path.with_name(json_path.name + ".tmp")
    tmp.write_text(json.dumps({"dataset": "synthetic", "images": entries}, indent=None), encoding="utf-8")
    os.replace(tmp, json_path)
    logger.info(
        "wrote %d synthetic images (%d captions) to %s in %.1fs",
        num_images,
        sentid,
        out,
        time.perf_counter() - started,
    )
    return json_path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate the synthetic shapes captioning dataset.")
    parser.add_argument("out_dir")
    parser.add_argument("num_images", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(generate_synthetic(args.out_dir, args.num_images, args.seed, progress=True))


if __name__ == "__main__":
    main()
