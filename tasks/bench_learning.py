"""``capflow bench learning``: does the training recipe learn? XE and SCST CIDEr of every model family at small
scale, against the most-frequent-caption baseline, plus SATIC's Table-4 ablation.

Runs the ``learning`` preset (synthetic images, informative region features, demo-size models) through the
pipeline's own jobs (:mod:`tasks.data`, :mod:`tasks.training`), with ``evaluation.xe`` on so that every model's
XE weights are scored as well as its SCST weights: the AIC teacher (XE) -> the teacher as an evaluated model
(SCST) -> SeqKD captions of the training images -> each student family as the recipe plans it -> beam-search
evaluation on the held-out test split with pycocoevalcap. SATIC K=4 is trained as the three plans of
:func:`~captioning.training.recipe.satic_ablation` (``base``, ``seqkd``, ``weight_init``); ``models["satic"]``
is the ``weight_init`` run. What the numbers mean and how seeds are aggregated: :mod:`captioning.bench.learning`.

Each seed runs in its own workdir ``seed-<run.seed>`` with the pipeline's stage records, so a bench that was
stopped resumes there, and the stages it finished are not run again.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from captioning.bench.learning import (
    DIVERSITY,
    KEEP,
    aggregate,
    claims,
    family,
    ratios_of,
    rows_of,
    seed_overrides,
    split_digest,
)
from captioning.bench.machine import machine_info
from captioning.config import PipelineConfig, load_config
from captioning.data.karpathy import Dataset
from captioning.metrics import evaluation
from captioning.metrics.coco import METRICS
from captioning.metrics.diversity import repetition_stats
from captioning.training.recipe import model_plan, satic_ablation
from tasks.common import RunContext
from tasks.data import extract, ingest, vocab
from tasks.refs import StudentFailure, StudentResult
from tasks.training import seqkd_captions, student, teacher

log = logging.getLogger(__name__)


def _captions(path: str) -> list[str]:
    return [p["caption"] for p in json.loads(Path(path).read_text(encoding="utf-8"))]


def _summary(metrics: dict[str, Any], figures: dict[str, Any], captions: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: metrics.get(k) for k in KEEP}
    out.update({k: figures[k] for k in ("params", "latency_ms", "avg_length", "novel_fraction", "unique_fraction")})
    rep = repetition_stats(captions)
    out.update({k: rep[k] for k in DIVERSITY})
    return out


def model_figures(r: StudentResult, arch: str) -> dict[str, Any]:
    """One trained model's bench entry from its job's result: the XE and the SCST weights' test figures."""
    if r.xe_evaluation is None or r.xe_predictions is None or "scst" not in r.training:
        raise ValueError(f"{r.label or r.student}: the learning bench needs evaluation.xe and SCST")
    xe_caps, scst_caps = _captions(r.xe_predictions), _captions(r.predictions)
    xe, scst = r.training["xe"], r.training["scst"]
    final = {"params": r.params, "latency_ms": r.latency_ms, "avg_length": r.avg_length,
             "novel_fraction": r.novel_fraction, "unique_fraction": r.unique_fraction}
    return {"arch": arch, "captions": r.captions, "init": "teacher" if r.init_from_teacher else "random",
            "init_tensors_loaded": xe["init"].get("init_loaded", 0),
            "xe": _summary(r.xe_evaluation["metrics"], r.xe_evaluation, xe_caps),
            "scst": _summary(r.metrics, final, scst_caps),
            "xe_best_val_cider": xe["best_metric"], "scst_best_val_cider": scst["best_metric"],
            "scst_best_epoch": scst["best_epoch"], "scst_val_cider": [h.get("CIDEr") for h in scst["history"]],
            "xe_seconds": xe["seconds"], "scst_seconds": scst["seconds"],
            "scst_reward": [h.get("reward") for h in scst["history"]],
            "examples": {"xe": xe_caps[:5], "scst": scst_caps[:5]}}


