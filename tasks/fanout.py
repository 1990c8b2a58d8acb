"""Students fanned out over a Dask cluster: one student (XE -> SCST -> evaluation -> model version) per task, each
in its own worker process.

``students.dask_workers`` > 0 starts a LocalCluster of that many processes on 127.0.0.1 (one GPU each when the
machine has GPUs, Dask resource ``GPU=1``); ``students.dask_address`` uses a running scheduler instead. A worker
runs the same job as the flow's own process (:func:`tasks.training.student`) with a tracker of its own and the
parent MLflow run id passed explicitly (never the thread-local active run), so the MLflow tree is the one a
sequential run makes. A student's result does not depend on how many run at once: every worker process uses
``students.torch_threads`` torch threads (default: usable CPUs // workers, the same in a sequential run with one
worker) and seeds itself. A worker that dies mid-student is replaced by Dask and the task runs again, resuming
from the student's last epoch checkpoint in its stage folder.

Nothing a worker needs comes from the environment the flow started in: the flow resolves it and sends it in the
task's arguments (:class:`StudentJob`): the MLflow tracking URI the flow records into (never the worker's own
``MLFLOW_TRACKING_URI`` or a fallback SQLite store of its own), the config and stage results with every local path
made absolute against the flow's working directory, SPICE's jar folder, the torch threads. Credentials stay in
each process's own environment (``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, ``AWS_*``) and are not carried - except
any written into ``MLFLOW_TRACKING_URI`` itself, which travels with the URI (give them as the variables instead).

With a run store (``run.store``) the workers need no filesystem of the flow's: the stage results travel with their
workdir paths written ``@run/...``; a worker fetches what they name from the store into its own copy
(:func:`worker_workdir`), publishes its stage folder after every epoch and its result when done, and the flow fetches
the finished student's folder (:meth:`tasks.cache.StageCache.materialise`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from captioning.config import PipelineConfig
from captioning.errors import InfrastructureError
from captioning.training.recipe import ModelPlan
from captioning.util import usable_cpus
from tasks.refs import DatasetRef, FeaturesRef, LabelsRef, SeqKDRef, StudentFailure, StudentResult, TeacherRef

log = logging.getLogger("capflow.pipeline")
R = TypeVar("R")


class SchedulerUnavailable(InfrastructureError, RuntimeError):
    """The Dask scheduler named by ``students.dask_address`` cannot be reached."""


def uses_cluster(cfg: PipelineConfig) -> bool:
    return bool(cfg.students.dask_address) or cfg.students.dask_workers > 0


def student_threads(cfg: PipelineConfig) -> int:
    """Torch threads of one student's process (the same whatever the number of students running at once)."""
    if cfg.students.torch_threads:
        return cfg.students.torch_threads
    return max(1, usable_cpus() // max(1, cfg.students.dask_workers))


@contextlib.contextmanager
def student_cluster(cfg: PipelineConfig) -> Iterator[Any]:
    """A Dask client for the students (None when they run in the flow's process). An unreachable scheduler is a
    :class:`SchedulerUnavailable` naming it, raised before any stage runs."""
    if not uses_cluster(cfg):
        yield None
        return
    import dask
    from distributed import Client

    # a student may launch data-parallel ranks (students.nproc): its worker process must be allowed children
    with dask.config.set({"distributed.worker.daemon": False}):
        if cfg.students.dask_address:
            try:
                client = Client(cfg.students.dask_address, timeout=20)
            except (OSError, TimeoutError) as e:
                raise SchedulerUnavailable(
                    f"students.dask_address {cfg.students.dask_address} is unreachable ({type(e).__name__}: {e}); "
                    "start the scheduler and its workers, or unset it to train on a local cluster "
                    "(students.dask_workers)") from None
            cluster = None
        else:
            from captioning.features.parallel import local_cluster

            cluster = local_cluster(cfg.students.dask_workers)
            client = Client(cluster)
        try:
            yield client
        finally:
            client.close()
            if cluster is not None:
                cluster.close()


def absolute(path: str | None) -> str | None:
    """A local path made absolute against this process's working directory; URIs (``s3://``...) and None as
    they are."""
    if not path or "://" in path:
        return path
    return os.path.abspath(path)


def worker_config(cfg: PipelineConfig) -> PipelineConfig:
    """The config a worker runs with: ``run.workdir``, ``features.store``, ``features.extractor.weights``, the
    dataset's files and ``evaluation.spice_jars`` absolute, SPICE's jar folder taken from the flow's
    ``CAPFLOW_SPICE_JARS`` when the config names none (where the flow would have read it)."""
    from captioning.metrics.coco import SPICE_ENV

    d = cfg.model_dump(mode="json")
    d["run"]["workdir"] = absolute(d["run"]["workdir"])
    d["features"]["store"] = absolute(d["features"]["store"])
    d["features"]["extractor"]["weights"] = absolute(d["features"]["extractor"]["weights"])
    d["dataset"]["annotations"] = absolute(d["dataset"]["annotations"])
    d["dataset"]["images"] = absolute(d["dataset"]["images"])
    spice = d["evaluation"]["spice_jars"] or os.environ.get(SPICE_ENV)
    d["evaluation"]["spice_jars"] = absolute(os.path.expanduser(spice)) if spice else None
    d["run"]["store"] = absolute(d["run"]["store"])
    return PipelineConfig.model_validate(d)


def worker_workdir(store: str) -> Path:
    """Where a worker keeps its local copy of a run store: in the Dask worker's own local directory (outside a
    worker: the temporary folder), one folder per store."""
    import hashlib
    import tempfile

    try:
        from distributed import get_worker

        base = Path(get_worker().local_directory)
    except (ImportError, ValueError):
        base = Path(tempfile.gettempdir())
    return base / "capflow-run-store" / hashlib.sha256(store.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class StudentJob:
    """Everything a Dask worker needs to train, evaluate and register one student, resolved by the flow."""
    cfg_json: str  # worker_config: local paths absolute
    tracking_uri: str  # the flow's resolved MLflow tracking URI (credentials, if any, from the worker's environment)
    parent_run: str
    plan_json: str  # the student's ModelPlan, resolved by the flow
    data: DatasetRef
    feats: FeaturesRef
    labels: LabelsRef
    teacher: TeacherRef | None
    kd: SeqKDRef | None
    threads: int

    @property
    def plan(self) -> ModelPlan:
        return ModelPlan.from_json(self.plan_json)


def student_job(rc: Any, plan: ModelPlan, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
                teacher: TeacherRef | None, kd: SeqKDRef | None) -> StudentJob:
    """The flow's side: one student's job for a worker (see :class:`StudentJob`). With a run store the stage
    results name workdir paths relative to it (``@run/...``): the worker fetches them into its own copy."""
    ship = rc.cache.shipped
    return StudentJob(cfg_json=worker_config(rc.cfg).model_dump_json(), tracking_uri=rc.tracker.uri,
                      parent_run=rc.parent_run, plan_json=plan.to_json(), data=ship(data), feats=ship(feats),
                      labels=ship(labels), teacher=ship(teacher) if teacher is not None else None, kd=kd,
                      threads=student_threads(rc.cfg))


def student_on_worker(job: StudentJob) -> tuple[StudentResult | StudentFailure, str]:
    """What a Dask worker runs for one student: the student job in this process, recorded in the flow's tracking
    store under the flow's parent run. Returns the result and the stage's state (``ran`` / ``cached`` /
    ``failed``)."""
    import multiprocessing

    import torch

    from captioning.config import PipelineConfig
    from captioning.features.parallel import _worker_index
    from tasks.cache import StageCache
    from tasks.common import RunContext
    from tasks.tracking import Tracker, sqlite_path
    from tasks.training import student

    plan = job.plan
    db = sqlite_path(job.tracking_uri)
    if db is not None and not db.is_file():  # never a store of the worker's own: the runs would not be found
        return StudentFailure(student=plan.label, error=(
            f"the flow's MLflow store {db} is not visible on this Dask worker; give the workers the same "
            "filesystem at the same path, or record into a tracking server (MLFLOW_TRACKING_URI / "
            "tracking.tracking_uri = http(s)://...)")), "failed"
    cfg = PipelineConfig.model_validate_json(job.cfg_json)
    if cfg.run.store:  # nothing of the flow's filesystem: this worker's own copy of the run store
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"workdir": str(worker_workdir(cfg.run.store))})})
    if plan.nproc > 1 and multiprocessing.current_process().daemon:
        return StudentFailure(student=plan.label, error=(
            f"students.nproc={plan.nproc} starts data-parallel processes, which this Dask worker (a daemonic "
            "process) may not have: start the workers with DASK_DISTRIBUTED__WORKER__DAEMON=False in their "
            "environment (capflow's own LocalCluster does this)")), "failed"
    torch.set_num_threads(job.threads)
    if torch.cuda.is_available():  # one GPU per worker (LocalCluster: as many workers as GPUs at most)
        torch.cuda.set_device(_worker_index() % torch.cuda.device_count())
    cache = StageCache.of(cfg)
    rc = RunContext(cfg, Tracker(cfg, uri=job.tracking_uri), job.parent_run, cache)
    try:
        data, feats, labels = (cache.materialise(r) for r in (job.data, job.feats, job.labels))
        teacher = cache.materialise(job.teacher) if job.teacher is not None else None
    except Exception as e:  # the run store is unreachable or lacks what the flow published
        return StudentFailure(student=plan.label, error=f"{type(e).__name__}: {e}"), "failed"
    res = student(rc, plan, data, feats, labels, teacher, job.kd)
    state = "failed" if isinstance(res, StudentFailure) else rc.stages.get(plan.stage, "ran")
    if isinstance(res, StudentResult):
        res = cache.shipped(res)  # with a run store the flow fetches the student's folder from it
    return res, state


