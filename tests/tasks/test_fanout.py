"""Students fanned out over a Dask LocalCluster (students.dask_workers): two students trained at once in two worker
processes give the same metrics, weights and MLflow tree as a sequential run in the flow's own process."""

from __future__ import annotations

import pytest
import torch
from mlflow import MlflowClient

from flows.pipeline import pipeline
from tasks.fanout import SchedulerUnavailable, student_cluster

pytestmark = [pytest.mark.slow, pytest.mark.integration]
STUDENTS = ["lw", "satic"]  # satic: SeqKD captions + the teacher's weights (inputs from two earlier stages)


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _overrides(work, *extra):
    return [f"run.workdir={work}", "features.source=synthetic-informative", "features.feature_dim=16",
            "features.max_boxes=10", "features.min_boxes=1", "students.torch_threads=1", *extra]


def _tree(res):
    """The MLflow tree of a run: child and grandchild run names, inputs, params and metrics that are not timings."""
    c = MlflowClient(res["tracking_uri"])
    runs = c.search_runs([res["experiment_id"]], max_results=500)
    by_parent: dict[str, list] = {}
    for r in runs:
        by_parent.setdefault(r.data.tags.get("mlflow.parentRunId", ""), []).append(r)
    timing = ("seconds", "latency_ms", "xe_seconds")
    tree = {}
    for child in by_parent[res["mlflow_run_id"]]:
        name = child.data.tags["mlflow.runName"]
        tree[name] = {"inputs": sorted(d.dataset.name for d in child.inputs.dataset_inputs),
                      "nested": sorted(g.data.tags["mlflow.runName"] for g in by_parent.get(child.info.run_id, [])),
                      "status": child.info.status}
        if name in ("lw-1x", "satic-k4"):
            tree[name]["metrics"] = {k: v for k, v in child.data.metrics.items() if not k.endswith(timing)}
    assert not [r for r in runs if r.info.status == "RUNNING"]
    versions = c.search_model_versions("name='capflow-captioner'")
    return tree, sorted(v.tags["student"] for v in versions)


def _weights(res, work):
    from tasks.cache import StageCache
    from tasks.refs import StudentResult

    out = {}
    for name in STUDENTS:
        rec = StageCache(work).latest(f"student-{name}", StudentResult)
        out[name] = torch.load(rec.checkpoint, weights_only=True)["state_dict"]
    return out


