"""The capflow DAG as one Prefect flow:

ingest -> extract -> vocab -> AIC teacher (XE) -> SeqKD -> students (XE, SATIC from the teacher's SeqKD captions
and weights) -> SCST -> evaluation -> leaderboard -> promotion.

Parameters are a small typed form (preset, config file, overrides, students, SCST on/off) validated before any
stage runs. Tasks pass references (paths, URIs, digests, MLflow run ids), never tensors. Every stage is cached by
its inputs' digests + config section + code version (``tasks.cache``), so a re-run with nothing changed only
re-reads the dataset; a killed run resumes where it stopped (chunks, epoch checkpoints).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

# Prefect's temporary server gets 20 s to start by default, too little on a loaded machine (2 of 16 starts failed
# on a busy 2-core box); read when prefect is first imported, so set before it (flows.cli sets it earlier still).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
# and it sends no telemetry (offline, the attempt logged an ERROR in every run); an explicit setting wins
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from captioning.config import PipelineConfig, load_config
from captioning.errors import InfrastructureError
from tasks.common import RunContext
from tasks.data import extract_task, ingest_task, vocab_task
from tasks.fanout import student_cluster, student_remote_task
from tasks.refs import StudentFailure, StudentResult
from tasks.report import leaderboard_task, markdown, promote_task
from tasks.tracking import Tracker
from tasks.training import seqkd_task, student_task, teacher_task

log = logging.getLogger("capflow.pipeline")
FLOW_NAME = "capflow-pipeline"


def build_config(preset: str | None = "demo", config_path: str | None = None, overrides: list[str] | None = None,
                 students: list[str] | None = None, scst: bool = True) -> PipelineConfig:
    """The flow's parameters -> a validated config (raises ConfigError naming the key)."""
    extra = list(overrides or [])
    if students:
        extra.append(f"students.names=[{','.join(students)}]")
    if not scst:
        extra.append("students.scst.enabled=false")
    cfg = load_config(None if config_path else preset, config_path, extra)
    from captioning.training.recipe import preset_name

    for s in cfg.students.names:
        preset_name(s)  # unknown names fail here, before any stage runs
    return cfg


@flow(name=FLOW_NAME, task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=True,
      validate_parameters=True)
def pipeline(preset: str = "demo", config_path: str | None = None, overrides: list[str] | None = None,
             students: list[str] | None = None, scst: bool = True) -> dict[str, Any]:
    """Run the whole capflow DAG (see the module docstring). Returns the run's summary."""
    quiet_database_locked()  # also where a worker runs the flow (no capflow CLI)
    cfg = build_config(preset, config_path, overrides, students, scst)
    summary = run_pipeline(cfg, flow_run_id=str(flow_run.get_id() or ""))
    from prefect.artifacts import create_markdown_artifact

    text = what_changed(summary)
    print(text)
    create_markdown_artifact(markdown=text, key="capflow-run-summary", description="what this run changed")
    return summary


