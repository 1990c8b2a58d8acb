"""Bottom-up checkpoints: which port's layout a weights file is, read from its tensor names and shapes.

The layout is recognised, never guessed from a config: a file whose tensors do not form exactly one known layout
(airsplay's or MILVLG's, :mod:`captioning.features.bottom_up`) is refused with the names at fault. Also the two
anchor tables (detectron2's generated cells, the Caffe model's stored ones). numpy only: the Dask runner checks a
file's layout before any worker starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from captioning.errors import InputError


class LayoutError(InputError, ValueError):
    """A checkpoint that is not exactly one known bottom-up layout (names the tensors at fault)."""


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
CELL_ANCHORS = "proposal_generator.anchor_generator.cell_anchors."


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
    anchor_keys = sorted(k for k in state if k.startswith(CELL_ANCHORS))
    anchors = None
    if anchor_keys:
        if anchor_keys != [CELL_ANCHORS + "0"]:
            raise LayoutError(f"expected one anchor level ({CELL_ANCHORS}0), got {anchor_keys}")
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
