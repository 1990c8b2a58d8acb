"""Small helpers shared across the library: file digests and torch device resolution."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def resolve_device(spec: str, what: str = "device") -> torch.device:
    """``auto`` -> CUDA when present else CPU; an explicit CUDA device must exist."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {spec!r} requested but CUDA is not available")
    return dev
