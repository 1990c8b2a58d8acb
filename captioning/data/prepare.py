"""Dataset preparation steps as plain functions of their plans (:mod:`captioning.data.plans`): ingest, vocabulary +
label store, imports.

These are what the CLI and the pipeline's tasks call; they know nothing about Prefect, MLflow or the pipeline
config.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from PIL import Image

from captioning.config import SyntheticConfig
from captioning.data.columnar import DatasetFile
from captioning.data.karpathy import SPLIT_CODES, Dataset, DatasetError, ImageEntry, image_ids_of, ingest_karpathy
from captioning.data.plans import IngestPlan, VocabPlan
from captioning.data.stores import FeatureStore, LabelStore
from captioning.data.tar_members import MemberError, MemberRef, read_member
from captioning.data.text import Vocabulary, build_vocabulary
from captioning.util import atomic_write, usable_cpus

log = logging.getLogger(__name__)


def synthetic_dataset(s: SyntheticConfig, out: Path, progress: bool = False) -> tuple[Path, Path]:
    """Generate (once) the synthetic dataset ``s`` into ``out``; returns (annotations JSON, images root)."""
    from captioning.data.synthetic import generate_synthetic

    ann = out / "dataset.json"
    done = out / ".complete"
    if not done.exists():
        log.info("generating %d synthetic images into %s", s.num_images, out)
        ann = generate_synthetic(
            out, s.num_images, s.seed, min_size=s.min_size, max_size=s.max_size, max_objects=s.max_objects,
            png_fraction=s.png_fraction, val_fraction=s.val_fraction, test_fraction=s.test_fraction,
            progress=progress,
        )
        marker = json.dumps(s.model_dump()).encode("utf-8")
        atomic_write(done, lambda f: f.write(marker), "synthetic dataset marker")
    return ann, out / "images"


def ingest(plan: IngestPlan, progress: bool = False) -> Dataset:
    """:func:`ingest_file` into a temporary file, read back whole (small datasets, tests)."""
    with tempfile.TemporaryDirectory(prefix="capflow-dataset-") as tmp:
        return Dataset.from_file(ingest_file(plan, Path(tmp) / "dataset.parquet", progress))


def _karpathy_input(plan: IngestPlan, out: Path, progress: bool) -> tuple[Path, DatasetFile]:
    d = plan.dataset
    if d.annotations is None:
        ann, images = synthetic_dataset(d.synthetic, plan.synthetic_dir, progress)
    else:
        ann, images = Path(d.annotations), (Path(d.images) if d.images else None)
    return ann, ingest_karpathy(
        ann, images, out, max_words=d.max_words, restval_split=d.restval_split, image_check=d.image_check,
        max_reject_fraction=d.max_reject_fraction, hash_workers=d.hash_workers or min(4, usable_cpus()),
        hash_cache=plan.hash_cache, progress=progress,
    )


def _webdataset_input(plan: IngestPlan, out: Path, progress: bool) -> tuple[Path, DatasetFile]:
    from captioning.data.shards import ingest_webdataset

    d = plan.dataset
    root = Path(d.images or ".")
    return root, ingest_webdataset(
        root, out, shards=d.shards.files, metadata=d.shards.metadata, val_images=d.shards.val_images,
        test_images=d.shards.test_images, max_split_fraction=d.shards.max_split_fraction, max_words=d.max_words,
        image_check=d.image_check, max_reject_fraction=d.max_reject_fraction,
        hash_workers=d.hash_workers or min(4, usable_cpus()), hash_cache=plan.hash_cache, progress=progress)


# dataset.format -> the reader of that input: (what it read, the normalised dataset file it wrote)
INPUT_FORMATS: dict[str, Callable[[IngestPlan, Path, bool], tuple[Path, DatasetFile]]] = {
    "karpathy": _karpathy_input,  # a Karpathy JSON + images root, or the synthetic dataset
    "webdataset": _webdataset_input,  # img2dataset tar shards (+ Parquet metadata): captioning.data.shards
}


def ingest_file(plan: IngestPlan, out: str | Path, progress: bool = False) -> DatasetFile:
    """Read + validate the plan's dataset (generating the synthetic one if no annotations are set) into the
    normalised dataset file ``out``, streaming."""
    source, f = INPUT_FORMATS[plan.dataset.format](plan, Path(out), progress)
    counts = f.head["splits"]
    missing = [s for s in ("train", "val", "test") if not counts.get(s)]
    if missing:  # the pipeline validates on val and scores on test: fail now, not after extraction and training
        f.path.unlink()
        raise DatasetError(
            f"{source}: no usable images in the {' and '.join(missing)} split{'s' if len(missing) > 1 else ''} "
            f"(usable images per split: {', '.join(f'{s} {counts.get(s, 0)}' for s in ('train', 'val', 'test'))}). "
            "capflow trains on train, validates on val and scores on test: give every split images (Karpathy "
            "'split' field, dataset.restval_split for 'restval' images; dataset.shards.val_images/test_images "
            "for shards)")
    return f


@dataclass
class LabelResult:
    vocab_path: Path
    labels_uri: str
    vocab: Vocabulary
    captions: int


def build_labels(
    ds: Dataset | DatasetFile, vocab: Vocabulary, uri: str, max_words: int, image_rows: dict[int, int] | None = None,
    overwrite: bool = True, chunk: int = 65536,
) -> LabelStore:
    """Write the ground-truth label store. ``image_rows`` maps image id -> feature-store row (default: the
    dataset's own order, which is the order a feature store built from it uses). The dataset is read entry by entry
    and the store written a chunk of rows at a time: memory holds a block of captions, not the label arrays."""
    if image_rows is not None:
        missing = [int(i) for i in image_ids_of(ds) if int(i) not in image_rows]
        if missing:
            raise DatasetError(f"{len(missing)} images have no feature-store row, e.g. {sorted(missing)[:5]}")
    store = LabelStore.allocate(uri, ds.num_captions, max_words, overwrite=overwrite, chunk=chunk,
                                attrs={"dataset_digest": ds.digest, "vocab_digest": vocab.digest()})
    written = 0
    parts: list[tuple[np.ndarray, ...]] = []  # encoded blocks not yet written (less than a chunk of rows)
    held = 0

    def write(final: bool) -> None:
        nonlocal written, held, parts
        if not parts:
            return
        cols = [np.concatenate(c) for c in zip(*parts, strict=True)]
        n = held if final else held - held % store.chunk_rows  # whole chunks until the last write
        store.write_rows(written, *(c[:n] for c in cols))
        written += n
        parts = [tuple(c[n:] for c in cols)] if n < held else []
        held -= n

    block: list[tuple[int, ImageEntry]] = []  # (row, entry): a block's words as Python strings, not the dataset's

    def encode() -> None:
        nonlocal held
        words = [c.split()[:max_words] for _, e in block for c in e.captions]
        lens = np.fromiter(map(len, words), np.int64, len(words))
        flat = vocab.encode_flat(chain.from_iterable(words), int(lens.sum()))
        tokens = np.zeros((len(words), max_words), np.int32)
        tokens[np.repeat(np.arange(len(words)), lens), np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)] \
            = flat
        per = np.fromiter((len(e.captions) for _, e in block), np.int64, len(block))
        parts.append((tokens, lens.astype(np.int16),
                      np.repeat(np.asarray([r for r, _ in block], np.int32), per),
                      np.repeat(np.asarray([e.image_id for _, e in block], np.int64), per),
                      np.repeat(np.asarray([SPLIT_CODES[e.split] for _, e in block], np.int8), per)))
        held += len(words)
        block.clear()
        if held >= store.chunk_rows:
            write(final=False)

    for i, e in enumerate(ds.iter_entries()):
        block.append((i if image_rows is None else image_rows[e.image_id], e))
        if len(block) >= min(4096, chunk):
            encode()
    if block:
        encode()
    write(final=True)
    return store


def vocab_and_labels(plan: VocabPlan, ds: Dataset | DatasetFile, out: str | Path,
                     image_rows: dict[int, int] | None = None) -> LabelResult:
    """Vocabulary from the train split -> ``<out>/vocab.json`` and ``<out>/labels.zarr``."""
    # counted as they are split (a list of every train caption's words would be the largest object of the stage)
    vocab = build_vocabulary(ds.captions("train"), plan.min_count, plan.radix_base)
    if not vocab.words and not vocab.unk_count:
        raise DatasetError("the dataset has no train captions to build a vocabulary from")
    out = Path(out)
    vocab_path = vocab.save(out / "vocab.json")
    uri = str(out / "labels.zarr")
    store = build_labels(ds, vocab, uri, plan.max_words, image_rows)
    return LabelResult(vocab_path, store.uri, vocab, int(store.group["tokens"].shape[0]))


def import_npy_features(
    att_dir: str | Path,
    box_dir: str | Path,
    image_ids: list[int],
    uri: str,
    *,
    max_boxes: int = 100,
    feature_dim: int = 2048,
    chunk_rows: int = 8,
    dtype: str = "float16",
    compressor: str = "lz4",
    image_sizes: dict[int, tuple[int, int]] | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> FeatureStore:
    """Per-image ``.npy`` features (``att_dir/{id}.npy`` N x D, ``box_dir/{id}.npy`` N x 4 relative boxes)
    -> a feature store whose rows are ``image_ids`` (in that order; files of other images follow as rejected
    rows). Missing/malformed files are rejected rows with a reason, never silently dropped. The other formats:
    :mod:`captioning.data.imports`."""
    from captioning.data.imports.importer import import_source
    from captioning.data.imports.ruotianluo import RuotianluoSource

    att_dir, box_dir = Path(att_dir), Path(box_dir)
    source = RuotianluoSource(att_dir, box_dir, fmt="npy", boxes="relative")
    return import_source(source, uri, image_ids=image_ids, sizes=image_sizes, max_boxes=max_boxes,
                         feature_dim=feature_dim, chunk_rows=chunk_rows, dtype=dtype, compressor=compressor,
                         overwrite=overwrite, progress=progress,
                         attrs={"att_dir": str(att_dir), "box_dir": str(box_dir)}).store


def image_sizes(ds: Dataset | DatasetFile) -> dict[int, tuple[int, int]]:
    """(height, width) of each dataset image whose file can be opened (header only; an image inside a WebDataset
    shard is read from its checked byte range), the dataset streamed entry by entry."""
    out: dict[int, tuple[int, int]] = {}
    if ds.images_root is None:
        return out
    for e in ds.iter_entries():
        p = ds.image_path(e)
        try:
            ref = MemberRef.parse(p)
            with Image.open(p if ref is None else io.BytesIO(read_member(ref))) as im:
                out[e.image_id] = (im.height, im.width)
        except (OSError, MemberError):
            continue
    return out
