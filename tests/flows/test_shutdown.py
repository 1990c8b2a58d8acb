"""Stopping cleanly (issue 34): SIGTERM reaches training in a worker thread (Prefect's thread pool runs the
students), which stops after its current step keeping the last epoch checkpoint; ``capflow run`` then exits 143
within seconds with its MLflow runs KILLED and no process it started left behind (the temporary Prefect server
was re-parented to PID 1 and kept listening)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from captioning import stopping
from captioning.bench.loader import make_data
from captioning.data.loader import CaptionDataset, MemoryFeatures
from captioning.models.encoder_decoder import Captioner
from captioning.models.registry import preset, scaled
from captioning.training import checkpoint
from captioning.training.loop import TrainSettings, train
from flows import shutdown


@pytest.fixture(autouse=True)
def _fresh_stop():
    stopping.reset()
    yield
    stopping.reset()


def _model() -> Captioner:
    cfg = scaled(preset("aic"), d_model=32, layers=1, heads=2, d_ff=64).replace(d_in=32, vocab_size=1000,
                                                                               max_len=24, dropout=0.1)
    torch.manual_seed(0)
    return Captioner(cfg)


def test_training_in_a_worker_thread_stops_after_its_step_keeping_the_epoch_checkpoint(tmp_path: Path) -> None:
    d = make_data(tmp_path / "data", images=24, max_boxes=6, dim=32, chunk_rows=4)
    data = CaptionDataset(MemoryFeatures(d["features"].astype("float32"), d["boxes"], d["num_boxes"], d["ids"],
                                         block_rows=4), labels=d["labels"], captions_per_image=2, shuffle_buffer=8,
                          seed=3)
    settings = TrainSettings(epochs=10_000, batch_size=6, warmup=5, seed=7)  # would run for many minutes
    first_epoch, outcome = threading.Event(), {}

    def work() -> None:
        try:
            train(_model(), data, settings, tmp_path / "ckpt", progress=False,
                  on_epoch=lambda epoch, m: first_epoch.set())
            outcome["finished"] = True
        except BaseException as e:  # what a Prefect worker thread would see
            outcome["raised"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    assert first_epoch.wait(120)
    t0 = time.monotonic()
    assert stopping.request(signal.SIGTERM) and not stopping.request(signal.SIGTERM)  # the first request counts
    t.join(30)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    err = outcome.get("raised")
    assert isinstance(err, stopping.Stopped) and not isinstance(err, Exception), outcome  # past `except Exception`
    assert err.signum == signal.SIGTERM and "last.pt holds the last finished epoch" in str(err)
    assert shutdown.exit_status(err) == 143
    assert checkpoint.load(tmp_path / "ckpt" / "last.pt")["epoch"] >= 0
    assert not list((tmp_path / "ckpt").glob("*.tmp")) and not list((tmp_path / "ckpt").glob(".*.tmp"))


def _rank_waits(rank: int, world: int, flags: str) -> None:
    Path(flags, f"rank-{rank}").write_text(str(os.getpid()))
    time.sleep(60)  # without the stop: launch() returns after a minute and the test fails


def test_a_stop_request_ends_data_parallel_ranks(tmp_path: Path) -> None:
    """`capflow train --nproc 2` / `students.nproc`: the spawned ranks stop with the caller, none outlives it."""
    from captioning.training.ddp import launch

    def request_when_up() -> None:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stopping.request(signal.SIGTERM)

    threading.Thread(target=request_when_up, daemon=True).start()
    with pytest.raises(stopping.Stopped, match="data-parallel training"):
        launch(_rank_waits, 2, str(tmp_path), threads=1)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank-*")]
    assert len(pids) == 2
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "a rank outlived launch()"


def _tree(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        kids = shutdown.children(todo.pop())
        out.update(kids)
        todo += kids
    return out


@pytest.mark.slow
@pytest.mark.integration
def test_sigterm_during_a_student_stops_capflow_run_cleanly(tmp_path: Path, capsys) -> None:
    """SIGTERM to `capflow run`'s process group while its student trains in Prefect's worker thread: exit 143
    within seconds, the student's epoch checkpoint intact, the pipeline's and the student's MLflow runs KILLED
    (none RUNNING), no child process (the temporary Prefect server) left; while it ran, a second writer was
    refused."""
    from mlflow import MlflowClient

    from flows.cli import main

    work = tmp_path / "work"
    sets = [f"run.workdir={work}", "features.source=synthetic-informative", "features.feature_dim=16",
            "features.min_boxes=1", "students.names=[lw]", "students.xe.epochs=1000", "students.scst.enabled=false"]
    cmd = [sys.executable, "-m", "flows.cli", "run", "--json", "--preset", "tiny",
           *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline, last = time.time() + 300, None
        while time.time() < deadline and proc.poll() is None and last is None:
            found = list(work.glob("runs/student-lw-*/xe/last.pt"))
            last = found[0] if found else None
            time.sleep(0.1)
        assert last is not None, proc.stderr.read()[-3000:] if proc.poll() is not None else "no student epoch"
        started = _tree(proc.pid)
        assert started, "the temporary Prefect server should be a child process"
        # one run per workdir: a second writer is refused at once, naming this run
        assert main(["ingest", "--set", f"run.workdir={work}", "--preset", "tiny"]) == 3
        assert f"in use by 'capflow run' (pid {proc.pid} on" in capsys.readouterr().err
        t0 = time.monotonic()
        # to the whole process group, as systemd does (Kubernetes signals PID 1 only): Prefect's temporary server,
        # in a session of its own, is not killed under Prefect's feet and capflow still stops it
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert took < 15, f"took {took:.1f} s to stop\n{err[-3000:]}"
    assert "capflow run: stopped (SIGTERM)" in err and "Traceback" not in err, err[-3000:]
    assert out == ""  # no summary of a run that did not finish
    st = checkpoint.load(last)  # intact, the resume point
    assert st["epoch"] >= 0
    assert not [p for p in work.rglob("*.tmp")]
    time.sleep(0.5)
    assert not [p for p in started if Path(f"/proc/{p}").exists()], "a process capflow started outlived it"
    assert json.loads((work / "capflow.lock").read_text() or "{}") == {}
    c = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()], max_results=100)
    status = {r.data.tags["mlflow.runName"]: r.info.status for r in runs}
    assert status["pipeline"] == "KILLED" and status["lw-1x"] == "KILLED", status
    assert "RUNNING" not in status.values(), status
