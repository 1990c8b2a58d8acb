"""From config to the data stages: what ingest, extraction and the vocabulary stage read, resolved once.

The data-side counterpart of :mod:`captioning.training.recipe`: the stage functions
(:func:`captioning.data.prepare.ingest` / ``vocab_and_labels``, :func:`captioning.features.parallel.extract_features`
/ ``prepare_store``, :func:`captioning.data.synthetic_features.informative_store_for`) take these plans and data,
never the pipeline config; the pipeline's jobs, the CLI and the benchmarks build them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from captioning.config import DatasetConfig, FeaturesConfig, PipelineConfig, SyntheticConfig
from captioning.workdir import Workdir


@dataclass(frozen=True)
class IngestPlan:
    """The dataset to read (``dataset`` section) and where ingest keeps its files."""
    dataset: DatasetConfig
    synthetic_dir: Path  # the generated synthetic dataset (no dataset.annotations), named by its settings
    hash_cache: Path  # image sha256 cache (size + mtime)


@dataclass(frozen=True)
class VocabPlan:
    """The vocabulary and label store's settings."""
    min_count: int
    radix_base: int
    max_words: int


@dataclass(frozen=True)
class ExtractPlan:
    """What extraction reads: the ``features`` section, the folder holding the stores, the weights cache, the run
    store (images for workers that share nothing with this machine), and what names a synthetic-informative store."""
    features: FeaturesConfig
    store_folder: str  # features.store, else <run.store>/features, else <workdir>/features
    weights_cache: Path
    run_store: str | None
    synthetic: SyntheticConfig  # the synthetic dataset's settings (names an informative store)
    synthetic_dataset: bool  # the dataset is the synthetic one (dataset.format karpathy, dataset.annotations unset)
    seed: int


def ingest_plan(cfg: PipelineConfig) -> IngestPlan:
    w = Workdir.of(cfg)
    return IngestPlan(dataset=cfg.dataset, synthetic_dir=w.synthetic(cfg.digest("dataset.synthetic")),
                      hash_cache=w.file_hashes())


def vocab_plan(cfg: PipelineConfig) -> VocabPlan:
    return VocabPlan(min_count=cfg.vocab.min_count, radix_base=cfg.vocab.radix_base,
                     max_words=cfg.dataset.max_words)


def extract_plan(cfg: PipelineConfig) -> ExtractPlan:
    return ExtractPlan(features=cfg.features, store_folder=cfg.feature_store_uri(),
                       weights_cache=Workdir.of(cfg).weights_cache(), run_store=cfg.run.store,
                       synthetic=cfg.dataset.synthetic,
                       synthetic_dataset=cfg.dataset.annotations is None and cfg.dataset.format == "karpathy",
                       seed=cfg.run.seed)
