"""``capflow bench learning``: does the training recipe learn? XE and SCST CIDEr of every model family at small
scale, against the most-frequent-caption baseline, plus SATIC's Table-4 ablation.

Runs the ``learning`` preset (synthetic images, informative region features, demo-size models) through the
same stage functions the pipeline uses: the AIC teacher (XE) -> SeqKD captions of the training images -> each
student family (XE on ground truth; SATIC on SeqKD captions, initialised from the teacher) -> SCST for every
model -> beam-search evaluation on the held-out test split with pycocoevalcap. SATIC K=4 is trained three ways
as in the paper's Table 4: ``base`` (ground truth, random init), ``seqkd`` (SeqKD captions, random init) and
``weight_init`` (SeqKD captions, teacher's weights); ``models["satic"]`` is the ``weight_init`` run.

Ratios (> 1 = the recipe works): ``xe_vs_baseline_min`` (worst model's XE CIDEr / baseline CIDEr),
``scst_vs_xe_min`` (smallest SCST/XE CIDEr ratio over models), ``satic_seqkd_vs_base`` and
``satic_weight_init_vs_seqkd`` (XE CIDEr ratios of the ablation).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from captioning.bench.machine import machine_info
from captioning.config import load_config
from captioning.data.loader import ZarrFeatures
from captioning.data.prepare import ingest, vocab_and_labels
from captioning.data.synthetic_features import informative_store_for
from captioning.metrics.coco import score
from captioning.training.recipe import student_arch, teacher_arch, xe_settings
from captioning.training.stages import StageContext, evaluate, fit_scst, fit_xe, seqkd
from captioning.util import resolve_device

log = logging.getLogger(__name__)
SEQKD = "seqkd:teacher"
_KEEP = ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")


def most_frequent_caption(ctx: StageContext, split: str = "test") -> tuple[str, dict[str, Any]]:
    """The baseline: the most frequent training caption, predicted for every image of ``split``."""
    counts = Counter(ctx.train_captions())
    caption = min(counts, key=lambda c: (-counts[c], c))
    refs = ctx.text_references(split)
    return caption, score({k: caption for k in refs}, refs)


def _summary(ev: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: ev["metrics"].get(k) for k in _KEEP}
    out.update({k: ev[k] for k in ("params", "latency_ms", "avg_length", "novel_fraction", "unique_fraction")})
    return out


def run(preset: str = "learning", overrides: tuple[str, ...] = (), workdir: str | None = None,
        progress: bool = False) -> dict[str, Any]:
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="capflow-bench-learning-")
        workdir = tmp.name
    wd = Path(workdir)
    cfg = load_config(preset, overrides=[f"run.workdir={wd}", *overrides])
    torch.manual_seed(cfg.run.seed)
    t_start = time.perf_counter()
    ds = ingest(cfg, progress=progress)
    store = informative_store_for(cfg, ds, str(wd / "features.zarr"), progress=progress)
    lab = vocab_and_labels(cfg, ds)
    ctx = StageContext(cfg, lab.vocab, lab.labels_uri, ZarrFeatures(store.uri), ds, resolve_device(cfg.run.device),
                       progress)
    d_in, words = cfg.features.feature_dim, cfg.dataset.max_words
    base_caption, base = most_frequent_caption(ctx)
    rows: list[dict[str, Any]] = []

    def train_eval(key: str, arch, *, name: str, xe_cfg, captions="ground_truth", init=None) -> dict[str, Any]:
        t0 = time.perf_counter()
        model, res, info = fit_xe(ctx, arch, wd / key / "xe", settings=xe_settings(xe_cfg, cfg), captions=captions,
                                  seqkd_source=SEQKD if captions != "ground_truth" else None, init_from=init)
        xe_eval = evaluate(ctx, model, arch_name=name)
        t1 = time.perf_counter()
        scst_model, scst_res = fit_scst(ctx, res.best_checkpoint, wd / key / "scst")
        scst_eval = evaluate(ctx, scst_model, arch_name=name)
        out = {"arch": name, "captions": captions, "init": "teacher" if init else "random",
               "init_tensors_loaded": info.get("init_loaded", 0),
               "xe": _summary(xe_eval), "scst": _summary(scst_eval),
               "xe_best_val_cider": res.best_metric, "scst_best_val_cider": scst_res.best_metric,
               "scst_best_epoch": scst_res.best_epoch, "scst_val_cider": [h.get("CIDEr") for h in scst_res.history],
               "xe_seconds": t1 - t0, "scst_seconds": time.perf_counter() - t1,
               "scst_reward": [h.get("reward") for h in scst_res.history]}
        for stage in ("xe", "scst"):
            rows.append({"model": key, "stage": stage, **{k: out[stage][k] for k in ("CIDEr", "Bleu_4", "METEOR")},
                         "params": out[stage]["params"], "latency_ms": out[stage]["latency_ms"]})
        log.info("%s: XE CIDEr %.3f -> SCST %.3f", key, out["xe"]["CIDEr"], out["scst"]["CIDEr"])
        return out, res.best_checkpoint, model

    models: dict[str, Any] = {}
    teacher = teacher_arch(cfg.teacher.model, lab.vocab, d_in, words)
    models["aic"], teacher_ckpt, teacher_model = train_eval("aic", teacher, name=cfg.teacher.model.arch,
                                                            xe_cfg=cfg.teacher.xe)
    kd = seqkd(ctx, teacher_model, SEQKD)
    ablation: dict[str, Any] = {}
    for family in cfg.students.names:
        arch = student_arch(family, cfg.students.size, lab.vocab, d_in, words)
        if family != "satic":
            models[family] = train_eval(family, arch, name=family, xe_cfg=cfg.students.xe)[0]
            continue
        for variant, captions, init in (("base", "ground_truth", None), ("seqkd", "seqkd", None),
                                        ("weight_init", "seqkd", teacher_ckpt)):
            ablation[variant] = train_eval(f"satic-{variant}", arch, name="satic", xe_cfg=cfg.students.xe,
                                           captions=captions, init=init)[0]
        models["satic"] = ablation["weight_init"]

    b = base["metrics"]["CIDEr"]
    ratios: dict[str, float] = {
        "xe_vs_baseline_min": min(m["xe"]["CIDEr"] for m in models.values()) / max(b, 1e-9),
        "scst_vs_xe_min": min(m["scst"]["CIDEr"] / max(m["xe"]["CIDEr"], 1e-9) for m in models.values()),
    }
    if ablation:
        ratios["satic_seqkd_vs_base"] = ablation["seqkd"]["xe"]["CIDEr"] / max(ablation["base"]["xe"]["CIDEr"], 1e-9)
        ratios["satic_weight_init_vs_seqkd"] = (ablation["weight_init"]["xe"]["CIDEr"]
                                                / max(ablation["seqkd"]["xe"]["CIDEr"], 1e-9))
    result = {
        "bench": "learning",
        "machine": machine_info(),
        "preset": preset,
        "images": len(ds.images),
        "splits": {s: len(ds.split(s)) for s in ("train", "val", "test")},
        "baseline_cider": b,
        "baseline_caption": base_caption,
        "baseline_metrics": {k: base["metrics"].get(k) for k in _KEEP},
        "seqkd": kd.to_json(),
        "models": models,
        "satic_ablation": ablation,
        "rows": rows,
        "ratios": ratios,
        "seconds": time.perf_counter() - t_start,
    }
    if tmp is not None:
        tmp.cleanup()
    return result
