"""The feature store (``features.zarr``), one row per image in a fixed order (ARCHITECTURE.md, "Data contracts"):
  features (N, B_max, D) float16 | boxes (N, B_max, 4) float32 (x1,y1,x2,y2 / image size) |
  num_boxes (N,) int16 | image_size (N, 2) int32 (height, width; -1 = unknown) | image_id (N,) int64 |
  status (N,) int8 (0 pending, 1 ok, 2 rejected) | reject_reason (N,) str
Optional per-region arrays (``extras``, chosen when the store is created, :data:`EXTRAS`):
  object_id (N, B_max) int32 (-1 = none) | object_conf (N, B_max) float32 | attr_id (N, B_max) int32 (-1 = none) |
  attr_conf (N, B_max) float32 | boxes_px (N, B_max, 4) float32 (x1,y1,x2,y2 in original-image pixels)
Chunks span whole rows (``chunk_rows`` images); each writer owns whole chunks and writes ``status`` last, so a
row is ``ok`` only once its data is on storage. Arrays are created (or grown) once, before any fan-out.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from captioning.data.stores.chunked import ChunkedStore
from captioning.data.stores.common import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS,
    DIGEST_BYTES,
    FEATURE_SCHEMA,
    OK,
    PENDING,
    REJECTED,
    ChunkFault,
    CorruptDataError,
    StoreError,
    VerifyReport,
    log,
    open_group,
)

_MANIFEST_BLOCK = 8192  # chunks per read of the row index and status while the manifest hashes them


def _compressors(name: str, itemsize: int):
    if name == "none":
        return None
    return [BloscCodec(cname=name, clevel=5, shuffle="shuffle", typesize=itemsize)]


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


class RowIndex(Mapping[int, int]):
    """image id -> store row as sorted numpy arrays (16 bytes an image, not a dict's ~100); iterates in row order."""

    def __init__(self, image_ids: np.ndarray) -> None:
        self._by_row = np.asarray(image_ids, np.int64)
        self._order = np.argsort(self._by_row, kind="stable")
        self._sorted = self._by_row[self._order]

    def __getitem__(self, image_id: int) -> int:
        k = int(np.searchsorted(self._sorted, image_id))
        if k < len(self._sorted) and self._sorted[k] == image_id:
            return int(self._order[k])
        raise KeyError(image_id)

    def __len__(self) -> int:
        return len(self._by_row)

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_row.tolist())


class FeatureStore(ChunkedStore):
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
        g = open_group(uri, "w" if overwrite else "w-")
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
        return cls(uri, open_group(uri, mode))

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

    def row_of(self) -> RowIndex:
        """image id -> row (numpy-backed: a dict of millions of ids would be the largest object of its stage)."""
        return RowIndex(self.image_ids())

    def _pending_mask(self, status: np.ndarray, chunks: int | None = None) -> np.ndarray:
        """Per chunk: has it a row not yet written? (one pass over the status, not a slice per chunk; ``status``
        from the first row of a chunk on, ``chunks`` of them: default every chunk of the store)"""
        mask = np.zeros(self.num_chunks if chunks is None else chunks, bool)
        mask[np.flatnonzero(status == PENDING) // self.chunk_rows] = True
        return mask

    def pending_chunks(self) -> list[int]:
        """Chunks with at least one row not yet written (resume starts here)."""
        return np.flatnonzero(self._pending_mask(self.status())).tolist()

    def append_images(self, image_ids: Sequence[int]) -> range:
        """Grow every array by new rows (status pending). Existing rows are untouched. Not for concurrent use."""
        new = np.asarray(image_ids, dtype=np.int64)
        if len(dup := np.unique(new[np.isin(new, self.image_ids())])):
            raise StoreError(f"images already in the store: {dup[:10].tolist()}")
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
        rows = _MANIFEST_BLOCK * self.chunk_rows  # whole chunks per read: the status gives whole chunks' flags
        for lo in range(0, self.num_rows, rows):  # hashed as read (no bytes copy of the whole array)
            h.update(np.ascontiguousarray(self.image_ids(lo, min(lo + rows, self.num_rows))))
        finished = np.zeros(self.num_chunks, bool)
        for lo in range(0, self.num_rows, rows):
            st = self.status(lo, min(lo + rows, self.num_rows))
            h.update(np.ascontiguousarray(st))
            n = -(-len(st) // self.chunk_rows)
            finished[lo // self.chunk_rows: lo // self.chunk_rows + n] = ~self._pending_mask(st, n)
        h.update(json.dumps(self.attrs, sort_keys=True, default=str).encode())
        sums, bad = self._recorded_sums()
        if bad:
            raise CorruptDataError(f"feature store {self.uri}: cannot read the checksums of chunks {sorted(bad)} "
                                   f"({self.chunk_file(CHECKSUMS, min(bad))}, ...). {self.repair_hint()}")
        if sums is not None:
            h.update(CHECKSUM_ALGORITHM.encode())
            h.update(np.ascontiguousarray(sums))
            unverified = int((finished & ~sums.reshape(len(sums), -1).any(axis=1)).sum())
        else:
            unverified = int(finished.sum())
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
        return np.flatnonzero(~self._pending_mask(st)).tolist()

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
            status = self.status()  # a local store's files read directly (zarr: ~0.2 ms and ~3 KB a chunk)
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
        unreadable = np.zeros(self.num_chunks, bool)  # per chunk, as masks: no Python object per chunk
        unreadable[sorted(bad_status | set(bad_sums))] = True
        finished = ~self._pending_mask(status) & ~unreadable
        wanted = np.ones(self.num_chunks, bool)
        if chunks is not None:
            asked = np.fromiter(chunks, np.int64)
            if len(asked) and (asked.min() < 0 or asked.max() >= self.num_chunks):
                raise ValueError(f"{self.uri} has chunks 0..{self.num_chunks - 1}; asked to verify "
                                 f"{int(asked[(asked < 0) | (asked >= self.num_chunks)][0])}")
            wanted[:] = False
            wanted[asked] = True
        report.pending = int((wanted & ~finished & ~unreadable).sum())
        todo = np.flatnonzero(finished & wanted)
        fresh = self._verify_chunks(todo, report, sums, threads) if len(todo) else {}
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
