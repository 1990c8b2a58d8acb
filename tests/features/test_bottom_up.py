"""The bottom-up flavours' parts without reference weights: anchors, stem, res5 grid, class order, objectness,
layouts, "+1" NMS and butd's keep rule (the comparison with the ports themselves is test_bottom_up_reference.py)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from captioning.config import BottomUpOptions, ExtractorConfig
from captioning.features.bottom_up import BottomUpStages, caffe_scale, iou_plus_one, nms_plus_one, select_kept
from captioning.features.bottom_up_layout import (
    LayoutError,
    caffe_anchors,
    default_layout,
    detectron2_cell_anchors,
    recognise_layout,
)
from captioning.features.bottom_up_model import BottomUpDetector, _CaffeStem, load_state
from captioning.features.bottom_up_options import REFERENCE, resolved_options

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_caffe_anchor_table():
    a = caffe_anchors()
    assert a.shape == (12, 4)
    # ratio-major (0.5, 1, 2) x scales (4, 8, 16, 32); the scale-8 anchors of the Caffe model
    assert a[1].tolist() == [-84, -40, 99, 55]
    assert a[5].tolist() == [-56, -56, 71, 71]
    assert a[9].tolist() == [-36, -80, 51, 95]
    assert np.all((a[:, 0] + a[:, 2]) / 2 == 7.5) and np.all((a[:, 1] + a[:, 3]) / 2 == 7.5)


def test_detectron2_anchor_table():
    a = detectron2_cell_anchors()
    assert a.shape == (12, 4)
    w, h = a[:, 2] - a[:, 0], a[:, 3] - a[:, 1]
    np.testing.assert_allclose(w * h, np.repeat([64.0**2, 128.0**2, 256.0**2, 512.0**2], 3), rtol=1e-5)
    np.testing.assert_allclose(h / w, np.tile([0.5, 1.0, 2.0], 4), rtol=1e-5)  # size-major
    assert np.all(a[:, 0] == -a[:, 2])  # centred on 0 (offset 0)


def test_caffe_stem_pool_alignment():
    torch.manual_seed(0)
    caffe, d2 = _CaffeStem(True), _CaffeStem(False)
    d2.load_state_dict(caffe.state_dict())
    x = torch.randn(1, 3, 50, 38)  # conv1 -> 25 x 19 (odd): Caffe's ceil pool gives 12 x 9, detectron2's 13 x 10
    with torch.no_grad():
        yc, yd = caffe(x), d2(x)
        conv = F.relu(caffe.conv1(x))
    assert yc.shape[-2:] == (12, 9) and yd.shape[-2:] == (13, 10)
    assert torch.equal(yc[0, :, 0, 0], conv[0, :, 0:3, 0:3].amax(dim=(1, 2)))  # window starts at 0 (p0)
    assert torch.equal(yd[0, :, 1, 1], conv[0, :, 1:4, 1:4].amax(dim=(1, 2)))  # window starts at -1 (p1)


def test_res5_grid_is_14x14_dilated():
    torch.manual_seed(0)
    m = BottomUpDetector(default_layout("airsplay"), REFERENCE["airsplay"])
    m7 = BottomUpDetector(default_layout("airsplay"), {**REFERENCE["airsplay"], "res5_dilation": 1})
    x = torch.randn(2, 1024, 14, 14)
    with torch.no_grad():
        assert m.roi_heads.res5(x).shape == (2, 2048, 14, 14)
        assert m7.roi_heads.res5(x).shape == (2, 2048, 7, 7)
    assert m.roi_heads.res5[1].conv2.dilation == (2, 2) and m.roi_heads.res5[1].conv2.padding == (2, 2)
    assert m.roi_heads.res5[0].conv1.stride == (1, 1) and m.roi_heads.res5[0].shortcut.stride == (1, 1)


def _stages(port: str, **opts) -> BottomUpStages:
    m = BottomUpDetector(default_layout(port), {**REFERENCE[port], **opts})
    return BottomUpStages(m, {**REFERENCE[port], **opts}, pre_nms=6000, post_nms=300)


def test_background_position_is_the_layouts():
    """The same probabilities with the background first (MILVLG) or last (airsplay) select the same boxes."""
    rng = np.random.default_rng(0)
    boxes = rng.uniform(0, 300, (40, 2)).astype(np.float32)
    boxes = np.concatenate([boxes, boxes + rng.uniform(5, 100, (40, 2)).astype(np.float32)], axis=1)
    logits = rng.normal(0, 3, (40, 31)).astype(np.float32)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    first = _stages("milvlg").select(boxes, p, conf_threshold=0.2, nms_threshold=0.3, min_boxes=5, max_boxes=30)
    last = _stages("airsplay", selection_nms_inclusive=True).select(
        boxes, np.concatenate([p[:, 1:], p[:, :1]], axis=1), conf_threshold=0.2, nms_threshold=0.3, min_boxes=5,
        max_boxes=30)
    assert np.array_equal(first[0], last[0]) and np.array_equal(first[1], last[1])
    wrong = _stages("airsplay", selection_nms_inclusive=True).select(
        boxes, p, conf_threshold=0.2, nms_threshold=0.3, min_boxes=5, max_boxes=30)
    assert not np.array_equal(first[1], wrong[1])  # reading the background as a class changes the scores


def test_two_logit_objectness_is_the_foreground_softmax():
    """MILVLG's (bg, fg) pairs: the probability equals sigmoid(fg - bg), and the proposal order is the same."""
    torch.manual_seed(1)
    logits = torch.randn(1, 24, 9, 11) * 3
    a = 12
    soft = F.softmax(logits.view(1, 2, a, 9, 11), dim=1)[:, 1]
    sig = torch.sigmoid(logits[:, a:] - logits[:, :a])
    torch.testing.assert_close(soft, sig, rtol=0, atol=1e-7)
    assert torch.equal(soft.flatten().topk(100).indices, sig.flatten().topk(100).indices)


