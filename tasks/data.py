"""The data stages as jobs - ingest, extract (or import) region features, vocab (the flow wraps them in its tasks).

A job takes a :class:`RunContext` and the typed results of the stages before it and returns its own
(:mod:`tasks.refs`). The pipeline's tasks and the single-stage commands (``capflow ingest|extract|vocab|
import-features``) call the same jobs, so both write the same workdir layout and stage records.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from captioning.data.karpathy import Dataset, image_ids_of, open_dataset
from captioning.data.plans import extract_plan, ingest_plan, vocab_plan
from captioning.data.prepare import ingest_file, vocab_and_labels
from captioning.data.stores import FeatureStore, LabelStore
from captioning.errors import InputError
from captioning.util import atomic_write
from tasks.cache import stage_key
from tasks.common import RunContext, log
from tasks.refs import DatasetRef, FeaturesRef, LabelsRef
from tasks.verify import features_intact


class MissingStageError(InputError, RuntimeError):
    """A single-stage command needs the output of a stage that has not run for this workdir."""


def ingest(rc: RunContext) -> DatasetRef:
    """Read + validate the dataset (always: the digest says whether anything downstream must change)."""
    cfg = rc.cfg
    t0 = time.perf_counter()
    wd = rc.workdir
    f = ingest_file(ingest_plan(cfg), wd.dataset_partial(), progress=rc.progress)
    path = wd.dataset(f.digest)
    f.path.replace(path)  # named by its digest (a link planted at the name is replaced, not followed)
    summary = f.summary()
    rejects = {"rejected": summary["rejected"], "dropped_captions": summary["dropped_captions"],
               "excluded": summary["excluded"]}
    rejects_path = wd.rejects(f.digest)
    text = json.dumps(rejects, indent=1, ensure_ascii=False).encode("utf-8")
    atomic_write(rejects_path, lambda fh: fh.write(text), "rejects")  # a link planted there is replaced, not followed
    ref = DatasetRef(run_id="", path=str(path), digest=f.digest, images=summary["images"],
                     captions=summary["captions"], rejected_images=len(summary["rejected"]),
                     dropped_captions=len(summary["dropped_captions"]), splits=dict(summary["splits"]),
                     rejects_path=str(rejects_path))
    counts = ref.counts()
    key, hit = rc.cached("ingest", DatasetRef, dataset=f.digest)
    rc.tracker.metrics(rc.parent_run, counts)  # counted in the parent run on every run
    if hit is not None:
        return hit
    with rc.tracker.run("ingest", rc.parent_run) as run:
        rc.tracker.dataset(run, "dataset", f.digest, f.source, "raw", counts)
        rc.tracker.metrics(run, {**counts, "seconds": time.perf_counter() - t0})
        rc.tracker.json_artifact(run, "rejects.json", rejects)
        rc.tracker.json_artifact(rc.parent_run, "rejects.json", rejects)
    return rc.done("ingest", key, dataclasses.replace(ref, run_id=run))


def extract(rc: RunContext, data: DatasetRef, *, uri: str | None = None, workers: int | None = None,
            reuse: bool = True) -> FeaturesRef:
    """Region features into the feature store (Dask-parallel, resumes at chunk level). ``reuse``: a recorded,
    intact store is returned as is; ``reuse=False`` (``capflow extract``) always passes over the store, which
    skips finished chunks (re-checking them) and fills the rest."""
    from captioning.features.naming import store_uri
    from captioning.features.parallel import extract_features

    cfg = rc.cfg
    uri = uri or store_uri(cfg)
    key, hit = rc.cached("extract", FeaturesRef, dataset=data.digest, store=uri, source=cfg.features.source)
    if reuse and hit is not None and features_intact(uri, hit.digest):  # values checked: a damaged chunk is redone
        return hit
    ds = open_dataset(data.path)  # streamed: extraction looks entries up a chunk at a time
    with rc.tracker.run("extract", rc.parent_run) as run:
        rc.tracker.params(run, {"features": cfg.features.model_dump(mode="json")})
        rc.tracker.dataset(run, "dataset", data.digest, ds.source, "input")
        t0 = time.perf_counter()
        if cfg.features.source == "synthetic-informative":
            from captioning.data.synthetic_features import informative_store_for

            whole = ds if isinstance(ds, Dataset) else Dataset.from_file(ds)  # synthetic data: small
            store = informative_store_for(extract_plan(cfg), whole, uri, progress=rc.progress)
            report: dict[str, Any] = {"extracted": store.num_rows}
        else:
            res = extract_features(extract_plan(cfg), ds, workers=workers, uri=uri, progress=rc.progress)
            report = res.to_json()
            store = FeatureStore.open(uri)
        summary = store.summary()
        manifest = store.manifest()
        info = {k: report[k] for k in ("extracted", "skipped_chunks", "seconds_per_image") if k in report}
        rc.tracker.metrics(run, {"images": summary["images"], "ok": summary["ok"], "rejected": len(summary["rejected"]),
                                 "boxes_mean": summary["boxes"]["mean"], "seconds": time.perf_counter() - t0, **info})
        rc.tracker.json_artifact(run, "manifest.json", manifest)
        rc.tracker.json_artifact(run, "feature_rejects.json", summary["rejected"])
        rc.tracker.metrics(rc.parent_run, {"feature_rejects": len(summary["rejected"])})
    log.info("extract: %s ok of %s images -> %s", summary["ok"], summary["images"], uri)
    return rc.done("extract", key, FeaturesRef(run_id=run, uri=uri, digest=manifest["digest"], ok=summary["ok"],
                                               rejected=len(summary["rejected"]), source=cfg.features.source,
                                               report=report))


def import_features(rc: RunContext, att_dir: Path | None = None, box_dir: Path | None = None, *,
                    source: Path | None = None, fmt: str = "auto", boxes: str = "auto",
                    tsv_fields: list[str] | None = None, image_sizes_files: list[Path] | None = None,
                    uri: str | None = None, overwrite: bool = False) -> FeaturesRef:
    """Region features another tool wrote (:mod:`captioning.data.imports`: ruotianluo npy/npz/LMDB, butd TSV, M2
    HDF5, MILVLG npz; ``source`` a file or folder, or the ruotianluo folders ``att_dir`` + ``box_dir``) -> a
    feature store in the feature-store folder (``imported-<digest>.zarr``: named by the sources and the image ids),
    recorded as the ``extract`` stage's result so that ``capflow vocab`` / ``capflow train`` use it. With
    dataset.annotations the dataset's images are the rows (records of other images are rejected rows) and their
    files' sizes make pixel boxes relative; ``image_sizes_files`` (COCO-format JSON) add sizes. Raises
    :class:`captioning.data.imports.FeatureImportError` for a source that cannot be read or options that do not
    fit it."""
    from captioning.data.imports import RuotianluoSource, import_source, read_image_sizes, resolve
    from captioning.data.prepare import image_sizes
    from captioning.features.naming import imported_store_uri, imported_uri

    cfg = rc.cfg
    spec = resolve(fmt, source, att=att_dir, box=box_dir, boxes=boxes, tsv_fields=tsv_fields)
    sizes: dict[int, tuple[int, int]] = {}
    for p in image_sizes_files or ():
        sizes.update(read_image_sizes(p))
    data: DatasetRef | None = None
    ids: list[int] | None = None
    if cfg.dataset.annotations:
        data = ingest(rc)
        ds = open_dataset(data.path)  # streamed: the id column, then one entry at a time for the sizes
        ids = image_ids_of(ds).tolist()
        sizes.update(image_sizes(ds))  # the image files themselves win over a sizes file
    f = cfg.features
    if uri is None:
        if spec.format == "npy":  # the name earlier capflow versions gave this import
            assert spec.att is not None and spec.box is not None
            name_ids = ids if ids is not None else sorted(
                int(p.stem) for p in spec.att.glob("*.npy") if p.stem.isdigit())
            if not name_ids:
                raise MissingStageError(f"no <image_id>.npy files in {spec.att}")
            uri = imported_store_uri(extract_plan(cfg), spec.att, spec.box, name_ids)
        else:
            uri = imported_uri(cfg.feature_store_uri(), spec.ident(), ids, {k: getattr(f, k) for k in (
                "max_boxes", "feature_dim", "chunk_rows", "dtype", "compressor")})
    src = spec.open(max_boxes=f.max_boxes, feature_dim=f.feature_dim)
    attrs = ({"att_dir": str(spec.att), "box_dir": str(spec.box)} if isinstance(src, RuotianluoSource) else {})
    res = import_source(src, uri, image_ids=ids, sizes=sizes, max_boxes=f.max_boxes, feature_dim=f.feature_dim,
                        chunk_rows=f.chunk_rows, dtype=f.dtype, compressor=f.compressor, overwrite=overwrite,
                        progress=rc.progress, attrs=attrs)
    _gate_import(res, uri, len(ids) if ids is not None else None, f.max_reject_fraction)
    summary = res.store.summary()
    ref = FeaturesRef(run_id="", uri=uri, digest=res.store.manifest()["digest"], ok=summary["ok"],
                      rejected=len(summary["rejected"]), source=f"import-{spec.format}",
                      report={"format": spec.format, "records": res.records, "reject_kinds": res.reasons,
                              "rejected": summary["rejected"]})
    key = stage_key("extract", dataset=data.digest if data else None, store=uri, source=ref.source)
    return rc.done("extract", key, ref)


def _gate_import(res: Any, uri: str, dataset_images: int | None, max_fraction: float) -> None:
    """An import that imported no row, or (with a dataset) rejected more than ``features.max_reject_fraction`` of
    its images, fails as bad input naming the reject kinds; its store is removed, so the same command runs again
    once the input is fixed."""
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(res.reasons.items(), key=lambda kv: -kv[1])) or "none"
    if res.ok == 0:
        why = f"no row of {res.store.num_rows} was imported (rejects by kind: {kinds})"
    elif dataset_images and res.rejected / dataset_images > max_fraction:
        why = (f"{res.rejected} of the dataset's {dataset_images} images have no usable features (rejects by kind: "
               f"{kinds}), more than features.max_reject_fraction={max_fraction}: is this the dataset's feature "
               "file?")
    else:
        return
    from captioning.data.imports import FeatureImportError
    from tasks.verify import remove_store

    remove_store(uri)
    raise FeatureImportError(f"import into {uri} failed: {why}; the store was removed")


def features_for(rc: RunContext, data: DatasetRef) -> FeaturesRef:
    """The feature store a single-stage command uses: the configured store's record for this dataset, else the
    most recent ``extract`` record of the workdir (an imported store); else :class:`MissingStageError`."""
    from captioning.features.naming import store_uri

    _, hit = rc.cached("extract", FeaturesRef, dataset=data.digest, store=store_uri(rc.cfg),
                       source=rc.cfg.features.source)
    hit = hit or rc.cache.latest("extract", FeaturesRef)
    if hit is None:
        raise MissingStageError(f"no feature store recorded in {rc.workdir.root}: run `capflow extract` (or "
                                "`capflow import-features`, or `capflow run`) with the same --preset/--config first")
    return hit


def features_of_store(uri: str) -> FeaturesRef:
    """A feature store named on the command line (``--features URI``) as a typed reference."""
    store = FeatureStore.open(uri)
    s = store.summary()
    return FeaturesRef(run_id="", uri=uri, digest=store.manifest()["digest"], ok=s["ok"], rejected=len(s["rejected"]),
                       source=str(store.group.attrs.get("source", "detector")))


def vocab(rc: RunContext, data: DatasetRef, feats: FeaturesRef | None) -> LabelsRef:
    """Vocabulary (train split) + ground-truth label store aligned to the feature store's rows (the dataset's own
    order without a feature store)."""
    cfg = rc.cfg
    key, hit = rc.cached("vocab", LabelsRef, dataset=data.digest, features=feats.digest if feats else None,
                         vocab=cfg.digest("vocab"), max_words=cfg.dataset.max_words)
    if hit is not None and Path(hit.vocab_path).is_file():
        return hit
    ds = open_dataset(data.path)  # streamed
    with rc.tracker.run("vocab", rc.parent_run) as run:
        rc.tracker.params(run, {"vocab": cfg.vocab.model_dump(mode="json"), "max_words": cfg.dataset.max_words})
        rc.tracker.dataset(run, "dataset", data.digest, ds.source, "input")
        rows = FeatureStore.open(feats.uri).row_of() if feats else None
        res = vocab_and_labels(vocab_plan(cfg), ds, rc.cache.workdir("vocab", key), rows)
        digest = LabelStore.open(res.labels_uri).digest()
        radix = res.vocab.radix()
        rc.tracker.dataset(run, "labels", digest, res.labels_uri, "output", {"captions": res.captions})
        rc.tracker.metrics(run, {"words": len(res.vocab.words), "ids": len(res.vocab), "radix_digits": radix.digits,
                                 "captions": res.captions})
        rc.tracker.artifact(run, res.vocab_path)
    return rc.done("vocab", key, LabelsRef(
        run_id=run, vocab_path=str(res.vocab_path), labels_uri=res.labels_uri, labels_digest=digest,
        vocab_digest=res.vocab.digest(), features_uri=feats.uri if feats else None,
        features_digest=feats.digest if feats else None, words=len(res.vocab.words), captions=res.captions))
