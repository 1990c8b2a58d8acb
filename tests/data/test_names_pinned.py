"""Stores keep their names and digests across refactors: the names capflow gives a feature store (extracted with
each detector flavour, synthetic-informative, imported from the npy layout or another format) and the digests of
a small synthetic dataset, its feature store and its label store, pinned at 0b63113. A change here means every
existing workdir's stores would be made again: it must come with a migration note, never by accident."""

from __future__ import annotations

from pathlib import Path

import pytest

from captioning.config import load_config
from captioning.data.plans import extract_plan, ingest_plan, vocab_plan
from captioning.data.prepare import ingest, vocab_and_labels
from captioning.data.stores import LabelStore
from captioning.data.synthetic_features import informative_store_for

PINNED_NAMES = {
    "stock": "91bd54012a45a799.zarr",
    "airsplay": "044454e0f97b5cac.zarr",
    "milvlg": "d7d62bb7636a7ce7.zarr",
    "informative": "informative-83fbcd02fcb7056e.zarr",
}


@pytest.mark.parametrize("name, overrides", [("stock", []), ("airsplay", ["features.extractor.flavour=airsplay"]),
                                             ("milvlg", ["features.extractor.flavour=milvlg"]),
                                             ("informative", ["features.source=synthetic-informative"])])
def test_extracted_store_names_are_pinned(name, overrides):
    from captioning.features.parallel import store_uri

    cfg = load_config("tiny", overrides=["run.workdir=/w", *overrides])
    assert Path(store_uri(extract_plan(cfg))).name == PINNED_NAMES[name]


def test_imported_store_names_are_pinned():
    from captioning.data.imports import ImportSpec
    from captioning.features.naming import imported_uri
    from captioning.features.parallel import imported_store_uri

    cfg = load_config("tiny", overrides=["run.workdir=/w"])
    assert Path(imported_store_uri(extract_plan(cfg), "/a/att", "/a/box", [1, 2, 3])).name == \
        "imported-d3804c7ddd8362f7.zarr"
    spec = ImportSpec(format="butd-tsv", path=Path("/a/f.tsv"))
    assert imported_uri("/w/features", spec.ident(), [1, 2, 3], {"max_boxes": 36}).rsplit("/", 1)[1] == \
        "imported-0ceab2447017c25d.zarr"


def test_dataset_feature_and_label_store_digests_are_pinned(tmp_path):
    cfg = load_config("learning", overrides=[f"run.workdir={tmp_path}", "dataset.synthetic.num_images=24"])
    ds = ingest(ingest_plan(cfg))
    store = informative_store_for(extract_plan(cfg), ds, str(tmp_path / "f.zarr"))
    labels = vocab_and_labels(vocab_plan(cfg), ds, tmp_path / "v")
    assert ds.digest == "4ab24a44266892b1af2ea2b93d65bb06dd3a70dabe6784716e13f3671e83af84"
    assert store.manifest()["digest"] == "cdf23fa8391ab867fe8fcff5e5d58003658dda14ff62fa50816e3ccdbe49396b"
    assert LabelStore.open(labels.labels_uri).digest() == \
        "62ed0d07e7401cc1a989843f31ac72ff1f70882d5715bc431305a29b4de96187"


@pytest.mark.parametrize("chunk", [7, 64])
def test_a_label_store_written_chunk_by_chunk_is_the_one_written_whole(tmp_path, chunk):
    """``build_labels`` streams: the dataset file read a row group at a time, the store written a chunk of rows at
    a time. Whatever the chunk (a few rows: many writes, a remainder held over between blocks), the values and the
    digest are those of the pinned store, and every chunk's checksum verifies."""
    import numpy as np

    from captioning.data.columnar import DatasetFile
    from captioning.data.prepare import build_labels
    from captioning.data.text import Vocabulary

    cfg = load_config("learning", overrides=[f"run.workdir={tmp_path}", "dataset.synthetic.num_images=24"])
    ds = ingest(ingest_plan(cfg))
    whole = LabelStore.open(vocab_and_labels(vocab_plan(cfg), ds, tmp_path / "v").labels_uri)
    f = DatasetFile(ds.save(tmp_path / "d.parquet"))
    vocab = Vocabulary.load(tmp_path / "v" / "vocab.json")
    rows = {int(i): k for k, i in enumerate(f.column("image_id"))}
    streamed = build_labels(f, vocab, str(tmp_path / "s.zarr"), cfg.dataset.max_words, rows, chunk=chunk)
    assert streamed.digest() == whole.digest() == "62ed0d07e7401cc1a989843f31ac72ff1f70882d5715bc431305a29b4de96187"
    a, b = whole.read(), streamed.read()
    assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("tokens", "length", "image_row", "image_id"))
    assert streamed.group["tokens"].chunks[0] == chunk and not streamed.verify().faults
