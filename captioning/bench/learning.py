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
``satic_weight_init_vs_seqkd`` (XE CIDEr ratios of the ablation); per family ``xe_vs_baseline_<family>`` and
``scst_vs_xe_<family>``.

Seeds (``seeds``, default 3): seed ``i`` is a full run with ``run.seed`` and ``dataset.synthetic.seed`` both
raised by ``i`` over the preset's (so the synthetic images, their train/val/test split, the informative
features' projection, the initialisation, the batch order and the SCST samples all change), in its own
workdir ``seed-<run.seed>``. Every number is reported as the mean over seeds (the keys a single run has, so
``models[f]["xe"]["CIDEr"]`` is the mean), with the sample standard deviation next to it (``..._sd`` in rows,
``models[f]["sd"]``) and the per-seed values (``models[f]["per_seed"]``, ``runs``). Ratios are computed on the
means; ``claims`` counts the seeds in which each claim holds: ``scst_gt_xe`` (test CIDEr, per family),
``xe_vs_baseline_3x`` (per family) and ``satic_order`` (XE CIDEr base < +SeqKD < +weight-init).
Each row also carries the test captions' diversity (:func:`~captioning.metrics.diversity.repetition_stats`):
``distinct_captions``, ``distinct_fraction``, ``repeat_caption_fraction``, ``repeated_token_rate``.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from captioning.bench.machine import machine_info
from captioning.config import load_config
from captioning.data.loader import ZarrFeatures
from captioning.data.plans import extract_plan, ingest_plan, vocab_plan
from captioning.data.prepare import ingest, vocab_and_labels
from captioning.data.synthetic_features import informative_store_for
from captioning.metrics import evaluation
from captioning.metrics.coco import METRICS
from captioning.metrics.diversity import repetition_stats
from captioning.training.recipe import stage_plan, student_arch, teacher_arch, xe_settings
from captioning.training.stages import StageContext, evaluate, fit_scst, fit_xe, seqkd
from captioning.util import resolve_device
from captioning.workdir import Workdir

log = logging.getLogger(__name__)
SEQKD = "seqkd:teacher"
_KEEP = ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")
_DIVERSITY = ("distinct_captions", "distinct_fraction", "repeat_caption_fraction", "repeated_token_rate")
_ROW_SD = ("CIDEr", "Bleu_4", "METEOR", *_DIVERSITY)  # row numbers that get a ``_sd`` next to their mean


def most_frequent_caption(ctx: StageContext, split: str = "test") -> tuple[str, dict[str, Any]]:
    """The baseline: the most frequent training caption, predicted for every image of ``split`` (all metrics)."""
    return evaluation.most_frequent_caption(ctx.train_captions(), ctx.text_references(split), metrics=METRICS)


def _summary(ev: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: ev["metrics"].get(k) for k in _KEEP}
    out.update({k: ev[k] for k in ("params", "latency_ms", "avg_length", "novel_fraction", "unique_fraction")})
    rep = repetition_stats(p["caption"] for p in ev["predictions"])
    out.update({k: rep[k] for k in _DIVERSITY})
    return out


def seed_overrides(cfg, index: int) -> list[str]:
    """Overrides of seed ``index`` (0-based): ``run.seed`` and the synthetic dataset's seed, each + index."""
    return [f"run.seed={cfg.run.seed + index}", f"dataset.synthetic.seed={cfg.dataset.synthetic.seed + index}"]


def split_digest(ds) -> str:
    """A short digest of which image files are in which split (changes when the split changes)."""
    h = hashlib.sha256()
    for s in ("train", "val", "test"):
        for f in sorted(e.file for e in ds.split(s)):
            h.update(f"{s}:{f}\n".encode())
    return h.hexdigest()[:16]


