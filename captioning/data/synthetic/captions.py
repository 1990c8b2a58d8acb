"""Captions of a synthetic scene: varied templates (lists, relations, sizes, regions, orders), each of which
states only what is true of the drawn scene, or declines."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from captioning.data.synthetic.scene import SHAPE_WORDS, SIZE_WORDS, Scene, SceneObject
from captioning.data.text import tokenize

__all__ = ["MAX_CAPTION_WORDS", "NUMBER_WORDS", "captions_for"]

NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
)
MAX_CAPTION_WORDS = 16

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
