"""ruotianluo's layout (formats ``npy``, ``npz``, ``lmdb``): ``cocobu_att/<id>.npy`` (N x D),
``cocobu_att/<id>.npz`` (key ``feat``) or ``cocobu_att.lmdb`` (keys: image ids; values: the bytes of such a
``.npy``/``.npz`` file, as ``scripts/dump_to_lmdb.py`` writes them), with boxes in ``cocobu_box_relative/<id>.npy``
(relative) or ``cocobu_box/<id>.npy`` (original-image pixels; a folder or an LMDB of the same files).

Nothing is unpickled: files and LMDB values are read with ``allow_pickle=False``, an LMDB value that is not the
bytes of a ``.npy``/``.npz`` is a rejected row, and lmdbdict's own entries (``__...__`` keys, pickles) are never
read."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np

from captioning.data.imports.base import (
    ABSENT,
    BYTES,
    NO_ARRAY,
    NOT_AN_ID,
    FeatureImportError,
    Regions,
    Rejected,
    Scan,
    Source,
    list_names,
    scan_names,
)

RUOTIANLUO_FORMATS = ("npy", "npz", "lmdb")  # the formats of this layout (RuotianluoSource.format)
LMDB_INTERNAL = re.compile(rb"__\w+__")  # lmdbdict's own entries (pickles: never read)


def _npy_bytes(data: bytes, where: str, key: str | None = None) -> np.ndarray:
    """The array in the bytes of a ``.npy`` file, or member ``key`` of a ``.npz`` (never unpickled)."""
    if not data.startswith((b"\x93NUMPY", b"PK\x03\x04")):
        raise Rejected(BYTES, f"{where}: not the bytes of a .npy or .npz file (starts {data[:8]!r}; pickled values "
                              "are never loaded)")
    buf = io.BytesIO(data)
    loaded = np.load(buf, allow_pickle=False)
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            if key is None or key not in loaded.files:
                raise Rejected(NO_ARRAY, f"{where}: no array {key!r} in the .npz (has "
                                         f"{', '.join(loaded.files) or 'none'})")
            return loaded[key]
    return loaded


def is_lmdb(path: Path) -> bool:
    """Whether ``path`` is an LMDB (a ``.lmdb`` file or folder, or a folder holding ``data.mdb``)."""
    return path.suffix == ".lmdb" or (path.is_dir() and (path / "data.mdb").is_file())


def _open_lmdb(path: Path):
    try:
        import lmdb  # only where an LMDB is read
    except ImportError:  # pragma: no cover - a dependency of capflow
        raise FeatureImportError("reading LMDB needs the lmdb package (pip install lmdb)") from None
    try:
        return lmdb.open(str(path), subdir=path.is_dir(), readonly=True, lock=False, readahead=False,
                         max_readers=16)
    except lmdb.Error as e:
        raise FeatureImportError(f"{path}: not a readable LMDB ({type(e).__name__}: {e})") from None


class _Blobs:
    """Per-image arrays: a folder of ``<id>.npy`` / ``<id>.npz`` files or an LMDB of their bytes."""

    def __init__(self, path: Path, ext: str | None = None):
        self.path = path
        self.lmdb = is_lmdb(path)
        self.ext = ext
        self._env = None
        self._names: list[str] = []

    def open(self) -> None:
        if self.lmdb and self._env is None:
            self._env = _open_lmdb(self.path)

    def scan(self) -> Scan:
        """Every record (file or key) with its image id."""
        self.open()
        if self.lmdb:
            import lmdb

            names = []
            try:
                with self._env.begin() as txn:
                    for key in txn.cursor().iternext(keys=True, values=False):
                        if LMDB_INTERNAL.fullmatch(key):
                            continue
                        names.append(key.decode("latin-1"))
            except lmdb.Error as e:  # a damaged page: the keys cannot be listed
                raise FeatureImportError(f"{self.path}: the LMDB is damaged, its keys cannot be listed "
                                         f"({type(e).__name__}: {e})") from None
        else:
            names = list_names(self.path, f".{self.ext}")
        self._names = names
        return scan_names(names, lambda name: _digits(self._stem(name)), lambda name: Rejected(
            NOT_AN_ID, f"{'key' if self.lmdb else 'file name'} {self._stem(name)!r} is not an image id"))

    def _stem(self, name: str) -> str:
        return name if self.lmdb else name[: -len(self.ext) - 1]

    def where_name(self, name: str) -> str:
        return f"{self.path}[{name}]" if self.lmdb else str(self.path / name)

    def name_of(self, record: int) -> str:
        return self._names[record]

    def where_id(self, image_id: int, ext: str | None = None) -> str:
        return self.where_name(str(image_id) if self.lmdb else f"{image_id}.{ext or self.ext}")

    def get(self, name: str, key: str | None = None) -> np.ndarray:
        """The array of record ``name`` (member ``key`` of a ``.npz``); :class:`Rejected` when it is missing."""
        where = self.where_name(name)
        if self.lmdb:
            self.open()
            with self._env.begin() as txn:
                data = txn.get(name.encode("latin-1"))
            if data is None:
                raise Rejected(ABSENT, f"no {where}")
            return _npy_bytes(data, where, key)
        p = self.path / name
        if not p.is_file():
            raise Rejected(ABSENT, f"no {p}")
        if name.endswith(".npz"):
            with np.load(p, allow_pickle=False) as z:
                if key not in z.files:
                    raise Rejected(NO_ARRAY, f"{p}: no array {key!r} (has {', '.join(z.files) or 'none'})")
                return z[key]
        return np.load(p, allow_pickle=False)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def _digits(stem: str) -> int | None:
    """The image id a ruotianluo file name or key is: all decimal digits (at most 18)."""
    return int(stem) if stem.isdigit() and len(stem) <= 18 else None


class RuotianluoSource(Source):
    """``cocobu_att`` (``.npy``, ``.npz`` with ``feat``, or an LMDB of either) + ``cocobu_box*/<id>.npy``."""

    def __init__(self, att: Path, box: Path, *, fmt: str, boxes: str):
        if fmt not in RUOTIANLUO_FORMATS:
            raise FeatureImportError(f"not a ruotianluo format: {fmt}")
        if boxes not in ("relative", "pixels"):
            raise FeatureImportError(f"boxes must be relative or pixels, not {boxes!r}")
        self.format = fmt
        self.att = _Blobs(att, None if fmt == "lmdb" else fmt)
        if fmt == "lmdb" and not self.att.lmdb:
            raise FeatureImportError(f"{att} is not an LMDB (a .lmdb file, or a folder holding data.mdb)")
        if fmt != "lmdb" and self.att.lmdb:
            raise FeatureImportError(f"{att} is an LMDB: use --format lmdb")
        if not self.att.lmdb and not att.is_dir():
            raise FeatureImportError(f"{att} is not a folder")
        self.box = _Blobs(box, "npy")
        if not self.box.lmdb and not box.is_dir():
            raise FeatureImportError(f"{box} is not a folder")
        self.pixels = boxes == "pixels"
        self.extras = ("boxes_px",) if self.pixels else ()

    def scan(self) -> Scan:
        self.box.open()
        return self.att.scan()

    def where(self, record: int) -> str:
        return self.att.where_name(self.att.name_of(record))

    def missing(self, image_id: int) -> Rejected:
        return Rejected(ABSENT, f"no {self.att.where_id(image_id)}")

    def load(self, record: int) -> Regions:
        name = self.att.name_of(record)
        feats = self.att.get(name, "feat")
        stem = name if self.att.lmdb else name.rsplit(".", 1)[0]
        boxes = self.box.get(stem if self.box.lmdb else f"{stem}.npy")
        return Regions(feats, boxes, self.pixels)

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.att.path), "att": str(self.att.path), "box": str(self.box.path),
                "boxes": "pixels" if self.pixels else "relative"}

    def close(self) -> None:
        self.att.close()
        self.box.close()


# ---------------------------------------------------------------------- detection
def box_kind(box: Path, boxes: str) -> str:
    """``boxes`` (``relative`` | ``pixels``), or for ``auto`` what the boxes folder's name says."""
    if boxes != "auto":
        return boxes
    return "pixels" if box.name in ("cocobu_box", "cocobu_box.lmdb") else "relative"


def ruotianluo_root(root: Path) -> tuple[Path, Path] | None:
    """(features, boxes) of a folder holding cocobu_att[.lmdb] and cocobu_box_relative or cocobu_box."""
    att = next((root / n for n in ("cocobu_att", "cocobu_att.lmdb") if (root / n).exists()), None)
    box = next((root / n for n in ("cocobu_box_relative", "cocobu_box_relative.lmdb", "cocobu_box",
                                   "cocobu_box.lmdb") if (root / n).exists()), None)
    return (att, box) if att is not None and box is not None else None


#: the members that make a ``.npz`` file one of ``cocobu_att``'s (format detection)
NPZ_MEMBERS = frozenset({"feat"})


def is_npy_name(name: str) -> bool:
    """Whether a folder entry is a ``.npy`` file (the ``npy`` format's records)."""
    return name.endswith(".npy")


def is_lmdb_name(name: str) -> bool:
    """Whether a folder entry is an LMDB's data file (the folder is an LMDB)."""
    return name == "data.mdb"


def is_lmdb_file(path: Path) -> bool:
    """Whether a source file is an LMDB (by its name)."""
    return path.suffix == ".lmdb"