def run_seed(cfg, wd: Path, progress: bool = False) -> dict[str, Any]:
    """One full run of the bench (data, every model's XE and SCST, evaluation) at ``cfg``'s seeds in ``wd``."""
    torch.manual_seed(cfg.run.seed)
    t_start = time.perf_counter()
    ds = ingest(ingest_plan(cfg), progress=progress)
    store = informative_store_for(extract_plan(cfg), ds, str(wd / "features.zarr"), progress=progress)
    lab = vocab_and_labels(vocab_plan(cfg), ds, Workdir.of(cfg).stage_dir("vocab", ds.digest))
    ctx = StageContext(stage_plan(cfg), lab.vocab, lab.labels_uri, ZarrFeatures(store.uri), ds,
                       resolve_device(cfg.run.device), progress)
    d_in, words = cfg.features.feature_dim, cfg.dataset.max_words
    base_caption, base = most_frequent_caption(ctx)
    rows: list[dict[str, Any]] = []

    def train_eval(key: str, arch, *, name: str, xe_cfg, captions="ground_truth", init=None) -> dict[str, Any]:
        t0 = time.perf_counter()
        model, res, info = fit_xe(ctx, arch, wd / key / "xe", settings=xe_settings(xe_cfg, cfg), captions=captions,
                                  seqkd_source=SEQKD if captions != "ground_truth" else None, init_from=init)
        xe_eval = evaluate(ctx, model, arch_name=name)
        t1 = time.perf_counter()
        scst_model, scst_res = fit_scst(ctx, res.best_checkpoint, wd / key / "scst", student=name)
        scst_eval = evaluate(ctx, scst_model, arch_name=name)
        out = {"arch": name, "captions": captions, "init": "teacher" if init else "random",
               "init_tensors_loaded": info.get("init_loaded", 0),
               "xe": _summary(xe_eval), "scst": _summary(scst_eval),
               "xe_best_val_cider": res.best_metric, "scst_best_val_cider": scst_res.best_metric,
               "scst_best_epoch": scst_res.best_epoch, "scst_val_cider": [h.get("CIDEr") for h in scst_res.history],
               "xe_seconds": t1 - t0, "scst_seconds": time.perf_counter() - t1,
               "scst_reward": [h.get("reward") for h in scst_res.history],
               "examples": {"xe": [p["caption"] for p in xe_eval["predictions"][:5]],
                            "scst": [p["caption"] for p in scst_eval["predictions"][:5]]}}
        for stage in ("xe", "scst"):
            rows.append({"model": key, "stage": stage, **{k: out[stage][k] for k in ("CIDEr", "Bleu_4", "METEOR")},
                         "params": out[stage]["params"], "latency_ms": out[stage]["latency_ms"],
                         **{k: out[stage][k] for k in _DIVERSITY}})
        log.info("%s: XE CIDEr %.3f -> SCST %.3f", key, out["xe"]["CIDEr"], out["scst"]["CIDEr"])
        return out, res.best_checkpoint, model

    models: dict[str, Any] = {}
    teacher = teacher_arch(cfg.teacher.model, lab.vocab, d_in, words, standardize=cfg.loader.standardize_features)
    models["aic"], teacher_ckpt, teacher_model = train_eval("aic", teacher, name=cfg.teacher.model.arch,
                                                            xe_cfg=cfg.teacher.xe)
    kd = seqkd(ctx, teacher_model, SEQKD)
    ablation: dict[str, Any] = {}
    for family in cfg.students.names:
        arch = student_arch(family, cfg.students.size, lab.vocab, d_in, words,
                            standardize=cfg.loader.standardize_features)
        if family != "satic":
            models[family] = train_eval(family, arch, name=family, xe_cfg=cfg.students.xe)[0]
            continue
        for variant, captions, init in (("base", "ground_truth", None), ("seqkd", "seqkd", None),
                                        ("weight_init", "seqkd", teacher_ckpt)):
            ablation[variant] = train_eval(f"satic-{variant}", arch, name="satic", xe_cfg=cfg.students.xe,
                                           captions=captions, init=init)[0]
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
        "baseline_metrics": {k: base["metrics"].get(k) for k in _KEEP},
        "seqkd": kd.to_json(),
        "models": models,
        "satic_ablation": ablation,
        "rows": rows,
        "ratios": ratios_of(b, models, ablation),
        "seconds": time.perf_counter() - t_start,
    }


def ratios_of(baseline: float, models: dict[str, Any], ablation: dict[str, Any]) -> dict[str, float]:
    """The bench's ratios (> 1 = better) from (mean) test CIDEr values."""
    xe = {k: m["xe"]["CIDEr"] for k, m in models.items()}
    scst = {k: m["scst"]["CIDEr"] for k, m in models.items()}
    ratios: dict[str, float] = {
        "xe_vs_baseline_min": min(xe.values()) / max(baseline, 1e-9),
        "scst_vs_xe_min": min(scst[k] / max(xe[k], 1e-9) for k in models),
    }
    if ablation:
        ratios["satic_seqkd_vs_base"] = ablation["seqkd"]["xe"]["CIDEr"] / max(ablation["base"]["xe"]["CIDEr"], 1e-9)
        ratios["satic_weight_init_vs_seqkd"] = (ablation["weight_init"]["xe"]["CIDEr"]
                                                / max(ablation["seqkd"]["xe"]["CIDEr"], 1e-9))
    for k in models:
        ratios[f"xe_vs_baseline_{k}"] = xe[k] / max(baseline, 1e-9)
        ratios[f"scst_vs_xe_{k}"] = scst[k] / max(xe[k], 1e-9)
    return ratios


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sd(values: list[float]) -> float | None:
    """Sample standard deviation (n - 1); None for a single seed."""
    return statistics.stdev(values) if len(values) > 1 else None


