"""Training batches from a feature source + the label store.

Reading is block-wise: a *block* is a run of consecutive rows read in one call (for a Zarr store, one row
chunk). Each epoch shuffles the block order, splits blocks over DataLoader workers, and feeds the images of
each block through a shuffle buffer, so reads stay sequential while batches are well mixed. Stores are opened
lazily, inside the process that reads them (fsspec/s3fs and some codecs are not fork-safe).

Three interchangeable feature sources share that machinery, so they can be compared like for like:
:class:`ZarrFeatures` (the capflow store), :class:`NpyFeatures` (one ``.npy`` file per image, the layout of
most captioning repositories: ``att/{id}.npy`` N x 2048 and ``box/{id}.npy`` N x 4) and
:class:`MemoryFeatures` (arrays already in RAM: the upper limit).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from captioning import stopping
from captioning.data.karpathy import SPLIT_CODES
from captioning.data.stores import OK, FeatureStore, Labels, LabelStore
from captioning.data.text import BOS, EOS, PAD, RadixCodec


# ---------------------------------------------------------------------- feature sources
@dataclass
class Rows:
    """Features of some images: per image a (n_i, D) array and a (n_i, 4) box array."""

    rows: np.ndarray
    image_ids: np.ndarray
    features: list[np.ndarray]
    boxes: list[np.ndarray]


class FeatureSource:
    """Where region features come from. Subclasses open their storage lazily, per process."""

    def __init__(self) -> None:
        self._pid: int | None = None

    def _ensure_open(self) -> None:
        if self._pid != os.getpid():
            self._open()
            self._pid = os.getpid()

    def _open(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __getstate__(self) -> dict:
        # never ship open handles to another process
        state = self.__dict__.copy()
        state["_pid"] = None
        for k in self._handles:
            state[k] = None
        return state

    _handles: tuple[str, ...] = ()

    def num_rows(self) -> int:
        raise NotImplementedError

    def ok_rows(self) -> np.ndarray:
        """Rows with usable features."""
        raise NotImplementedError

    def blocks(self, rows: np.ndarray) -> list[np.ndarray]:
        """Group sorted rows into read blocks."""
        raise NotImplementedError

    def read(self, rows: np.ndarray) -> Rows:
        raise NotImplementedError


def region_stats(source: FeatureSource, rows: np.ndarray, *, max_images: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension mean and standard deviation of the real regions of ``rows`` (float64), for feature
    standardisation. More than ``max_images`` rows: an evenly spaced subset of that many (deterministic)."""
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    if not len(rows):
        raise ValueError("no rows to compute region-feature statistics from")
    if len(rows) > max_images:
        rows = rows[np.linspace(0, len(rows) - 1, max_images).round().astype(np.int64)]
    total = sq = None
    n = 0
    for block in source.blocks(rows):
        feats = [f for f in source.read(block).features if len(f)]
        if not feats:
            continue
        x = np.concatenate(feats).astype(np.float64)
        total = x.sum(0) if total is None else total + x.sum(0)
        sq = (x * x).sum(0) if sq is None else sq + (x * x).sum(0)
        n += len(x)
    if n == 0:
        raise ValueError("the rows have no regions to compute feature statistics from")
    mean = total / n
    return mean, np.sqrt(np.maximum(sq / n - mean * mean, 0.0))


