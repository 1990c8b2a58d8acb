"""The pipeline on an external Dask cluster whose workers share nothing with the flow but the object store and the
tracking server (issue 32): a `dask scheduler` and two `dask worker` processes, each worker started in its own
mount namespace with an empty tmpfs over the flow's directories (and the reference run's and the servers'), so no
file the flow writes is visible to them. `run.store` is an S3 bucket on a real S3 HTTP endpoint (moto server);
MLflow is a tracking server over HTTP with its artifacts on the same endpoint.

Extraction runs on the workers (the images reach them through the run store), the students run on the workers
(their inputs fetched from the run store, their checkpoints published after every epoch), and the worker training
`lw` is SIGKILLed once its first epoch is on the store: the task runs again and resumes from that epoch. The
leaderboard and the weights equal a local sequential run's; `capflow verify` passes on the store; a second run from
an empty directory is cached from the store at every stage."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.tasks.test_external_cluster import (
    BIN,
    _capflow,
    _clean_env,
    _flow_env,
    _result,
    _stop,
    kill_worker_running,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration]
STUDENTS = "lw,satic"
WORKDIR = ".capflow/tiny"
BUCKET = "capflow-run"
# 3 XE epochs: the killed attempt has published an epoch that the next attempt resumes from
RUN = ["run", "--preset", "tiny", "--students", STUDENTS, "--no-scst", "--set", "students.torch_threads=1",
       "--set", "students.xe.epochs=3"]


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               "mount -t tmpfs probe /mnt"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """S3 (moto) + an MLflow server, a scheduler and two workers that cannot see ``flow``, ``flow2``, ``ref`` or
    the servers' folder. Yields a dict of what the test needs."""
    if not _can_unshare():
        pytest.skip("needs `unshare --mount` and tmpfs mounts (root, as in CI) to hide the flow's files from workers")
    from distributed import Client

    from flows.stack import Stack
    from tests.flows.test_stack import _free_port

    root = tmp_path_factory.mktemp("nothing-shared")
    hidden = {name: root / name for name in ("flow", "flow2", "ref", "servers")}
    for d in hidden.values():
        d.mkdir()
    (hidden["flow"] / "marker").write_text("the flow's file")
    st = Stack(home=hidden["servers"], bucket=BUCKET)
    st.ports.update(s3=_free_port(), mlflow=_free_port())
    st.key_id, st.secret = "test-key", "test-secret-for-moto"
    procs: dict[str, subprocess.Popen] = {}
    logs = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    try:
        st._start("s3", 60)
        st.s3_client().create_bucket(Bucket=BUCKET)
        st._start("mlflow", 120)

        def start(name: str, argv: list[str], env: dict[str, str]) -> None:
            d = root / name
            d.mkdir(exist_ok=True)
            log = open(root / f"{name}.log", "w")  # noqa: SIM115 - closed at teardown
            logs.append(log)
            procs[name] = subprocess.Popen(argv, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT)

        start("scheduler", [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                            "--no-dashboard"], _clean_env(root / "scheduler"))
        mounts = " && ".join(f"mount -t tmpfs capflow-hidden {shlex.quote(str(d))}" for d in hidden.values())
        for name in ("w1", "w2"):
            # an operator's worker: its own directory, S3 credentials and endpoint in its environment, nothing else
            dask = [str(BIN / "dask"), "worker", address, "--name", name, "--nthreads", "1", "--nworkers", "1",
                    "--no-dashboard", "--local-directory", str(root / name / "dask")]
            start(name, ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"',
                         "sh", *dask], _clean_env(root / name, **st.s3_env()))
        with Client(address, timeout=120) as c:
            c.wait_for_workers(2, timeout=180)
            seen = c.run(os.path.exists, str(hidden["flow"] / "marker"))
        assert seen and not any(seen.values()), f"a worker sees the flow's files: {seen}"
        yield {**hidden, "address": address, "procs": procs, "root": root, "stack": st}
    finally:
        for name in ("w1", "w2", "scheduler"):
            if name in procs:
                _stop(procs[name])
        for log in logs:
            log.close()
        st.down(snapshot=False)


def _kill_after_first_epoch(stack, address: str, student: str, killed: list, stop: threading.Event) -> None:
    """SIGKILL the worker running ``student`` once its stage folder on the run store holds an epoch's checkpoint."""
    from distributed import Client

    s3 = stack.s3_client()
    with Client(address, timeout=60) as c:
        while not stop.is_set() and not killed:
            listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"run/trees/runs/student-{student}-")
            for obj in listed.get("Contents", []):
                manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read())
                if "xe/last.pt" in manifest["files"] and kill_worker_running(c, student, killed):
                    return
            stop.wait(0.05)


