"""Seeded random weights in a bottom-up port's exact file layout (test support, no third-party code).

The layout of a port's checkpoint (tensor names, shapes, dtypes, and the anchor buffer's values) is recorded once
from the port's own model by ``generate_goldens.py`` into ``data/layout-<port>.json``. From that layout and a seed
this module writes the checkpoint file the way the port ships it:

* ``airsplay`` - a detectron2 model-zoo pickle: ``{"model": {name: numpy array}, "__author__": ...}`` (``.pkl``)
* ``milvlg``   - a torch checkpoint: ``{"model": {name: tensor}}`` (``.pth``)

The values are drawn per tensor from ``numpy.random.default_rng([seed, crc32(name)])``, so the reference code (in
the generator) and capflow (in the tests) load bit-identical weights without sharing any state. Scales keep an
untrained ResNet-101 finite and its classifiers informative (see ``_draw``).
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
PORTS = ("airsplay", "milvlg")


def layout_path(port: str) -> Path:
    return DATA / f"layout-{port}.json"


def load_layout(port: str) -> dict:
    """``{"tensors": [[name, shape, dtype], ...], "fixed": {name: nested list}}``"""
    return json.loads(layout_path(port).read_text())


def _draw(name: str, shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if dtype.startswith("int"):  # num_batches_tracked
        return np.zeros(shape, dtype=dtype)
    last = name.rsplit(".", 1)[-1]
    if last == "running_mean":
        v = rng.normal(0.0, 0.1, shape)
    elif last == "running_var":
        v = rng.uniform(0.5, 1.5, shape)
    elif ".norm." in name or name.endswith("_bn.weight") or ".bn." in name:
        if last == "weight":
            # the last norm of a bottleneck is kept small so that 33 random residual blocks stay finite
            v = rng.uniform(0.0, 0.2, shape) if ".conv3." in name else rng.uniform(0.5, 1.5, shape)
        else:
            v = rng.normal(0.0, 0.1, shape)
    elif "cls_score" in name or "objectness_logits" in name or "attr_score" in name or "attr_linear2" in name:
        v = rng.normal(0.0, 0.05 if last == "weight" else 0.5, shape)  # spread: informative softmaxes
    elif "bbox_pred" in name or "anchor_deltas" in name:
        v = rng.normal(0.0, 0.01 if last == "weight" else 0.05, shape)
    elif "cls_emb" in name:  # Embedding(1601, 256)
        v = rng.normal(0.0, 1.0, shape)
    elif last == "weight" and len(shape) >= 2:  # convolutions and linears: He-normal
        fan_in = int(np.prod(shape[1:]))
        v = rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)
        if name.endswith("stem.conv1.weight"):
            # the input is raw mean-subtracted pixels (|x| ~ 60, std 1 in both ports): without this the whole
            # network saturates (class softmaxes of exactly 0 and 1, ties everywhere in the selection)
            v = v / 64.0
    else:  # other biases
        v = rng.normal(0.0, 0.01, shape)
    return v.astype(dtype)


def state_dict(port: str, seed: int, layout: dict | None = None) -> OrderedDict[str, np.ndarray]:
    """The port's checkpoint content as numpy arrays (fixed buffers, e.g. anchors, as recorded)."""
    layout = layout or load_layout(port)
    fixed = layout.get("fixed", {})
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, shape, dtype in layout["tensors"]:
        if name in fixed:
            out[name] = np.asarray(fixed[name], dtype=dtype).reshape(shape)
        else:
            out[name] = _draw(name, tuple(shape), dtype, seed)
    return out


def write_checkpoint(port: str, path: Path, seed: int, layout: dict | None = None) -> Path:
    """Write the port's checkpoint file (its own container format) to ``path``; returns ``path``."""
    sd = state_dict(port, seed, layout)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if port == "airsplay":
        with open(path, "wb") as f:
            pickle.dump({"model": sd, "__author__": "capflow tests (seeded random)"}, f, protocol=2)
    elif port == "milvlg":
        import torch

        torch.save({"model": OrderedDict((k, torch.from_numpy(v)) for k, v in sd.items())}, path)
    else:
        raise ValueError(f"unknown port {port!r} (one of {PORTS})")
    return path