class ZarrFeatures(FeatureSource):
    """Reads blocks of ``block_chunks`` consecutive row chunks with one call per array (Zarr fetches and decodes
    the chunks of one call concurrently), only up to the block's largest box count, and copies each image's
    real boxes out so that the shuffle buffer never pins whole decoded blocks in memory."""

    _handles = ("_store", "_ids", "_status", "_num_boxes")

    def __init__(self, uri: str, block_chunks: int = 8):
        super().__init__()
        self.uri = uri
        self.block_chunks = block_chunks
        self._store: FeatureStore | None = None
        self._ids: np.ndarray | None = None
        self._status: np.ndarray | None = None
        self._num_boxes: np.ndarray | None = None

    def _open(self) -> None:
        self._store = FeatureStore.open(self.uri)
        self._ids = self._store.image_ids()
        self._status = self._store.status()
        self._num_boxes = self._store.num_boxes()

    @property
    def store(self) -> FeatureStore:
        self._ensure_open()
        assert self._store is not None
        return self._store

    def num_rows(self) -> int:
        return self.store.num_rows

    def image_ids(self) -> np.ndarray:
        self._ensure_open()
        return self._ids

    def ok_rows(self) -> np.ndarray:
        self._ensure_open()
        return np.flatnonzero(self._status == OK)

    def blocks(self, rows: np.ndarray) -> list[np.ndarray]:
        c = self.store.chunk_rows * self.block_chunks
        rows = np.sort(rows)
        cut = np.flatnonzero(np.diff(rows // c)) + 1
        return np.split(rows, cut) if len(rows) else []

    def read(self, rows: np.ndarray) -> Rows:
        self._ensure_open()
        start, stop = int(rows[0]), int(rows[-1]) + 1
        nb = self._num_boxes[rows]
        width = max(int(nb.max()), 1)
        feats, boxes = self.store.read_features(start, stop, width)
        local = rows - start
        return Rows(
            rows=rows,
            image_ids=self._ids[rows],
            features=[feats[i, :n].copy() for i, n in zip(local, nb, strict=True)],
            boxes=[boxes[i, :n].copy() for i, n in zip(local, nb, strict=True)],
        )


class _ListedRows(FeatureSource):
    """A source whose rows are a given list of image ids, every row usable, read in fixed-size blocks."""

    def __init__(self, image_ids: Sequence[int], block_rows: int):
        super().__init__()
        self.ids = np.asarray(image_ids, dtype=np.int64)
        self.block_rows = block_rows

    def _open(self) -> None:
        pass

    def num_rows(self) -> int:
        return len(self.ids)

    def image_ids(self) -> np.ndarray:
        return self.ids

    def ok_rows(self) -> np.ndarray:
        return np.arange(len(self.ids))

    def blocks(self, rows: np.ndarray) -> list[np.ndarray]:
        rows = np.sort(rows)
        return [rows[i : i + self.block_rows] for i in range(0, len(rows), self.block_rows)]


class NpyFeatures(_ListedRows):
    """Per-image ``.npy`` files: ``att_dir/{id}.npy`` (N x D float32) and ``box_dir/{id}.npy`` (N x 4)."""

    def __init__(self, att_dir: str | Path, box_dir: str | Path, image_ids: Sequence[int], block_rows: int = 8,
                 dtype: str = "float16"):
        super().__init__(image_ids, block_rows)
        self.att_dir, self.box_dir = Path(att_dir), Path(box_dir)
        self.dtype = np.dtype(dtype)

    def read(self, rows: np.ndarray) -> Rows:
        ids = self.ids[rows]
        feats = [np.load(self.att_dir / f"{i}.npy").astype(self.dtype, copy=False) for i in ids]
        boxes = [np.load(self.box_dir / f"{i}.npy").astype(np.float32, copy=False) for i in ids]
        return Rows(rows=rows, image_ids=ids, features=feats, boxes=boxes)


class MemoryFeatures(_ListedRows):
    """Padded arrays held in memory (same layout as the store): the throughput limit for the loader."""

    def __init__(self, features: np.ndarray, boxes: np.ndarray, num_boxes: np.ndarray, image_ids: np.ndarray,
                 block_rows: int = 8):
        super().__init__(image_ids, block_rows)
        self.features, self.boxes, self.num_boxes = features, boxes, np.asarray(num_boxes, np.int64)

    def read(self, rows: np.ndarray) -> Rows:
        nb = self.num_boxes[rows]
        return Rows(
            rows=rows,
            image_ids=self.ids[rows],
            features=[self.features[r, :n] for r, n in zip(rows, nb, strict=True)],
            boxes=[self.boxes[r, :n] for r, n in zip(rows, nb, strict=True)],
        )


# ---------------------------------------------------------------------- batches
@dataclass
class Batch:
    """A padded training batch. ``tokens`` hold [BOS, w_1..w_n, EOS, PAD...] per caption."""

    features: torch.Tensor  # (B, R, D) float16/float32
    boxes: torch.Tensor  # (B, R, 4) float32
    region_mask: torch.Tensor  # (B, R) bool, True = a real region
    tokens: torch.Tensor  # (B, C, T) int64
    token_mask: torch.Tensor  # (B, C, T) bool, True = a real token (incl. BOS/EOS)
    image_ids: torch.Tensor  # (B,) int64
    rows: torch.Tensor  # (B,) int64 rows of the feature store

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in (
            self.features, self.boxes, self.region_mask, self.tokens, self.token_mask, self.image_ids, self.rows)))

    def pin_memory(self) -> Batch:
        """Page-locked copies (what ``DataLoader(pin_memory=True)`` calls): ``to(cuda, non_blocking=True)`` from
        them is an asynchronous copy the host does not wait for."""
        return Batch(*(t.pin_memory() for t in (
            self.features, self.boxes, self.region_mask, self.tokens, self.token_mask, self.image_ids, self.rows)))

    def __len__(self) -> int:
        return self.features.shape[0]


