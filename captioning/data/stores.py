"""Zarr v3 stores: region features (``features.zarr``) and caption labels (``labels.zarr``).

Feature store, one row per image in a fixed order (ARCHITECTURE.md, "Data contracts"):
  features (N, B_max, D) float16 | boxes (N, B_max, 4) float32 (x1,y1,x2,y2 / image size) |
  num_boxes (N,) int16 | image_size (N, 2) int32 (height, width; -1 = unknown) | image_id (N,) int64 |
  status (N,) int8 (0 pending, 1 ok, 2 rejected) | reject_reason (N,) str
Optional per-region arrays (``extras``, chosen when the store is created, :data:`EXTRAS`):
  object_id (N, B_max) int32 (-1 = none) | object_conf (N, B_max) float32 | attr_id (N, B_max) int32 (-1 = none) |
  attr_conf (N, B_max) float32 | boxes_px (N, B_max, 4) float32 (x1,y1,x2,y2 in original-image pixels)
Chunks span whole rows (``chunk_rows`` images); each writer owns whole chunks and writes ``status`` last, so a
row is ``ok`` only once its data is on storage. Arrays are created (or grown) once, before any fan-out.

Label store, one row per caption:
  tokens (M, L) int32 word ids without BOS/EOS, 0-padded | length (M,) int16 | image_row (M,) int32 (row in
  the feature store) | image_id (M,) int64 | split (M,) int8 (0 train, 1 val, 2 test) | source (M,) int8
  with the group attribute ``sources`` naming each source code (0 = ground truth, others e.g. SeqKD runs).

Both stores open from a local path or any fsspec URI (``s3://bucket/prefix``); credentials come from the
environment, never from code or configs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from captioning.errors import InputError
from captioning.util import usable_cpus

FEATURE_SCHEMA = "capflow-features/1"
LABEL_SCHEMA = "capflow-labels/1"
PENDING, OK, REJECTED = 0, 1, 2
GROUND_TRUTH = 0
CHECKSUMS = "checksum"  # the per-chunk checksum array of both stores
CHECKSUM_ALGORITHM = "sha256/128"  # per array and chunk: the first 16 bytes of sha256(dtype, shape, values)
DIGEST_BYTES = 16

log = logging.getLogger(__name__)


class StoreError(InputError, ValueError):
    """A store is missing, has the wrong schema, or a write breaks the store's contract."""


class CorruptDataError(StoreError):
    """A stored file (a store's chunk, a checkpoint, a stage record) is damaged: the message names the file and
    says how to repair it."""


def storage_options_for(uri: str) -> dict[str, Any] | None:
    """fsspec options for remote URIs, from the environment only (``AWS_ENDPOINT_URL`` etc.)."""
    if uri.startswith("s3://"):
        opts: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
        return opts
    return None


def _open_group(uri: str, mode: str):
    try:
        return zarr.open_group(store=uri, mode=mode, storage_options=storage_options_for(uri), zarr_format=3)
    except FileNotFoundError:
        raise StoreError(f"no Zarr store at {uri}") from None
    except FileExistsError:
        raise StoreError(f"a store already exists at {uri} (remove it or ask to overwrite)") from None


def _compressors(name: str, itemsize: int):
    if name == "none":
        return None
    return [BloscCodec(cname=name, clevel=5, shuffle="shuffle", typesize=itemsize)]


# ---------------------------------------------------------------------- direct reads of many small chunks
_DIRECT_MIN_CHUNKS = 32  # fewer chunks than this: zarr's own read (its fixed cost is small then)


def _read_rows_direct(group: zarr.Group, arr, start: int | None, stop: int | None) -> np.ndarray | None:
    """Rows ``start..stop`` of a local, row-chunked numeric array read chunk file by chunk file (bytes + one Zstd
    or Blosc codec), or None when that does not apply or anything fails (the caller then reads through zarr, which
    names a damaged file). The arrays indexed by row (ids, status, box counts, checksums) are chunked by
    ``chunk_rows``, i.e. ~1 file per image at 8 rows: zarr spends ~0.6 ms per chunk on them (15 s per array at
    COCO's 123k images), a plain read and decode ~0.08 ms."""
    try:
        store = group.store
        root = getattr(store, "root", None)
        meta = arr.metadata
        c = arr.chunks[0]
        n = arr.shape[0]
        start, stop, _ = slice(start, stop).indices(n)
        first, last = start // c, -(-stop // c)
        if (root is None or type(store).__name__ != "LocalStore" or last - first < _DIRECT_MIN_CHUNKS
                or tuple(arr.chunks[1:]) != tuple(arr.shape[1:]) or arr.dtype.kind not in "iufb"):
            return None
        codecs = list(meta.codecs)
        if type(codecs[0]).__name__ != "BytesCodec" or len(codecs) > 2:
            return None
        if len(codecs) == 2:
            import numcodecs

            kind = type(codecs[1]).__name__
            if kind == "ZstdCodec":
                decode = numcodecs.Zstd().decode
            elif kind == "BloscCodec":
                decode = numcodecs.Blosc().decode
            else:
                return None
        else:
            def decode(b: bytes) -> bytes:
                return b
        endian = getattr(codecs[0].endian, "value", codecs[0].endian)
        dtype = np.dtype(arr.dtype).newbyteorder("<" if endian in ("little", None) else ">")
        shape = (c, *arr.shape[1:])
        out = np.empty((stop - start, *arr.shape[1:]), arr.dtype)
        base = os.path.join(str(root), arr.path)
        for k in range(first, last):
            lo, hi = max(k * c, start), min((k + 1) * c, stop)
            key = meta.encode_chunk_key((k,) + (0,) * (arr.ndim - 1))
            try:
                with open(os.path.join(base, key), "rb") as f:
                    raw = f.read()
            except FileNotFoundError:  # never written: the fill value, as zarr reads it
                out[lo - start: hi - start] = arr.fill_value
                continue
            chunk = np.frombuffer(decode(raw), dtype).reshape(shape)
            out[lo - start: hi - start] = chunk[lo - k * c: hi - k * c]
        return out
    except Exception:
        return None


