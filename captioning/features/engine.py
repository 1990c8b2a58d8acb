"""The flavour-independent half of a region extractor: settings, weights, loader processes, streaming, batches.

:class:`ExtractorEngine` is what the stock model (:class:`captioning.features.stock.RegionExtractor`) and the
bottom-up ports (:class:`captioning.features.bottom_up_extractor.BottomUpExtractor`) share: the settings resolved
once (:mod:`captioning.features.settings`), the weights file resolved, sha256-checked and read
(:mod:`captioning.features.weights`), the spawned loader processes, :meth:`ExtractorEngine.stream` (through
:class:`captioning.features.stream.ExtractionStream`), a failing batch retried image by image so that one image
cannot sink the others, and the list API. A flavour supplies the model (``_setup``), ``prepare``, the device
stages of a batch (``_detect``), their host side (``_finished``), ``extract_given`` and ``describe``.

Nothing process-wide is set here: the caller chooses ``torch.set_num_threads``.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from captioning.config import ExtractorConfig
from captioning.features.base import ExtractionError, Prepared, Regions, Result, check_images
from captioning.features.settings import device_settings, effective_config
from captioning.features.stream import ExtractionStream
from captioning.features.weights import read_checkpoint, resolve, weights_cache_dir
from captioning.util import resolve_device

log = logging.getLogger("captioning.features.extractor")  # the extractor's logger, whichever flavour logs

RANDOM_WEIGHTS_WARNING = (
    "RANDOM detector weights (features.extractor.weights is unset): region features come from an untrained "
    "Faster R-CNN. Fine for tests and the demo's plumbing, meaningless for real captioning."
)


class ExtractorEngine(ABC):
    """A detector built once (by the flavour's ``_setup``); call it on lists of RGB images (``(H, W, 3) uint8``)."""

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
        self._check_flavour(cfg)
        self.cfg = cfg = effective_config(cfg)  # cfg itself when the caller resolved it already
        self.min_boxes, self.max_boxes, self.feature_dim = min_boxes, max_boxes, feature_dim
        self.device = resolve_device(cfg.device, "extractor device")
        self.batching = cfg.batching
        self.warnings: list[str] = []
        on_device = device_settings(cfg, self.device.type)
        self.decode_threads = on_device.decode_threads
        self.decode_processes = cfg.decode_processes
        if self.decode_processes and multiprocessing.current_process().daemon:
            self._warn("decode_processes: a daemonic process (e.g. a Dask worker with distributed.worker.daemon "
                       "true) cannot start children; decoding on loader threads instead")
            self.decode_processes = 0
        self._pool: ProcessPoolExecutor | None = None
        self.channels_last = on_device.channels_last
        self.select_on_device = on_device.select_on_device
        self.profile: dict[str, float] | None = None  # per-stage seconds, when a benchmark asks for them
        self._last_mark = 0.0
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

    # ------------------------------------------------------------------ what a flavour supplies
    def _check_flavour(self, cfg: ExtractorConfig) -> None:
        """Refuse, before any weights are fetched, a flavour this class does not compute (the stock class refuses
        the bottom-up flavours; the bottom-up class refuses a flavour without a reference when it resolves its
        options)."""
        return None

    @abstractmethod
    def _setup(self, checkpoint: dict[str, Any] | None) -> None:
        """Build the model (and its settings: ``num_classes``, ``input_format``) from the checkpoint, if any."""

    @abstractmethod
    def prepare(self, image: np.ndarray, key: Any = None) -> Prepared:
        """The image resized for the model, still on the CPU (thread-safe)."""

    @abstractmethod
    def _detect(self, batch: list[Prepared]) -> Any:
        """The device stages of one batch."""

    @abstractmethod
    def _finished(self, d: Any) -> list[Result]:
        """The host side of what :meth:`_detect_safe` returned for a batch: ``(key, Regions or exception)``."""

    @abstractmethod
    def extract_given(self, images: list[np.ndarray], boxes: list[np.ndarray]) -> list[Regions]:
        """Features and best class scores of the given boxes ((n, 4) relative x1, y1, x2, y2), in their order."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-able description (for store attributes): settings, weights identity, device, versions."""

    # ------------------------------------------------------------------ construction
    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        log.warning(msg)

    # ------------------------------------------------------------------ preprocessing (CPU, thread-safe)
    def _resized_shape(self, image: np.ndarray) -> tuple[int, int]:
        from detectron2.data.transforms import ResizeShortestEdge

        h, w = image.shape[:2]
        return ResizeShortestEdge.get_output_shape(h, w, self.cfg.min_size, self.cfg.max_size)

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

    _check_images = staticmethod(check_images)

    def _batches(self, images: list[np.ndarray]) -> list[tuple[list[int], tuple[int, int]]]:
        """Indices batched by identical resized shape (no padding), batch_size at most, in first-seen order."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, im in enumerate(images):
            groups.setdefault(self._resized_shape(im), []).append(i)
        bs = self.cfg.batch_size
        return [(idx[s : s + bs], shape) for shape, idx in groups.items() for s in range(0, len(idx), bs)]

    def _group_key(self, p: Prepared) -> tuple[int, int]:
        """Images that may share a batch: the same resized shape."""
        return p.shape

    def _autocast(self):
        dtype = torch.bfloat16 if self.cfg.amp_dtype == "bfloat16" else torch.float16
        on = bool(self.cfg.amp and self.device.type == "cuda")
        return torch.autocast(device_type="cuda", dtype=dtype, enabled=on)

    # ------------------------------------------------------------------ device
    def _mark(self, stage: str) -> None:
        """Per-stage timing for ``capflow bench extract`` (synchronising: only when a profile is being taken)."""
        if self.profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.profile[stage] = self.profile.get(stage, 0.0) + now - self._last_mark
        self._last_mark = now

    def _check_finite(self, index: int, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if not bool(torch.isfinite(t).all()):
                raise ExtractionError(
                    f"image {index}: the detector produced non-finite values (NaN/inf) in its region features "
                    "or class scores; the image cannot be used with these weights", index
                )

    def _detect_safe(self, batch: list[Prepared]) -> list[Any]:
        """One batch, or image by image when the batch fails, so that one image cannot sink the others."""
        with torch.inference_mode(), self._autocast():
            try:
                return [self._detect(batch)]
            except Exception as e:
                if len(batch) == 1:
                    return [(batch[0].key, e)]
                log.warning("a batch of %d images failed (%s); extracting image by image", len(batch), e)
                return [x for p in batch for x in self._detect_safe([p])]

    # ------------------------------------------------------------------ public API
    def stream(self, items: Iterable[tuple[Any, Callable[[], np.ndarray]]], *, threads: int | None = None,
               window: int | None = None) -> Iterator[Result]:
        """Extract a stream of images: ``items`` yields ``(key, load)`` where ``load()`` returns the RGB array or
        raises (e.g. ``ImageRejected``); yields ``(key, Regions)`` or ``(key, exception)`` for every item, in
        completion order (:class:`captioning.features.stream.ExtractionStream`). ``threads`` decode/resize threads
        run ahead of the model (default ``decode_threads``; ``decode_processes`` processes instead for picklable
        ``load`` callables; ``threads=0`` loads inline); batches form among up to ``window`` ready images (default
        4 x batch_size) by :meth:`_group_key`."""
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
