"""The scale bench's synthetic COCO-shaped data (per size N, written once, not timed).

``captions_per_image`` captions per image (5 = COCO-shaped, the default; 1 = Conceptual-Captions-shaped) whose
lengths follow the Karpathy test references' length histogram (:data:`LENGTHS`) and whose words follow a
Zipf-Mandelbrot law fitted to them (:data:`ZIPF`); one tiny real JPEG per image; a feature store of every image
ingest keeps (in image-id order, the normalised dataset's order) whose regions are the embeddings of its first
caption's words plus noise. Planted faults (:data:`PLANTED`) make the reject paths run.

Two inputs (``input``): ``karpathy`` = a Karpathy-format annotation file with Karpathy-style splits and the image
files below ``images/``; ``shards`` = WebDataset tar shards as img2dataset writes them (``shards/NNNNN.tar``,
:data:`SHARD_SAMPLES` samples each, ``{key:09d}.jpg`` + ``{key:09d}.txt`` - the first caption - and, with more
than one caption, ``{key:09d}.json`` ``{"captions": [the others]}``), the key being the image id; shards carry no
split: ingest assigns val and test by a hash of the image id (:data:`SHARD_SPLITS`), which the generator
reproduces (:func:`captioning.data.shards.assign_splits`) for its expected counts.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from captioning.bench.scale.measure import tree_bytes

COCO_IMAGES = 123_287  # Karpathy's dataset_coco.json: images (616,767 captions)
HELD_OUT_FRACTION = 5000 / COCO_IMAGES  # Karpathy's val and test split: 5000 images each
CAPTIONS_PER_IMAGE = 5  # the default: COCO-shaped (1 = Conceptual-Captions-shaped)
INPUTS = ("karpathy", "shards")
SHARD_SAMPLES = 10_000  # samples per tar shard (img2dataset's default)
# the shards' val/test assignment the bench configures (dataset.shards; these are its defaults)
SHARD_SPLITS = {"val_images": 5000, "test_images": 5000, "max_split_fraction": 0.1}
# caption lengths (words) of the 25,010 Karpathy test references: length -> count
LENGTHS = {6: 2, 7: 218, 8: 4031, 9: 5510, 10: 5438, 11: 3861, 12: 2435, 13: 1411, 14: 823, 15: 450, 16: 277,
           17: 178, 18: 107, 19: 65, 20: 53, 21: 40, 22: 30, 23: 23, 24: 12, 25: 11, 26: 5, 27: 1, 28: 4, 29: 5}
# word frequencies p(rank r) ~ (r + q)^-s over a 40,000-word lexicon, fitted to the Karpathy test references:
# top-10 words 35% of tokens (real: 37%), 7.2k distinct words in 25k captions (real: 7.2k), ~10.9k words seen
# >= 5 times at COCO's 617k captions (Karpathy's vocabulary: 9,487)
ZIPF = {"words": 40_000, "s": 1.65, "q": 10.0}
# planted faults: every n-th image file empty (rejected at ingest), caption blank (dropped at ingest), feature-store
# row rejected (an image the extractor could not use)
PLANTED = {"bad_image_every": 500, "blank_caption_every": 1000, "rejected_row_every": 997}

_STEP = 2048  # images per annotation/feature step

__all__ = ["CAPTIONS_PER_IMAGE", "COCO_IMAGES", "HELD_OUT_FRACTION", "INPUTS", "LENGTHS", "PLANTED", "SHARD_SAMPLES",
           "SHARD_SPLITS", "ZIPF", "generate", "held_out", "image_id", "lexicon", "word_probabilities"]


def lexicon(words: int = ZIPF["words"]) -> list[str]:
    """Pronounceable pseudo-words, shortest for the most frequent ranks (syllable strings in rank order)."""
    syl = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    out: list[str] = []
    length = 1
    while len(out) < words:
        for k in range(len(syl) ** length):
            parts = []
            for _ in range(length):
                k, d = divmod(k, len(syl))
                parts.append(syl[d])
            out.append("".join(parts))
            if len(out) == words:
                break
        length += 1
    return out


def word_probabilities() -> np.ndarray:
    r = np.arange(1, ZIPF["words"] + 1, dtype=np.float64)
    p = (r + ZIPF["q"]) ** -ZIPF["s"]
    return p / p.sum()


def held_out(n: int) -> int:
    """Images in each of val and test at ``n`` images (COCO's proportion; at least 1)."""
    return max(1, round(n * HELD_OUT_FRACTION))


def image_id(i: np.ndarray | int):
    """COCO-like sparse, increasing image ids."""
    return 9 + 4 * i


def _jpeg_pool(count: int = 32) -> list[tuple[bytes, int, int]]:
    """Tiny distinct JPEG files (bytes, height, width)."""
    from PIL import Image

    rng = np.random.default_rng(7)
    pool = []
    for k in range(count):
        h, w = 24 + k % 5, 32 + k % 7
        arr = np.full((h, w, 3), rng.integers(0, 256, 3), np.uint8)
        arr[rng.integers(0, h, 8), rng.integers(0, w, 8)] = rng.integers(0, 256, (8, 3))
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=80)
        pool.append((buf.getvalue(), h, w))
    return pool


