"""What every pipeline task receives: the validated config, the MLflow tracker and parent run, the stage cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from captioning.config import PipelineConfig
from tasks.cache import StageCache, stage_key
from tasks.tracking import Tracker

log = logging.getLogger("capflow.pipeline")


@dataclass
class RunContext:
    cfg: PipelineConfig
    tracker: Tracker
    parent_run: str
    cache: StageCache
    progress: bool = False
    stages: dict[str, str] = field(default_factory=dict)  # stage -> "ran" | "cached" | "failed"

    def cached(self, stage: str, **parts: Any) -> tuple[str, dict[str, Any] | None]:
        key = stage_key(stage, **parts)
        hit = self.cache.get(stage, key)
        if hit is not None:
            self.stages[stage] = "cached"
            self.tracker.tags(self.parent_run, {f"stage.{stage}": f"cached:{hit.get('run_id', '')}"})
            log.info("%s: cached (key %s)", stage, key[:12])
        return key, hit

    def done(self, stage: str, key: str, result: dict[str, Any]) -> dict[str, Any]:
        self.cache.put(stage, key, result)
        self.stages[stage] = "ran"
        self.tracker.tags(self.parent_run, {f"stage.{stage}": f"ran:{result.get('run_id', '')}"})
        return result
