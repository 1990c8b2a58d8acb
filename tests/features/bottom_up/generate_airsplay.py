"""Golden data from airsplay/py-bottom-up-attention for capflow's bottom-up tests (a generator, never collected).

Usage (reference checkouts exported to scratch folders under /tmp, never inside this repository)::

    PYTHONPATH=/tmp/airsplay:/tmp/pydeps .venv/bin/python tests/features/bottom_up/generate_airsplay.py \
        --airsplay /tmp/airsplay --butd /tmp/butd --out tests/features/bottom_up/data

``--airsplay`` is an export of airsplay/py-bottom-up-attention (the Dec-2019 detectron2 fork), ``--butd`` an export
of peteanderson80/bottom-up-attention (its ``tools/`` and ``lib/`` are read), ``--out`` the folder that receives
``layout-airsplay.json`` and ``golden-airsplay.npz``. opencv (``cv2``) must be importable (e.g. installed with
``pip install --target /tmp/pydeps opencv-python-headless`` and put on PYTHONPATH); nothing is installed here.

What runs (the contract is the lead's golden spec; settings in ``SETTINGS`` below):

1. airsplay's own ``get_cfg`` + ``configs/VG-Detection/faster_rcnn_R_101_C4_attr_caffemaxpool.yaml`` and
   ``build_model`` on CPU give the layout (every ``model.state_dict()`` entry; the fork's anchor ``BufferList`` is a
   persistent buffer, so ``cell_anchors.0`` is recorded with the values the fork's own generator produces).
2. ``weights.write_checkpoint("airsplay", ...)`` writes the seeded checkpoint; airsplay's own ``DefaultPredictor``
   (``build_model`` + ``DetectionCheckpointer(model).load(cfg.MODEL.WEIGHTS)`` + ``ResizeShortestEdge``) loads it, and
   every tensor of the loaded model is compared with the file.
3. Per image, the steps of ``demo/detectron2_mscoco_proposal_maxnms.py`` ``doit()`` in order (cv2.imread ->
   ``transform_gen`` -> ``preprocess_image`` -> ``backbone`` -> ``proposal_generator`` -> ``_shared_roi_transform`` ->
   ``mean(dim=[2, 3])`` -> ``box_predictor`` -> ``FastRCNNOutputs.predict_probs``). The attribute config's
   ``box_predictor`` returns three values, unpacked as in ``demo/demo_feature_extraction_attr.ipynb``.
4. Selection: butd's OWN ``get_detections_from_im`` (its source is read from ``tools/generate_tsv.py`` of the checkout
   and executed; it is not copied here) with butd's own ``fast_rcnn.config`` (merged with
   ``experiments/cfgs/faster_rcnn_end2end_resnet.yml``, the cfg of the script's documented command line) and butd's own
   ``fast_rcnn.nms_wrapper.nms``. A fake net / ``im_detect`` / ``_get_blobs`` hand it airsplay's tensors: ``cls_prob``
   permuted to background FIRST, ``rois`` = airsplay's proposals already mapped to original pixels per axis with the
   fork's own ``Boxes.scale(W / w, H / h)`` (the scaling of its ``detector_postprocess``, without its clip), and
   ``im_scale`` 1.0. ``pool5_flat`` carries the proposal index (float32), so the returned ``features`` decode to the
   kept indices; they are cross-checked against the function's own ``keep_boxes`` local (read with a trace hook).
   ``objects/objconf/attrs/attrconf`` are stored as airsplay's code stores them: ``objects_id`` = argmax of the 1600
   foreground probabilities (airsplay order, so butd class index - 1), ``objects_conf`` = that probability (of the
   1601-way softmax); ``attrs`` = argmax / max of ``softmax(attr_logits[..., :-1])`` (the attribute notebook: a
   softmax over the 400 attribute logits, the no-attribute logit dropped BEFORE the softmax).

Shims (each replaces only something that cannot import or run on torch 2.13 / numpy 2 / Pillow 10+ / Python 3):

* ``detectron2._C``: an empty placeholder module. The fork's compiled extension is not built; its extraction path
  uses no C++ op (RoIPool and nms come from torchvision); any use would raise AttributeError.
* ``PIL.Image.LINEAR``: alias of ``PIL.Image.BILINEAR`` (removed in Pillow 10; the fork's transforms name it).
* ``imagesize``: an empty stub module (imported by the fork's ``data/datasets/coco.py``, unused here).
* numpy aliases ``np.int/np.float/np.object/np.str`` (removed in numpy 1.24) are set to the builtins only if absent;
  ``np.bool`` is left alone (it is a real dtype again in numpy 2).
* ``collections.Mapping`` (and ``MutableMapping``/``Sequence``/``Iterable``): aliases of ``collections.abc``'s
  (removed in Python 3.10; the fork's ``evaluation/testing.py``, imported by ``detectron2.engine``, needs Mapping).
* butd ``nms.gpu_nms``: a stub whose ``gpu_nms`` raises (the configured cfg has ``USE_GPU_NMS: False``).
* butd ``nms.cpu_nms``: a pure-Python stand-in for the Cython ``cpu_nms`` in ``lib/nms/cpu_nms.pyx`` with exactly its
  arithmetic: float32 boxes, ``+1`` widths/areas, ``order = scores.argsort()[::-1]``, greedy scan in that order,
  float32 ``inter / (iarea + areas[j] - inter)``, suppression when ``ovr >= thresh`` with ``thresh`` a C double (the
  float32 IoU is widened to float64 for the comparison). The comparison string is checked in the .pyx source.
* butd ``cfg_from_file`` is Python-2 only (``dict.iteritems``/``has_key``, ``yaml.load`` without Loader): the same
  yml is merged into butd's ``cfg`` with an equivalent few-line merge (keys must exist, as in ``_merge_a_into_b``).
* ``tools/generate_tsv.py`` is Python 2 (print statements), so the module cannot be imported; the text of
  ``get_detections_from_im`` is cut from the file and compiled on its own (same file name and line numbers) in a
  namespace holding numpy, cv2, base64, butd's ``cfg`` and ``nms``, the fake ``im_detect``/``_get_blobs`` and
  ``MIN_BOXES``/``MAX_BOXES`` set per setting. ``caffe`` is never imported, so it needs no stub. The fake
  ``_get_blobs`` returns ``im_scales`` as the list ``[1.0]``: with numpy 2 (NEP 50) ``float32 rois / np.float64``
  would be float64, while under numpy 1's value-based casting (what butd ran with) it stayed float32.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
IMAGES = [
    REPO.parent / "shared" / "external" / "images" / "COCO_val2014_000000391895.jpg",
    REPO.parent / "shared" / "external" / "images" / "COCO_val2014_000000386164.jpg",
]
# (name, conf_thresh, MIN_BOXES, MAX_BOXES)
SETTINGS = [("t02", 0.2, 10, 100), ("t0", 0.0, 10, 100), ("m5x20", 0.0, 5, 20), ("t09", 0.9, 10, 100)]
CONFIG = "configs/VG-Detection/faster_rcnn_R_101_C4_attr_caffemaxpool.yaml"
BUTD_CFG = "experiments/cfgs/faster_rcnn_end2end_resnet.yml"
MIN_SIZE, MAX_SIZE, PRE_NMS, POST_NMS, RPN_NMS, SEED = 192, 320, 6000, 24, 0.7, 0


# ----------------------------------------------------------------------------------------------- shims
def install_airsplay_shims() -> None:
    import numpy as np
    import PIL.Image

    if not hasattr(PIL.Image, "LINEAR"):
        PIL.Image.LINEAR = PIL.Image.BILINEAR
    import collections
    import collections.abc
    import warnings

    for alias, builtin in (("int", int), ("float", float), ("object", object), ("str", str)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                getattr(np, alias)
            except AttributeError:
                setattr(np, alias, builtin)
    for name in ("Mapping", "MutableMapping", "Sequence", "Iterable"):
        if not hasattr(collections, name):
            setattr(collections, name, getattr(collections.abc, name))
    sys.modules.setdefault("detectron2._C", types.ModuleType("detectron2._C"))
    sys.modules.setdefault("imagesize", types.ModuleType("imagesize"))


def _tie_argsort(a, variant):
    """argsort with a fixed tie order (diagnostics only): 'hi' puts the higher index first after [::-1], 'lo' lower."""
    import numpy as np

    a = np.asarray(a)
    if variant == "hi":
        return np.argsort(a, kind="stable")
    return np.lexsort((-np.arange(a.shape[0]), a))


def _cpu_nms_standin(dets, thresh, tie_variant=None):
    """Pure-Python stand-in for butd ``lib/nms/cpu_nms.pyx:cpu_nms`` (same float32 arithmetic, ``ovr >= thresh``).

    ``tie_variant`` (diagnostics only, never for the golden) replaces numpy's unstable argsort by a fixed tie order."""
    import numpy as np

    dets = np.asarray(dets, dtype=np.float32)
    x1, y1, x2, y2, scores = (dets[:, k] for k in range(5))
    one = np.float32(1)
    areas = (x2 - x1 + one) * (y2 - y1 + one)  # float32, as the .pyx's numpy expression
    order = (scores.argsort() if tie_variant is None else _tie_argsort(scores, tie_variant))[::-1]
    suppressed = np.zeros(dets.shape[0], dtype=bool)
    keep = []
    for _i in range(dets.shape[0]):
        i = order[_i]
        if suppressed[i]:
            continue
        keep.append(i)
        js = order[_i + 1 :]
        js = js[~suppressed[js]]
        if js.size == 0:
            continue
        xx1 = np.maximum(x1[i], x1[js])
        yy1 = np.maximum(y1[i], y1[js])
        xx2 = np.minimum(x2[i], x2[js])
        yy2 = np.minimum(y2[i], y2[js])
        w = np.maximum(np.float32(0.0), xx2 - xx1 + one)
        h = np.maximum(np.float32(0.0), yy2 - yy1 + one)
        inter = w * h
        ovr = inter / (areas[i] + areas[js] - inter)  # float32 (np.float32_t in the kernel)
        suppressed[js[ovr.astype(np.float64) >= float(thresh)]] = True  # C: float ovr >= double thresh
    return keep