def test_students_on_two_dask_workers_equal_a_sequential_run(harness, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    threads = torch.get_num_threads()
    # the workers' setting (students.torch_threads=1) in this process too: the teacher, trained here, is then the
    # same in both runs, and so is the arithmetic of the students trained here in the sequential run
    torch.set_num_threads(1)
    try:
        par = pipeline(preset="tiny", overrides=_overrides(tmp_path / "par", "students.dask_workers=2"),
                       students=STUDENTS)
        seq = pipeline(preset="tiny", overrides=_overrides(tmp_path / "seq", "run.parallel_students=1"),
                       students=STUDENTS)
    finally:
        torch.set_num_threads(threads)
    assert par["failed"] == [] and par["stages"]["student-lw"] == par["stages"]["student-satic"] == "ran"
    assert seq["failed"] == []
    key = {r["student"]: (r["metrics"], r["params"]) for r in seq["leaderboard"]}
    assert {r["student"]: (r["metrics"], r["params"]) for r in par["leaderboard"]} == key
    wp, ws = _weights(par, tmp_path / "par"), _weights(seq, tmp_path / "seq")
    for name in STUDENTS:
        assert wp[name].keys() == ws[name].keys()
        for k in wp[name]:
            assert torch.equal(wp[name][k], ws[name][k]), (name, k)
    tree_par, versions_par = _tree(par)
    tree_seq, versions_seq = _tree(seq)
    assert tree_par == tree_seq and versions_par == versions_seq == sorted(STUDENTS)
    assert tree_par["satic-k4"]["nested"] == ["evaluate", "scst"]
    assert {"seqkd-captions", "teacher-checkpoint"} <= set(tree_par["satic-k4"]["inputs"])

    # a cached re-run on the cluster: nothing trains again
    again = pipeline(preset="tiny", overrides=_overrides(tmp_path / "par", "students.dask_workers=2"),
                     students=STUDENTS)
    assert all(v == "cached" for v in again["stages"].values()), again["stages"]
    assert again["leaderboard"] == par["leaderboard"]


def test_an_unreachable_student_scheduler_is_a_clear_error(tmp_path):
    import socket

    from captioning.config import load_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config("tiny", None, [f"run.workdir={tmp_path}", f"students.dask_address=tcp://127.0.0.1:{port}"])
    with pytest.raises(SchedulerUnavailable, match=rf"127\.0\.0\.1:{port} is unreachable"), student_cluster(cfg):
        pass


def test_students_nproc_2_in_the_pipeline_equals_capflow_train_nproc_2(harness, tmp_path, monkeypatch, capsys):
    """students.nproc=2: the pipeline trains the student with 2 DDP processes (gloo), through the same training
    job as `capflow train --nproc 2`, so both end with the same weights."""
    import json
    from pathlib import Path

    from flows.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "w"
    res = pipeline(preset="tiny", overrides=_overrides(work, "students.nproc=2"), students=["lw"], scst=False)
    assert res["failed"] == []
    (xe_last,) = work.glob("runs/student-lw-*/xe/last.pt")
    capsys.readouterr()
    args = ["--preset", "tiny", *(x for o in _overrides(work) for x in ("--set", o))]
    assert main(["train", "--json", "--model", "lw", "--captions", "ground_truth", "--nproc", "2", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["processes"] == 2
    a = torch.load(xe_last, weights_only=True)
    b = torch.load(Path(out["last_checkpoint"]), weights_only=True)
    assert a["epoch"] == b["epoch"] and a["step"] == b["step"] > 0
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k


def test_a_sigkilled_student_worker_is_replaced_and_the_student_resumes(harness, tmp_path, monkeypatch):
    """SIGKILL the Dask worker process while it trains a student: Dask replaces the worker and runs the task
    again, which resumes from the student's last epoch checkpoint; the killed run does not stay RUNNING."""
    import signal
    import threading

    import psutil

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "k"
    killed: list[int] = []
    stop = threading.Event()

    def kill_the_worker_after_its_first_epoch():
        while not stop.is_set() and not killed:
            if list(work.glob("runs/student-lw-*/xe/last.pt")):
                for p in psutil.Process().children(recursive=True):
                    if "spawn_main" in " ".join(p.cmdline()):  # the Dask worker process (its nanny is here)
                        p.send_signal(signal.SIGKILL)
                        killed.append(p.pid)
                break
            stop.wait(0.02)

    t = threading.Thread(target=kill_the_worker_after_its_first_epoch, daemon=True)
    t.start()
    try:
        res = pipeline(preset="tiny", overrides=_overrides(work, "students.dask_workers=1", "students.xe.epochs=4"),
                       students=["lw"])
    finally:
        stop.set()
        t.join(10)
    assert killed, "the worker finished before it could be killed"
    assert res["failed"] == [] and [r["student"] for r in res["leaderboard"]] == ["lw"]
    c = MlflowClient(res["tracking_uri"])
    runs = c.search_runs([res["experiment_id"]], filter_string="tags.`mlflow.runName` = 'lw-1x'")
    status = sorted(r.info.status for r in runs)
    assert status == ["FINISHED", "KILLED"], status  # the killed worker's run is ended, not left RUNNING
    finished = next(r for r in runs if r.info.status == "FINISHED")
    assert finished.data.metrics["xe_resumed_from_epoch"] >= 1
    assert not [r for r in c.search_runs([res["experiment_id"]]) if r.info.status == "RUNNING"]