def what_changed(summary: dict[str, Any]) -> str:
    """A short markdown account of a run: stages re-run vs cached, the leaderboard, the champion decision."""
    ran = [k for k, v in summary["stages"].items() if v == "ran"]
    cached = [k for k, v in summary["stages"].items() if v == "cached"]
    lines = ["## capflow run summary", "",
             f"- re-ran (inputs or settings changed): {', '.join(ran) or 'nothing'}",
             f"- reused from cache: {', '.join(cached) or 'nothing'}"]
    if summary.get("seconds"):
        lines.append("- wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary["seconds"].items()))
    for f in summary["failed"]:
        lines.append(f"- FAILED: {f['student']}: {f['error']}")
    ch = summary["champion"]
    lines.append(f"- champion: {'changed to ' + str(ch['student']) if ch['changed'] else 'unchanged'}"
                 f" (version {ch['version']}; {ch['reason']})")
    lines += ["", markdown(summary["leaderboard"], summary["failed"], summary.get("baseline")),
              f"MLflow run `{summary['mlflow_run_id']}` in {summary['tracking_uri']}"]
    return "\n".join(lines)


def run_pipeline(cfg: PipelineConfig, flow_run_id: str = "", progress: bool | None = None) -> dict[str, Any]:
    from captioning import stopping
    from captioning.locks import hold_workdir

    stopping.reset()  # a new run in a long-lived process (a served flow, tests): an earlier stop request is done
    with hold_workdir(cfg.workdir, "capflow-pipeline flow run"):  # one run per workdir (re-entrant: capflow run)
        return _run_pipeline(cfg, flow_run_id, progress)


def _run_pipeline(cfg: PipelineConfig, flow_run_id: str, progress: bool | None) -> dict[str, Any]:
    tracker = Tracker(cfg)  # fails fast (before any stage) when the tracking server is unreachable
    # the students' Dask cluster (students.dask_workers / students.dask_address) before any stage: an unreachable
    # scheduler stops the run here
    with student_cluster(cfg) as client, RunContext.tracked(
            cfg, tracker, "pipeline", {"prefect.flow_run_id": flow_run_id},
            progress=sys.stderr.isatty() if progress is None else progress) as rc:
        parent = rc.parent_run
        with rc.timed("ingest"):
            data = ingest_task(rc)
        with rc.timed("extract"):
            feats = extract_task(rc, data)
        with rc.timed("vocab"):
            labels = vocab_task(rc, data, feats)
        with rc.timed("teacher"):
            teacher = teacher_task(rc, data, feats, labels)
        with rc.timed("seqkd"):
            kd = seqkd_task(rc, data, feats, labels, teacher)
        results: list[StudentResult | StudentFailure] = []
        names = list(cfg.students.names)
        scst = cfg.students.scst.enabled
        if client is not None:  # one Dask task per student, in the cluster's worker processes
            futures = [student_remote_task.submit(rc, client, n, data, feats, labels, teacher, kd, scst)
                       for n in names]
            results = [f.result() for f in futures]
            tracker.end_orphaned_runs()  # the runs of a student whose worker was killed (its task ran again)
        else:  # in this process, run.parallel_students at a time (threads)
            wave = cfg.run.parallel_students
            for i in range(0, len(names), wave):
                futures = [student_task.submit(rc, n, data, feats, labels, teacher, kd, scst)
                           for n in names[i: i + wave]]
                with stop_threads_on_interrupt(futures):  # SIGTERM: the students stop too, not just this thread
                    results += [f.result() for f in futures]
        with rc.timed("leaderboard"):
            board = leaderboard_task(rc, results, data)
        with rc.timed("promote"):
            promo = promote_task(rc, board, data.digest, data, feats, labels)
    return {
        "mlflow_run_id": parent,
        "tracking_uri": tracker.display_uri,  # credentials (from MLFLOW_TRACKING_URI) masked
        "experiment_id": tracker.experiment_id,
        "leaderboard": [{k: r[k] for k in ("student", "preset", "metrics", "params", "latency_ms", "unique_fraction",
                                           "distinct_captions", "repeated_token_rate", "model_version")}
                        for r in board["leaderboard"]],
        "failed": board["failed"],
        "baseline": board["baseline"],
        "champion": {"version": promo.champion_version, "changed": promo.changed, "reason": promo.reason,
                     "student": promo.candidate if promo.changed else None},
        "stages": rc.stages,
        "seconds": rc.seconds,  # wall time per stage in this run (students: in their own process or thread)
    }


@contextlib.contextmanager
def stop_threads_on_interrupt(futures: list, grace: float | None = None) -> Iterator[None]:
    """When the flow's thread is interrupted (SIGTERM through Prefect's TerminationSignal, Ctrl-C, capflow's
    Stopped), ask the tasks running in worker threads to stop too (:mod:`captioning.stopping`: training ends
    after its current step, its MLflow runs end KILLED) and wait for them, at most ``grace`` seconds (default
    ``CAPFLOW_STOP_GRACE``), before the interrupt goes on; otherwise the threads would train to their end."""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, Exception):
            from captioning import stopping
            from flows.shutdown import exit_status, grace_seconds

            stopping.request(exit_status(e) - 128)
            deadline = time.monotonic() + (grace_seconds() if grace is None else grace)
            for f in futures:
                with contextlib.suppress(Exception):
                    f.wait(timeout=max(0.0, deadline - time.monotonic()))
        raise