def _load_module(name: str, path: Path, package_dir: Path | None = None):
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(package_dir)] if package_dir else None
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_butd(butd: Path):
    """butd's cfg (merged with the documented yml), its nms_wrapper.nms, and get_detections_from_im compiled alone."""
    import numpy as np
    import yaml

    lib = butd / "lib"
    pyx = (lib / "nms" / "cpu_nms.pyx").read_text()
    assert "if ovr >= thresh:" in pyx, "butd cpu_nms.pyx no longer suppresses with >=; update the stand-in"
    _load_module("fast_rcnn", lib / "fast_rcnn" / "__init__.py", lib / "fast_rcnn")
    config = _load_module("fast_rcnn.config", lib / "fast_rcnn" / "config.py")
    _load_module("nms", lib / "nms" / "__init__.py", lib / "nms")
    gpu = types.ModuleType("nms.gpu_nms")

    def gpu_nms(*a, **k):
        raise RuntimeError("gpu_nms is not available (stub); the configured cfg has USE_GPU_NMS: False")

    gpu.gpu_nms = gpu_nms
    cpu = types.ModuleType("nms.cpu_nms")
    cpu.cpu_nms = _cpu_nms_standin

    def cpu_soft_nms(*a, **k):
        raise RuntimeError("cpu_soft_nms stub")

    cpu.cpu_soft_nms = cpu_soft_nms
    sys.modules["nms.gpu_nms"], sys.modules["nms.cpu_nms"] = gpu, cpu
    wrapper = _load_module("fast_rcnn.nms_wrapper", lib / "fast_rcnn" / "nms_wrapper.py")

    cfg = config.cfg

    def merge(a, b, where=""):
        for k, v in a.items():
            if k not in b:
                raise KeyError(f"{where}{k} is not a valid butd config key")
            if isinstance(v, dict):
                merge(v, b[k], f"{where}{k}.")
            else:
                if type(b[k]) is not type(v):
                    if isinstance(b[k], np.ndarray):
                        v = np.array(v, dtype=b[k].dtype)
                    else:
                        raise ValueError(f"type mismatch for {where}{k}")
                b[k] = v

    merge(yaml.safe_load((butd / BUTD_CFG).read_text()), cfg)

    src_path = butd / "tools" / "generate_tsv.py"
    lines = src_path.read_text().splitlines(keepends=True)
    start = next(i for i, s in enumerate(lines) if s.startswith("def get_detections_from_im("))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("def "))
    src = "\n" * start + "".join(lines[start:end])
    code = compile(src, str(src_path), "exec")
    rule = ">=" if not cfg.USE_GPU_NMS else ">"  # cpu_nms.pyx: ovr >= thresh; nms_kernel.cu: devIoU > thresh
    return cfg, wrapper.nms, code, rule


