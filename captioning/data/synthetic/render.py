"""Drawing a synthetic scene with PIL: a light gradient background with mild noise, then flat-coloured shapes."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from captioning.data.synthetic.scene import Scene, SceneObject

__all__ = ["render_scene"]


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
