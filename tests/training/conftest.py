"""A tiny but real training context: the synthetic dataset, informative features, vocabulary and labels."""

from __future__ import annotations

import pytest
import torch

from captioning.config import load_config
from captioning.data.loader import ZarrFeatures
from captioning.data.plans import ingest_plan, vocab_plan
from captioning.data.prepare import ingest, vocab_and_labels
from captioning.data.synthetic_features import informative_store
from captioning.training.recipe import model_plan
from captioning.training.stages import StageContext
from captioning.workdir import Workdir


@pytest.fixture(scope="session")
def synth_parts(tmp_path_factory):
    """(cfg, dataset, vocab, labels_uri, features_uri) for 60 synthetic images, built once."""
    work = tmp_path_factory.mktemp("synth_ctx")
    cfg = load_config("tiny", overrides=[f"run.workdir={work}", "dataset.synthetic.num_images=60",
                                         "dataset.synthetic.val_fraction=0.15", "dataset.synthetic.test_fraction=0.15",
                                         "dataset.image_check=none", "loader.batch_size=8"])
    ds = ingest(ingest_plan(cfg))
    store = informative_store(ds, cfg.dataset.synthetic, str(work / "features.zarr"), feature_dim=24, max_boxes=12,
                              chunk_rows=8)
    lab = vocab_and_labels(vocab_plan(cfg), ds, Workdir.of(cfg).stage_dir("vocab", ds.digest))
    return cfg, ds, lab.vocab_path, lab.labels_uri, store.uri


@pytest.fixture
def synth_ctx(synth_parts, tmp_path):
    """A fresh StageContext over a private copy of the label store (tests may add SeqKD sources)."""
    import shutil

    cfg, ds, vocab_path, labels_uri, features_uri = synth_parts
    labels = tmp_path / "labels.zarr"
    shutil.copytree(labels_uri, labels)
    torch.manual_seed(0)
    ctx = StageContext.from_paths(model_plan(cfg, "teacher"), vocab_path, str(labels), features_uri, ds)
    assert isinstance(ctx.source, ZarrFeatures)
    ctx.cfg = cfg  # the config the plan came from: the tests build their own settings from it
    return ctx
