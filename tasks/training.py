"""Pipeline tasks for the model stages: AIC teacher (XE), SeqKD captions, one task per student (XE -> SCST ->
evaluation -> registered model version). Training resumes from the stage folder's last checkpoint when a run
was killed; a student that fails is reported, not fatal to the others."""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from captioning.data.karpathy import Dataset
from captioning.data.stores import LabelStore
from captioning.training import checkpoint
from captioning.training.recipe import preset_name, scst_settings, student_arch, teacher_arch, xe_settings
from captioning.training.stages import StageContext, evaluate, fit_scst, fit_xe, seqkd
from captioning.util import sha256_file
from tasks.common import RunContext, log
from tasks.data import RETRY


def _context(rc: RunContext, data: dict[str, Any], feats: dict[str, Any], labels: dict[str, Any]) -> StageContext:
    return StageContext.from_paths(rc.cfg, labels["vocab_path"], labels["labels_uri"], feats["uri"],
                                   Dataset.load(data["dataset_path"]), progress=rc.progress)


def _inputs(rc: RunContext, run: str, data, feats, labels) -> None:
    rc.tracker.dataset(run, "dataset", data["digest"], data["dataset_path"], "input")
    rc.tracker.dataset(run, "features", feats["digest"], feats["uri"], "training")
    rc.tracker.dataset(run, "labels", labels["labels_digest"], labels["labels_uri"], "training")


def _epoch_logger(rc: RunContext, run: str, prefix: str = ""):
    def on_epoch(epoch: int, metrics: dict[str, Any]) -> None:
        rc.tracker.metrics(run, {k: v for k, v in metrics.items() if k != "epoch"}, step=epoch, prefix=prefix)
    return on_epoch


@task(name="train-teacher", **RETRY)
def teacher_task(rc: RunContext, data, feats, labels) -> dict[str, Any]:
    cfg = rc.cfg
    key, hit = rc.cached("teacher", features=feats["digest"], labels=labels["labels_digest"],
                         teacher=cfg.digest("teacher"), loader=cfg.digest("loader"), seed=cfg.run.seed,
                         max_words=cfg.dataset.max_words)
    if hit is not None:
        return hit
    ctx = _context(rc, data, feats, labels)
    arch = teacher_arch(cfg.teacher.model, ctx.vocab, ctx.d_in, cfg.dataset.max_words)
    with rc.tracker.run("teacher", rc.parent_run, {"capflow.arch": cfg.teacher.model.arch}) as run:
        s = xe_settings(cfg.teacher.xe, cfg)
        rc.tracker.params(run, {"arch": arch.to_dict(), "xe": vars(s)})
        _inputs(rc, run, data, feats, labels)
        out = rc.cache.workdir("teacher", key)
        _, res, _ = fit_xe(ctx, arch, out, settings=s, on_epoch=_epoch_logger(rc, run))
        best = res.best_checkpoint or res.last_checkpoint
        rc.tracker.metrics(run, {"best_val_CIDEr": res.best_metric, "best_epoch": res.best_epoch,
                                 "resumed_from_epoch": res.resumed_from_epoch})
        rc.tracker.artifact(run, best, "checkpoint")
        rc.tracker.json_artifact(run, "history.json", res.history)
    return rc.done("teacher", key, {"run_id": run, "checkpoint": str(best), "checkpoint_digest": sha256_file(best),
                                    "best_val_cider": res.best_metric})


@task(name="seqkd", **RETRY)
def seqkd_task(rc: RunContext, data, feats, labels, teacher: dict[str, Any]) -> dict[str, Any]:
    from captioning.training.xe import load_model

    cfg = rc.cfg
    key, hit = rc.cached("seqkd", teacher=teacher["checkpoint_digest"], labels=labels["labels_digest"],
                         beam=cfg.students.seqkd_beam, max_words=cfg.dataset.max_words)
    if hit is not None:
        return hit
    name = f"seqkd:{teacher['checkpoint_digest'][:12]}"
    ctx = _context(rc, data, feats, labels)
    with rc.tracker.run("seqkd", rc.parent_run) as run:
        rc.tracker.params(run, {"beam": cfg.students.seqkd_beam, "max_words": cfg.dataset.max_words, "source": name,
                                "teacher_run": teacher["run_id"]})
        rc.tracker.dataset(run, "teacher-checkpoint", teacher["checkpoint_digest"], teacher["checkpoint"], "model")
        report: dict[str, Any]
        if name in ctx.labels.sources.values():  # written by a run that died before recording it
            report = {"source": name, "reused": True}
        else:
            model, _ = load_model(teacher["checkpoint"], device=ctx.device)
            report = seqkd(ctx, model, name).to_json()
        digest = LabelStore.open(labels["labels_uri"]).digest()
        rc.tracker.dataset(run, "seqkd-captions", digest, labels["labels_uri"], "output",
                           {k: v for k, v in report.items() if k != "source"})
        rc.tracker.metrics(run, report)
        rc.tracker.json_artifact(run, "seqkd_report.json", report)
    return rc.done("seqkd", key, {"run_id": run, "source": name, "labels_digest": digest, "report": report})


def _student_key(rc: RunContext, name: str, arch: dict, feats, labels, kd, teacher) -> dict[str, Any]:
    cfg = rc.cfg
    parts: dict[str, Any] = {"arch": arch, "xe": cfg.digest("students.xe"), "loader": cfg.digest("loader"),
                             "seed": cfg.run.seed, "features": feats["digest"], "labels": labels["labels_digest"],
                             "max_words": cfg.dataset.max_words}
    if name in cfg.students.seqkd_for:
        parts["seqkd"] = kd["labels_digest"]
    if name in cfg.students.teacher_init_for:
        parts["teacher"] = teacher["checkpoint_digest"]
    return parts


