"""Dataset preparation steps as plain functions of their plans (:mod:`captioning.data.plans`): ingest, vocabulary +
label store, imports.

These are what the CLI and the pipeline's tasks call; they know nothing about Prefect, MLflow or the pipeline
config.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from PIL import Image

from captioning.config import SyntheticConfig
from captioning.data.karpathy import SPLIT_CODES, Dataset, DatasetError, read_karpathy
from captioning.data.plans import IngestPlan, VocabPlan
from captioning.data.stores import FeatureStore, LabelStore
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
    """Read + validate the plan's dataset (generating the synthetic one if no annotations are set)."""
    d = plan.dataset
    if d.annotations is None:
        ann, images = synthetic_dataset(d.synthetic, plan.synthetic_dir, progress)
    else:
        ann, images = Path(d.annotations), (Path(d.images) if d.images else None)
    ds = read_karpathy(
        ann, images, max_words=d.max_words, restval_split=d.restval_split, image_check=d.image_check,
        max_reject_fraction=d.max_reject_fraction, hash_workers=d.hash_workers or min(4, usable_cpus()),
        hash_cache=plan.hash_cache, progress=progress,
    )
    counts = {s: len(ds.split(s)) for s in ("train", "val", "test")}
    missing = [s for s in ("train", "val", "test") if not counts.get(s)]
    if missing:  # the pipeline validates on val and scores on test: fail now, not after extraction and training
        raise DatasetError(
            f"{ann}: no usable images in the {' and '.join(missing)} split{'s' if len(missing) > 1 else ''} "
            f"(usable images per split: {', '.join(f'{s} {counts.get(s, 0)}' for s in ('train', 'val', 'test'))}). "
            "capflow trains on train, validates on val and scores on test: give every split images (Karpathy "
            "'split' field; dataset.restval_split moves 'restval' images)")
    return ds


@dataclass
class LabelResult:
    vocab_path: Path
    labels_uri: str
    vocab: Vocabulary
    captions: int


def build_labels(
    ds: Dataset, vocab: Vocabulary, uri: str, max_words: int, image_rows: dict[int, int] | None = None,
    overwrite: bool = True,
) -> LabelStore:
    """Write the ground-truth label store. ``image_rows`` maps image id -> feature-store row (default: the
    dataset's own order, which is the order a feature store built from it uses)."""
    if image_rows is None:
        image_rows = {e.image_id: i for i, e in enumerate(ds.images)}
    missing = {e.image_id for e in ds.images if e.image_id not in image_rows}
    if missing:
        raise DatasetError(f"{len(missing)} images have no feature-store row, e.g. {sorted(missing)[:5]}")
    n = len(ds.images)
    per_image = np.fromiter((len(e.captions) for e in ds.images), np.int64, n)
    m = int(per_image.sum())
    rows = np.repeat(np.fromiter((image_rows[e.image_id] for e in ds.images), np.int32, n), per_image)
    ids = np.repeat(np.fromiter((e.image_id for e in ds.images), np.int64, n), per_image)
    split = np.repeat(np.fromiter((SPLIT_CODES[e.split] for e in ds.images), np.int8, n), per_image)
    tokens = np.zeros((m, max_words), np.int32)
    length = np.zeros(m, np.int16)
    k = 0
    block = 4096  # images per pass: the words of a block as Python strings at a time, not those of the dataset
    for b in range(0, n, block):
        words = [c.split()[:max_words] for e in ds.images[b: b + block] for c in e.captions]
        lens = np.fromiter(map(len, words), np.int64, len(words))
        flat = vocab.encode_flat(chain.from_iterable(words), int(lens.sum()))
        at = np.repeat(np.arange(k, k + len(words)), lens)
        tokens[at, np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)] = flat
        length[k: k + len(words)] = lens
        k += len(words)
    return LabelStore.create(
        uri, tokens, length, rows, ids, split, overwrite=overwrite,
        attrs={"dataset_digest": ds.digest, "vocab_digest": vocab.digest()},
    )


def vocab_and_labels(plan: VocabPlan, ds: Dataset, out: str | Path, image_rows: dict[int, int] | None = None
                     ) -> LabelResult:
    """Vocabulary from the train split -> ``<out>/vocab.json`` and ``<out>/labels.zarr``."""
    if not any(e.captions for e in ds.images if e.split == "train"):
        raise DatasetError("the dataset has no train captions to build a vocabulary from")
    # counted as they are split (a list of every train caption's words would be the largest object of the stage)
    vocab = build_vocabulary(ds.captions("train"), plan.min_count, plan.radix_base)
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


def image_sizes(ds: Dataset) -> dict[int, tuple[int, int]]:
    """(height, width) of each dataset image whose file can be opened (header only)."""
    out: dict[int, tuple[int, int]] = {}
    if ds.images_root is None:
        return out
    for e in ds.images:
        p = Path(ds.images_root) / e.file
        try:
            with Image.open(p) as im:
                out[e.image_id] = (im.height, im.width)
        except OSError:
            continue
    return out
