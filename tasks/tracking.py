"""MLflow recording for the pipeline, always through explicit run ids (the active run is thread-local, and
Prefect runs tasks in worker threads).

Where runs go: ``MLFLOW_TRACKING_URI`` when set, else ``tracking.tracking_uri``, else the embedded default - a
SQLite file ``<workdir>/mlflow.db`` with artifacts beside it, ``<workdir>/mlartifacts`` (a SQLite database shared
by several workdirs keeps its artifacts beside itself too, never in the workdir that happened to create the
experiment; no server needed; ``mlflow ui
--backend-store-uri sqlite:///<workdir>/mlflow.db`` shows them). Transient tracking errors are retried with
backoff. Parameters are the flattened config; nothing that looks like a credential is ever logged: params, tags,
text artifacts (``config.yaml``) and warnings all go through :mod:`captioning.redact` (credentials belong in the
environment: ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, ``AWS_*``).

Runs always end: :meth:`Tracker.run` is a context manager that ends its run FINISHED, FAILED (an exception) or
KILLED (an interrupt, SIGTERM, a Prefect cancellation). Every run records its owner process (host, pid, process
start time); runs whose owner died without ending them (SIGKILL, power loss) are marked KILLED by the next
pipeline run of the same experiment (:meth:`Tracker.end_orphaned_runs`) and by ``capflow stack down``.

Fail fast: a tracking server that cannot be reached is reported within ~20 s, before any stage runs
(:func:`preflight`), and MLflow's own HTTP retries are capped (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
``MLFLOW_HTTP_REQUEST_TIMEOUT``, ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``, each only when not set already) so
they nest inside capflow's own retries in about a minute instead of many.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from captioning.config import PipelineConfig
from captioning.errors import InfrastructureError
from captioning.redact import SECRET_KEY, redact, redact_obj
from captioning.workdir import Workdir

log = logging.getLogger(__name__)
T = TypeVar("T")
PARENT_TAG = "mlflow.parentRunId"
# MLflow writes "View run ... at: URL" lines to stdout when a run ends on a tracking server; capflow's stdout is
# its own output (``--json`` documents), so those links are left out (the CLI prints where the runs are).
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
MAX_PARAM = 6000
# MLflow retries a failed HTTP request 7 times with backoff factor 2 and waits up to 120 s for each answer: about
# 4.5 minutes per call before capflow's own retries even start. These caps (only where the user set nothing)
# keep one call under ~1 minute; capflow retries transient failures itself (:func:`retry`).
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
# who started a run: an orphaned RUNNING run (its owner is gone) is ended KILLED by the next pipeline run
OWNER_HOST, OWNER_PID, OWNER_START = "capflow.owner.host", "capflow.owner.pid", "capflow.owner.start"
PREFLIGHT_DELAYS = (1.0, 2.0, 4.0, 8.0)  # waits between reachability attempts: ~15 s, plus connect timeouts


class TrackingUnavailable(InfrastructureError, RuntimeError):
    """The tracking server cannot be reached (raised before any stage runs)."""


def limit_http_retries() -> None:
    """Cap MLflow's HTTP retries and timeouts (see ``HTTP_LIMITS``) unless the environment sets them."""
    for k, v in HTTP_LIMITS.items():
        os.environ.setdefault(k, v)


limit_http_retries()


def preflight(uri: str, delays: tuple[float, ...] = PREFLIGHT_DELAYS, timeout: float = 5.0) -> None:
    """Raise :class:`TrackingUnavailable` (with the cause and the way out) when an http(s) tracking server does
    not answer: a TCP connection and any HTTP answer to ``GET <uri>/health`` (even 401/404: something answers).
    Tried ``len(delays) + 1`` times, so a server that is restarting gets a few seconds; other URIs (sqlite,
    databricks, ...) pass, their first call fails fast on its own."""
    u = urlparse(uri)
    if u.scheme not in ("http", "https") or not u.hostname:
        return
    shown = redact(uri)
    t0 = time.monotonic()
    cause = ""
    for i in range(len(delays) + 1):
        try:
            port = u.port or (443 if u.scheme == "https" else 80)
            socket.create_connection((u.hostname, port), timeout=timeout).close()
            req = urllib.request.Request(f"{uri.rstrip('/')}/health", method="GET")
            try:
                with urllib.request.urlopen(req, timeout=timeout):  # http(s) only (checked above)
                    pass
            except urllib.error.HTTPError:
                pass  # it answered (an auth proxy, no /health route): reachable
            return
        except (OSError, ValueError) as e:  # refused, no route, DNS, timeout, TLS
            reason = getattr(e, "reason", None) or e
            cause = f"{type(reason).__name__}: {redact(reason)}" if not isinstance(reason, str) else redact(reason)
        if i < len(delays):
            log.warning("MLflow tracking server %s not reachable (%s); trying again in %.0f s", shown, cause,
                        delays[i])
            time.sleep(delays[i])
    raise TrackingUnavailable(
        f"the MLflow tracking server {shown} is unreachable ({cause}; {len(delays) + 1} attempts in "
        f"{time.monotonic() - t0:.0f} s); nothing was run. Start it (a local one: capflow stack up --home DIR, then "
        'eval "$(capflow stack env --home DIR)"), fix MLFLOW_TRACKING_URI / tracking.tracking_uri, or unset both '
        "to record into <workdir>/mlflow.db")


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), "" elsewhere: tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def owner_tags() -> dict[str, str]:
    pid = os.getpid()
    return {OWNER_HOST: socket.gethostname(), OWNER_PID: str(pid), OWNER_START: _process_start(pid)}


