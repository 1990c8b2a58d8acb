"""Parallel, resumable, incremental feature extraction into a chunked Zarr store.

The dataset's images are planned into the store's row chunks; each chunk is one task that loads its images,
extracts their regions and writes the whole chunk (``status`` last), so writers never share a chunk and a row
is ``ok`` only once its data is stored. Tasks run on Dask (a LocalCluster on 127.0.0.1 by default, or the
scheduler at ``features.dask_address``) with one model per worker process, built once and reused for every
chunk that worker runs.

Identity: the store's folder name is a digest of everything that changes the numbers
(:mod:`captioning.features.naming`), so new settings or weights make a new store, while the same settings
resume or extend the existing one: finished chunks are skipped, new dataset images are appended as new rows,
existing rows are never rewritten. The automatic extractor settings are resolved once per extraction, here, and
the resolved settings name the store and travel to the workers.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from captioning.config import ExtractorConfig, FeaturesConfig
from captioning.data.columnar import DatasetFile
from captioning.data.karpathy import Dataset, image_ids_of
from captioning.data.plans import ExtractPlan
from captioning.data.stores import EXTRAS, OK, PENDING, REJECTED, FeatureStore, StoreError
from captioning.features.bottom_up_layout import default_layout, recognise_layout
from captioning.features.bottom_up_options import deviations, resolved_options
from captioning.features.naming import (  # noqa: F401 - imported_store_uri: still importable from its old home
    imported_store_uri,
    store_key,
    store_uri,
    weights_identity,
)
from captioning.features.registry import flavour
from captioning.features.settings import effective_config

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- identity
def checkpoint_layout(ex: ExtractorConfig) -> dict[str, Any]:
    """The bottom-up layout of the configured weights, as recognised from the file (checked before any worker
    starts, so a wrong file fails the run at once); the released layout for random weights."""
    from captioning.features.weights import read_checkpoint, resolve, weights_cache_dir  # torch: bottom-up only

    if ex.weights is None:
        return {**default_layout(ex.flavour).describe(), "random_init": True}
    path, _ = resolve(ex.weights, ex.weights_sha256, weights_cache_dir())
    return recognise_layout(read_checkpoint(path)["model"], expect=ex.flavour).describe()


def store_extras(f: FeaturesConfig) -> tuple[str, ...]:
    """The optional per-region arrays a store of these settings holds: boxes in original pixels, object and
    attribute ids and confidences for the bottom-up flavours (attributes stay empty, -1, when the checkpoint
    has no attribute head); none for the stock flavour."""
    return flavour(f.extractor.flavour).store_extras(f.extractor.bottom_up)


# ---------------------------------------------------------------------- chunk work (runs on workers)
_MODELS: dict[str, Any] = {}


def _extractor(ex_json: str, min_boxes: int, max_boxes: int, feature_dim: int, threads: int | None,
               cache_dir: str | None = None):
    """The worker process's model for this config, built on first use."""
    key = f"{ex_json}|{min_boxes}|{max_boxes}|{feature_dim}"
    if key not in _MODELS:
        import torch

        from captioning.features.extractor import make_extractor

        if threads:
            torch.set_num_threads(threads)
        ex = ExtractorConfig.model_validate_json(ex_json)
        if ex.device == "auto" and torch.cuda.is_available():
            ex = ex.model_copy(update={"device": f"cuda:{_worker_index() % torch.cuda.device_count()}"})
        _MODELS.clear()  # one model per process
        _MODELS[key] = make_extractor(ex, min_boxes=min_boxes, max_boxes=max_boxes, feature_dim=feature_dim,
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


@dataclass
class _ChunkWork:
    """A chunk's rows while its pending images are being extracted (rows already written are kept as they are)."""

    chunk: int
    start: int
    pending: np.ndarray
    feats: np.ndarray
    boxes: np.ndarray
    nb: np.ndarray
    size: np.ndarray
    status: np.ndarray
    reasons: list[str]
    todo: int
    t0: float
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # the store's optional per-region arrays


def _open_chunk(store: FeatureStore, chunk: int, items: Sequence[tuple[int, str]]) -> _ChunkWork | None:
    t0 = time.perf_counter()
    start, stop = store.chunk_range(chunk)
    if len(items) != stop - start:
        raise StoreError(f"chunk {chunk} has {stop - start} rows but {len(items)} images were planned")
    ids = store.image_ids(start, stop)  # this chunk's rows only: no whole-array reads per chunk
    if [i for i, _ in items] != ids.tolist():
        raise StoreError(f"chunk {chunk}: planned images do not match the store's rows")
    pending = store.status(start, stop) == PENDING
    if not np.any(pending):
        return None
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
    extras = {k: v.copy() for k, v in old.extras.items()}
    for k, v in extras.items():
        v[pending] = EXTRAS[k][2]
    return _ChunkWork(chunk, start, pending, feats, boxes, nb, size, status, reasons, int(pending.sum()), t0,
                      extras)


def _put(w: _ChunkWork, k: int, r: Any, min_boxes: int, f16: bool) -> None:
    """Row ``k`` of the chunk from an extraction result (Regions) or the exception that replaced it."""
    from captioning.features.images import ImageRejected

    w.todo -= 1
    if isinstance(r, ImageRejected):
        w.status[k], w.reasons[k] = REJECTED, str(r.reason)
        return
    if isinstance(r, Exception):
        w.status[k], w.reasons[k] = REJECTED, f"extraction failed: {r}"
        return
    w.size[k] = r.image_size
    m = r.features.shape[0]
    if m < min_boxes:
        w.status[k], w.reasons[k] = REJECTED, f"only {m} boxes found (< features.min_boxes={min_boxes})"
        return
    if not (np.all(np.isfinite(r.features)) and np.all(np.isfinite(r.boxes))):
        w.status[k], w.reasons[k] = REJECTED, "non-finite features"
        return
    if f16 and not np.all(np.isfinite(r.features.astype(np.float16))):
        w.status[k], w.reasons[k] = REJECTED, "features overflow float16"
        return
    w.feats[k, :m] = r.features
    w.boxes[k, :m] = r.boxes
    w.nb[k] = m
    for name, arr in w.extras.items():  # arrays the extractor does not give (e.g. no attribute head) stay empty
        if r.extras and name in r.extras:
            arr[k, :m] = r.extras[name]


def _write_chunk(store: FeatureStore, w: _ChunkWork, n_items: int) -> ChunkResult:
    # status last: a row is ok only once its data is stored
    store.write_rows(w.start, features=w.feats, boxes=w.boxes, num_boxes=w.nb, image_size=w.size, status=w.status,
                     reject_reason=w.reasons, extras=w.extras or None)
    new_ok = w.pending & (w.status == OK)
    done = int(w.pending.sum())
    return ChunkResult(w.chunk, done, int(new_ok.sum()), done - int(new_ok.sum()), time.perf_counter() - w.t0,
                       boxes=w.nb[new_ok].tolist())


def extract_chunks(
    uri: str,
    chunks: Sequence[tuple[int, Sequence[tuple[int, str]]]],
    ex_json: str,
    min_boxes: int,
    max_boxes: int,
    feature_dim: int,
    threads: int | None = None,
    cache_dir: str | None = None,
    image_store: str | None = None,
) -> list[ChunkResult]:
    """Extract and write whole chunks, streaming their images through one model. Idempotent per chunk.

    An item's path ``blob:<sha256>`` is an image read from the run store ``image_store`` (a worker that cannot see
    the flow's files; :func:`publish_images`).

    The images of all ``chunks`` flow through :meth:`RegionExtractor.stream` (decoding ahead on threads or
    processes, batches across chunk boundaries, box selection overlapped with the device); a chunk is written (by
    a writer thread, off the device's path) as soon as its last image is done, so a killed run loses at most the
    chunks in flight.
    """
    from captioning.features.images import load_rgb
    from captioning.features.stored_images import BLOB, load_stored

    store = FeatureStore.open(uri, mode="r+")
    ex_cfg = ExtractorConfig.model_validate_json(ex_json)
    f16 = store.group["features"].dtype == np.float16
    results: dict[int, ChunkResult] = {}
    work: dict[int, _ChunkWork] = {}
    for chunk, items in chunks:
        w = _open_chunk(store, chunk, items)
        if w is None:
            results[chunk] = ChunkResult(chunk, len(items), 0, 0, 0.0, skipped=True)
        else:
            work[chunk] = w
    if work:
        model = _extractor(ex_json, min_boxes, max_boxes, feature_dim, threads, cache_dir)
        n_items = {c: len(items) for c, items in chunks}

        def jobs():
            for chunk, items in chunks:
                w = work.get(chunk)
                if w is None:
                    continue
                for k, (_, path) in enumerate(items):
                    if not w.pending[k]:
                        continue
                    # a partial, not a lambda: loader processes receive it pickled
                    if path.startswith(BLOB) and image_store:
                        yield (chunk, k), functools.partial(load_stored, image_store, path[len(BLOB):],
                                                            min_side=ex_cfg.min_image_side,
                                                            max_pixels=ex_cfg.max_image_pixels)
                    else:
                        yield (chunk, k), functools.partial(load_rgb, path, min_side=ex_cfg.min_image_side,
                                                            max_pixels=ex_cfg.max_image_pixels)

        with ThreadPoolExecutor(1, thread_name_prefix="capflow-write") as writer:
            writes = {}
            for (chunk, k), r in model.stream(jobs()):
                w = work[chunk]
                _put(w, k, r, min_boxes, f16)
                if w.todo == 0:
                    writes[chunk] = writer.submit(_write_chunk, store, w, n_items[chunk])
            for chunk, fut in writes.items():
                results[chunk] = fut.result()
        unfinished = [c for c, w in work.items() if w.todo]
        if unfinished:  # pragma: no cover - stream() yields every item exactly once
            raise StoreError(f"chunks {unfinished} did not receive every image")
    return [results[c] for c, _ in chunks]


# ---------------------------------------------------------------------- planning
def prepare_store(plan: ExtractPlan, ds: Dataset, uri: str | None = None, describe: dict | None = None,
                  settings: ExtractorConfig | None = None) -> tuple[FeatureStore, int]:
    """Open the store for these settings, appending rows for new dataset images; or create it.

    Returns the store and how many rows were added. Rows are in dataset order (sorted by image id) for a new
    store; appended images follow in the same order. ``settings``: the plan's extractor settings resolved already
    (:func:`captioning.features.settings.effective_config`), when the caller has them.
    """
    uri = uri or store_uri(plan, settings)
    f = plan.features
    ids = image_ids_of(ds)
    if FeatureStore.exists(uri):
        store = FeatureStore.open(uri, mode="r+")
        new = ids[~np.isin(ids, store.image_ids())].tolist()
        if new:
            store.append_images(new)
            store.group.attrs["dataset_digest"] = ds.digest
            log.info("feature store %s: %d new images appended", uri, len(new))
        return store, len(new)
    attrs = {
        "store_key": store_key(f, settings),
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
    if not flavour(f.extractor.flavour).is_stock:
        attrs["bottom_up"] = {"flavour": f.extractor.flavour,
                              "options": resolved_options(f.extractor.flavour, f.extractor.bottom_up),
                              "deviations": deviations(f.extractor.flavour, f.extractor.bottom_up),
                              "layout": checkpoint_layout(f.extractor)}
    if describe:
        attrs["extractor_runtime"] = describe
    store = FeatureStore.create(uri, ids, max_boxes=f.max_boxes, feature_dim=f.feature_dim,
                                chunk_rows=f.chunk_rows, dtype=f.dtype, compressor=f.compressor, attrs=attrs,
                                extras=store_extras(f))
    return store, len(ids)


def iter_chunks(store: FeatureStore, ds: Dataset | DatasetFile, chunks: Iterable[int]
                ) -> Iterator[tuple[int, list[tuple[int, str]]]]:
    """(chunk, [(image_id, path), ...]) for each of ``chunks``, made as they are asked for: the dataset's entries
    are looked up a chunk at a time (``entries_of``), so no list of every image's path is ever held."""
    ids = store.image_ids()
    for c in chunks:
        s, e = store.chunk_range(c)
        try:
            entries = ds.entries_of(ids[s:e])
        except KeyError:
            missing = [int(i) for i in ids[s:e] if not _has(ds, int(i))]
            raise StoreError(f"chunk {c} holds images {missing[:5]} that the dataset no longer has; "
                             "they cannot be extracted (restore them or start a new store)") from None
        yield c, [(en.image_id, str(ds.image_path(en))) for en in entries]


def _has(ds: Dataset | DatasetFile, image_id: int) -> bool:
    try:
        ds.entries_of([image_id])
    except KeyError:
        return False
    return True


def plan_chunks(store: FeatureStore, ds: Dataset | DatasetFile) -> list[tuple[int, list[tuple[int, str]]]]:
    """(chunk, [(image_id, path), ...]) for every chunk with pending rows (a list: small stores, benches)."""
    return list(iter_chunks(store, ds, store.pending_chunks()))


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
    reextracted: list[dict] = field(default_factory=list)  # finished chunks that failed verification, redone
    verified: dict[str, Any] = field(default_factory=dict)  # what the resume check read: chunks, bytes, seconds

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
            "reextracted": self.reextracted,
            "verified": self.verified,
            "seconds": self.seconds,
        }


def _absolute(path: str) -> str:
    """A local path made absolute (against this process's working directory); a URI (``s3://``...) as it is."""
    return path if "://" in path else os.path.abspath(path)


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
    # large torch tensor then costs an mmap/munmap and page faults (CPU extraction measured slower).
    settings: dict[str, Any] = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
    if gpus:  # a GPU worker starts its own decode processes (RegionExtractor's decode_processes): not daemonic
        settings["distributed.worker.daemon"] = False
    with dask.config.set(settings):
        return LocalCluster(n_workers=workers, threads_per_worker=threads_per_worker, processes=True,
                            host="127.0.0.1", dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR, **kw)


def _runs_on_gpu(device: str) -> bool:
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


_AHEAD_PER_WORKER = 8  # extraction tasks submitted per worker ahead of the results


def _chunks_per_task(n_chunks: int, workers: int, gpu: bool) -> int:
    """One chunk per task on CPUs (fine-grained balance); on GPUs enough chunks that a task streams many batches
    (decoding, the device and writing overlap within a task), with ~4 tasks per worker left for balance."""
    if not gpu:
        return 1
    return max(1, min(64, -(-n_chunks // (4 * max(workers, 1)))))


def _groups(todo: Iterable, per: int) -> Iterator[list]:
    """``todo`` in lists of ``per``, taken from it as they are asked for."""
    it = iter(todo)
    while group := list(islice(it, per)):
        yield group


def _gpu_resources(client) -> bool:
    info = client.scheduler_info()
    return any("GPU" in (w.get("resources") or {}) for w in info.get("workers", {}).values())


def extract_features(
    plan: ExtractPlan,
    ds: Dataset,
    *,
    workers: int | None = None,
    client=None,
    uri: str | None = None,
    progress: bool = True,
    threads_per_worker: int | None = None,
    on_chunk: Callable[[ChunkResult], None] | None = None,
) -> ExtractResult:
    """Extract every pending chunk of the store for ``plan``/``ds``. ``workers=0`` runs in this process."""
    from captioning.progress import bar as progress_bar

    t0 = time.perf_counter()
    f = plan.features
    # automatic settings are resolved here, once: they name the store and travel to the workers as they are
    ex = effective_config(f.extractor)
    store, appended = prepare_store(plan, ds, uri, settings=ex)
    # resume: finished chunks whose values fail their checksums (or cannot be read) are marked pending and redone
    check = store.verify(repair=True)
    for fault in check.faults:
        log.warning("feature store %s: %s: extracting it again", store.uri, fault)
    pending = store.pending_chunks()
    # the chunks' (image id, path) lists are made as tasks are submitted (a bounded number ahead), never all at once;
    # every local path a chunk task reads is absolute: a worker of an external cluster has its own working directory
    todo: Iterable[tuple[int, list[tuple[int, str]]]] = (
        (c, [(row, _absolute(path)) for row, path in items]) for c, items in iter_chunks(store, ds, pending))
    ex = ex.model_copy(update={"weights": _absolute(ex.weights)}) if ex.weights else ex
    ex_json = ex.model_dump_json()
    n_workers = f.dask_workers if workers is None else workers
    threads = threads_per_worker or f.extractor.torch_threads
    args = (ex_json, f.min_boxes, f.max_boxes, f.feature_dim, threads, _absolute(str(plan.weights_cache)))
    image_store = None
    if plan.run_store and f.dask_address and client is None and pending:
        # an external cluster under a run store shares no files with this machine: the images go through the store
        from captioning.features.stored_images import publish_images

        image_store = _absolute(plan.run_store)
        todo = publish_images(image_store, ds, todo)
        args = (*args[:-1], None)  # the workers' own weights cache
    uri = _absolute(store.uri)
    skipped = store.num_chunks - len(pending)
    extracted = 0
    rows = sum(b - a for a, b in map(store.chunk_range, pending))
    bar = progress_bar(total=rows, desc="extracting", unit="img", enabled=progress)

    def done(r: ChunkResult) -> None:
        nonlocal extracted
        if not r.skipped:
            extracted += r.images
        bar.update(r.images)
        if on_chunk:
            on_chunk(r)

    try:
        if pending and n_workers == 0 and client is None:
            per = _chunks_per_task(len(pending), 1, _runs_on_gpu(f.extractor.device))
            for group in _groups(todo, per):
                for r in extract_chunks(store.uri, group, *args):
                    done(r)
        elif pending:
            from distributed import Client, as_completed

            own_cluster, own_client = None, client is None
            if client is None:
                if f.dask_address:
                    client = Client(f.dask_address)
                else:
                    own_cluster = local_cluster(n_workers)
                    client = Client(own_cluster)
            try:
                gpu = _gpu_resources(client)
                resources = {"GPU": 1} if gpu else None
                n = max(1, len(client.scheduler_info().get("workers", {})))
                groups = _groups(todo, _chunks_per_task(len(pending), n, gpu))

                def submit(group: list):
                    return client.submit(extract_chunks, uri, group, *args, image_store=image_store,
                                         key=f"extract-{uri}-{group[0][0]}-{group[-1][0]}",
                                         resources=resources, pure=False)

                # a bounded window of tasks: the next is submitted as one finishes (the scheduler never holds
                # every image's path; the workers are kept busy by the tasks queued ahead of them)
                running = as_completed([submit(g) for g in islice(groups, _AHEAD_PER_WORKER * n)])
                for fut in running:
                    for r in fut.result():
                        done(r)
                    nxt = next(groups, None)
                    if nxt is not None:
                        running.add(submit(nxt))
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
                         skipped_chunks=skipped, appended=appended,
                         reextracted=[{"chunk": f.chunk, "rows": list(f.rows), "files": f.files, "problem": f.problem}
                                      for f in check.faults],
                         verified={"chunks": check.checked, "unverified": len(check.unverified),
                                   "bytes": check.bytes, "seconds": round(check.seconds, 3)})
