"""The real features of five COCO images, shared by the feature-import tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

IDS = [57870, 184613, 384029, 391895, 522418]


@pytest.fixture(scope="module")
def bu(external: Path) -> dict[int, dict]:
    """Per image: float32 features, relative boxes (float64 as stored), float32 pixel boxes, (height, width)."""
    root = external / "bu_features"
    files = {int(p.stem.split("_")[-1]): p for p in (external / "images").glob("COCO_*.jpg")}
    out = {}
    for iid in IDS:
        with Image.open(files[iid]) as im:
            h, w = im.height, im.width
        att = np.load(root / "cocobu_att" / f"{iid}.npy")
        rel = np.load(root / "cocobu_box_relative" / f"{iid}.npy")
        assert att.dtype == np.float32 and att.shape[1] == 2048
        px = (rel * np.array([w, h, w, h])).astype(np.float32)
        n = att.shape[0]
        rng = np.random.default_rng(iid)
        out[iid] = {"att": att, "rel": rel, "px": px, "size": (h, w), "n": n,
                    "object_id": rng.integers(0, 1600, n),
                    "object_conf": (0.01 + rng.random(n, dtype=np.float32) * 0.99).astype(np.float32),
                    "attr_id": rng.integers(0, 400, n), "attr_conf": rng.random(n, dtype=np.float32)}
    return out