# ---------------------------------------------------------------------- chunk checksums
def values_digest(values: Any) -> np.ndarray:
    """16-byte digest (uint8) of an array's values as stored: dtype, shape and bytes; strings as UTF-8."""
    a = np.asarray(values)
    h = hashlib.sha256()
    if a.dtype.kind in "OUST":  # reject reasons: str / StringDType / object arrays of str
        h.update(f"str{a.shape};".encode())
        for text in a.ravel().tolist():
            enc = str(text).encode("utf-8", "surrogatepass")
            h.update(len(enc).to_bytes(8, "little"))
            h.update(enc)
    else:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape};".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return np.frombuffer(h.digest()[:DIGEST_BYTES], np.uint8)


@dataclass
class ChunkFault:
    """A chunk whose files cannot be read or whose values differ from the checksum recorded when it was written."""

    chunk: int
    rows: tuple[int, int]
    arrays: list[str]
    files: list[str]
    problem: str

    def __str__(self) -> str:
        return f"chunk {self.chunk} (rows {self.rows[0]}..{self.rows[1] - 1}): {self.problem}: {', '.join(self.files)}"


@dataclass
class VerifyReport:
    """What :meth:`FeatureStore.verify` / :meth:`LabelStore.verify` found (and, with ``repair``, did)."""

    uri: str
    kind: str  # "features" | "labels"
    chunks: int  # chunks in the store
    checked: int  # chunks whose values were compared with their checksums
    faults: list[ChunkFault] = field(default_factory=list)
    unverified: list[int] = field(default_factory=list)  # finished chunks without a recorded checksum
    recorded: list[int] = field(default_factory=list)  # checksums recorded now (from values that could not be checked)
    repaired: list[int] = field(default_factory=list)  # damaged chunks marked pending (features: re-extracted next)
    pending: int = 0  # feature chunks not finished yet (nothing to verify)
    bytes: int = 0  # decoded bytes read and hashed
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.faults

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "kind": self.kind, "chunks": self.chunks, "checked": self.checked,
                "faults": [{"chunk": f.chunk, "rows": list(f.rows), "arrays": f.arrays, "files": f.files,
                            "problem": f.problem}
                           for f in self.faults],
                "unverified": len(self.unverified), "recorded": len(self.recorded), "repaired": self.repaired,
                "pending": self.pending, "bytes": self.bytes, "seconds": round(self.seconds, 3)}


