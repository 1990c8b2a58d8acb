"""The informative synthetic feature store: true boxes, and features from which the attributes can be read."""

from __future__ import annotations

import numpy as np

from captioning.config import load_config
from captioning.data.karpathy import read_karpathy
from captioning.data.stores import OK, FeatureStore
from captioning.data.synthetic import COCOID_OFFSET, COLOURS, SHAPES, scene_for
from captioning.data.synthetic_features import ATTRIBUTES, informative_store, projection


def test_store_encodes_objects_linearly(synthetic_small, tmp_path):
    from tests.conftest import SYNTHETIC_SEED

    ds = read_karpathy(synthetic_small / "dataset.json", synthetic_small / "images", image_check="none")
    syn = load_config(overrides=[f"dataset.synthetic.seed={SYNTHETIC_SEED}", "dataset.synthetic.min_size=64",
                                 "dataset.synthetic.max_size=112"]).dataset.synthetic
    st = informative_store(ds, syn, str(tmp_path / "f.zarr"), feature_dim=48, max_boxes=10, noise=0.05, chunk_rows=4)
    st = FeatureStore.open(st.uri)
    assert np.all(st.status() == OK) and list(st.image_ids()) == [e.image_id for e in ds.images]
    feats, boxes = st.read_features(0, st.num_rows)
    nb = st.num_boxes()
    pinv = np.linalg.pinv(projection(48, 0))
    hits = total = 0
    for i, e in enumerate(ds.images):
        scene = scene_for(e.image_id - COCOID_OFFSET, SYNTHETIC_SEED, min_size=64, max_size=112)
        n_obj = len(scene.objects)
        assert n_obj + 2 <= nb[i] <= n_obj + 5
        assert np.all(feats[i, nb[i]:] == 0)
        attrs = feats[i, : nb[i]].astype(np.float32) @ pinv  # decode the attributes back
        objects = [k for k in range(nb[i]) if attrs[k, -1] < 0.5]
        assert len(objects) == n_obj
        for obj in scene.objects:
            want = np.asarray(scene.normalised_bbox(obj), np.float32)
            k = int(np.argmin(np.abs(boxes[i, objects] - want).sum(1)))
            np.testing.assert_allclose(boxes[i, objects[k]], want, atol=1e-6)
            a = attrs[objects[k]]
            hits += SHAPES[int(np.argmax(a[: len(SHAPES)]))] == obj.shape
            hits += list(COLOURS)[int(np.argmax(a[len(SHAPES): len(SHAPES) + len(COLOURS)]))] == obj.colour
            total += 2
    assert len(SHAPES) + len(COLOURS) + 2 + 9 == ATTRIBUTES
    assert hits / total > 0.95
