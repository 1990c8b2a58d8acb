"""Zarr v3 stores: region features (``features.zarr``) and caption labels (``labels.zarr``).

Feature store, one row per image in a fixed order (DESIGN.md "Data contracts"):
  features (N, B_max, D) float16 | boxes (N, B_max, 4) float32 (x1,y1,x2,y2 / image size) |
  num_boxes (N,) int16 | image_size (N, 2) int32 (height, width; -1 = unknown) | image_id (N,) int64 |
  status (N,) int8 (0 pending, 1 ok, 2 rejected) | reject_reason (N,) str
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
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec

FEATURE_SCHEMA = "capflow-features/1"
LABEL_SCHEMA = "capflow-labels/1"
PENDING, OK, REJECTED = 0, 1, 2
GROUND_TRUTH = 0


class StoreError(ValueError):
    """A store is missing, has the wrong schema, or a write breaks the store's contract."""


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


# ---------------------------------------------------------------------- feature store
@dataclass
class FeatureBlock:
    """Rows ``start..stop`` of a feature store, as read in one go (numpy arrays, padded)."""

    start: int
    features: np.ndarray
    boxes: np.ndarray
    num_boxes: np.ndarray
    image_id: np.ndarray
    status: np.ndarray
    image_size: np.ndarray


class FeatureStore:
    """A chunked Zarr feature store. Create once with :meth:`create`, then write whole chunks."""

    ARRAYS = ("features", "boxes", "num_boxes", "image_size", "image_id", "status", "reject_reason")

    def __init__(self, uri: str, group: zarr.Group):
        self.uri = uri
        self.group = group
        schema = group.attrs.get("schema")
        if schema != FEATURE_SCHEMA:
            raise StoreError(f"{uri}: not a capflow feature store (schema {schema!r}, expected {FEATURE_SCHEMA})")
        missing = [a for a in self.ARRAYS if a not in group]
        if missing:
            raise StoreError(f"{uri}: feature store lacks arrays {missing}")
        self._a = {name: group[name] for name in self.ARRAYS}

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
    ) -> FeatureStore:
        ids = np.asarray(image_ids, dtype=np.int64)
        if len(np.unique(ids)) != len(ids):
            raise StoreError("image ids of a feature store must be unique")
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
        if n:
            g["image_id"][:] = ids
        g.attrs.update({
            "schema": FEATURE_SCHEMA,
            "max_boxes": b,
            "feature_dim": d,
            "chunk_rows": c,
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
        return self._a["image_id"][start:stop]

    def status(self, start: int | None = None, stop: int | None = None) -> np.ndarray:
        return self._a["status"][start:stop]

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
        for name, arr in self._a.items():
            arr.resize((n1, *arr.shape[1:]))
            self._a[name] = self.group[name]
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
    ) -> None:
        """Write rows ``start..start+n``; must cover whole chunks (or run to the end of the store)."""
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
        a = self._a
        a["features"][start:stop] = features.astype(a["features"].dtype, copy=False)
        a["boxes"][start:stop] = boxes.astype(np.float32, copy=False)
        a["num_boxes"][start:stop] = nb.astype(np.int16)
        a["image_size"][start:stop] = np.asarray(image_size, dtype=np.int32)
        reasons = list(reject_reason) if reject_reason is not None else [""] * n
        a["reject_reason"][start:stop] = np.array(reasons, dtype=object)
        a["status"][start:stop] = st  # last: marks the rows done

    # ------------------------------------------------------------------ read
    def read_block(self, start: int, stop: int) -> FeatureBlock:
        a = self._a
        return FeatureBlock(
            start=start,
            features=a["features"][start:stop],
            boxes=a["boxes"][start:stop],
            num_boxes=a["num_boxes"][start:stop].astype(np.int64),
            image_id=a["image_id"][start:stop],
            status=a["status"][start:stop],
            image_size=a["image_size"][start:stop],
        )

    def read_features(self, start: int, stop: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """features (n, width, D) and boxes (n, width, 4) of rows start..stop, boxes past ``width`` not copied."""
        w = self.max_boxes if width is None else width
        return self._a["features"][start:stop, :w], self._a["boxes"][start:stop, :w]

    def num_boxes(self) -> np.ndarray:
        return self._a["num_boxes"][:].astype(np.int64)

    def rejects(self) -> list[dict[str, Any]]:
        st = self.status()
        rows = np.flatnonzero(st == REJECTED)
        if not len(rows):
            return []
        reasons = self._a["reject_reason"][:]
        ids = self.image_ids()
        return [{"row": int(r), "image_id": int(ids[r]), "reason": str(reasons[r])} for r in rows]

    def summary(self) -> dict[str, Any]:
        st = self.status()
        nb = self._a["num_boxes"][:][st == OK]
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
        """Small description for lineage: schema, shape, attributes and a digest of the row index + status."""
        h = hashlib.sha256()
        h.update(self.image_ids().tobytes())
        h.update(self.status().tobytes())
        h.update(json.dumps(self.attrs, sort_keys=True, default=str).encode())
        return {
            "uri": self.uri,
            "rows": self.num_rows,
            "max_boxes": self.max_boxes,
            "feature_dim": self.feature_dim,
            "chunk_rows": self.chunk_rows,
            "attrs": self.attrs,
            "digest": h.hexdigest(),
        }


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


class LabelStore:
    ARRAYS = ("tokens", "length", "image_row", "image_id", "split", "source")

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
        g.attrs.update({"schema": LABEL_SCHEMA, "max_words": seq, "sources": {str(GROUND_TRUTH): "ground_truth"},
                        **(dict(attrs) if attrs else {})})
        store = cls(uri, g)
        store._write(0, tokens, length, image_row, image_id, split, np.full(m, GROUND_TRUTH, np.int8))
        return store

    @classmethod
    def open(cls, uri: str, mode: str = "r") -> LabelStore:
        return cls(uri, _open_group(uri, mode))

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    def _write(self, start, tokens, length, image_row, image_id, split, source) -> None:
        stop = start + len(tokens)
        g = self.group
        g["tokens"][start:stop] = np.asarray(tokens, np.int32)
        g["length"][start:stop] = np.asarray(length, np.int16)
        g["image_row"][start:stop] = np.asarray(image_row, np.int32)
        g["image_id"][start:stop] = np.asarray(image_id, np.int64)
        g["split"][start:stop] = np.asarray(split, np.int8)
        g["source"][start:stop] = np.asarray(source, np.int8)

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
        m1 = m0 + len(tokens)
        for a in self.ARRAYS:
            arr = self.group[a]
            arr.resize((m1, *arr.shape[1:]))
        self._write(m0, tokens, length, image_row, image_id, split, np.full(len(tokens), code, np.int8))
        sources[code] = name
        self.group.attrs["sources"] = {str(k): v for k, v in sources.items()}
        return code

    def read(self) -> Labels:
        g = self.group
        return Labels(
            tokens=g["tokens"][:],
            length=g["length"][:].astype(np.int64),
            image_row=g["image_row"][:].astype(np.int64),
            image_id=g["image_id"][:],
            split=g["split"][:],
            source=g["source"][:],
            sources={int(k): v for k, v in g.attrs["sources"].items()},
        )

    def digest(self) -> str:
        lab = self.read()
        h = hashlib.sha256()
        for arr in (lab.tokens, lab.length, lab.image_row, lab.image_id, lab.split, lab.source):
            h.update(np.ascontiguousarray(arr).tobytes())
        h.update(json.dumps(lab.sources, sort_keys=True).encode())
        return h.hexdigest()
