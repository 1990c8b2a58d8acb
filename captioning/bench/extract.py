"""``capflow bench extract``: extraction throughput of capflow on Dask vs a plain sequential loop.

(a) the anchor, how the original bottom-up-attention scripts work: one process, one model, a loop over the
    images (load, extract, save per-image ``.npy`` files);
(b) capflow with 1 Dask worker writing the chunked Zarr store;
(c) capflow with 2 Dask workers.
Same synthetic images, same extractor settings and the same number of torch threads per model (1 by default,
so that (b) and (a) use the same compute and (c) uses twice that). Throughput is measured in steady state:
every path builds its model(s) and runs a warm-up before the clock starts; start-up times are reported as
separate rows. Ratios: ``dask1_vs_loop`` = (b)/(a) and ``dask2_vs_dask1`` = (c)/(b) images per second.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from captioning.bench.loader import machine_info
from captioning.config import PipelineConfig, load_config
from captioning.data.karpathy import read_karpathy
from captioning.data.stores import FeatureStore
from captioning.data.synthetic import generate_synthetic


def _loop(cfg: PipelineConfig, paths: list[str], out: Path, threads: int) -> tuple[float, float]:
    import torch

    from captioning.features.extractor import RegionExtractor
    from captioning.features.images import load_rgb

    torch.set_num_threads(threads)
    f = cfg.features
    t0 = time.perf_counter()
    model = RegionExtractor(f.extractor, min_boxes=f.min_boxes, max_boxes=f.max_boxes, feature_dim=f.feature_dim)
    model([load_rgb(paths[0])])  # warm-up
    startup = time.perf_counter() - t0
    bs = f.extractor.batch_size
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(0, len(paths), bs):
        batch = paths[i : i + bs]
        regions = model([load_rgb(p) for p in batch])
        for p, r in zip(batch, regions, strict=True):
            stem = Path(p).stem
            np.save(out / f"{stem}_att.npy", r.features.astype(np.float16))
            np.save(out / f"{stem}_box.npy", r.boxes)
    return time.perf_counter() - t0, startup


def _dask(cfg: PipelineConfig, ds, warm_ds, root: Path, workers: int, threads: int) -> tuple[float, float, str]:
    from distributed import Client

    from captioning.features.parallel import extract_features, local_cluster

    t0 = time.perf_counter()
    cluster = local_cluster(workers)
    client = Client(cluster)
    try:
        # warm-up: every worker builds its model on a small store of other images
        extract_features(cfg, warm_ds, client=client, uri=str(root / f"warm-{workers}.zarr"), progress=False,
                         threads_per_worker=threads)
        startup = time.perf_counter() - t0
        uri = str(root / f"dask{workers}.zarr")
        t0 = time.perf_counter()
        extract_features(cfg, ds, client=client, uri=uri, progress=False, threads_per_worker=threads)
        return time.perf_counter() - t0, startup, uri
    finally:
        client.close()
        cluster.close()


def run(images: int = 48, preset: str = "demo", overrides: tuple[str, ...] = (), threads: int = 1,
        workdir: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-extract-") as tmp:
        root = Path(tmp)
        cfg = load_config(preset, overrides=[*overrides, f"run.workdir={root}"])
        s = cfg.dataset.synthetic
        warm_n = 2 * cfg.features.chunk_rows  # one chunk per worker of the 2-worker run
        ann = generate_synthetic(root / "data", images + warm_n, s.seed, min_size=s.min_size, max_size=s.max_size)
        full = read_karpathy(ann, root / "data" / "images", max_reject_fraction=1.0)
        warm = read_karpathy(ann, root / "data" / "images", max_reject_fraction=1.0)
        full.images, warm.images = full.images[warm_n:], full.images[:warm_n]
        paths = [str(full.image_path(e)) for e in full.images]
        loop_s, loop_start = _loop(cfg, paths, root / "npy", threads)
        d1_s, d1_start, uri1 = _dask(cfg, full, warm, root, 1, threads)
        d2_s, d2_start, uri2 = _dask(cfg, full, warm, root, 2, threads)
        a, b = FeatureStore.open(uri1), FeatureStore.open(uri2)
        same = bool(np.array_equal(a.status(), b.status()) and np.array_equal(
            a.read_block(0, a.num_rows).features, b.read_block(0, b.num_rows).features))
        n = len(paths)
        rows = [
            {"path": "loop", "workers": 1, "images": n, "seconds": loop_s, "images_per_second": n / loop_s,
             "startup_seconds": loop_start},
            {"path": "dask", "workers": 1, "images": n, "seconds": d1_s, "images_per_second": n / d1_s,
             "startup_seconds": d1_start},
            {"path": "dask", "workers": 2, "images": n, "seconds": d2_s, "images_per_second": n / d2_s,
             "startup_seconds": d2_start},
        ]
        return {
            "bench": "extract",
            "machine": machine_info(),
            "params": {"images": n, "preset": preset, "threads_per_model": threads,
                       "extractor": cfg.features.extractor.model_dump(mode="json"),
                       "chunk_rows": cfg.features.chunk_rows, "min_boxes": cfg.features.min_boxes,
                       "max_boxes": cfg.features.max_boxes},
            "rows": rows,
            "ratios": {"dask1_vs_loop": loop_s / d1_s, "dask2_vs_dask1": d1_s / d2_s},
            "targets": {"dask1_vs_loop": 0.9, "dask2_vs_dask1": 1.6},
            "stores_identical": same,
        }
