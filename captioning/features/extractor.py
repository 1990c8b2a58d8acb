"""Bottom-up-attention style region features from a detectron2 C4 Faster R-CNN.

Pipeline per image (inference only)::

    RGB uint8 -> ResizeShortestEdge(min_size, max_size) -> (BGR) -> (x - pixel_mean) / pixel_std
    -> backbone (stem, res2..res4) -> RPN proposals (cfg.proposals after the RPN's NMS)
    -> ROIAlign + res5 on every proposal -> mean over 7x7 -> 2048-d feature
    -> class softmax (background excluded) -> per-class NMS -> best surviving class score per proposal
    -> keep proposals scoring above conf_threshold, at least min_boxes, at most max_boxes (or exactly fixed_boxes)

Box selection follows the original bottom-up ``generate_tsv.py``: the per-class NMS runs over the *proposal*
boxes (the boxes the features were pooled from), not over class-specific regressed boxes, so every returned
box is exactly the region its feature describes. The box regressor is therefore never used. A proposal's score
is its highest class probability among the classes in which it survived NMS (0 when it survived in none).
Kept boxes are sorted by score, descending; ties keep the RPN's order (objectness), so the order is total.

Reproducibility: images are batched only with images of the same resized shape (no padding), and the ROI stage
runs image by image, so an image's numbers never depend on which other images share its batch. On CPU the
output is bit-identical across calls, instances, processes and batch compositions *for the same torch thread
count* (oneDNN convolutions, e.g. the RPN head, round differently with 1 and 2 threads: ~1e-6, enough to move a
proposal); on CUDA it is equal within float tolerance (cuDNN may pick different kernels per batch size).
Nothing process-wide is set here: the caller chooses ``torch.set_num_threads``.

Random weights (``cfg.weights`` unset) are built under ``torch.manual_seed(cfg.seed)`` (in a forked RNG, the
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
import multiprocessing
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from captioning.config import ExtractorConfig
from captioning.errors import CapflowError
from captioning.features.selection import (
    nms_max_conf_batched,
    nms_max_conf_batched_torch,
    overlap_masks,
    select_boxes,
)
from captioning.features.weights import (  # noqa: F401 - resolve_weights/weights_cache_dir: the extractor's API
    find_key,
    read_checkpoint,
    resolve,
    resolve_weights,
    weights_cache_dir,
)
from captioning.util import resolve_device

log = logging.getLogger(__name__)

# Known, harmless warnings from detectron2 0.6 on torch 2.13, printed by every worker otherwise.
warnings.filterwarnings("ignore", message=r"torch\.meshgrid: in an upcoming release", category=UserWarning)
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning)

RANDOM_WEIGHTS_WARNING = (
    "RANDOM detector weights (features.extractor.weights is unset): region features come from an untrained "
    "Faster R-CNN. Fine for tests and the demo's plumbing, meaningless for real captioning."
)
BOX_SELECTION = "per-class NMS over proposal boxes; score = best surviving class probability (bottom-up)"
PAD_QUANTUM = 32  # padded batching: the long side of the canvas is a multiple of this
_PRE_NMS_FLOOR = 6000  # detectron2's default RPN.PRE_NMS_TOPK_TEST for C4 models


class ExtractionError(CapflowError, RuntimeError):
    """The detector produced unusable numbers (NaN/inf) for an image; ``index`` is its position in the call."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


@dataclass
class Regions:
    """Regions of one image, sorted by score (descending) unless they were given."""

    features: np.ndarray  # (n, D) float32, mean-pooled res5 features
    boxes: np.ndarray  # (n, 4) float32, x1, y1, x2, y2 divided by the original width/height, in [0, 1]
    scores: np.ndarray  # (n,) float32, best class confidence
    image_size: tuple[int, int]  # (height, width) of the original image
    # bottom-up flavours: per kept box, the box in original-image pixels, the object class (foreground index,
    # 0-based) and its probability, the attribute class (0-based, "no attribute" excluded) and its probability
    extras: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.features.shape[0])


@dataclass
class Prepared:
    """One decoded image, resized and in the model's channel order, waiting for the device."""

    key: Any
    tensor: torch.Tensor  # (3, h, w) uint8 (pinned when the model is on CUDA)
    shape: tuple[int, int]  # resized (h, w)
    image_size: tuple[int, int]  # original (H, W)


