"""An image drawn with what its caption saw: the selected regions as boxes (labelled with their object and
attribute names where the detector's class-name files are given, their ids otherwise, their rank else) and the
caption under the image (``capflow caption --draw``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps

from captioning.features.base import Regions
from captioning.util import atomic_write

COLOURS = ((230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240),
           (240, 50, 230), (210, 245, 60))


def class_names(path: str | Path | None) -> list[str] | None:
    """A class-name file (one class a line, as the bottom-up models' ``objects_vocab.txt``/``attributes_vocab.txt``:
    synonyms after a comma, the first one is used); None without a file."""
    if path is None:
        return None
    return [line.split(",")[0].strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def labels(regions: Regions, objects: list[str] | None = None, attributes: list[str] | None = None) -> list[str]:
    """One label per region: "attribute object" names, "obj 12 attr 3" ids, or its rank when there are none."""
    ex = regions.extras or {}
    obj, attr = ex.get("object_id"), ex.get("attr_id")
    out = []
    for k in range(len(regions)):
        if obj is None:
            out.append(f"#{k + 1}")
            continue
        o = int(obj[k])
        name = objects[o] if objects and 0 <= o < len(objects) else f"obj {o}"
        if attr is not None and int(attr[k]) >= 0:
            a = int(attr[k])
            name = (f"{attributes[a]} {name}" if attributes and 0 <= a < len(attributes) else f"{name} attr {a}")
        out.append(name)
    return out


def draw(image: str | Path, regions: Regions, caption: str, out: str | Path, *, boxes: int = 10,
         objects: list[str] | None = None, attributes: list[str] | None = None) -> Path:
    """``image`` with its first ``boxes`` regions (by score) drawn and ``caption`` below it, written to ``out``
    (the format from its suffix; replaced whole)."""
    with Image.open(image) as im:
        img = ImageOps.exif_transpose(im).convert("RGB")
    w, h = img.size
    font = ImageFont.load_default()
    canvas = Image.new("RGB", (w, h + 28), "white")
    canvas.paste(img, (0, 0))
    pen = ImageDraw.Draw(canvas)
    names = labels(regions, objects, attributes)
    rel = np.asarray(regions.boxes, dtype=np.float64)[:boxes]
    for k, (x1, y1, x2, y2) in enumerate(rel * np.array([w, h, w, h])):
        colour = COLOURS[k % len(COLOURS)]
        pen.rectangle([x1, y1, x2, y2], outline=colour, width=2)
        pen.text((x1 + 3, y1 + 2), names[k], fill=colour, font=font)
    pen.text((4, h + 8), caption, fill="black", font=font)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    fmt = "JPEG" if target.suffix.lower() in (".jpg", ".jpeg") else "PNG"
    return atomic_write(target, lambda f: canvas.save(f, format=fmt), "drawn image")
