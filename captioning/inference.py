"""Captioning new images with a trained model folder (what ``capflow caption`` runs).

A model folder is what the pipeline registers for every student (:func:`captioning.training.checkpoint.
save_model_dir`): ``model.pt`` (a capflow checkpoint, loaded with ``weights_only=True``), ``vocab.json`` and
``capflow.json`` (``{"student", "preset", "features", "max_words", "beam", "test_metrics"}``, ``features`` being
the config's ``features`` section; real detector weights are in the folder's ``detector/``, named relative to
the folder with their sha256 - weights outside the folder or without a digest are refused, and ``.pkl`` weights
are read without unpickling code, :mod:`captioning.safe_pickle`). :class:`ImageCaptioner` rebuilds from it exactly
what produced the model's training features - the same :class:`~captioning.features.extractor.RegionExtractor`
(detector config, weights, proposals, image sizes, box limits) and the same stored precision (float16 features
are rounded to float16 before the model sees them, as they were in the feature store) - and decodes with the
evaluation's code (:func:`captioning.metrics.evaluation.predict`: beam search, radix digits -> words).

Images go through :func:`~captioning.features.images.load_rgb`; a file that cannot be used (missing,
unreadable, corrupt, too small, too few regions, non-finite features) becomes a rejection record
``{"file", "error"}`` and the other images are still captioned. Only ``features.source: detector`` models can
caption images: a ``synthetic-informative`` model was trained on encoded object attributes, not on pixels.

Determinism: on CPU the extractor's numbers are bit-identical for the same ``torch`` thread count (see
:mod:`captioning.features.extractor`); this module leaves the thread count to the caller.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from captioning.config import FeaturesConfig
from captioning.data.loader import MemoryFeatures
from captioning.data.text import Vocabulary
from captioning.errors import InputError
from captioning.features.extractor import Regions, make_extractor
from captioning.features.images import ImageRejected, load_rgb
from captioning.metrics.evaluation import predict
from captioning.models.encoder_decoder import ArchConfig
from captioning.models.registry import build
from captioning.precision import resolve_precision
from captioning.progress import bar as progress_bar
from captioning.training import checkpoint
from captioning.training.checkpoint import DETECTOR_DIR, META_FILE, MODEL_FILE, VOCAB_FILE
from captioning.training.recipe import codec_for, max_tokens
from captioning.util import resolve_device

log = logging.getLogger(__name__)


class CaptionerError(InputError, ValueError):
    """The model cannot caption images: missing/invalid model files, a non-detector model, a dimension
    mismatch between the extractor and the model. The message says which file or setting and what to do."""


@dataclass
class CaptionResult:
    """Captions of the usable images and rejection records of the others, each in input order."""

    captions: list[dict[str, str]] = field(default_factory=list)  # [{"file", "caption"}]
    rejected: list[dict[str, str]] = field(default_factory=list)  # [{"file", "error"}]
    regions: dict[str, Regions] = field(default_factory=dict)  # file -> the regions its caption saw (when kept)


@dataclass
class ModelFiles:
    folder: Path
    model: Path
    vocab: Path
    meta: Path


def model_files(path: str | Path) -> ModelFiles:
    """The three files of a model folder, given the folder or its ``model.pt`` (with the other two beside it)."""
    p = Path(path).expanduser()
    if p.is_dir():
        folder, model = p, p / MODEL_FILE
    elif p.is_file():
        folder, model = p.parent, p
    else:
        raise CaptionerError(f"model {p} not found: give a model folder ({MODEL_FILE}, {VOCAB_FILE}, {META_FILE}) "
                             f"or the path of its {MODEL_FILE}")
    files = ModelFiles(folder, model, folder / VOCAB_FILE, folder / META_FILE)
    missing = [f.name for f in (files.model, files.vocab, files.meta) if not f.is_file()]
    if missing:
        raise CaptionerError(f"model folder {folder} lacks {', '.join(missing)}: a model folder holds "
                             f"{MODEL_FILE}, {VOCAB_FILE} and {META_FILE} (as the pipeline registers them)")
    return files


def read_meta(path: Path) -> tuple[dict[str, Any], FeaturesConfig]:
    """``capflow.json`` and its features section, validated; a CaptionerError names what is wrong."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaptionerError(f"cannot read {path}: {e}") from None
    if not isinstance(meta, dict):
        raise CaptionerError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    for key in ("features", "max_words"):
        if key not in meta:
            raise CaptionerError(f"{path}: no {key!r} entry (written by an older capflow? re-export the model)")
    try:
        features = FeaturesConfig.model_validate(meta["features"])
    except ValidationError as e:
        raise CaptionerError(f"{path}: invalid 'features' settings: {e}") from None
    if not isinstance(meta["max_words"], int) or meta["max_words"] < 1:
        raise CaptionerError(f"{path}: 'max_words' must be a positive integer, got {meta['max_words']!r}")
    return meta, features


