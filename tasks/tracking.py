"""MLflow recording for the pipeline, always through explicit run ids (the active run is thread-local, and
Prefect runs tasks in worker threads).

Where runs go: ``MLFLOW_TRACKING_URI`` when set, else ``tracking.tracking_uri``, else the embedded default - a
SQLite file ``<workdir>/mlflow.db`` with artifacts under ``<workdir>/mlartifacts`` (no server needed; ``mlflow ui
--backend-store-uri sqlite:///<workdir>/mlflow.db`` shows them). Transient tracking errors are retried with
backoff. Parameters are the flattened config; nothing that looks like a credential is ever logged: params, tags,
text artifacts (``config.yaml``) and warnings all go through :mod:`captioning.redact` (credentials belong in the
environment: ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, ``AWS_*``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from captioning.config import PipelineConfig
from captioning.redact import SECRET_KEY, redact, redact_obj

log = logging.getLogger(__name__)
T = TypeVar("T")
PARENT_TAG = "mlflow.parentRunId"
# MLflow writes "View run ... at: URL" lines to stdout when a run ends on a tracking server; capflow's stdout is
# its own output (``--json`` documents), so those links are left out (the CLI prints where the runs are).
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
MAX_PARAM = 6000


def tracking_uri(cfg: PipelineConfig) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.tracking_uri
    if uri:
        return uri
    return f"sqlite:///{(cfg.workdir / 'mlflow.db').resolve()}"


def retry(fn: Callable[[], T], what: str, attempts: int = 4, base_delay: float = 0.5) -> T:
    """Call ``fn``; on connection-type failures retry with exponential backoff, then raise with context."""
    for i in range(attempts):
        try:
            return fn()
        except (MlflowException, OSError, ConnectionError) as e:
            transient = not isinstance(e, MlflowException) or getattr(e, "error_code", "") in (
                "TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED") or "connect" in str(e).lower()
            failure, final = f"{type(e).__name__}: {redact(e)}", not transient or i == attempts - 1
        # Outside the handler on purpose: MLflow's exception text may hold the tracking URI with its credentials,
        # so it is neither chained to the error nor the "current exception" a failing log handler would print.
        if final:
            raise RuntimeError(f"MLflow {what} failed: {failure}")
        delay = base_delay * 2**i
        log.warning("MLflow %s failed (%s); retrying in %.1fs", what, failure, delay)
        time.sleep(delay)
    raise AssertionError("unreachable")


def config_yaml(cfg: PipelineConfig) -> str:
    """The ``config.yaml`` artifact: the whole config as YAML, credentials redacted."""
    import yaml

    return yaml.safe_dump(redact_obj(cfg.model_dump(mode="json")), sort_keys=False, default_flow_style=False)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"}; keys that look like credentials are left out."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if SECRET_KEY.search(key):
            continue
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            s = json.dumps(v) if isinstance(v, list | tuple | bool) or v is None else str(v)
            out[key] = redact(s)[:MAX_PARAM]
    return out


class Tracker:
    """One pipeline run's view of MLflow: the experiment, the parent run, nested runs, inputs, artifacts."""

    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        self.display_uri = redact(self.uri)  # what may be printed, logged or stored
        if self.uri.startswith("sqlite:///"):
            cfg.workdir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(self.uri)
        name = cfg.tracking.experiment or cfg.run.name
        exp = retry(lambda: self.client.get_experiment_by_name(name), "get experiment")
        if exp is None:
            loc = None
            if self.uri.startswith("sqlite:///"):
                loc = (cfg.workdir / "mlartifacts").resolve().as_uri()
            # the kind tag makes the MLflow UI open the experiment as training runs, not as a GenAI app
            self.experiment_id = retry(lambda: self.client.create_experiment(
                name, artifact_location=loc, tags={"mlflow.experimentKind": "custom_model_development"}),
                "create experiment")
        else:
            self.experiment_id = exp.experiment_id

    # ------------------------------------------------------------------ runs
    def start(self, name: str, parent: str | None = None, tags: Mapping[str, Any] | None = None) -> str:
        t = {k: redact(v) for k, v in (tags or {}).items() if not SECRET_KEY.search(k)}
        if parent:
            t[PARENT_TAG] = parent
        run = retry(lambda: self.client.create_run(self.experiment_id, run_name=name, tags=t), f"create run {name}")
        return run.info.run_id

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        retry(lambda: self.client.set_terminated(run_id, status=status), "end run")

    def params(self, run_id: str, params: Mapping[str, Any]) -> None:
        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            chunk = items[i: i + 100]
            retry(lambda c=chunk: self.client.log_batch(run_id, params=c), "log params")

    def tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        items = [RunTag(k, redact(v)) for k, v in tags.items() if not SECRET_KEY.search(k)]
        retry(lambda: self.client.log_batch(run_id, tags=items), "set tags")

    def metrics(self, run_id: str, metrics: Mapping[str, Any], step: int = 0, prefix: str = "") -> None:
        now = int(time.time() * 1000)
        items = [Metric(f"{prefix}{k}", float(v), now, step) for k, v in metrics.items()
                 if isinstance(v, int | float) and not isinstance(v, bool) and v == v]
        if items:
            retry(lambda: self.client.log_batch(run_id, metrics=items), "log metrics")

    def dataset(self, run_id: str, name: str, digest: str, source: str, context: str,
                profile: Mapping[str, Any] | None = None) -> None:
        """An input of the run as an MLflow dataset with an explicit digest (metadata only)."""
        ds = Dataset(name=name, digest=digest[:36], source_type="capflow", source=json.dumps({"uri": redact(source)}),
                     profile=json.dumps(redact_obj(dict(profile or {})), default=str))
        retry(lambda: self.client.log_inputs(run_id, [DatasetInput(ds, [InputTag("mlflow.data.context", context)])]),
              f"log input {name}")

    def artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            retry(lambda: self.client.log_artifacts(run_id, str(p), artifact_path), f"log artifacts {p.name}")
        else:
            retry(lambda: self.client.log_artifact(run_id, str(p), artifact_path), f"log artifact {p.name}")

    def json_artifact(self, run_id: str, name: str, obj: Any, artifact_path: str | None = None) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / name
            p.write_text(redact(json.dumps(obj, indent=2, default=str, ensure_ascii=False)), encoding="utf-8")
            self.artifact(run_id, p, artifact_path)

    def text_artifact(self, run_id: str, name: str, text: str, artifact_path: str | None = None) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / name
            p.write_text(redact(text), encoding="utf-8")
            self.artifact(run_id, p, artifact_path)

    def history(self, run_id: str, rows: Iterable[Mapping[str, Any]], prefix: str = "") -> None:
        """Per-epoch metrics (step = epoch)."""
        for h in rows:
            self.metrics(run_id, {k: v for k, v in h.items() if k != "epoch"}, step=int(h.get("epoch", 0)),
                         prefix=prefix)

    # ------------------------------------------------------------------ registry
    def register(self, run_id: str, artifact_path: str, tags: Mapping[str, Any]) -> str:
        name = self.cfg.tracking.model_name
        try:
            retry(lambda: self.client.get_registered_model(name), "get registered model")
        except RuntimeError:
            retry(lambda: self.client.create_registered_model(name), "create registered model")
        mv = retry(lambda: self.client.create_model_version(name, f"runs:/{run_id}/{artifact_path}", run_id=run_id,
                                                            tags={k: str(v) for k, v in tags.items()}),
                   "create model version")
        return str(mv.version)

    def champion(self) -> tuple[str | None, dict[str, str]]:
        """(version, tags) of the current ``champion`` alias, (None, {}) if none."""
        name = self.cfg.tracking.model_name
        try:
            mv = self.client.get_model_version_by_alias(name, "champion")
        except MlflowException:
            return None, {}
        return str(mv.version), dict(mv.tags)

    def set_champion(self, version: str) -> None:
        retry(lambda: self.client.set_registered_model_alias(self.cfg.tracking.model_name, "champion", version),
              "set alias")
