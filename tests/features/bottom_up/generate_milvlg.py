"""Golden data from MILVLG/bottom-up-attention.pytorch (the ``bua/caffe`` path) for capflow's stage-wise tests.

Not a test (no ``test_`` prefix; runs only as a script). It runs MILVLG's OWN code, from a scratch checkout given on
the command line, and writes two files next to this script (or to ``--out``):

* ``data/layout-milvlg.json``: every tensor of MILVLG's model state dict (= its ``.pth`` checkpoint) with shape and
  dtype, plus ``fixed`` = the 12 Caffe anchors for ``proposal_generator.anchor_generator.cell_anchors.0``;
* ``data/golden-milvlg.npz``: per image the reference's intermediate tensors and its box selection (keys
  ``img{i}_*`` of the lead's golden-data contract), plus ``select_nms_rule`` (">=": MILVLG's kernel suppresses at
  IoU >= threshold), ``settings`` (JSON), ``port``, ``num_images``, ``provenance``.

Usage (nothing of MILVLG or detectron2 is imported from the venv; the checkouts shadow the venv's detectron2)::

    PYTHONPATH=/tmp/refdeps-milvlg .venv/bin/python tests/features/bottom_up/generate_milvlg.py \
        --milvlg /tmp/milvlg --detectron2 /tmp/d2-021 --out tests/features/bottom_up/data

``/tmp/milvlg`` = MILVLG @4dbce86 (``git archive HEAD``), ``/tmp/d2-021`` = facebookresearch/detectron2 @be792b9
(v0.2.1, the submodule commit MILVLG pins), ``/tmp/refdeps-milvlg`` = ``pip install --target /tmp/refdeps-milvlg
--no-deps opencv-python-headless`` (MILVLG decodes with ``cv2.imread`` and resizes with ``cv2.resize``).

Pipeline that is run (all MILVLG / detectron2 v0.2.1 code, nothing re-implemented except the NMS kernel):

1. ``utils.extract_features_singlegpu.setup(args)`` builds the config exactly as ``extract_features.py`` does
   (``configs/caffe/test-caffe-r101.yaml``, caffe mode, ``EXTRACT_FEATS``, extract mode ``roi_feats``) with the
   reduced settings of the contract as command-line opts (``MODEL.DEVICE cpu``, ``RPN.PRE_NMS_TOPK_TEST 6000``,
   ``RPN.POST_NMS_TOPK_TEST 24``, ``RPN.NMS_THRESH 0.7``); MILVLG's test scale lives in module globals of
   ``utils/extract_utils.py``, which are set to ``TEST_SCALES = (192,)``, ``TEST_MAX_SIZE = 320``.
2. ``DefaultTrainer.build_model(cfg)`` -> layout; ``weights.write_checkpoint("milvlg", ...)`` writes the seeded file.
3. ``utils.extract_features_singlegpu.extract_feat_singlegpu`` runs unchanged on the two images: it builds the model,
   loads the file with ``DetectionCheckpointer(...).resume_or_load``, decodes with ``cv2.imread``, preprocesses with
   ``get_image_blob``, runs the model and calls ``save_roi_features``. Intermediate tensors are recorded with forward
   hooks (backbone input / res4, RPN output) and by wrapping the module-level ``generate_npz`` (which receives the
   model's outputs: proposals, class probabilities, pooled features, attribute probabilities).
4. After the run: the model's state must equal the file tensor by tensor, and its anchor buffer the Caffe anchors.
5. Selection: ``utils.extract_utils.save_roi_features`` is called on the recorded outputs once per setting (``cfg``
   clone with ``MODEL.BUA.EXTRACTOR.CONF_THRESH / MIN_BOXES / MAX_BOXES``), writing its npz to a scratch folder, which
   is read back. The kept indices come from a second call in which ``features_pooled`` is replaced by the column
   ``arange(R)`` (``save_roi_features`` stores ``feats[keep_boxes]`` as ``x``); the first call's ``x`` is checked to
   equal ``pooled[keep]``.

Shims (all installed by ``install_shims`` below, in this process only; nothing is written into the checkouts):

* ``detectron2._C``: an empty placeholder module. d2 v0.2.1 imports its compiled extension at import time
  (``layers/deform_conv.py``, ``layers/rotated_boxes.py``, ``evaluation/fast_eval_api.py``...); nothing on the CPU
  extraction path calls it (ROIPool is torchvision's, NMS is MILVLG's own).
* ``bua.caffe.modeling._C``: MILVLG's compiled NMS (``bua/caffe/modeling/layers/csrc``), which cannot be built on
  torch 2.x, replaced by ``caffe_nms_cpu`` below: a line-by-line port of ``csrc/nms/nms_cpu.cpp`` (float32
  arithmetic, areas ``(x2-x1+1)*(y2-y1+1)``, overlap ``w*h / (area_i + area_j - inter)`` with ``w = max(0,
  xx2-xx1+1)``, suppression when ``ovr >= threshold`` (threshold cast to float32 as the C++ ``const float``), visiting
  order ``scores.sort(0, descending=True)`` as the kernel does, result = indices of the unsuppressed boxes in
  ascending index order (``nonzero(suppressed == 0)``), int64). The inner loop is vectorised over j with the same
  element-wise float32 operations, which is equivalent because a suppressed j is only ever skipped, never used.
  Checked once against the real kernel (``nms_cpu.cpp`` compiled with torch.utils.cpp_extension, patched only for
  removed ATen APIs: ``.data<T>()`` -> ``.data_ptr<T>()``, ``.type()`` -> ``.scalar_type()`` / ``.is_cuda()``):
  identical results on 1,500 random cases (integer boxes, tied scores, thresholds 0.25-0.7) and on every one of the
  28,802 calls made by a full run of this script.
* ``apex`` / ``apex.amp``: stub whose ``float_function`` is the identity decorator (``bua/caffe/modeling/layers/
  nms.py`` wraps ``_C.nms`` with ``amp.float_function``; inputs here are fp32 already).
* ``ray`` / ``ray.actor``: stub (``remote`` as a no-op decorator, ``ActorHandle``) so that ``utils/progress_bar.py``,
  imported at module level by ``utils/extract_features_singlegpu.py``, imports; ray is never called on this path.
* ``utils`` package: registered as a bare package (``__path__`` = the checkout's ``utils/``) so that its
  ``__init__.py``, which imports the ray-based multi-GPU / d2 extractors, is not executed.
* ``PIL.Image.LINEAR = PIL.Image.BILINEAR`` (removed in Pillow 10; same constant, used as a default argument in
  ``detectron2/data/transforms/transform.py``).
* removed numpy aliases (``np.int``, ``np.float``, ``np.object``, ``np.str``, ``np.bool`` where absent): set to the
  builtins; only referenced by evaluation / visualisation code of d2 v0.2.1, not on this path.
* fvcore / iopath: the venv's fvcore 0.1.5.post20221221 (iopath 0.1.9) is used instead of the mid-2020 fvcore that
  d2 v0.2.1 was released with; its ``fvcore.common.file_io`` and ``Checkpointer`` APIs still satisfy d2 v0.2.1, so
  no shim is needed. ``Checkpointer._load_model`` is the same strict=False ``load_state_dict`` (plus a shape check);
  ``_load_file`` is ``torch.load(map_location=cpu)`` (torch 2.13's default ``weights_only=True`` accepts the file).
* ``detectron2.engine.defaults.collect_env_info``: replaced by a function returning a fixed string, only if the real
  one fails with the placeholder ``_C`` (it is only logged by ``default_setup``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
IMAGES = ["COCO_val2014_000000391895.jpg", "COCO_val2014_000000386164.jpg"]
SETTINGS = {  # name: (CONF_THRESH, MIN_BOXES, MAX_BOXES)
    "t02": (0.2, 10, 100),
    "t0": (0.0, 10, 100),
    "m5x20": (0.0, 5, 20),
    "t09": (0.9, 10, 100),
}
ANCHOR_KEY = "proposal_generator.anchor_generator.cell_anchors.0"


# ----------------------------------------------------------------------------------------------------------------
# Caffe anchors: py-faster-rcnn generate_anchors(base_size=16, ratios=[0.5, 1, 2], scales=[4, 8, 16, 32])
# ----------------------------------------------------------------------------------------------------------------
def caffe_anchors(base_size=16, ratios=(0.5, 1.0, 2.0), scales=(4.0, 8.0, 16.0, 32.0)) -> np.ndarray:
    """The 12 anchors (x1, y1, x2, y2), inclusive "+1" convention, ratio-major, as py-faster-rcnn computes them."""

    def whctrs(a):
        w = a[2] - a[0] + 1
        h = a[3] - a[1] + 1
        return w, h, a[0] + 0.5 * (w - 1), a[1] + 0.5 * (h - 1)

    def mk(ws, hs, xc, yc):
        ws, hs = np.asarray(ws, float)[:, None], np.asarray(hs, float)[:, None]
        return np.hstack((xc - 0.5 * (ws - 1), yc - 0.5 * (hs - 1), xc + 0.5 * (ws - 1), yc + 0.5 * (hs - 1)))

    base = np.array([1, 1, base_size, base_size], float) - 1
    w, h, xc, yc = whctrs(base)
    size_ratios = (w * h) / np.asarray(ratios, float)
    ws = np.round(np.sqrt(size_ratios))
    hs = np.round(ws * np.asarray(ratios, float))
    ratio_anchors = mk(ws, hs, xc, yc)
    out = []
    for a in ratio_anchors:
        w, h, xc, yc = whctrs(a)
        out.append(mk(w * np.asarray(scales), h * np.asarray(scales), xc, yc))
    return np.vstack(out).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Stand-in for MILVLG's compiled CPU NMS kernel (bua/caffe/modeling/layers/csrc/nms/nms_cpu.cpp)
# ----------------------------------------------------------------------------------------------------------------
def caffe_nms_cpu(dets, scores, threshold):
    import torch

    assert dets.device.type == "cpu" and scores.device.type == "cpu"
    assert dets.dtype == scores.dtype, "dets should have the same type as scores"
    if dets.numel() == 0:
        return torch.empty((0,), dtype=torch.int64)
    thr = torch.tensor(threshold, dtype=torch.float32).to(dets.dtype)  # C++: const float threshold
    x1 = dets.select(1, 0).contiguous()
    y1 = dets.select(1, 1).contiguous()
    x2 = dets.select(1, 2).contiguous()
    y2 = dets.select(1, 3).contiguous()
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = scores.sort(0, descending=True)[1]
    n = dets.size(0)
    suppressed = torch.zeros(n, dtype=torch.bool)
    zero = torch.zeros((), dtype=dets.dtype)
    for _i in range(n):
        i = int(order[_i])
        if suppressed[i]:
            continue
        js = order[_i + 1 :]
        if js.numel() == 0:
            break
        js = js[~suppressed[js]]
        if js.numel() == 0:
            continue
        xx1 = torch.maximum(x1[i], x1[js])
        yy1 = torch.maximum(y1[i], y1[js])
        xx2 = torch.minimum(x2[i], x2[js])
        yy2 = torch.minimum(y2[i], y2[js])
        w = torch.maximum(zero, xx2 - xx1 + 1)
        h = torch.maximum(zero, yy2 - yy1 + 1)
        inter = w * h
        ovr = inter / (areas[i] + areas[js] - inter)
        suppressed[js[ovr >= thr]] = True
    return torch.nonzero(~suppressed).squeeze(1)


def install_shims(milvlg: Path, detectron2: Path) -> None:
    sys.path[:0] = [str(milvlg), str(detectron2)]

    d2c = types.ModuleType("detectron2._C")
    d2c.__doc__ = "placeholder for detectron2's compiled extension (not used on the CPU extraction path)"
    sys.modules["detectron2._C"] = d2c

    from PIL import Image

    if not hasattr(Image, "LINEAR"):
        Image.LINEAR = Image.BILINEAR
    for alias, real in (("int", int), ("float", float), ("object", object), ("str", str), ("bool", bool)):
        if alias not in np.__dict__:
            setattr(np, alias, real)

    apex = types.ModuleType("apex")
    amp = types.ModuleType("apex.amp")
    amp.float_function = lambda fn: fn
    apex.amp = amp
    sys.modules["apex"], sys.modules["apex.amp"] = apex, amp

    ray = types.ModuleType("ray")
    ray_actor = types.ModuleType("ray.actor")

    def remote(*a, **k):
        if len(a) == 1 and not k and callable(a[0]):
            return a[0]
        return lambda obj: obj

    ray.remote = remote
    ray_actor.ActorHandle = type("ActorHandle", (), {})
    ray.actor = ray_actor
    sys.modules["ray"], sys.modules["ray.actor"] = ray, ray_actor

    mc = types.ModuleType("bua.caffe.modeling._C")
    mc.nms = caffe_nms_cpu
    sys.modules["bua.caffe.modeling._C"] = mc

    utils_pkg = types.ModuleType("utils")
    utils_pkg.__path__ = [str(milvlg / "utils")]
    sys.modules["utils"] = utils_pkg

    import detectron2.engine.defaults as d2defaults

    try:
        d2defaults.collect_env_info()
    except Exception as e:  # only logged by default_setup
        print(f"[shim] collect_env_info fails ({type(e).__name__}: {e}); replaced by a fixed string")
        d2defaults.collect_env_info = lambda: "(collect_env_info shimmed: placeholder detectron2._C)"


def load_weights_module():
    spec = importlib.util.spec_from_file_location("capflow_bottom_up_weights", HERE / "weights.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stats(a: np.ndarray) -> str:
    if a.size == 0:
        return f"{a.dtype}{list(a.shape)} empty"
    if a.dtype.kind in "fc":
        return f"{a.dtype}{list(a.shape)} min {a.min():.6g} max {a.max():.6g} finite {bool(np.isfinite(a).all())}"
    return f"{a.dtype}{list(a.shape)} min {a.min()} max {a.max()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--milvlg", required=True, type=Path, help="MILVLG/bottom-up-attention.pytorch checkout")
    ap.add_argument("--detectron2", required=True, type=Path, help="detectron2 v0.2.1 (be792b9) checkout")
    ap.add_argument("--out", type=Path, default=HERE / "data", help="where layout-milvlg.json / golden-milvlg.npz go")
    ap.add_argument("--images", type=Path, default=REPO.parent / "shared" / "external" / "images")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new temp dir)")
    opt = ap.parse_args()

    milvlg, d2root = opt.milvlg.resolve(), opt.detectron2.resolve()
    out = opt.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(opt.work or tempfile.mkdtemp(prefix="golden-milvlg-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # MILVLG's scripts use relative paths (sys.path.append('detectron2'), outputs)

    install_shims(milvlg, d2root)
    import cv2
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    import detectron2

    print("detectron2 from", detectron2.__file__, "| cv2", cv2.__version__, "| torch", torch.__version__)
    assert Path(detectron2.__file__).resolve().is_relative_to(d2root)

    import utils.extract_features_singlegpu as efs
    import utils.extract_utils as eu

    eu.TEST_SCALES = (192,)
    eu.TEST_MAX_SIZE = 320
    weights = load_weights_module()

    ckpt = work / "milvlg-seed0.pth"
    args = argparse.Namespace(
        config_file=str(milvlg / "configs" / "caffe" / "test-caffe-r101.yaml"),
        num_cpus=1,
        gpu_id="0",
        mode="caffe",
        extract_mode="roi_feats",
        min_max_boxes="min_max_default",
        output_dir=str(work / "features"),
        image_dir=str(opt.images.resolve()),
        bbox_dir=str(work / "bbox"),
        fastmode=False,
        resume=False,
        opts=[
            "MODEL.DEVICE", "cpu",
            "MODEL.WEIGHTS", str(ckpt),
            "MODEL.RPN.PRE_NMS_TOPK_TEST", 6000,
            "MODEL.RPN.POST_NMS_TOPK_TEST", 24,
            "MODEL.RPN.NMS_THRESH", 0.7,
            "OUTPUT_DIR", str(work / "d2out"),
        ],
    )  # fmt: skip
    os.makedirs(args.output_dir, exist_ok=True)
    cfg = efs.setup(args)

    # ---- 1-2: layout ---------------------------------------------------------------------------------------------
    model0 = efs.DefaultTrainer.build_model(cfg)
    model0.eval()
    sd0 = model0.state_dict()
    generated_anchors = sd0[ANCHOR_KEY].clone() if ANCHOR_KEY in sd0 else None
    anchors = caffe_anchors()
    persistent = ANCHOR_KEY in sd0
    tensors = [[k, list(v.shape), str(v.numpy().dtype)] for k, v in sd0.items()]
    layout = {
        "port": "milvlg",
        "tensors": tensors,
        "fixed": {ANCHOR_KEY: anchors.tolist()},
        "notes": (
            "Recorded from MILVLG/bottom-up-attention.pytorch @4dbce86 (bua/caffe, configs/caffe/test-caffe-r101.yaml, "
            "caffe mode, EXTRACT_FEATS) on detectron2 v0.2.1 (be792b9): model.state_dict() of "
            "GeneralizedBUARCNN, the content of MILVLG's .pth ({'model': state_dict}). "
            f"The anchor buffer {ANCHOR_KEY} IS {'a persistent buffer' if persistent else 'NOT in the state dict'} "
            "in detectron2 v0.2.1 (DefaultAnchorGenerator.cell_anchors is a BufferList of register_buffer'd tensors), "
            "so MILVLG's checkpoint carries it and DetectionCheckpointer loads it. The model builds it from the "
            "config's SIZES [[4, 8, 16, 32]] (pixel sizes to d2) as "
            f"{generated_anchors.tolist() if generated_anchors is not None else None}; the fixed value here is the 12 "
            "Caffe anchors (py-faster-rcnn generate_anchors(16, [0.5, 1, 2], [4, 8, 16, 32]), ratio-major, inclusive "
            "'+1' convention, centre 7.5), which replace them on loading. res4 and res5 use torch BatchNorm2d "
            "(NORM: BN, FREEZE_AT 3) and so have num_batches_tracked (int64); stem/res2/res3 are FrozenBN. "
            "cls_score / cls_embed have 1601 rows with background at index 0; bbox_pred has 1601*4 rows; "
            "RPN objectness_logits has 2*12 channels (bg/fg pairs as (2, A) blocks)."
        ),
    }
    (out / "layout-milvlg.json").write_text(json.dumps(layout, indent=1) + "\n")
    print(f"layout: {len(tensors)} tensors -> {out / 'layout-milvlg.json'}")
    del model0, sd0
    weights.write_checkpoint("milvlg", ckpt, seed=0, layout=layout)

    # ---- 3: MILVLG's own extraction loop, with recording -----------------------------------------------------
    rec: dict[str, dict] = {}
    cur: dict = {}
    holder: dict = {}
    orig_build = efs.DefaultTrainer.build_model

    def build_and_hook(cfg_):
        model = orig_build(cfg_)
        holder["model"] = model
        model.backbone.register_forward_pre_hook(lambda m, inp: cur.__setitem__("input", inp[0].detach().clone()))
        model.backbone.register_forward_hook(lambda m, inp, o: cur.__setitem__("res4", o["res4"].detach().clone()))

        def rpn_hook(m, inp, o):
            props = o[0]
            assert len(props) == 1
            cur["proposals"] = props[0].proposal_boxes.tensor.detach().clone()
            cur["objectness"] = props[0].objectness_logits.detach().clone()
            cur["rpn_image_size"] = tuple(props[0].image_size)

        model.proposal_generator.register_forward_hook(rpn_hook)
        return model

    efs.DefaultTrainer.build_model = staticmethod(build_and_hook)
    orig_generate = efs.generate_npz

    def generate_and_record(mode, *a):
        _args, _cfg, im_file, im, dataset_dict, boxes, scores, feats, attr_scores = a
        assert mode == 1
        rec[im_file] = dict(cur, im=im.copy(), dataset_dict=dataset_dict, boxes=boxes, scores=scores,
                            feats=feats, attr_scores=attr_scores)  # fmt: skip
        cur.clear()
        return orig_generate(mode, *a)

    efs.generate_npz = generate_and_record
    efs.extract_feat_singlegpu(0, list(IMAGES), cfg, args)
    model = holder["model"]

    # ---- 4: the file is in MILVLG's format: loaded state == file ---------------------------------------------
    file_sd = torch.load(ckpt, map_location="cpu")["model"]
    msd = model.state_dict()
    assert list(file_sd) == list(msd), "key set/order differs between file and model"
    bad = [k for k in msd if not (msd[k].dtype == file_sd[k].dtype and torch.equal(msd[k], file_sd[k]))]
    assert not bad, f"{len(bad)} tensors differ after loading: {bad[:5]}"
    loaded_anchors = msd[ANCHOR_KEY]
    assert torch.equal(loaded_anchors, torch.from_numpy(anchors)), loaded_anchors
    buffers = [x[1] for x in model.proposal_generator.anchor_generator.cell_anchors.named_buffers()]
    assert len(buffers) == 1 and torch.equal(buffers[0], torch.from_numpy(anchors))
    print(f"loaded model state == file ({len(msd)} tensors); anchors after loading == Caffe anchors")
    print("anchors generated from SIZES before loading:", generated_anchors.tolist())

    # ---- 5: selection and golden arrays ---------------------------------------------------------------------
    from PIL import Image

    g: dict[str, np.ndarray] = {}
    report = []
    for i, name in enumerate(IMAGES):
        r = rec[name]
        im = r["im"]
        dd = r["dataset_dict"]
        im_scale = float(dd["im_scale"])
        props = r["boxes"][0]
        assert torch.equal(props, r["proposals"]), "proposals given to save_roi_features != RPN output"
        R = props.shape[0]
        p = f"img{i}_"
        g[p + "name"] = np.array(name)
        g[p + "image_size"] = np.array(im.shape[:2], dtype=np.int64)
        g[p + "input_size"] = np.array(dd["image"].shape[1:], dtype=np.int64)
        g[p + "scale"] = np.array([im_scale, im_scale], dtype=np.float64)
        g[p + "decoded"] = np.array(hashlib.sha256(np.ascontiguousarray(im).tobytes()).hexdigest())
        inp = r["input"]
        assert inp.shape[0] == 1 and torch.equal(inp[0], dd["image"].float()), "backbone input != get_image_blob"
        g[p + "input"] = inp[0].numpy().astype(np.float32)
        g[p + "res4"] = r["res4"][0].numpy().astype(np.float32)
        g[p + "proposals"] = props.numpy().astype(np.float32)
        g[p + "objectness"] = r["objectness"].numpy().astype(np.float32)
        pooled = r["feats"][0]
        g[p + "pooled"] = pooled.numpy().astype(np.float32)
        g[p + "cls_prob"] = r["scores"][0].numpy().astype(np.float32)
        g[p + "attr_prob"] = r["attr_scores"][0].numpy().astype(np.float32)

        # decoder check: PIL -> RGB -> BGR vs cv2.imread
        pil = np.asarray(Image.open(opt.images / name).convert("RGB"))[:, :, ::-1]
        dec_diff = (
            "equal"
            if (pil.shape == im.shape and np.array_equal(pil, im))
            else (
                f"max |diff| {np.abs(pil.astype(int) - im.astype(int)).max()}"
                if pil.shape == im.shape
                else "shape differs"
            )
        )

        kept = {}
        for s, (conf, mn, mx) in SETTINGS.items():
            cfg_s = cfg.clone()
            cfg_s.defrost()
            cfg_s.MODEL.BUA.EXTRACTOR.CONF_THRESH = conf
            cfg_s.MODEL.BUA.EXTRACTOR.MIN_BOXES = mn
            cfg_s.MODEL.BUA.EXTRACTOR.MAX_BOXES = mx
            cfg_s.freeze()
            d_real, d_idx = work / f"sel_{s}", work / f"sel_{s}_idx"
            d_real.mkdir(exist_ok=True)
            d_idx.mkdir(exist_ok=True)
            a_real = argparse.Namespace(**{**vars(args), "output_dir": str(d_real)})
            a_idx = argparse.Namespace(**{**vars(args), "output_dir": str(d_idx)})
            eu.save_roi_features(a_real, cfg_s, name, im, dd, r["boxes"], r["scores"], r["feats"], r["attr_scores"])
            idx_col = [torch.arange(R, dtype=torch.float64)[:, None]]
            eu.save_roi_features(a_idx, cfg_s, name, im, dd, r["boxes"], r["scores"], idx_col, r["attr_scores"])
            stem = name.split(".")[0] + ".npz"
            z = np.load(d_real / stem, allow_pickle=True)
            zi = np.load(d_idx / stem, allow_pickle=True)
            keep = zi["x"][:, 0]
            assert np.array_equal(keep, np.round(keep)) and keep.min() >= 0
            keep = keep.astype(np.int64)
            assert np.array_equal(z["x"], pooled.numpy()[keep]), "x != pooled[keep]"
            assert np.array_equal(z["bbox"], zi["bbox"])
            info = z["info"].item()
            assert int(z["num_bbox"]) == len(keep) == info["num_boxes"]
            g[p + f"keep_{s}"] = keep
            g[p + f"boxes_{s}"] = np.asarray(z["bbox"], dtype=np.float32)
            g[p + f"objects_{s}"] = np.asarray(info["objects_id"])
            g[p + f"objconf_{s}"] = np.asarray(info["objects_conf"])
            g[p + f"attrs_{s}"] = np.asarray(info["attrs_id"])
            g[p + f"attrconf_{s}"] = np.asarray(info["attrs_conf"])
            kept[s] = len(keep)
            if s == "t02":  # the extraction run itself wrote the default-setting file: must be identical
                zr = np.load(Path(args.output_dir) / stem, allow_pickle=True)
                assert np.array_equal(zr["x"], z["x"]) and np.array_equal(zr["bbox"], z["bbox"])

        lines = [f"image {i} {name}: H,W {list(im.shape[:2])} -> input {list(dd['image'].shape[1:])} "
                 f"im_scale {im_scale!r}; proposals {R}; decoded vs PIL(RGB->BGR): {dec_diff}"]  # fmt: skip
        for k in sorted(g):
            if k.startswith(p) and g[k].dtype.kind in "fiu":
                lines.append(f"  {k[len(p) :]:<16} {stats(g[k])}")
        cp = g[p + "cls_prob"]
        n_bg = int((cp.argmax(1) == 0).sum())
        lines.append(
            f"  cls_prob row max: min {cp.max(1).min():.4g} median {np.median(cp.max(1)):.4g} "
            f"(uniform {1 / cp.shape[1]:.3g}); argmax==0 (background) for {n_bg}/{R}"
        )
        ap_ = g[p + "attr_prob"]
        lines.append(f"  attr_prob row max: min {ap_.max(1).min():.4g} median {np.median(ap_.max(1)):.4g}")
        lines.append(f"  kept per setting: {kept}; keep_t02 {g[p + 'keep_t02'].tolist()}")
        report.append("\n".join(lines))

    g["port"] = np.array("milvlg")
    g["num_images"] = np.array(len(IMAGES), dtype=np.int64)
    g["select_nms_rule"] = np.array(">=")
    g["settings"] = np.array(json.dumps(SETTINGS))
    g["provenance"] = np.array(
        "MILVLG/bottom-up-attention.pytorch @4dbce86 bua/caffe + detectron2 v0.2.1 @be792b9; torch "
        f"{torch.__version__} CPU fp32 1 thread; cv2 {cv2.__version__}; weights seed 0; TEST_SCALES (192,) "
        "TEST_MAX_SIZE 320; RPN PRE 6000 POST 24 NMS 0.7"
    )
    for k, v in g.items():
        if v.dtype.kind == "f":
            assert np.isfinite(v).all(), k
    npz = out / "golden-milvlg.npz"
    np.savez_compressed(npz, **g)
    print("\n".join(report))
    print(f"wrote {npz} ({npz.stat().st_size} bytes), {len(g)} arrays; scratch {work}")


if __name__ == "__main__":
    main()
