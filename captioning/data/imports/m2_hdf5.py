"""``m2-hdf5``: M2 Transformer / LW-Transformer ``coco_detections.hdf5`` (``<id>_features`` (N, D), ``<id>_boxes``
(N, 4) pixels, optional ``<id>_cls_prob`` (N, 1 + classes), column 0 = background). Entries named otherwise are not
image records: they are counted and logged, never imported."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from captioning.data.imports.base import (
    EXTERNAL,
    MAX_BOXES,
    NO_DATASET,
    OTHER,
    SHAPE,
    FeatureImportError,
    Regions,
    Rejected,
    Scan,
    Source,
)

log = logging.getLogger(__name__)

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


class M2HDF5Source(Source):
    """``coco_detections.hdf5``: datasets ``<id>_features``, ``<id>_boxes`` (pixels), ``<id>_cls_prob``."""

    format = "m2-hdf5"
    KEY = re.compile(r"(\d{1,18})_(features|boxes|cls_prob)")

    def __init__(self, path: Path, max_boxes: int = 100, feature_dim: int = 2048):
        try:
            import h5py  # only where an HDF5 file is read
        except ImportError:  # pragma: no cover - a dependency of capflow
            raise FeatureImportError("reading HDF5 needs the h5py package (pip install h5py)") from None
        if not path.is_file():
            raise FeatureImportError(f"{path} is not a file")
        try:
            self.file = h5py.File(path, "r")
        except (OSError, ValueError) as e:
            raise FeatureImportError(f"{path}: not a readable HDF5 file ({e})") from None
        self.path = path
        self.max_boxes, self.feature_dim = max_boxes, feature_dim
        self.has_cls = False
        self.ignored: list[str] = []
        self._ids: np.ndarray = np.zeros(0, np.int64)
        self.extras = ("boxes_px",)

    def scan(self) -> Scan:
        parts: dict[int, set[str]] = {}
        ignored = 0
        try:
            keys = list(self.file.keys())
        except (OSError, RuntimeError) as e:
            raise FeatureImportError(f"{self.path}: cannot list the HDF5 datasets ({e})") from None
        for key in keys:
            m = self.KEY.fullmatch(key)
            if m is None:
                ignored += 1
                if len(self.ignored) < 10:
                    self.ignored.append(key)
                continue
            parts.setdefault(int(m.group(1)), set()).add(m.group(2))
        if ignored:
            log.warning("%s: %d entries not named <id>_features/_boxes/_cls_prob are not image records (e.g. %s)",
                        self.path, ignored, ", ".join(self.ignored))
        self.ignored_count = ignored
        self.has_cls = any("cls_prob" in p for p in parts.values())
        self.extras = ("object_id", "object_conf", "boxes_px") if self.has_cls else ("boxes_px",)
        self._ids = np.array(sorted(parts), np.int64)
        return Scan(self._ids.copy())

    def where(self, record: int) -> str:
        return f"{self.path}:{self._ids[record]}_features"

    def missing(self, image_id: int) -> Rejected:
        return Rejected(NO_DATASET, f"no dataset {image_id}_features in {self.path}")

    def _read(self, key: str) -> np.ndarray:
        """Dataset ``key``, checked before a byte of it is read: data kept in this file (no external link, external
        storage or virtual dataset, which would read other files of this machine), numeric, and of a declared size
        within the store's limits (features: rows <= max_boxes; any: values <= max_boxes x max(feature_dim, 4096))."""
        import h5py

        link = self.file.get(key, getlink=True)
        if link is None:
            raise Rejected(NO_DATASET, f"no dataset {key!r}")
        if isinstance(link, h5py.ExternalLink):
            raise Rejected(EXTERNAL, f"{key!r} is a link to another file ({link.filename}): not read")
        ds = self.file[key]
        if not hasattr(ds, "shape") or ds.dtype.kind not in "iuf":
            raise Rejected(OTHER, f"{key!r} is not a numeric dataset")
        if ds.external or ds.is_virtual:
            how = "virtual dataset" if ds.is_virtual else "external storage"
            raise Rejected(EXTERNAL, f"{key!r} keeps its data in other files (HDF5 {how}): not read")
        shape = ds.shape
        if key.endswith("_features") and len(shape) >= 1 and shape[0] > self.max_boxes:
            raise Rejected(MAX_BOXES, f"{shape[0]} boxes > max_boxes={self.max_boxes}")
        if ds.size > self.max_boxes * max(self.feature_dim, 4096):
            raise Rejected(SHAPE, f"{key!r} declares shape {shape}: more values than a record of max_boxes="
                                  f"{self.max_boxes} holds")
        return ds[()]

    def load(self, record: int) -> Regions:
        iid = int(self._ids[record])
        feats = self._read(f"{iid}_features")
        boxes = self._read(f"{iid}_boxes")
        extras = {}
        if self.has_cls:
            p = self._read(f"{iid}_cls_prob")
            n = feats.shape[0] if feats.ndim else -1
            if p.ndim != 2 or p.shape[0] != n or p.shape[1] < 2:
                raise Rejected(SHAPE, f"cls_prob has shape {p.shape}, expected ({n}, 1 + classes)")
            obj = np.argmax(p[:, 1:], axis=1)  # column 0 is background (bottom-up's convention)
            extras = {"object_id": obj.astype(np.int64), "object_conf": p[np.arange(n), obj + 1].astype(np.float32)}
        return Regions(feats, boxes, True, extras=extras)

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "cls_prob": self.has_cls, "ignored_entries": getattr(self, "ignored_count", 0)}

    def close(self) -> None:
        self.file.close()


def is_hdf5_name(name: str) -> bool:
    """Whether a file name is an HDF5 file's (``.hdf5``, ``.h5``)."""
    return name.endswith((".hdf5", ".h5"))


def is_hdf5_file(path: Path) -> bool:
    """Whether a source file is an HDF5 file: its first bytes (the HDF5 signature) or its name."""
    with open(path, "rb") as f:
        magic = f.read(8)
    return magic == HDF5_MAGIC or path.suffix in (".hdf5", ".h5")
