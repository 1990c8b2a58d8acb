"""The one workdir layout: every command and every pipeline task asks this module where a thing lives.

```
<run.workdir>/
  datasets/dataset-<digest16>.parquet                         normalised dataset, columnar (ingest; earlier
                                                              versions wrote dataset-<digest16>.json, still read)
  datasets/rejects-<digest16>.json                            its reject list
  synthetic/<digest12>/                                       generated synthetic dataset (no dataset.annotations)
  cache/file_hashes.sqlite, cache/weights/                    image sha256 cache; detector weights
  features/                                                   feature stores, unless features.store names a folder
  stages/<stage>-<key20>.json                                 stage records (the typed result of a finished stage)
  runs/<stage>-<key16>/                                       a stage's own outputs (labels, checkpoints, model)
  mlflow.db, mlartifacts/                                     embedded MLflow store (no tracking server configured)
```

``features.store`` has one meaning: the folder (local or ``s3://``) that holds feature stores; each store in it is
named by what determines its content (``<settings digest>.zarr``, ``informative-<digest>.zarr``,
``imported-<digest>.zarr``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Workdir:
    """Paths of one ``run.workdir`` (nothing is created until a caller writes)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def of(cls, cfg: Any) -> Workdir:
        """The workdir of a config (anything with ``run.workdir``: the layout depends on no config type)."""
        return cls(cfg.run.workdir)

    # data
    def dataset(self, digest: str) -> Path:
        return self.root / "datasets" / f"dataset-{digest[:16]}.parquet"

    def dataset_partial(self) -> Path:
        """Where ingest writes the dataset before its digest names it (one per process)."""
        return self.root / "datasets" / f".ingest-{os.getpid()}.parquet"

    def rejects(self, digest: str) -> Path:
        return self.root / "datasets" / f"rejects-{digest[:16]}.json"

    def synthetic(self, digest: str) -> Path:
        return self.root / "synthetic" / digest[:12]

    def file_hashes(self) -> Path:
        return self.root / "cache" / "file_hashes.sqlite"

    def weights_cache(self) -> Path:
        return self.root / "cache" / "weights"

    def default_features(self) -> Path:
        """The feature-store folder when ``features.store`` is unset."""
        return self.root / "features"

    # stages
    def stages(self) -> Path:
        return self.root / "stages"

    def record(self, stage: str, key: str) -> Path:
        return self.stages() / f"{stage}-{key[:20]}.json"

    def stage_dir(self, stage: str, key: str) -> Path:
        """A stage's private output folder, stable across re-runs with the same key."""
        return self.root / "runs" / f"{stage}-{key[:16]}"

    # tracking
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"
