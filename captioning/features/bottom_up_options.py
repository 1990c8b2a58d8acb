"""The bottom-up flavours' reference settings, and the options that depart from them.

Each flavour (``airsplay``, ``milvlg``: :mod:`captioning.features.bottom_up`) computes what its reference computes
wherever :class:`captioning.config.BottomUpOptions` leaves an option unset; an option set to another value is a
deviation, and the deviations (not the options) name a store. Plain data, no torch: the store naming reads it.
"""

from __future__ import annotations

from typing import Any

from captioning.config import BottomUpOptions

VG_PIXEL_MEAN = (102.9801, 115.9465, 122.7717)  # BGR, both ports

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