def test_workers_sharing_only_the_object_store_give_the_local_results(world, monkeypatch):
    from distributed import Client
    from mlflow import MlflowClient

    from tasks.cache import StageCache
    from tasks.refs import StudentResult

    st, address = world["stack"], world["address"]
    on_cluster = ["--set", f"features.dask_address={address}", "--set", f"students.dask_address={address}",
                  "--set", f"run.store=s3://{BUCKET}/run"]
    env = _flow_env(world["root"] / "flow-home", MLFLOW_TRACKING_URI=st.mlflow_url, **st.s3_env())
    killed: list = []
    stop = threading.Event()
    started = []
    t0 = time.monotonic()
    try:
        ref = _capflow(world["ref"], _flow_env(world["root"] / "ref-home"), *RUN)  # local, sequential, no store
        started.append(ref[0])
        killer = threading.Thread(target=_kill_after_first_epoch, args=(st, address, "lw", killed, stop),
                                  daemon=True)
        killer.start()
        run = _capflow(world["flow"], env, *RUN, *on_cluster)
        started.append(run[0])
        res = _result(run, "capflow run on the shared-nothing cluster")
        stop.set()
        killer.join(30)
        local = _result(ref, "capflow run, local path")
    finally:
        stop.set()
        for p in started:
            _stop(p)
    print(f"runs took {time.monotonic() - t0:.0f} s")

    assert killed, "the student finished before its worker could be killed"
    with Client(address, timeout=60) as c:
        c.wait_for_workers(2, timeout=120)
    assert res["failed"] == [] and local["failed"] == []
    assert all(v == "ran" for v in res["stages"].values()), res["stages"]
    rows = ("student", "metrics", "params", "unique_fraction", "distinct_captions", "repeated_token_rate")
    assert [{k: r[k] for k in rows} for r in res["leaderboard"]] == [{k: r[k] for k in rows}
                                                                    for r in local["leaderboard"]]
    # the students' outputs reached the flow only through the store (their records are there, not in the flow's
    # workdir); fetched into its workdir, they equal the local run's
    for k, v in st.s3_env().items():
        monkeypatch.setenv(k, v)
    assert StageCache(world["flow"] / WORKDIR).latest("student-*", StudentResult) is None
    for name in STUDENTS.split(","):
        a = StageCache(world["flow"] / WORKDIR, f"s3://{BUCKET}/run").latest(f"student-{name}", StudentResult)
        b = StageCache(world["ref"] / WORKDIR).latest(f"student-{name}", StudentResult)
        wa, wb = (torch.load(Path(d) / r.checkpoint, weights_only=True)["state_dict"]
                  for d, r in ((world["flow"], a), (world["ref"], b)))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
        assert (world["flow"] / a.predictions).read_text() == (world["ref"] / b.predictions).read_text()
    keys = [o["Key"] for o in st.s3_client().list_objects_v2(Bucket=BUCKET, Prefix="run/")["Contents"]]
    assert {k.split("/")[1] for k in keys} == {"blobs", "trees", "stages", "features"}
    assert sum(k.startswith("run/stages/") for k in keys) == 7

    # MLflow: the killed attempt KILLED, the next one FINISHED and resumed from the epoch the first published
    c = MlflowClient(st.mlflow_url)
    runs = c.search_runs([res["experiment_id"]], max_results=500)
    lw = {r.info.status: r for r in runs if r.data.tags.get("mlflow.runName") == "lw-1x"}
    assert sorted(lw) == ["FINISHED", "KILLED"], sorted(lw)
    assert lw["FINISHED"].data.metrics["xe_resumed_from_epoch"] >= 1
    versions = c.search_model_versions("name='capflow-captioner'")
    assert sorted(v.tags["student"] for v in versions) == ["lw", "satic"]

    # capflow verify on the store (no workdir on this machine), then a second run from an empty directory
    base = ["--preset", "tiny", "--set", f"run.store=s3://{BUCKET}/run"]
    env2 = _flow_env(world["root"] / "flow2-home", MLFLOW_TRACKING_URI=st.mlflow_url, **st.s3_env())
    ver = _result(_capflow(world["flow2"] / "verify", env2, "verify", *base), "capflow verify on the run store")
    states = [f["state"] for f in ver["findings"]]
    assert states and set(states) == {"ok"}
    assert sum(f["kind"] == "stage record" and f["path"].startswith("s3://") for f in ver["findings"]) == 7
    again = _result(_capflow(world["flow2"], env2, *RUN, *on_cluster), "second run from the run store")
    assert set(again["stages"].values()) == {"cached"}, again["stages"]
    assert [{k: r[k] for k in rows} for r in again["leaderboard"]] == [{k: r[k] for k in rows}
                                                                      for r in res["leaderboard"]]
    assert again["champion"]["reason"] == "already champion" and not again["champion"]["changed"]
