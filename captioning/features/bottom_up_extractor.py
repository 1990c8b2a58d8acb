"""The extractor of the bottom-up flavours (``airsplay``, ``milvlg``): the same streaming, batching and store
interface as the stock ``RegionExtractor`` (:class:`captioning.features.engine.ExtractorEngine`), with the model
of :mod:`captioning.features.bottom_up_model` and the per-image stages of :mod:`captioning.features.bottom_up`.

Images are batched only with images of the same input shape (the references run one image at a time and pad
nothing), the backbone runs on the batch, and every later stage runs image by image, so an image's numbers never
depend on its batch. Box selection runs on the host as soon as an image's tensors are there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from captioning.features.base import PRE_NMS_FLOOR, ExtractionError, Prepared, Regions, Result, resized_rgb
from captioning.features.bottom_up import BottomUpStages, caffe_preprocess, caffe_scale
from captioning.features.bottom_up_layout import default_layout, recognise_layout
from captioning.features.bottom_up_model import BottomUpDetector, load_state, random_init
from captioning.features.bottom_up_options import REFERENCE, deviations, resolved_options
from captioning.features.engine import ExtractorEngine
from captioning.features.registry import register

STOCK_CONFIG = "COCO-Detection/faster_rcnn_R_101_C4_3x.yaml"
RPN_NMS = 0.7  # both ports


@dataclass
class _Ready:
    """A batch's finished results (selection already done)."""

    results: list[Result]


