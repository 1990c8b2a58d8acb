"""Trained captioners as MLflow Models: a pyfunc *model from code* around the capflow model folder, logged as an
MLflow 3 LoggedModel of the run that trained it (explicit ids through one ``MlflowClient``: no active run and, but
for one registry call on local stores (:func:`_lookups_in`), no global tracking URI, so students logging from
worker threads do not interfere).

What a logged model holds (``models:/<model_id>``, and the registered versions created from it)::

    MLmodel                      pyfunc flavour, loader ``mlflow.pyfunc.loaders.code_model``, signature
    pyfunc_captioner.py          the model code (tasks/pyfunc_captioner.py), imported by MLflow - never unpickled
    code/captioning/             the capflow library that trained it (MLflow ``code_paths``)
    artifacts/model/             the capflow model folder (model.pt, vocab.json, capflow.json[, detector/])
    input_example.json, serving_input_example.json   one real image of the run's test split, base64
    requirements.txt, python_env.yaml, conda.yaml    capflow's third-party stack, pinned to the versions installed

The signature: input ``image`` (binary: image file bytes, base64 in JSON requests), output ``caption`` (string),
params ``beam`` and ``max_words`` (defaults: the model folder's). The LoggedModel carries the student's test
metrics (logged by :meth:`tasks.tracking.Tracker.metrics` with ``model_id`` and the evaluation dataset), its
architecture as params and tags for the student, preset, parameter count, latency and test set.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import captioning
from captioning.errors import InputError
from captioning.training.checkpoint import META_FILE, MODEL_FILE, VOCAB_FILE
from captioning.util import source_digest

CODE_FILE = Path(__file__).with_name("pyfunc_captioner.py")
LIBRARY = Path(captioning.__file__).resolve().parent
MODEL_VERSIONS_TAG = "mlflow.modelVersions"  # MLflow's own LoggedModel tag: the registered versions made from it
ARTIFACT = "model"  # the name of the model folder among the pyfunc model's artifacts (artifacts/model/)
MODEL_TYPE = "image-captioner"
# the third-party distributions the model code imports when it loads and captions (detectron2 is not on the package
# index: it is installed by infra/install_detectron2.py, see docs/pipeline.md, "The registered model in MLflow")
REQUIREMENTS = ("mlflow", "torch", "torchvision", "numpy", "pandas", "pillow", "pydantic", "pyyaml", "tqdm", "zarr",
                "numcodecs", "fsspec", "scipy", "fvcore", "iopath", "yacs", "termcolor", "tabulate", "omegaconf",
                "pycocotools")


class ModelCodeMismatch(InputError, RuntimeError):
    """An MLflow Model's ``code/`` (which MLflow imports when it loads or serves the model) is not the installed
    capflow library."""


def library_digest(code_root: str | Path | None = None) -> str:
    """The digest of a ``captioning`` library: the installed one, or the one under ``code_root`` (an MLflow Model's
    ``code/`` folder)."""
    return source_digest(Path(code_root) if code_root is not None else LIBRARY.parent, "captioning")


def check_model_code(model_root: str | Path) -> str:
    """Refuse an MLflow Model whose ``code/captioning`` differs from the installed library (serving or loading it
    runs that code: whoever can write the registry's artifacts chooses it). Returns the digest both have."""
    code = Path(model_root) / "code"
    if not (code / "captioning").is_dir():
        raise ModelCodeMismatch(f"{model_root} carries no code/captioning: not a capflow MLflow Model")
    got, mine = library_digest(code), library_digest()
    if got != mine:
        raise ModelCodeMismatch(
            f"the model's code ({model_root}/code/captioning, sha256 {got[:12]}...) is not the installed capflow "
            f"library (sha256 {mine[:12]}...): MLflow would run it when serving or loading the model. Serve it "
            "only if you trust whoever can write the registry's artifacts (--trust-model-code), or train/log it "
            "again with this capflow")
    return got


def pip_requirements() -> list[str]:
    """``REQUIREMENTS`` pinned to the installed versions (those not installed are left out)."""
    out = []
    for name in REQUIREMENTS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.append(f"{name}=={importlib.metadata.version(name)}")
    return out


def signature(beam: int, max_words: int):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("binary", "image")]),
                          outputs=Schema([ColSpec("string", "caption")]),
                          params=ParamSchema([ParamSpec("beam", "long", int(beam)),
                                              ParamSpec("max_words", "long", int(max_words))]))


