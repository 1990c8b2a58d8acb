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
import re
import time
from collections.abc import Iterator
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from captioning import progress
from captioning.config import PipelineConfig, load_config
from captioning.errors import InputError
from captioning.models.names import preset_name
from captioning.training.recipe import model_plan
from flows.prefect_server import caused_by, quiet_prefect_logs
from tasks import data, fanout, report, training
from tasks.common import RunContext
from tasks.fanout import student_cluster
from tasks.refs import Leaderboard, RunSummary, StudentFailure, StudentResult
from tasks.report import markdown
from tasks.tracking import Tracker

log = logging.getLogger("capflow.pipeline")
FLOW_NAME = "capflow-pipeline"

# The jobs as Prefect tasks: the orchestrator's wrappers and retries live here, not in the jobs. Prefect's own cache
# is off: caching is capflow's stage cache. A student is never retried as a task (its failure is a result).
def _worth_retrying(task, task_run, state) -> bool:
    """A task is retried after a passing failure, never after bad input (it would fail the same way)."""
    try:
        state.result()
    except Exception as e:
        return not caused_by(e, InputError)
    return True


RETRY = {"retries": 1, "retry_delay_seconds": 5, "retry_condition_fn": _worth_retrying, "cache_policy": NO_CACHE}
ingest_task = task(data.ingest, name="ingest", **RETRY)
extract_task = task(data.extract, name="extract", **RETRY)
vocab_task = task(data.vocab, name="vocab", **RETRY)
teacher_task = task(training.teacher, name="train-teacher", **RETRY)
seqkd_task = task(training.seqkd_captions, name="seqkd", **RETRY)
student_task = task(training.student, name="train-student", cache_policy=NO_CACHE)
student_remote_task = task(fanout.student_remote, name="train-student", cache_policy=NO_CACHE)
leaderboard_task = task(report.leaderboard, name="leaderboard", **RETRY)
promote_task = task(report.promote, name="promote", **RETRY)


def build_config(preset: str | None = "demo", config_path: str | None = None, overrides: list[str] | None = None,
                 students: list[str] | None = None, scst: bool = True) -> PipelineConfig:
    """The flow's parameters -> a validated config (raises ConfigError naming the key)."""
    extra = list(overrides or [])
    if students:
        extra.append(f"students.names=[{','.join(students)}]")
    if not scst:
        extra.append("students.scst.enabled=false")
    cfg = load_config(None if config_path else preset, config_path, extra)
    for s in cfg.students.names:
        preset_name(s)  # unknown names fail here, before any stage runs
    return cfg


@flow(name=FLOW_NAME, task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=True,
      validate_parameters=True)
def pipeline(preset: str = "demo", config_path: str | None = None, overrides: list[str] | None = None,
             students: list[str] | None = None, scst: bool = True) -> dict[str, Any]:
    """Run the whole capflow DAG (see the module docstring). Returns the run's summary (its JSON form)."""
    quiet_prefect_logs()  # also where a worker runs the flow (no capflow CLI)
    cfg = build_config(preset, config_path, overrides, students, scst)
    sink = ProgressArtifacts()
    progress.add_sink(sink)  # the stages' progress in the UI, as it goes (not as log lines)
    try:
        summary = run_pipeline(cfg, flow_run_id=str(flow_run.get_id() or ""))
    finally:
        progress.remove_sink(sink)
    from prefect.artifacts import create_markdown_artifact

    text = what_changed(summary)
    print(text)
    create_markdown_artifact(markdown=text, key="capflow-run-summary", description="what this run changed")
    return summary.to_record()


