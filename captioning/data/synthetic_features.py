"""Informative region features for the synthetic dataset, written directly as a feature store.

A detector with random weights (the demo's default: no pretrained weights can be downloaded here) produces
features that carry little of what the captions talk about. To check that the *training recipe* learns -
independently of the detector - this module writes the feature store a perfect detector would produce: one
region per drawn object whose feature encodes the object's attributes (shape, colour, size word, box
geometry), plus a few background regions, all projected through a fixed random matrix to ``feature_dim`` and
perturbed with Gaussian noise. Boxes are the objects' true normalised boxes. Region order is shuffled per image,
so a model has to read the features, not positions in the list.

The scene of image ``i`` is recomputed from the synthetic generator's seed (``scene_for``), so the features
always describe exactly what the image shows and what its captions say.
"""

from __future__ import annotations

import numpy as np

from captioning.config import SyntheticConfig
from captioning.data.karpathy import Dataset
from captioning.data.plans import ExtractPlan
from captioning.data.stores import OK, FeatureStore
from captioning.data.synthetic import COCOID_OFFSET, COLOURS, SHAPES, scene_for
from captioning.progress import bar as progress_bar

_SIZES = ("small", "large")
#: attribute layout: shape one-hot, colour one-hot, size one-hot, box (x1, y1, x2, y2, cx, cy, w, h), background
ATTRIBUTES = len(SHAPES) + len(COLOURS) + len(_SIZES) + 8 + 1


def _attributes(shape: str | None, colour: str | None, size: str | None, box: np.ndarray) -> np.ndarray:
    a = np.zeros(ATTRIBUTES, np.float32)
    o = 0
    if shape is not None:
        a[SHAPES.index(shape)] = 1
    o += len(SHAPES)
    if colour is not None:
        a[o + list(COLOURS).index(colour)] = 1
    o += len(COLOURS)
    if size is not None:
        a[o + _SIZES.index(size)] = 1
    o += len(_SIZES)
    x1, y1, x2, y2 = (float(v) for v in box)
    a[o: o + 8] = (x1, y1, x2, y2, (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1)
    a[-1] = 1.0 if shape is None else 0.0
    return a


def projection(feature_dim: int, seed: int) -> np.ndarray:
    """The fixed (ATTRIBUTES, feature_dim) projection (scaled so projected features have unit-ish norm)."""
    rng = np.random.default_rng([seed, 7919])
    return (rng.standard_normal((ATTRIBUTES, feature_dim)) * 2.0 / np.sqrt(ATTRIBUTES)).astype(np.float32)


def informative_store(ds: Dataset, synthetic: SyntheticConfig, uri: str, *, feature_dim: int = 64,
                      max_boxes: int = 16, background: tuple[int, int] = (2, 5), noise: float = 0.1,
                      chunk_rows: int = 16, dtype: str = "float16", compressor: str = "lz4", seed: int = 0,
                      overwrite: bool = True, progress: bool = False) -> FeatureStore:
    """Write the informative feature store for ``ds`` (rows in dataset order, like an extracted store)."""
    need = synthetic.max_objects + background[1]
    if max_boxes < need:
        raise ValueError(f"max_boxes={max_boxes} cannot hold {synthetic.max_objects} objects + "
                         f"{background[1]} background regions")
    ids = [e.image_id for e in ds.images]
    store = FeatureStore.create(
        uri, ids, max_boxes=max_boxes, feature_dim=feature_dim, chunk_rows=chunk_rows, dtype=dtype,
        compressor=compressor, overwrite=overwrite,
        attrs={"source": "synthetic-informative", "noise": noise, "seed": seed, "background": list(background),
               "dataset_digest": ds.digest},
    )
    proj = projection(feature_dim, seed)
    for c in progress_bar(range(store.num_chunks), desc="informative features", enabled=progress, unit="chunk"):
        start, stop = store.chunk_range(c)
        n = stop - start
        feats = np.zeros((n, max_boxes, feature_dim), np.float32)
        boxes = np.zeros((n, max_boxes, 4), np.float32)
        nb = np.zeros(n, np.int16)
        size = np.zeros((n, 2), np.int32)
        for k, iid in enumerate(ids[start:stop]):
            index = iid - COCOID_OFFSET
            scene = scene_for(index, synthetic.seed, min_size=synthetic.min_size, max_size=synthetic.max_size,
                              max_objects=synthetic.max_objects)
            rng = np.random.default_rng([seed, index])
            regions = []
            for obj in scene.objects:
                b = np.asarray(scene.normalised_bbox(obj), np.float32)
                regions.append((_attributes(obj.shape, obj.colour, obj.size_word, b), b))
            for _ in range(int(rng.integers(background[0], background[1] + 1))):
                x1, y1 = rng.uniform(0, 0.7, 2)
                w, h = rng.uniform(0.1, 0.3, 2)
                b = np.asarray([x1, y1, min(x1 + w, 1), min(y1 + h, 1)], np.float32)
                regions.append((_attributes(None, None, None, b), b))
            order = rng.permutation(len(regions))
            a = np.stack([regions[i][0] for i in order])
            bx = np.stack([regions[i][1] for i in order])
            f = a @ proj + noise * rng.standard_normal((len(a), feature_dim)).astype(np.float32)
            m = len(a)
            feats[k, :m], boxes[k, :m], nb[k] = f, bx, m
            size[k] = (scene.height, scene.width)
        store.write_rows(start, features=feats, boxes=boxes, num_boxes=nb, image_size=size,
                         status=np.full(n, OK, np.int8), reject_reason=[""] * n)
    return store


def informative_store_for(plan: ExtractPlan, ds: Dataset, uri: str, progress: bool = False) -> FeatureStore:
    """:func:`informative_store` with the plan's feature settings (``features.source`` = ``synthetic-informative``);
    needs the dataset to be the configured synthetic one."""
    if not plan.synthetic_dataset:
        raise ValueError("features.source=synthetic-informative needs the synthetic dataset (dataset.annotations "
                         "is set): informative features are computed from the generator's scenes")
    f = plan.features
    return informative_store(ds, plan.synthetic, uri, feature_dim=f.feature_dim, max_boxes=f.max_boxes,
                             chunk_rows=f.chunk_rows, dtype=f.dtype, compressor=f.compressor, seed=plan.seed,
                             progress=progress)