@register(*REFERENCE)
class BottomUpExtractor(ExtractorEngine):
    """The Visual Genome bottom-up detector as the ``airsplay`` or ``milvlg`` port computes it."""

    def _setup(self, checkpoint: dict[str, Any] | None) -> None:
        c = self.cfg
        if c.model_config_file != STOCK_CONFIG:
            raise ValueError(f"features.extractor.model_config_file ({c.model_config_file!r}) configures the stock "
                             f"flavour; the {c.flavour} flavour's model is fixed by its reference (options: "
                             "features.extractor.bottom_up.*)")
        if c.batching == "padded":
            raise ValueError("features.extractor.batching: padded is not available for the bottom-up flavours: the "
                             "references pad nothing, and padding changes the features near the image border")
        self.batching = "exact"
        self.opts = resolved_options(c.flavour, c.bottom_up)
        if checkpoint is not None:
            state = checkpoint["model"]
            self.layout = recognise_layout(state, expect=c.flavour)
        else:
            state = None
            self.layout = default_layout(c.flavour)
        model = BottomUpDetector(self.layout, self.opts)
        if state is not None:
            self.load_report = load_state(model, state, str(self.weights_path))
        else:
            random_init(model, c.seed)
            self.load_report = {}
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        model.to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        self.stages = BottomUpStages(model, self.opts, pre_nms=max(PRE_NMS_FLOOR, c.proposals),
                                     post_nms=c.proposals, rpn_nms=RPN_NMS)
        self.detectron2_cfg = None
        self.num_classes = self.layout.num_classes
        self.input_format = "BGR"

    # ------------------------------------------------------------------ preprocessing
    def _resized_shape(self, image: np.ndarray) -> tuple[int, int]:
        if self.opts["resize"] != "caffe":
            return super()._resized_shape(image)
        h, w = image.shape[:2]
        s = caffe_scale(h, w, self.cfg.min_size, self.cfg.max_size)
        return round(h * s), round(w * s)

    def prepare(self, image: np.ndarray, key: Any = None) -> Prepared:
        """detectron2 resize: the resized uint8 RGB image; caffe resize: the (3, h, w) float32 network input."""
        self._check_images([image])
        h, w = image.shape[:2]
        if self.opts["resize"] != "caffe":
            return self._prepared(key, resized_rgb(image, self.cfg.min_size, self.cfg.max_size), (int(h), int(w)))
        x, _ = caffe_preprocess(image[:, :, ::-1], self.model.pixel_mean, self.cfg.min_size, self.cfg.max_size)
        return Prepared(key=key, tensor=x, shape=(int(x.shape[1]), int(x.shape[2])), image_size=(int(h), int(w)))

    def network_input(self, p: Prepared) -> torch.Tensor:
        """(3, h, w) float32 on the device: what enters the backbone."""
        t = p.tensor.to(self.device, non_blocking=True)
        if t.dtype == torch.float32:  # caffe resize: normalised already
            return t
        return (self._model_input(t) - self.model.pixel_mean) / self.model.pixel_std

    def to_original(self, boxes: torch.Tensor, shape: tuple[int, int], image_size: tuple[int, int]) -> torch.Tensor:
        """Resized-image boxes -> original-image pixels: by one im_scale (caffe resize) or per axis (W/w, H/h)."""
        h, w = shape
        H, W = image_size
        if self.opts["resize"] == "caffe":
                return boxes / caffe_scale(H, W, self.cfg.min_size, self.cfg.max_size)
        out = boxes.clone()
        out[:, 0::2] *= W / w
        out[:, 1::2] *= H / h
        return out

    # ------------------------------------------------------------------ device + host
    def _detect(self, batch: list[Prepared]) -> _Ready:  # type: ignore[override]
        if self.profile is not None:
            self._mark("wait")
        x = torch.stack([self.network_input(p) for p in batch])
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        res4 = self.stages.backbone(x)
        self._mark("backbone")
        out: list[Result] = []
        for j, p in enumerate(batch):
            r4 = res4[j : j + 1]
            im_scale = float(p.shape[0]) / float(p.image_size[0])
            if self.opts["resize"] == "caffe":
                        im_scale = caffe_scale(p.image_size[0], p.image_size[1], self.cfg.min_size, self.cfg.max_size)
            props = self.stages.proposals(r4, p.shape, im_scale)
            self._mark("rpn")
            pooled, cls_prob, attr_prob = self.stages.head(r4, props.boxes)
            self._mark("roi_head")
            boxes_px = self.to_original(props.boxes.float(), p.shape, p.image_size)
            out.append((p.key, self._regions(j, p, pooled, cls_prob, attr_prob, boxes_px)))
        return _Ready(out)

    def _finished(self, d) -> list[Result]:
        return d.results if isinstance(d, _Ready) else [d]

    def _regions(self, j: int, p: Prepared, pooled, cls_prob, attr_prob, boxes_px) -> Regions | Exception:
        t0 = time.perf_counter()
        pooled = pooled.float().cpu().numpy()
        cls_prob = cls_prob.float().cpu().numpy()
        attr = attr_prob.float().cpu().numpy() if attr_prob is not None else None
        px = boxes_px.cpu().numpy().astype(np.float32)
        if not (np.isfinite(pooled).all() and np.isfinite(cls_prob).all()):
            return ExtractionError(f"image {p.key}: the detector produced non-finite values (NaN/inf) in its region "
                                   "features or class scores; the image cannot be used with these weights", j)
        lo, hi = self.min_boxes, self.max_boxes
        if self.cfg.fixed_boxes is not None:
            lo = hi = self.cfg.fixed_boxes
        keep, max_conf = self.stages.select(px, cls_prob, conf_threshold=self.cfg.conf_threshold,
                                            nms_threshold=self.cfg.nms_threshold, min_boxes=lo, max_boxes=hi)
        H, W = p.image_size
        kept_px = px[keep]
        rel = np.clip(kept_px / np.array([W, H, W, H], dtype=np.float32), 0.0, 1.0).astype(np.float32)
        extras: dict[str, np.ndarray] = {"boxes_px": np.ascontiguousarray(kept_px)}
        if self.opts["attributes"]:
            fg = cls_prob[keep][:, 1:] if self.layout.background == 0 else cls_prob[keep][:, :-1]
            extras["object_id"] = fg.argmax(axis=1).astype(np.int32)
            extras["object_conf"] = fg.max(axis=1).astype(np.float32)
            if attr is not None:
                if self.layout.background == 0:  # MILVLG: the 401-way probability ("no attribute" first)
                    a = attr[keep][:, 1:]
                else:  # airsplay's notebook: a softmax over the 400 attributes ("no attribute", last, left out)
                    a = attr[keep][:, :-1] / np.maximum(1.0 - attr[keep][:, -1:], np.finfo(np.float32).tiny)
                extras["attr_id"] = a.argmax(axis=1).astype(np.int32)
                extras["attr_conf"] = a.max(axis=1).astype(np.float32)
        if self.profile is not None:
            self.profile["selection"] = self.profile.get("selection", 0.0) + time.perf_counter() - t0
        return Regions(features=np.ascontiguousarray(pooled[keep], dtype=np.float32), boxes=rel,
                       scores=np.ascontiguousarray(max_conf[keep], dtype=np.float32), image_size=p.image_size,
                       extras=extras)

    # ------------------------------------------------------------------ given boxes
    def extract_given(self, images: list[np.ndarray], boxes: list[np.ndarray]) -> list[Regions]:
        """Features and best class scores of given boxes ((n, 4) relative x1, y1, x2, y2), in their order."""
        rel_boxes = self._given_boxes(images, boxes)
        out: list[Regions] = []
        with torch.inference_mode():
            for i, (im, b) in enumerate(zip(images, rel_boxes, strict=True)):
                p = self.prepare(im, i)
                h, w = p.shape
                res4 = self.stages.backbone(self.network_input(p)[None])
                rb = torch.from_numpy(b * np.array([w, h, w, h], dtype=np.float32)).to(self.device)
                pooled, probs, _ = self.stages.head(res4, rb)
                self._check_finite(i, pooled, probs)
                fg = probs[:, 1:] if self.layout.background == 0 else probs[:, :-1]
                scores = fg.amax(dim=1) if probs.shape[0] else probs.new_zeros(0)
                out.append(Regions(features=np.ascontiguousarray(pooled.cpu().numpy(), dtype=np.float32),
                                   boxes=b.copy(), scores=scores.cpu().numpy().astype(np.float32),
                                   image_size=(int(im.shape[0]), int(im.shape[1]))))
        return out

    def describe(self) -> dict[str, Any]:
        import detectron2

        d = {
            "config": self.cfg.model_dump(mode="json"),
            "flavour": self.cfg.flavour,
            "layout": self.layout.describe(),
            "options": self.opts,
            "deviations": deviations(self.cfg.flavour, self.cfg.bottom_up),
            "weights_digest": self.weights_digest,
            "random_init": self.random_init,
            "device": str(self.device),
            "batching": self.batching,
            "channels_last": self.channels_last,
            "num_classes": self.num_classes,
            "min_boxes": self.min_boxes,
            "max_boxes": self.max_boxes,
            "feature_dim": self.feature_dim,
            "box_selection": "butd: per-class '+1' NMS on original-pixel proposals, best surviving class score",
            "input_format": self.input_format,
            "detectron2_version": detectron2.__version__,
            "torch_version": torch.__version__,
            "warnings": list(self.warnings),
        }
        return d