def test_iou_plus_one_and_nms_match_a_plain_loop():
    rng = np.random.default_rng(2)
    xy = rng.uniform(0, 200, (300, 2)).astype(np.float32)
    b = np.concatenate([xy, xy + rng.uniform(0, 60, (300, 2)).astype(np.float32)], axis=1)
    b[7] = b[3]  # an exact duplicate: IoU 1
    scores = rng.uniform(0, 1, 300).astype(np.float32)
    scores[11] = scores[12]  # an exact tie: lower index first

    def plain(th, inclusive):  # the kernels' loop, one pair at a time in float32
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        area = (b[:, 2] - b[:, 0] + np.float32(1)) * (b[:, 3] - b[:, 1] + np.float32(1))
        sup, keep = set(), []
        for n, i in enumerate(order):
            if i in sup:
                continue
            keep.append(i)
            for j in order[n + 1:]:
                w = max(np.float32(0), min(b[i, 2], b[j, 2]) - max(b[i, 0], b[j, 0]) + np.float32(1))
                h = max(np.float32(0), min(b[i, 3], b[j, 3]) - max(b[i, 1], b[j, 1]) + np.float32(1))
                inter = np.float32(w * h)
                o = inter / (area[i] + area[j] - inter)
                if (o >= th) if inclusive else (o > th):
                    sup.add(j)
        return keep

    for th, inc in ((0.3, False), (0.3, True), (0.7, True)):
        got = nms_plus_one(torch.from_numpy(b), torch.from_numpy(scores), th, inclusive=inc).tolist()
        assert got == plain(th, inc)
    iou = iou_plus_one(torch.from_numpy(b), torch.from_numpy(b))
    assert float(iou[3, 7]) == 1.0 and torch.equal(iou, iou.T)


def test_keep_rule_order_and_threshold():
    conf = np.array([0.5, 0.1, 0.2, 0.9, 0.2, 0.05], dtype=np.float32)
    thr = float(np.float32(0.2))
    # 4 at or above the threshold, within [2, 5]: proposal order (butd)
    assert select_kept(conf, conf_threshold=thr, min_boxes=2, max_boxes=5).tolist() == [0, 2, 3, 4]
    assert select_kept(conf, conf_threshold=thr, min_boxes=2, max_boxes=5, order="score").tolist() == [3, 0, 2, 4]
    assert select_kept(conf, conf_threshold=thr, min_boxes=2, max_boxes=5, inclusive=False).tolist() == [0, 3]
    # clamped: by score, exact ties lower index first
    assert select_kept(conf, conf_threshold=thr, min_boxes=2, max_boxes=3).tolist() == [3, 0, 2]
    assert select_kept(conf, conf_threshold=0.95, min_boxes=2, max_boxes=3).tolist() == [3, 0]
    # k36 style: min = max
    assert select_kept(conf, conf_threshold=thr, min_boxes=4, max_boxes=4).tolist() == [0, 2, 3, 4]


def test_caffe_scale_rule():
    assert caffe_scale(480, 640, 600, 1000) == 600 / 480
    assert caffe_scale(300, 1000, 600, 1000) == 1.0  # round(2 * 1000) > 1000: the long side decides
    s = caffe_scale(427, 640, 600, 1000)
    assert round(427 * s) == 600 and round(640 * s) == 899


# ---------------------------------------------------------------------- layouts
@pytest.fixture(scope="module")
def states() -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for port in ("airsplay", "milvlg"):
        m = BottomUpDetector(default_layout(port), REFERENCE[port])
        sd = {k: v.numpy() for k, v in m.state_dict().items()}
        if port == "milvlg":  # its res4 BatchNorm counters
            sd["backbone.res4.0.conv1.norm.num_batches_tracked"] = np.zeros((), dtype=np.int64)
        out[port] = sd
    return out


