"""The normalised dataset as a columnar file: Parquet, written in row groups while ingest streams, read by column
and row group.

One row per kept image, in image-id order (``image_id``, ``file``, ``split``, ``captions``, ``sentids``, ``size``,
``sha256``); the head (format, digest, source, images root, counts) and the records of what was left out
(rejected images, dropped captions, excluded entries) are the file's key-value metadata. Nothing here holds the
dataset: :class:`DatasetWriter` keeps one row group, :class:`DatasetFile` hands out row groups, columns as numpy
arrays, or entries one at a time.

Ingest sorts by image id without holding the dataset: :class:`RunWriter` writes bounded, sorted runs (temporary
Parquet files) and :func:`merge_runs` merges them into the dataset, a few hundred rows per run in memory.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from captioning.data.entries import (
    SPLIT_CODES,
    SPLITS,
    DatasetError,
    DigestHasher,
    ImageEntry,
    Rejection,
    dataset_summary,
    rejection_dict,
)
from captioning.util import atomic_write

FORMAT = "capflow-dataset/2"
META_KEY = "capflow.dataset"
ROW_GROUP = 8192  # images per row group (about 2 MB of captions at COCO's five per image)
MERGE_BATCH = 256  # rows per run held while runs are merged
_COLUMNS = (("image_id", pa.int64()), ("file", pa.string()), ("split", pa.string()),
            ("captions", pa.list_(pa.string())), ("sentids", pa.list_(pa.int64())), ("size", pa.int64()),
            ("sha256", pa.string()))
SCHEMA = pa.schema(list(_COLUMNS))
_RUN_SCHEMA = pa.schema([*_COLUMNS, ("entry", pa.int64())])  # + the entry's index in the input


def is_columnar(path: str | Path) -> bool:
    """Whether ``path`` is a Parquet file (the JSON format of earlier versions starts with ``{``)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def _table(rows: Sequence[ImageEntry], schema: pa.Schema, entries: Sequence[int] | None = None) -> pa.Table:
    cols: dict[str, Any] = {name: [getattr(e, name) for e in rows] for name, _ in _COLUMNS}
    if entries is not None:
        cols["entry"] = list(entries)
    return pa.table(cols, schema=schema)


class DatasetWriter:
    """Append entries in image-id order; :meth:`close` records the head and the left-out records and moves the
    file into place (written beside it under a temporary name, never through a link planted at ``path``)."""

    def __init__(self, path: str | Path, *, source: str, images_root: str | None, files_checked: bool) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.partial")
        self._tmp.unlink(missing_ok=True)
        self._writer = pq.ParquetWriter(self._tmp, SCHEMA, compression="zstd")
        self._rows: list[ImageEntry] = []
        self._digest = DigestHasher()
        self._last: int | None = None
        self.head: dict[str, Any] = {"format": FORMAT, "source": source, "images_root": images_root,
                                     "files_checked": files_checked, "images": 0, "captions": 0,
                                     "splits": dict.fromkeys(SPLITS, 0)}

    def add(self, e: ImageEntry) -> None:
        if self._last is not None and e.image_id <= self._last:
            raise ValueError(f"entries must come in increasing image-id order ({e.image_id} after {self._last})")
        self._last = e.image_id
        self._digest.add(e.image_id, e.file, e.split, e.captions, e.size, e.sha256)
        self.head["images"] += 1
        self.head["captions"] += len(e.captions)
        self.head["splits"][e.split] += 1
        self._rows.append(e)
        if len(self._rows) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(_table(self._rows, SCHEMA))
            self._rows = []

    def close(self, *, entries: int, rejected: Iterable[Rejection] = (), dropped_captions: Iterable[Rejection] = (),
              excluded: Iterable[Rejection] = ()) -> DatasetFile:
        self._flush()
        head = {**self.head, "digest": self._digest.hexdigest(), "entries": entries,
                "rejected": [rejection_dict(r) for r in rejected],
                "dropped_captions": [rejection_dict(r) for r in dropped_captions],
                "excluded": [rejection_dict(r) for r in excluded]}
        self._writer.add_key_value_metadata({META_KEY: json.dumps(head, ensure_ascii=False)})
        self._writer.close()
        self.path.unlink(missing_ok=True)  # a link planted at the name is removed, not written through
        self._tmp.replace(self.path)
        return DatasetFile(self.path)

    def abort(self) -> None:
        self._writer.close()
        self._tmp.unlink(missing_ok=True)


class DatasetFile:
    """A normalised dataset file, read by row group and column (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._pf = pq.ParquetFile(self.path)
            raw = (self._pf.metadata.metadata or {}).get(META_KEY.encode())
            head = json.loads(raw) if raw else {}
        except (OSError, pa.ArrowException, ValueError) as e:
            raise DatasetError(f"{self.path}: not a readable normalised capflow dataset ({e})") from None
        if not isinstance(head, dict) or head.get("format") != FORMAT or self._pf.schema_arrow.names != SCHEMA.names:
            raise DatasetError(f"{self.path}: not a normalised capflow dataset (format "
                               f"{head.get('format') if isinstance(head, dict) else None!r})")
        self.head = head
        self._ids: np.ndarray | None = None  # entries_of: the id column, row-group ends, the last group read
        self._group_ends = np.zeros(0, np.int64)
        self._group: tuple[int, list[ImageEntry]] = (-1, [])

    digest = property(lambda self: self.head["digest"])
    source = property(lambda self: self.head["source"])
    images_root = property(lambda self: self.head["images_root"])
    files_checked = property(lambda self: self.head["files_checked"])
    entries = property(lambda self: self.head["entries"])
    num_images = property(lambda self: self.head["images"])
    num_captions = property(lambda self: self.head["captions"])

    rejected = property(lambda self: [Rejection(**r) for r in self.head["rejected"]])
    dropped_captions = property(lambda self: [Rejection(**r) for r in self.head["dropped_captions"]])
    excluded = property(lambda self: [Rejection(**r) for r in self.head["excluded"]])

    def summary(self) -> dict[str, Any]:
        return dataset_summary(self.num_images, self.num_captions, self.head["splits"], self.rejected,
                               self.dropped_captions, len(self.head["excluded"]), self.files_checked, self.digest)

    def batches(self, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
        """The file row group by row group (``columns``: only these)."""
        for g in range(self._pf.num_row_groups):
            yield from self._pf.read_row_group(g, columns=list(columns) if columns else None).to_batches()

    def image_path(self, entry: ImageEntry) -> Path:
        if self.images_root is None:
            raise DatasetError("this dataset has no images root (annotations only)")
        return Path(self.images_root) / entry.file

    def entries_of(self, image_ids: Sequence[int] | np.ndarray) -> list[ImageEntry]:
        """The entries of ``image_ids`` (KeyError naming an id the dataset does not have), found by binary search
        in the id column and read a row group at a time (the last one kept: ids asked for in order, as a feature
        store's chunks ask, read each row group once). Memory: the id column (8 bytes an image) and one group."""
        if self._ids is None:
            self._ids = self.column("image_id")
            self._group_ends = np.cumsum([self._pf.metadata.row_group(g).num_rows
                                          for g in range(self._pf.num_row_groups)])
        q = np.asarray(image_ids, np.int64)
        pos = np.minimum(np.searchsorted(self._ids, q), max(len(self._ids) - 1, 0))
        found = self._ids[pos] == q if len(self._ids) else np.zeros(len(q), bool)
        if not found.all():
            raise KeyError(int(q[np.flatnonzero(~found)[0]]))
        out = []
        for p, g in zip(pos.tolist(), np.searchsorted(self._group_ends, pos, side="right").tolist(), strict=True):
            if self._group[0] != g:
                b = self._pf.read_row_group(g)
                self._group = (g, [ImageEntry(*row) for row in zip(*(b.column(n).to_pylist() for n in SCHEMA.names),
                                                                    strict=True)])
            out.append(self._group[1][p - (int(self._group_ends[g - 1]) if g else 0)])
        return out

    def iter_entries(self, split: str | None = None) -> Iterator[ImageEntry]:
        for b in self.batches():
            cols = [b.column(name).to_pylist() for name in SCHEMA.names]
            for row in zip(*cols, strict=True):
                if split is None or row[2] == split:
                    yield ImageEntry(*row)

    def captions(self, split: str | None = None) -> Iterator[list[str]]:
        """Every caption's words (of one split), a row group at a time."""
        for b in self.batches(("split", "captions")):
            for s, caps in zip(b.column(0).to_pylist(), b.column(1).to_pylist(), strict=True):
                if split is None or s == split:
                    for c in caps:
                        yield c.split()

    def column(self, name: str) -> np.ndarray:
        """A scalar column for every image: ``image_id``/``size`` as int64, ``split`` as its int8 code,
        ``captions`` as the number of captions."""
        parts = []
        for b in self.batches((name,)):
            col = b.column(0)
            if name == "split":
                parts.append(np.fromiter((SPLIT_CODES[s] for s in col.to_pylist()), np.int8, len(col)))
            elif name == "captions":
                parts.append(np.diff(col.offsets.to_numpy()).astype(np.int64))
            else:
                parts.append(col.to_numpy())
        return np.concatenate(parts) if parts else np.zeros(0, np.int8 if name == "split" else np.int64)


class RunWriter:
    """Candidates of an ingest in bounded, sorted runs: ``add`` until :attr:`full`, then ``write`` (after the
    caller has checked the batch's files) - one temporary Parquet file per run in ``folder``."""

    def __init__(self, folder: Path, run_rows: int) -> None:
        self.folder, self.run_rows = folder, run_rows
        self.pending: list[tuple[int, ImageEntry]] = []  # (entry index, entry)
        self.paths: list[Path] = []
        self.bounds: list[tuple[tuple[int, int], tuple[int, int]]] = []  # each run's first and last (id, entry)

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.run_rows

    def add(self, idx: int, e: ImageEntry) -> None:
        self.pending.append((idx, e))

    def write(self, kept: Callable[[int, ImageEntry], bool] = lambda idx, e: True) -> None:
        """Sort the pending candidates by (image id, entry) and write those ``kept`` says to keep."""
        rows = sorted(((idx, e) for idx, e in self.pending if kept(idx, e)), key=lambda r: (r[1].image_id, r[0]))
        self.pending = []
        if rows:
            path = self.folder / f"run-{len(self.paths):05d}.parquet"
            table = _table([e for _, e in rows], _RUN_SCHEMA, [idx for idx, _ in rows])
            # small row groups: the merge reads one group of every run at a time, so memory is runs x group
            atomic_write(path, lambda f: pq.write_table(table, f, compression="zstd", row_group_size=MERGE_BATCH),
                         "ingest run")
            self.paths.append(path)
            self.bounds.append(((rows[0][1].image_id, rows[0][0]), (rows[-1][1].image_id, rows[-1][0])))

    def merged(self) -> Iterator[ImageEntry]:
        """Every run's entries in (image id, entry) order: :func:`merge_runs` with the runs' bounds."""
        return merge_runs(self.paths, self.bounds)


class FirstSeen:
    """image id -> the entry index where it was first seen, for finding repeated ids while entries stream: the ids
    folded into sorted numpy arrays (16 bytes an id; a dict of millions would take ~100), the latest in a small
    dict."""

    def __init__(self, fold_every: int = 65_536) -> None:
        self.fold_every = fold_every
        self._ids = np.zeros(0, np.int64)
        self._idx = np.zeros(0, np.int64)
        self._recent: dict[int, int] = {}

    def first(self, image_id: int, idx: int) -> int:
        """Where ``image_id`` was first seen: ``idx`` itself when it is new (and from now on remembered)."""
        hit = self._recent.get(image_id)
        if hit is not None:
            return hit
        k = int(np.searchsorted(self._ids, image_id))
        if k < len(self._ids) and self._ids[k] == image_id:
            return int(self._idx[k])
        self._recent[image_id] = idx
        if len(self._recent) >= self.fold_every:
            self._fold()
        return idx

    def _fold(self) -> None:
        """The recent ids into the sorted arrays: only they are sorted; the arrays take them by one merge (a
        copy of what is held, not a sort of it)."""
        n = len(self._recent)
        new = np.fromiter(self._recent.keys(), np.int64, n)
        new_idx = np.fromiter(self._recent.values(), np.int64, n)
        order = np.argsort(new, kind="stable")
        new, new_idx = new[order], new_idx[order]
        at = np.searchsorted(self._ids, new)  # an id is new here: never equal to one already held
        self._ids, self._idx = np.insert(self._ids, at, new), np.insert(self._idx, at, new_idx)
        self._recent.clear()


def _run_rows(path: Path) -> Iterator[tuple[int, int, ImageEntry]]:
    pf = pq.ParquetFile(path)
    for b in pf.iter_batches(batch_size=MERGE_BATCH):
        cols = [b.column(name).to_pylist() for name in _RUN_SCHEMA.names]
        for row in zip(*cols, strict=True):
            yield row[0], row[-1], ImageEntry(*row[:-1])


def _overlapping(bounds: Sequence[tuple[tuple[int, int], tuple[int, int]]]) -> list[list[int]]:
    """The runs in groups whose key ranges overlap, the groups in key order: runs of input already in id order
    (img2dataset's shards, keys increasing) are each their own group and are read one after another, no heap."""
    groups: list[list[int]] = []
    last: tuple[int, int] | None = None
    for k in sorted(range(len(bounds)), key=lambda k: bounds[k][0]):
        lo, hi = bounds[k]
        if groups and last is not None and lo <= last:
            groups[-1].append(k)
            last = max(last, hi)
        else:
            groups.append([k])
            last = hi
    return groups


def merge_runs(paths: Sequence[Path], bounds: Sequence[tuple[tuple[int, int], tuple[int, int]]] | None = None
               ) -> Iterator[ImageEntry]:
    """The runs' entries in (image id, entry) order. With each run's first and last key (``bounds``), runs whose
    ranges overlap no other are streamed as they are, the others merged group by group."""
    groups = [list(range(len(paths)))] if bounds is None else _overlapping(bounds)
    for g in groups:
        if len(g) == 1:
            rows: Iterator[tuple[int, int, ImageEntry]] = _run_rows(paths[g[0]])
        else:
            rows = heapq.merge(*(_run_rows(paths[k]) for k in g), key=lambda r: (r[0], r[1]))
        for _, _, e in rows:
            yield e