class _Blob:
    def __init__(self, data):
        self.data = data


class _TieNumpy:
    """numpy with argsort replaced by a fixed tie order (for the tie-robustness diagnostic only)."""

    def __init__(self, variant):
        import numpy

        self._np, self._variant = numpy, variant

    def argsort(self, a):
        return _tie_argsort(a, self._variant)

    def __getattr__(self, name):
        return getattr(self._np, name)


def butd_select(code, cfg, nms, im_file, cls_prob_bg_first, rois_orig, conf, min_boxes, max_boxes, tie_variant=None):
    """Run butd's get_detections_from_im on airsplay's outputs; returns (keep, boxes, max_conf, result dict).

    With ``tie_variant`` ('hi'/'lo'), numpy's unstable argsorts (in the NMS kernel and in the function's final
    clamp) get a fixed tie order: a diagnostic of whether the golden depends on tie breaking."""
    import cv2
    import numpy as np

    if tie_variant is not None:

        def nms(dets, thresh):
            if dets.shape[0] == 0:
                return []
            return _cpu_nms_standin(dets, thresh, tie_variant)

    n = rois_orig.shape[0]
    rois = np.zeros((n, 5), dtype=np.float32)
    rois[:, 1:5] = rois_orig
    net = types.SimpleNamespace(
        blobs={
            "rois": _Blob(rois),
            "cls_prob": _Blob(cls_prob_bg_first.astype(np.float32)),
            "pool5_flat": _Blob(np.arange(n, dtype=np.float32)[:, None]),
        }
    )

    def im_detect(net_, im):
        return net_.blobs["cls_prob"].data, None, None, None

    def _get_blobs(im, rois_):
        # a list, not np.array([1.0]): under numpy 2 (NEP 50) float32 / float64-scalar is float64, under the numpy 1
        # butd ran with (value-based casting) it stayed float32; a Python float keeps the float32 result
        return None, [1.0]

    ns = {
        "np": np if tie_variant is None else _TieNumpy(tie_variant),
        "cv2": cv2,
        "base64": base64,
        "cfg": cfg,
        "nms": nms,
        "im_detect": im_detect,
        "_get_blobs": _get_blobs,
        "MIN_BOXES": min_boxes,
        "MAX_BOXES": max_boxes,
    }
    exec(code, ns)
    fn = ns["get_detections_from_im"]
    captured = {}

    def tracer(frame, event, arg):
        if frame.f_code is fn.__code__:

            def local(fr, ev, a):
                if ev == "return":
                    captured.update(
                        keep_boxes=np.array(fr.f_locals["keep_boxes"]), max_conf=np.array(fr.f_locals["max_conf"])
                    )
                return local

            return local
        return None

    sys.settrace(tracer)
    try:
        out = fn(net, str(im_file), os.path.basename(str(im_file)), conf_thresh=conf)
    finally:
        sys.settrace(None)
    boxes = np.frombuffer(base64.b64decode(out["boxes"]), dtype=np.float32).reshape(-1, 4).copy()
    idx = np.frombuffer(base64.b64decode(out["features"]), dtype=np.float32)
    keep = idx.astype(np.int64)
    assert np.array_equal(keep.astype(np.float32), idx) and np.array_equal(keep, captured["keep_boxes"])
    assert out["num_boxes"] == len(keep)
    return keep, boxes, captured["max_conf"], out


