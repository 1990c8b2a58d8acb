"""Model references -> local model folders: a path as is, or a registered model version downloaded from MLflow.

``models:/NAME@ALIAS`` (e.g. ``models:/capflow-captioner@champion``) and ``models:/NAME/VERSION`` are looked up
in the MLflow model registry at the given tracking URI (default: ``MLFLOW_TRACKING_URI``, else the pipeline's
embedded default for the default config, :func:`tasks.tracking.tracking_uri`). A version's source is an MLflow
Model (``models:/<model_id>``, :mod:`tasks.mlflow_models`: the capflow folder is its ``artifacts/model``) or, for
versions registered before capflow logged MLflow Models, the ``model`` artifact folder of its student run
(``runs:/<run>/model``); the capflow folder is downloaded once into a local cache
(``CAPFLOW_MODEL_CACHE``, default ``~/.cache/capflow/models``), one folder per tracking store, model, version
and run, so later calls read nothing from the server but the alias lookup.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from captioning.errors import InputError
from captioning.training.checkpoint import META_FILE, MODEL_FILE, VOCAB_FILE
from tasks.mlflow_models import capflow_folder

DEFAULT_MODEL = "models:/capflow-captioner@champion"
MODEL_FILES = (MODEL_FILE, VOCAB_FILE, META_FILE)


class ModelResolveError(InputError, RuntimeError):
    """A model reference that does not lead to a model folder: says what was asked, where, and what to do."""

    def __init__(self, message: str):
        from captioning.redact import redact

        super().__init__(redact(message))  # the tracking URI (MLFLOW_TRACKING_URI) may hold credentials


def model_cache_dir() -> Path:
    return Path(os.environ.get("CAPFLOW_MODEL_CACHE", "~/.cache/capflow/models")).expanduser()


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else the tracking URI the pipeline uses with the default config."""
    from captioning.config import load_config
    from tasks.tracking import tracking_uri

    return tracking_uri(load_config())


def parse_models_uri(ref: str) -> tuple[str, str | None, str | None]:
    """``models:/NAME@ALIAS`` -> (NAME, ALIAS, None); ``models:/NAME/VERSION`` -> (NAME, None, VERSION)."""
    body = ref[len("models:/"):] if ref.startswith("models:/") else ""
    if "@" in body:
        name, alias = body.rsplit("@", 1)
        if name and alias and "/" not in alias:
            return name, alias, None
    elif "/" in body:
        name, version = body.rsplit("/", 1)
        if name and version.isdigit():
            return name, None, version
    raise ModelResolveError(f"model reference {ref!r}: use models:/NAME@ALIAS (e.g. {DEFAULT_MODEL}), "
                            "models:/NAME/VERSION, or a local model folder / model.pt")


def _check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail fast (instead of MLflow's minutes of retries) when the tracking store cannot be there."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_file():
            raise ModelResolveError(f"no MLflow tracking store at {path} ({uri}): run the pipeline first, or point "
                                    "MLFLOW_TRACKING_URI at the store that holds the model")
        return
    u = urlparse(uri)
    if u.scheme in ("http", "https") and u.hostname:
        port = u.port or (443 if u.scheme == "https" else 80)
        try:
            socket.create_connection((u.hostname, port), timeout=timeout).close()
        except OSError as e:
            raise ModelResolveError(f"MLflow tracking server {uri} is unreachable ({e}): start it (capflow stack "
                                    "up / mlflow server) or set MLFLOW_TRACKING_URI") from None


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in MODEL_FILES)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80] or "_"


def resolve_model(ref: str, tracking_uri: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """A local model folder (or model.pt) for ``ref``: an existing local path as is; a ``models:/`` URI
    resolved in the MLflow registry and downloaded (once) into ``cache_dir``. Raises ModelResolveError."""
    if not ref.startswith("models:/"):
        p = Path(ref).expanduser()
        if p.exists():
            return p
        raise ModelResolveError(f"model {ref!r} not found: give an existing model folder or model.pt, or a "
                                f"registered model as models:/NAME@ALIAS (default {DEFAULT_MODEL})")
    name, alias, version = parse_models_uri(ref)
    uri = tracking_uri or default_tracking_uri()
    _check_reachable(uri)

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        try:
            rm = client.get_registered_model(name)
        except MlflowException as e:
            if getattr(e, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                raise
            known = sorted(m.name for m in client.search_registered_models(max_results=50))
            raise ModelResolveError(f"no registered model {name!r} in {uri} (registered: "
                                    f"{', '.join(known) or 'none'}): run the pipeline, or check the name") from None
        if alias is not None:
            aliases = dict(rm.aliases or {})
            if alias not in aliases:
                have = ", ".join(f"{a} -> v{v}" for a, v in sorted(aliases.items())) or "none"
                raise ModelResolveError(f"registered model {name!r} in {uri} has no alias {alias!r} (aliases: "
                                        f"{have}); use models:/{name}/VERSION or set the alias")
            mv = client.get_model_version_by_alias(name, alias)
        else:
            try:
                mv = client.get_model_version(name, str(version))
            except MlflowException as e:
                if getattr(e, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                    raise
                raise ModelResolveError(f"registered model {name!r} in {uri} has no version {version}") from None
    except ModelResolveError:
        raise
    except Exception as e:  # connection errors, server errors, a broken store
        raise ModelResolveError(f"cannot read the MLflow model registry at {uri}: {type(e).__name__}: {e}") from None

    key = hashlib.sha256(uri.encode()).hexdigest()[:12]
    run = (mv.run_id or "norun")[:12]
    target = Path(cache_dir or model_cache_dir()) / key / _slug(name) / f"v{mv.version}-{run}"
    if _complete(target):
        return target
    source = mv.source or (f"runs:/{mv.run_id}/model" if mv.run_id else "")
    if not source:
        raise ModelResolveError(f"{name} v{mv.version} in {uri} has neither a source nor a run to download from")
    if source.startswith("models:/"):  # an MLflow Model (LoggedModel): its stored location, read with this client
        try:
            source = client.get_model_version_download_uri(name, str(mv.version))
        except Exception as e:
            raise ModelResolveError(f"cannot locate {name} v{mv.version} ({mv.source}) in {uri}: "
                                    f"{type(e).__name__}: {e}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        import mlflow.artifacts

        try:
            got = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=uri))
        except Exception as e:
            raise ModelResolveError(f"cannot download {name} v{mv.version} from {source} ({uri}): "
                                    f"{type(e).__name__}: {e}") from None
        if got.is_file():
            got = got.parent
        got = capflow_folder(got) or got  # an MLflow Model holds the capflow folder among its artifacts
        if not _complete(got):
            lacks = [f for f in MODEL_FILES if not (got / f).is_file()]
            raise ModelResolveError(f"{name} v{mv.version} ({source}) is not a capflow model folder: it lacks "
                                    f"{', '.join(lacks)}")
        if target.exists() and not _complete(target):  # an interrupted earlier download
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(got, target)
        except OSError:
            if not _complete(target):  # else another process finished the same download first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
