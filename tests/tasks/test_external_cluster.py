"""capflow on an external Dask cluster started the way an operator starts one (issue 32): a `dask scheduler` and two
`dask worker` processes on 127.0.0.1, each in its own directory with its own clean environment (no
MLFLOW_TRACKING_URI, no capflow settings), and `capflow run` / `capflow extract` pointed at it with
`features.dask_address` and `students.dask_address`. The flow records into an MLflow store named only in its own
environment and uses the tiny preset's relative `run.workdir`: the workers must get both from the flow.

Results are those of the local path (extraction on a LocalCluster, students one after another in the flow's
process), also when the worker training a student is SIGKILLed mid-task: its nanny starts a new worker process and
the task runs again. The flows run with one torch thread (OMP_NUM_THREADS=1), the threads a student gets on a
worker (`students.torch_threads=1`) and a Dask worker's default, so the arithmetic is the same on both paths."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.integration]
BIN = Path(sys.executable).parent
STUDENTS = "lw,satic"  # satic: SeqKD captions + the teacher's weights (inputs from two earlier stages)
WORKDIR = ".capflow/tiny"  # the tiny preset's run.workdir: relative to each flow's own directory


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment built from nothing (as a service manager gives a process), not the test's."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
            "MPLCONFIGDIR": str(home / "mpl"), "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", **extra}


def _stop(p: subprocess.Popen, grace: float = 20) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(scheduler address, {worker name: its `dask worker` process}); stopped (workers first) afterwards."""
    from distributed import Client

    root = tmp_path_factory.mktemp("cluster")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    procs: dict[str, subprocess.Popen] = {}
    logs = []

    def start(name: str, *args: str) -> None:
        d = root / name
        d.mkdir()
        log = open(d.parent / f"{name}.log", "w")  # noqa: SIM115 - closed at teardown
        logs.append(log)
        procs[name] = subprocess.Popen([str(BIN / "dask"), *args], cwd=d,
                                       env=_clean_env(d), stdout=log, stderr=subprocess.STDOUT)

    try:
        start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard")
        for name in ("w1", "w2"):
            start(name, "worker", address, "--name", name, "--nthreads", "1", "--nworkers", "1", "--no-dashboard",
                  "--local-directory", str(root / name / "dask"))
        with Client(address, timeout=120) as c:
            c.wait_for_workers(2, timeout=180)
        yield address, procs, root
    finally:
        for name in ("w1", "w2", "scheduler"):
            if name in procs:
                _stop(procs[name])
        for log in logs:
            log.close()


def _capflow(cwd: Path, env: dict[str, str], *args: str) -> tuple[subprocess.Popen, Path]:
    """`capflow ARGS --json` started in ``cwd``; its output goes to files there (a pipe nobody reads would fill)."""
    cwd.mkdir(parents=True, exist_ok=True)
    with open(cwd / "stdout.json", "w") as out, open(cwd / "stderr.log", "w") as err:
        return subprocess.Popen([str(BIN / "capflow"), *args, "--json"], cwd=cwd, env=env, stdout=out,
                                stderr=err), cwd


def _result(started: tuple[subprocess.Popen, Path], what: str, timeout: float = 900) -> dict:
    p, cwd = started
    p.wait(timeout)
    assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{(cwd / 'stderr.log').read_text()[-4000:]}"
    return json.loads((cwd / "stdout.json").read_text())


