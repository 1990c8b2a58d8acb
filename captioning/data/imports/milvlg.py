"""``milvlg-npz``: MILVLG bottom-up-attention.pytorch, one ``.npz`` per image (``x`` (N, D), ``bbox`` (N, 4) pixels,
``num_bbox``, ``image_h``, ``image_w``). Its ``info`` entry is a pickled object array: files are opened with
``allow_pickle=False`` and ``info`` is never read, so its object/attribute ids are not imported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from captioning.data.imports.base import (
    ABSENT,
    NO_ARRAY,
    OTHER,
    SHAPE,
    FeatureImportError,
    Regions,
    Rejected,
    Scan,
    Source,
    check_declared,
    image_id_in,
    list_names,
    npz_member_shape,
    scan_names,
)

#: the members that make a ``.npz`` file MILVLG's (format detection)
MILVLG_MEMBERS = frozenset({"x", "bbox"})


class MilvlgSource(Source):
    """A folder of MILVLG ``.npz`` files (``x``, ``bbox``, ``num_bbox``, ``image_h``, ``image_w``; ``info`` is a
    pickle and is never read)."""

    format = "milvlg-npz"
    extras = ("boxes_px",)

    def __init__(self, folder: Path, max_boxes: int = 100, feature_dim: int = 2048):
        if not folder.is_dir():
            raise FeatureImportError(f"{folder} is not a folder")
        self.folder = folder
        self.max_boxes, self.feature_dim = max_boxes, feature_dim
        self._names: list[str] = []

    def scan(self) -> Scan:
        self._names = list_names(self.folder, ".npz")
        return scan_names(self._names, lambda name: image_id_in(name[:-4]), lambda name: Rejected(
            OTHER, f"file name {name!r} does not end with an image id"))

    def where(self, record: int) -> str:
        return str(self.folder / self._names[record])

    def missing(self, image_id: int) -> Rejected:
        return Rejected(ABSENT, f"no .npz file for image {image_id} in {self.folder}")

    def load(self, record: int) -> Regions:
        where = self.where(record)
        with np.load(self.folder / self._names[record], allow_pickle=False) as z:
            have = set(z.files)
            need = ("x", "bbox", "num_bbox", "image_h", "image_w")
            if lacking := [k for k in need if k not in have]:
                raise Rejected(NO_ARRAY, f"no array {', '.join(map(repr, lacking))} (has "
                                         f"{', '.join(z.files) or 'none'})")
            for key in need:  # what each member declares, before it is decompressed
                check_declared(npz_member_shape(z, key, where), f"{where}[{key}]", max_boxes=self.max_boxes,
                               feature_dim=self.feature_dim, rows_are_boxes=key == "x")
            x, bbox = z["x"], z["bbox"]  # never z["info"]: a pickle
            num, h, w = (_scalar_int(z[k], k) for k in ("num_bbox", "image_h", "image_w"))
        if x.ndim != 2 or x.shape[0] != num:
            raise Rejected(SHAPE, f"x has shape {x.shape}, num_bbox is {num}")
        return Regions(x, bbox, True, size=(h, w))

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.folder), "not_imported": "info (a pickled object array: never unpickled)"}


def _scalar_int(v: np.ndarray, name: str) -> int:
    a = np.asarray(v)
    if a.size != 1 or a.dtype.kind not in "iuf" or not np.isfinite(a).all() or float(a.reshape(-1)[0]) % 1:
        raise Rejected(OTHER, f"{name} is not an integer ({a.dtype} {a.shape})")
    return int(a.reshape(-1)[0])
