"""RegionExtractor on a small R50-C4 config (random weights, CPU): shapes, determinism, box modes, checkpoints."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from captioning.config import ExtractorConfig
from captioning.features.extractor import (
    RANDOM_WEIGHTS_WARNING,
    ExtractionError,
    RegionExtractor,
    Regions,
    resolve_weights,
)
from captioning.features.images import load_rgb
from captioning.features.selection import nms_max_conf_batched, nms_max_conf_reference, overlap_masks

SMALL = dict(
    model_config_file="COCO-Detection/faster_rcnn_R_50_C4_3x.yaml",
    min_size=96,
    max_size=160,
    proposals=30,
    conf_threshold=0.0,
    batch_size=2,
    device="cpu",
)
REAL = [  # (w x h) 640x427, 500x368, 640x480, 640x427 (batched with the first)
    "COCO_val2014_000000078707.jpg",
    "COCO_val2014_000000165547.jpg",
    "COCO_train2014_000000057870.jpg",
    "COCO_val2014_000000060623.jpg",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(**kw) -> ExtractorConfig:
    return ExtractorConfig(**{**SMALL, **kw})


def _same(a: list[Regions], b: list[Regions]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.features, y.features) and np.array_equal(x.boxes, y.boxes)
        and np.array_equal(x.scores, y.scores) and x.image_size == y.image_size
        for x, y in zip(a, b, strict=True)
    )


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()




@pytest.fixture(scope="module")
def images(external) -> list[np.ndarray]:
    return [load_rgb(external / "images" / name) for name in REAL]


@pytest.fixture(scope="module")
def extractor() -> RegionExtractor:
    return RegionExtractor(_cfg())


@pytest.fixture(scope="module")
def regions(extractor, images) -> list[Regions]:
    return extractor(images)


@pytest.fixture(scope="module")
def weights_file(extractor, tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "random_r50.pth"
    torch.save(extractor.model.state_dict(), path)
    return path


# ---------------------------------------------------------------------- outputs
def test_shapes_ranges_and_order(regions, images):
    assert len(regions) == len(images)
    for r, im in zip(regions, images, strict=True):
        n = len(r)
        assert 10 <= n <= 100
        assert r.features.shape == (n, 2048) and r.features.dtype == np.float32
        assert r.boxes.shape == (n, 4) and r.boxes.dtype == np.float32
        assert r.scores.shape == (n,) and r.scores.dtype == np.float32
        assert r.image_size == im.shape[:2]
        for a in (r.features, r.boxes, r.scores):
            assert np.all(np.isfinite(a))
        assert np.all((r.boxes >= 0) & (r.boxes <= 1))
        assert np.all(r.boxes[:, 0] <= r.boxes[:, 2]) and np.all(r.boxes[:, 1] <= r.boxes[:, 3])
        assert np.all(np.diff(r.scores) <= 0), "scores sorted descending"
        assert np.all((r.scores >= 0) & (r.scores <= 1))
        assert np.abs(r.features).max() < 1e4, "identity-residual fix keeps random activations tame"


def test_random_weights_still_give_proposals(regions):
    # conf_threshold 0 keeps every proposal that survived NMS in some class: close to all 30 proposals
    assert all(len(r) >= 25 for r in regions)


def test_random_weights_warn(extractor, caplog):
    assert extractor.random_init is True
    assert extractor.warnings == [RANDOM_WEIGHTS_WARNING]
    assert extractor.weights_digest == f"random-init:0:{SMALL['model_config_file']}"
    with caplog.at_level(logging.WARNING, logger="captioning.features.extractor"):
        RegionExtractor(_cfg(seed=1))
    assert any("RANDOM detector weights" in r.getMessage() for r in caplog.records)


def test_describe_is_json(extractor):
    d = json.loads(json.dumps(extractor.describe()))
    assert d["random_init"] is True and d["device"] == "cpu" and d["num_classes"] == 80
    assert d["weights_digest"] == extractor.weights_digest
    assert d["config"]["min_size"] == 96 and d["detectron2_version"]
    assert d["warnings"] == [RANDOM_WEIGHTS_WARNING]


def test_boxes_map_to_original_image(extractor):
    # a bright square on grey: the same relative boxes whatever the image's scale
    big = np.full((240, 320, 3), 90, dtype=np.uint8)
    big[60:180, 80:240] = 230
    small = big[::2, ::2].copy()
    r_big, r_small = extractor([big, small])
    assert r_big.image_size == (240, 320) and r_small.image_size == (120, 160)
    # both are resized to 96x128: identical network input up to resampling; boxes are relative to each
    assert np.all(r_big.boxes <= 1) and np.all(r_small.boxes <= 1)
    assert np.abs(r_big.boxes[:5] - r_small.boxes[:5]).max() < 0.1


# ---------------------------------------------------------------------- determinism
def test_deterministic_across_calls_and_instances(extractor, images, regions):
    assert _same(extractor(images), regions)
    other = RegionExtractor(_cfg())
    assert _same(other(images), regions)


def test_batch_equals_single(extractor, images, regions):
    singles = [extractor([im])[0] for im in images]
    assert _same(singles, regions)  # bit-exact: batches never pad and the ROI stage runs per image
    # a different batch composition (order reversed, batch size 3) changes nothing either
    again = RegionExtractor(_cfg(batch_size=3))
    assert _same(again(images[::-1])[::-1], regions)


def test_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    RegionExtractor(_cfg())
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------------- box modes
def test_fixed_boxes(images):
    ex = RegionExtractor(_cfg(fixed_boxes=12))
    for r in ex(images[:2]):
        assert r.features.shape == (12, 2048) and r.boxes.shape == (12, 4) and r.scores.shape == (12,)


def test_fixed_boxes_above_max_boxes_is_refused():
    with pytest.raises(ValueError, match="fixed_boxes=36 exceeds max_boxes=20"):
        RegionExtractor(_cfg(fixed_boxes=36), max_boxes=20)


def test_given_boxes(extractor, images, regions):
    given = [regions[0].boxes, np.array([[0, 0, 1, 1], [0.1, 0.2, 0.5, 0.6]], dtype=np.float32),
             np.zeros((0, 4), dtype=np.float32)]
    out = extractor.extract_given(images[:3], given)
    assert [len(r) for r in out] == [len(regions[0]), 2, 0]
    assert out[1].features.shape == (2, 2048) and out[2].features.shape == (0, 2048)
    assert np.array_equal(out[1].boxes, given[1]) and out[1].image_size == images[1].shape[:2]
    # the extractor's own boxes give back (nearly) its own features; scores ignore NMS, so they are >=
    np.testing.assert_allclose(out[0].features, regions[0].features, rtol=1e-3, atol=1e-3)
    assert np.all(out[0].scores >= regions[0].scores - 1e-6)
    assert np.all(np.isfinite(out[1].features)) and np.all((out[1].scores > 0) & (out[1].scores <= 1))


def test_given_boxes_are_validated(extractor, images):
    with pytest.raises(ValueError, match="x1 <= x2"):
        extractor.extract_given(images[:1], [np.array([[0.5, 0, 0.1, 1]])])
    with pytest.raises(ValueError, match=r"\(n, 4\)"):
        extractor.extract_given(images[:1], [np.zeros((3, 5))])
    with pytest.raises(ValueError, match="1 images but 2"):
        extractor.extract_given(images[:1], [np.zeros((0, 4))] * 2)


def test_bad_input_arrays(extractor):
    with pytest.raises(ValueError, match="uint8"):
        extractor([np.zeros((32, 32, 3), dtype=np.float32)])
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        extractor([np.zeros((32, 32), dtype=np.uint8)])


def test_non_finite_outputs_raise(extractor, images):
    w = extractor.model.roi_heads.box_predictor.cls_score.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[0, 0] = float("nan")
        with pytest.raises(ExtractionError, match="non-finite") as info:
            extractor(images[:2])
        assert info.value.index == 0
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert np.all(np.isfinite(extractor(images[:1])[0].scores))


def test_selection_rule():
    def sel(conf, thr=0.5, lo=3, hi=5, fixed=None):
        ns = SimpleNamespace(cfg=SimpleNamespace(conf_threshold=thr, fixed_boxes=fixed), min_boxes=lo, max_boxes=hi)
        return RegionExtractor._select(ns, np.asarray(conf, dtype=np.float32)).tolist()

    assert sel([0.9, 0.1, 0.7, 0.6, 0.2]) == [0, 2, 3]  # all above threshold, sorted
    assert sel([0.1, 0.9, 0.2, 0.3]) == [1, 3, 2]  # too few above: top min_boxes
    assert sel([0.9] * 7) == [0, 1, 2, 3, 4]  # too many: max_boxes; ties keep proposal order
    assert sel([0.1, 0.2]) == [1, 0]  # fewer proposals than min_boxes: what exists
    assert sel([0.1, 0.2, 0.9, 0.8], fixed=2) == [2, 3]
    assert sel([], fixed=2) == []


def test_nms_matches_torchvision_per_class(extractor):
    from torchvision.ops import nms

    g = torch.Generator().manual_seed(0)
    xy = torch.rand(60, 2, generator=g) * 100
    boxes = torch.cat([xy, xy + 10 + torch.rand(60, 2, generator=g) * 40], dim=1)
    scores = torch.softmax(torch.randn(60, 9, generator=g) * 2, dim=1)
    thr = extractor.cfg.nms_threshold
    over = overlap_masks([boxes], thr)[0].numpy()
    got = torch.from_numpy(nms_max_conf_batched([over], [scores.numpy()])[0])
    expected = torch.zeros(60)
    for k in range(9):
        keep = nms(boxes, scores[:, k], thr)
        expected[keep] = torch.maximum(expected[keep], scores[keep, k])
    assert torch.equal(got, expected)
    assert torch.equal(nms_max_conf_reference(boxes, scores, thr), expected)
    assert nms_max_conf_batched([np.zeros((0, 0), bool)], [scores[:0].numpy()])[0].shape == (0,)


def test_synthetic_image(extractor, synthetic_small):
    path = sorted((synthetic_small / "images").rglob("*.jpg"))[0]
    img = load_rgb(path)
    (r,) = extractor([img])
    assert 10 <= len(r) <= 100 and r.features.shape[1] == 2048 and r.image_size == img.shape[:2]
    assert np.all(np.isfinite(r.features)) and np.all((r.boxes >= 0) & (r.boxes <= 1))


# ---------------------------------------------------------------------- weights
def test_weights_roundtrip(weights_file, images, regions):
    sha = _sha(weights_file)
    ex = RegionExtractor(_cfg(weights=str(weights_file), weights_sha256=sha.upper()))
    assert ex.random_init is False and ex.weights_digest == sha and ex.warnings == []
    assert ex.describe()["weights_digest"] == sha
    assert _same(ex(images), regions)


def test_weights_wrong_sha(weights_file):
    sha = _sha(weights_file)
    with pytest.raises(ValueError, match="sha256 mismatch") as info:
        RegionExtractor(_cfg(weights=str(weights_file), weights_sha256="0" * 64))
    assert "0" * 64 in str(info.value) and sha in str(info.value)


def test_weights_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        RegionExtractor(_cfg(weights=str(tmp_path / "nope.pth")))


def test_checkpoint_class_count(extractor, images, tmp_path):
    sd = {k: v.clone() for k, v in extractor.model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    sd["roi_heads.box_predictor.cls_score.weight"] = torch.randn(11, 2048, generator=g) * 0.01
    sd["roi_heads.box_predictor.cls_score.bias"] = torch.zeros(11)
    sd["roi_heads.box_predictor.bbox_pred.weight"] = torch.randn(40, 2048, generator=g) * 0.001
    sd["roi_heads.box_predictor.bbox_pred.bias"] = torch.zeros(40)
    path = tmp_path / "ten_classes.pth"
    torch.save({"model": sd, "iteration": 7}, path)  # detectron2's training checkpoint layout
    ex = RegionExtractor(_cfg(weights=str(path)))
    assert ex.num_classes == 10 and ex.detectron2_cfg.MODEL.ROI_HEADS.NUM_CLASSES == 10
    assert ex.model.roi_heads.box_predictor.cls_score.out_features == 11
    (r,) = ex(images[:1])
    assert len(r) >= 10 and np.all(np.isfinite(r.features))


def test_pkl_checkpoint_with_caffe_box_regressor(extractor, images, regions, tmp_path):
    """detectron2 model-zoo .pkl layout; a Caffe-style box regressor (background row) is not used."""
    sd = {k: v.numpy().copy() for k, v in extractor.model.state_dict().items()}
    sd["roi_heads.box_predictor.bbox_pred.weight"] = np.zeros((81 * 4, 2048), dtype=np.float32)
    sd["roi_heads.box_predictor.bbox_pred.bias"] = np.zeros(81 * 4, dtype=np.float32)
    path = tmp_path / "zoo.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": sd, "__author__": "capflow tests"}, f)
    ex = RegionExtractor(_cfg(weights=str(path)))
    assert ex.num_classes == 80 and ex.warnings == []
    assert _same(ex(images[:2]), regions[:2])  # regressed boxes are never used


def test_checkpoint_tensor_the_model_does_not_use_is_refused(extractor, tmp_path):
    """An extra tensor (e.g. an attribute head) would mean the checkpoint's function is not the one computed."""
    sd = {k: v.numpy().copy() for k, v in extractor.model.state_dict().items()}
    sd["roi_heads.attribute_predictor.attr_linear1.weight"] = np.zeros((512, 2048), dtype=np.float32)
    path = tmp_path / "zoo.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": sd, "__author__": "capflow tests"}, f)
    with pytest.raises(ValueError, match=r"1 tensors the model .* does not use: \['roi_heads.attribute_predictor"):
        RegionExtractor(_cfg(weights=str(path)))


