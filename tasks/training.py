"""The model stages as jobs - AIC teacher (XE), SeqKD captions, one student (XE -> SCST -> evaluation -> registered
model version) - each over one :class:`~captioning.training.recipe.ModelPlan` built from the config once. A job
checks its stage record first and opens its inputs (dataset, vocabulary, stores) only when it runs, once.
Training is :func:`captioning.training.stages.run_training` (one process, or the plan's ``nproc`` data-parallel
processes) for the pipeline and ``capflow train`` alike; a killed stage resumes from its folder's last epoch
checkpoint; a student that fails is reported, not fatal to the others. No orchestrator here: the flow wraps these
jobs in its tasks (:mod:`flows.pipeline`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import traceback
from pathlib import Path
from typing import Any, TypeVar

import torch

from captioning.data.columnar import DatasetFile
from captioning.data.karpathy import Dataset, open_dataset
from captioning.data.stores import LabelStore
from captioning.metrics.coco import references_document
from captioning.metrics.evaluation import Evaluation
from captioning.models.names import TEACHER_NAMES
from captioning.training import checkpoint
from captioning.training.loop import FitResult, load_model
from captioning.training.recipe import ModelPlan, model_plan
from captioning.training.stages import Inputs, StageContext, evaluate, run_training, seqkd
from captioning.util import atomic_write, sha256_file
from tasks.common import RunContext, log
from tasks.refs import DatasetRef, FeaturesRef, LabelsRef, SeqKDRef, StudentFailure, StudentResult, TeacherRef
from tasks.tracking import LocalRecorder

R = TypeVar("R")


def inputs_of(data: DatasetRef | None, feats: FeaturesRef, labels: LabelsRef) -> Inputs:
    return Inputs(vocab=labels.vocab_path, labels=labels.labels_uri, features=feats.uri,
                  dataset=data.path if data is not None else None)


def _log_inputs(rc: RunContext, run: str, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef) -> None:
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


def _train(rc: RunContext, run: str, plan: ModelPlan, inputs: Inputs, out: Path, *, ctx: StageContext | None = None,
           phase: str = "xe", start: str | None = None, seqkd_source: str | None = None) -> FitResult:
    """Train; per-epoch metrics go to ``run`` as they come (one process: on the job's opened ``ctx`` when given) or
    from the history (DDP: each process opens ``inputs``). The stage folder is published to the run store (when
    there is one) after every epoch (one process) and at the end: an attempt killed on one machine resumes on
    another from its last epoch."""
    logger = EpochLogger(rc, run) if plan.nproc == 1 else None

    def epoch_done(epoch: int, metrics: dict[str, Any]) -> None:
        assert logger is not None
        logger(epoch, metrics)
        rc.cache.sync(out)

    opened = ctx if ctx is not None and plan.nproc == 1 else inputs
    res = run_training(plan, opened, out, phase=phase, start=start, seqkd_source=seqkd_source,
                       on_epoch=epoch_done if logger else None, progress=rc.progress)
    rc.cache.sync(out)
    if logger is not None:
        logger.flush()  # what the tracker missed during training; raises if it is still down
    if plan.nproc > 1:
        rc.tracker.history(run, res.history)
    return res


def teacher(rc: RunContext, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef) -> TeacherRef:
    """The AIC teacher's XE training (its plan: :func:`~captioning.training.recipe.model_plan` of ``teacher``)."""
    plan = model_plan(rc.cfg, "teacher")
    key, hit = rc.cached("teacher", TeacherRef, model=plan.digest(through="xe"), features=feats.digest,
                         labels=labels.labels_digest)
    if hit is not None:
        return hit
    with rc.tracker.run("teacher", rc.parent_run, {"capflow.student": "teacher", "capflow.preset": plan.preset}) as run:
        rc.tracker.params(run, {"teacher": rc.cfg.teacher.model_dump(mode="json"), "xe": vars(plan.xe)})
        _log_inputs(rc, run, data, feats, labels)
        res = _train(rc, run, plan, inputs_of(data, feats, labels), rc.cache.workdir("teacher", key))
        rc.tracker.metrics(run, {"best_epoch": res.best_epoch, "resumed_from_epoch": res.resumed_from_epoch,
                                 "processes": res.processes})
        rc.tracker.artifact(run, res.checkpoint, "checkpoint")
        rc.tracker.json_artifact(run, "history.json", res.history)
        # its validation CIDEr is the teacher's MLflow Model's too, measured on the dataset
        rc.tracker.metrics(run, {"best_val_CIDEr": res.best_metric}, model_id=_log_trained_model(
            rc, run, res.checkpoint, plan, labels.vocab_path, data.path), dataset=("dataset", data.digest))
    return rc.done("teacher", key, TeacherRef(run_id=run, checkpoint=res.checkpoint,
                                              checkpoint_digest=sha256_file(res.checkpoint),
                                              best_val_cider=res.best_metric))


def seqkd_captions(rc: RunContext, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
                   teacher: TeacherRef) -> SeqKDRef:
    plan = model_plan(rc.cfg, "teacher")
    key, hit = rc.cached("seqkd", SeqKDRef, teacher=teacher.checkpoint_digest, labels=labels.labels_digest,
                         beam=plan.seqkd_beam, max_words=plan.max_words)
    if hit is not None:
        return hit
    name = f"seqkd:{teacher.checkpoint_digest[:12]}"
    ctx = inputs_of(data, feats, labels).open(plan, rc.progress)
    with rc.tracker.run("seqkd", rc.parent_run) as run:
        rc.tracker.params(run, {"beam": plan.seqkd_beam, "max_words": plan.max_words, "source": name,
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


def student_key(plan: ModelPlan, feats: FeaturesRef, labels: LabelsRef, kd: SeqKDRef | None,
                teacher: TeacherRef | None) -> dict[str, Any]:
    """The inputs and settings a student's result depends on (its stage key's parts): its plan (XE, its own SCST,
    evaluation), the stores, and the SeqKD captions / teacher weights it uses."""
    parts: dict[str, Any] = {"model": plan.digest(), "features": feats.digest, "labels": labels.labels_digest}
    if plan.captions != "ground_truth":
        parts["seqkd"] = _needed(kd, "SeqKD captions", plan.name).labels_digest
    if plan.init_from_teacher or plan.is_teacher:  # the teacher's plan: its XE weights are the teacher stage's
        parts["teacher"] = _needed(teacher, "the teacher", plan.name).checkpoint_digest
    return parts


def _needed(ref: R | None, what: str, name: str) -> R:
    if ref is None:
        raise ValueError(f"student {name} needs {what} (students.per_student.{name})")
    return ref


def student(rc: RunContext, plan: ModelPlan, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
            teacher: TeacherRef | None, kd: SeqKDRef | None) -> StudentResult | StudentFailure:
    """XE -> SCST (when the plan has it) -> test evaluation -> registered model version for one plan; never
    raises (a failure is the stage's state ``failed`` and a :class:`StudentFailure`)."""
    try:
        with rc.timed(plan.stage):
            return _student(rc, plan, data, feats, labels, teacher, kd)
    except Exception as e:
        log.error("student %s failed: %s", plan.label, e)
        rc.stages[plan.stage] = "failed"
        return StudentFailure(student=plan.label, error=f"{type(e).__name__}: {e}",
                              traceback=traceback.format_exc()[-4000:])


def _student(rc: RunContext, plan: ModelPlan, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
             teacher: TeacherRef | None, kd: SeqKDRef | None) -> StudentResult:
    key, hit = rc.cached(plan.stage, StudentResult, **student_key(plan, feats, labels, kd, teacher))
    if hit is not None:
        return hit  # nothing opened: a cached student reads no dataset, vocabulary or store
    inputs = inputs_of(data, feats, labels)
    ctx = inputs.open(plan, rc.progress)
    out = rc.cache.workdir(plan.stage, key)
    with rc.tracker.run(plan.preset, rc.parent_run, {"capflow.student": plan.name}) as run:
        _log_student(rc, run, plan, ctx, data, feats, labels, teacher, kd)
        xe = _fit_xe(rc, run, plan, ctx, inputs, out, teacher, kd)
        xe_eval = _evaluated(rc, ctx, run, "evaluate-xe", xe.checkpoint, out / "xe-predictions.json")[0] \
            if plan.evaluate_xe else None  # the XE weights' test scores, before SCST changes them
        if xe_eval is not None:
            rc.tracker.metrics(run, {f"xe_test_{k}": v for k, v in xe_eval.scored().items()})
        scst = _fit_scst(rc, run, plan, ctx, inputs, out, xe) if plan.scst is not None else None
        result = _evaluate_and_register(rc, run, plan, ctx, out, data, labels, (scst or xe).checkpoint)
    training: dict[str, Any] = {"xe": {"best_metric": xe.best_metric, "best_epoch": xe.best_epoch, "init": xe.init,
                                       "seconds": xe.seconds, "history": xe.history}}
    if scst is not None:
        training["scst"] = {"best_metric": scst.best_metric, "best_epoch": scst.best_epoch, "history": scst.history,
                            "seconds": scst.seconds}
    return rc.done(plan.stage, key, dataclasses.replace(
        result, training=training, xe_evaluation={"metrics": xe_eval.metrics, **xe_eval.summary()} if xe_eval else None,
        xe_predictions=str(out / "xe-predictions.json") if xe_eval is not None else None))


def _log_student(rc: RunContext, run: str, plan: ModelPlan, ctx: StageContext, data: DatasetRef, feats: FeaturesRef,
                 labels: LabelsRef, teacher: TeacherRef | None, kd: SeqKDRef | None) -> None:
    rc.tracker.params(run, {"student": plan.name, "preset": plan.preset, "captions": plan.captions,
                            "nproc": plan.nproc, "init_from_teacher": plan.init_from_teacher,
                            "arch": ctx.arch().to_dict(), "xe": vars(plan.xe)})
    _log_inputs(rc, run, data, feats, labels)
    if plan.captions != "ground_truth":
        rc.tracker.dataset(run, "seqkd-captions", _needed(kd, "SeqKD captions", plan.name).labels_digest,
                           labels.labels_uri, "training")
    if plan.init_from_teacher or plan.is_teacher:
        t = _needed(teacher, "the teacher", plan.name)
        rc.tracker.dataset(run, "teacher-checkpoint", t.checkpoint_digest, t.checkpoint, "init")


def _fit_xe(rc: RunContext, run: str, plan: ModelPlan, ctx: StageContext, inputs: Inputs, out: Path,
            teacher: TeacherRef | None, kd: SeqKDRef | None) -> FitResult:
    """XE of the plan (the teacher's plan: the teacher stage's weights, not trained again)."""
    if plan.is_teacher:
        t = _needed(teacher, "the teacher", plan.name)
        res = FitResult(best_checkpoint=t.checkpoint, last_checkpoint=t.checkpoint, best_metric=t.best_val_cider,
                        best_epoch=None, epochs_run=0, resumed_from_epoch=0, history=[])
    else:
        init = _needed(teacher, "the teacher", plan.name).checkpoint if plan.init_from_teacher else None
        source = _needed(kd, "SeqKD captions", plan.name).source if plan.captions != "ground_truth" else None
        res = _train(rc, run, plan, inputs, out / "xe", ctx=ctx, start=init, seqkd_source=source)
    rc.tracker.metrics(run, {"xe_best_val_CIDEr": res.best_metric, "xe_seconds": res.seconds,
                             "xe_resumed_from_epoch": res.resumed_from_epoch, **res.init})
    return res


def _fit_scst(rc: RunContext, run: str, plan: ModelPlan, ctx: StageContext, inputs: Inputs, out: Path,
              xe: FitResult) -> FitResult:
    assert plan.scst is not None
    with rc.tracker.run("scst", run, {"capflow.student": plan.name}) as srun:
        rc.tracker.params(srun, {"scst": plan.scst.section, "settings": vars(plan.scst.settings)})
        res = _train(rc, srun, plan, inputs, out / "scst", ctx=ctx, phase="scst", start=xe.checkpoint)
        # best_epoch -1: no SCST epoch beat the XE weights on validation, and they are what goes on
        rc.tracker.metrics(srun, {"best_val_CIDEr": res.best_metric, "best_epoch": res.best_epoch,
                                  "seconds": res.seconds, "resumed_from_epoch": res.resumed_from_epoch})
    return res


def _evaluated(rc: RunContext, ctx: StageContext, run: str, run_name: str, checkpoint_path: str,
               predictions: Path) -> tuple[Evaluation, Any, dict[str, Any]]:
    """Test evaluation of ``checkpoint_path`` in a nested run ``run_name``: metrics and summary logged, the
    predictions written to ``predictions`` and logged. Returns the evaluation, the model (loaded once, here) and its
    checkpoint's state."""
    model, st = load_model(checkpoint_path, device=ctx.device)
    with rc.tracker.run(run_name, run, {"capflow.student": ctx.plan.name}) as erun:
        ev = evaluate(ctx, model)
        rc.tracker.metrics(erun, {**ev.scored(), **ev.summary()})
        rc.tracker.json_artifact(erun, "predictions.json", ev.predictions)
        rc.tracker.json_artifact(erun, "metrics.json", ev.to_json())
    text = json.dumps(ev.predictions, ensure_ascii=False).encode("utf-8")
    atomic_write(predictions, lambda f: f.write(text), "predictions")
    return ev, model, st


def _evaluate_and_register(rc: RunContext, run: str, plan: ModelPlan, ctx: StageContext, out: Path,
                           data: DatasetRef, labels: LabelsRef, final: str) -> StudentResult:
    """The final weights scored on the test split, kept as a model folder (with the predictions and the test
    references, for ``capflow evaluate``), logged as an MLflow Model and registered."""
    cfg = rc.cfg
    pred_path, ref_path = out / "predictions.json", out / "references.json"
    ev, model, st = _evaluated(rc, ctx, run, "evaluate", final, pred_path)
    refs = json.dumps(references_document(ctx.text_references("test")), ensure_ascii=False).encode("utf-8")
    atomic_write(ref_path, lambda f: f.write(refs), "references")
    model_dir = _model_folder(rc, out / "model", model, st, plan, labels.vocab_path, ev.scored())
    model_id = rc.tracker.log_model(
        run, model_dir, name=plan.preset, example=_example_image(cfg, ctx.dataset, rc),
        params={"student": plan.name, "preset": plan.preset, "beam": plan.eval_beam, "max_words": plan.max_words,
                "arch": ctx.arch().to_dict()},
        tags={"capflow.student": plan.name, "capflow.preset": plan.preset, "capflow.params": ev.params,
              "capflow.latency_ms": f"{ev.latency_ms:.3f}", "capflow.test_set": data.digest,
              "capflow.features_source": cfg.features.source})
    rc.tracker.metrics(run, {f"test_{k}": v for k, v in {**ev.scored(), **ev.summary()}.items()}, model_id=model_id,
                       dataset=("dataset", data.digest))
    version = rc.tracker.register(run, "model", {"student": plan.name, "preset": plan.preset,
                                                 "test_CIDEr": ev.metrics.get("CIDEr"), "test_set": data.digest},
                                  model_id=model_id)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return StudentResult(
        student=plan.name, preset=plan.preset, run_id=run, metrics=ev.metrics, params=ev.params,
        latency_ms=ev.latency_ms, novel_fraction=ev.novel_fraction, avg_length=ev.avg_length,
        unique_fraction=ev.unique_fraction, model_version=version, test_set=data.digest,
        checkpoint=str(model_dir / "model.pt"), predictions=str(pred_path), references=str(ref_path),
        distinct_captions=ev.distinct_captions, repeated_token_rate=ev.repeated_token_rate, label=plan.label,
        captions=plan.captions, init_from_teacher=plan.init_from_teacher)


def _model_folder(rc: RunContext, folder: Path, model: Any, st: dict[str, Any], plan: ModelPlan, vocab_path: str,
                  test_metrics: dict[str, float]) -> Path:
    """The model folder: checkpoint + vocabulary + what produced it (and the extraction's weights cache)."""
    cfg = rc.cfg
    return checkpoint.save_model_dir(
        folder, model=model, arch=st["arch"], vocab=vocab_path, features=cfg.features.model_dump(mode="json"),
        student=plan.name, preset=plan.preset, max_words=plan.max_words, beam=plan.eval_beam,
        test_metrics=test_metrics, vocab_digest=st["vocab_digest"], epoch=st["epoch"], step=st["step"],
        weights_cache_dir=rc.workdir.weights_cache())


def _example_image(cfg, ds: Dataset | DatasetFile | None, rc: RunContext | None = None):
    """A real image for the MLflow Model's input example: the first usable test image (None: no image files). A
    worker that cannot see the dataset's files takes it from the run store, where extraction put the images."""
    from tasks.mlflow_models import example_image

    if ds is None or ds.images_root is None or cfg.features.source != "detector":
        return None  # a model of synthetic-informative features does not caption pixels
    entries = list(itertools.islice(ds.iter_entries("test"), 8))
    found = example_image([ds.image_path(e) for e in entries])
    if found is None and rc is not None:
        for e in entries:
            local = rc.cache.blob(e.sha256, rc.workdir.root / "cache" / "examples" / f"{e.sha256[:16]}"
                                  f"{Path(e.file).suffix}") if e.sha256 else None
            if local is not None and (found := example_image([local])) is not None:
                break
    return found


def _log_trained_model(rc: RunContext, run: str, best: str | Path, plan: ModelPlan, vocab_path: str,
                       dataset_path: str | None) -> str | None:
    """A trained model that is not a registered student (the teacher, a ``capflow train`` outside the recipe) as
    an MLflow Model too: a LoggedModel of ``run``, its model folder written beside the checkpoint; returns its
    ``model_id`` (None when nothing is tracked)."""
    if isinstance(rc.tracker, LocalRecorder):
        return None  # a single-stage command without tracking: nothing to log the model to
    model, st = load_model(best)
    model_dir = _model_folder(rc, Path(best).parent / "model", model, st, plan, vocab_path, {})
    model_id = rc.tracker.log_model(
        run, model_dir, name=plan.name if plan.is_teacher else plan.preset,
        example=_example_image(rc.cfg, open_dataset(dataset_path) if dataset_path else None, rc),
        params={"student": plan.name, "preset": plan.preset, "beam": plan.eval_beam, "max_words": plan.max_words,
                "arch": st["arch"]},
        tags={"capflow.student": plan.name, "capflow.preset": plan.preset,
              "capflow.features_source": rc.cfg.features.source})
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


def model_job(rc: RunContext, name: str, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef
              ) -> TeacherRef | StudentResult | StudentFailure:
    """One model of the recipe exactly as the pipeline makes it (``capflow train --model NAME``): the teacher, or
    a student with its SeqKD captions, teacher initialisation and SCST as the config gives them - the teacher and
    SeqKD stages it depends on are found in the stage records or run first. Same stages, same keys: after
    ``capflow run`` this returns the pipeline's results without training."""
    if name in TEACHER_NAMES:
        return teacher(rc, data, feats, labels)
    plan = model_plan(rc.cfg, name)
    t = teacher(rc, data, feats, labels) if plan.needs_teacher else None
    kd = seqkd_captions(rc, data, feats, labels, t) if plan.captions != "ground_truth" and t is not None else None
    return student(rc, plan, data, feats, labels, t, kd)


def custom_training(rc: RunContext, stage: str, plan: ModelPlan, inputs: Inputs, out: str, *, phase: str = "xe",
                    start: str | None = None, seqkd_source: str | None = None,
                    digests: dict[str, str | None] | None = None) -> FitResult:
    """``capflow train`` outside the recipe (its own captions, initialisation, SCST start or stores): one XE or SCST
    training of ``plan``, recorded like a stage run - params, inputs (``digests``: features, labels, dataset),
    per-epoch metrics, the best checkpoint and its MLflow Model - in ``out``, which a killed run resumes."""
    digests = digests or {}
    with rc.tracker.run(stage, rc.parent_run, {"capflow.student": plan.name}) as run:
        rc.tracker.params(run, {"model": plan.name, "captions": plan.captions, "seqkd_source": seqkd_source,
                                "init_from": start if phase == "xe" else None,
                                "scst_from": start if phase == "scst" else None, "nproc": plan.nproc})
        for name, uri in (("features", inputs.features), ("labels", inputs.labels), ("dataset", inputs.dataset)):
            if uri and digests.get(name):
                rc.tracker.dataset(run, name, str(digests[name]), uri, "input" if name == "dataset" else "training")
        res = _train(rc, run, plan, inputs, Path(out), phase=phase, start=start, seqkd_source=seqkd_source)
        rc.tracker.artifact(run, res.checkpoint, "checkpoint")
        rc.tracker.json_artifact(run, "history.json", res.history)
        model_id = _log_trained_model(rc, run, res.checkpoint, plan, inputs.vocab, inputs.dataset)
        on = ("dataset", str(digests["dataset"])) if inputs.dataset and digests.get("dataset") else None
        rc.tracker.metrics(run, {"best_val_CIDEr": res.best_metric, "best_epoch": res.best_epoch,
                                 "resumed_from_epoch": res.resumed_from_epoch, "processes": res.processes},
                           model_id=model_id, dataset=on)
    return res
