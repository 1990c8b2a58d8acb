"""The bottom-up Faster R-CNN (ResNet-101 C4) with the tensor names of the ports' checkpoints, and its weights.

The modules carry the names of airsplay's and MILVLG's files (Caffe stem pool, dilated res5, one- or two-logit
RPN, the attribute head of the layout), so a checkpoint loads by name: :func:`load_state` uses every tensor of the
file and fills every tensor of the model, or refuses the file naming what is missing, unused or of the wrong
shape. :func:`random_init` gives untrained weights that stay finite (plumbing tests only).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from captioning.features.bottom_up_layout import CELL_ANCHORS, Layout, LayoutError, detectron2_cell_anchors

RES_BLOCKS = {"res2": 3, "res3": 4, "res4": 23}  # ResNet-101 trunk (res5 is the ROI head)


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
    missing = sorted(k for k in want if k not in state and not k.startswith(CELL_ANCHORS))
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
