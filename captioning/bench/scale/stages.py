"""The scale bench's library stages and its stage registry (:data:`STAGES`).

Each stage function is called in a fresh process (:func:`captioning.bench.scale.measure.child`) with the size's
parameters and returns its counts (``outputs``: paths whose bytes are the stage's output); a :class:`Stage` names
it as ``module:function``. The pipeline-side stages are ``tasks.bench_scale``'s and ``flows.bench_prefect``'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["STAGES", "Stage", "stage_cider", "stage_coco_eval", "stage_digests", "stage_extract_plan", "stage_ingest",
           "stage_loader", "stage_names", "stage_planted_quadratic", "stage_region_stats", "stage_vocab"]


def _config(p: Mapping[str, Any]):
    """The pipeline config of the size's data: its Karpathy annotations + image files, or (``input`` shards) its
    WebDataset shards (``dataset.format=webdataset``, the val/test assignment the generator expects)."""
    from captioning.bench.scale.data import SHARD_SPLITS
    from captioning.config import PipelineConfig

    # the planted empty files are 0.2% by default; tests plant more
    if p.get("input", "karpathy") == "shards":
        dataset = {"format": "webdataset", "images": p["shards_root"], "max_reject_fraction": 0.05,
                   "shards": {"files": ["*.tar"], **SHARD_SPLITS}}
    else:
        dataset = {"annotations": p["annotations"], "images": p["images_root"], "max_reject_fraction": 0.05}
    return PipelineConfig.model_validate({"run": {"workdir": p["out"]}, "dataset": dataset})


def stage_ingest(p: Mapping[str, Any]) -> dict[str, Any]:
    """What the ingest job does without MLflow: read + validate + hash (``prepare.ingest``), then write the
    normalised dataset and its reject list into the workdir."""
    from captioning.data.plans import ingest_plan
    from captioning.data.prepare import ingest_file
    from captioning.workdir import Workdir

    cfg = _config(p)
    wd = Workdir.of(cfg)
    f = ingest_file(ingest_plan(cfg), wd.dataset_partial())
    path = wd.dataset(f.digest)
    f.path.replace(path)
    summary = f.summary()
    rejects = {"rejected": summary["rejected"], "dropped_captions": summary["dropped_captions"],
               "excluded": summary["excluded"]}
    wd.rejects(f.digest).write_text(json.dumps(rejects, indent=1, ensure_ascii=False), encoding="utf-8")
    link = Path(p["out"]) / "dataset.path"
    link.write_text(str(path), encoding="utf-8")
    splits = f.head["splits"]
    return {"images": summary["images"], "captions": summary["captions"], "rejected": len(summary["rejected"]),
            "dropped_captions": len(summary["dropped_captions"]), "entries": f.entries,
            "splits": {k: int(splits.get(k, 0)) for k in ("train", "val", "test")}, "outputs": [p["out"]]}


def _dataset_path(p: Mapping[str, Any]) -> str:
    return Path(p["ingest_out"], "dataset.path").read_text(encoding="utf-8")


def stage_vocab(p: Mapping[str, Any]) -> dict[str, Any]:
    """The vocab job without MLflow: the dataset (streamed), the feature store's row index, vocabulary + label
    store (``vocab_and_labels``), the label store's digest."""
    from captioning.data.karpathy import open_dataset
    from captioning.data.prepare import vocab_and_labels
    from captioning.data.stores import FeatureStore, LabelStore

    ds = open_dataset(_dataset_path(p))
    rows = FeatureStore.open(p["features"]).row_of()
    from captioning.data.plans import vocab_plan

    res = vocab_and_labels(vocab_plan(_config(p)), ds, p["out"], rows)
    digest = LabelStore.open(res.labels_uri).digest()
    return {"words": len(res.vocab.words), "label_rows": res.captions, "digest": digest[:16], "outputs": [p["out"]]}


def _labels_uri(p: Mapping[str, Any]) -> str:
    return str(Path(p["vocab_out"]) / "labels.zarr")


def stage_region_stats(p: Mapping[str, Any]) -> dict[str, Any]:
    """Region-feature statistics of the training split, as ``fit_xe`` computes them (label store -> train rows ->
    ``region_stats``, which samples at most 4096 images)."""
    from captioning.data.loader import ZarrFeatures, region_stats
    from captioning.data.stores import LabelStore
    from captioning.training.recipe import split_rows

    labels = LabelStore.open(_labels_uri(p)).read()
    src = ZarrFeatures(p["features"])
    rows = split_rows(labels, "train", src.ok_rows())
    mean, sd = region_stats(src, rows)
    return {"train_rows": len(rows), "sampled_rows": int(min(len(rows), 4096)),
            "mean_abs": float(np.abs(mean).mean()), "sd_mean": float(sd.mean())}