def input_example(image: str | Path | None):
    """A one-row input (the image file's bytes), or None without an image."""
    if image is None:
        return None
    import pandas as pd

    return pd.DataFrame({"image": [Path(image).read_bytes()]})


def example_image(files: list[str | Path], max_bytes: int = 512 * 1024) -> Path | None:
    """The first of ``files`` that decodes as an image and is small enough to ride along in the model's input
    example (the test split's images, in order); None when none does."""
    from captioning.features.images import ImageRejected, load_rgb

    for f in files:
        p = Path(f)
        try:
            if p.is_file() and p.stat().st_size <= max_bytes:
                load_rgb(p)
                return p
        except (ImageRejected, OSError):
            continue
    return None


def save_pyfunc(path: str | Path, model_dir: str | Path, *, example: str | Path | None = None,
                mlflow_model: Any = None, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write the pyfunc model of the capflow model folder ``model_dir`` to ``path`` (a new folder)."""
    folder = Path(model_dir)
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    missing = [f for f in (MODEL_FILE, VOCAB_FILE) if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} is not a capflow model folder: it lacks {', '.join(missing)}")
    with _SAVE:  # MLflow keeps process-global state while it saves (the code model it imported, schemas)
        _save(path, folder, meta, example, mlflow_model, metadata)
    for cache in Path(path).rglob("__pycache__"):  # bytecode of the code file and library, when MLflow imported them
        shutil.rmtree(cache, ignore_errors=True)
    return Path(path)


def _save(path, folder: Path, meta: dict[str, Any], example, mlflow_model, metadata) -> None:
    import mlflow.pyfunc

    mlflow.pyfunc.save_model(
        str(path), python_model=str(CODE_FILE), artifacts={ARTIFACT: str(folder)}, code_paths=[str(LIBRARY)],
        signature=signature(meta.get("beam") or 3, meta["max_words"]), input_example=input_example(example),
        pip_requirements=pip_requirements(), mlflow_model=mlflow_model,
        metadata={"capflow_student": meta.get("student"), "capflow_preset": meta.get("preset"),
                  "capflow_features_source": (meta.get("features") or {}).get("source"), **(metadata or {})})


def log_captioner(client, experiment_id: str, run_id: str, model_dir: str | Path, *, name: str,
                  params: Mapping[str, str] | None = None, tags: Mapping[str, str] | None = None,
                  example: str | Path | None = None,
                  retry: Callable[[Callable[[], Any], str], Any] = lambda fn, what: fn()) -> str:
    """Log the model folder as a LoggedModel output of ``run_id`` (status READY once its artifacts are stored;
    FAILED when storing them failed); returns its ``model_id``. ``retry(fn, what)`` wraps every tracking call."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    lm = retry(lambda: client.create_logged_model(experiment_id, name=name, source_run_id=run_id,
                                                  params=dict(params or {}),
                                                  tags={"capflow.model_format": "pyfunc-from-code",
                                                        "capflow.code_sha256": library_digest(),
                                                        **dict(tags or {})},
                                                  model_type=MODEL_TYPE), "create logged model")
    try:
        with tempfile.TemporaryDirectory(prefix="capflow-mlflow-model-") as tmp:
            local = Path(tmp) / "model"
            spec = Model(artifact_path=lm.artifact_location, run_id=run_id, model_uuid=lm.model_id,
                         model_id=lm.model_id)
            save_pyfunc(local, model_dir, example=example, mlflow_model=spec)
            retry(lambda: client.log_model_artifacts(lm.model_id, str(local)), "log model artifacts")
        retry(lambda: client.log_outputs(run_id, [LoggedModelOutput(lm.model_id, step=0)]), "log model output")
    except BaseException:
        with contextlib.suppress(Exception):  # the original error is what matters
            client.finalize_logged_model(lm.model_id, "FAILED")
        raise
    retry(lambda: client.finalize_logged_model(lm.model_id, "READY"), "finalize logged model")
    return lm.model_id


_GLOBAL_URI = threading.Lock()
_SAVE = threading.Lock()


_URI_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