def test_checkpoint_anchors_must_equal_the_configs(extractor, tmp_path):
    sd = {k: v.clone() for k, v in extractor.model.state_dict().items()}
    cell = next(extractor.model.proposal_generator.anchor_generator.cell_anchors.buffers()).clone()
    sd["proposal_generator.anchor_generator.cell_anchors.0"] = cell
    torch.save({"model": sd}, tmp_path / "same.pth")
    RegionExtractor(_cfg(weights=str(tmp_path / "same.pth")))  # equal: loads
    sd["proposal_generator.anchor_generator.cell_anchors.0"] = cell + 1.0
    torch.save({"model": sd}, tmp_path / "shifted.pth")
    with pytest.raises(ValueError, match=r"stored anchors .* differ"):
        RegionExtractor(_cfg(weights=str(tmp_path / "shifted.pth")))


def test_unknown_yaml_keys_are_refused(tmp_path):
    """A hand-written YAML with a bottom-up port's keys: never accepted and ignored."""
    yaml_file = tmp_path / "vg.yaml"
    yaml_file.write_text("MODEL:\n  CAFFE_MAXPOOL: True\n  PROPOSAL_GENERATOR:\n    HID_CHANNELS: 512\n"
                         "  ROI_BOX_HEAD:\n    RES5HALVE: False\n    ATTR: True\n    POOLER_TYPE: ROIPool\n")
    with pytest.raises(ValueError) as info:
        RegionExtractor(_cfg(model_config_file=str(yaml_file)))
    msg = str(info.value)
    for key in ("MODEL.CAFFE_MAXPOOL", "MODEL.PROPOSAL_GENERATOR.HID_CHANNELS", "MODEL.ROI_BOX_HEAD.RES5HALVE",
                "MODEL.ROI_BOX_HEAD.ATTR"):
        assert key in msg
    assert "flavour" in msg and "MODEL.ROI_BOX_HEAD.POOLER_TYPE" not in msg


