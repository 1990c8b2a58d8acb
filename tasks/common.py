"""What every stage job receives: the validated config, the tracker and parent run, the stage cache, the layout;
and the two ways a run of jobs starts: tracked (a parent MLflow run: the pipeline, or a single-stage command with a
tracking URI) or local (the same stage records, no MLflow)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from captioning.config import PipelineConfig
from captioning.workdir import Workdir
from tasks.cache import StageCache, code_version, stage_key
from tasks.refs import Ref
from tasks.tracking import LocalRecorder, Tracker, config_yaml

log = logging.getLogger("capflow.pipeline")
R = TypeVar("R", bound=Ref)


@dataclass
class RunContext:
    cfg: PipelineConfig
    tracker: Tracker | LocalRecorder
    parent_run: str
    cache: StageCache
    progress: bool = False
    stages: dict[str, str] = field(default_factory=dict)  # stage -> "ran" | "cached" | "failed"
    #: stages that run again although recorded (``capflow train --retrain``): record and folder are replaced
    rerun: frozenset[str] = frozenset()
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall seconds in this run (cached: ~0)

    @classmethod
    def local(cls, cfg: PipelineConfig, progress: bool = False, rerun: frozenset[str] = frozenset()) -> RunContext:
        """The context of a single-stage command: the pipeline's workdir layout and stage records, no MLflow."""
        return cls(cfg, LocalRecorder(cfg), "", StageCache.of(cfg), progress, rerun=rerun)

    @classmethod
    @contextlib.contextmanager
    def tracked(cls, cfg: PipelineConfig, tracker: Tracker, name: str, tags: Mapping[str, Any] | None = None,
                progress: bool = False, rerun: frozenset[str] = frozenset()) -> Iterator[RunContext]:
        """A parent MLflow run ``name`` (the config as params and ``config.yaml``, the code's identity as tags)
        whose stage jobs record their runs under it - the pipeline's ``pipeline`` run, or ``capflow <command>``.
        Ends FINISHED with the ``stages`` tag, FAILED/KILLED when the block raises."""
        tracker.end_orphaned_runs()  # runs of an earlier, killed process: KILLED, not RUNNING forever
        tags = {**(tags or {}), "git_commit": git_commit(), "config_digest": cfg.digest(),
                "code_version": code_version(), "capflow.preset_name": cfg.run.name}
        with tracker.run(name, tags=tags) as parent:
            tracker.params(parent, cfg.model_dump(mode="json"))
            tracker.text_artifact(parent, "config.yaml", config_yaml(cfg))  # credentials redacted
            rc = cls(cfg, tracker, parent, StageCache.of(cfg), progress, rerun=rerun)
            yield rc
            tracker.tags(parent, {"stages": ",".join(f"{k}={v}" for k, v in rc.stages.items())})

    @property
    def workdir(self) -> Workdir:
        return Workdir.of(self.cfg)

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Time the block as ``stage``'s wall seconds (:attr:`seconds`, the run summary's per-stage times)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = round(time.perf_counter() - t0, 3)

    def cached(self, stage: str, kind: type[R], **parts: Any) -> tuple[str, R | None]:
        """The stage's key and its recorded result of type ``kind`` (None: the stage must run)."""
        key = stage_key(stage, **parts)
        if stage in self.rerun:
            self.cache.forget(stage, key)
            return key, None
        hit = self.cache.get(stage, key, kind)
        if hit is not None:
            self.stages[stage] = "cached"
            self.tracker.tags(self.parent_run, {f"stage.{stage}": f"cached:{getattr(hit, 'run_id', '')}"})
            log.info("%s: cached (key %s)", stage, key[:12])
        return key, hit

    def done(self, stage: str, key: str, result: R) -> R:
        self.cache.put(stage, key, result)
        self.stages[stage] = "ran"
        self.tracker.tags(self.parent_run, {f"stage.{stage}": f"ran:{getattr(result, 'run_id', '')}"})
        return result


def tracking_requested(cfg: PipelineConfig) -> bool:
    """Whether a single-stage command records MLflow runs: a tracking URI was given (``MLFLOW_TRACKING_URI`` or
    ``tracking.tracking_uri``). The embedded default store belongs to ``capflow run``."""
    return bool(os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.tracking_uri)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
