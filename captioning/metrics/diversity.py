"""Caption diversity statistics: how many generated captions are novel, distinct, how long, how many words.

Two normalisations, both plain and documented:

* captions are compared (novelty, uniqueness) after lower-casing, trimming and collapsing runs of white space to
  one space, nothing more: ``"A  dog."`` equals ``"a dog."`` but not ``"a dog"``;
* words (length, vocabulary) are the runs of letters and digits of the lower-cased caption, so punctuation
  neither counts as a word nor sticks to one (``"dog."`` and ``"dog"`` are the same word); an apostrophe or
  hyphen between two letters/digits stays inside the word (``"man's"``, ``"t-shirt"``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

_WORD = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")


def normalize_caption(caption: str) -> str:
    """Lower-case, trim, collapse white space (the comparison key for novelty and uniqueness)."""
    return " ".join(caption.lower().split())


def caption_words(caption: str) -> list[str]:
    """The words of a caption (lower-cased runs of letters/digits; inner apostrophes and hyphens kept)."""
    return _WORD.findall(caption.lower())


def caption_stats(captions: Mapping[int, str], train_captions: Iterable[str]) -> dict:
    """Diversity statistics of generated captions (one per image) against the training captions.

    Returns ``{"captions": n, "novel_fraction": share of generated captions not found verbatim (after
    normalisation) among the training captions, "unique_fraction": distinct normalised captions / n,
    "avg_length": mean words per caption, "vocab_used": distinct words over all generated captions}``.
    """
    if not captions:
        raise ValueError("caption_stats needs at least one caption")
    norm = [normalize_caption(c) for c in captions.values()]
    train = {normalize_caption(c) for c in train_captions}
    words = [caption_words(c) for c in norm]
    n = len(norm)
    return {
        "captions": n,
        "novel_fraction": sum(c not in train for c in norm) / n,
        "unique_fraction": len(set(norm)) / n,
        "avg_length": sum(len(w) for w in words) / n,
        "vocab_used": len({w for ws in words for w in ws}),
    }