# ----------------------------------------------------------------------------------------------- main
def git_head(path: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown (export without .git)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--airsplay", required=True, type=Path, help="export of airsplay/py-bottom-up-attention")
    ap.add_argument("--butd", required=True, type=Path, help="export of peteanderson80/bottom-up-attention")
    ap.add_argument("--out", required=True, type=Path, help="folder for layout-airsplay.json / golden-airsplay.npz")
    ap.add_argument("--airsplay-commit", default=None)
    ap.add_argument("--butd-commit", default=None)
    args = ap.parse_args()
    airsplay, butd, out = args.airsplay.resolve(), args.butd.resolve(), args.out.resolve()

    install_airsplay_shims()
    sys.path.insert(0, str(airsplay))
    import cv2
    import detectron2
    import numpy as np
    import PIL
    import PIL.Image
    import torch

    assert Path(detectron2.__file__).resolve().is_relative_to(airsplay), detectron2.__file__
    from detectron2.config import get_cfg
    from detectron2.engine import DefaultPredictor
    from detectron2.modeling import build_model
    from detectron2.modeling.roi_heads.fast_rcnn import FastRCNNOutputs
    from detectron2.structures import Boxes

    sys.path.insert(0, str(HERE))
    import weights  # the lead's test support (same folder)

    torch.set_num_threads(1)
    torch.manual_seed(0)

    cfg = get_cfg()
    cfg.merge_from_file(str(airsplay / CONFIG))
    cfg.MODEL.DEVICE = "cpu"
    cfg.MODEL.RPN.PRE_NMS_TOPK_TEST = PRE_NMS
    cfg.MODEL.RPN.POST_NMS_TOPK_TEST = POST_NMS
    cfg.MODEL.RPN.NMS_THRESH = RPN_NMS
    cfg.MODEL.ROI_HEADS.NMS_THRESH_TEST = 0.6  # as the script / notebooks (unused on this path)
    cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST = 0.2
    cfg.INPUT.MIN_SIZE_TEST = MIN_SIZE
    cfg.INPUT.MAX_SIZE_TEST = MAX_SIZE

    # 1. layout from the fork's own model
    probe = build_model(cfg).eval()
    sd = probe.state_dict()
    anchor_keys = [k for k in sd if "anchor_generator.cell_anchors" in k]
    layout = {
        "port": "airsplay",
        "tensors": [[k, list(v.shape), str(v.numpy().dtype)] for k, v in sd.items()],
        "fixed": {k: sd[k].numpy().astype(np.float32).tolist() for k in anchor_keys},
        "notes": (
            "Recorded from airsplay/py-bottom-up-attention's own build_model with "
            f"{CONFIG}. The fork's DefaultAnchorGenerator keeps cell_anchors in a BufferList of persistent buffers, "
            "so its state dict (and its checkpoints) SAVE the anchors: "
            f"{', '.join(anchor_keys)} = the fork's generate_cell_anchors(sizes=[64,128,256,512], "
            "aspect_ratios=[0.5,1,2]) (size-major, centred on 0, float32) and DetectionCheckpointer loads them from "
            "the file. FrozenBatchNorm2d everywhere (no num_batches_tracked)."
        ),
    }
    del probe
    out.mkdir(parents=True, exist_ok=True)
    (out / "layout-airsplay.json").write_text(json.dumps(layout, indent=1) + "\n")
    print(f"layout: {len(layout['tensors'])} tensors; fixed: {anchor_keys}")

    # 2. checkpoint -> the fork's DefaultPredictor (DetectionCheckpointer) -> verify every tensor
    import tempfile

    tmpdir = Path(tempfile.mkdtemp(prefix="airsplay_golden_"))
    ckpt = weights.write_checkpoint("airsplay", tmpdir / "model.pkl", seed=SEED, layout=layout)
    cfg.MODEL.WEIGHTS = str(ckpt)
    predictor = DefaultPredictor(cfg)
    model = predictor.model
    with open(ckpt, "rb") as f:
        file_sd = pickle.load(f, encoding="latin1")["model"]
    loaded = model.state_dict()
    assert list(loaded) == list(file_sd), "key sets/order differ between the model and the file"
    for k, v in file_sd.items():
        assert loaded[k].dtype == torch.from_numpy(v).dtype and torch.equal(loaded[k], torch.from_numpy(v)), k
    print(f"loaded state equals the file: {len(file_sd)} tensors")
    os.remove(ckpt)

    bcfg, bnms, bcode, rule = load_butd(butd)
    assert abs(float(bcfg.TEST.NMS) - 0.3) < 1e-12 and bcfg.USE_GPU_NMS is False

    arrays: dict[str, np.ndarray] = {}
    report = []
    pil_checks = []
    for i, path in enumerate(IMAGES):
        with torch.no_grad():
            raw_image = cv2.imread(str(path))
            H, W = raw_image.shape[:2]
            image = predictor.transform_gen.get_transform(raw_image).apply_image(raw_image)
            image = torch.as_tensor(image.astype("float32").transpose(2, 0, 1))
            inputs = [{"image": image, "height": H, "width": W}]
            images = model.preprocess_image(inputs)
            features = model.backbone(images.tensor)
            proposals, _ = model.proposal_generator(images, features, None)
            proposal_boxes = [x.proposal_boxes for x in proposals]
            feats = [features[f] for f in model.roi_heads.in_features]
            box_features = model.roi_heads._shared_roi_transform(feats, proposal_boxes)
            feature_pooled = box_features.mean(dim=[2, 3])
            pred_class_logits, pred_attr_logits, pred_proposal_deltas = model.roi_heads.box_predictor(feature_pooled)
            outputs = FastRCNNOutputs(
                model.roi_heads.box2box_transform,
                pred_class_logits,
                pred_proposal_deltas,
                proposals,
                model.roi_heads.smooth_l1_beta,
            )
            probs = outputs.predict_probs()[0]
            attr_prob_401 = torch.softmax(pred_attr_logits, dim=-1)
            attr_prob_nb = pred_attr_logits[..., :-1].softmax(-1)  # the attribute notebook's rule
            max_attr_prob, max_attr_label = attr_prob_nb.max(-1)
            max_obj_prob, max_obj_label = probs[:, :-1].max(1)  # the script's fast_rcnn_inference_single_image

        h, w = images.image_sizes[0]
        assert tuple(images.tensor.shape[-2:]) == (h, w)
        prop = proposals[0].proposal_boxes.tensor.clone()
        sc = proposals[0].objectness_logits
        p = f"img{i}_"
        arrays[p + "name"] = np.array(path.name)
        arrays[p + "image_size"] = np.array([H, W], dtype=np.int64)
        arrays[p + "input_size"] = np.array([h, w], dtype=np.int64)
        arrays[p + "scale"] = np.array([h / H, w / W], dtype=np.float64)
        arrays[p + "decoded"] = np.array(hashlib.sha256(np.ascontiguousarray(raw_image).tobytes()).hexdigest())
        arrays[p + "input"] = images.tensor[0].numpy().astype(np.float32)
        arrays[p + "res4"] = features["res4"][0].numpy().astype(np.float32)
        arrays[p + "proposals"] = prop.numpy().astype(np.float32)
        arrays[p + "objectness"] = sc.numpy().astype(np.float32)
        arrays[p + "pooled"] = feature_pooled.numpy().astype(np.float32)
        arrays[p + "cls_prob"] = probs.numpy().astype(np.float32)
        arrays[p + "attr_prob"] = attr_prob_401.numpy().astype(np.float32)

        # PIL decode comparison (RGB -> BGR)
        pil = np.asarray(PIL.Image.open(path).convert("RGB"))[:, :, ::-1]
        if pil.shape == raw_image.shape:
            d = int(np.abs(pil.astype(np.int16) - raw_image.astype(np.int16)).max())
            pil_checks.append((path.name, "equal" if d == 0 else f"max abs diff {d}", int((pil != raw_image).sum())))
        else:
            pil_checks.append((path.name, f"shape differs {pil.shape} vs {raw_image.shape}", -1))

        # butd selection on airsplay outputs
        rois_orig = Boxes(prop.clone())
        rois_orig.scale(W / w, H / h)  # detector_postprocess's scaling (no clip: butd stores rois / im_scale)
        rois_orig = rois_orig.tensor.numpy().astype(np.float32)
        cp = probs.numpy().astype(np.float32)
        cp_bg_first = np.concatenate([cp[:, -1:], cp[:, :-1]], axis=1)
        kept = {}
        for name, conf, mn, mx in SETTINGS:
            keep, boxes, max_conf, res = butd_select(bcode, bcfg, bnms, path, cp_bg_first, rois_orig, conf, mn, mx)
            assert res["image_h"] == H and res["image_w"] == W
            assert np.array_equal(boxes, rois_orig[keep])
            arrays[p + "maxconf"] = max_conf.astype(np.float64)
            arrays[p + f"keep_{name}"] = keep.astype(np.int64)
            arrays[p + f"boxes_{name}"] = boxes.astype(np.float32)
            arrays[p + f"objects_{name}"] = max_obj_label.numpy()[keep].astype(np.int64)
            arrays[p + f"objconf_{name}"] = max_obj_prob.numpy()[keep].astype(np.float32)
            arrays[p + f"attrs_{name}"] = max_attr_label.numpy()[keep].astype(np.int64)
            arrays[p + f"attrconf_{name}"] = max_attr_prob.numpy()[keep].astype(np.float32)
            # tie diagnostics: butd orders by an unstable argsort only when it clamps to MIN/MAX
            n_pass = int((max_conf >= conf).sum())
            clamped = n_pass < mn or n_pass > mx
            sel = max_conf[keep]
            rest = np.delete(max_conf, keep)
            tie_inside = clamped and len(np.unique(sel)) < len(sel)
            tie_cut = clamped and rest.size > 0 and np.isin(rest, sel).any()
            robust = True
            for variant in ("hi", "lo"):
                k2, _, _, _ = butd_select(bcode, bcfg, bnms, path, cp_bg_first, rois_orig, conf, mn, mx, variant)
                robust &= bool(np.array_equal(k2, keep))
            arrays[p + f"tierobust_{name}"] = np.array(robust)
            kept[name] = (
                len(keep),
                n_pass,
                "argsort" if clamped else "index order",
                bool(tie_inside),
                bool(tie_cut),
                robust,
            )
        report.append((i, path.name, (H, W), (h, w), len(prop), kept))

    meta = {
        "port": "airsplay",
        "airsplay_commit": args.airsplay_commit or git_head(airsplay),
        "butd_commit": args.butd_commit or git_head(butd),
        "config": CONFIG,
        "settings": {
            "MIN_SIZE_TEST": MIN_SIZE,
            "MAX_SIZE_TEST": MAX_SIZE,
            "PRE_NMS_TOPK_TEST": PRE_NMS,
            "POST_NMS_TOPK_TEST": POST_NMS,
            "RPN.NMS_THRESH": RPN_NMS,
            "seed": SEED,
            "torch_threads": 1,
            "device": "cpu",
            "dtype": "float32",
        },
        "selection": {s[0]: {"conf": s[1], "min": s[2], "max": s[3]} for s in SETTINGS},
        "select_source": "butd tools/generate_tsv.py get_detections_from_im, cfg "
        + BUTD_CFG
        + " (USE_GPU_NMS False -> lib/nms/cpu_nms.pyx cpu_nms, +1 areas), TEST.NMS "
        + str(bcfg.TEST.NMS),
        "select_inputs": "cls_prob permuted to background-first; rois = airsplay proposals * (W/w, H/h) "
        "(Boxes.scale, float32, no clip); im_scale 1.0",
        "objects": "airsplay order (background last): argmax of cls_prob[:, :1600]; objconf = that 1601-softmax "
        "probability (the script's fast_rcnn_inference_single_image); equals butd class index - 1",
        "attrs": "airsplay attribute notebook: softmax(attr_logits[:, :400]) (no-attribute logit dropped BEFORE the "
        "softmax), argmax / max; attr_prob stores the full 401-way softmax",
        "maxconf": "butd's max_conf local (float64), identical for every setting",
        "tierobust": "img{i}_tierobust_{S}: True when butd's keep (indices and order) is unchanged if numpy's "
        "unstable argsorts (per-class NMS order and the MIN/MAX clamp) break ties by index instead "
        "(both directions); False means the golden selection depends on tie breaking",
        "versions": {
            "torch": torch.__version__,
            "numpy": np.__version__,
            "Pillow": PIL.__version__,
            "opencv": cv2.__version__,
            "python": sys.version.split()[0],
        },
    }
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    arrays["select_nms_rule"] = np.array(rule)
    npz = out / "golden-airsplay.npz"
    np.savez_compressed(npz, **arrays)

    # 5. sanity report
    print(f"\nwrote {npz} ({npz.stat().st_size} bytes); select_nms_rule {rule!r}")
    for name, res, ndiff in pil_checks:
        print(f"PIL decode vs cv2 for {name}: {res} ({ndiff} differing bytes)")
    for i, name, (H, W), (h, w), r, kept in report:
        p = f"img{i}_"
        print(f"\nimage {i} {name}: original {H}x{W}, input {h}x{w}, {r} proposals")
        for k in sorted(arrays):
            if k.startswith(p) and arrays[k].dtype.kind in "fiu" and arrays[k].size:
                a = arrays[k]
                print(
                    f"  {k[len(p) :]:16s} {a.shape!s:18s} {a.dtype!s:8s} min {a.min():.6g} max {a.max():.6g}"
                    f" finite {bool(np.isfinite(a).all())}"
                )
        cpr = arrays[p + "cls_prob"]
        print(
            f"  cls_prob row max: min {cpr.max(1).min():.4g} mean {cpr.max(1).mean():.4g} (uniform 1/1601="
            f"{1 / 1601:.4g}); argmax==background(1600) for {(cpr.argmax(1) == 1600).sum()} rows"
        )
        print(
            f"  rows with cls_prob max == 1.0 exactly: {(cpr.max(1) == 1.0).sum()}; exact zeros in cls_prob: "
            f"{(cpr == 0).sum()} of {cpr.size}; maxconf == 0: {(arrays[p + 'maxconf'] == 0).sum()}"
        )
        pr = arrays[p + "proposals"]
        side = np.minimum(pr[:, 2] - pr[:, 0], pr[:, 3] - pr[:, 1])
        print(
            f"  proposals with a side < 1 px: {(side < 1).sum()}; spanning the full width or height: "
            f"{((pr[:, 2] - pr[:, 0] == w) | (pr[:, 3] - pr[:, 1] == h)).sum()}"
        )
        for s, (n, n_pass, order, ti, tc, rb) in kept.items():
            print(
                f"  {s:6s}: kept {n} ({n_pass} pass conf, {order}; ties among kept {ti}, tie at cut {tc}; "
                f"same keep under fixed tie orders: {rb})"
            )


if __name__ == "__main__":
    main()
