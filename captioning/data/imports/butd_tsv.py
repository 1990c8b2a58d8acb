"""``butd-tsv``: the TSV of bottom-up-attention's ``tools/generate_tsv.py`` (``image_id, image_w, image_h,
num_boxes, boxes, features``; boxes/features base64 float32, boxes in original pixels), or the 10-field variant with
objects and attributes (LXMERT order: ``img_id, img_h, img_w, objects_id, objects_conf, attrs_id, attrs_conf,
num_boxes, boxes, features``); the layout follows the field count, a header line or ``tsv_fields``.

A streamed source: the first pass reads only the first field of each line, the second parses one record at a time.
A line is read with a length bound (the longest record max_boxes x feature_dim can have), so memory stays bounded
by one record whatever the file holds."""

from __future__ import annotations

import array
import base64
import binascii
import csv
import logging
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from captioning.data.imports.base import (
    ABSENT,
    BAD_BASE64,
    BYTES,
    IMAGE_SIZE,
    NO_ID,
    NOT_AN_ID,
    NUM_BOXES,
    OTHER,
    TOO_LONG,
    TRUNCATED,
    FeatureImportError,
    Regions,
    Rejected,
    Scan,
    Source,
    image_id_in,
)

log = logging.getLogger(__name__)

TSV_BUTD = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
TSV_LXMERT = ("image_id", "image_h", "image_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes",
              "boxes", "features")
TSV_ALIASES = {"img_id": "image_id", "img_w": "image_w", "img_h": "image_h"}
TSV_REQUIRED = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
# optional TSV fields -> (store extra, numpy dtype of the base64 bytes)
TSV_OPTIONAL = {"objects_id": ("object_id", "<i8"), "objects_conf": ("object_conf", "<f4"),
                "attrs_id": ("attr_id", "<i8"), "attrs_conf": ("attr_conf", "<f4")}


class ButdTsvSource(Source):
    """bottom-up-attention TSV files (one or more, read in name order), streamed line by line."""

    format = "butd-tsv"
    keyed = False

    def __init__(self, path: Path, *, fields: Sequence[str] | None = None, max_boxes: int = 100,
                 feature_dim: int = 2048):
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and is_tsv_name(p.name))
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
        self.given = tsv_fields(fields) if fields else None
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
        header = tsv_fields(line.decode("latin-1").split("\t"))
        if self.header is not None and header != self.header:
            raise FeatureImportError(f"{p}: header {','.join(header)} differs from the first file's "
                                     f"{','.join(self.header)}")
        self.header = header
        return True

    # -------------------------------------------------------------- passes
    def scan(self) -> Scan:
        ids = array.array("q")
        problems: dict[int, Rejected] = {}
        self._file_of, self._line_of, self.counts = array.array("i"), array.array("q"), Counter()
        for fi, line_no, line, state in self._lines():
            k = len(ids)
            self._file_of.append(fi)
            self._line_of.append(line_no)
            if state == "ok":
                self.counts[line.count(b"\t") + 1] += 1
            pos = (self.given or self.header or TSV_BUTD).index("image_id")
            parts = line.split(b"\t", pos + 1)
            iid = image_id_in(parts[pos].decode("latin-1")) if len(parts) > pos and parts[pos].strip() else None
            if iid is None:
                ids.append(NO_ID)
                problems[k] = (Rejected(OTHER, "empty line") if not line.strip() else
                               Rejected(NOT_AN_ID, f"image id field {parts[pos][:40].decode('latin-1')!r} is not an "
                                                   "image id")
                               if len(parts) > pos else Rejected(ABSENT, "no image id field"))
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

    def stream(self, records: np.ndarray) -> Iterator[tuple[int, Regions | Rejected]]:
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
                    yield k, e
                except Exception as e:  # a record the parser did not foresee: its reject, not the import's end
                    yield k, Rejected(OTHER, f"{type(e).__name__}: {e}")
                nxt = next(todo, None)

    def _parse(self, line: bytes, state: str) -> Regions:
        if state == "truncated":  # the last line has no newline: complete, or cut where the file ends
            try:
                return self._parse(line, "ok")
            except Rejected as e:
                # counted as truncated, but a cut inside a base64 field as bad base64 (as reports always have)
                raise Rejected(BAD_BASE64 if e.kind == BAD_BASE64 else TRUNCATED,
                               f"truncated record: the file ends inside it after {len(line)} bytes ({e})") from None
        if state == "overlong":
            raise Rejected(TOO_LONG, f"record longer than {self.limit} bytes (the bound for max_boxes x feature_dim)")
        try:
            values = next(csv.reader([line.decode("latin-1")], delimiter="\t", quoting=csv.QUOTE_NONE, strict=True))
        except csv.Error as e:
            raise Rejected(OTHER, f"not a TSV record ({e})") from None
        if len(values) != len(self.layout):
            raise Rejected(TRUNCATED, f"{len(values)} fields, expected {len(self.layout)} ({','.join(self.layout)}): "
                                      "a truncated or foreign record")
        rec = dict(zip(self.layout, values))
        n = _int_field(rec, "num_boxes")
        w, h = _int_field(rec, "image_w"), _int_field(rec, "image_h")
        if n <= 0:
            raise Rejected(NUM_BOXES, f"num_boxes is {n}")
        if w <= 0 or h <= 0:
            raise Rejected(IMAGE_SIZE, f"image size {rec['image_w']}x{rec['image_h']} is not positive")
        boxes = _b64_array(rec, "boxes", "<f4", n, 4)
        raw = _b64(rec, "features")
        if len(raw) % (4 * n):
            raise Rejected(BYTES, f"field 'features' has {len(raw)} bytes: not num_boxes ({n}) x D float32")
        feats = np.frombuffer(raw, "<f4").reshape(n, -1)
        extras = {}
        for name, (extra, dtype) in TSV_OPTIONAL.items():
            if name in rec:
                extras[extra] = _b64_array(rec, name, dtype, n, 1).reshape(n)
        return Regions(feats, boxes, True, size=(h, w), extras=extras)

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "files": [str(p) for p in self.files], "fields": list(self.layout)}


def is_tsv_name(name: str) -> bool:
    """Whether a file name is a TSV's (``.tsv``, or a part ``.tsv.<n>``)."""
    return bool(re.search(r"\.tsv(\.\d+)?$", name))


def is_tsv_file(path: Path) -> bool:
    """Whether a source file is a TSV (by its name)."""
    return is_tsv_name(path.name)


def tsv_fields(fields: Sequence[str]) -> tuple[str, ...]:
    """The TSV layout ``fields`` names (aliases resolved); :class:`FeatureImportError` for an unknown, lacking or
    repeated field."""
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
        raise Rejected(OTHER, f"field {name!r} is {rec[name][:40]!r}, not an integer") from None


def _b64(rec: Mapping[str, str], name: str) -> bytes:
    try:
        return base64.b64decode(rec[name], validate=True)
    except (binascii.Error, ValueError) as e:
        raise Rejected(BAD_BASE64, f"bad base64 in field {name!r} ({e})") from None


def _b64_array(rec: Mapping[str, str], name: str, dtype: str, n: int, width: int) -> np.ndarray:
    raw = _b64(rec, name)
    item = np.dtype(dtype).itemsize
    if len(raw) != n * width * item:
        raise Rejected(BYTES, f"field {name!r} has {len(raw)} bytes, expected num_boxes x {width} x {item} = "
                              f"{n * width * item}")
    return np.frombuffer(raw, dtype).reshape(n, width)
