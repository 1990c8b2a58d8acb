"""Tests for the synthetic shapes captioning dataset (captioning.data.synthetic)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioning.data.synthetic import (
    COLOURS,
    Scene,
    SceneObject,
    captions_for,
    generate_synthetic,
    scene_for,
)

# Vocabulary written out independently of the generator, so that a generator bug cannot hide itself.
COLOUR_WORDS = {"red", "green", "blue", "yellow", "purple", "orange", "black"}
FOREIGN_COLOURS = {"white", "grey", "gray", "pink", "brown", "cyan", "magenta", "violet", "gold"}
SHAPE_NOUNS: dict[tuple[str, ...], str] = {}
for _shape, _nouns in {
    "circle": ["circle", "circles", "disc", "discs", "round shape", "round shapes"],
    "square": ["square", "squares", "box", "boxes", "block", "blocks"],
    "triangle": ["triangle", "triangles", "triangular shape", "triangular shapes"],
    "diamond": ["diamond", "diamonds", "rhombus", "rhombuses"],
    "cross": ["cross", "crosses", "plus sign", "plus signs", "plus shape", "plus shapes"],
}.items():
    for _noun in _nouns:
        SHAPE_NOUNS[tuple(_noun.split())] = _shape
SIZE_TERMS = {"large": "large", "big": "large", "small": "small", "little": "small", "tiny": "small"}
COUNT_TERMS = {"one": 1, "single": 1, "lone": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}
RELATIONS = {("left", "of"): "left", ("right", "of"): "right", ("above",): "above", ("over",): "above"}
RELATIONS.update({("below",): "below", ("under",): "below", ("beneath",): "below"})
REGION_RE = re.compile(
    r"in the (?P<v1>top|bottom) (?P<h1>left|right) corner|at the (?P<v2>top|bottom)"
    r"|on the (?P<h2>left|right) side|in the (?P<c>centre|middle)"
)

SMALL = {"min_size": 64, "max_size": 128}


@dataclass
class Obj:
    shape: str
    colour: str
    size: str
    bbox: tuple[float, float, float, float]  # normalised x1, y1, x2, y2

    @property
    def cx(self) -> float:
        return (self.bbox[0] + self.bbox[2]) / 2

    @property
    def cy(self) -> float:
        return (self.bbox[1] + self.bbox[3]) / 2


@dataclass
class Mention:
    start: int  # first token (determiner / count / size / colour)
    end: int  # one past the shape noun
    colour: str
    shape: str
    size: str | None
    count: int | None

    def matches(self, o: Obj) -> bool:
        size_ok = self.size is None or o.size == self.size
        return o.colour == self.colour and o.shape == self.shape and size_ok


def tokens_of(raw: str) -> list[str]:
    return re.sub(r"[^\w\s]", "", raw.lower()).split()


def objs_from_entry(entry: dict) -> list[Obj]:
    return [Obj(o["shape"], o["colour"], o["size"], tuple(o["bbox"])) for o in entry["objects"]]


def objs_from_scene(scene: Scene) -> list[Obj]:
    return [Obj(o.shape, o.colour, o.size_word, tuple(scene.normalised_bbox(o))) for o in scene.objects]


def parse_mentions(tokens: list[str]) -> list[Mention]:
    mentions = []
    for i, tok in enumerate(tokens):
        if tok not in COLOUR_WORDS:
            continue
        shape = None
        for length in (2, 1):
            shape = SHAPE_NOUNS.get(tuple(tokens[i + 1 : i + 1 + length]))
            if shape is not None:
                end = i + 1 + length
                break
        assert shape is not None, f"colour word {tok!r} not followed by a shape noun in {tokens}"
        start = i
        size = SIZE_TERMS.get(tokens[i - 1]) if i > 0 else None
        if size is not None:
            start -= 1
        count = COUNT_TERMS.get(tokens[start - 1]) if start > 0 else None
        if start > 0 and (count is not None or tokens[start - 1] in ("a", "an", "the")):
            start -= 1
        mentions.append(Mention(start, end, tok, shape, size, count))
    return mentions


def in_region(o: Obj, vertical: str | None, horizontal: str | None) -> bool:
    def third(v: float) -> str:
        return "low" if v < 1 / 3 else "high" if v > 2 / 3 else "middle"

    want_v = {"top": "low", "bottom": "high", None: "middle"}[vertical]
    want_h = {"left": "low", "right": "high", None: "middle"}[horizontal]
    return third(o.cy) == want_v and third(o.cx) == want_h


def check_caption(raw: str, objects: list[Obj]) -> None:
    """Assert that ``raw`` is a well-formed, true caption of the scene made of ``objects``."""
    assert len(raw.split()) <= 16, raw
    tokens = tokens_of(raw)
    assert all(t.isascii() for t in tokens), raw
    colours_present = {o.colour for o in objects}
    for t in tokens:
        assert t not in FOREIGN_COLOURS, raw
        if t in COLOUR_WORDS:
            assert t in colours_present, f"{raw!r} mentions {t} which is not in the scene"
    mentions = parse_mentions(tokens)
    assert mentions, f"{raw!r} mentions no object"
    for m in mentions:
        matching = [o for o in objects if m.matches(o)]
        assert matching, f"{raw!r}: nothing matches {m}"
        if m.count is not None:
            assert len(matching) == m.count, f"{raw!r}: count {m.count} but {len(matching)} objects"
    # "three shapes" / "a single shape" -> total number of objects
    for k, t in enumerate(tokens[:-1]):
        if t in COUNT_TERMS and tokens[k + 1] in ("shape", "shapes", "objects"):
            assert COUNT_TERMS[t] == len(objects), raw

    # spatial relations between the mention before and the mention after the relation phrase
    for k in range(len(tokens)):
        for phrase, rel in RELATIONS.items():
            if tuple(tokens[k : k + len(phrase)]) != phrase:
                continue
            before = [m for m in mentions if m.end <= k]
            after = [m for m in mentions if m.start >= k + len(phrase)]
            assert before and after, raw
            subj, obj = before[-1], after[0]
            ok = False
            for a in objects:
                for b in objects:
                    if a is b or not (subj.matches(a) and obj.matches(b)):
                        continue
                    # boxes must be fully separated along the axis (so the centres agree as well)
                    ok |= {
                        "left": a.bbox[2] <= b.bbox[0] and a.cx < b.cx,
                        "right": a.bbox[0] >= b.bbox[2] and a.cx > b.cx,
                        "above": a.bbox[3] <= b.bbox[1] and a.cy < b.cy,
                        "below": a.bbox[1] >= b.bbox[3] and a.cy > b.cy,
                    }[rel]
            assert ok, f"{raw!r}: relation {rel} is false"

    # size comparisons
    for k in range(len(tokens) - 1):
        if tokens[k] in ("bigger", "larger", "smaller") and tokens[k + 1] == "than":
            subj = [m for m in mentions if m.end <= k][-1]
            obj = next(m for m in mentions if m.start >= k + 2)
            big_first = tokens[k] != "smaller"
            ok = any(
                subj.matches(a) and obj.matches(b) and (a.size, b.size) == (
                    ("large", "small") if big_first else ("small", "large")
                )
                for a in objects
                for b in objects
                if a is not b
            )
            assert ok, f"{raw!r}: size comparison is false"

    text = " ".join(tokens)
    for direction, axis in (("left to right", 0), ("top to bottom", 1)):
        if direction in text:
            ordered = sorted(objects, key=lambda o: o.bbox[axis])
            assert len(mentions) == len(ordered), raw
            for m, o in zip(mentions, ordered, strict=True):
                assert m.matches(o), f"{raw!r}: wrong order"
            return  # "left"/"right"/"top" in the direction phrase are not regions
    for match in REGION_RE.finditer(text):
        pos = len(text[: match.start()].split())
        subj = [m for m in mentions if m.end <= pos][-1]
        vertical = match.group("v1") or match.group("v2")
        horizontal = match.group("h1") or match.group("h2")
        assert any(subj.matches(o) and in_region(o, vertical, horizontal) for o in objects), (
            f"{raw!r}: region is false"
        )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("syn_a")
    path = generate_synthetic(out, 40, seed=3, **SMALL)
    return path, json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------------
# determinism
# ----------------------------------------------------------------------------------------------------------


def test_same_seed_identical_bytes_different_seed_differs(
    dataset: tuple[Path, dict], tmp_path: Path
) -> None:
    path_a, _ = dataset
    path_b = generate_synthetic(tmp_path / "b", 40, seed=3, **SMALL)
    assert path_b == tmp_path / "b" / "dataset.json"
    assert path_a.read_bytes() == path_b.read_bytes()
    hashes_a = file_hashes(path_a.parent / "images")
    hashes_b = file_hashes(path_b.parent / "images")
    assert len(hashes_a) == 40
    assert hashes_a == hashes_b

    path_c = generate_synthetic(tmp_path / "c", 40, seed=4, **SMALL)
    assert path_c.read_bytes() != path_a.read_bytes()
    hashes_c = file_hashes(path_c.parent / "images")
    common = set(hashes_a) & set(hashes_c)
    assert sum(hashes_a[k] != hashes_c[k] for k in common) >= 0.9 * len(common)
    assert json.loads(path_c.read_text())["images"][0]["sentences"] != json.loads(path_a.read_text())[
        "images"
    ][0]["sentences"]


def test_prefix_stability(tmp_path: Path) -> None:
    p20 = generate_synthetic(tmp_path / "n20", 20, seed=11, **SMALL)
    p25 = generate_synthetic(tmp_path / "n25", 25, seed=11, **SMALL)
    d20, d25 = json.loads(p20.read_text()), json.loads(p25.read_text())
    assert len(d20["images"]) == 20 and len(d25["images"]) == 25
    assert d25["images"][:20] == d20["images"]
    h20, h25 = file_hashes(tmp_path / "n20" / "images"), file_hashes(tmp_path / "n25" / "images")
    assert len(h20) == 20 and len(h25) == 25
    assert {k: h25[k] for k in h20} == h20


def test_scene_for_is_pure() -> None:
    a = scene_for(7, 2, min_size=64, max_size=128)
    b = scene_for(7, 2, min_size=64, max_size=128)
    assert a == b
    assert scene_for(8, 2, min_size=64, max_size=128) != a
    assert scene_for(7, 3, min_size=64, max_size=128) != a
    caps1 = captions_for(a, np.random.default_rng(5), 5)
    caps2 = captions_for(a, np.random.default_rng(5), 5)
    assert caps1 == caps2


# ----------------------------------------------------------------------------------------------------------
# format and files
# ----------------------------------------------------------------------------------------------------------


def test_karpathy_json_format(dataset: tuple[Path, dict]) -> None:
    _, data = dataset
    assert list(data) == ["dataset", "images"] and data["dataset"] == "synthetic"
    next_sentid = 0
    for i, entry in enumerate(data["images"]):
        assert list(entry)[:7] == ["filepath", "filename", "imgid", "split", "cocoid", "sentids", "sentences"]
        assert entry["imgid"] == i and entry["cocoid"] == 100000 + i
        assert entry["filepath"] == "shapes"
        assert entry["split"] in {"train", "val", "test", "restval"}
        assert len(entry["sentences"]) == 5
        assert entry["sentids"] == list(range(next_sentid, next_sentid + 5))
        for sent, sentid in zip(entry["sentences"], entry["sentids"], strict=True):
            assert list(sent) == ["tokens", "raw", "imgid", "sentid"]
            assert sent["sentid"] == sentid and sent["imgid"] == i
            assert sent["tokens"] == tokens_of(sent["raw"])
        next_sentid += 5
        assert 1 <= len(entry["objects"]) <= 4
        for o in entry["objects"]:
            assert set(o) == {"shape", "colour", "size", "bbox"}
            x1, y1, x2, y2 = o["bbox"]
            assert 0.0 <= x1 < x2 <= 1.0 and 0.0 <= y1 < y2 <= 1.0


def test_image_files(dataset: tuple[Path, dict]) -> None:
    path, data = dataset
    sizes = set()
    formats = Counter()
    for entry in data["images"]:
        file = path.parent / "images" / entry["filepath"] / entry["filename"]
        assert file.is_file()
        with Image.open(file) as im:
            im.load()
            formats[im.format] += 1
            assert im.format == {"jpg": "JPEG", "png": "PNG"}[file.suffix[1:]]
            assert im.mode == "RGB"
            assert 64 <= im.width <= 128 and 64 <= im.height <= 128
            assert (im.width, im.height) == (entry["width"], entry["height"])
            sizes.add(im.size)
    assert formats["JPEG"] > 0 and formats["PNG"] > 0
    assert len(sizes) > 20  # independent widths and heights vary


def test_pixels_show_the_described_objects(dataset: tuple[Path, dict]) -> None:
    path, data = dataset
    checked = 0
    palette = {name: np.array(rgb, dtype=float) for name, rgb in COLOURS.items()}
    for entry in data["images"]:
        with Image.open(path.parent / "images" / entry["filepath"] / entry["filename"]) as im:
            pixels = np.asarray(im.convert("RGB"), dtype=float)
        h, w, _ = pixels.shape
        assert pixels[0, 0].min() >= 180, "corner should be light background"
        for o in entry["objects"]:
            x1, y1, x2, y2 = o["bbox"]
            px = pixels[int((y1 + y2) / 2 * h), int((x1 + x2) / 2 * w)]
            dists = {name: np.abs(px - rgb).max() for name, rgb in palette.items()}
            assert dists[o["colour"]] <= 40, (entry["filename"], o, px)
            assert min(dists, key=dists.get) == o["colour"]
            checked += o["shape"] in ("circle", "square")
    assert checked >= 10


def test_splits(tmp_path: Path) -> None:
    path = generate_synthetic(tmp_path, 200, seed=1, min_size=32, max_size=48, captions_per_image=1)
    splits = Counter(e["split"] for e in json.loads(path.read_text())["images"])
    assert set(splits) == {"train", "val", "test", "restval"}
    assert 8 <= splits["val"] <= 36 and 8 <= splits["test"] <= 36
    assert 1 <= splits["restval"] <= 20
    assert splits["train"] >= 120


# ----------------------------------------------------------------------------------------------------------
# captions
# ----------------------------------------------------------------------------------------------------------


def test_generated_captions_are_true(dataset: tuple[Path, dict]) -> None:
    _, data = dataset
    all_distinct = 0
    for entry in data["images"]:
        objects = objs_from_entry(entry)
        raws = [s["raw"] for s in entry["sentences"]]
        assert len(raws) == 5
        distinct = {tuple(tokens_of(r)) for r in raws}
        assert len(distinct) > 1, raws
        all_distinct += len(distinct) == 5
        for raw in raws:
            check_caption(raw, objects)
    assert all_distinct >= 0.9 * len(data["images"])


def test_many_scenes_captions_are_true() -> None:
    """Wider coverage without rendering: scenes and captions sampled directly."""
    word_counts = Counter()
    for i in range(300):
        scene = scene_for(i, 99, max_objects=5)
        objects = objs_from_scene(scene)
        for raw in captions_for(scene, np.random.default_rng(i), 5):
            check_caption(raw, objects)
            word_counts.update(tokens_of(raw))
    # the grammar really uses synonyms, relations, counts and regions
    expected = ("disc", "box", "big", "little", "left", "above", "below", "two", "bigger", "smaller")
    expected += ("corner", "rhombus", "plus")
    for word in expected:
        assert word_counts[word] > 0, word


def two_object_scene(first: tuple[int, int, int, int], second: tuple[int, int, int, int]) -> Scene:
    return Scene(
        width=100,
        height=100,
        background=(240, 240, 240),
        objects=[
            SceneObject("circle", "red", "small", first, COLOURS["red"]),
            SceneObject("square", "blue", "small", second, COLOURS["blue"]),
        ],
    )


@pytest.mark.parametrize(
    ("first", "second", "red_rel", "other_rels"),
    [
        ((5, 40, 25, 60), (70, 40, 90, 60), "left", {"above", "below"}),  # red left of blue
        ((70, 40, 90, 60), (5, 40, 25, 60), "right", {"above", "below"}),  # red right of blue
        ((40, 5, 60, 25), (40, 70, 60, 90), "above", {"left", "right"}),  # red above blue
        ((40, 70, 60, 90), (40, 5, 60, 25), "below", {"left", "right"}),  # red below blue
    ],
)
def test_relations_follow_positions(
    first: tuple[int, int, int, int], second: tuple[int, int, int, int], red_rel: str, other_rels: set[str]
) -> None:
    scene = two_object_scene(first, second)
    objects = objs_from_scene(scene)
    seen = 0
    for k in range(20):
        for raw in captions_for(scene, np.random.default_rng(k), 5):
            check_caption(raw, objects)
            tokens = tokens_of(raw)
            for phrase, rel in RELATIONS.items():
                for j in range(len(tokens)):
                    if tuple(tokens[j : j + len(phrase)]) != phrase:
                        continue
                    assert rel not in other_rels, raw
                    red_first = tokens.index("red") < j
                    assert red_first == (rel == red_rel), raw
                    assert (tokens.index("blue") > j) == red_first, raw
                    seen += 1
    assert seen >= 10


def test_checker_rejects_false_captions() -> None:
    """The caption checker used above must be able to fail."""
    objects = objs_from_scene(two_object_scene((5, 40, 25, 60), (70, 40, 90, 60)))
    check_caption("a red circle to the left of a blue box", objects)
    for false in (
        "a red circle to the right of a blue box",
        "a blue square is left of a red disc",
        "a green circle",
        "two red circles and a blue square",
        "a big red circle",
        "the red circle is bigger than the blue square",
        "three shapes: a red circle and a blue box",
        "from left to right: a blue box and a red circle",
        "a red circle in the top left corner",
        "a red circle on a white background",
    ):
        with pytest.raises(AssertionError):
            check_caption(false, objects)
