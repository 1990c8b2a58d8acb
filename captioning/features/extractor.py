"""The region extractor of a config: :func:`make_extractor` builds the class registered for its flavour.

``features.extractor.flavour`` names the extractor: ``stock``, a detectron2 C4 Faster R-CNN from
``model_config_file`` (:class:`captioning.features.stock.RegionExtractor`), or ``airsplay`` / ``milvlg``, the
Visual Genome bottom-up detector exactly as that public port computes it
(:class:`captioning.features.bottom_up_extractor.BottomUpExtractor`). This module imports every flavour's module,
so each has registered its class (:mod:`captioning.features.registry`) when :func:`make_extractor` looks it up;
it also gathers the names the extractor's callers use (``__all__``).
"""

from __future__ import annotations

from typing import Any

from captioning.config import ExtractorConfig
from captioning.features.base import ExtractionError, Extractor, Prepared, Regions
from captioning.features.bottom_up_extractor import BottomUpExtractor
from captioning.features.engine import RANDOM_WEIGHTS_WARNING, ExtractorEngine
from captioning.features.registry import extractor_class
from captioning.features.settings import effective_config
from captioning.features.stock import RegionExtractor
from captioning.features.weights import resolve_weights, weights_cache_dir

__all__ = [
    "RANDOM_WEIGHTS_WARNING",
    "BottomUpExtractor",
    "ExtractionError",
    "Extractor",
    "ExtractorEngine",
    "Prepared",
    "RegionExtractor",
    "Regions",
    "effective_config",
    "make_extractor",
    "resolve_weights",
    "weights_cache_dir",
]


def make_extractor(cfg: ExtractorConfig, **kwargs: Any) -> ExtractorEngine:
    """The extractor of ``cfg.flavour``: the stock detectron2 model, or a bottom-up port's exact pipeline."""
    return extractor_class(cfg.flavour)(cfg, **kwargs)
