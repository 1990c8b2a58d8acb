"""``capflow deploy``: the pipeline as a Prefect deployment with a nightly schedule.

The deployment runs on the ``capflow`` process work pool (``capflow stack up`` starts a worker for it; on other
machines ``capflow serve`` does). Its entrypoint is the installed module ``flows.pipeline:pipeline``, so a worker
needs only this package installed - no image, no code upload. A deployment concurrency limit of 1 (collisions
are queued) means a nightly run never overlaps the previous one; the flow's typed parameters appear as a form in
the Prefect UI. The working directory of flow runs is the folder ``capflow deploy`` ran in (or ``--workdir``), so
relative ``run.workdir`` settings resolve where the caches of earlier runs are: a nightly run re-extracts only
new images and retrains only what is downstream of changed inputs (see tasks.cache).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from flows.stack import WORK_POOL, StackError

DEFAULT_CRON = "0 2 * * *"
DEPLOYMENT = "nightly"


def _require_api() -> str:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise StackError("PREFECT_API_URL is not set: start a server ('capflow stack up --home DIR' then "
                           "eval \"$(capflow stack env --home DIR)\"; DIR defaults to $CAPFLOW_STACK_HOME or "
                           "./.capflow/stack) or point it at your Prefect server")
    return url


def ensure_work_pool(name: str = WORK_POOL) -> str:
    """The pool's type; capflow's own process pool is created when missing, other pools must exist."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_work_pool(name).type
        except ObjectNotFound:
            if name != WORK_POOL:
                raise StackError(f"work pool {name!r} does not exist on the Prefect server; create it first "
                                 "(prefect work-pool create ...; see infra/README.md)") from None
            client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                                   description="capflow pipeline runs (local processes)"))
            return "process"


def deploy(*, name: str = DEPLOYMENT, cron: str = DEFAULT_CRON, timezone: str = "UTC",
           parameters: dict[str, Any] | None = None, workdir: str | Path | None = None,
           work_pool: str = WORK_POOL, paused: bool = False, image: str | None = None) -> dict[str, Any]:
    """Create or update the deployment; returns what the Prefect API now says about it."""
    from prefect.client.orchestration import get_client
    from prefect.schedules import Cron

    from flows.pipeline import FLOW_NAME, pipeline

    api = _require_api()
    try:  # the expression and the zone are checked before anything is registered
        Cron(cron, timezone=timezone)
    except ValueError as e:
        raise StackError(f"bad schedule {cron!r} ({timezone}): {e}") from None
    pool_type = ensure_work_pool(work_pool)
    wd = str(Path(workdir or Path.cwd()).resolve())
    with contextlib.redirect_stdout(sys.stderr):  # Prefect prints a table; stdout is for capflow's own output
        # a process worker runs the flow in the working dir; other pools (kubernetes, ...) use their image's
        job = {"working_dir": wd} if pool_type == "process" else {}
        if image and pool_type == "process":
            raise StackError(f"work pool {work_pool!r} runs local processes: --image applies to container pools")
        dep_id = _deploy(pipeline, name, work_pool, cron, timezone, parameters, job, paused, image)
    with get_client(sync_client=True) as client:
        d = client.read_deployment(dep_id)
    return {
        "deployment_id": str(d.id), "name": f"{FLOW_NAME}/{d.name}", "api": api, "work_pool": d.work_pool_name,
        "entrypoint": d.entrypoint, "working_dir": wd, "parameters": d.parameters,
        "schedules": [{"cron": getattr(s.schedule, "cron", None), "timezone": getattr(s.schedule, "timezone", None),
                       "active": s.active} for s in d.schedules],
        "concurrency_limit": d.global_concurrency_limit.limit if d.global_concurrency_limit else None,
        "run_command": f"prefect deployment run '{FLOW_NAME}/{d.name}'",
    }


def _deploy(pipeline, name, work_pool, cron, timezone, parameters, job, paused, image):
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron

    return pipeline.deploy(
        name=name, work_pool_name=work_pool, build=False, push=False, image=image,
        schedules=[Cron(cron, timezone=timezone)],
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        parameters=parameters or {}, job_variables=job, paused=paused,
        entrypoint_type=EntrypointType.MODULE_PATH, tags=["capflow", "nightly"],
        description="capflow DAG: ingest -> extract -> vocab -> teacher -> SeqKD -> students -> SCST -> "
                    "evaluation -> leaderboard -> promotion",
        print_next_steps=False, ignore_warnings=True)