def collate(samples: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]) -> Batch:
    """Samples (row, image_id, features (n, D), boxes (n, 4), tokens (C, T)) -> one padded Batch."""
    b = len(samples)
    r = max(max(s[2].shape[0] for s in samples), 1)
    d = samples[0][2].shape[1]
    feats = np.zeros((b, r, d), dtype=samples[0][2].dtype)
    boxes = np.zeros((b, r, 4), dtype=np.float32)
    mask = np.zeros((b, r), dtype=bool)
    toks = np.stack([s[4] for s in samples])
    for i, (_, _, f, bx, _) in enumerate(samples):
        n = f.shape[0]
        feats[i, :n] = f
        boxes[i, :n] = bx
        mask[i, :n] = True
    tok = torch.from_numpy(toks.astype(np.int64))
    return Batch(
        features=torch.from_numpy(feats),
        boxes=torch.from_numpy(boxes),
        region_mask=torch.from_numpy(mask),
        tokens=tok,
        token_mask=tok != PAD,
        image_ids=torch.tensor([s[1] for s in samples], dtype=torch.int64),
        rows=torch.tensor([s[0] for s in samples], dtype=torch.int64),
    )


def caption_matrix(labels: Labels, codec: RadixCodec | None = None) -> np.ndarray:
    """All captions as model targets [BOS, tokens..., EOS, PAD...] (word ids, or radix digits with ``codec``)."""
    words = labels.tokens
    m, length = words.shape
    if codec is None:
        out = np.zeros((m, length + 2), dtype=np.int32)
        out[:, 0] = BOS
        out[:, 1 : length + 1] = words
        out[np.arange(m), labels.length + 1] = EOS
        return out
    digits = codec.word_ids_to_digits(words)
    d = codec.digits
    out = np.zeros((m, length * d + 2), dtype=np.int32)
    out[:, 0] = codec.bos
    out[:, 1 : length * d + 1] = digits
    out[np.arange(m), labels.length * d + 1] = codec.eos
    return out


