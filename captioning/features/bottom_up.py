"""The Visual Genome bottom-up detector (Anderson et al. 2018) exactly as its public PyTorch ports compute it.

Two flavours, one per reference, each read from that port's own weights file:

* ``airsplay`` - airsplay/py-bottom-up-attention (a detectron2 fork; ``faster_rcnn_from_caffe[_attr].pkl``,
  detectron2 model-zoo pickles of numpy arrays): detectron2's resize (PIL bilinear on uint8, per-axis scale),
  the VG pixel mean, the Caffe stem pool, a 512-channel RPN with one sigmoid logit per anchor and detectron2's
  proposal rule, 12 anchors (sizes 64-512 x ratios 0.5/1/2), ROIPool 14x14, res5 with stride 1 and dilation 2
  (a 14x14 map, mean-pooled), 1600 classes with the background LAST, the attribute head ``cls_embedding`` /
  ``fc_attr`` / ``attr_score``.
* ``milvlg`` - MILVLG/bottom-up-attention.pytorch (``bua-caffe-frcn-r101-k10-100.pth`` / ``-k36.pth``), whose
  conventions are the original Caffe code's (butd): the mean subtracted before a float bilinear resize by one
  ``im_scale``, a two-logit (background/foreground) softmax objectness, the 12 Caffe anchors stored in the
  checkpoint, the "+1" box coder, clipping to ``w - 1``, a minimum side of ``16 * im_scale`` before the
  top-6000, NMS on "+1" areas suppressing at IoU >= 0.7, the background FIRST, the attribute head
  ``cls_embed`` / ``attr_linear1`` / ``attr_linear2``.

Both select boxes by butd's rule (``tools/generate_tsv.py``): for every class, greedy NMS over the proposals
mapped to original-image pixels ("+1" IoU, suppress when IoU >= 0.3: butd's configured CPU kernel
``cpu_nms.pyx``, and MILVLG's); a proposal's score is
its best surviving class probability; keep scores >= 0.2, at least 10 and at most 100 boxes; the kept boxes in
proposal order when 10 <= n <= 100, by score when clamped (exact ties: lower proposal index first). Every
difference from a reference is an option (:class:`captioning.config.BottomUpOptions`).

The checkpoint's layout is recognised from its tensor names and shapes, never guessed from a config: a file
whose tensors do not form exactly one known layout, or that holds a tensor the model would not use, is refused
with the names. The stages are public methods (``preprocess``, ``backbone``, ``proposals``, ``head``,
``select``) so that tests can compare each with the reference given the reference's previous stage.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from captioning.config import BottomUpOptions
from captioning.errors import InputError
from captioning.features.selection import nms_max_conf_batched

log = logging.getLogger(__name__)

VG_PIXEL_MEAN = (102.9801, 115.9465, 122.7717)  # BGR, both ports
RES_BLOCKS = {"res2": 3, "res3": 4, "res4": 23}  # ResNet-101 trunk (res5 is the ROI head)
SCALE_CLAMP = math.log(1000.0 / 16)  # largest log-scale a box delta may apply (detectron2 and Caffe)
STRIDE = 16  # res4's stride: anchors and ROI pooling
POOL = 14  # ROI pooling resolution

# What each flavour does where the options are unset: the references' own behaviour.
REFERENCE: dict[str, dict[str, Any]] = {
    "airsplay": dict(stem_pool="caffe", res5_dilation=2, pooler="ROIPool", pixel_mean=list(VG_PIXEL_MEAN),
                     resize="detectron2", proposals_rule="detectron2", rpn_nms_inclusive=False, rpn_min_size=0.0,
                     selection_iou="butd", selection_nms_inclusive=True, conf_inclusive=True, order="butd",
                     attributes=True),
    "milvlg": dict(stem_pool="caffe", res5_dilation=2, pooler="ROIPool", pixel_mean=list(VG_PIXEL_MEAN),
                   resize="caffe", proposals_rule="caffe", rpn_nms_inclusive=True, rpn_min_size=16.0,
                   selection_iou="butd", selection_nms_inclusive=True, conf_inclusive=True, order="butd",
                   attributes=True),
}


class LayoutError(InputError, ValueError):
    """A checkpoint that is not exactly one known bottom-up layout (names the tensors at fault)."""


def resolved_options(flavour: str, opts: BottomUpOptions) -> dict[str, Any]:
    """The flavour's reference settings with the options that were set on top."""
    if flavour not in REFERENCE:
        raise ValueError(f"unknown bottom-up flavour {flavour!r} (one of {sorted(REFERENCE)})")
    out = dict(REFERENCE[flavour])
    out.update({k: v for k, v in opts.model_dump().items() if v is not None})
    return out