class ProgressArtifacts:
    """A :mod:`captioning.progress` sink: each progress bar of the run (extraction, an epoch, evaluation, ...) as a
    Prefect progress artifact of the task run it belongs to, updated at the bars' pace (every
    ``CAPFLOW_PROGRESS_EVERY`` seconds and when a bar closes)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[str, str], Any] = {}

    def __call__(self, desc: str, done: float, total: float | None) -> None:
        if not total:
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact
        from prefect.context import TaskRunContext

        ctx = TaskRunContext.get()
        kind = re.sub(r"\d+", "N", desc)  # one artifact per kind of bar ("epoch N/N"), not one per epoch
        key = (str(ctx.task_run.id) if ctx else "", kind)
        pct = min(100.0, 100.0 * done / total)
        if key not in self.ids:
            self.ids[key] = create_progress_artifact(pct, description=f"capflow: {kind}")
        else:
            update_progress_artifact(self.ids[key], pct)


def what_changed(summary: RunSummary) -> str:
    """A short markdown account of a run: stages re-run vs cached, the leaderboard, the champion decision."""
    ran = [k for k, v in summary.stages.items() if v == "ran"]
    cached = [k for k, v in summary.stages.items() if v == "cached"]
    lines = ["## capflow run summary", "",
             f"- re-ran (inputs or settings changed): {', '.join(ran) or 'nothing'}",
             f"- reused from cache: {', '.join(cached) or 'nothing'}"]
    if summary.seconds:
        lines.append("- wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary.seconds.items()))
    for f in summary.failed:
        lines.append(f"- FAILED: {f.student}: {f.error}")
    p = summary.promotion
    lines.append(f"- champion: {'changed to ' + str(p.candidate) if p.changed else 'unchanged'}"
                 f" (version {p.champion_version}; {p.reason})")
    lines += ["", markdown(summary.board), f"MLflow run `{summary.mlflow_run_id}` in {summary.tracking_uri}"]
    if summary.board.rows:
        lines.append("Trade-off report (CIDEr against size and latency, Pareto front, learning curves, sample "
                     f"captions): `runs:/{summary.mlflow_run_id}/report/report.html`")
    return "\n".join(lines)


def run_pipeline(cfg: PipelineConfig, flow_run_id: str = "", progress: bool | None = None) -> RunSummary:
    from captioning import stopping
    from captioning.locks import hold_workdir

    stopping.reset()  # a new run in a long-lived process (a served flow, tests): an earlier stop request is done
    with hold_workdir(cfg.workdir, "capflow-pipeline flow run"):  # one run per workdir (re-entrant: capflow run)
        return _run_pipeline(cfg, flow_run_id, progress)


def _run_pipeline(cfg: PipelineConfig, flow_run_id: str, progress: bool | None) -> RunSummary:
    tracker = Tracker(cfg)  # fails fast (before any stage) when the tracking server is unreachable
    # the students' Dask cluster (students.dask_workers / students.dask_address) before any stage: an unreachable
    # scheduler stops the run here
    with student_cluster(cfg) as client, RunContext.tracked(
            cfg, tracker, "pipeline", {"prefect.flow_run_id": flow_run_id},
            progress=True if progress is None else progress) as rc:  # captioning.progress: bar or lines
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
        plans = [model_plan(cfg, n) for n in cfg.students.names]  # each student resolved once, here
        if client is not None:  # one Dask task per student, in the cluster's worker processes
            futures = [student_remote_task.submit(rc, client, p, data, feats, labels, teacher, kd) for p in plans]
            results = [f.result() for f in futures]
            tracker.end_orphaned_runs()  # the runs of a student whose worker was killed (its task ran again)
        else:  # in this process, run.parallel_students at a time (threads)
            wave = cfg.run.parallel_students
            for i in range(0, len(plans), wave):
                futures = [student_task.submit(rc, p, data, feats, labels, teacher, kd) for p in plans[i: i + wave]]
                with stop_threads_on_interrupt(futures):  # SIGTERM: the students stop too, not just this thread
                    results += [f.result() for f in futures]
        with rc.timed("leaderboard"):
            board: Leaderboard = leaderboard_task(rc, results, data)
        with rc.timed("promote"):
            promo = promote_task(rc, board, data.digest, data, feats, labels)
    # wall time per stage in this run (students: in their own process or thread); credentials in the URI masked
    return RunSummary(mlflow_run_id=parent, tracking_uri=tracker.display_uri, experiment_id=tracker.experiment_id,
                      board=board, promotion=promo, stages=dict(rc.stages), seconds=dict(rc.seconds))


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


