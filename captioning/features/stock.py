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

The model is built from its config and checkpoint by :mod:`captioning.features.stock_model` (random weights,
checkpoint formats, what is refused); the settings, weights, loaders and streaming are
:class:`captioning.features.engine.ExtractorEngine`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from captioning.config import ExtractorConfig
from captioning.features.base import ExtractionError, Prepared, Regions, Result, resized_rgb
from captioning.features.engine import ExtractorEngine
from captioning.features.registry import STOCK, flavour, register
from captioning.features.selection import (
    nms_max_conf_batched,
    nms_max_conf_batched_torch,
    overlap_masks,
    select_boxes,
)
from captioning.features.stock_model import build_detector, detectron2_config

BOX_SELECTION = "per-class NMS over proposal boxes; score = best surviving class probability (bottom-up)"
PAD_QUANTUM = 32  # padded batching: the long side of the canvas is a multiple of this


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


@register(STOCK.name)
class RegionExtractor(ExtractorEngine):
    """A detectron2 C4 Faster R-CNN built once; call it on lists of RGB images (``(H, W, 3) uint8``)."""

    def _check_flavour(self, cfg: ExtractorConfig) -> None:
        """The bottom-up flavours are other classes (:func:`captioning.features.extractor.make_extractor`)."""
        if not flavour(cfg.flavour).is_stock:
            raise ValueError(f"features.extractor.flavour is {cfg.flavour!r}: build the extractor with "
                             "make_extractor (RegionExtractor is the stock detectron2 model)")

    # ------------------------------------------------------------------ construction
    def _setup(self, checkpoint: dict[str, Any] | None) -> None:
        """Build the model (and its settings) from the checkpoint, if any."""
        self.detectron2_cfg = detectron2_config(self.cfg, checkpoint, device=self.device,
                                                feature_dim=self.feature_dim, warn=self._warn)
        self.num_classes = int(self.detectron2_cfg.MODEL.ROI_HEADS.NUM_CLASSES)
        self.model = build_detector(self.detectron2_cfg, self.cfg, checkpoint, weights_path=self.weights_path,
                                    channels_last=self.channels_last)
        self.input_format = self.detectron2_cfg.INPUT.FORMAT

    # ------------------------------------------------------------------ preprocessing (CPU, thread-safe)
    def prepare(self, image: np.ndarray, key: Any = None) -> Prepared:
        """Resize (PIL bilinear, as detectron2's ResizeShortestEdge): uint8 RGB (h, w, 3), still on the CPU.

        The device reorders channels, converts to float and normalises (:meth:`_model_input`); bilinear resizing
        treats channels independently, so the numbers equal detectron2's CPU path (flip, resize, float) exactly.
        """
        self._check_images([image])
        h, w = image.shape[:2]
        return self._prepared(key, resized_rgb(image, self.cfg.min_size, self.cfg.max_size), (int(h), int(w)))

    def _to_tensor(self, image: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
        p = self.prepare(image)
        assert p.shape == shape
        return self._model_input(p.tensor)

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

    # ------------------------------------------------------------------ model stages (device)
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

    def _select(self, max_conf: np.ndarray) -> np.ndarray:
        """Indices of the kept boxes, by score descending then index."""
        return select_boxes(max_conf, conf_threshold=self.cfg.conf_threshold, min_boxes=self.min_boxes,
                            max_boxes=self.max_boxes, fixed_boxes=self.cfg.fixed_boxes)

    def _finish(self, det: _Detected) -> list[Result]:
        """Host side of a batch: box selection (all images at once) and the kept regions; runs off the GPU's path."""
        det.wait()
        t0 = time.perf_counter()
        offs = np.concatenate([[0], np.cumsum(det.sizes)]).astype(int)
        pooled, probs, boxes, over = det.pooled_h, det.probs_h, det.boxes_h, det.over_h
        out: list[Result] = []
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

    def _finished(self, d: _Detected | tuple[Any, Exception]) -> list[Result]:
        return self._finish(d) if isinstance(d, _Detected) else [d]

    # ------------------------------------------------------------------ public API
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
