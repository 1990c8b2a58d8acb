"""``capflow bench heads``: what the faithful bottom-up detector costs beside the stock detectron2 C4 model.

The anchor is the stock flavour (detectron2's R101-C4: ROIAlignV2, res5 with stride 2, a 7x7 map). The rows
are the stock model and the two bottom-up flavours (Caffe stem pool, ROIPool, res5 with stride 1 and dilation
2: a 14x14 map, about 4x the ROI head's arithmetic) on the same images at the same input size, with random
weights (the cost does not depend on the values). Per image: the backbone, and the ROI head on a fixed set of
``proposals`` boxes (the same boxes for every flavour, so the head's cost is compared at equal work); then the
whole extraction (RPN and box selection included) for each bottom-up flavour. Ratios: each head's time over
the stock head's, measured in the same run.
"""

from __future__ import annotations

import time

import numpy as np


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _boxes(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 1, (n, 2)) * [w * 0.8, h * 0.8]
    wh = rng.uniform(0.05, 0.5, (n, 2)) * [w, h]
    b = np.concatenate([xy, np.minimum(xy + wh, [w - 1, h - 1])], axis=1)
    return b.astype(np.float32)


def run(images: int = 2, proposals: int = 100, min_size: int = 600, max_size: int = 1000, device: str = "cpu",
        threads: int | None = None, seed: int = 0) -> dict:
    import torch

    from captioning.bench.machine import machine_info
    from captioning.config import ExtractorConfig
    from captioning.features.extractor import make_extractor
    from captioning.features.registry import FLAVOURS, STOCK

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(seed)
        shape = (min_size * 3 // 4 * 4 // 3, int(min_size * 4 / 3))  # a COCO-like 4:3 image at the input size
        ims = [rng.integers(0, 256, (*shape, 3), dtype=np.uint8) for _ in range(images)]
        rows, head_ms = [], {}
        for fl in FLAVOURS.values():  # the stock model first: the anchor
            flavour = fl.name
            cfg = ExtractorConfig(flavour=flavour, device=device, min_size=min_size, max_size=max_size,
                                  proposals=proposals, seed=seed)
            ex = make_extractor(cfg, min_boxes=1, max_boxes=max(proposals, 1))
            dev = ex.device
            backbone, head = [], []
            with torch.inference_mode():
                for rep, im in enumerate([ims[0], *ims]):  # the first pass warms up
                    p = ex.prepare(im)
                    h, w = p.shape
                    boxes = torch.from_numpy(_boxes(proposals, h, w, seed)).to(dev)
                    _sync(dev)
                    t0 = time.perf_counter()
                    if fl.is_stock:
                        _, feats = ex._backbone([p.tensor])
                        _sync(dev)
                        t1 = time.perf_counter()
                        from detectron2.structures import Boxes

                        ex._roi(feats, 0, Boxes(boxes))
                    else:
                        res4 = ex.stages.backbone(ex.network_input(p)[None])
                        _sync(dev)
                        t1 = time.perf_counter()
                        ex.stages.head(res4, boxes)
                    _sync(dev)
                    t2 = time.perf_counter()
                    if rep:
                        backbone.append(t1 - t0)
                        head.append(t2 - t1)
                end_to_end = None
                if not fl.is_stock:
                    ex(ims[:1])  # warm
                    t0 = time.perf_counter()
                    ex(ims)
                    end_to_end = (time.perf_counter() - t0) / len(ims)
            head_ms[flavour] = 1000 * float(np.mean(head))
            rows.append({"flavour": flavour, "input": f"{h}x{w}", "proposals": proposals,
                         "backbone_ms": 1000 * float(np.mean(backbone)), "roi_head_ms": head_ms[flavour],
                         "roi_head_ms_per_box": head_ms[flavour] / proposals,
                         "end_to_end_ms": None if end_to_end is None else 1000 * end_to_end})
        return {
            "bench": "heads",
            "machine": machine_info(device=str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev)),
            "params": {"images": images, "proposals": proposals, "min_size": min_size, "max_size": max_size,
                       "device": device, "weights": "random", "seed": seed},
            "rows": rows,
            "ratios": {f"{f}_head_vs_stock": head_ms[f] / head_ms[STOCK.name]
                       for f, fl in FLAVOURS.items() if not fl.is_stock},
        }
    finally:
        torch.set_num_threads(before)
