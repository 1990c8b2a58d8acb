"""The names the config validates without building a model equal the registry's."""

from captioning.models.names import FAMILIES, PRESET_NAMES, preset_name
from captioning.models.registry import PRESETS


def test_preset_names_are_the_registrys_and_every_family_names_a_preset():
    assert tuple(PRESETS) == PRESET_NAMES
    assert all(preset in PRESETS for preset in FAMILIES.values())
    assert preset_name("satic") == "satic-k4" and preset_name("satic-k2") == "satic-k2"