def detector_weights(files: ModelFiles, features: FeaturesConfig) -> str | None:
    """The local path of the model folder's detector weights (None: random-weight detector).

    ``features.extractor.weights`` in ``capflow.json`` must name a file inside the folder (symlinks resolved)
    and ``features.extractor.weights_sha256`` must hold the digest recorded at training time (the file is checked
    against it before it is read). Anything else - an absolute path, a remote URI, ``..``, no digest - is a
    CaptionerError: a model folder from elsewhere must not make capflow read files of its choosing.
    """
    ex = features.extractor
    if ex.weights is None:
        return None
    where = f"{files.meta}: features.extractor.weights {ex.weights!r}"
    fix = (f"a model folder holds its detector weights under {DETECTOR_DIR}/ with their sha256 (as the pipeline "
           "writes it); re-export the model, or copy the weights into the folder and record their sha256")
    root = files.folder.resolve()
    if "://" in ex.weights or Path(ex.weights).is_absolute():
        raise CaptionerError(f"{where} points outside the model folder {files.folder}: {fix}")
    path = (root / ex.weights).resolve()
    if not path.is_relative_to(root):
        raise CaptionerError(f"{where} points outside the model folder {files.folder}: {fix}")
    if not path.is_file():
        raise CaptionerError(f"{where}: no such file in the model folder {files.folder}: {fix}")
    if not (ex.weights_sha256 or "").strip():
        raise CaptionerError(f"{where}: no weights_sha256 recorded at training time, so the weights cannot be "
                             f"verified and are not loaded: {fix}")
    return str(path)


