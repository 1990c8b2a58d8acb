"""The model stages as jobs - AIC teacher (XE), SeqKD captions, one student (XE -> SCST -> evaluation -> registered
model version) - and their Prefect tasks. Training is :func:`captioning.training.stages.run_training` (one
process, or ``teacher.nproc`` / ``students.nproc`` data-parallel processes) for the pipeline and ``capflow train``
alike; a killed stage resumes from its folder's last epoch checkpoint; a student that fails is reported, not
fatal to the others."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any, TypeVar

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from captioning.config import json_digest
from captioning.data.karpathy import Dataset
from captioning.data.stores import LabelStore
from captioning.metrics.coco import references_document
from captioning.training import checkpoint
from captioning.training.loop import load_model
from captioning.training.recipe import (
    TEACHER_NAMES,
    StudentPlan,
    scst_settings,
    stage_plan,
    student_plan,
    train_plan,
    xe_settings,
)
from captioning.training.stages import StageContext, TrainSpec, evaluate, run_training, seqkd
from captioning.util import sha256_file
from tasks.common import RunContext, log
from tasks.data import RETRY
from tasks.refs import DatasetRef, FeaturesRef, LabelsRef, SeqKDRef, StudentFailure, StudentResult, TeacherRef
from tasks.tracking import LocalRecorder

R = TypeVar("R")


def _context(rc: RunContext, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef) -> StageContext:
    return StageContext.from_paths(stage_plan(rc.cfg), labels.vocab_path, labels.labels_uri, feats.uri,
                                   Dataset.load(data.path), progress=rc.progress)


def _spec(data: DatasetRef, feats: FeaturesRef, labels: LabelsRef, model: str, out, **kw: Any) -> TrainSpec:
    return TrainSpec(model=model, vocab_path=labels.vocab_path, labels_uri=labels.labels_uri, features_uri=feats.uri,
                     out=str(out), dataset_path=data.path, **kw)


def _inputs(rc: RunContext, run: str, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef) -> None:
    rc.tracker.dataset(run, "dataset", data.digest, data.path, "input")
    rc.tracker.dataset(run, "features", feats.digest, feats.uri, "training")
    rc.tracker.dataset(run, "labels", labels.labels_digest, labels.labels_uri, "training")


class EpochLogger:
    """Per-epoch metrics to ``run`` as they come. Training does not stop because the tracker failed once (a
    tracking server restarting): metrics it could not take are kept and sent with the next epoch's; :meth:`flush`
    at the end raises only if the tracker is still failing then (the stage fails, its checkpoints are kept)."""

    def __init__(self, rc: RunContext, run: str):
        self.rc, self.run, self.pending = rc, run, []

    def __call__(self, epoch: int, metrics: dict[str, Any]) -> None:
        self.pending.append((epoch, {k: v for k, v in metrics.items() if k != "epoch"}))
        try:
            self.flush()
        except RuntimeError as e:  # tasks.tracking.retry gave up on this call
            log.warning("could not log epoch %d's metrics (%s); kept, sent with the next epoch's", epoch, e)

    def flush(self) -> None:
        while self.pending:
            epoch, metrics = self.pending[0]
            self.rc.tracker.metrics(self.run, metrics, step=epoch)
            self.pending.pop(0)


def _train(rc: RunContext, run: str, spec: TrainSpec, nproc: int) -> dict[str, Any]:
    """Train; per-epoch metrics go to ``run`` as they come (one process) or from the history (DDP). With a run
    store, the stage folder is published after every epoch (one process) and at the end: an attempt killed on one
    machine resumes on another from its last epoch."""
    logger = EpochLogger(rc, run) if nproc == 1 else None

    def epoch_done(epoch: int, metrics: dict[str, Any]) -> None:
        assert logger is not None
        logger(epoch, metrics)
        rc.cache.sync(spec.out)

    res = run_training(train_plan(rc.cfg, spec.model), spec, nproc=nproc, on_epoch=epoch_done if logger else None,
                       progress=rc.progress)
    rc.cache.sync(spec.out)
    if logger is not None:
        logger.flush()  # what the tracker missed during training; raises if it is still down
    if nproc > 1:
        rc.tracker.history(run, res["history"])
    return res


def teacher(rc: RunContext, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef) -> TeacherRef:
    cfg = rc.cfg
    key, hit = rc.cached("teacher", TeacherRef, features=feats.digest, labels=labels.labels_digest,
                         teacher=cfg.digest("teacher"), loader=cfg.digest("loader"), seed=cfg.run.seed,
                         max_words=cfg.dataset.max_words)
    if hit is not None:
        return hit
    with rc.tracker.run("teacher", rc.parent_run, {"capflow.arch": cfg.teacher.model.arch}) as run:
        rc.tracker.params(run, {"teacher": cfg.teacher.model_dump(mode="json"),
                                "xe": vars(xe_settings(cfg.teacher.xe, cfg))})
        _inputs(rc, run, data, feats, labels)
        spec = _spec(data, feats, labels, "teacher", rc.cache.workdir("teacher", key))
        res = _train(rc, run, spec, cfg.teacher.nproc)
        best = res["best_checkpoint"] or res["last_checkpoint"]
        rc.tracker.metrics(run, {"best_epoch": res["best_epoch"], "resumed_from_epoch": res["resumed_from_epoch"],
                                 "processes": res["processes"]})
        rc.tracker.artifact(run, best, "checkpoint")
        rc.tracker.json_artifact(run, "history.json", res["history"])
        # its validation CIDEr is the teacher's MLflow Model's too, measured on the dataset
        rc.tracker.metrics(run, {"best_val_CIDEr": res["best_metric"]}, model_id=_log_trained_model(
            rc, run, best, "teacher", labels.vocab_path, data.path), dataset=("dataset", data.digest))
    return rc.done("teacher", key, TeacherRef(run_id=run, checkpoint=str(best), checkpoint_digest=sha256_file(best),
                                              best_val_cider=res["best_metric"]))


def seqkd_captions(rc: RunContext, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
                   teacher: TeacherRef) -> SeqKDRef:
    cfg = rc.cfg
    key, hit = rc.cached("seqkd", SeqKDRef, teacher=teacher.checkpoint_digest, labels=labels.labels_digest,
                         beam=cfg.students.seqkd_beam, max_words=cfg.dataset.max_words)
    if hit is not None:
        return hit
    name = f"seqkd:{teacher.checkpoint_digest[:12]}"
    ctx = _context(rc, data, feats, labels)
    with rc.tracker.run("seqkd", rc.parent_run) as run:
        rc.tracker.params(run, {"beam": cfg.students.seqkd_beam, "max_words": cfg.dataset.max_words, "source": name,
                                "teacher_run": teacher.run_id})
        rc.tracker.dataset(run, "teacher-checkpoint", teacher.checkpoint_digest, teacher.checkpoint, "model")
        report: dict[str, Any]
        if name in ctx.labels.sources.values():  # written by a run that died before recording it
            report = {"source": name, "reused": True}
        else:
            model, _ = load_model(teacher.checkpoint, device=ctx.device)
            report = seqkd(ctx, model, name).to_json()
        digest = LabelStore.open(labels.labels_uri).digest()
        rc.cache.sync(labels.labels_uri)  # the label store with its new source, on the run store when there is one
        rc.tracker.dataset(run, "seqkd-captions", digest, labels.labels_uri, "output",
                           {k: v for k, v in report.items() if k != "source"})
        rc.tracker.metrics(run, report)
        rc.tracker.json_artifact(run, "seqkd_report.json", report)
    return rc.done("seqkd", key, SeqKDRef(run_id=run, source=name, labels_digest=digest, report=report))


def student_key(rc: RunContext, plan: StudentPlan, arch: dict, feats: FeaturesRef, labels: LabelsRef,
                kd: SeqKDRef | None, teacher: TeacherRef | None, scst: bool) -> dict[str, Any]:
    """The inputs and settings a student's result depends on (its stage key's parts)."""
    cfg = rc.cfg
    parts: dict[str, Any] = {"arch": arch, "xe": cfg.digest("students.xe"), "loader": cfg.digest("loader"),
                             "seed": cfg.run.seed, "features": feats.digest, "labels": labels.labels_digest,
                             "max_words": cfg.dataset.max_words, "nproc": cfg.students.nproc,
                             # this student's SCST settings: another student's per_student entry does not touch it
                             "scst": json_digest(plan.scst.model_dump(mode="json")) if scst else None,
                             "evaluation": cfg.digest("evaluation")}
    if plan.captions == "seqkd":
        parts["seqkd"] = _needed(kd, "SeqKD captions", plan.name).labels_digest
    if plan.init_from_teacher or plan.is_teacher:  # the teacher's plan: its XE weights are the teacher stage's
        parts["teacher"] = _needed(teacher, "the teacher", plan.name).checkpoint_digest
    if plan.evaluate_xe:
        parts["evaluate_xe"] = True
    return parts


def _needed(ref: R | None, what: str, name: str) -> R:
    if ref is None:
        raise ValueError(f"student {name} needs {what} (students.per_student.{name})")
    return ref


def student(rc: RunContext, name: str | StudentPlan, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
            teacher: TeacherRef | None, kd: SeqKDRef | None, scst: bool = True) -> StudentResult | StudentFailure:
    """XE -> SCST -> test evaluation -> registered model version for one student (a name, resolved here by
    :func:`~captioning.training.recipe.student_plan`, or the plan itself); never raises."""
    plan = name if isinstance(name, StudentPlan) else None
    label = (plan.label or plan.name) if plan is not None else str(name)
    try:
        with rc.timed(f"student-{label}"):
            return _student(rc, plan or student_plan(rc.cfg, str(name)), data, feats, labels, teacher, kd, scst)
    except Exception as e:
        log.error("student %s failed: %s", label, e)
        rc.stages[f"student:{label}"] = "failed"
        return StudentFailure(student=label, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])


_SUMMARY = ("params", "latency_ms", "novel_fraction", "avg_length", "unique_fraction", "distinct_captions",
            "repeat_caption_fraction", "repeated_token_rate")


def _evaluated(rc: RunContext, ctx: StageContext, plan: StudentPlan, run: str, run_name: str, checkpoint: str,
               predictions: Path) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Test evaluation of ``checkpoint`` in a nested run ``run_name``: metrics and summary logged, the predictions
    written to ``predictions`` and logged. Returns the evaluation (without its predictions), the model and its
    checkpoint's state."""
    model, st = load_model(checkpoint, device=ctx.device)
    with rc.tracker.run(run_name, run, {"capflow.student": plan.name}) as erun:
        ev = evaluate(ctx, model, arch_name=plan.preset if plan.is_teacher else plan.name)
        preds = ev.pop("predictions")
        rc.tracker.metrics(erun, {**{k: v for k, v in ev["metrics"].items() if v is not None},
                                  **{k: ev[k] for k in _SUMMARY}})
        rc.tracker.json_artifact(erun, "predictions.json", preds)
        rc.tracker.json_artifact(erun, "metrics.json", ev)
    predictions.write_text(json.dumps(preds, ensure_ascii=False), encoding="utf-8")
    return ev, model, st