def test_layouts_are_recognised_by_name_and_shape(states):
    a, m = recognise_layout(states["airsplay"]), recognise_layout(states["milvlg"])
    assert (a.port, a.background, a.objectness, a.attributes) == (
        "airsplay", -1, "sigmoid", ("cls_embedding", "fc_attr", "attr_score"))
    assert (m.port, m.background, m.objectness, m.attributes) == (
        "milvlg", 0, "softmax2", ("cls_embed", "attr_linear1", "attr_linear2"))
    assert m.anchors is not None and np.array_equal(m.anchors, caffe_anchors())
    assert m.batchnorm_counters == ("backbone.res4.0.conv1.norm.num_batches_tracked",)
    with pytest.raises(LayoutError, match="flavour is 'airsplay' but these weights are milvlg's"):
        recognise_layout(states["milvlg"], expect="airsplay")


def test_mixed_or_unknown_layouts_are_refused(states):
    mixed = dict(states["airsplay"])
    mixed["roi_heads.box_predictor.cls_embed.weight"] = mixed.pop("roi_heads.box_predictor.cls_embedding.weight")
    with pytest.raises(LayoutError, match="mixes the airsplay and MILVLG layouts"):
        recognise_layout(mixed)
    odd = dict(states["airsplay"])
    odd["proposal_generator.rpn_head.objectness_logits.weight"] = np.zeros((36, 512, 1, 1), np.float32)
    with pytest.raises(LayoutError, match="36 rows for 12 anchors"):
        recognise_layout(odd)
    with pytest.raises(LayoutError, match=r"no \['proposal_generator\.rpn_head\.conv\.weight'"):
        recognise_layout({k: v for k, v in states["airsplay"].items() if "rpn_head.conv." not in k})


def test_every_checkpoint_tensor_is_used(states):
    layout = recognise_layout(states["airsplay"])
    extra = dict(states["airsplay"], **{"roi_heads.box_predictor.attr_extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(LayoutError, match=r"1 tensors the airsplay model does not use: "
                                          r"\['roi_heads\.box_predictor\.attr_extra\.weight'\]"):
        load_state(BottomUpDetector(layout, REFERENCE["airsplay"]), extra, "x.pkl")
    short = {k: v for k, v in states["airsplay"].items() if not k.startswith("roi_heads.res5.2.")}
    with pytest.raises(LayoutError, match="tensors of the airsplay model missing"):
        load_state(BottomUpDetector(layout, REFERENCE["airsplay"]), short, "x.pkl")
    moved = dict(states["airsplay"], **{"proposal_generator.anchor_generator.cell_anchors.0":
                                        detectron2_cell_anchors() * 2})
    with pytest.raises(LayoutError, match="stored anchors differ"):
        load_state(BottomUpDetector(recognise_layout(moved), REFERENCE["airsplay"]), moved, "x.pkl")


def test_port_weights_refused_by_the_stock_flavour_and_loaded_by_their_own(states, tmp_path):
    from captioning.features.extractor import RegionExtractor, make_extractor

    path = tmp_path / "faster_rcnn_from_caffe_attr.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": states["airsplay"], "__author__": "test"}, f)
    with pytest.raises(ValueError, match=r"airsplay bottom-up layout .* set features\.extractor\.flavour: airsplay"):
        RegionExtractor(ExtractorConfig(weights=str(path), device="cpu"))
    with pytest.raises(ValueError, match="milvlg' but these weights are airsplay's"):
        make_extractor(ExtractorConfig(flavour="milvlg", weights=str(path), device="cpu"))
    ex = make_extractor(ExtractorConfig(flavour="airsplay", weights=str(path), device="cpu"))
    assert ex.layout.port == "airsplay" and ex.describe()["deviations"] == {}


def test_options_resolve_over_the_reference():
    o = resolved_options("milvlg", BottomUpOptions(pooler="ROIAlignV2"))
    assert o["pooler"] == "ROIAlignV2" and o["resize"] == "caffe" and o["selection_nms_inclusive"] is True
    with pytest.raises(ValueError, match="bottom-up flavours only"):
        ExtractorConfig(bottom_up={"pooler": "ROIPool"})


def test_caffe_proposals_minimum_side_and_edges():
    """MILVLG's rule: '+1' decode, clip to w-1, proposals whose side + 1 is not above 16 x im_scale dropped."""
    st = _stages("milvlg")
    anchors = torch.tensor([[0.0, 0.0, 5.0, 5.0], [0.0, 0.0, 20.0, 20.0], [90.0, 40.0, 130.0, 70.0]])
    deltas = torch.zeros(3, 4)
    scores = torch.tensor([0.9, 0.8, 0.7])
    got = st._caffe_proposals(deltas, anchors, scores, (60, 100), 1.0)
    # zero deltas move x2 to x2 + 1 (the port's decoder); the clip to (w-1, h-1) leaves the third 10 x 20 px
    assert got.boxes.tolist() == [[0.0, 0.0, 21.0, 21.0]]
    st.opts["rpn_min_size"] = 0.0
    assert st._caffe_proposals(deltas, anchors, scores, (60, 100), 1.0).boxes.shape[0] == 3
    st.opts["rpn_min_size"] = 16.0
    assert st._caffe_proposals(deltas, anchors, scores, (60, 100), 0.25).boxes.shape[0] == 3  # 16 x 0.25 = 4 px
