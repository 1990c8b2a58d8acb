"""The stock flavour's model: a detectron2 C4 Faster R-CNN from its config and its checkpoint.

The config (``model_config_file``: a YAML file or a detectron2 model-zoo name) must be understood key by key: a key
capflow does not know is an error (a bottom-up port's keys name the flavour to use instead). Random weights
(``features.extractor.weights`` unset) are built under ``torch.manual_seed(cfg.seed)`` (in a forked RNG, the
caller's RNG state is untouched), so every process builds the same model. Untrained ResNets explode (res4
activations ~1e7) and the RPN then returns nothing; the last BatchNorm scale of every bottleneck block
(``conv3.norm.weight``, a FrozenBatchNorm2d buffer) is zeroed so that each residual block starts as the
identity (Goyal et al. 2017, "zero-gamma"). Such features are fine for plumbing tests and meaningless for
captioning; a loud warning says so.

Checkpoints: ``.pth``/``.pt`` files are read with ``torch.load(weights_only=True)`` (a raw state dict, or a
dict holding it under ``model`` / ``state_dict``). ``.pkl`` files (detectron2 model-zoo or Caffe2-converted
format) are read by :func:`captioning.safe_pickle.load_detectron2_pkl`: a restricted unpickler that admits only
numpy arrays, dtypes, scalars and ``OrderedDict`` and refuses anything else (e.g. a pickle that would call
``os.system``) before it runs, naming the file and the forbidden global; Caffe2 names are still converted by
detectron2's name matching when the weights are loaded. The class count (``MODEL.ROI_HEADS.NUM_CLASSES``) and
class-agnostic box regression follow the checkpoint's box predictor. A checkpoint that lacks parameters of the model,
has tensors of the wrong shape or tensors the model does not use (an attribute head: a Visual Genome bottom-up port,
which the ``airsplay``/``milvlg`` flavours of :mod:`captioning.features.bottom_up_extractor` read), is an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from captioning.config import ExtractorConfig
from captioning.features.base import PRE_NMS_FLOOR
from captioning.features.bottom_up_layout import LayoutError, recognise_layout
from captioning.features.weights import find_key

log = logging.getLogger("captioning.features.extractor")  # the extractor's logger

# Keys of the ports' detectron2 configs that stock detectron2 does not have (airsplay's fork; MILVLG's BUA)
BOTTOM_UP_YAML_KEYS = {"MODEL.CAFFE_MAXPOOL", "MODEL.PROPOSAL_GENERATOR.HID_CHANNELS", "MODEL.ROI_BOX_HEAD.RES5HALVE",
                       "MODEL.ROI_BOX_HEAD.ATTR", "MODEL.ROI_BOX_HEAD.NUM_ATTRS", "MODEL.BUA",
                       "MODEL.RESNETS.RES5_DILATION"}


def unknown_config_keys(base, loaded: Any, prefix: str = "") -> list[str]:
    """Dotted keys of ``loaded`` (a YAML mapping) that the detectron2 config ``base`` does not have."""
    out: list[str] = []
    if not isinstance(loaded, dict):
        return out
    for k, v in loaded.items():
        if k == "_BASE_" and not prefix:
            continue
        name = f"{prefix}{k}"
        if not isinstance(base, dict) or k not in base:
            out.append(name)
        elif isinstance(v, dict):
            out.extend(unknown_config_keys(base[k], v, name + "."))
    return sorted(out)


def detectron2_config(c: ExtractorConfig, checkpoint: dict[str, Any] | None, *, device: torch.device, feature_dim: int,
                      warn: Callable[[str], None]):
    """The detectron2 config of ``c.model_config_file`` (a file or a model-zoo name; every key understood), set
    for inference with ``c``'s sizes and proposals on ``device``, and adapted to the checkpoint's box predictor."""
    from detectron2 import model_zoo
    from detectron2.config import get_cfg
    from detectron2.modeling import ROI_HEADS_REGISTRY

    d2 = get_cfg()
    src = Path(c.model_config_file).expanduser()
    if not src.is_file():
        try:
            src = Path(model_zoo.get_config_file(c.model_config_file))
        except RuntimeError as e:
            raise ValueError(
                f"extractor model_config_file {c.model_config_file!r} is neither a file nor a detectron2 "
                f"model-zoo config: {e}"
            ) from None
    unknown = unknown_config_keys(d2, d2.load_yaml_with_base(str(src), allow_unsafe=False))
    if unknown:
        raise ValueError(f"{c.model_config_file}: detectron2 config keys capflow does not know: {unknown}"
                         + ("; these are a bottom-up port's keys: use features.extractor.flavour: airsplay "
                            "or milvlg (no YAML)" if set(unknown) & BOTTOM_UP_YAML_KEYS else "")
                         + " (a key that is not understood is never ignored)")
    d2.merge_from_file(str(src))
    if d2.MODEL.ROI_HEADS.NAME not in ROI_HEADS_REGISTRY:
        warn(f"ROI heads {d2.MODEL.ROI_HEADS.NAME!r} unknown to detectron2; using Res5ROIHeads")
        d2.MODEL.ROI_HEADS.NAME = "Res5ROIHeads"
    d2.MODEL.DEVICE = str(device)
    d2.MODEL.WEIGHTS = ""
    d2.MODEL.MASK_ON = False
    d2.MODEL.KEYPOINT_ON = False
    d2.INPUT.MIN_SIZE_TEST = c.min_size
    d2.INPUT.MAX_SIZE_TEST = c.max_size
    d2.MODEL.RPN.POST_NMS_TOPK_TEST = c.proposals
    d2.MODEL.RPN.PRE_NMS_TOPK_TEST = max(int(d2.MODEL.RPN.PRE_NMS_TOPK_TEST), PRE_NMS_FLOOR, c.proposals)
    if d2.INPUT.FORMAT not in ("BGR", "RGB"):
        raise ValueError(f"unsupported INPUT.FORMAT {d2.INPUT.FORMAT!r} (BGR or RGB)")
    if checkpoint is not None:
        adapt_to_checkpoint(d2, checkpoint)
    out = d2.MODEL.RESNETS.RES2_OUT_CHANNELS * 8
    if out != feature_dim:
        raise ValueError(f"the model's res5 gives {out}-d features but feature_dim={feature_dim}")
    return d2


def adapt_to_checkpoint(d2, checkpoint: dict[str, Any]) -> None:
    """Class count and box-regression layout from the checkpoint's box predictor."""
    state = checkpoint["model"]
    k_cls = find_key(state, "roi_heads.box_predictor.cls_score.weight", "cls_score_w",
                      "box_predictor.cls_score.weight")
    if k_cls is None:
        raise ValueError("detector weights have no box classifier (roi_heads.box_predictor.cls_score.weight)")
    rows = int(state[k_cls].shape[0])
    if rows < 2:
        raise ValueError(f"detector weights: box classifier has {rows} output(s); need classes + background")
    num_classes = rows - 1
    if num_classes != d2.MODEL.ROI_HEADS.NUM_CLASSES:
        log.info("detector weights have %d classes (config: %d)", num_classes, d2.MODEL.ROI_HEADS.NUM_CLASSES)
    d2.MODEL.ROI_HEADS.NUM_CLASSES = num_classes
    k_box = find_key(state, "roi_heads.box_predictor.bbox_pred.weight", "bbox_pred_w",
                      "box_predictor.bbox_pred.weight")
    if k_box is not None:
        box_rows = int(state[k_box].shape[0])
        box_dim = len(d2.MODEL.ROI_BOX_HEAD.BBOX_REG_WEIGHTS)
        if box_rows == box_dim:
            d2.MODEL.ROI_BOX_HEAD.CLS_AGNOSTIC_BBOX_REG = True
        elif box_rows == box_dim * num_classes:
            d2.MODEL.ROI_BOX_HEAD.CLS_AGNOSTIC_BBOX_REG = False
        else:
            # e.g. Caffe-era regressors with a background row; regressed boxes are never used here
            d2.MODEL.ROI_BOX_HEAD.CLS_AGNOSTIC_BBOX_REG = False
            bias = k_box[: -len("weight")] + "bias" if k_box.endswith("weight") else k_box[:-1] + "b"
            for k in (k_box, bias):
                state.pop(k, None)
            log.info("ignoring the checkpoint's box regressor (%d rows): regressed boxes are not used",
                     box_rows)
            checkpoint["_dropped_bbox_pred"] = True


