"""The scale bench's Prefect stage (``capflow bench scale --stages prefect``): one flow run's overhead at each size.
It lives beside the flow because only this layer imports Prefect; the other pipeline-side stages are
:mod:`tasks.bench_scale`'s."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from captioning.bench.scale.stages import Stage
from tasks.bench_scale import STAGES as TASK_STAGES
from tasks.bench_scale import dataset_path


def stage_prefect(p: Mapping[str, Any]) -> dict[str, Any]:
    """One Prefect flow run's overhead: a flow (``ThreadPoolTaskRunner``, as the pipeline) of three tasks that pass
    this size's dataset reference along, temporary API server included (no ``PREFECT_API_URL``)."""
    home = Path(p["out"]) / "prefect"
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.task_runners import ThreadPoolTaskRunner

    from tasks.refs import DatasetRef

    doc = json.loads(Path(dataset_path(p)).read_text(encoding="utf-8"))
    ref = DatasetRef(run_id="", path=dataset_path(p), digest=doc["digest"], images=len(doc["images"]),
                     captions=sum(len(e["captions"]) for e in doc["images"]), rejected_images=len(doc["rejected"]),
                     dropped_captions=len(doc["dropped_captions"]))
    del doc

    # no annotations: under ``from __future__ import annotations`` Prefect could not resolve a local class name
    @task(name="pass", cache_policy=NO_CACHE)
    def step(r):
        return r

    @flow(name="bench-scale-overhead", task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=False)
    def overhead(r):
        return step(step(step(r)))

    t0 = time.perf_counter()
    out = overhead(ref)
    return {"flow_seconds": time.perf_counter() - t0, "images": out.images}


STAGES: dict[str, Stage] = {**TASK_STAGES, "prefect": Stage(
    "prefect", "flows.bench_prefect:stage_prefect", "one Prefect flow run of three tasks (temporary API server)",
    ("prefect", "prefect.task_runners", "tasks.refs"), needs=("ingest",))}