def _student(rc: RunContext, plan: StudentPlan, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
             teacher: TeacherRef | None, kd: SeqKDRef | None, scst: bool) -> StudentResult:
    cfg = rc.cfg
    name = plan.name
    ctx = _context(rc, data, feats, labels)
    arch = train_plan(cfg, name).arch(ctx.vocab, ctx.d_in)
    pname = plan.preset
    stage = plan.stage
    key, hit = rc.cached(stage, StudentResult, **student_key(rc, plan, arch.to_dict(), feats, labels, kd, teacher,
                                                             scst))
    if hit is not None:
        return hit
    captions = plan.captions
    init = _needed(teacher, "the teacher", name).checkpoint if plan.init_from_teacher else None
    nproc = cfg.students.nproc
    training: dict[str, Any] = {}
    xe_eval: dict[str, Any] | None = None
    with rc.tracker.run(pname, rc.parent_run, {"capflow.student": name}) as run:
        rc.tracker.params(run, {"student": name, "preset": pname, "captions": captions, "nproc": nproc,
                                "init_from_teacher": bool(init), "arch": arch.to_dict(),
                                "xe": vars(xe_settings(cfg.teacher.xe if plan.is_teacher else cfg.students.xe, cfg))})
        _inputs(rc, run, data, feats, labels)
        if captions == "seqkd":
            rc.tracker.dataset(run, "seqkd-captions", kd.labels_digest, labels.labels_uri, "training")
        if init or plan.is_teacher:
            t = _needed(teacher, "the teacher", name)
            rc.tracker.dataset(run, "teacher-checkpoint", t.checkpoint_digest, t.checkpoint, "init")
        out = rc.cache.workdir(stage, key)
        t0 = time.perf_counter()
        if plan.is_teacher:  # the teacher stage's XE weights
            t = _needed(teacher, "the teacher", name)
            res: dict[str, Any] = {"best_metric": t.best_val_cider, "best_epoch": None, "best_checkpoint": t.checkpoint,
                                   "last_checkpoint": t.checkpoint, "resumed_from_epoch": 0, "init": {}}
        else:
            res = _train(rc, run, _spec(data, feats, labels, name, out / "xe", captions=captions, init_from=init,
                                        seqkd_source=_needed(kd, "SeqKD captions", name).source
                                        if captions == "seqkd" else None), nproc)
        rc.tracker.metrics(run, {"xe_best_val_CIDEr": res["best_metric"], "xe_seconds": time.perf_counter() - t0,
                                 "xe_resumed_from_epoch": res["resumed_from_epoch"], **res["init"]})
        final_ckpt = res["best_checkpoint"] or res["last_checkpoint"]
        training["xe"] = {k: res[k] for k in ("best_metric", "best_epoch", "init")}
        training["xe"]["seconds"] = time.perf_counter() - t0
        if plan.evaluate_xe:  # the XE weights' test scores, before SCST changes them
            ev, _, _ = _evaluated(rc, ctx, plan, run, "evaluate-xe", final_ckpt, out / "xe-predictions.json")
            xe_eval = {"metrics": ev["metrics"], **{k: ev[k] for k in _SUMMARY}}
            rc.tracker.metrics(run, {f"xe_test_{k}": v for k, v in ev["metrics"].items() if v is not None})
        if scst:
            with rc.tracker.run("scst", run, {"capflow.student": name}) as srun:
                rc.tracker.params(srun, {"scst": plan.scst.model_dump(mode="json"),
                                         "settings": vars(scst_settings(cfg.students.scst, cfg, name))})
                t1 = time.perf_counter()
                sres = _train(rc, srun, _spec(data, feats, labels, name, out / "scst", scst_from=final_ckpt), nproc)
                # best_epoch -1: no SCST epoch beat the XE weights on validation, and they are what goes on
                rc.tracker.metrics(srun, {"best_val_CIDEr": sres["best_metric"], "best_epoch": sres["best_epoch"],
                                          "seconds": time.perf_counter() - t1,
                                          "resumed_from_epoch": sres["resumed_from_epoch"]})
            final_ckpt = sres["best_checkpoint"] or sres["last_checkpoint"]
            training["scst"] = {**{k: sres[k] for k in ("best_metric", "best_epoch", "history")},
                                "seconds": time.perf_counter() - t1}
        # kept beside the model for `capflow evaluate` (COCO results + the test split's references)
        pred_path, ref_path = out / "predictions.json", out / "references.json"
        ev, model, st = _evaluated(rc, ctx, plan, run, "evaluate", final_ckpt, pred_path)
        test = {k: v for k, v in ev["metrics"].items() if v is not None}
        summary = {k: ev[k] for k in _SUMMARY}
        ref_path.write_text(json.dumps(references_document(ctx.text_references("test")), ensure_ascii=False),
                            encoding="utf-8")
        # the model folder: checkpoint + vocabulary + what produced it
        model_dir = checkpoint.save_model_dir(
            out / "model", model=model, arch=st["arch"], vocab=labels.vocab_path,
            features=cfg.features.model_dump(mode="json"), student=name, preset=pname,
            max_words=cfg.dataset.max_words, beam=cfg.evaluation.beam, test_metrics=test,
            vocab_digest=st["vocab_digest"], epoch=st["epoch"], step=st["step"],
            weights_cache_dir=rc.workdir.weights_cache())  # the extraction's weights cache
        # ... as an MLflow Model: a LoggedModel of this run, its test metrics measured on the dataset's test split
        model_id = rc.tracker.log_model(
            run, model_dir, name=pname, example=_example_image(cfg, ctx.dataset, rc),
            params={"student": name, "preset": pname, "beam": cfg.evaluation.beam,
                    "max_words": cfg.dataset.max_words, "arch": arch.to_dict()},
            tags={"capflow.student": name, "capflow.preset": pname, "capflow.arch": name,
                  "capflow.params": ev["params"], "capflow.latency_ms": f"{ev['latency_ms']:.3f}",
                  "capflow.test_set": data.digest, "capflow.features_source": cfg.features.source})
        rc.tracker.metrics(run, {f"test_{k}": v for k, v in {**test, **summary}.items()}, model_id=model_id,
                           dataset=("dataset", data.digest))
        version = rc.tracker.register(run, "model", {"student": name, "preset": pname,
                                                     "test_CIDEr": test.get("CIDEr"), "test_set": data.digest},
                                      model_id=model_id)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rc.done(stage, key, StudentResult(
        student=name, preset=pname, run_id=run, metrics=ev["metrics"], params=ev["params"],
        latency_ms=ev["latency_ms"], novel_fraction=ev["novel_fraction"], avg_length=ev["avg_length"],
        unique_fraction=ev["unique_fraction"], model_version=version, test_set=data.digest,
        checkpoint=str(model_dir / "model.pt"), predictions=str(pred_path), references=str(ref_path),
        distinct_captions=ev["distinct_captions"], repeated_token_rate=ev["repeated_token_rate"],
        label=plan.label or name, captions=captions, init_from_teacher=bool(init), xe_evaluation=xe_eval,
        xe_predictions=str(out / "xe-predictions.json") if xe_eval is not None else None, training=training))