def deviations(flavour: str, opts: BottomUpOptions) -> dict[str, Any]:
    """The options that differ from the flavour's reference (what names a deviating store)."""
    ref = REFERENCE[flavour]
    return {k: v for k, v in opts.model_dump().items() if v is not None and v != ref[k]}


# ---------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """What a checkpoint is, read from its names and shapes."""

    port: str  # airsplay | milvlg
    num_classes: int  # foreground classes (1600)
    background: int  # row of the background class in cls_score: -1 (last, airsplay) or 0 (first, MILVLG)
    objectness: str  # sigmoid (one logit per anchor) | softmax2 (Caffe background/foreground pairs)
    num_anchors: int
    rpn_hidden: int
    bbox_rows: int
    attributes: tuple[str, str, str] | None  # (embedding, hidden linear, output linear) module names
    num_attributes: int  # attribute classes including "no attribute" (401); 0 without the head
    anchors: np.ndarray | None  # (A, 4) float32 from the checkpoint, when it stores them
    batchnorm_counters: tuple[str, ...]  # num_batches_tracked entries (MILVLG's res4 BatchNorm): no parameters

    def describe(self) -> dict[str, Any]:
        return {"port": self.port, "num_classes": self.num_classes,
                "background": "first" if self.background == 0 else "last", "objectness": self.objectness,
                "num_anchors": self.num_anchors, "rpn_hidden": self.rpn_hidden, "bbox_rows": self.bbox_rows,
                "attributes": bool(self.attributes), "num_attributes": self.num_attributes,
                "anchors_from_checkpoint": self.anchors is not None}


_ATTR_NAMES = {
    "airsplay": ("cls_embedding", "fc_attr", "attr_score"),
    "milvlg": ("cls_embed", "attr_linear1", "attr_linear2"),
}
_P = "roi_heads.box_predictor."
_RPN = "proposal_generator.rpn_head."
_ANCHORS = "proposal_generator.anchor_generator.cell_anchors."


