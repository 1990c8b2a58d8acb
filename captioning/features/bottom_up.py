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
with the names (:mod:`captioning.features.bottom_up_layout`; the model and its weights:
:mod:`captioning.features.bottom_up_model`; the references' settings: :mod:`captioning.features.bottom_up_options`).
This module holds the box arithmetic, the preprocessing and the stages. The stages are public methods
(``preprocess``, ``backbone``, ``proposals``, ``head``, ``select``) so that tests can compare each with the
reference given the reference's previous stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from captioning.features.bottom_up_model import BottomUpDetector
from captioning.features.selection import nms_max_conf_batched

SCALE_CLAMP = math.log(1000.0 / 16)  # largest log-scale a box delta may apply (detectron2 and Caffe)
STRIDE = 16  # res4's stride: anchors and ROI pooling
POOL = 14  # ROI pooling resolution


# ---------------------------------------------------------------------- anchors
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