@contextlib.contextmanager
def _global_uris(uri: str, registry: bool) -> Iterator[None]:
    """Point MLflow's process-global tracking URI (and, with ``registry``, its registry URI) at ``uri`` for the
    block, then restore exactly what was there: both module globals and both environment variables, which MLflow's
    setters also write (``set_registry_uri`` leaves ``MLFLOW_REGISTRY_URI`` behind, and every later client would
    find its registry there)."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    with _GLOBAL_URI:
        before = (tracking_utils._tracking_uri, registry_utils._registry_uri,
                  {k: os.environ.get(k) for k in _URI_VARIABLES})
        mlflow.set_tracking_uri(uri)
        if registry:
            mlflow.set_registry_uri(uri)
        try:
            yield
        finally:
            tracking_utils._tracking_uri, registry_utils._registry_uri = before[0], before[1]
            for k, v in before[2].items():
                if v is not None:
                    os.environ[k] = v
                else:
                    os.environ.pop(k, None)


@contextlib.contextmanager
def _lookups_in(uri: str) -> Iterator[None]:
    """MLflow's SQL registry store resolves a ``models:/<model_id>`` version source through the process's *global*
    tracking URI (not its client's): point that at ``uri`` for the call when it is a local store that the global
    URI does not already name (a tracking server resolves it on its own side), then restore it exactly."""
    from urllib.parse import urlparse

    import mlflow

    if urlparse(uri).scheme in ("http", "https") or mlflow.get_tracking_uri() == uri:
        yield
        return
    with _global_uris(uri, registry=False):
        yield


def register_logged_model(client, uri: str, name: str, model_id: str, run_id: str, tags: Mapping[str, str],
                          retry: Callable[[Callable[[], Any], str], Any] = lambda fn, what: fn()) -> str:
    """A new version of the registered model ``name`` (which exists) from the LoggedModel ``model_id``: source
    ``models:/<model_id>`` as MLflow's own ``register_model`` writes it, tag ``capflow.model_id``, and the
    LoggedModel's ``mlflow.modelVersions`` tag listing it (the MLflow UI shows the link on both pages)."""
    with _lookups_in(uri):
        mv = retry(lambda: client.create_model_version(name, f"models:/{model_id}", run_id=run_id, model_id=model_id,
                                                       tags={**tags, "capflow.model_id": model_id}),
                   "create model version")
    lm = retry(lambda: client.get_logged_model(model_id), "get logged model")
    listed = [*json.loads(lm.tags.get(MODEL_VERSIONS_TAG) or "[]"), {"name": name, "version": mv.version}]
    retry(lambda: client.set_logged_model_tags(model_id, {MODEL_VERSIONS_TAG: json.dumps(listed)}),
          "tag logged model")
    return str(mv.version)


def capflow_folder(root: str | Path) -> Path | None:
    """The capflow model folder inside a downloaded MLflow model (``artifacts/model`` as its MLmodel names it),
    the folder itself when it is a capflow model folder, else None."""
    root = Path(root)
    if all((root / f).is_file() for f in (MODEL_FILE, VOCAB_FILE, META_FILE)):
        return root
    mlmodel = root / "MLmodel"
    if not mlmodel.is_file():
        return None
    import yaml

    conf = yaml.safe_load(mlmodel.read_text(encoding="utf-8")) or {}
    rel = (((conf.get("flavors") or {}).get("python_function") or {}).get("artifacts") or {}).get(ARTIFACT, {})
    rel = rel.get("path") if isinstance(rel, dict) else None
    if not rel:
        return None
    folder = (root / rel).resolve()
    return folder if folder.is_relative_to(root.resolve()) and folder.is_dir() else None


def local_model(model_uri: str, dest: str | Path, tracking_uri: str | None = None) -> Path:
    """An MLflow Model as a local folder: a local path as it is; a ``models:/`` or ``runs:/`` URI downloaded into
    ``dest`` from the tracking and registry store ``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``). MLflow's
    download resolves ``models:/`` through the process's global URIs: they point at ``tracking_uri`` for the call and
    are restored exactly."""
    if ":/" not in model_uri:
        return Path(model_uri).resolve()
    import mlflow.artifacts

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dest)))
    with _global_uris(uri, registry=True):
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dest)))