def test_checkpoint_missing_tensors_is_an_error(extractor, tmp_path):
    sd = {k: v for k, v in extractor.model.state_dict().items() if not k.startswith("roi_heads.res5.2.")}
    path = tmp_path / "partial.pth"
    torch.save(sd, path)
    with pytest.raises(ValueError, match=r"lack \d+ tensors"):
        RegionExtractor(_cfg(weights=str(path)))


def test_unknown_model_config():
    with pytest.raises(ValueError, match="neither a file nor a detectron2 model-zoo config"):
        RegionExtractor(_cfg(model_config_file="COCO-Detection/nope.yaml"))


def test_resolve_local_weights(weights_file, tmp_path):
    assert resolve_weights(str(weights_file), None, tmp_path) == weights_file
    assert resolve_weights(f"file://{weights_file}", _sha(weights_file), tmp_path) == weights_file


@pytest.mark.slow
@pytest.mark.integration
def test_resolve_s3_weights(tmp_path, monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        body = b"not really a model, but bytes to hash"
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="capflow-weights")
        s3.put_object(Bucket="capflow-weights", Key="detector/model.pth", Body=body)
        sha = hashlib.sha256(body).hexdigest()
        local = resolve_weights("s3://capflow-weights/detector/model.pth", sha, tmp_path / "cache")
        assert local.read_bytes() == body and local.name == "model.pth"
        assert resolve_weights("s3://capflow-weights/detector/model.pth", sha, tmp_path / "cache") == local
        with pytest.raises(ValueError, match=f"expected {'1' * 64}, actual {sha}"):
            resolve_weights("s3://capflow-weights/detector/model.pth", "1" * 64, tmp_path / "cache2")
        assert not any(p.is_file() for p in (tmp_path / "cache2").rglob("*"))  # nothing half-written kept
        unpinned = resolve_weights("s3://capflow-weights/detector/model.pth", None, tmp_path / "cache")
        assert unpinned.read_bytes() == body
    finally:
        server.stop()