def build_detector(d2, c: ExtractorConfig, checkpoint: dict[str, Any] | None, *, weights_path: Path | None,
                   channels_last: bool):
    """The C4 model of config ``d2``, in eval mode without gradients: the checkpoint's weights loaded exactly
    (:func:`load_weights`), or random ones (``checkpoint`` None) built under ``c.seed``."""
    from detectron2.modeling import build_model
    from detectron2.modeling.backbone.resnet import BottleneckBlock

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(c.seed)
        model = build_model(d2)
    roi = model.roi_heads
    if not (hasattr(roi, "res5") and hasattr(roi, "_shared_roi_transform")):
        raise ValueError(
            f"{c.model_config_file}: region features need a C4 model (Res5ROIHeads), "
            f"got {type(roi).__name__}"
        )
    if checkpoint is None:
        blocks = [m for m in model.modules() if isinstance(m, BottleneckBlock)]
        with torch.no_grad():
            for b in blocks:
                b.conv3.norm.weight.zero_()  # FrozenBatchNorm2d buffer (or BatchNorm2d parameter)
        log.info("random init: zeroed the last norm scale of %d bottleneck blocks (identity residuals)",
                 len(blocks))
    else:
        load_weights(model, checkpoint, weights_path, c.model_config_file)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def load_weights(model, checkpoint: dict[str, Any], weights_path: Path | None, model_config_file: str) -> None:
    """Load the checkpoint into ``model``: every tensor of the model from the file, every tensor of the file used
    (a bottom-up port's file and anchors that differ from the config's are refused)."""
    from detectron2.checkpoint import DetectionCheckpointer

    dropped_bbox = checkpoint.pop("_dropped_bbox_pred", False)
    refuse_bottom_up(checkpoint["model"], weights_path)
    check_anchors(model, checkpoint["model"], weights_path, model_config_file)
    ckpt = DetectionCheckpointer(model)
    inc = ckpt._load_model(checkpoint)
    if inc.incorrect_shapes:
        k, shape_ckpt, shape_model = inc.incorrect_shapes[0]
        raise ValueError(
            f"detector weights {weights_path} do not fit {model_config_file}: "
            f"{len(inc.incorrect_shapes)} tensors of the wrong shape, e.g. {k} {shape_ckpt} vs {shape_model}"
        )
    missing = [k for k in inc.missing_keys if not (dropped_bbox and "bbox_pred" in k)]
    if missing:
        raise ValueError(
            f"detector weights {weights_path} lack {len(missing)} tensors of "
            f"{model_config_file}, e.g. {missing[:4]}: wrong model_config_file for these weights?"
        )
    unused = sorted(k for k in inc.unexpected_keys if ".cell_anchors." not in k)
    if unused:
        raise ValueError(f"detector weights {weights_path}: {len(unused)} tensors the model of "
                         f"{model_config_file} does not use: {unused[:8]} (a different function "
                         "would be computed silently: refused)")


