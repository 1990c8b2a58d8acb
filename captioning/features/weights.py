"""Detector weights: where a weights URI resolves to (downloaded once, sha256-checked), and how a checkpoint file is
read without running anything from it (what identifies the weights in a store's name:
:func:`captioning.features.naming.weights_identity`).

``.pth``/``.pt`` files are read with ``torch.load(weights_only=True)`` (a raw state dict, or a dict holding it
under ``model`` / ``state_dict``). ``.pkl`` files (detectron2 model-zoo or Caffe2-converted format) are read by
:func:`captioning.safe_pickle.load_detectron2_pkl`: a restricted unpickler that admits only numpy arrays, dtypes,
scalars and ``OrderedDict`` and refuses anything else before it runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from captioning.util import sha256_file

log = logging.getLogger(__name__)



def weights_cache_dir() -> Path:
    return Path(os.environ.get("CAPFLOW_WEIGHTS_CACHE", "~/.cache/capflow/weights")).expanduser()


def check_sha(uri: str, expected: str | None, actual: str) -> None:
    if expected is not None and expected.strip().lower() != actual:
        raise ValueError(
            f"detector weights {uri}: sha256 mismatch: expected {expected.strip().lower()}, actual {actual}"
        )


def resolve(uri: str, sha256: str | None, cache_dir: Path) -> tuple[Path, str]:
    """(local path, its sha256) of a weights URI; remote files are downloaded once into ``cache_dir``."""
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if "://" not in uri:
        path = Path(uri).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"detector weights not found: {path}")
        digest = sha256_file(path)
        check_sha(uri, sha256, digest)
        return path, digest

    import fsspec

    from captioning.data.stores import storage_options_for

    protocol = uri.split("://", 1)[0]
    fs = fsspec.filesystem(protocol, **(storage_options_for(uri) or {}))
    name = Path(uri.rstrip("/")).name or "weights"
    if sha256:
        key = sha256.strip().lower()
    else:  # no pinned hash: the remote object's identity (ETag/size/mtime) names the cached copy
        info = fs.info(uri)
        ident = {k: str(info.get(k)) for k in ("ETag", "etag", "size", "LastModified", "mtime") if k in info}
        key = "uri-" + hashlib.sha256(repr((uri, sorted(ident.items()))).encode()).hexdigest()[:16]
    target = Path(cache_dir).expanduser() / key / name
    if target.is_file():
        digest = sha256_file(target)
        if sha256 is None or digest == sha256.strip().lower():
            return target, digest
        target.unlink(missing_ok=True)  # a bad cached copy: fetch again
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{name}.{os.getpid()}.{uuid.uuid4().hex}.part")
    try:
        log.info("downloading detector weights %s -> %s", uri, target)
        fs.get_file(uri, str(tmp))
        digest = sha256_file(tmp)
        check_sha(uri, sha256, digest)
        os.replace(tmp, target)  # atomic: concurrent workers downloading the same file do not clash
    finally:
        tmp.unlink(missing_ok=True)
    return target, digest


def resolve_weights(uri: str, sha256: str | None, cache_dir: Path) -> Path:
    """Local path of the weights at ``uri`` (a path, ``file://`` or ``s3://...``), verified against ``sha256``.

    Remote files are downloaded once into ``cache_dir`` (credentials from the environment only; the endpoint
    from ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` when set). A hash mismatch raises ValueError naming the
    expected and the actual hash.
    """
    return resolve(uri, sha256, Path(cache_dir))[0]


def find_key(state: dict[str, Any], exact: str, c2: str, suffix: str) -> str | None:
    if exact in state:
        return exact
    if c2 in state:
        return c2
    for k in state:
        if k.endswith(suffix):
            return k
    return None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint as detectron2's checkpointer expects it: ``{"model": state_dict, ...}``."""
    if path.suffix == ".pkl":
        from captioning.safe_pickle import load_detectron2_pkl

        return load_detectron2_pkl(path)  # restricted unpickler: numpy arrays only, nothing from the file runs
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read detector weights {path} as a torch checkpoint: {e}") from e
    if isinstance(obj, dict):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise ValueError(f"detector weights {path}: no state dict found (got {type(obj).__name__})")
    return {"model": OrderedDict(obj), "__author__": "capflow"}