def stage_loader(p: Mapping[str, Any]) -> dict[str, Any]:
    """One training epoch of the train split through ``CaptionDataset`` + ``make_loader`` (batch 50, the data's
    captions per image, shuffled, in-process), from the feature store at ``p['features']`` (local or s3://)."""
    from captioning.data.loader import CaptionDataset, ZarrFeatures, make_loader

    ds = CaptionDataset(ZarrFeatures(p["features"]), _labels_uri(p), split="train",
                        captions_per_image=int(p.get("captions_per_image", 5)), shuffle=True, seed=0)
    images = batches = regions = 0
    for batch in make_loader(ds, batch_size=50):
        images += len(batch)
        batches += 1
        regions += int(batch.region_mask.sum())
    return {"epoch_images": images, "batches": batches, "regions": regions}


def stage_cider(p: Mapping[str, Any]) -> dict[str, Any]:
    """SCST's reward set-up as ``fit_scst`` does it (label store, streamed -> train references -> ``ScstLoss``,
    which builds CIDEr-D's document frequencies and reference vectors), then 20 reward batches of 50 images x 5
    samples (the samples: other training images' references)."""
    from captioning.data.stores import LabelStore
    from captioning.data.text import EOS, Vocabulary
    from captioning.training.recipe import references
    from captioning.training.scst import ScstLoss

    t0 = time.perf_counter()
    vocab = Vocabulary.load(Path(p["vocab_out"]) / "vocab.json")
    refs = references(LabelStore.open(_labels_uri(p)), vocab, "train", spill=True)  # as fit_scst builds them
    t_refs = time.perf_counter() - t0
    loss = ScstLoss(refs, samples=5)
    t_df = time.perf_counter() - t0 - t_refs
    n_img = len(refs)
    rng = np.random.default_rng(0)
    t1 = time.perf_counter()
    scored = 0
    for _ in range(20):
        imgs = refs.image_ids[rng.integers(0, n_img, 50)].tolist()
        others = rng.integers(0, n_img, 250)
        first = refs.token_offsets[refs.caption_offsets[others]]
        ends = refs.token_offsets[refs.caption_offsets[others] + 1]
        cands = [np.asarray([*refs.tokens[a:b].tolist(), EOS], np.int64) for a, b in zip(first, ends, strict=True)]
        scores = loss.cider.score_batch(cands, [i for i in imgs for _ in range(5)])
        scored += len(scores)
    return {"train_images": n_img, "ngrams": int(loss.cider.table_size), "references_seconds": t_refs,
            "df_seconds": t_df, "batch_ms": (time.perf_counter() - t1) / 20 * 1000, "scored": scored}


def stage_coco_eval(p: Mapping[str, Any]) -> dict[str, Any]:
    """pycocoevalcap (BLEU, METEOR, ROUGE-L, CIDEr; SPICE needs CoreNLP, not here) on the test split: each test
    image's result is the first reference of the next test image. The test split grows with N here (COCO's
    proportion: 5000 images at 123,287)."""
    from captioning.data.karpathy import open_dataset
    from captioning.metrics.coco import close_meteor, score

    test = list(open_dataset(_dataset_path(p)).iter_entries("test"))
    refs = {e.image_id: list(e.captions) for e in test}
    results = {e.image_id: test[(k + 1) % len(test)].captions[0] for k, e in enumerate(test)}
    out = score(results, refs, metrics=("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"))
    close_meteor()
    return {"test_images": out["images"], "CIDEr": out["metrics"].get("CIDEr"),
            "METEOR": out["metrics"].get("METEOR")}


def stage_digests(p: Mapping[str, Any]) -> dict[str, Any]:
    """The lineage digests a pipeline run computes: the dataset's (recomputed over the normalised dataset file,
    streamed, as ``capflow verify`` does), the feature store's manifest digest (ids, status, attributes, chunk
    checksums) and the label store's."""
    from captioning.data.karpathy import file_digest
    from captioning.data.stores import FeatureStore, LabelStore

    t0 = time.perf_counter()
    d = file_digest(_dataset_path(p))
    t1 = time.perf_counter()
    m = FeatureStore.open(p["features"]).manifest()
    t2 = time.perf_counter()
    lab = LabelStore.open(_labels_uri(p)).digest()
    t3 = time.perf_counter()
    return {"dataset_digest_seconds": t1 - t0, "manifest_seconds": t2 - t1, "labels_digest_seconds": t3 - t2,
            "dataset_digest": d[:16], "features_digest": m["digest"][:16], "labels_digest": lab[:16]}


