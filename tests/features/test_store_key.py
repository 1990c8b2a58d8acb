"""Store names are stable: settings added for the GPU path leave the names of existing (CPU) stores unchanged."""

from __future__ import annotations

import pytest

from captioning.config import load_config
from captioning.features.parallel import store_key

# store_key values computed by the code before the GPU extraction work (commit 30888d5) for the same settings
PINNED = [
    # the demo preset's extraction settings of that commit (it now keeps 12 proposals and at most 12 boxes)
    ("demo", ["features.extractor.device=cpu", "features.extractor.proposals=50", "features.max_boxes=16"],
     "cdbb4c7ce7f6bd36"),
    ("coco", ["features.extractor.weights=null", "features.extractor.device=cpu", "features.extractor.flavour=stock"],
     "673c6ead24faa951"),
    (None, ["features.extractor.amp=true", "features.extractor.device=cpu"], "e1fdd7937bcf0c6d"),
]


@pytest.mark.parametrize(("preset", "overrides", "key"), PINNED)
def test_cpu_store_names_are_unchanged(preset, overrides, key):
    assert store_key(load_config(preset, overrides=overrides).features) == key


def test_overlap_settings_do_not_name_the_store_but_numeric_ones_do():
    base = ["features.extractor.device=cpu"]
    k = store_key(load_config("demo", overrides=base).features)
    for same in ("features.extractor.decode_threads=8", "features.extractor.selection_on_device=true",
                 "features.extractor.decode_processes=3", "features.extractor.channels_last=true",
                 "features.extractor.batching=exact", "features.extractor.batch_size=2"):
        assert store_key(load_config("demo", overrides=[*base, same]).features) == k, same
    for other in ("features.extractor.batching=padded", "features.extractor.batch_size=4",
                  "features.extractor.amp=true"):
        assert store_key(load_config("demo", overrides=[*base, other]).features) != k, other
    cuda = store_key(load_config("demo", overrides=["features.extractor.device=cuda"]).features)
    assert cuda != k  # CUDA resolves to padded batches of 16: other numbers, another store
    bf16 = ["features.extractor.device=cpu", "features.extractor.amp=true"]
    assert store_key(load_config("demo", overrides=[*bf16, "features.extractor.amp_dtype=bfloat16"]).features) != \
        store_key(load_config("demo", overrides=bf16).features)


def test_bottom_up_stores_are_named_by_flavour_and_deviations():
    base = ["features.extractor.device=cpu", "features.extractor.weights=null"]
    k = store_key(load_config("coco", overrides=base).features)
    assert k != store_key(load_config("coco", overrides=[*base, "features.extractor.flavour=airsplay"]).features)
    assert k != store_key(load_config("coco", overrides=[*base, "features.extractor.flavour=stock"]).features)
    # an option set to the flavour's reference value computes the same numbers: the same store
    same = "features.extractor.bottom_up.pooler=ROIPool"
    assert store_key(load_config("coco", overrides=[*base, same]).features) == k
    other = "features.extractor.bottom_up.pooler=ROIAlignV2"
    assert store_key(load_config("coco", overrides=[*base, other]).features) != k
    # CUDA keeps exact batches for the bottom-up flavours (the references pad nothing)
    from captioning.features.extractor import effective_config

    cuda = load_config("coco", overrides=["features.extractor.device=cuda"]).features.extractor
    assert effective_config(cuda).batching == "exact"