class _ChunkedStore:
    """What both stores share: row chunks spanning every array, reads that name a damaged chunk file, and a
    checksum per array and chunk (``checksum`` array, shape (chunks, arrays, 16) uint8, one Zarr chunk per row
    chunk, so writers that own whole chunks also own their checksums; all zero = none recorded)."""

    ARRAYS: tuple[str, ...] = ()
    KIND = ""
    uri: str
    group: zarr.Group

    # -------------------------------------------------------------- layout
    def _array(self, name: str):
        return self.group[name]

    @property
    def _n(self) -> int:
        return self._array(self.ARRAYS[0]).shape[0]

    @property
    def _rows_per_chunk(self) -> int:
        return self._array(self.ARRAYS[0]).chunks[0]

    @property
    def _chunks(self) -> int:
        return -(-self._n // self._rows_per_chunk)

    def _range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self._rows_per_chunk
        return start, min(start + self._rows_per_chunk, self._n)

    def _sums(self):
        return self.group.get(CHECKSUMS)

    @property
    def has_checksums(self) -> bool:
        return self._sums() is not None

    def chunk_file(self, name: str, chunk: int) -> str:
        """Where the file of array ``name``'s row chunk ``chunk`` lives (path or URI)."""
        arr = self._array(name)
        key = arr.metadata.encode_chunk_key((chunk,) + (0,) * (arr.ndim - 1))
        return f"{self.uri.rstrip('/')}/{arr.path}/{key}"

    def repair_hint(self, name: str | None = None) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    # -------------------------------------------------------------- reads that name damaged files
    def _read(self, name: str, start: int | None = None, stop: int | None = None, width: int | None = None):
        arr = self._array(name)
        if width is None:
            fast = _read_rows_direct(self.group, arr, start, stop)
            if fast is not None:
                return fast
        try:
            return arr[start:stop] if width is None else arr[start:stop, :width]
        except Exception as e:
            err = self._unreadable(name, start, stop, e)
            if err is None:
                raise
            raise err from e

    def _unreadable(self, name: str, start: int | None, stop: int | None, error: Exception
                    ) -> CorruptDataError | None:
        """The error naming the chunk files of rows start..stop that cannot be read (None if each reads alone)."""
        start = 0 if start is None else start
        stop = self._n if stop is None else stop
        c = self._rows_per_chunk
        bad = []
        for k in range(start // c, -(-stop // c)):
            a, b = self._range(k)
            try:
                self._array(name)[a:b]
            except Exception as e:
                bad.append((k, e))
        if not bad:
            return None
        files = "; ".join(f"{self.chunk_file(name, k)} (rows {self._range(k)[0]}..{self._range(k)[1] - 1}: "
                          f"{type(e).__name__}: {e})" for k, e in bad)
        return CorruptDataError(f"{self.KIND} store {self.uri}: cannot read {files}: the chunk file is damaged "
                                f"(truncated or overwritten). {self.repair_hint(name)}")

    # -------------------------------------------------------------- checksums
    def _chunk_values(self, values: Mapping[str, Any], offset: int, chunk: int) -> dict[str, Any]:
        a, b = self._range(chunk)
        return {n: values[n][a - offset : b - offset] for n in self.ARRAYS}

    def _digests(self, values: Mapping[str, Any]) -> np.ndarray:
        return np.stack([values_digest(values[n]) for n in self.ARRAYS])

    def _ensure_sums(self):
        """The checksum array, created (all zero: nothing recorded) for a store written before checksums."""
        sums = self._sums()
        if sums is None:
            sums = self.group.create_array(CHECKSUMS, shape=(self._chunks, len(self.ARRAYS), DIGEST_BYTES),
                                           chunks=(1, len(self.ARRAYS), DIGEST_BYTES), dtype="uint8", fill_value=0)
            self.group.attrs["checksums"] = {"algorithm": CHECKSUM_ALGORITHM, "arrays": list(self.ARRAYS)}
        return sums

    def _recorded_sums(self) -> tuple[np.ndarray | None, dict[int, Exception]]:
        """Recorded checksums (None: the store has none) and the chunks whose checksum file cannot be read."""
        sums = self._sums()
        if sums is None:
            return None, {}
        fast = _read_rows_direct(self.group, sums, None, None)
        if fast is not None:
            return fast, {}
        try:
            return sums[:], {}
        except Exception:
            out = np.zeros(sums.shape, np.uint8)
            bad: dict[int, Exception] = {}
            for k in range(sums.shape[0]):
                try:
                    out[k] = sums[k]
                except Exception as e:
                    bad[k] = e
            return out, bad

    def _compute(self, chunks: Sequence[int]) -> list[tuple[int, np.ndarray | None, dict[str, str], int]]:
        """Digests of consecutive ``chunks`` from the stored values: (chunk, digests | None, {array: error},
        bytes). One read per array for the whole run; a read that fails is retried chunk by chunk to name the
        damaged files."""
        start, stop = self._range(chunks[0])[0], self._range(chunks[-1])[1]

        def read(name: str):
            fast = _read_rows_direct(self.group, self._array(name), start, stop)  # a run of many small chunks
            return fast if fast is not None else self._array(name)[start:stop]
        try:
            values = {n: read(n) for n in self.ARRAYS}
        except Exception:
            values = None
        if values is not None:
            out = []
            for k in chunks:
                v = self._chunk_values(values, start, k)
                out.append((k, self._digests(v), {}, sum(np.asarray(x).nbytes for x in v.values())))
            return out
        out = []
        for k in chunks:
            a, b = self._range(k)
            v, errors = {}, {}
            for n in self.ARRAYS:
                try:
                    v[n] = self._array(n)[a:b]
                except Exception as e:
                    errors[n] = f"{type(e).__name__}: {e}"
            out.append((k, None if errors else self._digests(v), errors,
                        sum(np.asarray(x).nbytes for x in v.values())))
        return out

    def _verify_chunks(self, todo: Sequence[int], report: VerifyReport, recorded: np.ndarray | None,
                       threads: int | None) -> dict[int, np.ndarray]:
        """Compare chunks ``todo`` with their recorded checksums (faults and unverified chunks go into
        ``report``); returns the digests computed for the unverified ones."""
        per_chunk = sum(int(np.prod(self._array(n).chunks)) * self._array(n).dtype.itemsize
                        for n in self.ARRAYS if self._array(n).dtype.kind not in "OUST")
        group = max(1, min(64, (32 << 20) // max(per_chunk, 1)))  # ~32 MB of decoded values per read
        runs: list[list[int]] = []
        for k in todo:
            if runs and runs[-1][-1] == k - 1 and len(runs[-1]) < group:
                runs[-1].append(k)
            else:
                runs.append([k])
        workers = threads or min(4, usable_cpus())
        fresh: dict[int, np.ndarray] = {}
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="capflow-verify") as pool:
            for results in pool.map(self._compute, runs):
                for k, dig, errors, nbytes in results:
                    report.bytes += nbytes
                    rows = self._range(k)
                    if errors:
                        files = [self.chunk_file(n, k) for n in errors]
                        report.faults.append(ChunkFault(k, rows, list(errors), files, "cannot be read (" + "; ".join(
                            f"{n}: {e}" for n, e in errors.items()) + ")"))
                        continue
                    assert dig is not None
                    if recorded is None or not recorded[k].any():
                        report.unverified.append(k)
                        fresh[k] = dig
                        continue
                    report.checked += 1
                    wrong = [n for i, n in enumerate(self.ARRAYS) if not np.array_equal(dig[i], recorded[k, i])]
                    if wrong:
                        report.faults.append(ChunkFault(k, rows, wrong, [self.chunk_file(n, k) for n in wrong],
                                                        "values differ from the checksum recorded when the chunk "
                                                        "was written"))
        return fresh

    def _record(self, fresh: Mapping[int, np.ndarray], report: VerifyReport) -> None:
        """Record ``fresh`` checksums; the checksum array is added to an older store even when nothing is
        finished yet, so that chunks written from now on record theirs."""
        sums = self._ensure_sums()
        if not fresh:
            return
        for k, dig in sorted(fresh.items()):
            sums[k] = dig
            report.recorded.append(k)
        log.warning("%s store %s: %d chunks had no checksum (written before capflow recorded them); recorded them "
                    "now from their current values, which could not be checked", self.KIND, self.uri, len(fresh))


# ---------------------------------------------------------------------- feature store
# Optional per-region arrays of a feature store: name -> (trailing shape after (N, B_max), dtype, fill value).
# Bottom-up detectors give each region an object class and an attribute class with their confidences; the
# pixel boxes keep the source's own coordinates beside the relative ``boxes``. A store has the ones it was
# created with (attribute ``extras``), in this order.
EXTRAS: dict[str, tuple[tuple[int, ...], str, float | int]] = {
    "object_id": ((), "int32", -1),
    "object_conf": ((), "float32", 0.0),
    "attr_id": ((), "int32", -1),
    "attr_conf": ((), "float32", 0.0),
    "boxes_px": ((4,), "float32", 0.0),
}


def _extras_names(extras: Iterable[str]) -> tuple[str, ...]:
    """``extras`` checked against :data:`EXTRAS` and put in its order."""
    names = list(extras)
    if isinstance(extras, str):
        raise StoreError(f"extras must be a sequence of array names, not the string {extras!r}")
    unknown = [n for n in names if n not in EXTRAS]
    if unknown:
        raise StoreError(f"unknown extra feature-store arrays {unknown} (known: {', '.join(EXTRAS)})")
    if len(set(names)) != len(names):
        raise StoreError(f"extra feature-store arrays named twice: {names}")
    return tuple(n for n in EXTRAS if n in names)


@dataclass
class FeatureBlock:
    """Rows ``start..stop`` of a feature store, as read in one go (numpy arrays, padded); ``extras`` holds the
    store's optional per-region arrays (empty for a store without them)."""

    start: int
    features: np.ndarray
    boxes: np.ndarray
    num_boxes: np.ndarray
    image_id: np.ndarray
    status: np.ndarray
    image_size: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)


class FeatureStore(_ChunkedStore):
    """A chunked Zarr feature store. Create once with :meth:`create`, then write whole chunks.

    Each chunk's checksums (per array, of the values as stored) are recorded by the writer that owns the chunk,
    before its ``status``; :meth:`verify` compares stored values with them, :meth:`manifest`'s digest covers
    them. Stores written before checksums open as they are ("unverified"); :meth:`verify` with ``record``
    adds them.

    Optional per-region arrays (:data:`EXTRAS`: object/attribute ids and confidences, pixel boxes) are chosen at
    :meth:`create` (``extras``) and then given by every :meth:`write_rows`; they are checksummed, verified and
    covered by the manifest exactly like the other arrays. A store without them is laid out, checksummed and
    digested as before they existed.
    """

    ARRAYS = ("features", "boxes", "num_boxes", "image_size", "image_id", "status", "reject_reason")
    KIND = "feature"

    def __init__(self, uri: str, group: zarr.Group):
        self.uri = uri
        self.group = group
        schema = group.attrs.get("schema")
        if schema != FEATURE_SCHEMA:
            raise StoreError(f"{uri}: not a capflow feature store (schema {schema!r}, expected {FEATURE_SCHEMA})")
        try:
            self._extras = _extras_names(group.attrs.get("extras", ()))
        except StoreError as e:
            raise StoreError(f"{uri}: {e}") from None
        if self._extras:  # this store's arrays (checksum columns): the fixed ones, then its extras
            self.ARRAYS = FeatureStore.ARRAYS + self._extras
        missing = [a for a in self.ARRAYS if a not in group]
        if missing:
            raise StoreError(f"{uri}: feature store lacks arrays {missing}")
        self._a = {name: group[name] for name in self.ARRAYS}
        sums = group.get(CHECKSUMS)
        if sums is not None and sums.shape[1] != len(self.ARRAYS):
            raise StoreError(f"{uri}: the checksum array has {sums.shape[1]} columns for {len(self.ARRAYS)} arrays "
                             f"({', '.join(self.ARRAYS)})")

    def _array(self, name: str):
        return self._a[name]

    def repair_hint(self, name: str | None = None) -> str:
        if name == "image_id":
            return ("The store's image index cannot be re-extracted: start the store again with "
                    "`capflow extract --no-resume` (or remove it; `capflow run` then extracts it anew).")
        return (f"Run `capflow verify --repair {self.uri}` to mark the damaged chunks' rows for re-extraction, "
                "then `capflow extract` (or `capflow run`) re-extracts them.")

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(
        cls,
        uri: str,
        image_ids: Sequence[int],
        *,
        max_boxes: int,
        feature_dim: int = 2048,
        chunk_rows: int = 8,
        dtype: str = "float16",
        compressor: str = "lz4",
        attrs: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        extras: Sequence[str] = (),
    ) -> FeatureStore:
        """A new store of ``image_ids`` (all rows pending). ``extras``: optional per-region arrays
        (:data:`EXTRAS`), which every :meth:`write_rows` must then give; unknown names are an error."""
        ids = np.asarray(image_ids, dtype=np.int64)
        if len(np.unique(ids)) != len(ids):
            raise StoreError("image ids of a feature store must be unique")
        extra_names = _extras_names(extras)
        if attrs and "extras" in attrs and list(attrs["extras"]) != list(extra_names):
            raise StoreError("the store attribute 'extras' is set by FeatureStore.create(extras=...)")
        arrays = cls.ARRAYS + extra_names
        g = _open_group(uri, "w" if overwrite else "w-")
        n, b, d, c = len(ids), max_boxes, feature_dim, chunk_rows
        g.create_array("features", shape=(n, b, d), chunks=(c, b, d), dtype=dtype,
                       compressors=_compressors(compressor, np.dtype(dtype).itemsize), fill_value=0)
        g.create_array("boxes", shape=(n, b, 4), chunks=(c, b, 4), dtype="float32", fill_value=0)
        g.create_array("num_boxes", shape=(n,), chunks=(c,), dtype="int16", fill_value=0)
        g.create_array("image_size", shape=(n, 2), chunks=(c, 2), dtype="int32", fill_value=-1)
        g.create_array("image_id", shape=(n,), chunks=(c,), dtype="int64", fill_value=-1)
        g.create_array("status", shape=(n,), chunks=(c,), dtype="int8", fill_value=PENDING)
        g.create_array("reject_reason", shape=(n,), chunks=(c,), dtype=str, fill_value="")
        for name in extra_names:
            tail, edtype, fill = EXTRAS[name]
            g.create_array(name, shape=(n, b, *tail), chunks=(c, b, *tail), dtype=edtype, fill_value=fill)
        g.create_array(CHECKSUMS, shape=(-(-n // c), len(arrays), DIGEST_BYTES),
                       chunks=(1, len(arrays), DIGEST_BYTES), dtype="uint8", fill_value=0)
        step = c * 256  # in slices: one write of every chunk at once holds them all in memory
        for s in range(0, n, step):
            g["image_id"][s : s + step] = ids[s : s + step]
        g.attrs.update({
            "schema": FEATURE_SCHEMA,
            "max_boxes": b,
            "feature_dim": d,
            "chunk_rows": c,
            "checksums": {"algorithm": CHECKSUM_ALGORITHM, "arrays": list(arrays)},
            **({"extras": list(extra_names)} if extra_names else {}),  # absent: stores without extras as before
            **(dict(attrs) if attrs else {}),
        })
        return cls(uri, g)

    @classmethod
    def open(cls, uri: str, mode: str = "r") -> FeatureStore:
        return cls(uri, _open_group(uri, mode))

    @classmethod
    def exists(cls, uri: str) -> bool:
        try:
            cls.open(uri)
        except (StoreError, FileNotFoundError, KeyError):
            return False
        return True

    # ------------------------------------------------------------------ shape
    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    @property
    def extras(self) -> tuple[str, ...]:
        """The store's optional per-region arrays (:data:`EXTRAS` order; empty for a store without them)."""
        return self._extras

    @property
    def num_rows(self) -> int:
        return self._a["image_id"].shape[0]

    @property
    def max_boxes(self) -> int:
        return self._a["features"].shape[1]

    @property
    def feature_dim(self) -> int:
        return self._a["features"].shape[2]

    @property
    def chunk_rows(self) -> int:
        return self._a["features"].chunks[0]

    @property
    def num_chunks(self) -> int:
        return -(-self.num_rows // self.chunk_rows)

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_rows
        return start, min(start + self.chunk_rows, self.num_rows)

    def image_ids(self, start: int | None = None, stop: int | None = None) -> np.ndarray:
        return self._read("image_id", start, stop)

    def status(self, start: int | None = None, stop: int | None = None) -> np.ndarray:
        return self._read("status", start, stop)

    def row_of(self) -> dict[int, int]:
        return {int(i): r for r, i in enumerate(self.image_ids())}

    def pending_chunks(self) -> list[int]:
        """Chunks with at least one row not yet written (resume starts here)."""
        st = self.status()
        return [c for c in range(self.num_chunks) if np.any(st[slice(*self.chunk_range(c))] == PENDING)]

    def append_images(self, image_ids: Sequence[int]) -> range:
        """Grow every array by new rows (status pending). Existing rows are untouched. Not for concurrent use."""
        new = np.asarray(image_ids, dtype=np.int64)
        have = set(self.image_ids().tolist())
        if dup := sorted(have.intersection(new.tolist())):
            raise StoreError(f"images already in the store: {dup[:10]}")
        n0 = self.num_rows
        n1 = n0 + len(new)
        c = self.chunk_rows
        sums = self._sums()
        last = n0 // c if n0 % c else None  # a partial last chunk gains pending rows: check it, then forget its sum
        if last is not None and sums is not None and not np.any(self.status(*self.chunk_range(last)) == PENDING):
            check = VerifyReport(self.uri, "features", self.num_chunks, 0)
            self._verify_chunks([last], check, self._recorded_sums()[0], threads=1)
            if check.faults:
                log.warning("feature store %s: %s; its rows are extracted again", self.uri, check.faults[0])
                self.mark_pending([last])
        for name, arr in self._a.items():
            arr.resize((n1, *arr.shape[1:]))
            self._a[name] = self.group[name]
        if sums is not None:
            sums.resize((-(-n1 // c), *sums.shape[1:]))
            if last is not None:
                self.group[CHECKSUMS][last] = 0
        self._a["image_id"][n0:n1] = new
        return range(n0, n1)

    # ------------------------------------------------------------------ write
    def write_rows(
        self,
        start: int,
        *,
        features: np.ndarray,
        boxes: np.ndarray,
        num_boxes: np.ndarray,
        image_size: np.ndarray,
        status: np.ndarray,
        reject_reason: Sequence[str] | None = None,
        extras: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Write rows ``start..start+n``; must cover whole chunks (or run to the end of the store). ``extras``
        gives exactly the store's optional arrays (:attr:`extras`), each (n, B_max) or (n, B_max, 4) for
        ``boxes_px``, padded with its fill value past the row's boxes (ids -1, the rest 0)."""
        n = len(num_boxes)
        stop = start + n
        c = self.chunk_rows
        if start % c or (stop % c and stop != self.num_rows) or stop > self.num_rows:
            raise StoreError(
                f"{self.uri}: rows {start}..{stop} are not whole chunks of {c} rows (store has {self.num_rows})"
            )
        b, d = self.max_boxes, self.feature_dim
        if features.shape != (n, b, d) or boxes.shape != (n, b, 4):
            raise StoreError(
                f"expected features {(n, b, d)} and boxes {(n, b, 4)}, got {features.shape}, {boxes.shape}"
            )
        nb = np.asarray(num_boxes)
        if np.any(nb < 0) or np.any(nb > b):
            raise StoreError(f"num_boxes outside 0..{b}")
        st = np.asarray(status, dtype=np.int8)
        if np.any(st == PENDING):
            raise StoreError("write_rows needs a final status (ok or rejected) for every row")
        extra_values = self._extra_values(extras, n)
        a = self._a
        values = {
            "features": features.astype(a["features"].dtype, copy=False),
            "boxes": boxes.astype(np.float32, copy=False),
            "num_boxes": nb.astype(np.int16),
            "image_size": np.asarray(image_size, dtype=np.int32),
            "reject_reason": np.array(list(reject_reason) if reject_reason is not None else [""] * n, dtype=object),
            "status": st,
            **extra_values,
        }
        for name in ("features", "boxes", "num_boxes", "image_size", "reject_reason", *extra_values):
            a[name][start:stop] = values[name]
        sums = self._sums()
        if sums is not None and n:  # checksums of the values as written, before the status that finishes them
            values["image_id"] = self.image_ids(start, stop)
            first = start // c
            sums[first : first + -(-n // c)] = np.stack(
                [self._digests(self._chunk_values(values, start, k)) for k in range(first, first + -(-n // c))])
        a["status"][start:stop] = st  # last: marks the rows done

    def _extra_values(self, extras: Mapping[str, np.ndarray] | None, n: int) -> dict[str, np.ndarray]:
        """``write_rows``' extras checked against the store's (names, shapes, integer range) and cast to the
        stored dtypes."""
        given = dict(extras or {})
        if set(given) != set(self._extras):
            missing = [e for e in self._extras if e not in given]
            unexpected = sorted(set(given) - set(self._extras))
            raise StoreError(f"{self.uri}: write_rows must give exactly the store's extras "
                             f"{list(self._extras) or '(none)'}: missing {missing}, unexpected {unexpected}")
        out = {}
        for name in self._extras:
            tail, dtype, _ = EXTRAS[name]
            v = np.asarray(given[name])
            want = (n, self.max_boxes, *tail)
            if v.shape != want:
                raise StoreError(f"{self.uri}: extra array {name} has shape {v.shape}, expected {want}")
            if np.dtype(dtype).kind == "i":
                if v.dtype.kind not in "iu":
                    raise StoreError(f"{self.uri}: extra array {name} must hold integers (got {v.dtype})")
                info = np.iinfo(dtype)
                if v.size and (v.min() < info.min or v.max() > info.max):
                    raise StoreError(f"{self.uri}: extra array {name} has values outside {dtype}")
            out[name] = v.astype(dtype, copy=False)
        return out

    # ------------------------------------------------------------------ read
    def read_block(self, start: int, stop: int) -> FeatureBlock:
        return FeatureBlock(
            start=start,
            features=self._read("features", start, stop),
            boxes=self._read("boxes", start, stop),
            num_boxes=self._read("num_boxes", start, stop).astype(np.int64),
            image_id=self._read("image_id", start, stop),
            status=self._read("status", start, stop),
            image_size=self._read("image_size", start, stop),
            extras={name: self._read(name, start, stop) for name in self._extras},
        )

    def read_features(self, start: int, stop: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """features (n, width, D) and boxes (n, width, 4) of rows start..stop, boxes past ``width`` not copied."""
        w = self.max_boxes if width is None else width
        return self._read("features", start, stop, w), self._read("boxes", start, stop, w)

    def num_boxes(self) -> np.ndarray:
        return self._read("num_boxes").astype(np.int64)

    def rejects(self) -> list[dict[str, Any]]:
        st = self.status()
        rows = np.flatnonzero(st == REJECTED)
        if not len(rows):
            return []
        reasons = self._read("reject_reason")
        ids = self.image_ids()
        return [{"row": int(r), "image_id": int(ids[r]), "reason": str(reasons[r])} for r in rows]

    def summary(self) -> dict[str, Any]:
        st = self.status()
        nb = self._read("num_boxes")[st == OK]
        return {
            "store": self.uri,
            "images": self.num_rows,
            "ok": int((st == OK).sum()),
            "pending": int((st == PENDING).sum()),
            "rejected": self.rejects(),
            "boxes": {
                "min": int(nb.min()) if len(nb) else 0,
                "mean": float(nb.mean()) if len(nb) else 0.0,
                "max": int(nb.max()) if len(nb) else 0,
            },
        }

    def manifest(self) -> dict[str, Any]:
        """Small description for lineage: schema, shape, attributes and a digest of the row index, the status and
        every chunk's checksums, i.e. of the values (cheap: no feature is read). ``unverified_chunks`` counts
        finished chunks without a checksum (a store written before checksums: ``capflow verify --repair``)."""
        h = hashlib.sha256()
        ids, st = self.image_ids(), self.status()
        h.update(ids.tobytes())
        h.update(st.tobytes())
        h.update(json.dumps(self.attrs, sort_keys=True, default=str).encode())
        sums, bad = self._recorded_sums()
        if bad:
            raise CorruptDataError(f"feature store {self.uri}: cannot read the checksums of chunks {sorted(bad)} "
                                   f"({self.chunk_file(CHECKSUMS, min(bad))}, ...). {self.repair_hint()}")
        finished = self.finished_chunks(st)
        if sums is not None:
            h.update(CHECKSUM_ALGORITHM.encode())
            h.update(sums.tobytes())
            unverified = sum(1 for k in finished if not sums[k].any())
        else:
            unverified = len(finished)
        return {
            "uri": self.uri,
            "rows": self.num_rows,
            "max_boxes": self.max_boxes,
            "feature_dim": self.feature_dim,
            "chunk_rows": self.chunk_rows,
            "attrs": self.attrs,
            "checksums": CHECKSUM_ALGORITHM if sums is not None else None,
            "unverified_chunks": unverified,
            **({"extras": list(self._extras)} if self._extras else {}),
            "digest": h.hexdigest(),
        }

    # ------------------------------------------------------------------ verification
    def finished_chunks(self, status: np.ndarray | None = None) -> list[int]:
        """Chunks whose every row is written (ok or rejected)."""
        st = self.status() if status is None else status
        return [c for c in range(self.num_chunks) if not np.any(st[slice(*self.chunk_range(c))] == PENDING)]

    def verify(self, chunks: Iterable[int] | None = None, *, repair: bool = False, record: bool | None = None,
               threads: int | None = None) -> VerifyReport:
        """Compare the values of finished chunks (all, or ``chunks``) with the checksums recorded when they were
        written. A chunk fails when a file cannot be read (truncated, not decodable) or its values differ (e.g.
        another chunk's bytes). With ``repair``, failed chunks are marked pending (the next extraction redoes
        them; the image index, which extraction cannot redo, is never "repaired"). With ``record`` (default:
        ``repair``), finished chunks without a checksum get one from their current values. Not for use while
        another process writes the store."""
        t0 = time.perf_counter()
        record = repair if record is None else record
        report = VerifyReport(self.uri, "features", self.num_chunks, 0)
        st = self._a["status"]
        try:
            status = st[:]
        except Exception:  # chunk by chunk: a damaged status file fails only its chunk
            status = np.full(self.num_rows, PENDING, np.int8)
            for k in range(self.num_chunks):
                a, b = self.chunk_range(k)
                try:
                    status[a:b] = st[a:b]
                except Exception as e:
                    report.faults.append(ChunkFault(k, (a, b), ["status"], [self.chunk_file("status", k)],
                                                    f"cannot be read (status: {type(e).__name__}: {e})"))
        bad_status = {f.chunk for f in report.faults}
        sums, bad_sums = self._recorded_sums()
        for k, e in bad_sums.items():
            report.faults.append(ChunkFault(k, self.chunk_range(k), [CHECKSUMS], [self.chunk_file(CHECKSUMS, k)],
                                            f"checksum record cannot be read ({type(e).__name__}: {e})"))
        finished = [k for k in self.finished_chunks(status) if k not in bad_status and k not in bad_sums]
        wanted = set(range(self.num_chunks)) if chunks is None else set(chunks)
        todo = [k for k in finished if k in wanted]
        report.pending = sum(1 for k in wanted if k not in finished and k not in bad_status and k not in bad_sums)
        fresh = self._verify_chunks(todo, report, sums, threads) if todo else {}
        report.faults.sort(key=lambda f: f.chunk)
        if repair:
            fixable = sorted({f.chunk for f in report.faults if "image_id" not in f.arrays})
            self.mark_pending(fixable)
            report.repaired = fixable
        if record:
            self._record(fresh, report)
        report.seconds = time.perf_counter() - t0
        return report

    def mark_pending(self, chunks: Sequence[int]) -> None:
        """Mark every row of ``chunks`` pending, reset their values to the fill values (a damaged file is replaced,
        so nothing reads it again) and forget their checksums: the next extraction redoes them."""
        sums = self._sums()
        for k in chunks:
            rows = slice(*self.chunk_range(k))
            self._a["status"][rows] = PENDING  # first: the rows are no longer done
            fills = [("features", 0), ("boxes", 0), ("num_boxes", 0), ("image_size", -1)]
            for name, fill in [*fills, *((e, EXTRAS[e][2]) for e in self._extras)]:
                self._a[name][rows] = fill
            self._a["reject_reason"][rows] = ""
            if sums is not None:
                sums[k] = 0
        if chunks:
            log.warning("feature store %s: chunks %s marked pending (re-extracted by the next `capflow extract` or "
                        "`capflow run`)", self.uri, list(chunks))



# ---------------------------------------------------------------------- label store
@dataclass
class Labels:
    """The label store in memory (small: ~600k COCO captions x 16 words x 4 bytes = 38 MB)."""

    tokens: np.ndarray
    length: np.ndarray
    image_row: np.ndarray
    image_id: np.ndarray
    split: np.ndarray
    source: np.ndarray
    sources: dict[int, str]

    def select(self, mask: np.ndarray) -> Labels:
        return Labels(self.tokens[mask], self.length[mask], self.image_row[mask], self.image_id[mask],
                      self.split[mask], self.source[mask], dict(self.sources))


class LabelStore(_ChunkedStore):
    """Captions as word ids. Every chunk's checksums are recorded when it is written (:meth:`create`,
    :meth:`add_source`; one writer at a time) and checked by :meth:`read`, so damaged labels never train."""

    ARRAYS = ("tokens", "length", "image_row", "image_id", "split", "source")
    KIND = "label"

    def __init__(self, uri: str, group: zarr.Group):
        self.uri = uri
        self.group = group
        if group.attrs.get("schema") != LABEL_SCHEMA:
            raise StoreError(f"{uri}: not a capflow label store (schema {group.attrs.get('schema')!r})")

    @classmethod
    def create(
        cls,
        uri: str,
        tokens: np.ndarray,
        length: np.ndarray,
        image_row: np.ndarray,
        image_id: np.ndarray,
        split: np.ndarray,
        *,
        attrs: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        chunk: int = 65536,
    ) -> LabelStore:
        m, seq = tokens.shape
        g = _open_group(uri, "w" if overwrite else "w-")
        specs = {
            "tokens": ((m, seq), (chunk, seq), "int32"),
            "length": ((m,), (chunk,), "int16"),
            "image_row": ((m,), (chunk,), "int32"),
            "image_id": ((m,), (chunk,), "int64"),
            "split": ((m,), (chunk,), "int8"),
            "source": ((m,), (chunk,), "int8"),
        }
        for name, (shape, chunks, dtype) in specs.items():
            g.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0)
        g.create_array(CHECKSUMS, shape=(-(-m // chunk), len(cls.ARRAYS), DIGEST_BYTES),
                       chunks=(1, len(cls.ARRAYS), DIGEST_BYTES), dtype="uint8", fill_value=0)
        g.attrs.update({"schema": LABEL_SCHEMA, "max_words": seq, "sources": {str(GROUND_TRUTH): "ground_truth"},
                        "checksums": {"algorithm": CHECKSUM_ALGORITHM, "arrays": list(cls.ARRAYS)},
                        **(dict(attrs) if attrs else {})})
        store = cls(uri, g)
        store._write(0, tokens, length, image_row, image_id, split, np.full(m, GROUND_TRUTH, np.int8))
        return store

    def repair_hint(self, name: str | None = None) -> str:
        return ("A label store is not repaired in place: rebuild it (`capflow vocab`), or run `capflow verify "
                "--repair` on the pipeline's workdir, which removes it and the stage records that point at it so "
                "that `capflow run` rebuilds it.")

    @classmethod
    def open(cls, uri: str, mode: str = "r") -> LabelStore:
        return cls(uri, _open_group(uri, mode))

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    def _write(self, start, tokens, length, image_row, image_id, split, source) -> None:
        """Write rows ``start..`` and record the checksums of every chunk they touch (read back as stored)."""
        stop = start + len(tokens)
        g = self.group
        g["tokens"][start:stop] = np.asarray(tokens, np.int32)
        g["length"][start:stop] = np.asarray(length, np.int16)
        g["image_row"][start:stop] = np.asarray(image_row, np.int32)
        g["image_id"][start:stop] = np.asarray(image_id, np.int64)
        g["split"][start:stop] = np.asarray(split, np.int8)
        g["source"][start:stop] = np.asarray(source, np.int8)
        sums = self._sums()
        if sums is not None and stop > start:
            c = self._rows_per_chunk
            for k, dig, errors, _ in self._compute(list(range(start // c, -(-stop // c)))):
                if errors:
                    files = ", ".join(self.chunk_file(n, k) for n in errors)
                    raise CorruptDataError(f"label store {self.uri}: {files} cannot be read back after writing "
                                           f"({'; '.join(errors.values())}). {self.repair_hint()}")
                sums[k] = dig

    def add_source(self, name: str, tokens, length, image_row, image_id, split) -> int:
        """Append captions from a new source (e.g. SeqKD from teacher run X); returns its source code."""
        sources = {int(k): v for k, v in self.group.attrs["sources"].items()}
        if name in sources.values():
            raise StoreError(f"{self.uri}: source {name!r} already present")
        code = max(sources) + 1
        if code > 127:
            raise StoreError("too many label sources")
        m0 = self.group["tokens"].shape[0]
        seq = self.group["tokens"].shape[1]
        if tokens.shape[1] != seq:
            raise StoreError(f"tokens have width {tokens.shape[1]}, store has {seq}")
        sums = self._sums()
        if sums is not None and m0 % self._rows_per_chunk:  # the partial last chunk is rewritten: check it first
            self._raise_faults(self.verify([m0 // self._rows_per_chunk]))
        m1 = m0 + len(tokens)
        for a in self.ARRAYS:
            arr = self.group[a]
            arr.resize((m1, *arr.shape[1:]))
        if sums is not None:
            sums.resize((-(-m1 // self._rows_per_chunk), *sums.shape[1:]))
        self._write(m0, tokens, length, image_row, image_id, split, np.full(len(tokens), code, np.int8))
        sources[code] = name
        self.group.attrs["sources"] = {str(k): v for k, v in sources.items()}
        return code

    def read(self, verify: bool = True) -> Labels:
        """Every caption; with ``verify`` (default) each chunk is checked against its recorded checksums and a
        damaged chunk raises :class:`CorruptDataError` naming its files (a store without checksums reads as is)."""
        vals = {n: self._read(n) for n in self.ARRAYS}
        sums, bad = self._recorded_sums() if verify else (None, {})
        if bad:
            raise CorruptDataError(f"label store {self.uri}: cannot read the checksums of chunks {sorted(bad)} "
                                   f"({self.chunk_file(CHECKSUMS, min(bad))}, ...). {self.repair_hint()}")
        if sums is not None:
            faults = []
            for k in range(self._chunks):
                if not sums[k].any():
                    continue
                dig = self._digests(self._chunk_values(vals, 0, k))
                wrong = [n for i, n in enumerate(self.ARRAYS) if not np.array_equal(dig[i], sums[k, i])]
                if wrong:
                    faults.append(ChunkFault(k, self._range(k), wrong, [self.chunk_file(n, k) for n in wrong],
                                             "values differ from the checksum recorded when the chunk was written"))
            self._raise_faults(VerifyReport(self.uri, "labels", self._chunks, self._chunks, faults))
        return Labels(
            tokens=vals["tokens"],
            length=vals["length"].astype(np.int64),
            image_row=vals["image_row"].astype(np.int64),
            image_id=vals["image_id"],
            split=vals["split"],
            source=vals["source"],
            sources={int(k): v for k, v in self.group.attrs["sources"].items()},
        )

    def _raise_faults(self, report: VerifyReport) -> None:
        if report.faults:
            raise CorruptDataError(f"label store {self.uri} is damaged: " + "; ".join(map(str, report.faults)) +
                                   f". {self.repair_hint()}")

    def verify(self, chunks: Iterable[int] | None = None, *, record: bool = False,
               threads: int | None = None) -> VerifyReport:
        """Compare every chunk (or ``chunks``) with its recorded checksums; with ``record``, chunks without one
        (a store written before checksums) get one from their current values."""
        t0 = time.perf_counter()
        report = VerifyReport(self.uri, "labels", self._chunks, 0)
        sums, bad = self._recorded_sums()
        for k, e in bad.items():
            report.faults.append(ChunkFault(k, self._range(k), [CHECKSUMS], [self.chunk_file(CHECKSUMS, k)],
                                            f"checksum record cannot be read ({type(e).__name__}: {e})"))
        todo = [k for k in (range(self._chunks) if chunks is None else chunks) if k not in bad]
        fresh = self._verify_chunks(todo, report, sums, threads) if todo else {}
        report.faults.sort(key=lambda f: f.chunk)
        if record:
            self._record(fresh, report)
        report.seconds = time.perf_counter() - t0
        return report

    def digest(self) -> str:
        """sha256 of every array's values (in :meth:`read`'s dtypes) and the source names, read a block of chunks
        at a time and each chunk checked against its checksums as :meth:`read` does (the store is never in
        memory whole)."""
        sums, bad = self._recorded_sums()
        if bad:
            raise CorruptDataError(f"label store {self.uri}: cannot read the checksums of chunks {sorted(bad)} "
                                   f"({self.chunk_file(CHECKSUMS, min(bad))}, ...). {self.repair_hint()}")
        widen = {"length", "image_row"}  # read() gives them as int64: the digest hashes those bytes
        c, run = self._rows_per_chunk, 16
        h = hashlib.sha256()
        faults: list[ChunkFault] = []
        for i, name in enumerate(self.ARRAYS):
            for k0 in range(0, self._chunks, run):
                k1 = min(k0 + run, self._chunks)
                vals = self._read(name, k0 * c, self._range(k1 - 1)[1])
                for k in range(k0, k1):
                    if sums is not None and sums[k].any():
                        part = vals[(k - k0) * c: (k - k0 + 1) * c]
                        if not np.array_equal(values_digest(part), sums[k, i]):
                            faults.append(ChunkFault(k, self._range(k), [name], [self.chunk_file(name, k)],
                                                     "values differ from the checksum recorded when the chunk was "
                                                     "written"))
                h.update(np.ascontiguousarray(vals.astype(np.int64) if name in widen else vals).tobytes())
        self._raise_faults(VerifyReport(self.uri, "labels", self._chunks, self._chunks, faults))
        sources = {int(k): v for k, v in self.group.attrs["sources"].items()}
        h.update(json.dumps(sources, sort_keys=True).encode())
        return h.hexdigest()
