"""What every feature source shares: the :class:`Source` interface, the records it gives (:class:`Regions`,
:class:`Scan`), the rejection of one record (:class:`Rejected`, with its kind as data), the error for a source that
cannot be read at all (:class:`FeatureImportError`) and the first-pass scan of a folder of per-image files."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from captioning.errors import InputError

NO_ID = np.iinfo(np.int64).min  # a record whose image id cannot be read

# ---------------------------------------------------------------------- reject kinds
# The kind of a rejected row, counted per kind in the import's report (``ImportResult.reasons``, the store's
# ``import.reject_kinds``). The code that rejects a row states its kind; the values are the names reports have
# always used (some read oddly, e.g. ``"no "``: they are kept so that reports and stores do not change).
DUPLICATE_ID = "duplicate image id"  # two records of one image
NOT_IN_DATASET = "not in the dataset"  # a record of an image the dataset does not have
BAD_BASE64 = "bad base64"  # a TSV field that is not base64 (also when the record is cut inside it)
TRUNCATED = "truncated"  # a record cut where the file ends, or with another field count than the layout's
TOO_LONG = "longer than"  # a TSV line longer than any record of max_boxes x feature_dim
NON_FINITE = "non-finite"  # NaN/inf in features, boxes or an extra
OUTSIDE = "outside"  # a box outside the image, an object/attribute id outside 0..2^31-1
BYTES = "bytes"  # a field or value with the wrong number of bytes, or not the bytes of a .npy/.npz
SHAPE = "shape"  # an array of the wrong shape
IMAGE_SIZE = "image size"  # the image size is unknown, not positive, or differs from the image file's
NUM_BOXES = "num_boxes is"  # a TSV record of zero or fewer boxes
NO_REGIONS = "no regions"  # an array of zero regions
MAX_BOXES = "max_boxes"  # more regions than the store's max_boxes
NOT_AN_ID = "is not an image id"  # a file name, key or field that is not an image id
NO_RECORD = "no record"  # an image of the dataset without a record (sources that name no file)
NO_ARRAY = "no array"  # a .npz without the member the format needs
NO_DATASET = "no dataset"  # an HDF5 file without the dataset the format needs
ABSENT = "no "  # a file, key or field that is not there
EXTERNAL = "external data"  # an HDF5 dataset whose data lives in another file (a link, external storage, virtual)
OTHER = "other"  # anything else, including an error the reading library raised


class FeatureImportError(InputError, ValueError):
    """The source cannot be read at all (missing, not the format, unreadable container) or the options do not fit
    it; the message is one line."""


class Rejected(Exception):
    """One record cannot be imported: ``kind`` (one of the kinds above, what reports count) and ``text`` (the
    reason the row keeps; also the exception's message)."""

    def __init__(self, kind: str, text: str):
        super().__init__(kind, text)  # both: a copy (pickle) is made with both
        self.kind = kind
        self.text = text

    def __str__(self) -> str:
        return self.text


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
    read) and the problems found on the way (record -> its rejection)."""

    ids: np.ndarray
    problems: dict[int, Rejected] = field(default_factory=dict)


def image_id_in(text: str) -> int | None:
    """An image id from a file name, key or field: the decimal number it ends with (``391895``,
    ``COCO_val2014_000000391895``)."""
    m = re.search(r"(\d+)$", text.strip())
    if not m or len(m.group(1)) > 18:
        return None
    return int(m.group(1))


def list_names(folder: Path, suffix: str) -> list[str]:
    """The names of the entries of ``folder`` that end with ``suffix``, sorted (the records of a folder source,
    in their order); :class:`FeatureImportError` when the folder cannot be listed."""
    try:
        return sorted(e.name for e in os.scandir(folder) if e.name.endswith(suffix))
    except OSError as e:
        raise FeatureImportError(f"cannot list {folder}: {e}") from None


def scan_names(names: Sequence[str], image_id_of: Callable[[str], int | None],
               problem: Callable[[str], Rejected]) -> Scan:
    """The first pass over records named ``names`` (files or keys): each one's image id (``image_id_of``), or
    :data:`NO_ID` and the rejection ``problem`` gives for a name without one."""
    ids = np.full(len(names), NO_ID, np.int64)
    problems = {}
    for k, name in enumerate(names):
        iid = image_id_of(name)
        if iid is None:
            problems[k] = problem(name)
        else:
            ids[k] = iid
    return Scan(ids, problems)


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

    def missing(self, image_id: int) -> Rejected:
        """The rejection of an image that has no record."""
        return Rejected(NO_RECORD, f"no record for image {image_id} in {self.describe()['path']}")

    def load(self, record: int) -> Regions:
        raise NotImplementedError

    def stream(self, records: np.ndarray) -> Iterator[tuple[int, Regions | Rejected]]:
        """Records ``records`` (ascending) in order, each as regions or its rejection."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def declared_shape(fileobj: Any, where: str) -> tuple[int, ...]:
    """The shape a ``.npy`` stream declares in its header, read without reading its data (the stream is left after
    the header); :class:`Rejected` when it is not a ``.npy`` header."""
    try:
        version = np.lib.format.read_magic(fileobj)
        shape, _, _ = (np.lib.format.read_array_header_1_0(fileobj) if version == (1, 0)
                       else np.lib.format.read_array_header_2_0(fileobj))
    except (ValueError, OSError, EOFError) as e:
        raise Rejected(BYTES, f"{where}: not a .npy header ({e})") from None
    return tuple(int(v) for v in shape)


def check_declared(shape: tuple[int, ...], where: str, *, max_boxes: int, feature_dim: int,
                   rows_are_boxes: bool) -> None:
    """Refuse, before any data is read, an array whose declared shape no record of the store can hold: more rows
    than ``max_boxes`` (when its rows are regions) or more values than max_boxes x max(feature_dim, 4096)."""
    if rows_are_boxes and shape and shape[0] > max_boxes:
        raise Rejected(MAX_BOXES, f"{shape[0]} boxes > max_boxes={max_boxes}")
    if int(np.prod(shape, dtype=np.float64)) > max_boxes * max(feature_dim, 4096):
        raise Rejected(SHAPE, f"{where} declares shape {shape}: more values than a record of max_boxes={max_boxes} "
                              "holds")


def npz_member_shape(z: Any, key: str, where: str) -> tuple[int, ...]:
    """The shape member ``key`` of an open ``np.load`` npz declares (its header only is read)."""
    with z.zip.open(f"{key}.npy") as f:
        return declared_shape(f, f"{where}[{key}]")