class CaptionDataset(IterableDataset):
    """Yields (row, image_id, features, boxes, tokens) samples: one per image, ``captions_per_image`` captions.

    An image with fewer captions than asked for repeats some (sampled with replacement); one with more gets a
    random subset each epoch. Deterministic for a given (seed, epoch, worker count).
    """

    def __init__(
        self,
        source: FeatureSource,
        labels_uri: str | None = None,
        *,
        labels: Labels | None = None,
        split: str = "train",
        captions_per_image: int = 5,
        shuffle: bool = True,
        shuffle_buffer: int = 256,
        seed: int = 0,
        codec: RadixCodec | None = None,
        sources: Sequence[int] | None = None,
    ):
        if labels is None and labels_uri is None:
            raise ValueError("give labels_uri or labels")
        self.source = source
        self.labels_uri = labels_uri
        self._labels = labels
        self.split = split
        self.captions_per_image = captions_per_image
        self.shuffle = shuffle
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.codec = codec
        self.sources = None if sources is None else list(sources)
        self.epoch = 0
        self._index: tuple[np.ndarray, dict[int, np.ndarray], np.ndarray] | None = None
        self._index_pid: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_index"] = None
        state["_index_pid"] = None
        if self.labels_uri is not None:
            state["_labels"] = None  # re-read lazily in the worker
        return state

    def _build_index(self) -> tuple[np.ndarray, dict[int, np.ndarray], np.ndarray]:
        if self._index is not None and self._index_pid == os.getpid():
            return self._index
        labels = self._labels if self._labels is not None else LabelStore.open(self.labels_uri).read()
        keep = labels.split == SPLIT_CODES[self.split]
        if self.sources is not None:
            keep &= np.isin(labels.source, self.sources)
        labels = labels.select(keep)
        ids = self.source.image_ids()
        rows_ok = self.source.ok_rows()
        valid = labels.image_row < len(ids)
        if not np.all(valid) or not np.array_equal(ids[labels.image_row[valid]], labels.image_id[valid]):
            raise ValueError(
                "label store and feature store disagree on image rows (was the label store built for this store?)"
            )
        targets = caption_matrix(labels, self.codec)
        order = np.argsort(labels.image_row, kind="stable")
        rows_sorted = labels.image_row[order]
        uniq, starts = np.unique(rows_sorted, return_index=True)
        groups = np.split(order, starts[1:]) if len(order) else []
        by_row = {int(r): g for r, g in zip(uniq, groups, strict=True)}
        rows = np.intersect1d(uniq, rows_ok)
        self._index = (rows, by_row, targets)
        self._index_pid = os.getpid()
        return self._index

    def rows(self) -> np.ndarray:
        return self._build_index()[0]

    def __len__(self) -> int:
        return len(self.rows())

    def __iter__(self) -> Iterator[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
        rows, by_row, targets = self._build_index()
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        rng = np.random.default_rng([self.seed, self.epoch, wid])
        blocks = self.source.blocks(rows)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(blocks)) if self.shuffle else \
            np.arange(len(blocks))
        mine = [blocks[i] for i in order[wid::nw]]
        c = self.captions_per_image
        buffer: list = []
        for block in mine:
            got = self.source.read(block)
            for r, iid, f, bx in zip(got.rows, got.image_ids, got.features, got.boxes, strict=True):
                caps = by_row[int(r)]
                pick = rng.choice(caps, size=c, replace=len(caps) < c) if self.shuffle else np.resize(caps, c)
                sample = (int(r), int(iid), f, bx, targets[pick])
                if not self.shuffle:
                    yield sample
                    continue
                if len(buffer) < self.shuffle_buffer:
                    buffer.append(sample)
                    continue
                j = int(rng.integers(len(buffer)))
                yield buffer[j]
                buffer[j] = sample
        if self.shuffle:
            rng.shuffle(buffer)
        yield from buffer


def make_loader(dataset: CaptionDataset, batch_size: int, workers: int = 0, drop_last: bool = False,
                pin_memory: bool = False) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate,
        drop_last=drop_last,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=4 if workers else None,
    )


def image_batches(source: FeatureSource, rows: np.ndarray, batch_size: int) -> Iterator[Batch]:
    """The images of ``rows`` (in order, read block-wise) as padded batches without captions (decoding,
    distillation, evaluation). ``tokens`` is an empty (B, 1, 1) padding tensor. A stop request
    (:mod:`captioning.stopping`) ends it before the next batch: evaluation, SeqKD and latency runs stop there."""
    rows = np.asarray(rows, dtype=np.int64)
    pending: list = []
    empty = np.zeros((1, 1), np.int64)
    for block in source.blocks(np.sort(rows)):
        got = source.read(block)
        for r, iid, f, bx in zip(got.rows, got.image_ids, got.features, got.boxes, strict=True):
            pending.append((int(r), int(iid), f, bx, empty))
            if len(pending) == batch_size:
                stopping.check("decoding")
                yield collate(pending)
                pending = []
    if pending:
        stopping.check("decoding")
        yield collate(pending)