def aggregate(items: list[Any]) -> tuple[Any, Any, Any]:
    """Per-seed values of the same shape -> (mean, sd, per-seed values), recursively.

    Numbers: their mean, sample sd (None for one seed) and list. Dicts: key by key (the first item's keys).
    Lists of equal length: element by element; otherwise the per-seed lists. Anything else (strings, None,
    booleans): the common value if all seeds agree, else the per-seed list; its sd is None. A number that is
    None in some seed is not averaged (mean None)."""
    first = items[0]
    if all(_is_num(v) for v in items):
        vals = [float(v) for v in items]
        return statistics.fmean(vals), _sd(vals), list(items)
    if all(isinstance(v, dict) for v in items):
        parts = {k: aggregate([v.get(k) for v in items]) for k in first}
        return ({k: p[0] for k, p in parts.items()}, {k: p[1] for k, p in parts.items()},
                {k: p[2] for k, p in parts.items()})
    if all(isinstance(v, list) for v in items) and len({len(v) for v in items}) == 1:
        parts = [aggregate([v[i] for v in items]) for i in range(len(first))]
        return [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]
    same = all(v == first for v in items)
    return (first if same else list(items)), None, list(items)


def _claims(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """How many seeds each claim holds in (test CIDEr)."""
    fams = list(runs[0]["models"])
    claims: dict[str, Any] = {
        "seeds": len(runs),
        "scst_gt_xe": {f: sum(r["models"][f]["scst"]["CIDEr"] > r["models"][f]["xe"]["CIDEr"] for r in runs)
                       for f in fams},
        "xe_vs_baseline_3x": {f: sum(r["models"][f]["xe"]["CIDEr"] >= 3 * r["baseline_cider"] for r in runs)
                              for f in fams},
    }
    if runs[0]["satic_ablation"]:
        def order(r):
            a = r["satic_ablation"]
            return a["base"]["xe"]["CIDEr"] < a["seqkd"]["xe"]["CIDEr"] < a["weight_init"]["xe"]["CIDEr"]

        claims["satic_order"] = sum(order(r) for r in runs)
    return claims


def _rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, stage): the per-seed rows' means, ``<metric>_sd`` for CIDEr, BLEU-4, METEOR and the
    diversity figures, and ``seeds``."""
    out = []
    for i, row in enumerate(runs[0]["rows"]):
        per = [r["rows"][i] for r in runs]
        mean, sd, _ = aggregate(per)
        new: dict[str, Any] = {"model": row["model"], "stage": row["stage"], "seeds": len(runs)}
        for k, v in mean.items():
            if k in ("model", "stage"):
                continue
            new[k] = v
            if k in _ROW_SD:
                new[f"{k}_sd"] = sd[k]
        out.append(new)
    return out


def _family(runs_models: list[dict[str, Any]]) -> dict[str, Any]:
    mean, sd, per = aggregate(runs_models)
    keep = ("xe", "scst", "xe_best_val_cider", "scst_best_val_cider", "scst_best_epoch")
    return {**mean, "sd": {k: sd[k] for k in keep}, "per_seed": {k: per[k] for k in keep}}


def run(preset: str = "learning", overrides: tuple[str, ...] = (), workdir: str | None = None,
        progress: bool = False, seeds: int = 3, threads: int | None = None) -> dict[str, Any]:
    """The bench over ``seeds`` full runs (see the module's doc); ``workdir`` holds ``seed-<n>/`` per seed;
    ``threads``: torch threads for the whole bench (None: leave torch's setting)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(preset, overrides, workdir, progress, seeds)
    finally:
        torch.set_num_threads(before)


def _run(preset: str, overrides: tuple[str, ...], workdir: str | None, progress: bool, seeds: int) -> dict[str, Any]:
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="capflow-bench-learning-")
        workdir = tmp.name
    wd = Path(workdir)
    t_start = time.perf_counter()
    base_cfg = load_config(preset, overrides=[f"run.workdir={wd}", *overrides])
    runs = []
    for i in range(seeds):
        over = seed_overrides(base_cfg, i)
        seed_wd = wd / f"seed-{base_cfg.run.seed + i}"
        cfg = load_config(preset, overrides=[*overrides, f"run.workdir={seed_wd}", *over])
        log.info("learning bench: seed %d of %d (%s)", i + 1, seeds, ", ".join(over))
        runs.append(run_seed(cfg, seed_wd, progress=progress))

    models = {f: _family([r["models"][f] for r in runs]) for f in runs[0]["models"]}
    ablation = {v: _family([r["satic_ablation"][v] for r in runs]) for v in runs[0]["satic_ablation"]}
    if "satic" in models and ablation:
        models["satic"] = ablation["weight_init"]
    base_mean, base_sd, base_per = aggregate([r["baseline_cider"] for r in runs])
    captions = Counter(r["baseline_caption"] for r in runs)
    result = {
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
        "rows": _rows(runs),
        "ratios": ratios_of(base_mean, models, ablation),
        "claims": _claims(runs),
        "runs": runs,
        "seconds": time.perf_counter() - t_start,
    }
    if tmp is not None:
        tmp.cleanup()
    return result
