"""What a student's Dask task carries (issue 32): the worker records into exactly the flow's resolved MLflow
tracking store and reads the flow's files by absolute paths, whatever its own environment and working directory
(another MLFLOW_TRACKING_URI, another directory, no SPICE setting); it never makes a SQLite store of its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from mlflow import MlflowClient

from captioning.config import load_config
from captioning.training.recipe import model_plan
from tasks.cache import StageCache
from tasks.common import RunContext
from tasks.fanout import StudentJob, student_on_worker, student_remote
from tasks.refs import DatasetRef, FeaturesRef, LabelsRef, SeqKDRef, StudentFailure, TeacherRef
from tasks.tracking import Tracker


class _Future:
    def __init__(self, fn, args, on_worker):
        self.fn, self.args, self.on_worker = fn, args, on_worker

    def result(self):
        self.on_worker()  # the task runs "on the worker": its environment and directory, not the flow's
        return self.fn(*self.args)


class _Client:
    """Stands in for a distributed Client: keeps what was submitted and runs it when its result is asked for."""

    def __init__(self, on_worker):
        self.on_worker, self.submitted = on_worker, []

    def scheduler_info(self):
        return {"workers": {}}

    def submit(self, fn, *args, **kw):
        self.submitted.append(args)
        return _Future(fn, args, self.on_worker)


def _refs():
    return (DatasetRef(run_id="", path="wd/datasets/dataset-0.json", digest="d" * 64, images=1, captions=1,
                       rejected_images=0, dropped_captions=0, rejects_path="wd/datasets/rejects-0.json"),
            FeaturesRef(run_id="", uri="wd/features/f.zarr", digest="f" * 64, ok=1, rejected=0),
            LabelsRef(run_id="", vocab_path="wd/runs/vocab-0/vocab.json", labels_uri="s3://bucket/labels.zarr",
                      labels_digest="l" * 64, vocab_digest="v" * 64, features_uri="wd/features/f.zarr",
                      features_digest="f" * 64),
            TeacherRef(run_id="", checkpoint="wd/runs/teacher-0/best.pt", checkpoint_digest="t" * 64,
                       best_val_cider=0.0),
            SeqKDRef(run_id="", source="seqkd:0", labels_digest="l" * 64))


def test_the_worker_records_into_the_flows_store_by_absolute_paths(tmp_path, monkeypatch):
    flow, worker = tmp_path / "flow", tmp_path / "worker"
    flow.mkdir()
    worker.mkdir()
    flow_uri = f"sqlite:///{flow / 'tracking' / 'flow.db'}"
    monkeypatch.chdir(flow)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", flow_uri)
    monkeypatch.setenv("CAPFLOW_SPICE_JARS", "jars")
    cfg = load_config("tiny", None, ["run.workdir=wd", "features.store=stores", "tracking.experiment=job"])
    tracker = Tracker(cfg)
    parent = tracker.start("pipeline")
    rc = RunContext(cfg, tracker, parent, StageCache(cfg.workdir))
    seen = {}

    def on_worker():
        monkeypatch.chdir(worker)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{worker / 'own.db'}")
        monkeypatch.delenv("CAPFLOW_SPICE_JARS")

    def fake_student(rc, plan, data, feats, labels, teacher, kd):
        seen.update(uri=rc.tracker.uri, cfg=rc.cfg, refs=(data, feats, labels, teacher, kd), plan=plan)
        rc.tracker.tags(rc.parent_run, {f"seen.{plan.label}": "on the worker"})  # fails in any other store
        return StudentFailure(student=plan.label, error="stub")

    monkeypatch.setattr("tasks.training.student", fake_student)
    client = _Client(on_worker)
    plan = dataclasses.replace(model_plan(cfg, "lw"), scst=None)
    res = student_remote(rc, client, plan, *_refs())
    assert res == StudentFailure(student="lw", error="stub")
    (args,) = client.submitted
    assert len(args) == 1 and isinstance(args[0], StudentJob) and args[0].tracking_uri == flow_uri
    assert seen["uri"] == flow_uri and seen["plan"] == plan and seen["plan"].scst is None  # the flow's plan
    assert MlflowClient(flow_uri).get_run(parent).data.tags["seen.lw"] == "on the worker"
    assert not (worker / "own.db").exists() and not list(tmp_path.rglob("mlflow.db"))
    wcfg = seen["cfg"]
    assert wcfg.run.workdir == str(flow / "wd") and wcfg.features.store == str(flow / "stores")
    assert wcfg.evaluation.spice_jars == str(flow / "jars")  # the flow's setting, not the worker's (none)
    data, feats, labels, teacher, kd = seen["refs"]
    assert data.path == str(flow / "wd/datasets/dataset-0.json") and feats.uri == str(flow / "wd/features/f.zarr")
    assert labels.vocab_path == str(flow / "wd/runs/vocab-0/vocab.json") and labels.labels_uri == "s3://bucket/labels.zarr"
    assert teacher.checkpoint == str(flow / "wd/runs/teacher-0/best.pt") and kd == _refs()[4]
    # the rest of the job is what the flow resolved too
    assert wcfg.model_dump(exclude={"run", "features", "evaluation"}) == cfg.model_dump(
        exclude={"run", "features", "evaluation"})
    tracker.end(parent)


def test_a_flow_store_the_worker_cannot_see_is_that_students_failure_not_a_new_store(tmp_path):
    missing = tmp_path / "elsewhere" / "mlflow.db"
    cfg = load_config("tiny", None, [f"run.workdir={tmp_path / 'wd'}"])
    job = StudentJob(cfg_json=cfg.model_dump_json(), tracking_uri=f"sqlite:///{missing}", parent_run="p",
                     plan_json=model_plan(cfg, "lw").to_json(), data=_refs()[0], feats=_refs()[1], labels=_refs()[2],
                     teacher=_refs()[3], kd=_refs()[4], threads=1)
    res, state = student_on_worker(job)
    assert state == "failed" and isinstance(res, StudentFailure)
    assert str(missing) in res.error and "tracking server" in res.error
    assert not missing.exists() and not list(tmp_path.rglob("*.db"))


@pytest.mark.parametrize("path, expected", [("s3://b/x.zarr", "s3://b/x.zarr"), ("", ""), ("/abs/x", "/abs/x"),
                                            ("rel/x", None)])
def test_absolute_leaves_uris_alone(path, expected, tmp_path, monkeypatch):
    from tasks.fanout import absolute

    monkeypatch.chdir(tmp_path)
    assert absolute(path) == (expected if expected is not None else str(Path(tmp_path) / path))


def test_the_normalised_dataset_names_its_images_root_by_absolute_path(synthetic_small, tmp_path, monkeypatch):
    """A worker reads the flow's dataset file from another directory: its images root must not be relative."""
    import shutil

    from captioning.data.karpathy import Dataset, read_karpathy

    shutil.copytree(synthetic_small, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    ds = read_karpathy(Path("data/dataset.json"), Path("data/images"), max_words=16)
    saved = ds.save(tmp_path / "dataset.json")
    monkeypatch.chdir(tmp_path.parent)
    loaded = Dataset.load(saved)
    assert loaded.images_root == str(tmp_path / "data" / "images")
    assert all(loaded.image_path(e).is_file() for e in loaded.images)


def test_a_daemonic_worker_refuses_data_parallel_students_with_the_way_out(tmp_path, monkeypatch):
    """`dask worker` processes are daemonic by default and may not start students.nproc ranks: said plainly."""
    import multiprocessing

    db = tmp_path / "flow.db"
    db.touch()
    cfg = load_config("tiny", None, [f"run.workdir={tmp_path / 'wd'}", "students.nproc=2"])
    job = StudentJob(cfg_json=cfg.model_dump_json(), tracking_uri=f"sqlite:///{db}", parent_run="p",
                     plan_json=model_plan(cfg, "lw").to_json(), data=_refs()[0], feats=_refs()[1], labels=_refs()[2],
                     teacher=_refs()[3], kd=_refs()[4], threads=1)
    monkeypatch.setitem(multiprocessing.current_process()._config, "daemon", True)
    res, state = student_on_worker(job)
    assert state == "failed" and "DASK_DISTRIBUTED__WORKER__DAEMON=False" in res.error
