"""Parallel, resumable, incremental feature extraction into a chunked Zarr store.

The dataset's images are planned into the store's row chunks; each chunk is one task that loads its images,
extracts their regions and writes the whole chunk (``status`` last), so writers never share a chunk and a row
is ``ok`` only once its data is stored. Tasks run on Dask (a LocalCluster on 127.0.0.1 by default, or the
scheduler at ``features.dask_address``) with one model per worker process, built once and reused for every
chunk that worker runs.

Identity: the store's folder name is a digest of everything that changes the numbers (extractor settings,
weights, box limits, dtype, chunking), so new settings or weights make a new store, while the same settings
resume or extend the existing one: finished chunks are skipped, new dataset images are appended as new rows,
existing rows are never rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from captioning.config import ExtractorConfig, FeaturesConfig, PipelineConfig
from captioning.data.karpathy import Dataset
from captioning.data.stores import OK, PENDING, REJECTED, FeatureStore, StoreError

log = logging.getLogger(__name__)

STORE_FORMAT = 1  # bump when the extraction code changes its numbers


# ---------------------------------------------------------------------- identity
def weights_identity(ex: ExtractorConfig) -> str:
    """What identifies the detector weights: the file's sha256 (given or computed), or the random-init seed."""
    if ex.weights is None:
        return f"random-init:{ex.seed}:{ex.model_config_file}"
    if ex.weights_sha256:
        return ex.weights_sha256.lower()
    if "://" not in ex.weights:
        h = hashlib.sha256()
        with open(ex.weights, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    return f"uri:{ex.weights}"  # remote without a pinned hash: the URI is the best identity we have


def store_key(f: FeaturesConfig) -> str:
    ex = f.extractor.model_dump(mode="json")
    ex.pop("device")  # where it runs does not name the store (recorded in its attributes instead)
    ex.pop("weights_sha256")
    ex["weights"] = weights_identity(f.extractor)
    ident = {
        "format": STORE_FORMAT,
        "extractor": ex,
        "min_boxes": f.min_boxes,
        "max_boxes": f.max_boxes,
        "feature_dim": f.feature_dim,
        "dtype": f.dtype,
        "chunk_rows": f.chunk_rows,
        "compressor": f.compressor,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def store_uri(cfg: PipelineConfig) -> str:
    """Where the configured feature store lives: named by everything that determines its content."""
    base = cfg.feature_store_uri().rstrip("/")
    if cfg.features.source == "synthetic-informative":
        f = cfg.features
        ident = json.dumps({"synthetic": cfg.dataset.synthetic.model_dump(mode="json"), "seed": cfg.run.seed,
                            **{k: getattr(f, k) for k in ("feature_dim", "max_boxes", "chunk_rows", "dtype",
                                                           "compressor")}}, sort_keys=True)
        return f"{base}/informative-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.zarr"
    return f"{base}/{store_key(cfg.features)}.zarr"


# ---------------------------------------------------------------------- chunk work (runs on workers)
_MODELS: dict[str, Any] = {}


def _extractor(ex_json: str, min_boxes: int, max_boxes: int, feature_dim: int, threads: int | None,
               cache_dir: str | None = None):
    """The worker process's model for this config, built on first use."""
    key = f"{ex_json}|{min_boxes}|{max_boxes}|{feature_dim}"
    if key not in _MODELS:
        import torch

        from captioning.features.extractor import RegionExtractor

        if threads:
            torch.set_num_threads(threads)
        ex = ExtractorConfig.model_validate_json(ex_json)
        if ex.device == "auto" and torch.cuda.is_available():
            ex = ex.model_copy(update={"device": f"cuda:{_worker_index() % torch.cuda.device_count()}"})
        _MODELS.clear()  # one model per process
        _MODELS[key] = RegionExtractor(ex, min_boxes=min_boxes, max_boxes=max_boxes, feature_dim=feature_dim,
                                       cache_dir=Path(cache_dir) if cache_dir else None)
    return _MODELS[key]


def _worker_index() -> int:
    """This Dask worker's index (LocalCluster names workers 0..n-1), 0 outside Dask: spreads GPUs over workers."""
    try:
        from distributed import get_worker

        name = get_worker().name
        return int(name) if str(name).isdigit() else abs(hash(name))
    except (ImportError, ValueError):
        return 0


@dataclass
class ChunkResult:
    chunk: int
    images: int
    ok: int
    rejected: int
    seconds: float
    skipped: bool = False
    boxes: list[int] = field(default_factory=list)


def extract_chunk(
    uri: str,
    chunk: int,
    items: Sequence[tuple[int, str]],
    ex_json: str,
    min_boxes: int,
    max_boxes: int,
    feature_dim: int,
    threads: int | None = None,
    cache_dir: str | None = None,
) -> ChunkResult:
    """Extract and write one whole chunk. Idempotent: a chunk already written is left alone."""
    from captioning.features.images import ImageRejected, load_rgb

    t0 = time.perf_counter()
    store = FeatureStore.open(uri, mode="r+")
    start, stop = store.chunk_range(chunk)
    if len(items) != stop - start:
        raise StoreError(f"chunk {chunk} has {stop - start} rows but {len(items)} images were planned")
    ids = store.image_ids(start, stop)  # this chunk's rows only: no whole-array reads per chunk
    if [i for i, _ in items] != ids.tolist():
        raise StoreError(f"chunk {chunk}: planned images do not match the store's rows")
    pending = store.status(start, stop) == PENDING
    if not np.any(pending):
        return ChunkResult(chunk, len(items), 0, 0, time.perf_counter() - t0, skipped=True)
    ex_cfg = ExtractorConfig.model_validate_json(ex_json)
    model = _extractor(ex_json, min_boxes, max_boxes, feature_dim, threads, cache_dir)
    # rows already written (a chunk that grew by appended images) are kept exactly as they are
    old = store.read_block(start, stop)
    feats = old.features.astype(np.float32)
    boxes = old.boxes.copy()
    nb = old.num_boxes.astype(np.int16)
    size = old.image_size.copy()
    status = np.where(pending, OK, old.status).astype(np.int8)
    reasons = [str(r) for r in store.group["reject_reason"][start:stop]]
    # pending rows start from nothing (a killed writer may have left partial data there)
    feats[pending], boxes[pending], nb[pending], size[pending] = 0, 0, 0, -1
    reasons = [r if not p else "" for r, p in zip(reasons, pending, strict=True)]
    good: list[int] = []
    pixels: list[np.ndarray] = []
    for k, (_, path) in enumerate(items):
        if not pending[k]:
            continue
        try:
            img = load_rgb(path, min_side=ex_cfg.min_image_side, max_pixels=ex_cfg.max_image_pixels)
        except ImageRejected as e:
            status[k], reasons[k] = REJECTED, str(e.reason)
            continue
        good.append(k)
        pixels.append(img)
        size[k] = img.shape[:2]
    if pixels:
        try:
            regions = model(pixels)
        except Exception as e:  # one bad batch: retry image by image so one image cannot sink the chunk
            log.warning("chunk %d: batch failed (%s); extracting image by image", chunk, e)
            regions = []
            for img in pixels:
                try:
                    regions.extend(model([img]))
                except Exception as e1:
                    regions.append(e1)
        for k, r in zip(good, regions, strict=True):
            if isinstance(r, Exception):
                status[k], reasons[k] = REJECTED, f"extraction failed: {r}"
                continue
            m = r.features.shape[0]
            if m < min_boxes:
                status[k], reasons[k] = REJECTED, f"only {m} boxes found (< features.min_boxes={min_boxes})"
                continue
            if not (np.all(np.isfinite(r.features)) and np.all(np.isfinite(r.boxes))):
                status[k], reasons[k] = REJECTED, "non-finite features"
                continue
            f16 = r.features.astype(np.float16) if store.group["features"].dtype == np.float16 else r.features
            if not np.all(np.isfinite(f16)):
                status[k], reasons[k] = REJECTED, "features overflow float16"
                continue
            feats[k, :m] = r.features
            boxes[k, :m] = r.boxes
            nb[k] = m
    store.write_rows(start, features=feats, boxes=boxes, num_boxes=nb, image_size=size, status=status,
                     reject_reason=reasons)
    new_ok = pending & (status == OK)
    done = int(pending.sum())
    return ChunkResult(chunk, done, int(new_ok.sum()), done - int(new_ok.sum()), time.perf_counter() - t0,
                       boxes=nb[new_ok].tolist())


# ---------------------------------------------------------------------- planning
def prepare_store(cfg: PipelineConfig, ds: Dataset, uri: str | None = None, describe: dict | None = None
                  ) -> tuple[FeatureStore, int]:
    """Open the store for these settings, appending rows for new dataset images; or create it.

    Returns the store and how many rows were added. Rows are in dataset order (sorted by image id) for a new
    store; appended images follow in the same order.
    """
    uri = uri or store_uri(cfg)
    f = cfg.features
    ids = [e.image_id for e in ds.images]
    if FeatureStore.exists(uri):
        store = FeatureStore.open(uri, mode="r+")
        have = set(store.image_ids().tolist())
        new = [i for i in ids if i not in have]
        if new:
            store.append_images(new)
            store.group.attrs["dataset_digest"] = ds.digest
            log.info("feature store %s: %d new images appended", uri, len(new))
        return store, len(new)
    attrs = {
        "store_key": store_key(f),
        "extractor": f.extractor.model_dump(mode="json"),
        "weights_identity": weights_identity(f.extractor),
        "random_weights": f.extractor.weights is None,
        "dataset_digest": ds.digest,
        "code_version": _code_version(),
        "min_boxes": f.min_boxes,
    }
    if f.extractor.weights is None:
        attrs["warning"] = ("features extracted with RANDOM detector weights (no features.extractor.weights): "
                            "fine for tests and the demo's plumbing, meaningless for real captioning")
    if describe:
        attrs["extractor_runtime"] = describe
    store = FeatureStore.create(uri, ids, max_boxes=f.max_boxes, feature_dim=f.feature_dim,
                                chunk_rows=f.chunk_rows, dtype=f.dtype, compressor=f.compressor, attrs=attrs)
    return store, len(ids)


def plan_chunks(store: FeatureStore, ds: Dataset) -> list[tuple[int, list[tuple[int, str]]]]:
    """(chunk, [(image_id, path), ...]) for every chunk with pending rows."""
    by_id = {e.image_id: str(ds.image_path(e)) for e in ds.images}
    ids = store.image_ids()
    todo = []
    for c in store.pending_chunks():
        s, e = store.chunk_range(c)
        missing = [int(i) for i in ids[s:e] if int(i) not in by_id]
        if missing:
            raise StoreError(f"chunk {c} holds images {missing[:5]} that the dataset no longer has; "
                             "they cannot be extracted (restore them or start a new store)")
        todo.append((c, [(int(i), by_id[int(i)]) for i in ids[s:e]]))
    return todo


def _code_version() -> str:
    try:
        from importlib.metadata import version

        return version("capflow")
    except Exception:  # pragma: no cover - not installed
        return "unknown"


# ---------------------------------------------------------------------- the run
@dataclass
class ExtractResult:
    store: str
    images: int
    ok: int
    rejected: list[dict]
    boxes: dict[str, float]
    seconds: float
    extracted: int  # images extracted by this run
    skipped_chunks: int
    appended: int

    @property
    def seconds_per_image(self) -> float:
        return self.seconds / self.extracted if self.extracted else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "images": self.images,
            "ok": self.ok,
            "rejected": [{"image_id": r["image_id"], "reason": r["reason"]} for r in self.rejected],
            "boxes": self.boxes,
            "seconds_per_image": self.seconds_per_image,
            "extracted": self.extracted,
            "skipped_chunks": self.skipped_chunks,
            "appended": self.appended,
            "seconds": self.seconds,
        }


def local_cluster(workers: int, threads_per_worker: int = 1, gpus: int | None = None):
    """A LocalCluster bound to 127.0.0.1 (dashboard too), one single-threaded process per worker.

    With GPUs (``gpus`` or, by default, every CUDA device), there is at most one worker per GPU and each
    worker offers the Dask resource ``GPU=1``; a worker uses GPU number (worker index mod device count).
    """
    import dask
    from distributed import LocalCluster

    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kw = {}
    if gpus:
        workers = min(workers, gpus)
        kw["resources"] = {"GPU": 1}
    # distributed sets MALLOC_TRIM_THRESHOLD_ in workers, which turns off glibc's adaptive mmap threshold: every
    # large torch tensor then costs an mmap/munmap and page faults (measured: CPU extraction ~30% slower).
    with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}):
        return LocalCluster(n_workers=workers, threads_per_worker=threads_per_worker, processes=True,
                            host="127.0.0.1", dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR, **kw)


