"""Numerical precision of training and decoding: one setting (``run.precision``), one helper per concern.

``fp32``: plain float32 everywhere. ``bf16`` / ``fp16``: CUDA autocast (matrix products and attention in the
16-bit type, reductions, softmax/log-softmax, layer norms and the losses in float32); the weights, the optimizer
state and therefore the checkpoints stay float32. ``fp16`` needs a gradient scaler (its range is small), ``bf16``
does not. ``auto``: ``bf16`` on a CUDA device that supports it, else ``fp32``.

Autocast is only ever switched on for CUDA devices: on a CPU every precision runs as ``fp32``, so CPU results do
not depend on the setting (and stay bit-identical to a run without it).
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

Precision = Literal["fp32", "bf16", "fp16", "auto"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "auto")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _bf16_supported(device: torch.device) -> bool:
    try:
        major, _ = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError, ValueError):
        return False
    return major >= 8  # Ampere and later compute in bf16 natively


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """The precision actually used on ``device``: ``fp32``, ``bf16`` or ``fp16`` (never ``auto``).

    CPU devices always give ``fp32``. ``bf16`` on a CUDA device without native bf16 is an error naming ``fp16``
    as the alternative."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    dev = torch.device(device)
    if dev.type != "cuda":
        return "fp32"
    if precision == "auto":
        return "bf16" if _bf16_supported(dev) else "fp32"
    if precision == "bf16" and not _bf16_supported(dev):
        raise ValueError(f"{dev} ({torch.cuda.get_device_name(dev)}) has no native bf16: use precision fp16 or fp32")
    return precision


def autocast(precision: str, device: str | torch.device, *, cache: bool = True) -> contextlib.AbstractContextManager:
    """The autocast context for ``precision`` on ``device`` (a no-op context for fp32 and on CPUs).

    ``cache=False`` for code that decodes (evaluation, SeqKD, SCST's sampling, captioning): decoding may replay
    CUDA graphs (:mod:`captioning.decoding.graphs`), and a captured graph must not read autocast's cached
    low-precision copies of the weights, which are freed when the context exits; without the cache the casts
    are ordinary kernels, captured with the step."""
    p = resolve_precision(precision, device)
    if p == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=DTYPES[p], cache_enabled=cache)


def grad_scaler(precision: str, device: str | torch.device) -> torch.amp.GradScaler:
    """A gradient scaler, enabled only where it is needed (fp16 on CUDA); disabled it passes everything through."""
    return torch.amp.GradScaler("cuda", enabled=resolve_precision(precision, device) == "fp16")


__all__ = ["DTYPES", "PRECISIONS", "Precision", "autocast", "grad_scaler", "resolve_precision"]