@dataclass
class _Detected:
    """A batch's device outputs on their way to the host (copied asynchronously on CUDA)."""

    batch: list[Prepared]
    sizes: list[int]  # proposals per image
    pooled: torch.Tensor  # (sum R, D) float32
    probs: torch.Tensor  # (sum R, K + 1) float32
    boxes: torch.Tensor  # (sum R, 4) float32, resized-image coordinates
    over: torch.Tensor  # (B, R_max, R_max) bool, IoU > nms_threshold; or (B, R_max) best scores when scanned
    scanned: bool = False  # the selection scan already ran on the device
    event: Any = None
    host: list[torch.Tensor] = field(default_factory=list)

    def to_host(self, device: torch.device) -> None:
        parts = (self.pooled, self.probs, self.boxes, self.over)
        if device.type != "cuda":
            self.host = [t.cpu() for t in parts]
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
        for h, t in zip(self.host, parts, strict=True):
            h.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()
        self.pooled = self.probs = self.boxes = self.over = None  # type: ignore[assignment]

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.pooled_h, self.probs_h, self.boxes_h, self.over_h = (t.numpy() for t in self.host)


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


# ---------------------------------------------------------------------- the extractor
def _torch_device(spec: str) -> torch.device:
    return resolve_device(spec, "extractor device")


# What ``auto``/unset extractor settings become on a CUDA device (measured with ``capflow bench extract --device
# cuda``: see the README's extraction figures) and elsewhere (today's CPU behaviour, so CPU stores keep their names).
GPU_DEFAULTS = {"batching": "padded", "batch_size": 16, "amp": False}
CPU_DEFAULTS = {"batching": "exact", "batch_size": 2, "amp": False}


def effective_config(cfg: ExtractorConfig) -> ExtractorConfig:
    """``cfg`` with its automatic settings resolved for the device it names (``auto``: CUDA when present)."""
    kind = str(cfg.device).split(":")[0]
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = GPU_DEFAULTS if kind == "cuda" else CPU_DEFAULTS
    update = {}
    if cfg.batching == "auto":  # the bottom-up references pad nothing: exact batches on every device
        update["batching"] = defaults["batching"] if cfg.flavour == "stock" else "exact"
    if cfg.batch_size is None:
        update["batch_size"] = defaults["batch_size"]
    if cfg.amp is None:
        update["amp"] = defaults["amp"]
    return cfg.model_copy(update=update) if update else cfg


def resized_rgb(image: np.ndarray, min_size: int, max_size: int) -> np.ndarray:
    """``image`` ((H, W, 3) uint8 RGB) resized as detectron2's ``ResizeShortestEdge`` at inference (PIL bilinear):
    a C-contiguous uint8 array of the resized shape (the image itself when no resize is needed)."""
    from detectron2.data.transforms import ResizeShortestEdge, ResizeTransform

    h, w = image.shape[:2]
    shape = ResizeShortestEdge.get_output_shape(h, w, min_size, max_size)
    img = np.ascontiguousarray(image)
    if (h, w) != shape:
        img = ResizeTransform(h, w, shape[0], shape[1], Image.BILINEAR).apply_image(img)
    return np.ascontiguousarray(img)


