"""Region features written by other tools -> a capflow feature store (``capflow import-features``).

Formats (:data:`FORMATS`):

- ``npy`` / ``npz`` / ``lmdb``: ruotianluo's layout: ``cocobu_att/<id>.npy`` (N x D), ``cocobu_att/<id>.npz`` (key
  ``feat``) or ``cocobu_att.lmdb`` (keys: image ids; values: the bytes of such a ``.npy``/``.npz`` file, as
  ``scripts/dump_to_lmdb.py`` writes them), with boxes in ``cocobu_box_relative/<id>.npy`` (relative) or
  ``cocobu_box/<id>.npy`` (original-image pixels; a folder or an LMDB of the same files).
- ``butd-tsv``: the TSV of bottom-up-attention's ``tools/generate_tsv.py`` (``image_id, image_w, image_h,
  num_boxes, boxes, features``; boxes/features base64 float32, boxes in original pixels), or the 10-field variant
  with objects and attributes (LXMERT order: ``img_id, img_h, img_w, objects_id, objects_conf, attrs_id,
  attrs_conf, num_boxes, boxes, features``); the layout follows the field count, a header line or ``tsv_fields``.
- ``m2-hdf5``: M2 Transformer / LW-Transformer ``coco_detections.hdf5`` (``<id>_features`` (N, D),
  ``<id>_boxes`` (N, 4) pixels, optional ``<id>_cls_prob`` (N, 1 + classes), column 0 = background).
- ``milvlg-npz``: MILVLG bottom-up-attention.pytorch, one ``.npz`` per image (``x`` (N, D), ``bbox`` (N, 4) pixels,
  ``num_bbox``, ``image_h``, ``image_w``). Its ``info`` entry is a pickled object array: files are opened with
  ``allow_pickle=False`` and ``info`` is never read, so its object/attribute ids are not imported.

Every record of the source becomes a row of the store or is part of a rejected row, never dropped: a malformed
record (bad base64, wrong length, shape mismatch, NaN/inf, a box outside the image, an image id the dataset does not
have, an id given twice, a truncated record or file) is a row with status ``rejected`` and the reason; a record
whose image id cannot be read is a rejected row whose image id is minus its record number (1-based). A container
that cannot be opened at all is a :class:`FeatureImportError` (one line).

Two passes: the first reads only the image ids (for a TSV: the first field of each line), which fixes the rows, the
duplicates and the unknown ids before anything is written; the second reads one record at a time and writes whole
chunks. Memory stays bounded by one chunk of rows plus one record (a TSV line is read with a length bound), never
by the size of the source. Boxes are stored relative (x1/w, y1/h, x2/w, y2/h in float32) and, where the source
gives pixels, also as ``boxes_px``; object/attribute ids and confidences where the source gives them.
"""

from __future__ import annotations

import array
import base64
import binascii
import csv
import hashlib
import io
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from captioning.data.stores import OK, REJECTED, FeatureStore
from captioning.errors import InputError

log = logging.getLogger(__name__)

FORMATS = ("npy", "npz", "lmdb", "butd-tsv", "m2-hdf5", "milvlg-npz")
REASON = "cannot import features: "
NO_ID = np.iinfo(np.int64).min  # a record whose image id cannot be read

TSV_BUTD = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
TSV_LXMERT = ("image_id", "image_h", "image_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes",
              "boxes", "features")
TSV_ALIASES = {"img_id": "image_id", "img_w": "image_w", "img_h": "image_h"}
TSV_REQUIRED = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
# optional TSV fields -> (store extra, numpy dtype of the base64 bytes)
TSV_OPTIONAL = {"objects_id": ("object_id", "<i8"), "objects_conf": ("object_conf", "<f4"),
                "attrs_id": ("attr_id", "<i8"), "attrs_conf": ("attr_conf", "<f4")}
LMDB_INTERNAL = re.compile(rb"__\w+__")  # lmdbdict's own entries (pickles: never read)


class FeatureImportError(InputError, ValueError):
    """The source cannot be read at all (missing, not the format, unreadable container) or the options do not fit
    it; the message is one line."""


class Rejected(Exception):
    """One record cannot be imported; the message is the reason."""


class _StreamOutOfStep(AssertionError):
    """A streamed source gave another record than the plan expected (a bug: the import stops)."""


@dataclass
class Regions:
    """One image's regions as the source gives them."""

    features: np.ndarray  # (n, D)
    boxes: np.ndarray  # (n, 4) x1, y1, x2, y2
    pixels: bool  # boxes in original-image pixels (else relative to the image size)
    size: tuple[int, int] | None = None  # (height, width) when the source states it
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # object_id, object_conf, attr_id, attr_conf: (n,)


@dataclass
class Scan:
    """The first pass: the image id of every record, in the source's order (:data:`NO_ID` where it cannot be
    read) and the problems found on the way (record -> reason)."""

    ids: np.ndarray
    problems: dict[int, str] = field(default_factory=dict)


def _image_id(text: str) -> int | None:
    """An image id from a file name, key or field: the decimal number it ends with (``391895``,
    ``COCO_val2014_000000391895``)."""
    m = re.search(r"(\d+)$", text.strip())
    if not m or len(m.group(1)) > 18:
        return None
    return int(m.group(1))


