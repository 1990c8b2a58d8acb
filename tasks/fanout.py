"""Students fanned out over a Dask cluster: one student (XE -> SCST -> evaluation -> model version) per task, each
in its own worker process.

``students.workers`` > 0 starts a LocalCluster of that many processes on 127.0.0.1 (one GPU each when the
machine has GPUs, Dask resource ``GPU=1``); ``students.dask_address`` uses a running scheduler instead. A worker
runs the same job as the flow's own process (:func:`tasks.training.student`) with a tracker of its own and the
parent MLflow run id passed explicitly (never the thread-local active run), so the MLflow tree is the one a
sequential run makes. A student's result does not depend on how many run at once: every worker process uses
``students.threads`` torch threads (default: usable CPUs // workers, the same in a sequential run with one
worker) and seeds itself. A worker that dies mid-student is replaced by Dask and the task runs again, resuming
from the student's last epoch checkpoint in its stage folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from captioning.config import PipelineConfig
from tasks.refs import DatasetRef, FeaturesRef, LabelsRef, SeqKDRef, StudentFailure, StudentResult, TeacherRef

log = logging.getLogger("capflow.pipeline")


class SchedulerUnavailable(RuntimeError):
    """The Dask scheduler named by ``students.dask_address`` cannot be reached."""


def uses_cluster(cfg: PipelineConfig) -> bool:
    return bool(cfg.students.dask_address) or cfg.students.workers > 0


def student_threads(cfg: PipelineConfig) -> int:
    """Torch threads of one student's process (the same whatever the number of students running at once)."""
    if cfg.students.threads:
        return cfg.students.threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, cfg.students.workers))


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
                    "(students.workers)") from None
            cluster = None
        else:
            from captioning.features.parallel import local_cluster

            cluster = local_cluster(cfg.students.workers)
            client = Client(cluster)
        try:
            yield client
        finally:
            client.close()
            if cluster is not None:
                cluster.close()


def student_on_worker(cfg_json: str, parent_run: str, name: str, data: DatasetRef, feats: FeaturesRef,
                      labels: LabelsRef, teacher: TeacherRef, kd: SeqKDRef, scst: bool,
                      threads: int) -> tuple[StudentResult | StudentFailure, str]:
    """What a Dask worker runs for one student: the student job in this process, recorded under ``parent_run``.
    Returns the result and the stage's state (``ran`` / ``cached`` / ``failed``)."""
    import torch

    from captioning.config import PipelineConfig
    from captioning.features.parallel import _worker_index
    from tasks.cache import StageCache
    from tasks.common import RunContext
    from tasks.tracking import Tracker
    from tasks.training import student

    torch.set_num_threads(threads)
    if torch.cuda.is_available():  # one GPU per worker (LocalCluster: as many workers as GPUs at most)
        torch.cuda.set_device(_worker_index() % torch.cuda.device_count())
    cfg = PipelineConfig.model_validate_json(cfg_json)
    rc = RunContext(cfg, Tracker(cfg), parent_run, StageCache(cfg.workdir))
    res = student(rc, name, data, feats, labels, teacher, kd, scst)
    state = "failed" if isinstance(res, StudentFailure) else rc.stages.get(f"student-{name}", "ran")
    return res, state


def student_remote(rc: Any, client: Any, name: str, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef,
                   teacher: TeacherRef, kd: SeqKDRef, scst: bool = True) -> StudentResult | StudentFailure:
    """One student as a Dask task (``GPU=1`` where the workers offer it), waited for; never raises. A task lost
    with its worker more often than Dask allows is that student's failure."""
    resources = {"GPU": 1} if _offers_gpus(client) else None
    fut = client.submit(student_on_worker, rc.cfg.model_dump_json(), rc.parent_run, name, data, feats, labels,
                        teacher, kd, scst, student_threads(rc.cfg), key=f"student-{name}-{rc.parent_run}",
                        pure=False, resources=resources)
    try:
        res, state = fut.result()
    except Exception as e:  # the worker died more often than distributed.scheduler.allowed-failures
        log.error("student %s: its Dask task failed: %s", name, e)
        res, state = StudentFailure(student=name, error=f"{type(e).__name__}: {e}"), "failed"
    rc.stages[f"student-{name}" if state != "failed" else f"student:{name}"] = state
    return res


def _offers_gpus(client: Any) -> bool:
    workers = client.scheduler_info().get("workers", {})
    return any((w.get("resources") or {}).get("GPU") for w in workers.values())


student_remote_task = task(student_remote, name="train-student", cache_policy=NO_CACHE)
