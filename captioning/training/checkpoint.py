"""Checkpoints: weights, architecture, vocabulary digest, optimizer/scheduler/RNG state, epoch and step.

Only tensors, numbers, strings, lists and dicts are stored, so every checkpoint loads with
``torch.load(..., weights_only=True)``: nothing arbitrary is ever unpickled. Writes are atomic (temp + rename),
so a killed run never leaves a torn checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from captioning.data.stores import CorruptDataError
from captioning.util import atomic_write

FORMAT = "capflow-checkpoint/1"

#: the files of a model folder (what the pipeline registers and ``capflow caption`` loads)
MODEL_FILE, VOCAB_FILE, META_FILE = "model.pt", "vocab.json", "capflow.json"
#: subfolder of a model folder that holds its detector weights (when the features came from real weights)
DETECTOR_DIR = "detector"


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": [py[0], list(py[1]), py[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def save(path: str | Path, *, model: torch.nn.Module, arch: dict[str, Any], vocab_digest: str = "",
         optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, epoch: int = 0, step: int = 0,
         extra: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "arch": _plain(arch),
        "vocab_digest": vocab_digest,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "epoch": epoch,
        "step": step,
        "rng": rng_state(),
        "extra": _plain(extra or {}),
    }
    # through a file object, so that a full disk is an OSError (ENOSPC) naming the file, not torch's "unexpected
    # pos"; the temporary file goes on any failure or interruption (SIGTERM), the previous checkpoint stays
    return atomic_write(path, lambda f: torch.save(state, f), "checkpoint")


class CheckpointError(CorruptDataError):
    """A checkpoint file is damaged (truncated, overwritten): the message names it and the repair."""


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint written by :func:`save`. A damaged file raises :class:`CheckpointError` naming it and the
    repair; a file that is not a capflow checkpoint (other Python objects are never unpickled) ``ValueError``."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower():  # torch refused a global: a foreign (or hostile) pickle, not damage
            raise ValueError(f"{path}: not a capflow checkpoint: it holds Python objects other than tensors and "
                             "plain data, which capflow never unpickles") from None
        raise CheckpointError(damaged_message(path, e)) from None
    except Exception as e:  # a torn zip archive, EOF, a bad record: the many ways torch reports damage
        raise CheckpointError(damaged_message(path, e)) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        fmt = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path}: not a capflow checkpoint (format {fmt!r})")
    return state


def damaged_message(path: str | Path, error: BaseException | str) -> str:
    """The message for a damaged checkpoint: the file, what failed, and how to get a sound one again."""
    if isinstance(error, str):
        what = error
    else:  # torch's first sentence only (the rest is its generic advice)
        text = (str(error).splitlines() or [""])[0].split(". ")[0][:200] or "the file ends early"
        what = f"{type(error).__name__}: {text}"
    return (f"checkpoint {path} is damaged and cannot be read ({what}). Delete it - or run `capflow verify "
            "--repair` on the workdir, which removes damaged checkpoints and the stage records that point at them "
            "- and run again: the stage that wrote it trains again (an epoch checkpoint: training restarts from "
            "scratch); a model folder's model.pt comes back from the model registry or a new `capflow run`.")


def _bundle_detector(out: Path, features: dict[str, Any], cache_dir: str | Path | None) -> dict[str, Any]:
    """Copy the detector weights named in ``features`` into ``out/detector/`` and return ``features`` naming
    that copy (relative to the folder) with its sha256; ``features`` as is for a random-weight detector."""
    ex = dict(features.get("extractor") or {})
    uri = ex.get("weights")
    if not uri:
        return features
    from captioning.features.weights import resolve_weights, weights_cache_dir
    from captioning.util import sha256_file

    src = resolve_weights(str(uri), ex.get("weights_sha256"), Path(cache_dir) if cache_dir else weights_cache_dir())
    digest = sha256_file(src)  # resolve_weights has checked it against a pinned weights_sha256
    rel = f"{DETECTOR_DIR}/{src.name}"
    dst = out / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(src, tmp)
        if sha256_file(tmp) != digest:
            raise OSError(f"copying detector weights {src} into {dst.parent} gave different bytes")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    ex.update(weights=rel, weights_sha256=digest)
    return {**features, "extractor": ex}


def save_model_dir(path: str | Path, *, model: torch.nn.Module, arch: dict[str, Any], vocab: Any,
                   features: dict[str, Any], student: str, preset: str, max_words: int, beam: int,
                   test_metrics: dict[str, Any] | None = None, vocab_digest: str = "", epoch: int = 0,
                   step: int = 0, weights_cache_dir: str | Path | None = None) -> Path:
    """Write a model folder: ``model.pt`` (weights only, :func:`save`), ``vocab.json`` and ``capflow.json``
    (``{"student", "preset", "features", "max_words", "beam", "test_metrics"}``; ``features`` is the config's
    ``features`` section as JSON, so a captioner can rebuild the same region extractor).

    Detector weights (``features.extractor.weights``, a path or remote URI; remote files are fetched through
    ``weights_cache_dir``) are copied into ``detector/`` and ``capflow.json`` names that copy relative to the
    folder, with the sha256 taken now: a captioner loads no weights from outside the folder and none that do
    not match that digest (:mod:`captioning.inference`).

    ``vocab`` is the path of a ``vocab.json`` (copied as is) or a :class:`~captioning.data.text.Vocabulary`.
    ``vocab_digest`` defaults to the vocabulary's digest when a Vocabulary is given. Returns the folder.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    features = _bundle_detector(out, features, weights_cache_dir)
    if isinstance(vocab, str | Path):
        vocab_text = Path(vocab).read_text(encoding="utf-8")
    else:
        vocab_text = json.dumps(vocab.to_dict(), ensure_ascii=False, indent=1)
        vocab_digest = vocab_digest or vocab.digest()
    save(out / MODEL_FILE, model=model, arch=arch, vocab_digest=vocab_digest, epoch=epoch, step=step,
         extra={"student": student, "preset": preset})
    meta = {"student": student, "preset": preset, "features": features, "max_words": max_words, "beam": beam,
            "test_metrics": dict(test_metrics or {})}
    for name, text in ((VOCAB_FILE, vocab_text), (META_FILE, json.dumps(meta, indent=2))):
        atomic_write(out / name, lambda f, t=text: f.write(t.encode("utf-8")))
    return out


def _plain(obj: Any) -> Any:
    """JSON-like copy (tuples -> lists) that weights_only loading accepts."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str | torch.Tensor):
        return obj
    return str(obj)


def init_from(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Copy every tensor of ``state_dict`` whose name and shape match into ``model`` (SATIC's weight
    initialisation from the AIC teacher). Returns ``{"loaded": [...], "skipped": [...]}`` (model keys)."""
    own = model.state_dict()
    loaded, skipped = [], []
    for k, v in own.items():
        src = state_dict.get(k)
        if src is not None and tuple(src.shape) == tuple(v.shape):
            own[k] = src.to(dtype=v.dtype)
            loaded.append(k)
        else:
            skipped.append(k)
    model.load_state_dict(own)
    return {"loaded": loaded, "skipped": skipped}