class SQLiteLockedFilter(logging.Filter):
    """Turns an ERROR with a traceback about Prefect's SQLite database being busy ("database is locked": Prefect
    retries these itself) into a one-line WARNING, so that a busy local database does not print tracebacks on the
    user's terminal; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        chain, seen = [], set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            chain.append(str(exc))
            exc = exc.__cause__ or exc.__context__
        if "database is locked" not in " ".join([record.getMessage(), *chain]):
            return True
        record.msg, record.args = "Prefect's database was busy (database is locked); the call is retried", ()
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_database_locked(filter_: logging.Filter | None = None) -> None:
    """Install :class:`SQLiteLockedFilter` on every handler of the root logger and of Prefect's loggers (filters
    on handlers see the records of every child logger). Idempotent; call after Prefect configured logging."""
    f = filter_ or _LOCKED_FILTER
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
                                      if n.split(".")[0] in ("prefect", "uvicorn", "docket"))]
    for lg in loggers:
        for h in getattr(lg, "handlers", []):
            if f not in h.filters:
                h.addFilter(f)


_LOCKED_FILTER = SQLiteLockedFilter()


@contextlib.contextmanager
def _server_outside_our_process_group() -> Iterator[None]:
    """Prefect's temporary server is started in a session of its own that dies with this process (Linux parent-
    death signal): a Ctrl-C or a process-group SIGTERM then reaches capflow only, which reports its flow run's end
    to the server and stops it at exit, instead of the server dying first and Prefect waiting on it until the
    grace period ran out; a SIGKILLed capflow still takes the server with it."""
    import ctypes
    import signal as _signal

    from prefect.server.api import server as prefect_server

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the server stays in capflow's process group
        yield
        return

    def die_with_parent() -> None:  # in the child, before exec: one system call
        prctl(1, int(_signal.SIGTERM))  # PR_SET_PDEATHSIG

    real = prefect_server.subprocess.Popen

    def popen(*args: Any, **kwargs: Any):
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("preexec_fn", die_with_parent)
        return real(*args, **kwargs)

    prefect_server.subprocess = _PopenOverride(prefect_server.subprocess, popen)
    try:
        yield
    finally:
        prefect_server.subprocess = prefect_server.subprocess.module


class _PopenOverride:
    """The ``subprocess`` module as Prefect's server module sees it during the start: Popen replaced."""

    def __init__(self, module: Any, popen: Any):
        self.module, self.Popen = module, popen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


class PrefectUnavailable(InfrastructureError, RuntimeError):
    """Prefect's temporary API server did not start."""


def start_prefect_api() -> str | None:
    """Without ``PREFECT_API_URL``, start Prefect's temporary (ephemeral) API server now - the flow would start it
    on its first call - so that a failure says what happened and what to do instead of Prefect's bare
    RuntimeError. The start-up timeout is ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (capflow's
    default 90 s: Prefect's 20 s is too short on a loaded machine). Returns the API URL in use."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    quiet_database_locked()
    api = PREFECT_API_URL.value()
    if api or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return api or None
    from prefect.server.api.server import SubprocessASGIServer

    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    server = SubprocessASGIServer()
    try:
        with _server_outside_our_process_group():
            server.start(timeout=timeout)
    except Exception as e:
        server.stop()  # a server still starting is not left behind
        cause = " ".join(str(e).split())
        cause = cause if len(cause) <= 600 else cause[:300] + " ... " + cause[-300:]
        raise PrefectUnavailable(
            f"Prefect's temporary API server did not start within {timeout} s ({cause}). A busy machine is the usual "
            f"cause: allow it longer (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={max(2 * timeout, 180)}), or "
            "run a lasting server once and reuse it: capflow stack up --home DIR, then "
            'eval "$(capflow stack env --home DIR)" and run again') from None
    return server.api_url
