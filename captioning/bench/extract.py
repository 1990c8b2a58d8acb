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

from captioning.bench.machine import machine_info
from captioning.config import PipelineConfig, load_config
from captioning.data.karpathy import read_karpathy
from captioning.data.plans import extract_plan
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
    bs = model.cfg.batch_size
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
        extract_features(extract_plan(cfg), warm_ds, client=client, uri=str(root / f"warm-{workers}.zarr"),
                         progress=False, threads_per_worker=threads)
        startup = time.perf_counter() - t0
        uri = str(root / f"dask{workers}.zarr")
        t0 = time.perf_counter()
        extract_features(extract_plan(cfg), ds, client=client, uri=uri, progress=False, threads_per_worker=threads)
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


# ---------------------------------------------------------------------- the GPU benchmark (--device cuda)
def reference_extract(model, images: list[np.ndarray]) -> list:
    """Today's path before the GPU work, kept as the anchor: same-shape batches, the ROI head image by image,
    the per-class NMS loop on the device (:func:`nms_max_conf_reference`), host syncs per image."""
    import torch

    from captioning.features.extractor import Regions
    from captioning.features.selection import nms_max_conf_reference

    out: list = [None] * len(images)
    with torch.inference_mode(), model._autocast():
        for idx, shape in model._batches(images):
            tensors = [model._to_tensor(images[i], shape) for i in idx]
            imgs, features = model._backbone(tensors)
            proposals, _ = model.model.proposal_generator(imgs, features, None)
            for j, i in enumerate(idx):
                boxes = proposals[j].proposal_boxes
                pooled, probs = model._roi(features, j, boxes)
                model._check_finite(i, pooled, probs)
                max_conf = nms_max_conf_reference(boxes.tensor.float(), probs[:, :-1], model.cfg.nms_threshold)
                max_conf = max_conf.cpu().numpy()
                keep = model._select(max_conf)
                h, w = shape
                keep_t = torch.from_numpy(keep).to(pooled.device)
                b = boxes.tensor.float().index_select(0, keep_t).cpu().numpy()
                rel = np.clip(b / np.array([w, h, w, h], dtype=np.float32), 0.0, 1.0).astype(np.float32)
                out[i] = Regions(features=pooled.index_select(0, keep_t).cpu().numpy().astype(np.float32),
                                 boxes=rel, scores=max_conf[keep].astype(np.float32),
                                 image_size=(int(images[i].shape[0]), int(images[i].shape[1])))
    return out


def agreement(a: list, b: list) -> dict:
    """How closely two extractions of the same images agree: equal box counts, kept-box overlap (boxes matched
    by coordinates within 1e-3 of the image size; matched / union), cosine of the matched boxes' features."""
    same_n, overlaps, cos = 0, [], []
    for ra, rb in zip(a, b, strict=True):
        same_n += int(len(ra) == len(rb))
        if len(ra) == 0 or len(rb) == 0:
            overlaps.append(float(len(ra) == len(rb)))
            continue
        d = np.abs(ra.boxes[:, None, :] - rb.boxes[None, :, :]).max(-1)  # (na, nb)
        match = np.argmin(d, axis=1)
        ok = d[np.arange(len(ra)), match] < 1e-3
        overlaps.append(float(ok.sum()) / (len(ra) + len(rb) - ok.sum()))
        if ok.any():
            fa, fb = ra.features[ok].astype(np.float64), rb.features[match[ok]].astype(np.float64)
            num = (fa * fb).sum(1)
            den = np.linalg.norm(fa, axis=1) * np.linalg.norm(fb, axis=1)
            cos.extend((num / np.maximum(den, 1e-12)).tolist())
    n = max(len(a), 1)
    return {"images": len(a), "num_boxes_equal": same_n / n, "kept_box_overlap_mean": float(np.mean(overlaps)),
            "kept_box_overlap_min": float(np.min(overlaps)) if overlaps else 1.0,
            "feature_cosine_mean": float(np.mean(cos)) if cos else None,
            "feature_cosine_min": float(np.min(cos)) if cos else None}