# ---------------------------------------------------------------------- sources
class Source:
    """A readable feature source. Keyed sources load any record on demand (:meth:`load`); streaming ones
    (:attr:`keyed` False) give their records in order (:meth:`stream`)."""

    format = ""
    keyed = True
    extras: tuple[str, ...] = ()  # per-region store arrays this source fills

    def scan(self) -> Scan:
        raise NotImplementedError

    def where(self, record: int) -> str:
        raise NotImplementedError

    def missing(self, image_id: int) -> str:
        """The reason for an image that has no record."""
        return f"no record for image {image_id} in {self.describe()['path']}"

    def load(self, record: int) -> Regions:
        raise NotImplementedError

    def stream(self, records: np.ndarray) -> Iterator[tuple[int, Regions | str]]:
        """Records ``records`` (ascending) in order, each as regions or a reject reason."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _npy_bytes(data: bytes, where: str, key: str | None = None) -> np.ndarray:
    """The array in the bytes of a ``.npy`` file, or member ``key`` of a ``.npz`` (never unpickled)."""
    if not data.startswith((b"\x93NUMPY", b"PK\x03\x04")):
        raise Rejected(f"{where}: not the bytes of a .npy or .npz file (starts {data[:8]!r}; pickled values are "
                       "never loaded)")
    buf = io.BytesIO(data)
    loaded = np.load(buf, allow_pickle=False)
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            if key is None or key not in loaded.files:
                raise Rejected(f"{where}: no array {key!r} in the .npz (has {', '.join(loaded.files) or 'none'})")
            return loaded[key]
    return loaded


class _Blobs:
    """Per-image arrays: a folder of ``<id>.npy`` / ``<id>.npz`` files or an LMDB of their bytes."""

    def __init__(self, path: Path, ext: str | None = None):
        self.path = path
        self.lmdb = _is_lmdb(path)
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
            names = []
            with self._env.begin() as txn:
                for key in txn.cursor().iternext(keys=True, values=False):
                    if LMDB_INTERNAL.fullmatch(key):
                        continue
                    names.append(key.decode("latin-1"))
        else:
            try:
                names = sorted(e.name for e in os.scandir(self.path) if e.name.endswith(f".{self.ext}"))
            except OSError as e:
                raise FeatureImportError(f"cannot list {self.path}: {e}") from None
        self._names = names
        ids = np.full(len(names), NO_ID, np.int64)
        problems = {}
        for k, name in enumerate(names):
            stem = name if self.lmdb else name[: -len(self.ext) - 1]
            iid = int(stem) if stem.isdigit() and len(stem) <= 18 else None
            if iid is None:
                problems[k] = f"{'key' if self.lmdb else 'file name'} {stem!r} is not an image id"
            else:
                ids[k] = iid
        return Scan(ids, problems)

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
                raise Rejected(f"no {where}")
            return _npy_bytes(data, where, key)
        p = self.path / name
        if not p.is_file():
            raise Rejected(f"no {p}")
        if name.endswith(".npz"):
            with np.load(p, allow_pickle=False) as z:
                if key not in z.files:
                    raise Rejected(f"{p}: no array {key!r} (has {', '.join(z.files) or 'none'})")
                return z[key]
        return np.load(p, allow_pickle=False)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def _is_lmdb(path: Path) -> bool:
    return path.suffix == ".lmdb" or (path.is_dir() and (path / "data.mdb").is_file())


def _open_lmdb(path: Path):
    try:
        import lmdb
    except ImportError:  # pragma: no cover - a dependency of capflow
        raise FeatureImportError("reading LMDB needs the lmdb package (pip install lmdb)") from None
    try:
        return lmdb.open(str(path), subdir=path.is_dir(), readonly=True, lock=False, readahead=False,
                         max_readers=16)
    except lmdb.Error as e:
        raise FeatureImportError(f"{path}: not a readable LMDB ({type(e).__name__}: {e})") from None


class RuotianluoSource(Source):
    """``cocobu_att`` (``.npy``, ``.npz`` with ``feat``, or an LMDB of either) + ``cocobu_box*/<id>.npy``."""

    def __init__(self, att: Path, box: Path, *, fmt: str, boxes: str):
        if fmt not in ("npy", "npz", "lmdb"):
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

    def missing(self, image_id: int) -> str:
        return f"no {self.att.where_id(image_id)}"

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


class MilvlgSource(Source):
    """A folder of MILVLG ``.npz`` files (``x``, ``bbox``, ``num_bbox``, ``image_h``, ``image_w``; ``info`` is a
    pickle and is never read)."""

    format = "milvlg-npz"
    extras = ("boxes_px",)

    def __init__(self, folder: Path):
        if not folder.is_dir():
            raise FeatureImportError(f"{folder} is not a folder")
        self.folder = folder
        self._names: list[str] = []

    def scan(self) -> Scan:
        try:
            self._names = sorted(e.name for e in os.scandir(self.folder) if e.name.endswith(".npz"))
        except OSError as e:
            raise FeatureImportError(f"cannot list {self.folder}: {e}") from None
        ids = np.full(len(self._names), NO_ID, np.int64)
        problems = {}
        for k, name in enumerate(self._names):
            iid = _image_id(name[:-4])
            if iid is None:
                problems[k] = f"file name {name!r} does not end with an image id"
            else:
                ids[k] = iid
        return Scan(ids, problems)

    def where(self, record: int) -> str:
        return str(self.folder / self._names[record])

    def missing(self, image_id: int) -> str:
        return f"no .npz file for image {image_id} in {self.folder}"

    def load(self, record: int) -> Regions:
        with np.load(self.folder / self._names[record], allow_pickle=False) as z:
            have = set(z.files)
            need = ("x", "bbox", "num_bbox", "image_h", "image_w")
            if lacking := [k for k in need if k not in have]:
                raise Rejected(f"no array {', '.join(map(repr, lacking))} (has {', '.join(z.files) or 'none'})")
            x, bbox = z["x"], z["bbox"]  # never z["info"]: a pickle
            num, h, w = (_scalar_int(z[k], k) for k in ("num_bbox", "image_h", "image_w"))
        if x.ndim != 2 or x.shape[0] != num:
            raise Rejected(f"x has shape {x.shape}, num_bbox is {num}")
        return Regions(x, bbox, True, size=(h, w))

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.folder), "not_imported": "info (a pickled object array: never unpickled)"}


def _scalar_int(v: np.ndarray, name: str) -> int:
    a = np.asarray(v)
    if a.size != 1 or a.dtype.kind not in "iuf" or not np.isfinite(a).all() or float(a.reshape(-1)[0]) % 1:
        raise Rejected(f"{name} is not an integer ({a.dtype} {a.shape})")
    return int(a.reshape(-1)[0])


class M2HDF5Source(Source):
    """``coco_detections.hdf5``: datasets ``<id>_features``, ``<id>_boxes`` (pixels), ``<id>_cls_prob``."""

    format = "m2-hdf5"
    KEY = re.compile(r"(\d{1,18})_(features|boxes|cls_prob)")

    def __init__(self, path: Path):
        try:
            import h5py
        except ImportError:  # pragma: no cover - a dependency of capflow
            raise FeatureImportError("reading HDF5 needs the h5py package (pip install h5py)") from None
        if not path.is_file():
            raise FeatureImportError(f"{path} is not a file")
        try:
            self.file = h5py.File(path, "r")
        except (OSError, ValueError) as e:
            raise FeatureImportError(f"{path}: not a readable HDF5 file ({e})") from None
        self.path = path
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

    def missing(self, image_id: int) -> str:
        return f"no dataset {image_id}_features in {self.path}"

    def _read(self, key: str) -> np.ndarray:
        if key not in self.file:
            raise Rejected(f"no dataset {key!r}")
        ds = self.file[key]
        if not hasattr(ds, "shape") or ds.dtype.kind not in "iuf":
            raise Rejected(f"{key!r} is not a numeric dataset")
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
                raise Rejected(f"cls_prob has shape {p.shape}, expected ({n}, 1 + classes)")
            obj = np.argmax(p[:, 1:], axis=1)  # column 0 is background (bottom-up's convention)
            extras = {"object_id": obj.astype(np.int64), "object_conf": p[np.arange(n), obj + 1].astype(np.float32)}
        return Regions(feats, boxes, True, extras=extras)

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "cls_prob": self.has_cls, "ignored_entries": getattr(self, "ignored_count", 0)}

    def close(self) -> None:
        self.file.close()


class ButdTsvSource(Source):
    """bottom-up-attention TSV files (one or more, read in name order), streamed line by line."""

    format = "butd-tsv"
    keyed = False

    def __init__(self, path: Path, *, fields: Sequence[str] | None = None, max_boxes: int = 100,
                 feature_dim: int = 2048):
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and _is_tsv_name(p.name))
            if not files:
                raise FeatureImportError(f"no .tsv files in {path}")
        elif path.is_file():
            files = [path]
        else:
            raise FeatureImportError(f"{path} does not exist")
        self.path = path
        self.files = files
        # the longest record a layout of max_boxes x feature_dim can have (base64 of every field), with room
        per_box = feature_dim * 4 + 4 * 4 + 2 * 8 + 2 * 4
        self.limit = 2 * (max_boxes * per_box * 4 // 3) + (1 << 16)
        self.given = _tsv_fields(fields) if fields else None
        self.header: tuple[str, ...] | None = None
        self.layout: tuple[str, ...] = self.given or TSV_BUTD
        self._file_of = array.array("i")
        self._line_of = array.array("q")
        self.counts: Counter[int] = Counter()
        self.extras = ("boxes_px",)

    # -------------------------------------------------------------- lines
    def _lines(self) -> Iterator[tuple[int, int, bytes, str]]:
        """(file index, line number, line without its newline, state): state ``ok``, ``truncated`` (the file
        ends inside the line) or ``overlong`` (longer than the bound; only its start is returned). Header lines
        (a first line that names the fields) are not records and are skipped."""
        for fi, p in enumerate(self.files):
            try:
                f = open(p, "rb")  # noqa: SIM115 - closed below; a generator
            except OSError as e:
                raise FeatureImportError(f"cannot read {p}: {e}") from None
            with f:
                line_no = 0
                while True:
                    try:
                        line = f.readline(self.limit)
                    except OSError as e:
                        raise FeatureImportError(f"cannot read {p} after line {line_no}: {e}") from None
                    if not line:
                        break
                    line_no += 1
                    if line.endswith(b"\n"):
                        state, line = "ok", line[:-1].rstrip(b"\r")
                    elif len(line) < self.limit:
                        state = "truncated"
                    else:
                        state = "overlong"
                        while True:
                            more = f.readline(self.limit)
                            if not more or more.endswith(b"\n"):
                                break
                    if line_no == 1 and self._is_header(line, p):
                        continue
                    yield fi, line_no, line, state

    def _is_header(self, line: bytes, p: Path) -> bool:
        first = line.split(b"\t", 1)[0].decode("latin-1").strip()
        if TSV_ALIASES.get(first, first) not in TSV_REQUIRED:
            return False
        header = _tsv_fields(line.decode("latin-1").split("\t"))
        if self.header is not None and header != self.header:
            raise FeatureImportError(f"{p}: header {','.join(header)} differs from the first file's "
                                     f"{','.join(self.header)}")
        self.header = header
        return True

    # -------------------------------------------------------------- passes
    def scan(self) -> Scan:
        ids = array.array("q")
        problems: dict[int, str] = {}
        self._file_of, self._line_of, self.counts = array.array("i"), array.array("q"), Counter()
        for fi, line_no, line, state in self._lines():
            k = len(ids)
            self._file_of.append(fi)
            self._line_of.append(line_no)
            if state == "ok":
                self.counts[line.count(b"\t") + 1] += 1
            pos = (self.given or self.header or TSV_BUTD).index("image_id")
            parts = line.split(b"\t", pos + 1)
            iid = _image_id(parts[pos].decode("latin-1")) if len(parts) > pos and parts[pos].strip() else None
            if iid is None:
                ids.append(NO_ID)
                problems[k] = ("empty line" if not line.strip() else
                               f"image id field {parts[pos][:40].decode('latin-1')!r} is not an image id"
                               if len(parts) > pos else "no image id field")
            else:
                ids.append(iid)
        self.layout = self._choose_layout()
        self.extras = (*(TSV_OPTIONAL[f][0] for f in self.layout if f in TSV_OPTIONAL), "boxes_px")
        return Scan(np.frombuffer(ids, np.int64).copy() if len(ids) else np.zeros(0, np.int64), problems)

    def _choose_layout(self) -> tuple[str, ...]:
        if self.given:
            if self.header and self.header != self.given:
                log.warning("%s: --tsv-fields %s overrides the header %s", self.path, ",".join(self.given),
                            ",".join(self.header))
            return self.given
        if self.header:
            return self.header
        n6, n10 = self.counts.get(len(TSV_BUTD), 0), self.counts.get(len(TSV_LXMERT), 0)
        if n6 == n10 == 0:
            seen = ", ".join(f"{n} fields: {c} lines" for n, c in self.counts.most_common(3)) or "no complete line"
            raise FeatureImportError(f"{self.path}: no record has 6 (bottom-up: {','.join(TSV_BUTD)}) or 10 "
                                     f"(LXMERT-style: {','.join(TSV_LXMERT)}) fields ({seen}): give --tsv-fields")
        return TSV_BUTD if n6 >= n10 else TSV_LXMERT

    def where(self, record: int) -> str:
        return f"{self.files[self._file_of[record]]}:{self._line_of[record]}"

    def stream(self, records: np.ndarray) -> Iterator[tuple[int, Regions | str]]:
        todo = iter(records.tolist())
        nxt = next(todo, None)
        with _csv_field_limit(self.limit):
            for k, (_, _, line, state) in enumerate(self._lines()):
                if nxt is None:
                    return
                if k != nxt:
                    continue
                try:
                    yield k, self._parse(line, state)
                except Rejected as e:
                    yield k, str(e)
                except Exception as e:  # a record the parser did not foresee: its reject, not the import's end
                    yield k, f"{type(e).__name__}: {e}"
                nxt = next(todo, None)

    def _parse(self, line: bytes, state: str) -> Regions:
        if state == "truncated":  # the last line has no newline: complete, or cut where the file ends
            try:
                return self._parse(line, "ok")
            except Rejected as e:
                raise Rejected(f"truncated record: the file ends inside it after {len(line)} bytes ({e})") from None
        if state == "overlong":
            raise Rejected(f"record longer than {self.limit} bytes (the bound for max_boxes x feature_dim)")
        try:
            values = next(csv.reader([line.decode("latin-1")], delimiter="\t", quoting=csv.QUOTE_NONE, strict=True))
        except csv.Error as e:
            raise Rejected(f"not a TSV record ({e})") from None
        if len(values) != len(self.layout):
            raise Rejected(f"{len(values)} fields, expected {len(self.layout)} ({','.join(self.layout)}): "
                           "a truncated or foreign record")
        rec = dict(zip(self.layout, values))
        n = _int_field(rec, "num_boxes")
        w, h = _int_field(rec, "image_w"), _int_field(rec, "image_h")
        if n <= 0:
            raise Rejected(f"num_boxes is {n}")
        if w <= 0 or h <= 0:
            raise Rejected(f"image size {rec['image_w']}x{rec['image_h']} is not positive")
        boxes = _b64_array(rec, "boxes", "<f4", n, 4)
        raw = _b64(rec, "features")
        if len(raw) % (4 * n):
            raise Rejected(f"field 'features' has {len(raw)} bytes: not num_boxes ({n}) x D float32")
        feats = np.frombuffer(raw, "<f4").reshape(n, -1)
        extras = {}
        for name, (extra, dtype) in TSV_OPTIONAL.items():
            if name in rec:
                extras[extra] = _b64_array(rec, name, dtype, n, 1).reshape(n)
        return Regions(feats, boxes, True, size=(h, w), extras=extras)

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "files": [str(p) for p in self.files], "fields": list(self.layout)}


def _is_tsv_name(name: str) -> bool:
    return bool(re.search(r"\.tsv(\.\d+)?$", name))


def _tsv_fields(fields: Sequence[str]) -> tuple[str, ...]:
    names = tuple(TSV_ALIASES.get(f.strip(), f.strip()) for f in fields if f.strip())
    known = set(TSV_REQUIRED) | set(TSV_OPTIONAL)
    unknown = [f for f in names if f not in known]
    if unknown:
        raise FeatureImportError(f"unknown TSV fields {unknown} (known: {', '.join([*TSV_REQUIRED, *TSV_OPTIONAL])}; "
                                 "img_id/img_w/img_h are accepted for image_id/image_w/image_h)")
    if lacking := [f for f in TSV_REQUIRED if f not in names]:
        raise FeatureImportError(f"TSV fields lack {lacking} (given: {','.join(names)})")
    if len(set(names)) != len(names):
        raise FeatureImportError(f"TSV fields named twice: {','.join(names)}")
    return names


@contextmanager
def _csv_field_limit(limit: int):
    """The csv module's field-size limit raised to the record bound (its default, 128 KiB, is smaller than a
    features field) for the import, and restored after."""
    old = csv.field_size_limit()
    csv.field_size_limit(max(old, limit))
    try:
        yield
    finally:
        csv.field_size_limit(old)


def _int_field(rec: Mapping[str, str], name: str) -> int:
    try:
        return int(rec[name])
    except ValueError:
        raise Rejected(f"field {name!r} is {rec[name][:40]!r}, not an integer") from None


def _b64(rec: Mapping[str, str], name: str) -> bytes:
    try:
        return base64.b64decode(rec[name], validate=True)
    except (binascii.Error, ValueError) as e:
        raise Rejected(f"bad base64 in field {name!r} ({e})") from None


def _b64_array(rec: Mapping[str, str], name: str, dtype: str, n: int, width: int) -> np.ndarray:
    raw = _b64(rec, name)
    item = np.dtype(dtype).itemsize
    if len(raw) != n * width * item:
        raise Rejected(f"field {name!r} has {len(raw)} bytes, expected num_boxes x {width} x {item} = "
                       f"{n * width * item}")
    return np.frombuffer(raw, dtype).reshape(n, width)


# ---------------------------------------------------------------------- format detection
def _npz_members(p: Path) -> set[str]:
    import zipfile

    try:
        with zipfile.ZipFile(p) as z:
            return {n[:-4] if n.endswith(".npy") else n for n in z.namelist()}
    except (OSError, zipfile.BadZipFile):
        return set()


def _folder_kinds(folder: Path) -> set[str]:
    """The formats the files of ``folder`` could be (a few .npz files are peeked at: member names only)."""
    kinds: set[str] = set()
    npz: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError as e:
        raise FeatureImportError(f"cannot list {folder}: {e}") from None
    for e in entries:
        if e.name == "data.mdb":
            kinds.add("lmdb")
        elif _is_tsv_name(e.name):
            kinds.add("butd-tsv")
        elif e.name.endswith((".hdf5", ".h5")):
            kinds.add("m2-hdf5")
        elif e.name.endswith(".npy"):
            kinds.add("npy")
        elif e.name.endswith(".npz") and len(npz) < 3:
            npz.append(Path(e.path))
    for p in npz:
        members = _npz_members(p)
        if {"x", "bbox"} <= members:
            kinds.add("milvlg-npz")
        elif "feat" in members:
            kinds.add("npz")
    return kinds


@dataclass
class ImportSpec:
    """What to import: the format and its paths (resolved from a source path or the ruotianluo folders)."""

    format: str
    path: Path | None = None  # TSV file/folder, HDF5 file, MILVLG folder
    att: Path | None = None  # ruotianluo: features (folder or LMDB)
    box: Path | None = None  # ruotianluo: boxes (folder or LMDB)
    boxes: str = "relative"  # ruotianluo boxes: relative | pixels
    tsv_fields: tuple[str, ...] | None = None

    def ident(self) -> dict[str, Any]:
        """What names the imported store (paths resolved)."""
        paths = {k: str(Path(v).resolve()) for k, v in (("path", self.path), ("att", self.att), ("box", self.box))
                 if v is not None}
        return {"format": self.format, **paths, "boxes": self.boxes,
                "tsv_fields": list(self.tsv_fields) if self.tsv_fields else None}

    def open(self, *, max_boxes: int, feature_dim: int) -> Source:
        if self.format in ("npy", "npz", "lmdb"):
            assert self.att is not None and self.box is not None
            return RuotianluoSource(self.att, self.box, fmt=self.format, boxes=self.boxes)
        assert self.path is not None
        if self.format == "butd-tsv":
            return ButdTsvSource(self.path, fields=self.tsv_fields, max_boxes=max_boxes, feature_dim=feature_dim)
        if self.format == "m2-hdf5":
            return M2HDF5Source(self.path)
        if self.format == "milvlg-npz":
            return MilvlgSource(self.path)
        raise FeatureImportError(f"unknown format {self.format!r} (one of {', '.join(FORMATS)})")


def _box_kind(box: Path, boxes: str) -> str:
    if boxes != "auto":
        return boxes
    return "pixels" if box.name in ("cocobu_box", "cocobu_box.lmdb") else "relative"


def _ruotianluo_root(root: Path) -> tuple[Path, Path] | None:
    """(features, boxes) of a folder holding cocobu_att[.lmdb] and cocobu_box_relative or cocobu_box."""
    att = next((root / n for n in ("cocobu_att", "cocobu_att.lmdb") if (root / n).exists()), None)
    box = next((root / n for n in ("cocobu_box_relative", "cocobu_box_relative.lmdb", "cocobu_box",
                                   "cocobu_box.lmdb") if (root / n).exists()), None)
    return (att, box) if att is not None and box is not None else None


def _att_format(att: Path) -> str:
    if _is_lmdb(att):
        return "lmdb"
    if not att.is_dir():
        raise FeatureImportError(f"{att} is not a folder")
    kinds = _folder_kinds(att) & {"npy", "npz"}
    if len(kinds) == 1:
        return kinds.pop()
    if not kinds:
        raise FeatureImportError(f"no <image_id>.npy or .npz (key feat) files in {att}")
    raise FeatureImportError(f"{att} holds both .npy and .npz files: give --format npy or --format npz")


def resolve(fmt: str = "auto", source: Path | None = None, *, att: Path | None = None, box: Path | None = None,
            boxes: str = "auto", tsv_fields: Sequence[str] | None = None) -> ImportSpec:
    """The import of ``source`` (a file or folder) or of the ruotianluo folders ``att`` + ``box``; ``fmt`` ``auto``
    detects the format from the path (a few .npz files' member names at most), and is an error listing the
    candidates where the path fits more than one."""
    if fmt != "auto" and fmt not in FORMATS:
        raise FeatureImportError(f"unknown format {fmt!r} (one of auto, {', '.join(FORMATS)})")
    fields = _tsv_fields(tsv_fields) if tsv_fields else None
    if boxes not in ("auto", "relative", "pixels"):
        raise FeatureImportError(f"--boxes must be auto, relative or pixels, not {boxes!r}")
    if source is not None and (att is not None or box is not None):
        raise FeatureImportError("give a source path or --att-dir/--box-dir, not both")
    if source is None:
        if att is None or box is None:
            raise FeatureImportError("give a source file or folder, or --att-dir with --box-dir")
        got = _att_format(att) if fmt == "auto" else fmt
        if got not in ("npy", "npz", "lmdb"):
            raise FeatureImportError(f"--att-dir/--box-dir are ruotianluo's layout (npy, npz, lmdb), not {got}")
        return ImportSpec(got, att=att, box=box, boxes=_box_kind(box, boxes))
    if not source.exists():
        raise FeatureImportError(f"{source} does not exist")
    pair = _ruotianluo_root(source) if source.is_dir() else None
    if fmt in ("npy", "npz", "lmdb") or (fmt == "auto" and pair):
        if pair is None:
            raise FeatureImportError(f"{source} holds no cocobu_att/ (or cocobu_att.lmdb) with cocobu_box_relative/ "
                                     "or cocobu_box/: give --att-dir and --box-dir")
        a, b = pair
        got = _att_format(a) if fmt == "auto" else fmt
        return ImportSpec(got, att=a, box=b, boxes=_box_kind(b, boxes))
    if fmt != "auto":
        return ImportSpec(fmt, path=source, tsv_fields=fields)
    if source.is_file():
        if _is_tsv_name(source.name):
            return ImportSpec("butd-tsv", path=source, tsv_fields=fields)
        with open(source, "rb") as f:
            magic = f.read(8)
        if magic == b"\x89HDF\r\n\x1a\n" or source.suffix in (".hdf5", ".h5"):
            return ImportSpec("m2-hdf5", path=source)
        if source.suffix == ".lmdb":
            raise FeatureImportError(f"{source} is an LMDB of features: give it as --att-dir with --box-dir")
        raise FeatureImportError(f"cannot tell the format of {source} (candidates: butd-tsv, m2-hdf5): give --format")
    kinds = _folder_kinds(source)
    if kinds == {"butd-tsv"}:
        return ImportSpec("butd-tsv", path=source, tsv_fields=fields)
    if kinds == {"milvlg-npz"}:
        return ImportSpec("milvlg-npz", path=source)
    if kinds & {"npy", "npz", "lmdb"} and not kinds - {"npy", "npz", "lmdb"}:
        raise FeatureImportError(f"{source} looks like a ruotianluo features folder ({', '.join(sorted(kinds))}): "
                                 "give it as --att-dir with --box-dir (the boxes folder)")
    if not kinds:
        raise FeatureImportError(f"no feature files in {source} (looked for .tsv, .hdf5/.h5, .npz, .npy, data.mdb, "
                                 "cocobu_att/)")
    raise FeatureImportError(f"{source} could be more than one format (candidates: {', '.join(sorted(kinds))}): "
                             "give --format")


# ---------------------------------------------------------------------- image sizes
def read_image_sizes(path: Path) -> dict[int, tuple[int, int]]:
    """(height, width) per image id from a COCO-format JSON (``images``: ``id``, ``width``, ``height``; e.g.
    ``captions_train2014.json``)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise FeatureImportError(f"cannot read image sizes from {path}: {e}") from None
    images = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(images, list):
        raise FeatureImportError(f"{path}: no 'images' list (a COCO-format JSON with id, width, height per image)")
    out: dict[int, tuple[int, int]] = {}
    for k, im in enumerate(images):
        try:
            out[int(im["id"])] = (int(im["height"]), int(im["width"]))
        except (KeyError, TypeError, ValueError):
            raise FeatureImportError(f"{path}: images[{k}] lacks an integer id, width or height") from None
    return out


# ---------------------------------------------------------------------- the import
LOAD, DUPLICATE, UNKNOWN, MISSING, PROBLEM = range(5)


@dataclass
class _Plan:
    """The store's rows: image id, what to do (code), and the record each row reads (-1: none)."""

    ids: np.ndarray
    code: np.ndarray
    record: np.ndarray
    duplicates: dict[int, list[int]]


def _plan(source: Source, scan: Scan, wanted: Sequence[int] | None) -> _Plan:
    """The rows, from the first pass's ids (numpy throughout: a few bytes per record, no per-record objects)."""
    ids = scan.ids
    valid = ids != NO_ID
    rec_valid = np.flatnonzero(valid)
    vals, first, counts = np.unique(ids[valid], return_index=True, return_counts=True)
    first_rec = rec_valid[first]
    dup_vals = vals[counts > 1]
    duplicates: dict[int, list[int]] = {}
    if len(dup_vals):
        order = np.argsort(ids[valid], kind="stable")
        sorted_ids = ids[valid][order]
        lo = np.searchsorted(sorted_ids, dup_vals, side="left")
        hi = np.searchsorted(sorted_ids, dup_vals, side="right")
        for v, a, b in zip(dup_vals.tolist(), lo.tolist(), hi.tolist()):
            duplicates[v] = rec_valid[order[a:b]].tolist()
    wanted_arr = None if wanted is None else np.asarray(wanted, np.int64).reshape(-1)
    if wanted_arr is not None and len(np.unique(wanted_arr)) != len(wanted_arr):
        raise FeatureImportError("the dataset's image ids are not unique")
    invalid = np.flatnonzero(~valid)
    placeholder = -(invalid + 1)  # minus the record number (1-based)
    if source.keyed:
        if wanted_arr is not None:
            pos = np.minimum(np.searchsorted(vals, wanted_arr), max(len(vals) - 1, 0))
            present = (vals[pos] == wanted_arr) if len(vals) else np.zeros(len(wanted_arr), bool)
            rec_wanted = np.where(present, first_rec[pos] if len(vals) else -1, -1)
            other = ~np.isin(vals, wanted_arr)
            row_ids = np.concatenate([wanted_arr, vals[other], placeholder])
            record = np.concatenate([rec_wanted, first_rec[other], invalid])
        else:
            row_ids = np.concatenate([vals, placeholder])
            record = np.concatenate([first_rec, invalid])
    else:
        keep = np.zeros(len(ids), bool)
        keep[first_rec] = True
        keep[invalid] = True
        record = np.flatnonzero(keep)
        row_ids = np.where(ids[record] == NO_ID, -(record + 1), ids[record])
        if wanted_arr is not None:
            missing = wanted_arr[~np.isin(wanted_arr, vals)]
            row_ids = np.concatenate([row_ids, missing])
            record = np.concatenate([record, np.full(len(missing), -1, np.int64)])
    row_ids, record = row_ids.astype(np.int64), record.astype(np.int64)
    code = np.full(len(row_ids), LOAD, np.int8)
    has = record >= 0
    problem = np.zeros(len(row_ids), bool)
    problem[has] = ids[record[has]] == NO_ID
    dup = has & ~problem & np.isin(row_ids, dup_vals)
    code[dup] = DUPLICATE
    if wanted_arr is not None:
        code[has & ~problem & ~dup & ~np.isin(row_ids, wanted_arr)] = UNKNOWN
    code[problem] = PROBLEM
    code[~has] = MISSING
    return _Plan(row_ids, code, record, duplicates)


def _check(reg: Regions, known: tuple[int, int] | None, *, max_boxes: int, feature_dim: int,
           dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, int] | None,
                                     dict[str, np.ndarray]]:
    """Validate one image's regions: (features in the store's dtype, relative boxes, pixel boxes or None, size
    (h, w) or None, extras), or :class:`Rejected` with the reason."""
    f = np.asarray(reg.features)
    if f.ndim != 2 or f.shape[1] != feature_dim:
        raise Rejected(f"features have shape {f.shape}, expected (N, {feature_dim})")
    if f.dtype.kind != "f":
        raise Rejected(f"features have dtype {f.dtype}, expected floats")
    n = f.shape[0]
    if n == 0:
        raise Rejected("no regions")
    if n > max_boxes:
        raise Rejected(f"{n} boxes > max_boxes={max_boxes}")
    b = np.asarray(reg.boxes)
    if b.shape != (n, 4):
        raise Rejected(f"boxes have shape {b.shape}, expected ({n}, 4)")
    if b.dtype.kind not in "fiu":
        raise Rejected(f"boxes have dtype {b.dtype}, expected numbers")
    for name, v in reg.extras.items():
        if v.shape != (n,):
            raise Rejected(f"{name} has shape {v.shape}, expected ({n},)")
    if not np.isfinite(f).all():
        raise Rejected("non-finite values (NaN/inf) in features")
    if not np.isfinite(b).all():
        raise Rejected("non-finite values (NaN/inf) in boxes")
    for name, v in reg.extras.items():
        if v.dtype.kind == "f" and not np.isfinite(v).all():
            raise Rejected(f"non-finite values (NaN/inf) in {name}")
        if name.endswith("_id") and (v.dtype.kind not in "iu" or (v.size and (v.min() < 0 or v.max() > 2**31 - 1))):
            raise Rejected(f"{name} holds values outside 0..2^31-1")
    size = reg.size
    if size is not None and known is not None and tuple(size) != tuple(known):
        raise Rejected(f"image size {size[1]}x{size[0]} (w x h) in the source differs from the image file's "
                       f"{known[1]}x{known[0]}")
    size = size if size is not None else known
    box = b.astype(np.float32, copy=False)
    x1, y1, x2, y2 = box.T
    if reg.pixels:
        if size is None:
            raise Rejected("image size unknown: pixel boxes cannot be made relative (give dataset.images, or "
                           "--image-sizes with a COCO annotation file)")
        h, w = size
        if h <= 0 or w <= 0:
            raise Rejected(f"image size {w}x{h} is not positive")
        bad = (x1 < 0) | (y1 < 0) | (x2 > w) | (y2 > h) | (x1 > x2) | (y1 > y2)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise Rejected(f"box {k} ({', '.join(f'{v:g}' for v in box[k].tolist())}) is outside the {w}x{h} image "
                           f"({int(bad.sum())} such boxes)")
        px = box
        rel = px / np.array([w, h, w, h], np.float32)
    else:
        bad = (box < 0).any(1) | (box > 1).any(1) | (x1 > x2) | (y1 > y2)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise Rejected(f"box {k} ({', '.join(f'{v:g}' for v in box[k].tolist())}) is outside the image: relative "
                           "boxes lie in [0, 1] with x1 <= x2, y1 <= y2 (pixel boxes? --boxes pixels)")
        px, rel = None, box
    out = f.astype(dtype, copy=False)
    if dtype != f.dtype and not np.isfinite(out).all():
        raise Rejected(f"features overflow {dtype} (import with features.dtype=float32)")
    return out, rel, px, size, dict(reg.extras)