@task(name="train-student", cache_policy=NO_CACHE)
def student_task(rc: RunContext, name: str, data, feats, labels, teacher, kd, scst: bool = True) -> dict[str, Any]:
    """XE -> SCST -> test evaluation -> registered model version for one student; never raises."""
    try:
        return _student(rc, name, data, feats, labels, teacher, kd, scst)
    except Exception as e:
        log.error("student %s failed: %s", name, e)
        rc.stages[f"student:{name}"] = "failed"
        return {"student": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


def _student(rc: RunContext, name: str, data, feats, labels, teacher, kd, scst: bool) -> dict[str, Any]:
    cfg = rc.cfg
    ctx = _context(rc, data, feats, labels)
    arch = student_arch(name, cfg.students.size, ctx.vocab, ctx.d_in, cfg.dataset.max_words)
    pname = preset_name(name)
    parts = _student_key(rc, name, arch.to_dict(), feats, labels, kd, teacher)
    stage = f"student-{name}"
    parts["scst"] = cfg.digest("students.scst") if scst else None
    parts["evaluation"] = cfg.digest("evaluation")
    key, hit = rc.cached(stage, **parts)
    if hit is not None:
        return hit
    captions = "seqkd" if name in cfg.students.seqkd_for else "ground_truth"
    init = teacher["checkpoint"] if name in cfg.students.teacher_init_for else None
    with rc.tracker.run(pname, rc.parent_run, {"capflow.student": name}) as run:
        s = xe_settings(cfg.students.xe, cfg)
        rc.tracker.params(run, {"student": name, "preset": pname, "captions": captions,
                                "init_from_teacher": bool(init), "arch": arch.to_dict(), "xe": vars(s)})
        _inputs(rc, run, data, feats, labels)
        if captions == "seqkd":
            rc.tracker.dataset(run, "seqkd-captions", kd["labels_digest"], labels["labels_uri"], "training")
        if init:
            rc.tracker.dataset(run, "teacher-checkpoint", teacher["checkpoint_digest"], init, "init")
        out = rc.cache.workdir(stage, key)
        t0 = time.perf_counter()
        model, res, info = fit_xe(ctx, arch, out / "xe", settings=s, captions=captions,
                                  seqkd_source=kd["source"] if captions == "seqkd" else None, init_from=init,
                                  on_epoch=_epoch_logger(rc, run))
        rc.tracker.metrics(run, {"xe_best_val_CIDEr": res.best_metric, "xe_seconds": time.perf_counter() - t0,
                                 "xe_resumed_from_epoch": res.resumed_from_epoch,
                                 **{k: v for k, v in info.items() if k.startswith("init_") and isinstance(v, int)}})
        final_ckpt = res.best_checkpoint or res.last_checkpoint
        if scst:
            with rc.tracker.run("scst", run, {"capflow.student": name}) as srun:
                ss = scst_settings(cfg.students.scst, cfg)
                rc.tracker.params(srun, {"scst": cfg.students.scst.model_dump(mode="json"), "settings": vars(ss)})
                t1 = time.perf_counter()
                model, sres = fit_scst(ctx, final_ckpt, out / "scst", settings=ss, on_epoch=_epoch_logger(rc, srun))
                # best_epoch -1: no SCST epoch beat the XE weights on validation, and they are what goes on
                rc.tracker.metrics(srun, {"best_val_CIDEr": sres.best_metric, "best_epoch": sres.best_epoch,
                                          "seconds": time.perf_counter() - t1,
                                          "resumed_from_epoch": sres.resumed_from_epoch})
            final_ckpt = sres.best_checkpoint or sres.last_checkpoint
        with rc.tracker.run("evaluate", run, {"capflow.student": name}) as erun:
            ev = evaluate(ctx, model, arch_name=name)
            preds = ev.pop("predictions")
            test = {k: v for k, v in ev["metrics"].items() if v is not None}
            summary = {"params": ev["params"], "latency_ms": ev["latency_ms"], "novel_fraction": ev["novel_fraction"],
                       "avg_length": ev["avg_length"], "unique_fraction": ev["unique_fraction"]}
            rc.tracker.metrics(erun, {**test, **summary})
            rc.tracker.json_artifact(erun, "predictions.json", preds)
            rc.tracker.json_artifact(erun, "metrics.json", ev)
        rc.tracker.metrics(run, {f"test_{k}": v for k, v in {**test, **summary}.items()})
        # the model folder: checkpoint + vocabulary + what produced it (registered below)
        st = checkpoint.load(final_ckpt)
        model_dir = checkpoint.save_model_dir(
            out / "model", model=model, arch=st["arch"], vocab=labels["vocab_path"],
            features=cfg.features.model_dump(mode="json"), student=name, preset=pname,
            max_words=cfg.dataset.max_words, beam=cfg.evaluation.beam, test_metrics=test,
            vocab_digest=st["vocab_digest"], epoch=st["epoch"], step=st["step"],
            weights_cache_dir=cfg.workdir / "cache" / "weights")  # the extraction's weights cache
        rc.tracker.artifact(run, model_dir, "model")
        test_set = data["digest"]
        version = rc.tracker.register(run, "model", {"student": name, "preset": pname,
                                                     "test_CIDEr": test.get("CIDEr"), "test_set": test_set})
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rc.done(stage, key, {"student": name, "preset": pname, "run_id": run, "metrics": ev["metrics"],
                                "params": ev["params"], "latency_ms": ev["latency_ms"],
                                "novel_fraction": ev["novel_fraction"], "avg_length": ev["avg_length"],
                                "model_version": version, "test_set": test_set,
                                "checkpoint": str(model_dir / "model.pt")})