def _example_image(cfg, ds: Dataset | None, rc: RunContext | None = None):
    """A real image for the MLflow Model's input example: the first usable test image (None: no image files). A
    worker that cannot see the dataset's files takes it from the run store, where extraction put the images."""
    from tasks.mlflow_models import example_image

    if ds is None or ds.images_root is None or cfg.features.source != "detector":
        return None  # a model of synthetic-informative features does not caption pixels
    entries = ds.split("test")[:8]
    found = example_image([ds.image_path(e) for e in entries])
    store = rc.cache.store if rc is not None else None
    if found is None and store is not None:
        for e in entries:
            if e.sha256 and store.has_blob(e.sha256):
                local = store.get_blob(e.sha256, rc.workdir.root / "cache" / "examples" / f"{e.sha256[:16]}"
                                       f"{Path(e.file).suffix}")
                if (found := example_image([local])) is not None:
                    break
    return found


def _log_trained_model(rc: RunContext, run: str, best: str | Path, name: str, vocab_path: str,
                       dataset_path: str | None) -> str | None:
    """A trained model that is not a registered student (the teacher, a ``capflow train`` outside the recipe) as
    an MLflow Model too: a LoggedModel of ``run``, its model folder written beside the checkpoint; returns its
    ``model_id`` (None when nothing is tracked)."""
    if isinstance(rc.tracker, LocalRecorder):
        return None  # a single-stage command without tracking: nothing to log the model to
    cfg = rc.cfg
    preset = student_plan(cfg, name).preset
    model, st = load_model(best)
    model_dir = checkpoint.save_model_dir(
        Path(best).parent / "model", model=model, arch=st["arch"], vocab=vocab_path,
        features=cfg.features.model_dump(mode="json"), student=name, preset=preset, max_words=cfg.dataset.max_words,
        beam=cfg.evaluation.beam, test_metrics={}, vocab_digest=st["vocab_digest"], epoch=st["epoch"],
        step=st["step"], weights_cache_dir=rc.workdir.weights_cache())
    model_id = rc.tracker.log_model(
        run, model_dir, name=name if name in TEACHER_NAMES else preset,
        example=_example_image(cfg, Dataset.load(dataset_path) if dataset_path else None, rc),
        params={"student": name, "preset": preset, "beam": cfg.evaluation.beam, "max_words": cfg.dataset.max_words,
                "arch": st["arch"]},
        tags={"capflow.student": name, "capflow.preset": preset, "capflow.arch": preset,
              "capflow.features_source": cfg.features.source})
    del model
    return model_id


