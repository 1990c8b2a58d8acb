"""``capflow bench loader``: training batches per second from the Zarr store vs per-image ``.npy`` files vs
the same arrays in memory (the limit), same data, same batch size, same loader code, one run.

The data are synthetic with the shape of bottom-up features: per image 10..100 boxes of 2048-d (float32 in the
``.npy`` files as in the repositories that use them, float16 in the store and in memory, which is what every
path delivers to the model). Each path is timed twice: with the OS page cache holding the files ("warm"), and
after asking the kernel to drop the files' cached pages (``posix_fadvise(DONTNEED)``, "cold"), which is the
situation of a real run whose 50 GB of COCO features do not fit in memory. The headline ratios use the cold
passes; the warm numbers are reported beside them.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from captioning.bench.machine import machine_info
from captioning.data.loader import CaptionDataset, MemoryFeatures, NpyFeatures, ZarrFeatures, make_loader
from captioning.data.stores import OK, FeatureStore, Labels, LabelStore


def _drop_cache(root: Path) -> int:
    """Ask the kernel to evict cached pages of every file under root; returns how many files."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def make_data(root: Path, images: int, max_boxes: int, dim: int, chunk_rows: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = np.arange(1, images + 1, dtype=np.int64) * 7
    nb = rng.integers(min(10, max_boxes), max_boxes + 1, size=images)
    feats = np.zeros((images, max_boxes, dim), np.float16)
    boxes = np.zeros((images, max_boxes, 4), np.float32)
    att, box = root / "npy" / "att", root / "npy" / "box"
    att.mkdir(parents=True)
    box.mkdir(parents=True)
    for i in range(images):
        f = np.maximum(rng.standard_normal((nb[i], dim), dtype=np.float32), 0)  # ReLU-like, as real features
        xy = rng.random((nb[i], 2), dtype=np.float32) * 0.5
        b = np.concatenate([xy, xy + 0.1 + rng.random((nb[i], 2), dtype=np.float32) * 0.4], 1)
        feats[i, : nb[i]] = f
        boxes[i, : nb[i]] = b
        np.save(att / f"{ids[i]}.npy", f)
        np.save(box / f"{ids[i]}.npy", b)
    store = FeatureStore.create(str(root / "features.zarr"), ids, max_boxes=max_boxes, feature_dim=dim,
                                chunk_rows=chunk_rows)
    for c in range(store.num_chunks):
        s, e = store.chunk_range(c)
        store.write_rows(s, features=feats[s:e], boxes=boxes[s:e], num_boxes=nb[s:e],
                         image_size=np.full((e - s, 2), 480, np.int32), status=np.full(e - s, OK, np.int8))
    caps = 5
    m = images * caps
    lengths = rng.integers(5, 17, size=m)
    tokens = np.zeros((m, 16), np.int32)
    for k in range(m):
        tokens[k, : lengths[k]] = rng.integers(3, 1000, size=lengths[k])
    rows = np.repeat(np.arange(images), caps)
    labels = Labels(tokens, lengths, rows, ids[rows], np.zeros(m, np.int8), np.zeros(m, np.int8), {0: "gt"})
    LabelStore.create(str(root / "labels.zarr"), tokens, lengths, rows, ids[rows], np.zeros(m, np.int8))
    return {"ids": ids, "features": feats, "boxes": boxes, "num_boxes": nb, "labels": labels,
            "att": att, "box": box}


def _time_epochs(ds: CaptionDataset, batch_size: int, workers: int, epochs: int,
                 before_epoch=None) -> tuple[float, int, float]:
    """Seconds, batches and a checksum of the features delivered, over ``epochs`` passes (reshuffled each)."""
    loader = make_loader(ds, batch_size, workers=workers)
    n = 0
    checksum = 0.0
    seconds = 0.0
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch()
        ds.set_epoch(epoch)
        t0 = time.perf_counter()
        for batch in loader:
            n += 1
            checksum += float(batch.features[..., :8].double().sum()) + float(batch.boxes.double().sum())
        seconds += time.perf_counter() - t0
    return seconds, n, checksum


def run(images: int = 1000, batch_size: int = 50, max_boxes: int = 100, dim: int = 2048, chunk_rows: int = 8,
        workers: int = 0, repeats: int = 2, epochs: int = 2, workdir: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-loader-") as tmp:
        root = Path(tmp)
        data = make_data(root, images, max_boxes, dim, chunk_rows)
        labels = data["labels"]
        sources = {
            "zarr": (lambda: ZarrFeatures(str(root / "features.zarr")), root / "features.zarr"),
            "npy": (lambda: NpyFeatures(data["att"], data["box"], data["ids"], block_rows=chunk_rows), root / "npy"),
            "memory": (lambda: MemoryFeatures(data["features"], data["boxes"], data["num_boxes"], data["ids"],
                                              block_rows=chunk_rows), None),
        }
        rows = []
        best: dict[tuple[str, str], float] = {}
        checks: dict[str, float] = {}
        for cache in ("warm", "cold"):
            for name, (make, files) in sources.items():
                if cache == "cold" and files is None:
                    continue  # memory has no files: its warm number is the limit for both
                drop = (lambda f=files: _drop_cache(f)) if cache == "cold" else None
                ds = CaptionDataset(make(), labels=labels, split="train", captions_per_image=5, shuffle=True, seed=0)
                if cache == "warm":
                    _time_epochs(ds, batch_size, workers, 1)  # fills the page cache, warms up code paths
                for rep in range(repeats):
                    sec, n, chk = _time_epochs(ds, batch_size, workers, epochs, drop)
                    bps = n / sec
                    rows.append({"source": name, "cache": cache, "repeat": rep, "workers": workers, "batches": n,
                                 "seconds": sec, "batches_per_second": bps, "images_per_second": bps * batch_size})
                    best[(name, cache)] = max(best.get((name, cache), 0.0), bps)
                    checks.setdefault(name, chk)
        # every source delivered the same features (same shuffles): otherwise the comparison is void
        ref = checks["memory"]
        for name, chk in checks.items():
            if abs(chk - ref) > 1e-6 * max(1.0, abs(ref)):
                raise RuntimeError(f"source {name} delivered different data (checksum {chk} vs {ref})")
        mem = best[("memory", "warm")]
        ratios = {
            "zarr_vs_npy": best[("zarr", "cold")] / best[("npy", "cold")],
            "zarr_vs_memory": best[("zarr", "cold")] / mem,
            "zarr_vs_npy_warm": best[("zarr", "warm")] / best[("npy", "warm")],
            "zarr_vs_memory_warm": best[("zarr", "warm")] / mem,
        }
        return {
            "bench": "loader",
            "machine": machine_info(),
            "params": {"images": images, "batch_size": batch_size, "max_boxes": max_boxes, "feature_dim": dim,
                       "chunk_rows": chunk_rows, "workers": workers, "repeats": repeats, "epochs": epochs,
                       "captions_per_image": 5},
            "rows": rows,
            "ratios": ratios,
            "targets": {"zarr_vs_npy": 3.0, "zarr_vs_memory": 0.5},
        }
