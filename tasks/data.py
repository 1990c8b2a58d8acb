"""Pipeline tasks for the data stages: ingest, extract (region features), vocab (vocabulary + label store)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from captioning.data.karpathy import Dataset
from captioning.data.prepare import build_labels, ingest
from captioning.data.stores import FeatureStore, LabelStore
from captioning.data.text import build_vocabulary
from tasks.common import RunContext, log
from tasks.verify import features_intact

RETRY = {"retries": 1, "retry_delay_seconds": 5, "cache_policy": NO_CACHE}


@task(name="ingest", **RETRY)
def ingest_task(rc: RunContext) -> dict[str, Any]:
    """Read + validate the dataset (always: the digest says whether anything downstream must change)."""
    cfg = rc.cfg
    t0 = time.perf_counter()
    ds = ingest(cfg, progress=rc.progress)
    path = ds.save(cfg.workdir / "datasets" / f"dataset-{ds.digest[:16]}.json")
    summary = ds.summary()
    rejects = {"rejected": summary["rejected"], "dropped_captions": summary["dropped_captions"],
               "excluded": summary["excluded"]}
    counts = {"images": summary["images"], "captions": summary["captions"], "rejected_images": len(ds.rejected),
              "dropped_captions": len(ds.dropped_captions), **{f"split_{k}": v for k, v in summary["splits"].items()}}
    key, hit = rc.cached("ingest", dataset=ds.digest)
    rc.tracker.metrics(rc.parent_run, counts)  # counted in the parent run on every run
    if hit is not None:
        return hit
    with rc.tracker.run("ingest", rc.parent_run) as run:
        rc.tracker.dataset(run, "dataset", ds.digest, ds.source, "raw", counts)
        rc.tracker.metrics(run, {**counts, "seconds": time.perf_counter() - t0})
        rc.tracker.json_artifact(run, "rejects.json", rejects)
        rc.tracker.json_artifact(rc.parent_run, "rejects.json", rejects)
    return rc.done("ingest", key, {"run_id": run, "dataset_path": str(path), "digest": ds.digest, **counts})


@task(name="extract", **RETRY)
def extract_task(rc: RunContext, data: dict[str, Any]) -> dict[str, Any]:
    """Region features into the feature store (Dask-parallel, resumes at chunk level)."""
    from captioning.features.parallel import extract_features, store_uri

    cfg = rc.cfg
    uri = store_uri(cfg)
    key, hit = rc.cached("extract", dataset=data["digest"], store=uri, source=cfg.features.source)
    if hit is not None and features_intact(uri, hit["digest"]):  # values checked: a damaged chunk is redone
        return hit
    ds = Dataset.load(data["dataset_path"])
    with rc.tracker.run("extract", rc.parent_run) as run:
        rc.tracker.params(run, {"features": cfg.features.model_dump(mode="json")})
        rc.tracker.dataset(run, "dataset", data["digest"], ds.source, "input")
        t0 = time.perf_counter()
        if cfg.features.source == "synthetic-informative":
            from captioning.data.synthetic_features import informative_store_for

            store = informative_store_for(cfg, ds, uri, progress=rc.progress)
            info: dict[str, Any] = {"extracted": store.num_rows}
        else:
            res = extract_features(cfg, ds, uri=uri, progress=rc.progress)
            info = {"extracted": res.extracted, "skipped_chunks": res.skipped_chunks,
                    "seconds_per_image": res.seconds_per_image}
            store = FeatureStore.open(uri)
        summary = store.summary()
        manifest = store.manifest()
        rc.tracker.metrics(run, {"images": summary["images"], "ok": summary["ok"], "rejected": len(summary["rejected"]),
                                 "boxes_mean": summary["boxes"]["mean"], "seconds": time.perf_counter() - t0, **info})
        rc.tracker.json_artifact(run, "manifest.json", manifest)
        rc.tracker.json_artifact(run, "feature_rejects.json", summary["rejected"])
        rc.tracker.metrics(rc.parent_run, {"feature_rejects": len(summary["rejected"])})
    log.info("extract: %s ok of %s images -> %s", summary["ok"], summary["images"], uri)
    return rc.done("extract", key, {"run_id": run, "uri": uri, "digest": manifest["digest"], "ok": summary["ok"],
                                    "rejected": len(summary["rejected"])})


@task(name="vocab", **RETRY)
def vocab_task(rc: RunContext, data: dict[str, Any], feats: dict[str, Any]) -> dict[str, Any]:
    """Vocabulary (train split) + ground-truth label store aligned to the feature store's rows."""
    cfg = rc.cfg
    key, hit = rc.cached("vocab", dataset=data["digest"], features=feats["digest"],
                         vocab=cfg.digest("vocab"), max_words=cfg.dataset.max_words)
    if hit is not None:
        return hit
    ds = Dataset.load(data["dataset_path"])
    with rc.tracker.run("vocab", rc.parent_run) as run:
        rc.tracker.params(run, {"vocab": cfg.vocab.model_dump(mode="json"), "max_words": cfg.dataset.max_words})
        rc.tracker.dataset(run, "dataset", data["digest"], ds.source, "input")
        out: Path = rc.cache.workdir("vocab", key)
        vocab = build_vocabulary(list(ds.captions("train")), cfg.vocab.min_count, cfg.vocab.radix_base)
        vocab_path = vocab.save(out / "vocab.json")
        rows = FeatureStore.open(feats["uri"]).row_of()
        store = build_labels(ds, vocab, str(out / "labels.zarr"), cfg.dataset.max_words, rows)
        digest = store.digest()
        radix = vocab.radix()
        rc.tracker.dataset(run, "labels", digest, store.uri, "output",
                           {"captions": int(store.group["tokens"].shape[0])})
        rc.tracker.metrics(run, {"words": len(vocab.words), "ids": len(vocab), "radix_digits": radix.digits,
                                 "captions": int(store.group["tokens"].shape[0])})
        rc.tracker.artifact(run, vocab_path)
    return rc.done("vocab", key, {"run_id": run, "vocab_path": str(vocab_path), "labels_uri": store.uri,
                                  "labels_digest": digest, "vocab_digest": vocab.digest()})


def labels_digest(uri: str) -> str:
    return LabelStore.open(uri).digest()