def refuse_bottom_up(state: dict[str, Any], weights_path: Path | None) -> None:
    """A bottom-up port's checkpoint given to the stock flavour: refused, naming the flavour to use."""
    try:
        layout = recognise_layout(state)
    except LayoutError:
        return
    # the stock C4 layout shares airsplay's names: only a port's own marks decide (its attribute head, Caffe
    # objectness pairs, or the VG detector's 1600 classes behind a 512-channel RPN)
    if not (layout.attributes or layout.objectness == "softmax2"
            or (layout.num_classes == 1600 and layout.rpn_hidden == 512)):
        return
    raise ValueError(f"detector weights {weights_path} are the {layout.port} bottom-up layout "
                     f"({layout.describe()}): set features.extractor.flavour: {layout.port}")


def check_anchors(model, state: dict[str, Any], weights_path: Path | None, model_config_file: str) -> None:
    """Anchors stored in the checkpoint (dropped by detectron2 0.6 on load) must equal the config's."""
    gen = getattr(getattr(model, "proposal_generator", None), "anchor_generator", None)
    for k in [k for k in state if ".anchor_generator.cell_anchors." in k]:
        level = int(k.rsplit(".", 1)[1])
        cells = list(gen.cell_anchors.buffers()) if gen is not None else []  # detectron2's BufferList
        have = cells[level].detach().cpu() if level < len(cells) else None
        stored = torch.as_tensor(state[k]).float()
        if have is None or have.shape != stored.shape or not torch.allclose(have, stored, rtol=0, atol=1e-4):
            raise ValueError(f"detector weights {weights_path}: stored anchors {k} {stored.tolist()} differ "
                             f"from the anchors of {model_config_file} "
                             f"({None if have is None else have.tolist()}): refused")