def _captions(rng: np.random.Generator, count: int, cdf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``count`` captions' word ranks: (flat ranks, lengths)."""
    lens = np.fromiter(LENGTHS, np.int64)
    p = np.fromiter(LENGTHS.values(), np.float64)
    lengths = rng.choice(lens, size=count, p=p / p.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), len(cdf) - 1)
    return ranks, lengths


@dataclass
class _Layout:
    """Which image goes where: its split, whether its file is a planted empty one, its feature-store row."""

    split: np.ndarray  # object array of split names (the Karpathy input's; shards carry none)
    bad: np.ndarray  # bool: planted empty image file
    no_caption: np.ndarray  # bool: every caption of the image is a planted blank one (ingest rejects it)
    kept: np.ndarray  # indices of the images ingest keeps (the feature store's rows, in order)
    row_of_image: np.ndarray  # feature-store row of each image, -1 for one ingest rejects


def _layout(rng: np.random.Generator, n: int, held: int, rates: Mapping[str, int], per_image: int) -> _Layout:
    order = rng.permutation(n)
    split = np.where(rng.random(n) < 0.27, "restval", "train").astype(object)
    split[order[:held]] = "val"
    split[order[held: 2 * held]] = "test"
    every = rates["bad_image_every"]
    bad = (np.arange(n) % every) == every - 1
    # caption k of image i has sentid i * per_image + k; sentid s is blank when (s + 1) % blank_every == 0
    blank_every = rates["blank_caption_every"]
    first = np.arange(n, dtype=np.int64) * per_image
    blanks = (first + per_image) // blank_every - first // blank_every
    no_caption = blanks == per_image
    kept = np.flatnonzero(~bad & ~no_caption)
    row_of_image = np.full(n, -1, np.int64)
    row_of_image[kept] = np.arange(len(kept))
    return _Layout(split, bad, no_caption, kept, row_of_image)