def owner_alive(tags: Mapping[str, str]) -> bool | None:
    """Whether the process that started a run still runs: None when unknown (no owner recorded, another host)."""
    if OWNER_PID not in tags or tags.get(OWNER_HOST) != socket.gethostname():
        return None
    try:
        pid = int(tags[OWNER_PID])
        os.kill(pid, 0)
    except ValueError:
        return None
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    start = tags.get(OWNER_START, "")
    if start and _process_start(pid) not in ("", start):
        return False  # the pid was reused by a newer process
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False  # a zombie has finished
    except (OSError, IndexError):
        pass
    return True


def end_orphaned_runs(client: MlflowClient, experiment_ids: list[str], *, unowned: bool = False,
                      note: str = "") -> list[str]:
    """End KILLED every RUNNING run of these experiments whose owner process is gone (a killed pipeline);
    with ``unowned`` also runs that recorded no owner or another host's (``capflow stack down``: nothing can
    still be writing to the stack's store). Returns the run ids ended."""
    ended: list[str] = []
    token = None
    while True:
        page = retry(lambda t=token: client.search_runs(experiment_ids, "attributes.status = 'RUNNING'",
                                                        max_results=1000, page_token=t), "search running runs")
        for r in page:
            alive = owner_alive(r.data.tags)
            if alive is False or (alive is None and unowned):
                rid = r.info.run_id
                retry(lambda rid=rid: client.set_tag(rid, "capflow.ended_by", note or "capflow: owner gone"),
                      "tag orphaned run")
                retry(lambda rid=rid: client.set_terminated(rid, status="KILLED"), "end orphaned run")
                ended.append(rid)
        token = page.token
        if not token:
            return ended


