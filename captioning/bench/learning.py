"""The learning bench's figures (``capflow bench learning``, run by :mod:`tasks.bench_learning` through the
pipeline's jobs): does the training recipe learn? XE and SCST CIDEr of every model family at small scale,
against the most-frequent-caption baseline, plus SATIC's Table-4 ablation. This module holds what turns the
seeds' runs into the report; it composes no stages.

Ratios (> 1 = the recipe works): ``xe_vs_baseline_min`` (worst model's XE CIDEr / baseline CIDEr),
``scst_vs_xe_min`` (smallest SCST/XE CIDEr ratio over models), ``satic_seqkd_vs_base`` and
``satic_weight_init_vs_seqkd`` (XE CIDEr ratios of the ablation); per family ``xe_vs_baseline_<family>`` and
``scst_vs_xe_<family>``.

Seeds (``seeds``, default 3): seed ``i`` is a full run with ``run.seed`` and ``dataset.synthetic.seed`` both
raised by ``i`` over the preset's (:func:`seed_overrides`: so the synthetic images, their train/val/test split,
the informative features' projection, the initialisation, the batch order and the SCST samples all change), in
its own workdir ``seed-<run.seed>``. Every number is reported as the mean over seeds (the keys a single run has,
so ``models[f]["xe"]["CIDEr"]`` is the mean), with the sample standard deviation next to it (``..._sd`` in rows,
``models[f]["sd"]``) and the per-seed values (``models[f]["per_seed"]``, ``runs``). Ratios are computed on the
means; ``claims`` counts the seeds in which each claim holds: ``scst_gt_xe`` (test CIDEr, per family),
``xe_vs_baseline_3x`` (per family) and ``satic_order`` (XE CIDEr base < +SeqKD < +weight-init).
Each row also carries the test captions' diversity (:func:`~captioning.metrics.diversity.repetition_stats`):
``distinct_captions``, ``distinct_fraction``, ``repeat_caption_fraction``, ``repeated_token_rate``.
"""

from __future__ import annotations

import hashlib
import statistics
from typing import Any

KEEP = ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")  # the metrics a model's entry reports
#: the test captions' diversity figures a model's entry reports
DIVERSITY = ("distinct_captions", "distinct_fraction", "repeat_caption_fraction", "repeated_token_rate")
_ROW_SD = ("CIDEr", "Bleu_4", "METEOR", *DIVERSITY)  # row numbers that get a ``_sd`` next to their mean


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


def claims(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """How many seeds each claim holds in (test CIDEr)."""
    fams = list(runs[0]["models"])
    out: dict[str, Any] = {
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

        out["satic_order"] = sum(order(r) for r in runs)
    return out


def rows_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def family(runs_models: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's entries over the seeds: their means, with ``sd`` and ``per_seed`` of the headline figures."""
    mean, sd, per = aggregate(runs_models)
    keep = ("xe", "scst", "xe_best_val_cider", "scst_best_val_cider", "scst_best_epoch")
    return {**mean, "sd": {k: sd[k] for k in keep}, "per_seed": {k: per[k] for k in keep}}
