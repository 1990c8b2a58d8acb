"""The extractor's automatic settings, resolved in one place.

Two kinds. Those that change the numbers (``batching``, ``batch_size``, ``amp``) and therefore name the store:
:func:`effective_config` resolves them for the device the config names, once per extraction (the Dask runner
resolves the plan's settings, names the store from them and hands them to its workers; an extractor built
directly resolves its own). Those that follow the device an extractor runs on and never change the numbers
(``decode_threads``, ``channels_last``, ``selection_on_device``): :func:`device_settings`. No torch is imported
unless a device is ``auto`` (the store naming imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass

from captioning.config import ExtractorConfig
from captioning.features.registry import flavour

# What ``auto``/unset extractor settings become on a CUDA device (measured with ``capflow bench extract --device
# cuda``: see the README's extraction figures) and elsewhere (today's CPU behaviour, so CPU stores keep their names).
GPU_DEFAULTS = {"batching": "padded", "batch_size": 16, "amp": False}
CPU_DEFAULTS = {"batching": "exact", "batch_size": 2, "amp": False}


def device_kind(spec: str) -> str:
    """``cuda`` or ``cpu`` (or another torch device type) for a device setting; ``auto``: CUDA when present."""
    kind = str(spec).split(":")[0]
    if kind == "auto":
        import torch  # only here: naming a store for an explicit device needs no torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def effective_config(cfg: ExtractorConfig) -> ExtractorConfig:
    """``cfg`` with its automatic settings resolved for the device it names (``auto``: CUDA when present); ``cfg``
    itself when none is left."""
    if cfg.batching != "auto" and cfg.batch_size is not None and cfg.amp is not None:
        return cfg
    defaults = GPU_DEFAULTS if device_kind(cfg.device) == "cuda" else CPU_DEFAULTS
    update = {}
    if cfg.batching == "auto":  # the bottom-up references pad nothing: exact batches on every device
        update["batching"] = defaults["batching"] if flavour(cfg.flavour).may_pad else "exact"
    if cfg.batch_size is None:
        update["batch_size"] = defaults["batch_size"]
    if cfg.amp is None:
        update["amp"] = defaults["amp"]
    return cfg.model_copy(update=update)


@dataclass(frozen=True)
class DeviceSettings:
    """The settings that follow the extractor's device; none of them changes the numbers beyond float rounding,
    so none names a store."""

    decode_threads: int  # loader threads ahead of the model: 4 on CUDA, 0 (inline) elsewhere unless set
    channels_last: bool  # channels-last convolutions: on CUDA unless set (faster there; float rounding only)
    select_on_device: bool  # the (exact) box-selection scan on the device: only when asked for, and only on CUDA


def device_settings(cfg: ExtractorConfig, device_type: str) -> DeviceSettings:
    """:class:`DeviceSettings` of ``cfg`` on a device of type ``device_type`` (``cuda``, ``cpu``...).

    The box-selection scan runs on the host by default: the host's NumPy scan measured faster end to end than the
    scan's many small kernels on the device (``capflow bench extract --device cuda``)."""
    cuda = device_type == "cuda"
    return DeviceSettings(
        decode_threads=cfg.decode_threads if cfg.decode_threads is not None else (4 if cuda else 0),
        channels_last=bool(cfg.channels_last) if cfg.channels_last is not None else cuda,
        select_on_device=bool(cfg.selection_on_device) and cuda,
    )
