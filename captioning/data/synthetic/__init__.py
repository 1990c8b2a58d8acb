"""Deterministic synthetic captioning dataset: coloured shapes on a light canvas.

Every image is drawn with PIL and described by captions that are *true* for what is drawn (colours, shapes,
sizes, counts, relative positions, coarse regions), so a captioning model can only score well by looking at
the pixels. Annotations are written in the Karpathy ``dataset_coco.json`` layout.

All randomness for image ``i`` comes from ``numpy.random.default_rng`` seeded with ``(seed, i, stream)``, so
an image never depends on how many images are generated, and the same seed always gives byte-identical files.

Modules: :mod:`~captioning.data.synthetic.scene` (palette, shapes, scene sampling),
:mod:`~captioning.data.synthetic.render` (drawing), :mod:`~captioning.data.synthetic.captions` (true captions),
:mod:`~captioning.data.synthetic.dataset` (writing the images and ``dataset.json``).
"""

from captioning.data.synthetic.captions import MAX_CAPTION_WORDS, NUMBER_WORDS, captions_for
from captioning.data.synthetic.dataset import (
    COCOID_OFFSET,
    IMAGE_SUBDIR,
    JPEG_QUALITY,
    RESTVAL_FRACTION,
    generate_synthetic,
    main,
)
from captioning.data.synthetic.render import render_scene
from captioning.data.synthetic.scene import (
    COLOURS,
    SHAPE_WORDS,
    SHAPES,
    SIZE_FRACTIONS,
    SIZE_WORDS,
    Scene,
    SceneObject,
    scene_for,
)
from captioning.data.text import tokenize

__all__ = [
    "COCOID_OFFSET",
    "COLOURS",
    "IMAGE_SUBDIR",
    "JPEG_QUALITY",
    "MAX_CAPTION_WORDS",
    "NUMBER_WORDS",
    "RESTVAL_FRACTION",
    "SHAPES",
    "SHAPE_WORDS",
    "SIZE_FRACTIONS",
    "SIZE_WORDS",
    "Scene",
    "SceneObject",
    "captions_for",
    "generate_synthetic",
    "main",
    "render_scene",
    "scene_for",
    "tokenize",
]
