"""MLflow runs always end and tracking failures are clear (issue 18, findings 4 and 6), against a real local
tracking store (SQLite in the test's workdir): a run ends FINISHED / FAILED / KILLED with its block; a stage or a
student that raises leaves its run FAILED; runs of a killed process are ended KILLED by the next pipeline run and
by ``capflow stack down``; a registry error is never read as "no champion"; an unreachable tracking server fails
within a minute, before any stage."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from captioning.config import load_config
from tasks.cache import StageCache
from tasks.common import RunContext
from tasks.refs import FeaturesRef, SeqKDRef, StudentFailure, TeacherRef
from tasks.tracking import OWNER_HOST, OWNER_PID, Tracker, TrackingUnavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _cfg(work: Path, *extra: str, informative: bool = False):
    sets = [f"run.workdir={work}", *extra]
    if informative:  # tiny's synthetic dataset with features computed from its scenes (no detector)
        sets += ["dataset.synthetic.num_images=24", "features.source=synthetic-informative",
                 "features.feature_dim=16", "features.min_boxes=1"]
    return load_config("tiny", None, sets)


def _runs(tracker: Tracker) -> dict[str, Any]:
    return {r.data.tags["mlflow.runName"]: r for r in tracker.client.search_runs([tracker.experiment_id])}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- runs end with their block
def test_run_block_ends_finished_failed_or_killed_and_records_its_owner(tmp_path):
    tr = Tracker(_cfg(tmp_path))
    with tr.run("ok") as ok:
        pass
    with pytest.raises(ValueError, match="boom"), tr.run("fails", parent=ok) as failed:
        raise ValueError("boom")
    with pytest.raises(KeyboardInterrupt), tr.run("interrupted") as killed:
        raise KeyboardInterrupt
    c = tr.client
    assert c.get_run(ok).info.status == "FINISHED"
    f = c.get_run(failed)
    assert f.info.status == "FAILED" and f.data.tags["capflow.error"] == "ValueError: boom"
    assert f.data.tags["mlflow.parentRunId"] == ok
    assert c.get_run(killed).info.status == "KILLED"
    tags = c.get_run(ok).data.tags
    assert tags[OWNER_PID] == str(os.getpid()) and tags[OWNER_HOST] == socket.gethostname()


def test_a_stage_and_a_student_that_raise_leave_their_runs_failed(tmp_path):
    from captioning.training.recipe import model_plan
    from flows.pipeline import extract_task, ingest_task, student_task, vocab_task

    cfg = _cfg(tmp_path / "w", informative=True)
    tr = Tracker(cfg)
    with tr.run("pipeline") as parent:
        rc = RunContext(cfg, tr, parent, StageCache(cfg.workdir))
        data = ingest_task.fn(rc)
        feats = extract_task.fn(rc, data)
        # the vocab stage starts its run, then finds no feature store: its run must not stay RUNNING
        with pytest.raises(Exception, match="missing"):
            vocab_task.fn(rc, data, FeaturesRef(run_id="", uri=str(tmp_path / "missing.zarr"), digest="0" * 64,
                                                ok=0, rejected=0))
        labels = vocab_task.fn(rc, data, feats)
        # SATIC starts its run, then cannot read the teacher checkpoint it is initialised from: reported, not
        # raised (the other students go on), and its run ends FAILED
        teacher = TeacherRef(run_id="", checkpoint=str(tmp_path / "no-teacher.pt"), checkpoint_digest="1" * 64,
                             best_val_cider=0.0)
        kd = SeqKDRef(run_id="", source="seqkd:none", labels_digest=labels.labels_digest)
        plan = dataclasses.replace(model_plan(cfg, "satic"), scst=None)  # XE only
        res = student_task.fn(rc, plan, data, feats, labels, teacher, kd)
        assert isinstance(res, StudentFailure) and "no-teacher.pt" in res.error
    runs = tr.client.search_runs([tr.experiment_id])
    status: dict[str, list[str]] = {}
    for r in runs:
        status.setdefault(r.data.tags["mlflow.runName"], []).append(r.info.status)
    assert sorted(status["vocab"]) == ["FAILED", "FINISHED"]
    assert status["ingest"] == ["FINISHED"] and status["extract"] == ["FINISHED"]
    assert status["satic-k4"] == ["FAILED"]
    assert status["pipeline"] == ["FINISHED"]
    assert not [r for r in runs if r.info.status == "RUNNING"]


# ---------------------------------------------------------------------- killed runs
KILLED_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from captioning.config import load_config
    from tasks.tracking import Tracker
    tr = Tracker(load_config("tiny", None, ["run.workdir=" + sys.argv[1]]))
    with tr.run("pipeline") as parent, tr.run("extract", parent) as child:
        print(parent, child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _killed_runs(work: Path, uri: str | None = None) -> list[str]:
    """Run ids of a pipeline run and its child left RUNNING by a process killed with SIGKILL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"MLFLOW_TRACKING_URI": uri} if uri else {})}
    out = subprocess.run([sys.executable, "-c", KILLED_SCRIPT, str(work)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    return out.stdout.split()


def test_runs_of_a_killed_process_are_ended_killed_by_the_next_run_only(tmp_path):
    killed = _killed_runs(tmp_path)
    tr = Tracker(_cfg(tmp_path))
    assert {tr.client.get_run(r).info.status for r in killed} == {"RUNNING"}
    alive = tr.start("still-running")  # this process lives: its run is left alone
    assert sorted(tr.end_orphaned_runs()) == sorted(killed)
    assert {tr.client.get_run(r).info.status for r in killed} == {"KILLED"}
    assert tr.client.get_run(alive).info.status == "RUNNING"
    assert "later pipeline run" in tr.client.get_run(killed[0]).data.tags["capflow.ended_by"]
    assert tr.end_orphaned_runs() == []
    tr.end(alive)


def test_stack_down_ends_the_stacks_orphaned_runs_killed(tmp_path):
    from flows.stack import Stack

    home = tmp_path / "stack"
    home.mkdir()
    uri = f"sqlite:///{home / 'mlflow.db'}"
    killed = _killed_runs(tmp_path, uri)
    c = MlflowClient(uri)
    exp = c.create_experiment("other")
    unowned = c.create_run(exp).info.run_id  # no owner recorded (an older capflow, another client)
    res = Stack(home=home).down()
    assert sorted(res["runs_killed"]) == sorted([*killed, unowned])
    assert {c.get_run(r).info.status for r in [*killed, unowned]} == {"KILLED"}


# ---------------------------------------------------------------------- champion
class _FlakyRegistry:
    """The real client, except that the registry lookups fail ``failures`` times with a server error (what a
    tracking server answers while its database is busy or restarting) - not something SQLite can be made to do."""

    def __init__(self, client: MlflowClient, failures: int):
        self._client, self.failures, self.calls = client, failures, 0

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def _flaky(self, name: str, *a, **k):
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise MlflowException("Internal server error: database is locked", error_code="INTERNAL_ERROR")
        return getattr(self._client, name)(*a, **k)

    def get_registered_model(self, *a, **k):
        return self._flaky("get_registered_model", *a, **k)

    def get_model_version_by_alias(self, *a, **k):
        return self._flaky("get_model_version_by_alias", *a, **k)


def _registered(tr: Tracker, n: int) -> list[str]:
    versions = []
    for i in range(n):
        with tr.run(f"student-{i}") as run:
            versions.append(tr.register(run, "model", {"student": f"s{i}", "test_CIDEr": 0.1 * (i + 1),
                                                       "test_set": "t"}))
    return versions


def test_champion_absent_only_when_the_model_or_alias_does_not_exist(tmp_path):
    tr = Tracker(_cfg(tmp_path))
    assert tr.champion() == (None, {})  # no registered model
    v1, _ = _registered(tr, 2)
    assert tr.champion() == (None, {})  # a model without the alias
    tr.set_champion(v1)
    version, tags = tr.champion()
    assert version == v1 and tags["student"] == "s0"


def test_champion_lookup_retries_a_transient_error_and_never_reads_it_as_no_champion(tmp_path):
    from flows.pipeline import promote_task
    from tasks.refs import Leaderboard, Row

    tr = Tracker(_cfg(tmp_path))
    v1, v2 = _registered(tr, 2)
    tr.set_champion(v2)  # v2 scores 0.2
    real = tr.client
    tr.client = _FlakyRegistry(real, failures=1)
    assert tr.champion()[0] == v2 and tr.client.calls >= 2  # retried, then found

    # the registry keeps failing: promotion fails instead of handing the alias to the worse v1
    tr.client = _FlakyRegistry(real, failures=10**6)
    board = Leaderboard(rows=(Row(student="s0", preset="s0", metrics={"CIDEr": 0.1}, params=1, latency_ms=1.0,
                                  unique_fraction=1.0, distinct_captions=1, repeated_token_rate=0.0, run_id="",
                                  model_version=v1),))
    with tr.run("pipeline") as parent:
        rc = RunContext(tr.cfg, tr, parent, StageCache(tr.cfg.workdir))
        with pytest.raises(RuntimeError, match="database is locked"):
            promote_task.fn(rc, board, "t")
    assert str(real.get_model_version_by_alias(tr.cfg.tracking.model_name, "champion").version) == v2


# ---------------------------------------------------------------------- unreachable tracking server
def test_unreachable_tracking_server_fails_fast_with_a_clear_message(tmp_path, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(TrackingUnavailable) as e:
        Tracker(_cfg(tmp_path))
    assert time.monotonic() - t0 < 60
    msg = str(e.value)
    assert f"127.0.0.1:{port} is unreachable" in msg and "capflow stack up --home" in msg
    assert "MLFLOW_TRACKING_URI" in msg


def test_capflow_run_with_an_unreachable_tracking_server_stops_before_any_stage(tmp_path):
    port = _closed_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "PREFECT_HOME": str(tmp_path / "p")}
    env.pop("PREFECT_API_URL", None)
    work = tmp_path / "w"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--set",
                          f"run.workdir={work}"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert time.monotonic() - t0 < 60
    assert out.returncode == 3, out.stderr[-3000:]  # the environment failed, not the input (issue 34)
    assert f"capflow run: error: the MLflow tracking server http://127.0.0.1:{port} is unreachable" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (work / "stages").exists() and not (work / "datasets").exists()


# ---------------------------------------------------------------------- Prefect's temporary server
def _prefect_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), **extra}
    env.pop("PREFECT_API_URL", None)
    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" not in extra:
        env.pop("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", None)
    return env


