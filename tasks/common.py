"""What every stage job receives: the validated config, the tracker and parent run, the stage cache, the layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

from captioning.config import PipelineConfig
from captioning.workdir import Workdir
from tasks.cache import StageCache, stage_key
from tasks.refs import Ref
from tasks.tracking import LocalRecorder, Tracker

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

    @classmethod
    def local(cls, cfg: PipelineConfig, progress: bool = False) -> RunContext:
        """The context of a single-stage command: the pipeline's workdir layout and stage records, no MLflow."""
        return cls(cfg, LocalRecorder(cfg), "", StageCache(cfg.workdir), progress)

    @property
    def workdir(self) -> Workdir:
        return Workdir.of(self.cfg)

    def cached(self, stage: str, kind: type[R], **parts: Any) -> tuple[str, R | None]:
        """The stage's key and its recorded result of type ``kind`` (None: the stage must run)."""
        key = stage_key(stage, **parts)
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