class _RowWriter:
    """Buffers feature-store rows and writes them to every store in whole-chunk blocks (the rest at the end)."""

    def __init__(self, stores: list, block: int, max_boxes: int) -> None:
        self.stores = stores
        self.block = block  # feature rows per write: whole chunks
        self.max_boxes = max_boxes
        self.written = 0
        self.pending: dict[str, list] = {"features": [], "boxes": [], "num_boxes": [], "image_size": [],
                                         "status": [], "reject_reason": []}

    def add(self, **parts: Any) -> None:
        for k, v in parts.items():
            self.pending[k].append(v)

    def flush(self, final: bool) -> None:
        pending = self.pending
        have = sum(len(x) for x in pending["num_boxes"])
        take = have if final else (have // self.block) * self.block
        if take == 0:
            return
        cat = {k: (np.concatenate(v) if k != "reject_reason" else [r for part in v for r in part])
               for k, v in pending.items()}
        for st in self.stores:
            st.write_rows(self.written, features=cat["features"][:take], boxes=cat["boxes"][:take],
                          num_boxes=cat["num_boxes"][:take], image_size=cat["image_size"][:take],
                          status=cat["status"][:take], reject_reason=cat["reject_reason"][:take])
        self.written += take
        for k in pending:
            pending[k] = [cat[k][take:]] if take < have else []


class _KarpathySink:
    """The Karpathy input: ``annotations.json`` (written entry by entry) and the image files below ``images/``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("train2014", "val2014"):
            (root / "images" / sub).mkdir(parents=True, exist_ok=True)
        self.ann: IO[str] = open(root / "annotations.json", "w", encoding="utf-8")  # noqa: SIM115 - closed in close
        self.ann.write('{"dataset": "coco", "images": [\n')
        self.first = True

    def add(self, i: int, iid: int, split: str, data: bytes, sents: list[dict[str, Any]]) -> None:
        sub = "val2014" if split in ("val", "test") else "train2014"
        name = f"COCO_{sub}_{iid:012d}.jpg"
        (self.root / "images" / sub / name).write_bytes(data)
        entry = {"filepath": sub, "filename": name, "imgid": i, "split": split,
                 "sentids": [x["sentid"] for x in sents], "sentences": sents, "cocoid": iid}
        self.ann.write(("" if self.first else ",\n") + json.dumps(entry))
        self.first = False

    def close(self) -> dict[str, int]:
        self.ann.write("\n]}\n")
        self.ann.close()
        return {"annotation_bytes": (self.root / "annotations.json").stat().st_size}


class _ShardSink:
    """The WebDataset input: ``shards/NNNNN.tar``, :data:`SHARD_SAMPLES` samples each, written as a stream (the
    tar file's member list is dropped after every member: memory stays flat in N)."""

    def __init__(self, root: Path, per_shard: int = SHARD_SAMPLES) -> None:
        self.folder = root / "shards"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.per_shard = per_shard
        self.tar: tarfile.TarFile | None = None
        self.in_shard = self.shards = 0

    def _member(self, name: str, data: bytes) -> None:
        assert self.tar is not None
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
        self.tar.addfile(info, io.BytesIO(data))
        self.tar.members = []  # TarFile keeps every member it wrote otherwise

    def add(self, i: int, iid: int, split: str, data: bytes, sents: list[dict[str, Any]]) -> None:
        if self.tar is None or self.in_shard == self.per_shard:
            if self.tar is not None:
                self.tar.close()
            path = self.folder / f"{self.shards:05d}.tar"
            self.tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 - closed in add/close
            self.shards += 1
            self.in_shard = 0
        key = f"{iid:09d}"
        self._member(f"{key}.jpg", data)
        self._member(f"{key}.txt", sents[0]["raw"].encode("utf-8"))
        if len(sents) > 1:
            self._member(f"{key}.json", json.dumps({"captions": [x["raw"] for x in sents[1:]]}).encode("utf-8"))
        self.in_shard += 1

    def close(self) -> dict[str, int]:
        if self.tar is not None:
            self.tar.close()
        return {"shards": self.shards, "shard_bytes": tree_bytes(self.folder)}


class _DatasetWriter:
    """Streams one size's images and captions (into a sink: :class:`_KarpathySink` or :class:`_ShardSink`) and
    feature rows, ``_STEP`` images at a time, keeping the running counts."""

    def __init__(self, rng: np.random.Generator, lay: _Layout, rates: Mapping[str, int], per_image: int,
                 embed: np.ndarray, rows: _RowWriter) -> None:
        self.rng, self.lay, self.rates, self.per_image, self.embed, self.rows = rng, lay, rates, per_image, embed, rows
        self.words = lexicon()
        self.cdf = np.cumsum(word_probabilities())
        self.pool = _jpeg_pool()
        self.captions = self.blank = self.kept_captions = self.sentid = self.store_rejects = 0

    def write(self, sink: _KarpathySink | _ShardSink, n: int) -> None:
        c = self.per_image
        for s in range(0, n, _STEP):
            idx = np.arange(s, min(s + _STEP, n))
            ranks, lengths = _captions(self.rng, len(idx) * c, self.cdf)
            ends = np.cumsum(lengths)
            starts = ends - lengths
            feat_rows: list[tuple[int, np.ndarray, int, int]] = []
            for j, i in enumerate(idx.tolist()):
                spans = [ranks[starts[k]: ends[k]] for k in range(j * c, (j + 1) * c)]
                self.image(sink, i, spans, feat_rows)
            self.feature_rows(feat_rows)

    def image(self, sink: _KarpathySink | _ShardSink, i: int, spans: list[np.ndarray], feat_rows: list) -> None:
        """Write image ``i``'s file and captions (``spans``: each caption's word ranks) to ``sink``; adds
        ``(i, first caption's ranks, h, w)`` to ``feat_rows`` when ingest keeps the image."""
        lay = self.lay
        data, h, w = self.pool[i % len(self.pool)]
        sents = []
        for span in spans:
            toks = [self.words[t] for t in span]
            if (self.sentid + 1) % self.rates["blank_caption_every"] == 0:
                raw, toks = " . ", []
                self.blank += 1
            else:
                raw = (toks[0].capitalize() + " " + " ".join(toks[1:])).strip() + "."
                self.kept_captions += int(not lay.bad[i])
            sents.append({"tokens": toks, "raw": raw, "imgid": i, "sentid": self.sentid})
            self.sentid += 1
        self.captions += len(spans)
        if lay.row_of_image[i] >= 0:
            feat_rows.append((i, spans[0], h, w))
        sink.add(i, int(image_id(i)), str(lay.split[i]), b"" if lay.bad[i] else data, sents)

    def feature_rows(self, feat_rows: list[tuple[int, np.ndarray, int, int]]) -> None:
        """Feature rows of a step's kept images: regions = embeddings of the first caption's words + noise."""
        from captioning.data.stores import OK, REJECTED

        m = len(feat_rows)
        if not m:
            return
        rng, boxes_max, dim = self.rng, self.rows.max_boxes, self.embed.shape[1]
        nb = rng.integers(min(10, boxes_max), boxes_max + 1, size=m).astype(np.int16)
        cap0 = np.zeros((m, boxes_max), np.int64)
        for r, (_, rk, _, _) in enumerate(feat_rows):
            cap0[r] = np.resize(rk, boxes_max)
        feats = self.embed[cap0] + np.float32(0.1) * rng.standard_normal((m, boxes_max, dim), dtype=np.float32)
        feats[np.arange(boxes_max)[None, :] >= nb[:, None]] = 0
        xy = rng.random((m, boxes_max, 2), dtype=np.float32) * np.float32(0.6)
        bx = np.concatenate([xy, xy + np.float32(0.1) + rng.random((m, boxes_max, 2), dtype=np.float32)
                             * np.float32(0.3)], -1)
        bx[np.arange(boxes_max)[None, :] >= nb[:, None]] = 0
        rows = self.lay.row_of_image[[i for i, *_ in feat_rows]]
        every = self.rates["rejected_row_every"]
        status = np.where(rows % every == every - 1, REJECTED, OK).astype(np.int8)
        self.store_rejects += int((status == REJECTED).sum())
        self.rows.add(features=feats, boxes=bx, num_boxes=nb,
                      image_size=np.array([(h, w) for *_, h, w in feat_rows], np.int32), status=status,
                      reject_reason=["bench: planted reject" if x == REJECTED else "" for x in status])
        self.rows.flush(final=False)


def _create_stores(params: Mapping[str, Any], root: Path, kept: np.ndarray, dim: int, max_boxes: int,
                   chunk_rows: int) -> list:
    from captioning.data.stores import FeatureStore

    uris = [str(root / "features.zarr")] + ([params["s3_features"]] if params.get("s3_features") else [])
    return [FeatureStore.create(u, image_id(kept), max_boxes=max_boxes, feature_dim=dim, chunk_rows=chunk_rows,
                                dtype=params.get("dtype", "float16"), compressor="lz4", overwrite=True,
                                attrs={"source": "bench-scale"}) for u in uris]


def _expected_splits(lay: _Layout, shards: bool) -> dict[str, np.ndarray]:
    """Boolean masks over the kept images: which ingest puts in val, in test, in train."""
    kept = lay.kept
    if shards:  # ingest's own hash-based assignment, on the same kept image ids
        from captioning.data.shards import assign_splits

        ids = np.asarray(image_id(kept), np.int64)
        val, test = assign_splits(ids, SHARD_SPLITS["val_images"], SHARD_SPLITS["test_images"],
                                  SHARD_SPLITS["max_split_fraction"])
        is_val = np.fromiter((int(x) in val for x in ids), bool, len(ids))
        is_test = np.fromiter((int(x) in test for x in ids), bool, len(ids))
    else:
        is_val, is_test = lay.split[kept] == "val", lay.split[kept] == "test"
    return {"val": is_val, "test": is_test, "train": ~is_val & ~is_test}


def generate(params: Mapping[str, Any]) -> dict[str, Any]:
    """Write the size-``images`` dataset under ``root`` (``input`` karpathy: annotations.json + images/; shards:
    shards/*.tar; both: features.zarr, and the same store at ``s3_features`` when given) with
    ``captions_per_image`` captions per image; returns the expected counts. Streams: memory stays flat in N."""
    root = Path(params["root"])
    n, dim, max_boxes = int(params["images"]), int(params["dim"]), int(params["max_boxes"])
    chunk_rows = int(params["chunk_rows"])
    per_image = int(params.get("captions_per_image", CAPTIONS_PER_IMAGE))
    kind = params.get("input", "karpathy")
    if kind not in INPUTS or per_image < 1:
        raise ValueError(f"input must be one of {INPUTS} and captions_per_image >= 1, got {kind!r}, {per_image}")
    rng = np.random.default_rng([int(params.get("seed", 0)), n])
    embed = rng.standard_normal((ZIPF["words"], dim), dtype=np.float32)  # one vector per lexicon word
    held = held_out(n)
    rates = {k: int(params.get(k, v)) for k, v in PLANTED.items()}
    lay = _layout(rng, n, held, rates, per_image)
    stores = _create_stores(params, root, lay.kept, dim, max_boxes, chunk_rows)
    rows = _RowWriter(stores, chunk_rows * max(1, 4096 // chunk_rows), max_boxes)
    out = _DatasetWriter(rng, lay, rates, per_image, embed, rows)
    sink = _ShardSink(root, int(params.get("shard_samples", SHARD_SAMPLES))) if kind == "shards" else \
        _KarpathySink(root)
    try:
        out.write(sink, n)
    finally:
        files = sink.close()
    rows.flush(final=True)
    kept = lay.kept
    assert rows.written == len(kept)
    every = rates["rejected_row_every"]
    splits = _expected_splits(lay, kind == "shards")
    ok_row = np.arange(len(kept)) % every != every - 1
    return {"images": n, "input": kind, "captions_per_image": per_image, "kept": len(kept),
            "bad_images": int(lay.bad.sum()), "no_caption_images": int((lay.no_caption & ~lay.bad).sum()),
            "rejected": n - len(kept), "captions": out.captions, "blank_captions": out.blank,
            "kept_captions": out.kept_captions, "held_out": held if kind == "karpathy" else int(splits["val"].sum()),
            "val": int(splits["val"].sum()), "test": int(splits["test"].sum()),
            "train_ok_rows": int(np.sum(splits["train"] & ok_row)), "store_rows": len(kept),
            "store_rejects": out.store_rejects, **files, "store_bytes": tree_bytes(root / "features.zarr")}