class ImageCaptioner:
    """A model folder ready to caption image files: region extractor + captioning model + vocabulary.

    ``device``: torch device for both the extractor and the model (``auto`` = CUDA when present).
    ``beam``: beam width (default: the pipeline's evaluation beam stored in ``capflow.json``; 1 = greedy).
    ``batch_size``: images loaded, extracted and decoded together. ``cache_dir``: where remote detector weights
    are downloaded (default ``CAPFLOW_WEIGHTS_CACHE`` or ``~/.cache/capflow/weights``). ``precision``: the
    captioning model's precision (:mod:`captioning.precision`: ``auto`` = bf16 on a CUDA device that supports it,
    fp32 on CPUs; the extractor keeps its own ``features.extractor.amp`` setting).
    """

    def __init__(self, path: str | Path, *, device: str = "auto", beam: int | None = None, batch_size: int = 16,
                 progress: bool = True, cache_dir: str | Path | None = None, precision: str = "auto"):
        if batch_size < 1:
            raise CaptionerError(f"batch size must be >= 1, got {batch_size}")
        self.files = model_files(path)
        self.meta, self.features = read_meta(self.files.meta)
        f = self.features
        if f.source != "detector":
            raise CaptionerError(
                f"model {self.files.folder} was trained on features.source={f.source!r}, not on detector region "
                "features: it cannot caption real images. Use a model trained with features.source: detector "
                "(the demo/tiny/coco presets).")
        try:
            self.device = resolve_device(device)
        except (ValueError, RuntimeError) as e:
            raise CaptionerError(f"device {device!r}: {e}") from None
        try:
            self.precision = resolve_precision(precision, self.device)
        except ValueError as e:
            raise CaptionerError(f"precision {precision!r}: {e}") from None
        try:
            self.vocab = Vocabulary.load(self.files.vocab)
        except (ValueError, KeyError, TypeError) as e:
            raise CaptionerError(f"{self.files.vocab}: not a usable capflow vocabulary: {e}") from None
        self.model, self.state = self._load_model()
        self.codec = codec_for(self.model, self.vocab)
        self.max_tokens = max_tokens(self.model, int(self.meta["max_words"]), self.vocab.radix())
        self.beam = int(beam if beam is not None else self.meta.get("beam") or 3)
        if self.beam < 1:
            raise CaptionerError(f"beam must be >= 1, got {self.beam}")
        self.batch_size = batch_size
        self.progress = progress
        self.d_in = int(self.model.cfg.d_in)
        if f.feature_dim != self.d_in:
            raise CaptionerError(
                f"{self.files.meta}: the extractor gives {f.feature_dim}-d region features but the model "
                f"{self.files.model} takes {self.d_in}-d inputs: the model folder's files do not belong together")
        self.feature_dtype = np.float16 if f.dtype == "float16" else np.float32
        ex = f.extractor.model_copy(update={"device": str(self.device),
                                            "weights": detector_weights(self.files, f)})
        try:
            self.extractor = make_extractor(ex, min_boxes=f.min_boxes, max_boxes=f.max_boxes,
                                           feature_dim=f.feature_dim, cache_dir=cache_dir)
        except (OSError, ValueError) as e:
            raise CaptionerError(f"cannot build the region extractor the model was trained with "
                                 f"({self.files.meta} features.extractor): {e}") from None

    # ------------------------------------------------------------------ loading
    def _load_model(self):
        path = self.files.model
        try:
            st = checkpoint.load(path)
        except ValueError as e:
            raise CaptionerError(str(e)) from None
        except Exception as e:  # torch.load on a torn/foreign file raises many kinds
            raise CaptionerError(f"cannot read {path} as a capflow checkpoint: {type(e).__name__}: {e}") from None
        try:
            arch = ArchConfig.from_dict(st["arch"])
            model = build(arch)
            model.load_state_dict(st["state_dict"])
        except Exception as e:
            raise CaptionerError(f"{path}: the stored architecture and weights do not build a model: {e}") from None
        digest = st.get("vocab_digest") or ""
        if digest and digest != self.vocab.digest():
            raise CaptionerError(f"{self.files.vocab} is not the vocabulary {path} was trained with "
                                 f"(digest {self.vocab.digest()[:12]} vs {digest[:12]})")
        want = self.vocab.radix().size if arch.codec == "radix" else len(self.vocab)
        if arch.vocab_size != want:
            raise CaptionerError(f"{path} has {arch.vocab_size} output classes but {self.files.vocab} needs {want}")
        return model.to(self.device).eval(), st

    # ------------------------------------------------------------------ info
    @property
    def warnings(self) -> list[str]:
        return list(self.extractor.warnings)

    def describe(self) -> dict[str, Any]:
        return {"model": str(self.files.folder), "student": self.meta.get("student"),
                "preset": self.meta.get("preset"), "beam": self.beam, "device": str(self.device),
                "precision": self.precision,
                "random_detector": self.extractor.random_init, "warnings": self.warnings}

    # ------------------------------------------------------------------ captioning
    def extract(self, images: list[np.ndarray]) -> list[Regions | str]:
        """Regions per image, or the reason it failed (a failing batch is retried image by image, so one bad
        image cannot take the others with it)."""
        if not images:
            return []
        try:
            return list(self.extractor(images))
        except Exception as e:
            if len(images) == 1:
                return [f"extraction failed: {e}"]
            log.warning("extraction of a batch failed (%s); extracting image by image", e)
        out: list[Regions | str] = []
        for img in images:
            out.extend(self.extract([img]))
        return out

    def _usable(self, r: Regions) -> str | None:
        """None when the regions can be captioned, else the reason (the pipeline's reject rules)."""
        if r.features.ndim != 2 or r.features.shape[1] != self.d_in:
            raise CaptionerError(f"the extractor returned {tuple(r.features.shape)} region features but the model "
                                 f"takes {self.d_in}-d inputs")
        m = len(r)
        if m < self.features.min_boxes:
            return f"only {m} boxes found (< features.min_boxes={self.features.min_boxes})"
        if not (np.all(np.isfinite(r.features)) and np.all(np.isfinite(r.boxes))):
            return "non-finite features"
        if not np.all(np.isfinite(r.features.astype(self.feature_dtype))):
            return "features overflow float16"
        return None

    def caption_regions(self, regions: Sequence[Regions]) -> list[str]:
        """Captions of images given as extracted regions (rounded to the stored precision, then decoded with
        the evaluation's :func:`predict`)."""
        if not regions:
            return []
        n, r = len(regions), max(len(x) for x in regions)
        feats = np.zeros((n, r, self.d_in), dtype=self.feature_dtype)
        boxes = np.zeros((n, r, 4), dtype=np.float32)
        nb = np.zeros(n, dtype=np.int64)
        for i, x in enumerate(regions):
            feats[i, : len(x)] = x.features
            boxes[i, : len(x)] = x.boxes
            nb[i] = len(x)
        rows = np.arange(n)
        caps = predict(self.model, MemoryFeatures(feats, boxes, nb, rows), rows, self.vocab, codec=self.codec,
                       max_tokens=self.max_tokens, beam=self.beam, batch_size=n, device=self.device,
                       precision=self.precision)
        return [caps[i] for i in range(n)]

    def decode(self, path: str | Path) -> np.ndarray:
        """One image file decoded as the detector reads it (RGB uint8), within the model's image limits;
        :class:`ImageRejected` otherwise. The model server decodes before it takes the model."""
        ex = self.features.extractor
        return load_rgb(path, min_side=ex.min_image_side, max_pixels=ex.max_image_pixels)

    def caption(self, files: Iterable[str | Path], progress: bool | None = None,
                decoded: Mapping[int, np.ndarray | str] | None = None, keep_regions: bool = False) -> CaptionResult:
        """Caption image files: ``captions`` = [{"file", "caption"}] for the usable ones, ``rejected`` =
        [{"file", "error"}] for the others (both in input order; ``file`` as given). ``decoded``: images already
        decoded by :meth:`decode` (or the reason they were rejected), by position; ``keep_regions``: the regions
        each caption saw in ``regions`` (``capflow caption --draw``)."""
        paths = [str(p) for p in files]
        decoded = decoded or {}
        done: dict[int, str] = {}
        failed: dict[int, str] = {}
        kept: dict[int, Regions] = {}
        show = self.progress if progress is None else progress
        with progress_bar(total=len(paths), desc="captioning", unit="img", enabled=show) as bar:
            for start in range(0, len(paths), self.batch_size):
                idx = range(start, min(start + self.batch_size, len(paths)))
                good: list[int] = []
                images: list[np.ndarray] = []
                for i in idx:
                    try:
                        got = decoded[i] if i in decoded else self.decode(paths[i])
                        if isinstance(got, str):
                            raise ImageRejected(got)
                        images.append(got)
                        good.append(i)
                    except ImageRejected as e:
                        failed[i] = e.reason
                usable: list[tuple[int, Regions]] = []
                for i, reg in zip(good, self.extract(images), strict=True):
                    reason = reg if isinstance(reg, str) else self._usable(reg)
                    if reason is None:
                        usable.append((i, reg))  # type: ignore[arg-type]
                    else:
                        failed[i] = reason
                del images
                for (i, reg), cap in zip(usable, self.caption_regions([r for _, r in usable]), strict=True):
                    done[i] = cap
                    if keep_regions:
                        kept[i] = reg
                bar.update(len(idx))
        for i, reason in sorted(failed.items()):
            log.info("rejected %s: %s", paths[i], reason)
        return CaptionResult(captions=[{"file": paths[i], "caption": c} for i, c in sorted(done.items())],
                             rejected=[{"file": paths[i], "error": r} for i, r in sorted(failed.items())],
                             regions={paths[i]: r for i, r in kept.items()})


__all__ = ["CaptionResult", "CaptionerError", "ImageCaptioner", "ModelFiles", "detector_weights", "model_files",
           "read_meta"]
