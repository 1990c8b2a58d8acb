"""The pipeline-side stages of ``capflow bench scale`` (:mod:`captioning.bench.scale`), which need the stage cache,
``capflow verify``, MLflow and Prefect (the library never imports those). Each runs in its own process like the
library's stages, on the data and outputs of the same size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from captioning.bench.scale.stages import Stage

_M = "tasks.bench_scale"


def dataset_path(p: Mapping[str, Any]) -> str:
    return Path(p["ingest_out"], "dataset.path").read_text(encoding="utf-8")


def _labels_uri(p: Mapping[str, Any]) -> str:
    return str(Path(p["vocab_out"]) / "labels.zarr")


def stage_verify(p: Mapping[str, Any]) -> dict[str, Any]:
    """``capflow verify`` of the size's folder (a workdir-like tree: images, feature store, label store): every
    chunk of both stores read back and compared with its checksum."""
    from tasks.verify import verify

    res = verify([p["root"]])
    states = [f.state for f in res.findings]
    return {"findings": len(res.findings), "ok": states.count("ok"), "damaged": states.count("damaged"),
            "bytes_checked": res.bytes}


def stage_keys(p: Mapping[str, Any]) -> dict[str, Any]:
    """What a re-run of the pipeline pays to find its data stages cached: the stage keys (code digests included),
    the stage records written and read back, and the cached extract's check that its store is intact
    (``features_intact``: the manifest digest, then every chunk against its checksum)."""
    from captioning.data.karpathy import open_dataset
    from captioning.data.stores import FeatureStore, LabelStore
    from tasks.cache import StageCache, stage_key
    from tasks.refs import DatasetRef, FeaturesRef, LabelsRef
    from tasks.verify import features_intact

    cache = StageCache(p["out"])
    t0 = time.perf_counter()
    ds = open_dataset(dataset_path(p))  # the head only: nothing here reads the entries
    data = DatasetRef(run_id="", path=dataset_path(p), digest=ds.digest, images=ds.num_images,
                      captions=ds.num_captions, rejected_images=len(ds.rejected),
                      dropped_captions=len(ds.dropped_captions))
    t_load = time.perf_counter() - t0
    store = FeatureStore.open(p["features"])
    feats = FeaturesRef(run_id="", uri=p["features"], digest=store.manifest()["digest"], ok=0, rejected=0)
    labels = LabelsRef(run_id="", vocab_path=str(Path(p["vocab_out"]) / "vocab.json"), labels_uri=_labels_uri(p),
                       labels_digest=LabelStore.open(_labels_uri(p)).digest(), vocab_digest="", features_uri=feats.uri,
                       features_digest=feats.digest, words=0, captions=0)
    keys = {"ingest": stage_key("ingest", dataset=data.digest),
            "extract": stage_key("extract", dataset=data.digest, store=feats.uri, source="synthetic-informative"),
            "vocab": stage_key("vocab", dataset=data.digest, features=feats.digest, vocab="v", max_words=16)}
    for stage, ref in (("ingest", data), ("extract", feats), ("vocab", labels)):
        cache.put(stage, keys[stage], ref)
    t1 = time.perf_counter()
    hits = sum(cache.get(s, keys[s], kind) is not None
               for s, kind in (("ingest", DatasetRef), ("extract", FeaturesRef), ("vocab", LabelsRef)))
    intact = features_intact(feats.uri, feats.digest)
    return {"records_hit": hits, "intact": intact, "dataset_load_seconds": t_load,
            "cached_check_seconds": time.perf_counter() - t1, "outputs": [p["out"]]}


def stage_mlflow(p: Mapping[str, Any]) -> dict[str, Any]:
    """The MLflow calls of the ingest, extract and vocab jobs with this size's payloads (dataset inputs, metrics,
    ``rejects.json`` twice, ``manifest.json``, ``feature_rejects.json``, ``vocab.json``), against a fresh SQLite
    tracking store (the default without a tracking server)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from captioning.config import PipelineConfig
    from captioning.data.karpathy import open_dataset
    from captioning.data.stores import FeatureStore, LabelStore
    from tasks.tracking import Tracker

    cfg = PipelineConfig.model_validate({"run": {"workdir": p["out"], "name": "bench-scale"}})
    tracker = Tracker(cfg)
    ds = open_dataset(dataset_path(p))
    summary = ds.summary()
    rejects = {"rejected": summary["rejected"], "dropped_captions": summary["dropped_captions"],
               "excluded": summary["excluded"]}
    counts = {"images": summary["images"], "captions": summary["captions"], "rejected_images": len(ds.rejected)}
    with tracker.run("pipeline") as parent:
        with tracker.run("ingest", parent) as run:
            tracker.dataset(run, "dataset", ds.digest, ds.source, "raw", counts)
            tracker.metrics(run, counts)
            tracker.json_artifact(run, "rejects.json", rejects)
            tracker.json_artifact(parent, "rejects.json", rejects)
        store = FeatureStore.open(p["features"])
        with tracker.run("extract", parent) as run:
            tracker.params(run, {"features": cfg.features.model_dump(mode="json")})
            tracker.dataset(run, "dataset", ds.digest, ds.source, "input")
            fsum, manifest = store.summary(), store.manifest()
            tracker.metrics(run, {"images": fsum["images"], "ok": fsum["ok"], "rejected": len(fsum["rejected"])})
            tracker.json_artifact(run, "manifest.json", manifest)
            tracker.json_artifact(run, "feature_rejects.json", fsum["rejected"])
        with tracker.run("vocab", parent) as run:
            tracker.params(run, {"vocab": cfg.vocab.model_dump(mode="json"), "max_words": cfg.dataset.max_words})
            tracker.dataset(run, "dataset", ds.digest, ds.source, "input")
            digest = LabelStore.open(_labels_uri(p)).digest()
            tracker.dataset(run, "labels", digest, _labels_uri(p), "output", {"captions": summary["captions"]})
            tracker.artifact(run, Path(p["vocab_out"]) / "vocab.json")
    return {"rejects_logged": len(rejects["rejected"]) + len(rejects["dropped_captions"]),
            "feature_rejects_logged": len(fsum["rejected"]), "outputs": [p["out"]]}


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("verify", f"{_M}:stage_verify", "`capflow verify` of the feature and label stores (every chunk re-read)",
          ("tasks.verify",), needs=("vocab",)),
    Stage("stage-keys", f"{_M}:stage_keys", "stage keys + records + a cached extract's intact check",
          ("tasks.cache", "tasks.verify", "captioning.data.karpathy"), needs=("vocab",)),
    Stage("mlflow", f"{_M}:stage_mlflow", "the data jobs' MLflow inputs, metrics and artifacts (SQLite store)",
          ("tasks.tracking", "captioning.data.karpathy"), needs=("vocab",)),
)}