class RegionExtractor:
    """A detectron2 C4 Faster R-CNN built once; call it on lists of RGB images (``(H, W, 3) uint8``)."""

    def __init__(
        self,
        cfg: ExtractorConfig,
        *,
        min_boxes: int = 10,
        max_boxes: int = 100,
        feature_dim: int = 2048,
        cache_dir: str | Path | None = None,
    ):
        if min_boxes < 1 or max_boxes < min_boxes:
            raise ValueError(f"need 1 <= min_boxes <= max_boxes, got min_boxes={min_boxes}, max_boxes={max_boxes}")
        if cfg.fixed_boxes is not None and cfg.fixed_boxes > max_boxes:
            raise ValueError(f"fixed_boxes={cfg.fixed_boxes} exceeds max_boxes={max_boxes}")
        if cfg.flavour != "stock" and type(self) is RegionExtractor:
            raise ValueError(f"features.extractor.flavour is {cfg.flavour!r}: build the extractor with "
                             "make_extractor (RegionExtractor is the stock detectron2 model)")
        self.cfg = cfg = effective_config(cfg)
        self.min_boxes, self.max_boxes, self.feature_dim = min_boxes, max_boxes, feature_dim
        self.device = _torch_device(cfg.device)
        self.batching = cfg.batching
        self.decode_threads = cfg.decode_threads if cfg.decode_threads is not None else (
            4 if self.device.type == "cuda" else 0)
        self.decode_processes = cfg.decode_processes
        if self.decode_processes and multiprocessing.current_process().daemon:
            self._warn("decode_processes: a daemonic process (e.g. a Dask worker with distributed.worker.daemon "
                       "true) cannot start children; decoding on loader threads instead")
            self.decode_processes = 0
        self._pool: ProcessPoolExecutor | None = None
        # channels-last convolutions: measured on an H100 (R101-C4, batch 16, 600x800), GPU time per image
        # backbone 2.3 -> 2.1 ms, ROI head 6.1 -> 4.4 ms in fp32, 70.4 -> 75.1 images/s end to end; float
        # rounding only
        self.channels_last = (bool(cfg.channels_last) if cfg.channels_last is not None
                              else self.device.type == "cuda")
        # Where the (exact) box-selection scan runs: the host's NumPy scan by default - measured on an H100 at
        # the coco settings, 58 img/s end to end against 55 with the scan's ~2,000 small kernels on the device
        self.select_on_device = bool(cfg.selection_on_device) and self.device.type == "cuda"
        self.profile: dict[str, float] | None = None  # per-stage seconds, when a benchmark asks for them
        self._last_mark = 0.0
        self.warnings: list[str] = []
        self.random_init = cfg.weights is None

        checkpoint = None
        if self.random_init:
            self.weights_digest = f"random-init:{cfg.seed}:{cfg.model_config_file}"
            self.weights_path: Path | None = None
        else:
            path, digest = resolve(cfg.weights, cfg.weights_sha256, Path(cache_dir or weights_cache_dir()))
            self.weights_digest, self.weights_path = digest, path
            checkpoint = read_checkpoint(path)

        self._setup(checkpoint)
        if self.random_init:
            self._warn(RANDOM_WEIGHTS_WARNING)

    # ------------------------------------------------------------------ construction
    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        log.warning(msg)

    def _setup(self, checkpoint: dict[str, Any] | None) -> None:
        """Build the model (and its settings) from the checkpoint, if any."""
        self.detectron2_cfg = self._build_cfg(checkpoint)
        self.num_classes = int(self.detectron2_cfg.MODEL.ROI_HEADS.NUM_CLASSES)
        self.model = self._build_model(checkpoint)
        self.input_format = self.detectron2_cfg.INPUT.FORMAT

    def _build_cfg(self, checkpoint: dict[str, Any] | None):
        from detectron2 import model_zoo
        from detectron2.config import get_cfg
        from detectron2.modeling import ROI_HEADS_REGISTRY

        c = self.cfg
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
            self._warn(f"ROI heads {d2.MODEL.ROI_HEADS.NAME!r} unknown to detectron2; using Res5ROIHeads")
            d2.MODEL.ROI_HEADS.NAME = "Res5ROIHeads"
        d2.MODEL.DEVICE = str(self.device)
        d2.MODEL.WEIGHTS = ""
        d2.MODEL.MASK_ON = False
        d2.MODEL.KEYPOINT_ON = False
        d2.INPUT.MIN_SIZE_TEST = c.min_size
        d2.INPUT.MAX_SIZE_TEST = c.max_size
        d2.MODEL.RPN.POST_NMS_TOPK_TEST = c.proposals
        d2.MODEL.RPN.PRE_NMS_TOPK_TEST = max(int(d2.MODEL.RPN.PRE_NMS_TOPK_TEST), _PRE_NMS_FLOOR, c.proposals)
        if d2.INPUT.FORMAT not in ("BGR", "RGB"):
            raise ValueError(f"unsupported INPUT.FORMAT {d2.INPUT.FORMAT!r} (BGR or RGB)")
        if checkpoint is not None:
            self._adapt_to_checkpoint(d2, checkpoint)
        out = d2.MODEL.RESNETS.RES2_OUT_CHANNELS * 8
        if out != self.feature_dim:
            raise ValueError(f"the model's res5 gives {out}-d features but feature_dim={self.feature_dim}")
        return d2

    def _adapt_to_checkpoint(self, d2, checkpoint: dict[str, Any]) -> None:
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

    def _build_model(self, checkpoint: dict[str, Any] | None):
        from detectron2.modeling import build_model
        from detectron2.modeling.backbone.resnet import BottleneckBlock

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            model = build_model(self.detectron2_cfg)
        roi = model.roi_heads
        if not (hasattr(roi, "res5") and hasattr(roi, "_shared_roi_transform")):
            raise ValueError(
                f"{self.cfg.model_config_file}: region features need a C4 model (Res5ROIHeads), "
                f"got {type(roi).__name__}"
            )
        if self.random_init:
            blocks = [m for m in model.modules() if isinstance(m, BottleneckBlock)]
            with torch.no_grad():
                for b in blocks:
                    b.conv3.norm.weight.zero_()  # FrozenBatchNorm2d buffer (or BatchNorm2d parameter)
            log.info("random init: zeroed the last norm scale of %d bottleneck blocks (identity residuals)",
                     len(blocks))
        else:
            self._load_weights(model, checkpoint)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    def _load_weights(self, model, checkpoint: dict[str, Any]) -> None:
        from detectron2.checkpoint import DetectionCheckpointer

        dropped_bbox = checkpoint.pop("_dropped_bbox_pred", False)
        self._refuse_bottom_up(checkpoint["model"])
        self._check_anchors(model, checkpoint["model"])
        ckpt = DetectionCheckpointer(model)
        inc = ckpt._load_model(checkpoint)
        if inc.incorrect_shapes:
            k, shape_ckpt, shape_model = inc.incorrect_shapes[0]
            raise ValueError(
                f"detector weights {self.weights_path} do not fit {self.cfg.model_config_file}: "
                f"{len(inc.incorrect_shapes)} tensors of the wrong shape, e.g. {k} {shape_ckpt} vs {shape_model}"
            )
        missing = [k for k in inc.missing_keys if not (dropped_bbox and "bbox_pred" in k)]
        if missing:
            raise ValueError(
                f"detector weights {self.weights_path} lack {len(missing)} tensors of "
                f"{self.cfg.model_config_file}, e.g. {missing[:4]}: wrong model_config_file for these weights?"
            )
        unused = sorted(k for k in inc.unexpected_keys if ".cell_anchors." not in k)
        if unused:
            raise ValueError(f"detector weights {self.weights_path}: {len(unused)} tensors the model of "
                             f"{self.cfg.model_config_file} does not use: {unused[:8]} (a different function "
                             "would be computed silently: refused)")

    def _refuse_bottom_up(self, state: dict[str, Any]) -> None:
        """A bottom-up port's checkpoint given to the stock flavour: refused, naming the flavour to use."""
        from captioning.features.bottom_up import LayoutError, recognise_layout

        try:
            layout = recognise_layout(state)
        except LayoutError:
            return
        # the stock C4 layout shares airsplay's names: only a port's own marks decide (its attribute head, Caffe
        # objectness pairs, or the VG detector's 1600 classes behind a 512-channel RPN)
        if not (layout.attributes or layout.objectness == "softmax2"
                or (layout.num_classes == 1600 and layout.rpn_hidden == 512)):
            return
        raise ValueError(f"detector weights {self.weights_path} are the {layout.port} bottom-up layout "
                         f"({layout.describe()}): set features.extractor.flavour: {layout.port}")

    def _check_anchors(self, model, state: dict[str, Any]) -> None:
        """Anchors stored in the checkpoint (dropped by detectron2 0.6 on load) must equal the config's."""
        gen = getattr(getattr(model, "proposal_generator", None), "anchor_generator", None)
        for k in [k for k in state if ".anchor_generator.cell_anchors." in k]:
            level = int(k.rsplit(".", 1)[1])
            cells = list(gen.cell_anchors.buffers()) if gen is not None else []  # detectron2's BufferList
            have = cells[level].detach().cpu() if level < len(cells) else None
            stored = torch.as_tensor(state[k]).float()
            if have is None or have.shape != stored.shape or not torch.allclose(have, stored, rtol=0, atol=1e-4):
                raise ValueError(f"detector weights {self.weights_path}: stored anchors {k} {stored.tolist()} differ "
                                 f"from the anchors of {self.cfg.model_config_file} "
                                 f"({None if have is None else have.tolist()}): refused")

    # ------------------------------------------------------------------ preprocessing (CPU, thread-safe)
    def _resized_shape(self, image: np.ndarray) -> tuple[int, int]:
        from detectron2.data.transforms import ResizeShortestEdge

        h, w = image.shape[:2]
        return ResizeShortestEdge.get_output_shape(h, w, self.cfg.min_size, self.cfg.max_size)

    def prepare(self, image: np.ndarray, key: Any = None) -> Prepared:
        """Resize (PIL bilinear, as detectron2's ResizeShortestEdge): uint8 RGB (h, w, 3), still on the CPU.

        The device reorders channels, converts to float and normalises (:meth:`_model_input`); bilinear resizing
        treats channels independently, so the numbers equal detectron2's CPU path (flip, resize, float) exactly.
        """
        self._check_images([image])
        h, w = image.shape[:2]
        return self._prepared(key, resized_rgb(image, self.cfg.min_size, self.cfg.max_size), (int(h), int(w)))

    def _prepared(self, key: Any, img: np.ndarray, image_size: tuple[int, int]) -> Prepared:
        t = torch.from_numpy(img)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return Prepared(key=key, tensor=t, shape=(int(img.shape[0]), int(img.shape[1])), image_size=image_size)

    def _process_pool(self) -> ProcessPoolExecutor:
        """The loader processes (spawned on first use, kept for the extractor's life)."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.decode_processes, mp_context=multiprocessing.get_context("spawn"))
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def _drop_pool(self, why: BaseException) -> None:
        if self._pool is not None:
            self._warn(f"loader processes failed ({type(why).__name__}: {why}); decoding on loader threads from now on")
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.decode_processes = 0

    def _model_input(self, t: torch.Tensor) -> torch.Tensor:
        """(h, w, 3) uint8 RGB -> (3, h, w) float32 in the model's channel order, where ``t`` is."""
        x = t.permute(2, 0, 1)
        if self.input_format == "BGR":
            x = x.flip(0)
        return x.float()

    def _to_tensor(self, image: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
        p = self.prepare(image)
        assert p.shape == shape
        return self._model_input(p.tensor)

    @staticmethod
    def _check_images(images: list[np.ndarray]) -> None:
        for i, im in enumerate(images):
            if not (isinstance(im, np.ndarray) and im.dtype == np.uint8 and im.ndim == 3 and im.shape[2] == 3):
                desc = f"{im.dtype} {im.shape}" if isinstance(im, np.ndarray) else type(im).__name__
                raise ValueError(f"image {i}: expected an (H, W, 3) uint8 RGB array, got {desc}")
            if min(im.shape[:2]) < 1:
                raise ValueError(f"image {i}: empty image {im.shape}")

    def _batches(self, images: list[np.ndarray]) -> list[tuple[list[int], tuple[int, int]]]:
        """Indices batched by identical resized shape (no padding), batch_size at most, in first-seen order."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, im in enumerate(images):
            groups.setdefault(self._resized_shape(im), []).append(i)
        bs = self.cfg.batch_size
        return [(idx[s : s + bs], shape) for shape, idx in groups.items() for s in range(0, len(idx), bs)]

    def padded_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The canonical padded (h, w) of a resized image in ``padded`` batching: the short side padded to
        ``min_size``, the long side rounded up to a multiple of 32. It depends on the image alone, so an image's
        features never depend on which images share its batch (a resumed run equals an uninterrupted one)."""
        h, w = shape
        q = PAD_QUANTUM
        if w >= h:
            return max(h, self.cfg.min_size), -(-w // q) * q
        return -(-h // q) * q, max(w, self.cfg.min_size)

    def _group_key(self, p: Prepared) -> tuple[int, int]:
        """Images that may share a batch: the same resized shape (exact), the same padded shape (padded)."""
        return p.shape if self.batching == "exact" else self.padded_shape(p.shape)

    def _autocast(self):
        dtype = torch.bfloat16 if self.cfg.amp_dtype == "bfloat16" else torch.float16
        on = bool(self.cfg.amp and self.device.type == "cuda")
        return torch.autocast(device_type="cuda", dtype=dtype, enabled=on)

    # ------------------------------------------------------------------ model stages (device)
    def _mark(self, stage: str) -> None:
        """Per-stage timing for ``capflow bench extract`` (synchronising: only when a profile is being taken)."""
        if self.profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.profile[stage] = self.profile.get(stage, 0.0) + now - self._last_mark
        self._last_mark = now

    def _backbone(self, tensors: list[torch.Tensor]):
        """Normalise on the device ((x - mean) / std, as detectron2) and run the backbone on one batch tensor.

        exact: the images share one shape (detectron2's ImageList adds nothing); padded: each image sits
        top-left in a zero (= mean colour) canvas of its :meth:`padded_shape`, which the batch shares.
        """
        from detectron2.structures import ImageList

        m = self.model
        xs = []
        for t in tensors:  # prepared uint8 HWC RGB, or an already converted float CHW tensor (_to_tensor)
            t = t.to(self.device, non_blocking=True)
            x = t if t.dtype == torch.float32 else self._model_input(t)
            xs.append((x - m.pixel_mean) / m.pixel_std)
        if self.batching == "exact":
            images = ImageList.from_tensors(xs, m.backbone.size_divisibility)
        else:
            hc, wc = self.padded_shape(tuple(xs[0].shape[1:]))
            canvas = xs[0].new_zeros(len(xs), 3, hc, wc)
            for j, x in enumerate(xs):
                canvas[j, :, : x.shape[1], : x.shape[2]] = x
            images = ImageList(canvas, [(int(x.shape[1]), int(x.shape[2])) for x in xs])
        features = m.backbone(images.tensor)
        return images, features

    def _roi(self, features: dict[str, torch.Tensor], j: int, boxes) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled res5 features (R, D) and class probabilities (R, K+1) for image ``j`` of the batch."""
        roi = self.model.roi_heads
        feats = [features[f][j : j + 1] for f in roi.in_features]
        x = roi._shared_roi_transform(feats, [boxes]).mean(dim=[2, 3])
        logits = roi.box_predictor.cls_score(x)
        return x.float(), F.softmax(logits.float(), dim=-1)

    def _roi_batched(self, features: dict[str, torch.Tensor], boxes: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled features and class probabilities of every proposal of the batch in one ROI-head call."""
        roi = self.model.roi_heads
        x = roi._shared_roi_transform([features[f] for f in roi.in_features], boxes).mean(dim=[2, 3])
        logits = roi.box_predictor.cls_score(x)
        return x.float(), F.softmax(logits.float(), dim=-1)

    def _detect(self, batch: list[Prepared]) -> _Detected:
        """Backbone, RPN and ROI head of one batch on the device; results copied to the host asynchronously."""
        if self.profile is not None:
            self._mark("wait")
        imgs, features = self._backbone([p.tensor for p in batch])
        self._mark("backbone")
        proposals, _ = self.model.proposal_generator(imgs, features, None)
        self._mark("rpn")
        boxes = [p.proposal_boxes for p in proposals]
        if self.batching == "exact":
            parts = [self._roi(features, j, b) for j, b in enumerate(boxes)]
            pooled = torch.cat([p for p, _ in parts]) if parts else None
            probs = torch.cat([q for _, q in parts]) if parts else None
        else:
            pooled, probs = self._roi_batched(features, boxes)
        self._mark("roi_head")
        box_t = [b.tensor.float() for b in boxes]
        over = overlap_masks(box_t, self.cfg.nms_threshold)
        sizes = [int(b.shape[0]) for b in box_t]
        r = max(sizes) if sizes else 0
        over_pad = torch.zeros(len(batch), r, r, dtype=torch.bool, device=self.device)
        for j, o in enumerate(over):
            over_pad[j, : sizes[j], : sizes[j]] = o
        scanned = self.device.type == "cuda" and self.select_on_device
        if scanned:  # the selection scan on the device: only (B, R) best scores travel to the host
            k = probs.shape[1] - 1
            s_pad = torch.full((len(batch), r, k), float("-inf"), dtype=torch.float32, device=self.device)
            for j, part in enumerate(torch.split(probs, sizes)):
                s_pad[j, : sizes[j]] = part[:, :-1]
            over_pad = nms_max_conf_batched_torch(over_pad, s_pad)
            self._mark("selection")
        host = _Detected(batch=batch, sizes=sizes, pooled=pooled, probs=probs, boxes=torch.cat(box_t), over=over_pad,
                         scanned=scanned)
        host.to_host(self.device)
        self._mark("to_host")
        return host

    def _check_finite(self, index: int, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if not bool(torch.isfinite(t).all()):
                raise ExtractionError(
                    f"image {index}: the detector produced non-finite values (NaN/inf) in its region features "
                    "or class scores; the image cannot be used with these weights", index
                )

    def _select(self, max_conf: np.ndarray) -> np.ndarray:
        """Indices of the kept boxes, by score descending then index."""
        return select_boxes(max_conf, conf_threshold=self.cfg.conf_threshold, min_boxes=self.min_boxes,
                            max_boxes=self.max_boxes, fixed_boxes=self.cfg.fixed_boxes)

    def _finish(self, det: _Detected) -> list[tuple[Any, Regions | Exception]]:
        """Host side of a batch: box selection (all images at once) and the kept regions; runs off the GPU's path."""
        det.wait()
        t0 = time.perf_counter()
        offs = np.concatenate([[0], np.cumsum(det.sizes)]).astype(int)
        pooled, probs, boxes, over = det.pooled_h, det.probs_h, det.boxes_h, det.over_h
        out: list[tuple[Any, Regions | Exception]] = []
        good: list[int] = []
        for j, p in enumerate(det.batch):
            s, e = offs[j], offs[j + 1]
            if not (np.isfinite(pooled[s:e]).all() and np.isfinite(probs[s:e]).all()):
                out.append((p.key, ExtractionError(
                    f"image {p.key}: the detector produced non-finite values (NaN/inf) in its region features or "
                    "class scores; the image cannot be used with these weights", j)))
            else:
                good.append(j)
        if det.scanned:  # selected on the device already
            confs = [over[j, : det.sizes[j]].astype(np.float32) for j in good]
        else:
            confs = nms_max_conf_batched(
                [over[j, : det.sizes[j], : det.sizes[j]] for j in good],
                [probs[offs[j] : offs[j + 1], :-1] for j in good],
            )
        for j, max_conf in zip(good, confs, strict=True):
            p = det.batch[j]
            s = offs[j]
            keep = self._select(max_conf)
            h, w = p.shape
            rel = boxes[s + keep] / np.array([w, h, w, h], dtype=np.float32)  # resized -> relative
            out.append((p.key, Regions(
                features=np.ascontiguousarray(pooled[s + keep], dtype=np.float32),
                boxes=np.ascontiguousarray(np.clip(rel, 0.0, 1.0).astype(np.float32)),
                scores=np.ascontiguousarray(max_conf[keep], dtype=np.float32),
                image_size=p.image_size,
            )))
        if self.profile is not None:
            self.profile["selection"] = self.profile.get("selection", 0.0) + time.perf_counter() - t0
        return out

    def _detect_safe(self, batch: list[Prepared]) -> list[_Detected | tuple[Any, Exception]]:
        """One batch, or image by image when the batch fails, so that one image cannot sink the others."""
        with torch.inference_mode(), self._autocast():
            try:
                return [self._detect(batch)]
            except Exception as e:
                if len(batch) == 1:
                    return [(batch[0].key, e)]
                log.warning("a batch of %d images failed (%s); extracting image by image", len(batch), e)
                return [x for p in batch for x in self._detect_safe([p])]

    def _finished(self, d: _Detected | tuple[Any, Exception]) -> list[tuple[Any, Regions | Exception]]:
        return self._finish(d) if isinstance(d, _Detected) else [d]

    # ------------------------------------------------------------------ public API
    def stream(self, items: Iterable[tuple[Any, Callable[[], np.ndarray]]], *, threads: int | None = None,
               window: int | None = None) -> Iterator[tuple[Any, Regions | Exception]]:
        """Extract a stream of images: ``items`` yields ``(key, load)`` where ``load()`` returns the RGB array or
        raises (e.g. ``ImageRejected``); yields ``(key, Regions)`` or ``(key, exception)`` for every item, in
        completion order (:class:`captioning.features.stream.ExtractionStream`). ``threads`` decode/resize threads
        run ahead of the model (default ``decode_threads``; ``decode_processes`` processes instead for picklable
        ``load`` callables; ``threads=0`` loads inline); batches form among up to ``window`` ready images (default
        4 x batch_size) by :meth:`_group_key`."""
        from captioning.features.stream import ExtractionStream

        threads = self.decode_threads if threads is None else threads
        return ExtractionStream(self, threads, window or 4 * self.cfg.batch_size).run(items)

    def __call__(self, images: list[np.ndarray]) -> list[Regions]:
        """Regions of each image (same order). Raises ExtractionError for non-finite model outputs."""
        self._check_images(images)
        out: dict[int, Regions | Exception] = {}
        for i, r in self.stream(((i, (lambda im=im: im)) for i, im in enumerate(images)), threads=0,
                                window=max(len(images), 1)):
            out[i] = r
        for i in range(len(images)):
            r = out[i]
            if isinstance(r, ExtractionError):
                raise ExtractionError(str(r), i)
            if isinstance(r, Exception):
                raise r
        return [out[i] for i in range(len(images))]  # type: ignore[misc]

    def _given_boxes(self, images: list[np.ndarray], boxes: list[np.ndarray]) -> list[np.ndarray]:
        """The images checked and each image's boxes as a finite (n, 4) float32 array clipped to [0, 1]."""
        self._check_images(images)
        if len(boxes) != len(images):
            raise ValueError(f"{len(images)} images but {len(boxes)} box arrays")
        out = []
        for i, b in enumerate(boxes):
            b = np.asarray(b, dtype=np.float32)
            if b.ndim != 2 or b.shape[1] != 4 or not np.all(np.isfinite(b)):
                raise ValueError(f"boxes {i}: expected a finite (n, 4) array, got shape {b.shape}")
            b = np.clip(b, 0.0, 1.0)
            if np.any(b[:, 2] < b[:, 0]) or np.any(b[:, 3] < b[:, 1]):
                raise ValueError(f"boxes {i}: need x1 <= x2 and y1 <= y2")
            out.append(b)
        return out

    def extract_given(self, images: list[np.ndarray], boxes: list[np.ndarray]) -> list[Regions]:
        """Features and best class scores of the given boxes ((n, 4) relative x1, y1, x2, y2), in their order."""
        rel_boxes = self._given_boxes(images, boxes)
        from detectron2.structures import Boxes

        out: list[Regions | None] = [None] * len(images)
        with torch.inference_mode(), self._autocast():
            for idx, shape in self._batches(images):
                tensors = [self._to_tensor(images[i], shape) for i in idx]
                _, features = self._backbone(tensors)
                h, w = shape
                scale = torch.tensor([w, h, w, h], dtype=torch.float32)
                for j, i in enumerate(idx):
                    b = torch.from_numpy(rel_boxes[i]) * scale
                    pooled, probs = self._roi(features, j, Boxes(b.to(self.device)))
                    self._check_finite(i, pooled, probs)
                    scores = probs[:, :-1].amax(dim=1) if probs.shape[0] else probs.new_zeros(0)
                    out[i] = Regions(
                        features=np.ascontiguousarray(pooled.cpu().numpy(), dtype=np.float32),
                        boxes=rel_boxes[i].copy(),
                        scores=scores.cpu().numpy().astype(np.float32),
                        image_size=(int(images[i].shape[0]), int(images[i].shape[1])),
                    )
        return out  # type: ignore[return-value]

    def describe(self) -> dict[str, Any]:
        """JSON-able description (for store attributes): settings, weights identity, device, versions."""
        import detectron2

        return {
            "config": self.cfg.model_dump(mode="json"),
            "weights_digest": self.weights_digest,
            "random_init": self.random_init,
            "device": str(self.device),
            "amp": bool(self.cfg.amp and self.device.type == "cuda"),
            "amp_dtype": self.cfg.amp_dtype,
            "batching": self.batching,
            "channels_last": self.channels_last,
            "decode_processes": self.decode_processes,
            "num_classes": self.num_classes,
            "min_boxes": self.min_boxes,
            "max_boxes": self.max_boxes,
            "feature_dim": self.feature_dim,
            "box_selection": BOX_SELECTION,
            "input_format": self.input_format,
            "detectron2_version": detectron2.__version__,
            "torch_version": torch.__version__,
            "warnings": list(self.warnings),
        }


def make_extractor(cfg: ExtractorConfig, **kwargs: Any) -> RegionExtractor:
    """The extractor of ``cfg.flavour``: the stock detectron2 model, or a bottom-up port's exact pipeline."""
    if cfg.flavour == "stock":
        return RegionExtractor(cfg, **kwargs)
    from captioning.features.bottom_up_extractor import BottomUpExtractor

    return BottomUpExtractor(cfg, **kwargs)