def imported_checkpoint(rc: RunContext, folder: str | Path, *, family: str, preset: str, checkpoint: str,
                        params: dict[str, Any]) -> str | None:
    """A released checkpoint that ``capflow import-checkpoint`` converted into ``folder``, as an MLflow Model: a
    run ``import-checkpoint`` with the checkpoint file as its input (by sha256) and the folder as a LoggedModel
    (not registered: it has no test score here). Returns the ``model_id`` (None without tracking)."""
    with rc.tracker.run("import-checkpoint", rc.parent_run, {"capflow.student": family}) as run:
        rc.tracker.params(run, {"family": family, "preset": preset, **params})
        rc.tracker.dataset(run, "checkpoint", sha256_file(checkpoint), checkpoint, "model")
        return rc.tracker.log_model(run, folder, name=preset.replace("@", "-"), params={"family": family, **params},
                                    tags={"capflow.student": family, "capflow.preset": preset,
                                          "capflow.imported_from": Path(checkpoint).name})


def model_job(rc: RunContext, name: str, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef, scst: bool = True
              ) -> TeacherRef | StudentResult | StudentFailure:
    """One model of the recipe exactly as the pipeline makes it (``capflow train --model NAME``): the teacher, or
    a student with its SeqKD captions and teacher initialisation as the config gives them - the teacher and
    SeqKD stages it depends on are found in the stage records or run first. Same stages, same keys: after
    ``capflow run`` this returns the pipeline's results without training."""
    if name in TEACHER_NAMES:
        return teacher(rc, data, feats, labels)
    plan = student_plan(rc.cfg, name)
    t = teacher(rc, data, feats, labels) if plan.needs_teacher else None
    kd = seqkd_captions(rc, data, feats, labels, t) if plan.captions == "seqkd" and t is not None else None
    return student(rc, plan, data, feats, labels, t, kd, scst)