def tracking_uri(cfg: PipelineConfig) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.tracking_uri
    if uri:
        return uri
    return f"sqlite:///{Workdir.of(cfg).mlflow_db().resolve()}"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI (``sqlite:////abs`` or ``sqlite:///rel``), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


@contextlib.contextmanager
def sqlite_setup_lock(db: Path | None, timeout: float = 300.0) -> Iterator[None]:
    """Serialise the creation of a SQLite tracking store (``<db>.lock`` beside it) across processes; a no-op for
    other stores. Failing to create it raises one line naming the database."""
    if db is None:
        yield
        return
    from captioning.locks import file_lock

    try:
        with file_lock(db.with_name(db.name + ".lock"), f"creating the MLflow store {db}", timeout=timeout):
            yield
    except TimeoutError as e:
        raise TrackingUnavailable(f"{e}: is another capflow process stuck creating it?") from None
    except Exception as e:  # MLflow's schema migration or retry()'s error: the store cannot be used
        cause = " ".join(f"{type(e).__name__}: {redact(e)}".split())[:300]
        raise TrackingUnavailable(f"the MLflow store {db} could not be created or opened ({cause}); if it was "
                                  "left half-made by a crash, move it aside and run again") from None


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

    def __init__(self, cfg: PipelineConfig, uri: str | None = None):
        """``uri``: the tracking URI already resolved by the flow (a Dask worker records exactly where the flow
        does, whatever its own environment says); unset = :func:`tracking_uri`."""
        self.cfg = cfg
        self.uri = uri or tracking_uri(cfg)
        self.display_uri = redact(self.uri)  # what may be printed, logged or stored
        db = sqlite_path(self.uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        limit_http_retries()
        preflight(self.uri)
        name = cfg.tracking.experiment or cfg.run.name
        # a fresh SQLite store is created (schema migrations) with the client: processes starting together take
        # turns, or MLflow fails half-way ("table ... already exists"); the experiment is made once the same way
        with sqlite_setup_lock(db):
            self.client = MlflowClient(self.uri)
            exp = retry(lambda: self.client.get_experiment_by_name(name), "get experiment")
            if exp is None:
                loc = None
                if db is not None:  # beside the database, not in the workdir of whichever run created it
                    loc = (db.parent / "mlartifacts").resolve().as_uri()
                # the kind tag makes the MLflow UI open the experiment as training runs, not as a GenAI app
                self.experiment_id = retry(lambda: self.client.create_experiment(
                    name, artifact_location=loc, tags={"mlflow.experimentKind": "custom_model_development"}),
                    "create experiment")
            else:
                self.experiment_id = exp.experiment_id

    # ------------------------------------------------------------------ runs
    def start(self, name: str, parent: str | None = None, tags: Mapping[str, Any] | None = None) -> str:
        """Create a run (prefer :meth:`run`, which always ends it)."""
        t = {k: redact(v) for k, v in (tags or {}).items() if not SECRET_KEY.search(k)}
        t.update(owner_tags())
        if parent:
            t[PARENT_TAG] = parent
        run = retry(lambda: self.client.create_run(self.experiment_id, run_name=name, tags=t), f"create run {name}")
        return run.info.run_id

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        retry(lambda: self.client.set_terminated(run_id, status=status), "end run")

    @contextlib.contextmanager
    def run(self, name: str, parent: str | None = None, tags: Mapping[str, Any] | None = None) -> Iterator[str]:
        """``with tracker.run("extract", parent=p) as run_id:`` - a run that ends FINISHED when the block
        completes, FAILED when it raises an exception (tagged ``capflow.error``), KILLED on an interrupt
        (KeyboardInterrupt, SystemExit from SIGTERM, Prefect's cancellation/termination signals)."""
        run_id = self.start(name, parent, tags)
        try:
            yield run_id
        except BaseException as e:
            status = "FAILED" if isinstance(e, Exception) else "KILLED"
            try:  # the block's exception is what matters; failing to record the end must not replace it
                self.tags(run_id, {"capflow.error": f"{type(e).__name__}: {redact(e)}"[:500]})
                self.end(run_id, status)
            except Exception as end_error:
                log.warning("could not end MLflow run %s (%s) as %s: %s", run_id, name, status, end_error)
            raise
        self.end(run_id, "FINISHED")

    def end_orphaned_runs(self) -> list[str]:
        """End KILLED this experiment's RUNNING runs whose owner process is gone (see :func:`end_orphaned_runs`);
        called at the start of every pipeline run."""
        ended = end_orphaned_runs(self.client, [self.experiment_id],
                                  note="capflow: ended by a later pipeline run (its process was gone)")
        if ended:
            log.warning("marked %d MLflow run(s) of an earlier, killed pipeline run KILLED: %s", len(ended),
                        ", ".join(ended))
        return ended

    def params(self, run_id: str, params: Mapping[str, Any]) -> None:
        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            chunk = items[i: i + 100]
            retry(lambda c=chunk: self.client.log_batch(run_id, params=c), "log params")

    def tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        items = [RunTag(k, redact(v)) for k, v in tags.items() if not SECRET_KEY.search(k)]
        retry(lambda: self.client.log_batch(run_id, tags=items), "set tags")

    def metrics(self, run_id: str, metrics: Mapping[str, Any], step: int = 0, prefix: str = "",
                model_id: str | None = None, dataset: tuple[str, str] | None = None) -> None:
        """Metrics of a run; with ``model_id`` (a LoggedModel of the run) they are also the model's, and with
        ``dataset`` = (name, digest) of one of the run's dataset inputs, measured on that dataset."""
        now = int(time.time() * 1000)
        name, digest = (dataset[0], dataset[1][:36]) if dataset else (None, None)
        items = [Metric(f"{prefix}{k}", float(v), now, step, model_id=model_id, dataset_name=name,
                        dataset_digest=digest) for k, v in metrics.items()
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

    # ------------------------------------------------------------------ models and registry
    def log_model(self, run_id: str, model_dir: str | Path, *, name: str, params: Mapping[str, Any] | None = None,
                  tags: Mapping[str, Any] | None = None, example: str | Path | None = None) -> str:
        """The capflow model folder as an MLflow Model (pyfunc from code) and a LoggedModel output of ``run_id``
        (:mod:`tasks.mlflow_models`); returns its ``model_id``. ``params`` are flattened like a run's."""
        from tasks.mlflow_models import log_captioner

        return log_captioner(self.client, self.experiment_id, run_id, model_dir, name=name,
                             params=flatten(params or {}),
                             tags={k: redact(v) for k, v in (tags or {}).items() if not SECRET_KEY.search(k)},
                             example=example, retry=retry)

    def register(self, run_id: str, artifact_path: str, tags: Mapping[str, Any], model_id: str | None = None) -> str:
        """A new version of the registered model: from the LoggedModel ``model_id`` (source ``models:/<id>``),
        else (older callers) from the run's artifact folder ``artifact_path``."""
        name = self.cfg.tracking.model_name
        if retry(lambda: _absent_as_none(lambda: self.client.get_registered_model(name)),
                 "get registered model") is None:
            # students register in parallel: another one may create it first
            retry(lambda: _existing_ok(lambda: self.client.create_registered_model(name)),
                  "create registered model")
        tags = {k: str(v) for k, v in tags.items()}
        if model_id:
            from tasks.mlflow_models import register_logged_model

            return register_logged_model(self.client, self.uri, name, model_id, run_id, tags, retry=retry)
        mv = retry(lambda: self.client.create_model_version(name, f"runs:/{run_id}/{artifact_path}", run_id=run_id,
                                                            tags=tags),
                   "create model version")
        return str(mv.version)

    def champion(self) -> tuple[str | None, dict[str, str]]:
        """(version, tags) of the current ``champion`` alias, (None, {}) only when the registered model does not
        exist or has no such alias. Any other failure is retried (transient) or raised - never read as "no
        champion", which would hand the alias to a worse model."""
        name = self.cfg.tracking.model_name
        rm = retry(lambda: _absent_as_none(lambda: self.client.get_registered_model(name)), "get registered model")
        aliases = dict(getattr(rm, "aliases", None) or {}) if rm is not None else {}
        if "champion" not in aliases:
            return None, {}
        mv = retry(lambda: self.client.get_model_version(name, str(aliases["champion"])), "get champion version")
        return str(mv.version), dict(mv.tags)

    def has_version(self, version: str) -> bool:
        """Whether this tracking store's registered model has ``version`` (a cached result from a run store may
        name a version another tracking store registered)."""
        name = self.cfg.tracking.model_name
        return retry(lambda: _absent_as_none(lambda: self.client.get_model_version(name, str(version))),
                     "get model version") is not None

    def set_champion(self, version: str) -> None:
        retry(lambda: self.client.set_registered_model_alias(self.cfg.tracking.model_name, "champion", version),
              "set alias")


def _absent_as_none(fn: Callable[[], T]) -> T | None:
    """``fn()``, or None when MLflow says the resource does not exist (every other error propagates)."""
    try:
        return fn()
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def _existing_ok(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except MlflowException as e:
        if e.error_code == "RESOURCE_ALREADY_EXISTS":
            return None
        raise


class LocalRecorder:
    """The tracker of single-stage commands (``capflow ingest|extract|vocab|train``): they write the same stage
    outputs and stage records as the pipeline but record no MLflow runs - ``capflow run`` does. Every recording
    call is accepted and dropped; runs have the id ``""``."""

    display_uri = "(not tracked: single-stage command)"

    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg

    @contextlib.contextmanager
    def run(self, name: str, parent: str | None = None, tags: Mapping[str, Any] | None = None) -> Iterator[str]:
        yield ""

    def params(self, run_id: str, params: Mapping[str, Any]) -> None:
        pass

    def tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        pass

    def metrics(self, run_id: str, metrics: Mapping[str, Any], step: int = 0, prefix: str = "",
                model_id: str | None = None, dataset: tuple[str, str] | None = None) -> None:
        pass

    def dataset(self, run_id: str, name: str, digest: str, source: str, context: str,
                profile: Mapping[str, Any] | None = None) -> None:
        pass

    def artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def json_artifact(self, run_id: str, name: str, obj: Any, artifact_path: str | None = None) -> None:
        pass

    def text_artifact(self, run_id: str, name: str, text: str, artifact_path: str | None = None) -> None:
        pass

    def history(self, run_id: str, rows: Iterable[Mapping[str, Any]], prefix: str = "") -> None:
        pass

    def log_model(self, run_id: str, model_dir: str | Path, *, name: str, params: Mapping[str, Any] | None = None,
                  tags: Mapping[str, Any] | None = None, example: str | Path | None = None) -> str | None:
        return None

    def register(self, run_id: str, artifact_path: str, tags: Mapping[str, Any], model_id: str | None = None
                 ) -> str | None:
        return None
