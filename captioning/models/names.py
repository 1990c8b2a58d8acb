"""The names of models, importable without building any (no torch): the registry's preset names, the student
families and the sizes below the papers' - what the config validates and the model plans resolve. The
architectures themselves are :mod:`captioning.models.registry`'s (a test keeps :data:`PRESET_NAMES` equal to its
``PRESETS``)."""

from __future__ import annotations

#: the registry's presets (:data:`captioning.models.registry.PRESETS`), in its order
PRESET_NAMES: tuple[str, ...] = (
    "aic",
    "ort-base",
    "ort-small",
    "ort-xsmall",
    "acort-base",
    "acort-base-al",
    "acort-small",
    "acort-xsmall",
    "expansionnet",
    "lw-1x",
    "lw-2x",
    "lw-3x",
    "satic-k2",
    "satic-k4",
    "satic-k6",
    "zodiac-sigmoid",
    "zodiac-tanh",
)

#: student family -> the registry preset that stands for it (any registry preset name is accepted as well)
FAMILIES: dict[str, str] = {
    "aic": "aic",
    "acort": "acort-base",
    "expansionnet": "expansionnet",
    "lw": "lw-1x",
    "satic": "satic-k4",
    "zodiac": "zodiac-sigmoid",
}

#: model sizes below the papers' ("base" = the preset exactly as published): d_model, layers, heads, d_ff
SIZES: dict[str, tuple[int, int, int, int]] = {
    "small": (256, 3, 8, 1024),
    "demo": (128, 2, 4, 512),
    "tiny": (32, 1, 2, 64),
}

#: the names that mean the AIC teacher (``capflow train --model``, the teacher as an evaluated model)
TEACHER_NAMES = ("teacher", "aic")


def preset_name(name: str) -> str:
    """A student family (``satic``) or a registry preset (``satic-k2``) -> the registry preset name."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name in PRESET_NAMES:
        return name
    raise ValueError(f"unknown student {name!r}: use a family ({', '.join(FAMILIES)}) or a registry preset "
                     f"({', '.join(sorted(PRESET_NAMES))})")