def test_prefect_temporary_server_gets_90_s_to_start_unless_set(tmp_path):
    code = ("import flows.cli, flows.pipeline; from prefect.settings import "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as s; print(s.value())")
    for extra, want in (({}, "90"), ({"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "7"}, "7")):
        out = subprocess.run([sys.executable, "-c", code], env=_prefect_env(tmp_path, **extra), capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
        assert out.stdout.split()[-1:] == [want], out.stderr[-2000:]


def test_prefect_temporary_server_sends_no_telemetry_unless_asked(tmp_path):
    code = ("import flows.cli, flows.pipeline; from prefect.settings import "
            "PREFECT_SERVER_ANALYTICS_ENABLED as s; print(s.value())")
    for extra, want in (({}, "False"), ({"PREFECT_SERVER_ANALYTICS_ENABLED": "true"}, "True")):
        env = _prefect_env(tmp_path, **extra)
        if not extra:
            env.pop("PREFECT_SERVER_ANALYTICS_ENABLED", None)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
        assert out.stdout.split()[-1:] == [want], out.stderr[-2000:]


def test_prefect_server_that_does_not_start_in_time_names_the_cause_and_the_way_out(tmp_path):
    # a start-up timeout far below what the server needs stands in for a machine too loaded to start it in time
    env = _prefect_env(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    work = tmp_path / "w"
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--set",
                          f"run.workdir={work}"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 3, out.stderr[-3000:]  # the environment failed, not the input (issue 34)
    err = out.stderr
    assert "capflow run: error: Prefect's temporary API server did not start within 1 s" in err
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180" in err and "capflow stack up --home" in err
    assert "Traceback" not in err and "RuntimeError" not in err
    assert not (work / "stages").exists()


_LOCKED_SCRIPT = """
import logging, sqlite3
import prefect  # configures Prefect's logging (its console handler)
import sqlalchemy.exc
from flows.prefect_server import quiet_prefect_logs

quiet_prefect_logs()
log = logging.getLogger("prefect.events.clients")
locked = sqlalchemy.exc.OperationalError("UPDATE flow_run", {}, sqlite3.OperationalError("database is locked"))
try:
    raise RuntimeError("request failed") from locked
except RuntimeError:
    log.error("Service failed to process item", exc_info=True)
try:
    raise ValueError("something else broke")
except ValueError:
    log.error("another failure", exc_info=True)
"""


def test_prefect_database_locked_errors_reach_the_terminal_as_one_warning_line(tmp_path):
    # a fresh interpreter: Prefect's console handler binds the process's stderr when logging is first set up,
    # which inside a long pytest session is whatever capture was active then
    env = _prefect_env(tmp_path)
    out = subprocess.run([sys.executable, "-c", _LOCKED_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    err = out.stderr
    assert "database was busy (database is locked)" in err and "Service failed" not in err
    assert err.count("Traceback") == 1 and "something else broke" in err  # other errors keep their traceback


def test_shared_database_keeps_artifacts_beside_it_not_in_the_first_workdir(tmp_path):
    """Two workdirs share one tracking database: deleting the workdir that created the experiment must not break
    the other's artifacts (they live beside the database)."""
    import shutil

    from captioning.config import load_config
    from tasks.tracking import Tracker

    db = tmp_path / "shared" / "mlflow.db"
    sets = [f"tracking.tracking_uri=sqlite:///{db}", "tracking.experiment=shared-exp"]
    first = Tracker(load_config("tiny", None, [*sets, f"run.workdir={tmp_path / 'one'}"]))
    exp = first.client.get_experiment(first.experiment_id)
    assert exp.artifact_location == (db.parent / "mlartifacts").resolve().as_uri()
    with first.run("a") as rid:
        first.client.log_text(rid, "one", "note.txt")
    shutil.rmtree(tmp_path / "one", ignore_errors=True)
    second = Tracker(load_config("tiny", None, [*sets, f"run.workdir={tmp_path / 'two'}"]))
    assert second.experiment_id == first.experiment_id
    with second.run("b") as rid:
        second.client.log_text(rid, "two", "note.txt")
    path = second.client.download_artifacts(rid, "note.txt", str(tmp_path / "dl"))
    assert Path(path).read_text() == "two"
    assert not (tmp_path / "two" / "mlartifacts").exists()