def student_remote(rc: Any, client: Any, plan: ModelPlan, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
                   teacher: TeacherRef | None, kd: SeqKDRef | None) -> StudentResult | StudentFailure:
    """One student as a Dask task (``GPU=1`` where the workers offer it), waited for; never raises. A task lost
    with its worker more often than Dask allows is that student's failure."""
    name = plan.label
    resources = {"GPU": 1} if _offers_gpus(client) else None
    fut = client.submit(student_on_worker, student_job(rc, plan, data, feats, labels, teacher, kd),
                        key=f"{plan.stage}-{rc.parent_run}", pure=False, resources=resources)
    try:
        res, state = fut.result()
    except Exception as e:  # the worker died more often than distributed.scheduler.allowed-failures
        log.error("student %s: its Dask task failed: %s", name, e)
        res, state = StudentFailure(student=name, error=f"{type(e).__name__}: {e}"), "failed"
    if isinstance(res, StudentResult):
        try:
            res = rc.cache.materialise(res)  # a run store's result: its folder fetched into the flow's workdir
        except Exception as e:
            log.error("student %s: its outputs cannot be fetched from the run store: %s", name, e)
            res, state = StudentFailure(student=name, error=f"{type(e).__name__}: {e}"), "failed"
    rc.stages[plan.stage] = state
    return res


def _offers_gpus(client: Any) -> bool:
    workers = client.scheduler_info().get("workers", {})
    return any((w.get("resources") or {}).get("GPU") for w in workers.values())