def custom_training(rc: RunContext, stage: str, spec: TrainSpec, nproc: int, digests: dict[str, str | None]
                    ) -> dict[str, Any]:
    """``capflow train`` outside the recipe (its own captions, initialisation, SCST start or stores): one XE or SCST
    training, recorded like a stage run - params, inputs (``digests``: features, labels, dataset), per-epoch
    metrics, the best checkpoint and its MLflow Model - in ``spec.out``, which a killed run resumes."""
    with rc.tracker.run(stage, rc.parent_run, {"capflow.student": spec.model}) as run:
        rc.tracker.params(run, {"model": spec.model, "captions": spec.captions, "seqkd_source": spec.seqkd_source,
                                "init_from": spec.init_from, "scst_from": spec.scst_from, "nproc": nproc})
        for name, uri in (("features", spec.features_uri), ("labels", spec.labels_uri), ("dataset", spec.dataset_path)):
            if uri and digests.get(name):
                rc.tracker.dataset(run, name, str(digests[name]), uri, "input" if name == "dataset" else "training")
        res = _train(rc, run, spec, nproc)
        best = res["best_checkpoint"] or res["last_checkpoint"]
        rc.tracker.artifact(run, best, "checkpoint")
        rc.tracker.json_artifact(run, "history.json", res["history"])
        model_id = _log_trained_model(rc, run, best, spec.model, spec.vocab_path, spec.dataset_path)
        on = ("dataset", str(digests["dataset"])) if spec.dataset_path and digests.get("dataset") else None
        rc.tracker.metrics(run, {"best_val_CIDEr": res["best_metric"], "best_epoch": res["best_epoch"],
                                 "resumed_from_epoch": res["resumed_from_epoch"], "processes": res["processes"]},
                           model_id=model_id, dataset=on)
    return res


teacher_task = task(teacher, name="train-teacher", **RETRY)
seqkd_task = task(seqkd_captions, name="seqkd", **RETRY)
student_task = task(student, name="train-student", cache_policy=NO_CACHE)