def _gpu_dataset(root: Path, images: int, images_dir: str | None, seed: int):
    """``images`` image files (copies of the real JPEGs in ``images_dir`` when given, else synthetic COCO-sized
    pictures) with a minimal Karpathy annotation file; returns the dataset."""
    import json
    import os
    import shutil

    img_root = root / "images"
    img_root.mkdir(parents=True)
    if images_dir:
        src = sorted(p for p in Path(images_dir).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        if not src:
            raise ValueError(f"no .jpg/.png images in {images_dir}")
    else:
        ann = generate_synthetic(root / "synthetic", min(images, 64), seed, min_size=400, max_size=640)
        src = [Path(ann).parent / "images" / e.get("filepath", "") / e["filename"]
               for e in json.loads(Path(ann).read_text())["images"]]
    entries = []
    for i in range(images):
        s = src[i % len(src)]
        name = f"{i:06d}{s.suffix.lower()}"
        try:
            os.link(s, img_root / name)  # same bytes, no copy
        except OSError:
            shutil.copyfile(s, img_root / name)
        split = "train" if i % 10 < 8 else ("val" if i % 10 == 8 else "test")
        entries.append({"filename": name, "imgid": i, "cocoid": i + 1, "split": split,
                        "sentences": [{"tokens": ["a", "picture"], "raw": "a picture"}]})
    ann_path = root / "dataset.json"
    ann_path.write_text(json.dumps({"images": entries}))
    return read_karpathy(ann_path, img_root, max_reject_fraction=1.0)


def _reference_run(cfg: PipelineConfig, ds, uri: str, images: int) -> tuple[float, int]:
    """The anchor end to end (files -> Zarr, one process): load each chunk's images, reference extraction, write."""
    from captioning.features.extractor import RegionExtractor
    from captioning.features.images import ImageRejected, load_rgb
    from captioning.features.parallel import _open_chunk, _put, _write_chunk, plan_chunks, prepare_store

    f = cfg.features
    ex = f.extractor.model_copy(update={"batching": "exact", "decode_threads": 0, "decode_processes": 0, "amp": False,
                                        "channels_last": False})
    model = RegionExtractor(ex, min_boxes=f.min_boxes, max_boxes=f.max_boxes, feature_dim=f.feature_dim)
    sub = _subset(ds, images)
    store, _ = prepare_store(extract_plan(cfg), sub, uri)
    todo = plan_chunks(store, sub)
    reference_extract(model, [load_rgb(todo[0][1][0][1])])  # warm-up
    f16 = store.group["features"].dtype == np.float16
    t0 = time.perf_counter()
    n = 0
    for c, items in todo:
        w = _open_chunk(store, c, items)
        pix, ks, res = [], [], {}
        for k, (_, p) in enumerate(items):
            try:
                pix.append(load_rgb(p, min_side=ex.min_image_side, max_pixels=ex.max_image_pixels))
                ks.append(k)
            except ImageRejected as e:
                res[k] = e
        for k, r in zip(ks, reference_extract(model, pix), strict=True):
            res[k] = r
        for k in sorted(res):
            _put(w, k, res[k], f.min_boxes, f16)
        _write_chunk(store, w, len(items))
        n += len(items)
    return time.perf_counter() - t0, n


def _subset(ds, n: int):
    import copy

    sub = copy.copy(ds)
    sub.images = ds.images[:n]
    return sub


def _profile(cfg: PipelineConfig, ds, n: int, uri: str) -> dict:
    """Seconds per image of each stage, measured one after the other with device syncs (no overlap)."""
    from captioning.data.stores import FeatureStore
    from captioning.features.extractor import RegionExtractor
    from captioning.features.images import load_rgb

    f = cfg.features
    model = RegionExtractor(f.extractor.model_copy(update={"decode_threads": 0}), min_boxes=f.min_boxes,
                            max_boxes=f.max_boxes, feature_dim=f.feature_dim)
    paths = [str(ds.image_path(e)) for e in ds.images[:n]]
    model([load_rgb(paths[0])])  # warm-up
    t = {"load": 0.0, "preprocess": 0.0}
    prepared = []
    for i, p in enumerate(paths):
        t0 = time.perf_counter()
        img = load_rgb(p)
        t1 = time.perf_counter()
        prepared.append(model.prepare(img, i))
        t["load"] += t1 - t0
        t["preprocess"] += time.perf_counter() - t1
    groups: dict = {}
    for p in prepared:
        groups.setdefault(model._group_key(p), []).append(p)
    bs = model.cfg.batch_size
    batches = [g[i : i + bs] for g in groups.values() for i in range(0, len(g), bs)]
    model.profile = {}
    regions = []
    for b in batches:
        model._last_mark = time.perf_counter()
        regions.extend(r for _, r in model._finish(model._detect_safe(b)[0]))
    t.update({k: v for k, v in model.profile.items() if k != "wait"})
    store = FeatureStore.create(uri, list(range(len(regions))), max_boxes=f.max_boxes, feature_dim=f.feature_dim,
                                chunk_rows=f.chunk_rows, dtype=f.dtype, compressor=f.compressor)
    t0 = time.perf_counter()
    cr = f.chunk_rows
    for s in range(0, len(regions) - len(regions) % cr, cr):
        feats = np.zeros((cr, f.max_boxes, f.feature_dim), np.float32)
        boxes = np.zeros((cr, f.max_boxes, 4), np.float32)
        nb = np.zeros(cr, np.int16)
        for k, r in enumerate(regions[s : s + cr]):
            m = len(r)
            feats[k, :m], boxes[k, :m], nb[k] = r.features, r.boxes, m
        store.write_rows(s, features=feats, boxes=boxes, num_boxes=nb, image_size=np.zeros((cr, 2), np.int32),
                         status=np.ones(cr, np.int8), reject_reason=[""] * cr)
    t["write"] = time.perf_counter() - t0
    return {k: 1000 * v / len(paths) for k, v in t.items()}


def run_gpu(images: int = 1080, preset: str = "coco", overrides: tuple[str, ...] = (),
            images_dir: str | None = None, reference_images: int = 216, agreement_images: int = 64,
            workdir: str | None = None, device: str = "cuda") -> dict:
    """``capflow bench extract --device cuda``: the GPU path end to end (image files -> Zarr through one Dask GPU
    worker) against the anchor (today's path before the GPU work: one process, reference selection), at the
    preset's extractor settings with random weights; per-stage breakdown; reduced-precision and padded-batching
    agreement with fp32/exact; ``ratios.speedup_vs_reference``."""
    import torch

    from captioning.data.stores import FeatureStore
    from captioning.features.extractor import RegionExtractor
    from captioning.features.images import load_rgb
    from captioning.features.parallel import extract_features
    from captioning.features.settings import effective_config

    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-extract-gpu-") as tmp:
        root = Path(tmp)
        # the stock detectron2 model (the bottom-up flavours' cost: capflow bench heads)
        cfg = load_config(preset, overrides=["features.extractor.weights=null", f"features.extractor.device={device}",
                                             "features.extractor.flavour=stock", *overrides, f"run.workdir={root}"])
        f = cfg.features
        ds = _gpu_dataset(root / "data", images, images_dir, cfg.run.seed)
        rows = []

        ref_s, ref_n = _reference_run(cfg, ds, str(root / "reference.zarr"), min(reference_images, images))
        rows.append({"path": "reference", "batching": "exact", "precision": "fp32", "images": ref_n,
                     "seconds": ref_s, "images_per_second": ref_n / ref_s})

        from distributed import Client

        from captioning.features.parallel import local_cluster

        cluster = local_cluster(1)
        client = Client(cluster)

        def pipeline(name: str, **update) -> float:
            c = cfg.model_copy(deep=True)
            c.features.extractor = effective_config(c.features.extractor.model_copy(update=update))
            warm = _subset(ds, 4 * c.features.extractor.batch_size)  # the worker builds this variant's model
            extract_features(extract_plan(c), warm, client=client, uri=str(root / f"warm-{name}.zarr"), progress=False)
            t0 = time.perf_counter()
            res = extract_features(extract_plan(c), ds, client=client, uri=str(root / f"{name}.zarr"), progress=False)
            s = time.perf_counter() - t0
            ex = c.features.extractor
            rows.append({"path": "capflow", "variant": name, "workers": 1, "batching": ex.batching,
                         "batch_size": ex.batch_size, "precision": ex.amp_dtype if ex.amp else "fp32",
                         "selection_on_device": bool(ex.selection_on_device),
                         "channels_last": ex.channels_last is not False,
                         "decode_processes": ex.decode_processes,
                         "images": res.extracted, "ok": res.ok, "seconds": s,
                         "images_per_second": res.extracted / s})
            return res.extracted / s

        variants = {"device-selection": {"selection_on_device": True},
                    "decode-processes": {"decode_processes": 8},
                    "contiguous": {"channels_last": False},
                    "exact-fp32": {"batching": "exact", "amp": False},
                    "padded-bf16": {"batching": "padded", "amp": True, "amp_dtype": "bfloat16"},
                    "padded-fp16": {"batching": "padded", "amp": True, "amp_dtype": "float16"}}
        try:
            default_ips = pipeline("default")
            for name, upd in variants.items():
                pipeline(name, **upd)
        finally:
            client.close()
            cluster.close()

        # agreement on real pixels: reference (fp32, exact) vs each variant, the same images
        sample = [load_rgb(ds.image_path(e)) for e in ds.images[: min(agreement_images, images)]]

        def regions(**update):
            m = RegionExtractor(f.extractor.model_copy(update=update), min_boxes=f.min_boxes,
                                max_boxes=f.max_boxes, feature_dim=f.feature_dim)
            return m(sample)

        base = regions(batching="exact", amp=False, channels_last=False)
        agree = {"exact_vs_reference": agreement(reference_extract(
            RegionExtractor(f.extractor.model_copy(update={"batching": "exact", "amp": False, "channels_last": False}),
                            min_boxes=f.min_boxes, max_boxes=f.max_boxes, feature_dim=f.feature_dim), sample), base)}
        for name, upd in {"exact-fp32-channels-last": {"batching": "exact", "amp": False, "channels_last": True},
                          "padded-fp32": {"batching": "padded", "amp": False},
                          **{k: v for k, v in variants.items() if "16" in k}}.items():
            agree[f"{name}_vs_exact-fp32"] = agreement(base, regions(**upd))
        prof = _profile(cfg, ds, min(128, images), str(root / "profile.zarr"))
        st = FeatureStore.open(str(root / "default.zarr")).summary()
        return {
            "bench": "extract-gpu",
            "machine": {**machine_info(), "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                        else "cpu"},
            "params": {"images": images, "preset": preset, "images_dir": images_dir,
                       "reference_images": ref_n, "extractor": f.extractor.model_dump(mode="json"),
                       "chunk_rows": f.chunk_rows, "min_boxes": f.min_boxes, "max_boxes": f.max_boxes},
            "rows": rows,
            "stage_ms_per_image": prof,
            "agreement": agree,
            "default_store": {"ok": st["ok"], "rejected": len(st["rejected"]), "boxes": st["boxes"]},
            "ratios": {"speedup_vs_reference": default_ips / (ref_n / ref_s)},
            "targets": {"speedup_vs_reference": 8.0, "images_per_second": 100.0},
        }