def run_seed(cfg: PipelineConfig, progress: bool = False) -> dict[str, Any]:
    """One full run of the bench (data, every model's XE and SCST, evaluation) at ``cfg``'s seeds, in its
    ``run.workdir``, by the pipeline's jobs."""
    torch.manual_seed(cfg.run.seed)
    t_start = time.perf_counter()
    rc = RunContext.local(cfg, progress)
    data = ingest(rc)
    feats = extract(rc, data)
    labels = vocab(rc, data, feats)
    ds = Dataset.load(data.path)
    base_caption, base = evaluation.most_frequent_caption(
        [c for e in ds.split("train") for c in e.captions], {e.image_id: list(e.captions) for e in ds.split("test")},
        metrics=METRICS)
    rows: list[dict[str, Any]] = []

    def trained(key: str, plan, arch: str, kd=None) -> dict[str, Any]:
        res = student(rc, plan, data, feats, labels, t, kd)
        if isinstance(res, StudentFailure):
            raise RuntimeError(f"learning bench: {key} failed: {res.error}\n{res.traceback}")
        out = model_figures(res, arch)
        for stage in ("xe", "scst"):
            rows.append({"model": key, "stage": stage, **{k: out[stage][k] for k in ("CIDEr", "Bleu_4", "METEOR")},
                         "params": out[stage]["params"], "latency_ms": out[stage]["latency_ms"],
                         **{k: out[stage][k] for k in DIVERSITY}})
        log.info("%s: XE CIDEr %.3f -> SCST %.3f", key, out["xe"]["CIDEr"], out["scst"]["CIDEr"])
        return out

    models: dict[str, Any] = {}
    t = teacher(rc, data, feats, labels)
    models["aic"] = trained("aic", model_plan(cfg, "teacher"), cfg.teacher.model.arch)
    kd = seqkd_captions(rc, data, feats, labels, t)
    ablation: dict[str, Any] = {}
    for name in cfg.students.names:
        if name != "satic":
            models[name] = trained(name, model_plan(cfg, name), name, kd)
            continue
        for variant, plan in satic_ablation(cfg, name).items():
            ablation[variant] = trained(f"satic-{variant}", plan, name, kd)
        models["satic"] = ablation["weight_init"]

    b = base["metrics"]["CIDEr"]
    return {
        "seed": cfg.run.seed,
        "dataset_seed": cfg.dataset.synthetic.seed,
        "split_digest": split_digest(ds),
        "images": len(ds.images),
        "splits": {s: len(ds.split(s)) for s in ("train", "val", "test")},
        "baseline_cider": b,
        "baseline_caption": base_caption,
        "baseline_metrics": {k: base["metrics"].get(k) for k in KEEP},
        "seqkd": {k: v for k, v in kd.report.items() if k != "reused"},
        "models": models,
        "satic_ablation": ablation,
        "rows": rows,
        "ratios": ratios_of(b, models, ablation),
        "stages": dict(rc.stages),
        "seconds": time.perf_counter() - t_start,
    }


def run(preset: str = "learning", overrides: tuple[str, ...] = (), workdir: str | None = None,
        progress: bool = False, seeds: int = 3, threads: int | None = None) -> dict[str, Any]:
    """The bench over ``seeds`` full runs (see the module's doc); ``workdir`` holds ``seed-<n>/`` per seed (unset:
    a temporary folder); ``threads``: torch threads for the whole bench (None: leave torch's setting)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="capflow-bench-learning-") as tmp:
            return _run(preset, overrides, Path(workdir or tmp), progress, seeds)
    finally:
        torch.set_num_threads(before)


def _run(preset: str, overrides: tuple[str, ...], wd: Path, progress: bool, seeds: int) -> dict[str, Any]:
    t_start = time.perf_counter()
    base_cfg = load_config(preset, overrides=[f"run.workdir={wd}", *overrides])
    runs = []
    for i in range(seeds):
        over = seed_overrides(base_cfg, i)
        seed_wd = wd / f"seed-{base_cfg.run.seed + i}"
        cfg = load_config(preset, overrides=[*overrides, f"run.workdir={seed_wd}", *over, "evaluation.xe=true"])
        log.info("learning bench: seed %d of %d (%s)", i + 1, seeds, ", ".join(over))
        runs.append(run_seed(cfg, progress=progress))

    models = {f: family([r["models"][f] for r in runs]) for f in runs[0]["models"]}
    ablation = {v: family([r["satic_ablation"][v] for r in runs]) for v in runs[0]["satic_ablation"]}
    if "satic" in models and ablation:
        models["satic"] = ablation["weight_init"]
    base_mean, base_sd, base_per = aggregate([r["baseline_cider"] for r in runs])
    captions = Counter(r["baseline_caption"] for r in runs)
    return {
        "bench": "learning",
        "machine": machine_info(),
        "preset": preset,
        "seeds": seeds,
        "run_seeds": [r["seed"] for r in runs],
        "dataset_seeds": [r["dataset_seed"] for r in runs],
        "split_digests": [r["split_digest"] for r in runs],
        "images": aggregate([r["images"] for r in runs])[0],
        "splits": aggregate([r["splits"] for r in runs])[0],
        "baseline_cider": base_mean,
        "baseline_cider_sd": base_sd,
        "baseline_cider_per_seed": base_per,
        "baseline_caption": min(captions, key=lambda c: (-captions[c], c)),
        "baseline_captions": [r["baseline_caption"] for r in runs],
        "baseline_metrics": aggregate([r["baseline_metrics"] for r in runs])[0],
        "seqkd": aggregate([r["seqkd"] for r in runs])[0],
        "models": models,
        "satic_ablation": ablation,
        "rows": rows_of(runs),
        "ratios": ratios_of(base_mean, models, ablation),
        "claims": claims(runs),
        "runs": runs,
        "seconds": time.perf_counter() - t_start,
    }
