"""The extractor flavours by name (``features.extractor.flavour``): the one place a flavour is looked up.

In the spirit of detectron2's ``modeling/meta_arch/build.py``, this registry imports no architecture (no torch, no
detectron2): the extractor classes register themselves by flavour name (:func:`register`) when their module is
imported, and :func:`captioning.features.extractor.make_extractor`, which imports every flavour's module, builds
the one :func:`extractor_class` names. What the rest of capflow must know of a flavour without building its model
is the flavour's record (:class:`Flavour`, in :data:`FLAVOURS`): whether it is the stock detectron2 model, what it
adds to a store's name, which extra per-region arrays its store holds, whether its batches may be padded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from captioning.config import BottomUpOptions, ExtractorConfig
from captioning.features.bottom_up_options import REFERENCE, deviations

# the optional per-region arrays of a bottom-up store (captioning.data.stores.EXTRAS)
BOTTOM_UP_EXTRAS = ("object_id", "object_conf", "attr_id", "attr_conf", "boxes_px")


@dataclass(frozen=True)
class Flavour:
    """One value of ``features.extractor.flavour``: the stock detectron2 model, or a bottom-up port (its name is
    its reference's in :data:`captioning.features.bottom_up_options.REFERENCE`)."""

    name: str
    bottom_up: bool

    @property
    def is_stock(self) -> bool:
        """The stock detectron2 C4 model (``model_config_file``), not a bottom-up port's exact pipeline."""
        return not self.bottom_up

    @property
    def may_pad(self) -> bool:
        """Whether ``batching: auto`` may pad on CUDA: the bottom-up references pad nothing (exact batches on every
        device), the stock model pads there."""
        return self.is_stock

    def store_identity(self, ex: ExtractorConfig) -> dict[str, Any]:
        """What the flavour adds to the extractor settings that name a store: nothing for the stock model (its
        stores keep the names they had before the flavours), a port's name and its deviations from the reference
        for a bottom-up flavour."""
        if self.is_stock:
            return {}
        return {"flavour": self.name, "bottom_up": deviations(self.name, ex.bottom_up)}

    def store_extras(self, opts: BottomUpOptions) -> tuple[str, ...]:
        """The optional per-region arrays a store of this flavour holds: boxes in original pixels, object and
        attribute ids and confidences for the bottom-up flavours (attributes stay empty, -1, when the checkpoint
        has no attribute head); none for the stock flavour."""
        if self.is_stock:
            return ()
        if opts.attributes is False:
            return ("boxes_px",)
        return BOTTOM_UP_EXTRAS


STOCK = Flavour("stock", bottom_up=False)
FLAVOURS: dict[str, Flavour] = {f.name: f for f in (STOCK, *(Flavour(port, bottom_up=True) for port in REFERENCE))}


def flavour(name: str) -> Flavour:
    """The record of flavour ``name``."""
    try:
        return FLAVOURS[name]
    except KeyError:
        raise ValueError(f"unknown extractor flavour {name!r} (one of {sorted(FLAVOURS)})") from None


# ---------------------------------------------------------------------- the extractor classes
_EXTRACTORS: dict[str, type] = {}
C = TypeVar("C", bound=type)


def register(*names: str) -> Callable[[C], C]:
    """Class decorator: the extractor class of the flavours ``names``."""

    def add(cls: C) -> C:
        for name in names:
            have = _EXTRACTORS.get(flavour(name).name)
            if have is not None and have is not cls:
                raise ValueError(f"flavour {name!r} already has an extractor: {have.__qualname__}")
            _EXTRACTORS[name] = cls
        return cls

    return add


def extractor_class(name: str) -> type:
    """The extractor class registered for flavour ``name`` (its module imported: :mod:`captioning.features.extractor`
    imports every flavour's)."""
    fl = flavour(name)
    try:
        return _EXTRACTORS[fl.name]
    except KeyError:
        raise ValueError(f"no extractor registered for flavour {name!r}: build it with "
                         "captioning.features.extractor.make_extractor") from None
