"""Feature-store names: where a store of given settings lives in the feature-store folder.

Identity: an extracted store's folder name is a digest of everything that changes the numbers (extractor settings,
weights, box limits, dtype, chunking), so new settings or weights make a new store, while the same settings
resume or extend the existing one (:mod:`captioning.features.parallel`). A ``synthetic-informative`` store is
named by its synthetic settings; a store imported from per-image ``.npy`` folders by its sources.

No Dask and no torch (the jobs that only name a store import this module): torch is asked only whether CUDA is
there, when a setting is ``auto`` on an ``auto`` device and the name depends on it
(:func:`captioning.features.settings.effective_config`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from captioning.config import ExtractorConfig, FeaturesConfig, PipelineConfig
from captioning.data.plans import ExtractPlan, extract_plan
from captioning.features.registry import flavour
from captioning.features.settings import effective_config
from captioning.util import sha256_file

STORE_FORMAT = 1  # bump when the extraction code changes its numbers


def weights_identity(ex: ExtractorConfig) -> str:
    """What identifies the detector weights: the file's sha256 (given or computed), or the random-init seed."""
    if ex.weights is None:
        return f"random-init:{ex.seed}:{ex.model_config_file}"
    if ex.weights_sha256:
        return ex.weights_sha256.lower()
    if "://" not in ex.weights:
        return sha256_file(Path(ex.weights).expanduser())
    return f"uri:{ex.weights}"  # remote without a pinned hash: the URI is the best identity we have


def store_key(f: FeaturesConfig, settings: ExtractorConfig | None = None) -> str:
    """The digest naming the extracted store of ``f``. ``settings``: ``f.extractor`` with its automatic settings
    resolved already (:func:`captioning.features.settings.effective_config`), when the caller has them."""
    ex = (settings or effective_config(f.extractor)).model_dump(mode="json")
    ex.pop("device")  # where it runs does not name the store (recorded in its attributes instead)
    ex.pop("weights_sha256")
    ex.pop("decode_threads")  # overlap only, never the numbers
    ex.pop("decode_processes")
    ex.pop("channels_last")  # float rounding only, as the device (cuDNN picks kernels by layout and batch anyway)
    ex.pop("selection_on_device")  # where the (exact) selection scan runs
    ex["threads"] = ex.pop("torch_threads")  # its name before the rename: existing stores keep their names
    # settings added later are named only when they change the numbers, so existing stores keep their names
    if ex["batching"] == "exact":
        ex.pop("batching")
    if not ex["amp"] or ex["amp_dtype"] == "float16":
        ex.pop("amp_dtype")
    ex.pop("flavour")
    ex.pop("bottom_up")
    ex.update(flavour(f.extractor.flavour).store_identity(f.extractor))  # bottom-up: the flavour and its deviations
    ex["weights"] = weights_identity(f.extractor)
    ident = {
        "format": STORE_FORMAT,
        "extractor": ex,
        "min_boxes": f.min_boxes,
        "max_boxes": f.max_boxes,
        "feature_dim": f.feature_dim,
        "dtype": f.dtype,
        "chunk_rows": f.chunk_rows,
        "compressor": f.compressor,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def store_uri(plan: ExtractPlan | PipelineConfig, settings: ExtractorConfig | None = None) -> str:
    """Where the configured feature store lives: named by everything that determines its content (the store naming
    of every command and job: from an :class:`ExtractPlan`, or the config it is built from). ``settings``: as for
    :func:`store_key`."""
    if isinstance(plan, PipelineConfig):
        plan = extract_plan(plan)
    base = plan.store_folder.rstrip("/")
    f = plan.features
    if f.source == "synthetic-informative":
        ident = json.dumps({"synthetic": plan.synthetic.model_dump(mode="json"), "seed": plan.seed,
                            **{k: getattr(f, k) for k in ("feature_dim", "max_boxes", "chunk_rows", "dtype",
                                                           "compressor")}}, sort_keys=True)
        return f"{base}/informative-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.zarr"
    return f"{base}/{store_key(f, settings)}.zarr"


def imported_store_uri(plan: ExtractPlan, att_dir: str | Path, box_dir: str | Path, image_ids: list[int]) -> str:
    """Where ``capflow import-features`` puts a store imported from per-image ``.npy`` folders: in the same
    feature-store folder as extracted stores, named by its sources, image ids and layout settings."""
    f = plan.features
    ident = json.dumps({"att": str(Path(att_dir).resolve()), "box": str(Path(box_dir).resolve()), "ids": image_ids,
                        **{k: getattr(f, k) for k in ("max_boxes", "feature_dim", "chunk_rows", "dtype",
                                                      "compressor")}}, sort_keys=True)
    return f"{plan.store_folder.rstrip('/')}/imported-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.zarr"


def imported_uri(feature_store_uri: str, source: Mapping[str, Any], image_ids: Sequence[int] | None,
                 settings: Mapping[str, Any]) -> str:
    """Where ``capflow import-features`` puts a store imported from a source other than per-image ``.npy`` folders
    (those keep :func:`imported_store_uri`): named by the source (``ImportSpec.ident()``: format, paths resolved,
    options), the dataset's image ids and the layout settings."""
    ident = json.dumps({**dict(source), "ids": list(map(int, image_ids)) if image_ids is not None else None,
                        **dict(settings)}, sort_keys=True)
    return f"{feature_store_uri.rstrip('/')}/imported-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.zarr"