def _shape(state: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    v = state.get(key)
    return None if v is None else tuple(int(d) for d in v.shape)


def recognise_layout(state: Mapping[str, Any], *, expect: str | None = None) -> Layout:
    """The bottom-up layout of ``state`` (name -> array), from its names and shapes.

    airsplay: attribute tensors named ``cls_embedding/fc_attr/attr_score`` (or none), one objectness logit per
    anchor, a class-specific box regressor without a background row (4 x 1600). MILVLG: ``cls_embed/
    attr_linear1/attr_linear2``, two objectness logits per anchor, 4 x 1601 regressor rows. Anything else, or
    a mix, raises :class:`LayoutError` naming the tensors; ``expect`` (the configured flavour) must match.
    """
    need = [_RPN + "conv.weight", _RPN + "objectness_logits.weight", _RPN + "anchor_deltas.weight",
            _P + "cls_score.weight", "backbone.stem.conv1.weight", "roi_heads.res5.0.conv1.weight"]
    missing = [k for k in need if k not in state]
    if missing:
        raise LayoutError(f"not a bottom-up (C4 Faster R-CNN) checkpoint: no {missing}")
    hidden, c_in = _shape(state, _RPN + "conv.weight")[:2]
    obj = _shape(state, _RPN + "objectness_logits.weight")[0]
    deltas = _shape(state, _RPN + "anchor_deltas.weight")[0]
    rows = _shape(state, _P + "cls_score.weight")[0]
    bbox = _shape(state, _P + "bbox_pred.weight")
    if deltas % 4:
        raise LayoutError(f"{_RPN}anchor_deltas.weight has {deltas} rows, not 4 per anchor")
    a = deltas // 4
    have = {port: [n for n in names if f"{_P}{n}.weight" in state] for port, names in _ATTR_NAMES.items()}
    votes: dict[str, list[str]] = {"airsplay": [], "milvlg": []}
    if have["airsplay"]:
        votes["airsplay"].append(f"attribute head {have['airsplay']}")
    if have["milvlg"]:
        votes["milvlg"].append(f"attribute head {have['milvlg']}")
    if obj == a:
        votes["airsplay"].append(f"{obj} objectness logits for {a} anchors (sigmoid)")
    elif obj == 2 * a:
        votes["milvlg"].append(f"{obj} objectness logits for {a} anchors (background/foreground pairs)")
    else:
        raise LayoutError(f"{_RPN}objectness_logits.weight has {obj} rows for {a} anchors (expected {a} or {2 * a})")
    if bbox is not None:
        if bbox[0] == 4 * (rows - 1):
            votes["airsplay"].append(f"{bbox[0]} box-regression rows (no background row)")
        elif bbox[0] == 4 * rows:
            votes["milvlg"].append(f"{bbox[0]} box-regression rows (with the background row)")
        else:
            raise LayoutError(f"{_P}bbox_pred.weight has {bbox[0]} rows for {rows} classes")
    ports = [p for p, v in votes.items() if v]
    if len(ports) != 1:
        raise LayoutError("checkpoint mixes the airsplay and MILVLG layouts: "
                          + "; ".join(f"{p}: {', '.join(v)}" for p, v in votes.items() if v))
    port = ports[0]
    if not votes[port][0].startswith("attribute") and have[port] and len(have[port]) != 3:
        raise LayoutError(f"incomplete attribute head: {have[port]}")
    if have[port] and len(have[port]) != 3:
        raise LayoutError(f"incomplete {port} attribute head: has {have[port]} of {list(_ATTR_NAMES[port])}")
    if expect is not None and expect != port:
        raise LayoutError(f"features.extractor.flavour is {expect!r} but these weights are {port}'s layout ("
                          f"{'; '.join(votes[port])}): set flavour: {port}")
    attrs = _ATTR_NAMES[port] if have[port] else None
    n_attr = _shape(state, f"{_P}{attrs[2]}.weight")[0] if attrs else 0
    anchor_keys = sorted(k for k in state if k.startswith(_ANCHORS))
    anchors = None
    if anchor_keys:
        if anchor_keys != [_ANCHORS + "0"]:
            raise LayoutError(f"expected one anchor level ({_ANCHORS}0), got {anchor_keys}")
        anchors = np.asarray(state[anchor_keys[0]], dtype=np.float32)
        if anchors.shape != (a, 4):
            raise LayoutError(f"{anchor_keys[0]} has shape {anchors.shape}, expected ({a}, 4)")
    if c_in != 1024:
        raise LayoutError(f"{_RPN}conv.weight reads {c_in} channels; a ResNet C4 res4 has 1024")
    counters = tuple(k for k in state if k.endswith(".num_batches_tracked"))
    return Layout(port=port, num_classes=rows - 1, background=-1 if port == "airsplay" else 0,
                  objectness="sigmoid" if port == "airsplay" else "softmax2", num_anchors=a, rpn_hidden=hidden,
                  bbox_rows=bbox[0] if bbox else 0, attributes=attrs, num_attributes=n_attr, anchors=anchors,
                  batchnorm_counters=counters)


def default_layout(port: str) -> Layout:
    """The released models' layout (used for random weights, when no checkpoint is given)."""
    attrs = _ATTR_NAMES[port]
    return Layout(port=port, num_classes=1600, background=-1 if port == "airsplay" else 0,
                  objectness="sigmoid" if port == "airsplay" else "softmax2", num_anchors=12, rpn_hidden=512,
                  bbox_rows=6400 if port == "airsplay" else 6404, attributes=attrs, num_attributes=401,
                  anchors=caffe_anchors() if port == "milvlg" else None, batchnorm_counters=())


# ---------------------------------------------------------------------- anchors
def detectron2_cell_anchors(sizes=(64, 128, 256, 512), ratios=(0.5, 1.0, 2.0)) -> np.ndarray:
    """detectron2's cell anchors (size-major, centred on 0, unquantised): airsplay's 12."""
    out = []
    for size in sizes:
        area = float(size) ** 2
        for r in ratios:
            w = math.sqrt(area / r)
            h = r * w
            out.append([-w / 2.0, -h / 2.0, w / 2.0, h / 2.0])
    return np.asarray(out, dtype=np.float32)


def caffe_anchors(base: int = 16, ratios=(0.5, 1.0, 2.0), scales=(4, 8, 16, 32)) -> np.ndarray:
    """The Caffe Faster R-CNN anchors (ratio-major, integer, inclusive "+1" boxes centred on (base-1)/2)."""
    ctr = (base - 1) / 2.0
    size = base * base
    out = []
    for r in ratios:
        ws = float(np.round(np.sqrt(size / r)))
        hs = float(np.round(ws * r))
        for s in scales:
            w, h = ws * s, hs * s
            out.append([ctr - 0.5 * (w - 1), ctr - 0.5 * (h - 1), ctr + 0.5 * (w - 1), ctr + 0.5 * (h - 1)])
    return np.asarray(out, dtype=np.float32)


def grid_anchors(cell: torch.Tensor, height: int, width: int, stride: int = STRIDE) -> torch.Tensor:
    """(H * W * A, 4): the cell anchors shifted to every map position, row-major, anchors fastest."""
    sx = torch.arange(0, width * stride, step=stride, dtype=torch.float32, device=cell.device)
    sy = torch.arange(0, height * stride, step=stride, dtype=torch.float32, device=cell.device)
    yy, xx = torch.meshgrid(sy, sx, indexing="ij")
    xx, yy = xx.reshape(-1), yy.reshape(-1)
    shifts = torch.stack((xx, yy, xx, yy), dim=1)
    return (shifts.view(-1, 1, 4) + cell.view(1, -1, 4)).reshape(-1, 4)


# ---------------------------------------------------------------------- box arithmetic
def decode_boxes(deltas: torch.Tensor, anchors: torch.Tensor, *, plus_one: bool) -> torch.Tensor:
    """Apply (dx, dy, dw, dh) deltas (weights 1) to boxes; ``plus_one``: Caffe's inclusive widths."""
    one = 1.0 if plus_one else 0.0
    widths = anchors[:, 2] - anchors[:, 0] + one
    heights = anchors[:, 3] - anchors[:, 1] + one
    ctr_x = anchors[:, 0] + 0.5 * widths
    ctr_y = anchors[:, 1] + 0.5 * heights
    dx, dy = deltas[:, 0], deltas[:, 1]
    dw = torch.clamp(deltas[:, 2], max=SCALE_CLAMP)
    dh = torch.clamp(deltas[:, 3], max=SCALE_CLAMP)
    px = dx * widths + ctr_x
    py = dy * heights + ctr_y
    pw = torch.exp(dw) * widths
    ph = torch.exp(dh) * heights
    return torch.stack((px - 0.5 * pw, py - 0.5 * ph, px + 0.5 * pw, py + 0.5 * ph), dim=1)


def iou_plus_one(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(n, m) IoU of inclusive-pixel boxes (Caffe's "+1" widths), in the boxes' dtype, with the NMS kernels'
    operation order: inter / (area_a + area_b - inter)."""
    area_a = (a[:, 2] - a[:, 0] + 1) * (a[:, 3] - a[:, 1] + 1)
    area_b = (b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)
    xx1 = torch.maximum(a[:, None, 0], b[None, :, 0])
    yy1 = torch.maximum(a[:, None, 1], b[None, :, 1])
    xx2 = torch.minimum(a[:, None, 2], b[None, :, 2])
    yy2 = torch.minimum(a[:, None, 3], b[None, :, 3])
    w = torch.clamp(xx2 - xx1 + 1, min=0)
    h = torch.clamp(yy2 - yy1 + 1, min=0)
    inter = w * h
    return inter / (area_a[:, None] + area_b[None, :] - inter)


def nms_plus_one(boxes: torch.Tensor, scores: torch.Tensor, threshold: float, *, inclusive: bool) -> torch.Tensor:
    """Greedy NMS with "+1" areas (Caffe/MILVLG kernels): visit by score (descending, ties lower index first),
    suppress later boxes whose IoU with a kept one is >= (``inclusive``) or > ``threshold``. Kept indices."""
    n = int(boxes.shape[0])
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=boxes.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes[order]
    suppressed = np.zeros(n, dtype=bool)
    keep: list[int] = []
    block = 1024
    for s in range(0, n, block):  # the IoU matrix a block of rows at a time (6000^2 floats would be 144 MB)
        e = min(s + block, n)
        iou = iou_plus_one(b[s:e], b).cpu().numpy()
        over = iou >= threshold if inclusive else iou > threshold
        for i in range(s, e):
            if suppressed[i]:
                continue
            keep.append(i)
            row = over[i - s]
            row[: i + 1] = False
            suppressed |= row
    return order[torch.as_tensor(keep, dtype=torch.int64, device=boxes.device)]


# ---------------------------------------------------------------------- the model
class _CaffeStem(nn.Module):
    """conv1 (7x7 s2 p3, norm) -> ReLU -> max-pool k3 s2 with Caffe's (p0, ceil) or detectron2's (p1) padding."""

    def __init__(self, caffe_pool: bool):
        super().__init__()
        from detectron2.layers import Conv2d, FrozenBatchNorm2d

        self.conv1 = Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False, norm=FrozenBatchNorm2d(64))
        self.caffe_pool = caffe_pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu_(self.conv1(x))
        if self.caffe_pool:
            return F.max_pool2d(x, kernel_size=3, stride=2, padding=0, ceil_mode=True)
        return F.max_pool2d(x, kernel_size=3, stride=2, padding=1)


def _stage(n: int, first_stride: int, c_in: int, c_mid: int, c_out: int, dilation: int = 1) -> nn.Sequential:
    from detectron2.modeling.backbone.resnet import BottleneckBlock

    blocks = []
    for i in range(n):
        blocks.append(BottleneckBlock(c_in if i == 0 else c_out, c_out, bottleneck_channels=c_mid,
                                      stride=first_stride if i == 0 else 1, num_groups=1, norm="FrozenBN",
                                      stride_in_1x1=True, dilation=dilation))
    return nn.Sequential(*blocks)


class _Trunk(nn.Module):
    def __init__(self, caffe_pool: bool):
        super().__init__()
        self.stem = _CaffeStem(caffe_pool)
        self.res2 = _stage(RES_BLOCKS["res2"], 1, 64, 64, 256)
        self.res3 = _stage(RES_BLOCKS["res3"], 2, 256, 128, 512)
        self.res4 = _stage(RES_BLOCKS["res4"], 2, 512, 256, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res4(self.res3(self.res2(self.stem(x))))


class _RPNHead(nn.Module):
    def __init__(self, hidden: int, anchors: int, logits_per_anchor: int):
        super().__init__()
        self.conv = nn.Conv2d(1024, hidden, kernel_size=3, stride=1, padding=1)
        self.objectness_logits = nn.Conv2d(hidden, anchors * logits_per_anchor, kernel_size=1)
        self.anchor_deltas = nn.Conv2d(hidden, anchors * 4, kernel_size=1)


class _AnchorGenerator(nn.Module):
    def __init__(self, cell: np.ndarray):
        super().__init__()
        self.cell_anchors = nn.ParameterList([nn.Parameter(torch.from_numpy(cell.copy()), requires_grad=False)])


class _ProposalGenerator(nn.Module):
    def __init__(self, layout: Layout, cell: np.ndarray):
        super().__init__()
        self.rpn_head = _RPNHead(layout.rpn_hidden, layout.num_anchors, 2 if layout.objectness == "softmax2" else 1)
        self.anchor_generator = _AnchorGenerator(cell)


class _BoxPredictor(nn.Module):
    def __init__(self, layout: Layout):
        super().__init__()
        rows = layout.num_classes + 1
        self.cls_score = nn.Linear(2048, rows)
        if layout.bbox_rows:
            self.bbox_pred = nn.Linear(2048, layout.bbox_rows)  # loaded for the layout check; boxes are proposals
        self.attr_names = layout.attributes
        if layout.attributes:
            emb, hid, out = layout.attributes
            self.add_module(emb, nn.Embedding(rows, 256))
            self.add_module(hid, nn.Linear(2048 + 256, 512))
            self.add_module(out, nn.Linear(512, layout.num_attributes))

    def attributes(self, pooled: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """Attribute probabilities given the class logits (the embedding of the arg-max over ALL classes,
        background included, concatenated with the feature: both ports)."""
        if not self.attr_names:
            return None
        emb, hid, out = (getattr(self, n) for n in self.attr_names)
        x = torch.cat([pooled, emb(torch.argmax(logits, dim=1))], dim=1)
        return F.softmax(out(F.relu(hid(x))), dim=-1)


class _ROIHeads(nn.Module):
    def __init__(self, layout: Layout, dilation: int):
        super().__init__()
        self.res5 = _stage(3, 1 if dilation == 2 else 2, 1024, 512, 2048, dilation=dilation)
        self.box_predictor = _BoxPredictor(layout)


class BottomUpDetector(nn.Module):
    """The bottom-up Faster R-CNN (ResNet-101 C4) with the tensor names of the ports' checkpoints."""

    def __init__(self, layout: Layout, opts: Mapping[str, Any]):
        super().__init__()
        self.layout = layout
        self.opts = dict(opts)
        cell = layout.anchors if layout.anchors is not None else detectron2_cell_anchors()
        self.backbone = _Trunk(opts["stem_pool"] == "caffe")
        self.proposal_generator = _ProposalGenerator(layout, cell)
        self.roi_heads = _ROIHeads(layout, int(opts["res5_dilation"]))
        mean = torch.tensor(opts["pixel_mean"], dtype=torch.float32)
        if mean.shape != (3,):
            raise ValueError(f"bottom_up.pixel_mean needs 3 values (BGR), got {opts['pixel_mean']}")
        self.register_buffer("pixel_mean", mean.view(3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.ones(3, 1, 1), persistent=False)


def load_state(model: BottomUpDetector, state: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Load ``state`` into ``model`` exactly: every model tensor from the file, every file tensor used.

    MILVLG's res4 BatchNorm counters (``num_batches_tracked``) carry no parameter and are the only entries set
    aside (counted in the returned report). Anchors stored in the file are the model's anchors already
    (:func:`recognise_layout`); airsplay's must equal detectron2's generated ones.
    """
    want = model.state_dict()
    layout = model.layout
    skip = set(layout.batchnorm_counters)
    unused = sorted(k for k in state if k not in want and k not in skip)
    missing = sorted(k for k in want if k not in state and not k.startswith(_ANCHORS))
    if unused or missing:
        parts = []
        if unused:
            parts.append(f"{len(unused)} tensors the {layout.port} model does not use: {unused[:8]}")
        if missing:
            parts.append(f"{len(missing)} tensors of the {layout.port} model missing: {missing[:8]}")
        raise LayoutError(f"detector weights {source}: " + "; ".join(parts))
    bad = []
    values: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, ref in want.items():
        if k not in state:  # anchors the file does not store: the generated ones stay
            values[k] = ref
            continue
        v = torch.as_tensor(np.asarray(state[k])) if not isinstance(state[k], torch.Tensor) else state[k]
        if tuple(v.shape) != tuple(ref.shape):
            bad.append(f"{k} {tuple(v.shape)} vs {tuple(ref.shape)}")
        values[k] = v.to(ref.dtype)
    if bad:
        raise LayoutError(f"detector weights {source}: {len(bad)} tensors of the wrong shape, e.g. {bad[:4]}")
    if layout.port == "airsplay" and layout.anchors is not None:
        gen = detectron2_cell_anchors()
        if not np.allclose(layout.anchors, gen, rtol=0, atol=1e-4):
            raise LayoutError(f"detector weights {source}: the stored anchors differ from airsplay's configured "
                              f"anchors (sizes 64-512, ratios 0.5/1/2): {layout.anchors.tolist()}")
    model.load_state_dict(values, strict=True)
    return {"tensors": len(values), "set_aside": sorted(skip)}


def random_init(model: BottomUpDetector, seed: int) -> None:
    """Untrained weights that stay finite through 33 residual blocks (each block's last norm scale zeroed)."""
    from detectron2.modeling.backbone.resnet import BottleneckBlock

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(m.weight, std=0.01 if isinstance(m, nn.Linear) else math.sqrt(
                    2.0 / (m.weight.shape[1] * m.weight.shape[2] * m.weight.shape[3])))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.01)
        for b in model.modules():
            if isinstance(b, BottleneckBlock):
                b.conv3.norm.weight.zero_()


# ---------------------------------------------------------------------- preprocessing
def caffe_scale(height: int, width: int, min_size: int, max_size: int) -> float:
    """MILVLG/butd's single ``im_scale``: short side to ``min_size`` unless the rounded long side would pass
    ``max_size``."""
    short, long = min(height, width), max(height, width)
    s = float(min_size) / float(short)
    if np.round(s * long) > max_size:
        s = float(max_size) / float(long)
    return s


def caffe_preprocess(bgr: np.ndarray, mean: torch.Tensor, min_size: int, max_size: int
                     ) -> tuple[torch.Tensor, float]:
    """(3, h, w) float32 network input and ``im_scale``: the mean subtracted from the float image, then a
    bilinear resize (half-pixel centres, no anti-aliasing) whose coordinate map uses exactly ``1 / im_scale``
    and whose size is ``round(dim * im_scale)`` (half to even), as ``cv2.resize(fx=fy=im_scale)``."""
    h, w = bgr.shape[:2]
    s = caffe_scale(h, w, min_size, max_size)
    x = torch.from_numpy(np.ascontiguousarray(bgr)).permute(2, 0, 1).float() - mean.view(3, 1, 1).cpu()
    oh, ow = round(h * s), round(w * s)
    if (oh, ow) == (h, w) and s == 1.0:
        return x.contiguous(), s
    y = torch.ops.aten.upsample_bilinear2d.default(x[None], [oh, ow], False, s, s)[0]
    return y.contiguous(), s


# ---------------------------------------------------------------------- stages
@dataclass
class Proposals:
    boxes: torch.Tensor  # (R, 4) resized-image coordinates, in the reference's order
    scores: torch.Tensor  # (R,) objectness: logits (detectron2 rule) or foreground probabilities (caffe rule)


class BottomUpStages:
    """The model plus the flavour's rules, stage by stage (one image per call; tensors on ``device``)."""

    def __init__(self, model: BottomUpDetector, opts: Mapping[str, Any], *, pre_nms: int, post_nms: int,
                 rpn_nms: float = 0.7):
        self.model = model
        self.opts = dict(opts)
        self.pre_nms, self.post_nms, self.rpn_nms = pre_nms, post_nms, rpn_nms
        self.layout = model.layout

    @property
    def device(self) -> torch.device:
        return self.model.pixel_mean.device

    def backbone(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, h, w) network input -> (B, 1024, h/16, w/16) res4."""
        return self.model.backbone(x)

    def proposals(self, res4: torch.Tensor, image_size: tuple[int, int], im_scale: float) -> Proposals:
        """The RPN's proposals for one image (``res4`` (1, 1024, H, W); ``image_size`` the input's (h, w))."""
        head = self.model.proposal_generator.rpn_head
        t = F.relu(head.conv(res4))
        logits = head.objectness_logits(t)
        deltas = head.anchor_deltas(t)
        _, _, hh, ww = res4.shape
        a = self.layout.num_anchors
        cell = self.model.proposal_generator.anchor_generator.cell_anchors[0]
        anchors = grid_anchors(cell, hh, ww)
        deltas = deltas.view(1, a, 4, hh, ww).permute(0, 3, 4, 1, 2).reshape(-1, 4)
        if self.layout.objectness == "softmax2":  # (1, 2A, H, W) = (background A, foreground A) -> fg probability
            scores = F.softmax(logits.view(1, 2, a, hh, ww), dim=1)[:, 1:].permute(0, 3, 4, 1, 2).reshape(-1)
        else:
            scores = logits.permute(0, 2, 3, 1).reshape(-1)
        if self.opts["proposals_rule"] == "caffe":
            return self._caffe_proposals(deltas, anchors, scores, image_size, im_scale)
        return self._detectron2_proposals(deltas, anchors, scores, image_size)

    def _detectron2_proposals(self, deltas, anchors, scores, image_size) -> Proposals:
        """detectron2's rule (airsplay): top-k logits, decode, clip to [0, w], non-empty, NMS, top-k."""
        from torchvision.ops import nms

        k = min(self.pre_nms, scores.shape[0])
        top, idx = scores.topk(k)
        boxes = decode_boxes(deltas[idx], anchors[idx], plus_one=False)
        h, w = image_size
        boxes = torch.stack((boxes[:, 0].clamp(0, w), boxes[:, 1].clamp(0, h), boxes[:, 2].clamp(0, w),
                             boxes[:, 3].clamp(0, h)), dim=1)
        ok = ((boxes[:, 2] - boxes[:, 0]) > self.opts["rpn_min_size"]) & (
            (boxes[:, 3] - boxes[:, 1]) > self.opts["rpn_min_size"])
        boxes, top = boxes[ok], top[ok]
        keep = nms(boxes, top, self.rpn_nms)[: self.post_nms]
        return Proposals(boxes[keep], top[keep])

    def _caffe_proposals(self, deltas, anchors, scores, image_size, im_scale) -> Proposals:
        """MILVLG/butd's rule: "+1" decode, clip to [0, w-1], drop x2 <= x1, drop sides + 1 not above
        min_size * im_scale, sort all, top-k, "+1" NMS, top-k."""
        boxes = decode_boxes(deltas, anchors, plus_one=True)
        h, w = image_size
        boxes = torch.stack((boxes[:, 0].clamp(0, w - 1), boxes[:, 1].clamp(0, h - 1), boxes[:, 2].clamp(0, w - 1),
                             boxes[:, 3].clamp(0, h - 1)), dim=1)
        ok = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        boxes, scores = boxes[ok], scores[ok]
        thr = self.opts["rpn_min_size"] * im_scale
        ok = ((boxes[:, 2] - boxes[:, 0] + 1) > thr) & ((boxes[:, 3] - boxes[:, 1] + 1) > thr)
        boxes, scores = boxes[ok], scores[ok]
        scores, idx = scores.sort(descending=True)
        k = min(self.pre_nms, scores.shape[0])
        scores, boxes = scores[:k], boxes[idx[:k]]
        keep = nms_plus_one(boxes, scores, self.rpn_nms, inclusive=bool(self.opts["rpn_nms_inclusive"]))
        keep = keep[: self.post_nms]
        return Proposals(boxes[keep], scores[keep])

    def head(self, res4: torch.Tensor, boxes: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Pooled 2048-d features, class probabilities (native order) and attribute probabilities (or None) of
        ``boxes`` (R, 4, resized-image coordinates) on one image's ``res4`` (1, 1024, H, W)."""
        from torchvision.ops import roi_align, roi_pool

        rois = torch.cat([boxes.new_zeros(boxes.shape[0], 1), boxes], dim=1)
        if self.opts["pooler"] == "ROIPool":
            x = roi_pool(res4, rois, output_size=(POOL, POOL), spatial_scale=1.0 / STRIDE)
        else:
            x = roi_align(res4, rois, output_size=(POOL, POOL), spatial_scale=1.0 / STRIDE, sampling_ratio=0,
                          aligned=True)
        pooled = self.model.roi_heads.res5(x).mean(dim=[2, 3])
        pred = self.model.roi_heads.box_predictor
        logits = pred.cls_score(pooled)
        return pooled, F.softmax(logits, dim=-1), pred.attributes(pooled, logits)

    def select(self, boxes_px: np.ndarray, cls_prob: np.ndarray, *, conf_threshold: float, nms_threshold: float,
               min_boxes: int, max_boxes: int, boxes_resized: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """butd's selection: (kept proposal indices in the stored order, every proposal's max_conf).

        ``boxes_px`` (R, 4) float32 in original-image pixels; ``cls_prob`` (R, K+1) in the native class order.
        """
        fg = cls_prob[:, 1:] if self.layout.background == 0 else cls_prob[:, :-1]
        if self.opts["selection_iou"] == "butd":
            b = torch.from_numpy(np.ascontiguousarray(boxes_px, dtype=np.float32))
            iou = iou_plus_one(b, b).numpy()
        else:
            from torchvision.ops import box_iou

            src = boxes_resized if boxes_resized is not None else boxes_px
            b = torch.from_numpy(np.ascontiguousarray(src, dtype=np.float32))
            iou = box_iou(b, b).numpy()
        iou = iou.astype(np.float64)  # the kernels compare their float IoU with a double threshold
        over = iou >= nms_threshold if self.opts["selection_nms_inclusive"] else iou > nms_threshold
        np.fill_diagonal(over, False)
        max_conf = nms_max_conf_batched([over], [np.ascontiguousarray(fg, dtype=np.float32)])[0]
        keep = select_kept(max_conf, conf_threshold=conf_threshold, min_boxes=min_boxes, max_boxes=max_boxes,
                           inclusive=bool(self.opts["conf_inclusive"]), order=self.opts["order"])
        return keep, max_conf


def select_kept(max_conf: np.ndarray, *, conf_threshold: float, min_boxes: int, max_boxes: int,
                inclusive: bool = True, order: str = "butd") -> np.ndarray:
    """butd's keep rule: scores over the threshold (>= when ``inclusive``); fewer than ``min_boxes``: the best
    ``min_boxes``; more than ``max_boxes``: the best ``max_boxes`` (by score, exact ties lower index first);
    otherwise in proposal order (``order="butd"``) or by score (``order="score"``)."""
    r = max_conf.shape[0]
    above = np.flatnonzero(max_conf >= conf_threshold if inclusive else max_conf > conf_threshold)
    by_score = np.lexsort((np.arange(r), -max_conf.astype(np.float64)))
    if len(above) < min_boxes:
        return by_score[: min(min_boxes, r)]
    if len(above) > max_boxes:
        return by_score[:max_boxes]
    if order == "score":
        return by_score[: len(above)]
    return above