def stage_extract_plan(p: Mapping[str, Any]) -> dict[str, Any]:
    """What extraction holds to plan its work, without the detector: every chunk of the feature store planned as
    ``extract_features`` plans a pending one (its (image id, path) items from the streamed dataset file, made as
    tasks are taken), items counted and dropped."""
    from captioning.data.karpathy import open_dataset
    from captioning.data.stores import FeatureStore
    from captioning.features.parallel import iter_chunks

    ds = open_dataset(_dataset_path(p))
    store = FeatureStore.open(p["features"])
    chunks = items = 0
    for _, planned in iter_chunks(store, ds, range(store.num_chunks)):
        chunks += 1
        items += len(planned)
    return {"chunks": chunks, "items": items}


def stage_planted_quadratic(p: Mapping[str, Any]) -> dict[str, Any]:
    """Self-check of the fit: all pairs of N items compared in a Python loop (O(N^2); 2,000 items take ~0.1 s)."""
    k = max(2, int(p["images"]))
    items = list(range(k))
    pairs = 0
    for i in items:
        for j in items[:i]:
            pairs += (i ^ j) & 1
    return {"items": k, "pairs": k * (k - 1) // 2, "odd_pairs": pairs}


@dataclass(frozen=True)
class Stage:
    """One measured stage: ``func`` (``module:function``, called with the size's parameters in a fresh process
    after ``imports`` are loaded) returns its counts (``outputs``: paths whose bytes are the stage's output)."""

    name: str
    func: str
    what: str
    imports: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # stages whose outputs it reads
    s3: bool = False  # reads the feature store on the S3 endpoint
    default: bool = True  # run when no stages are named
    data: bool = True  # reads the generated data set
    out_of: str | None = None  # works in this stage's output folder instead of its own (a second pass over it)


_M = "captioning.bench.scale.stages"
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("ingest", f"{_M}:stage_ingest", "parse + validate + hash images (cold hash cache) + write the dataset file",
          ("captioning.data.prepare", "captioning.data.shards")),
    Stage("ingest-warm", f"{_M}:stage_ingest", "ingest again, image hashes cached (what every pipeline run pays)",
          ("captioning.data.prepare", "captioning.data.shards"), needs=("ingest",), out_of="ingest"),
    Stage("vocab", f"{_M}:stage_vocab", "vocabulary + label store + its digest", ("captioning.data.prepare",),
          needs=("ingest",)),
    Stage("region-stats", f"{_M}:stage_region_stats", "training-split region statistics (<= 4096 images)",
          ("captioning.data.loader", "captioning.training.recipe"), needs=("vocab",)),
    Stage("loader", f"{_M}:stage_loader", "one epoch of the train split, local Zarr store, batch 50",
          ("captioning.data.loader",), needs=("vocab",)),
    Stage("loader-s3", f"{_M}:stage_loader", "one epoch of the train split, store on the S3 endpoint (moto)",
          ("captioning.data.loader", "s3fs"), needs=("vocab",), s3=True),
    Stage("cider", f"{_M}:stage_cider", "SCST rewards: train references, CIDEr-D df + vectors, 20 batches 50x5",
          ("captioning.training.scst", "captioning.training.recipe"), needs=("vocab",)),
    Stage("coco-eval", f"{_M}:stage_coco_eval", "pycocoevalcap BLEU/METEOR/ROUGE-L/CIDEr on the test split",
          ("captioning.metrics.coco", "captioning.data.karpathy"), needs=("ingest",)),
    Stage("digests", f"{_M}:stage_digests", "dataset digest, feature-store manifest, label-store digest",
          ("captioning.data.karpathy", "captioning.data.stores"), needs=("ingest", "vocab")),
    Stage("extract-plan", f"{_M}:stage_extract_plan", "extraction's plan of every chunk (dataset looked up by id)",
          ("captioning.features.parallel", "captioning.data.karpathy"), needs=("ingest",), default=False),
    Stage("planted-quadratic", f"{_M}:stage_planted_quadratic", "self-check of the fit: an O(N^2) loop",
          default=False, data=False),
)}


def stage_names(stages: Mapping[str, Stage] | None = None) -> list[str]:
    return list({**STAGES, **(stages or {})})