def _gpu_resources(client) -> bool:
    info = client.scheduler_info()
    return any("GPU" in (w.get("resources") or {}) for w in info.get("workers", {}).values())


def extract_features(
    cfg: PipelineConfig,
    ds: Dataset,
    *,
    workers: int | None = None,
    client=None,
    uri: str | None = None,
    progress: bool = True,
    threads_per_worker: int | None = None,
    on_chunk: Callable[[ChunkResult], None] | None = None,
) -> ExtractResult:
    """Extract every pending chunk of the store for ``cfg``/``ds``. ``workers=0`` runs in this process."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    store, appended = prepare_store(cfg, ds, uri)
    todo = plan_chunks(store, ds)
    f = cfg.features
    ex_json = f.extractor.model_dump_json()
    n_workers = f.workers if workers is None else workers
    threads = threads_per_worker or f.extractor.threads
    args = (ex_json, f.min_boxes, f.max_boxes, f.feature_dim, threads, str(cfg.workdir / "cache" / "weights"))
    skipped = store.num_chunks - len(todo)
    extracted = 0
    bar = tqdm(total=sum(len(items) for _, items in todo), desc="extracting", unit="img", disable=not progress)

    def done(r: ChunkResult) -> None:
        nonlocal extracted
        if not r.skipped:
            extracted += r.images
        bar.update(r.images)
        if on_chunk:
            on_chunk(r)

    try:
        if todo and n_workers == 0 and client is None:
            for c, items in todo:
                done(extract_chunk(store.uri, c, items, *args))
        elif todo:
            from distributed import Client, as_completed

            own_cluster, own_client = None, client is None
            if client is None:
                if f.dask_address:
                    client = Client(f.dask_address)
                else:
                    own_cluster = local_cluster(n_workers)
                    client = Client(own_cluster)
            try:
                resources = {"GPU": 1} if _gpu_resources(client) else None
                futures = [client.submit(extract_chunk, store.uri, c, items, *args, key=f"extract-{store.uri}-{c}",
                                         resources=resources, pure=False) for c, items in todo]
                for fut in as_completed(futures):
                    done(fut.result())
            finally:
                if own_client:  # a client we opened (to our LocalCluster or an external scheduler) is closed
                    client.close()
                if own_cluster is not None:
                    own_cluster.close()
    finally:
        bar.close()
    summ = FeatureStore.open(store.uri).summary()
    return ExtractResult(store=store.uri, images=summ["images"], ok=summ["ok"], rejected=summ["rejected"],
                         boxes=summ["boxes"], seconds=time.perf_counter() - t0, extracted=extracted,
                         skipped_chunks=skipped, appended=appended)