def _flow_env(home: Path, **extra: str) -> dict[str, str]:
    return _clean_env(home, PREFECT_HOME=str(home / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                      OMP_NUM_THREADS="1", **extra)


RUN = ["run", "--preset", "tiny", "--students", STUDENTS, "--no-scst", "--set", "students.torch_threads=1"]


def _records(work: Path, stage: str, kind):
    from tasks.cache import StageCache

    rec = StageCache(work).latest(stage, kind)
    assert rec is not None, f"no {stage} record in {work}"
    return rec


def kill_worker_running(client, student: str, killed: list) -> bool:
    """SIGKILL the worker process whose task is ``student``'s (recorded in ``killed``); False when none runs it."""
    busy = [a for a, keys in client.processing().items() if any(str(k).startswith(f"student-{student}-")
                                                                for k in keys)]
    if not busy:
        return False
    pid = client.run(os.getpid, workers=busy)[busy[0]]
    os.kill(pid, signal.SIGKILL)
    killed.append((busy[0], pid))
    return True


def _kill_the_worker_training(address: str, student: str, stage_dir: Path, killed: list, stop: threading.Event):
    """SIGKILL the worker process that runs ``student``'s task once its training has started."""
    from distributed import Client

    with Client(address, timeout=60) as c:
        while not stop.is_set() and not killed:
            if list(stage_dir.glob(f"runs/student-{student}-*/xe")) and kill_worker_running(c, student, killed):
                return
            stop.wait(0.05)


def test_capflow_on_an_external_cluster_equals_the_local_path_even_when_a_worker_is_killed(cluster, tmp_path):
    from distributed import Client
    from mlflow import MlflowClient

    from tasks.refs import FeaturesRef, StudentResult

    address, procs, root = cluster
    t0 = time.monotonic()
    started = []
    killed: list = []
    stop = threading.Event()
    try:
        # the local path: extraction on a LocalCluster (tiny: features.dask_workers=2), students in the flow's process
        ref = _capflow(tmp_path / "local", _flow_env(tmp_path / "local-home"), *RUN)
        # capflow extract on the cluster, from yet another directory, while the run below uses the cluster too
        ext = _capflow(tmp_path / "extract", _flow_env(tmp_path / "extract-home"), "extract", "--preset", "tiny",
                       "--set", f"features.dask_address={address}")
        started += [ref[0], ext[0]]
        # the external cluster, the flow recording into a store that only its own environment names
        flow_db = tmp_path / "tracking" / "flow.db"
        env = _flow_env(tmp_path / "cluster-home", MLFLOW_TRACKING_URI=f"sqlite:///{flow_db}")
        on_cluster = ["--set", f"features.dask_address={address}", "--set", f"students.dask_address={address}"]
        work = tmp_path / "cluster" / WORKDIR
        killer = threading.Thread(target=_kill_the_worker_training, args=(address, "lw", work, killed, stop),
                                  daemon=True)
        killer.start()
        run = _capflow(tmp_path / "cluster", env, *RUN, *on_cluster)
        started.append(run[0])
        res = _result(run, "capflow run on the cluster")
        stop.set()
        killer.join(30)
        extracted = _result(ext, "capflow extract on the cluster")
        local = _result(ref, "capflow run, local path")
    finally:
        stop.set()
        for p in started:  # only after a failure: a run still going is stopped
            _stop(p)
    print(f"runs took {time.monotonic() - t0:.0f} s")

    assert killed, "the student finished before its worker could be killed"
    with Client(address, timeout=60) as c:  # the killed worker was replaced (its nanny started a new process)
        c.wait_for_workers(2, timeout=120)
        pids = c.run(os.getpid)
    assert killed[0][1] not in pids.values() and all(p.poll() is None for p in procs.values())

    assert res["failed"] == [] and local["failed"] == []
    assert res["stages"]["student-lw"] == res["stages"]["student-satic"] == "ran"
    rows = ("student", "metrics", "params", "unique_fraction", "distinct_captions", "repeated_token_rate")
    assert [{k: r[k] for k in rows} for r in res["leaderboard"]] == [{k: r[k] for k in rows}
                                                                    for r in local["leaderboard"]]
    local_work = tmp_path / "local" / WORKDIR
    # extraction: the same store contents (digest over ids, status, attributes and every chunk's checksum)
    digests = {_records(w, "extract", FeaturesRef).digest
               for w in (local_work, work, tmp_path / "extract" / WORKDIR)}
    assert len(digests) == 1 and extracted["ok"] == _records(local_work, "extract", FeaturesRef).ok
    for name in STUDENTS.split(","):
        a, b = (_records(w, f"student-{name}", StudentResult) for w in (work, local_work))
        assert Path(a.checkpoint).is_absolute()  # written by a worker: the flow's workdir, by its absolute path
        local_dir = tmp_path / "local"  # the local run's paths are relative to its own directory
        wa, wb = (torch.load(local_dir / r.checkpoint, weights_only=True)["state_dict"] for r in (a, b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
        assert (local_dir / a.predictions).read_text() == (local_dir / b.predictions).read_text()

    # MLflow: everything in the flow's store, nothing left RUNNING, the killed attempt ended KILLED
    assert res["tracking_uri"] == f"sqlite:///{flow_db}"
    c = MlflowClient(f"sqlite:///{flow_db}")
    runs = c.search_runs([res["experiment_id"]], max_results=500)
    lw = sorted(r.info.status for r in runs if r.data.tags.get("mlflow.runName") == "lw-1x")
    assert lw == ["FINISHED", "KILLED"], lw
    assert not [r for r in runs if r.info.status == "RUNNING"]
    versions = c.search_model_versions("name='capflow-captioner'")
    assert sorted(v.tags["student"] for v in versions) == ["lw", "satic"]
    for v in versions:  # each worker read a test image for its model's input example (the flow's absolute paths)
        mlmodel = Path(urlparse(c.get_logged_model(v.tags["capflow.model_id"]).artifact_location).path) / "MLmodel"
        assert "saved_input_example_info" in mlmodel.read_text(), v.tags["student"]
    # no worker made a tracking store of its own (the bug: each fell back to <workdir>/mlflow.db)
    assert not list((tmp_path / "cluster").rglob("mlflow.db")) and not list(root.rglob("*.db"))