@dataclass
class ImportResult:
    store: FeatureStore
    records: int
    ok: int
    rejected: int
    reasons: dict[str, int]  # reject counts by kind


def _reason_kind(reason: str) -> str:
    text = reason[len(REASON):] if reason.startswith(REASON) else reason
    for key in ("duplicate image id", "not in the dataset", "bad base64", "truncated", "longer than", "non-finite",
                "outside", "fields, expected", "bytes", "shape", "image size", "num_boxes is", "no regions",
                "max_boxes", "is not an image id", "no record", "no array", "no dataset", "no "):
        if key in text:
            return key
    return "other"


def import_source(source: Source, uri: str, *, image_ids: Sequence[int] | None = None,
                  sizes: Mapping[int, tuple[int, int]] | None = None, max_boxes: int = 100, feature_dim: int = 2048,
                  chunk_rows: int = 8, dtype: str = "float16", compressor: str = "lz4", overwrite: bool = False,
                  progress: bool = False, attrs: Mapping[str, Any] | None = None) -> ImportResult:
    """Import ``source`` into a new feature store at ``uri``. ``image_ids``: the dataset's images (then every one
    is a row, records of other images are rejected rows; without it the source's records are the rows); ``sizes``:
    (height, width) of images whose files are known, for pixel boxes without a size in the source and to check the
    size a source states. Rows of a keyed source come in the dataset's order (else by image id), a streamed
    source's in its own order; the images without a record come last."""
    sizes = sizes or {}
    stream = None
    try:
        scan = source.scan()
        if not len(scan.ids) and image_ids is None:
            raise FeatureImportError(f"no feature records in {source.describe()['path']}")
        plan = _plan(source, scan, image_ids)
        info = {"format": source.format, **source.describe(), "records": len(scan.ids)}
        store = FeatureStore.create(
            uri, plan.ids, max_boxes=max_boxes, feature_dim=feature_dim, chunk_rows=chunk_rows, dtype=dtype,
            compressor=compressor, overwrite=overwrite, extras=source.extras,
            attrs={"source": f"import-{source.format}", "import": info, **(dict(attrs) if attrs else {})})
        if not source.keyed:
            stream = source.stream(np.sort(plan.record[plan.code == LOAD]))
        want_dtype = np.dtype(dtype)
        reasons: Counter[str] = Counter()
        ok = 0
        # several whole chunks per write (fewer, larger Zarr writes), within ~16 MiB of row buffers
        row_bytes = max_boxes * (feature_dim * want_dtype.itemsize + 16 + 16 * len(source.extras))
        per_write = chunk_rows * max(1, min(64, (16 << 20) // max(1, chunk_rows * row_bytes)))
        bar = tqdm(total=store.num_rows, desc="importing", disable=not progress, unit="image")
        for start in range(0, store.num_rows, per_write):
            stop = min(start + per_write, store.num_rows)
            bar.update(stop - start)
            m = stop - start
            feats = np.zeros((m, max_boxes, feature_dim), want_dtype)
            boxes = np.zeros((m, max_boxes, 4), np.float32)
            nb = np.zeros(m, np.int16)
            size = np.full((m, 2), -1, np.int32)
            status = np.full(m, OK, np.int8)
            why = [""] * m
            extras = {e: np.full((m, max_boxes, 4) if e == "boxes_px" else (m, max_boxes),
                                 -1 if e.endswith("_id") else 0, np.int32 if e.endswith("_id") else np.float32)
                      for e in source.extras}
            for k in range(m):
                row = start + k
                iid, code, rec = int(plan.ids[row]), int(plan.code[row]), int(plan.record[row])
                known = sizes.get(iid)
                try:
                    if code == DUPLICATE:
                        where = ", ".join(source.where(r) for r in plan.duplicates[iid][:5])
                        more = len(plan.duplicates[iid]) - 5
                        raise Rejected(f"duplicate image id {iid} ({len(plan.duplicates[iid])} records: {where}"
                                       + (f", and {more} more" if more > 0 else "") + ")")
                    if code == UNKNOWN:
                        raise Rejected(f"{source.where(rec)}: image id {iid} is not in the dataset")
                    if code == MISSING:
                        raise Rejected(source.missing(iid))
                    if code == PROBLEM:
                        raise Rejected(f"{source.where(rec)}: {scan.problems.get(rec, 'no image id')}")
                    if stream is not None:
                        got, regions = next(stream, (None, None))
                        if got != rec:  # a bug, not a record's fault
                            raise _StreamOutOfStep(f"the stream of {source.format} records gave record {got}, "
                                                   f"expected {rec}")
                        if isinstance(regions, str):
                            raise Rejected(regions)
                    else:
                        regions = source.load(rec)
                    f, rel, px, hw, ex = _check(regions, known, max_boxes=max_boxes, feature_dim=feature_dim,
                                                dtype=want_dtype)
                except (FeatureImportError, _StreamOutOfStep):
                    raise
                except Exception as e:
                    text = str(e) if isinstance(e, Rejected) else f"{type(e).__name__}: {e}"
                    if code == LOAD and not text.startswith(source.where(rec)):
                        text = f"{source.where(rec)}: {text}"
                    status[k], why[k] = REJECTED, REASON + text
                    reasons[_reason_kind(why[k])] += 1
                    if sum(reasons.values()) <= 20:
                        log.warning("image %s: %s", iid, why[k])
                    continue
                n = f.shape[0]
                feats[k, :n], boxes[k, :n], nb[k] = f, rel, n
                if hw is not None:
                    size[k] = hw
                if px is not None and "boxes_px" in extras:
                    extras["boxes_px"][k, :n] = px
                for name, v in ex.items():
                    if name in extras:
                        extras[name][k, :n] = v
                ok += 1
            store.write_rows(start, features=feats, boxes=boxes, num_boxes=nb, image_size=size, status=status,
                             reject_reason=why, extras=extras)
        bar.close()
        rejected = store.num_rows - ok
        store.group.attrs["import"] = {**info, "ok": ok, "rejected": rejected, "reject_kinds": dict(reasons)}
        if rejected > 20:
            log.warning("%d rows rejected in all (%s); the list: FeatureStore.rejects() / capflow import-features "
                        "--json", rejected, ", ".join(f"{k}: {v}" for k, v in reasons.most_common()))
        return ImportResult(store, len(scan.ids), ok, rejected, dict(reasons))
    finally:
        if stream is not None:
            stream.close()
        source.close()


def imported_uri(feature_store_uri: str, spec: ImportSpec, image_ids: Sequence[int] | None,
                 settings: Mapping[str, Any]) -> str:
    """Where ``capflow import-features`` puts a store imported from ``spec`` (non-npy formats; the npy layout keeps
    :func:`captioning.features.parallel.imported_store_uri`): named by the source, the dataset's image ids and
    the layout settings."""
    ident = json.dumps({**spec.ident(), "ids": list(map(int, image_ids)) if image_ids is not None else None,
                        **dict(settings)}, sort_keys=True)
    return f"{feature_store_uri.rstrip('/')}/imported-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.zarr"
