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
from itertools import pairwise

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


def repetition_stats(captions: Iterable[str]) -> dict:
    """Distinct captions and immediate word repetitions of generated captions (one per image).

    The degenerate outputs of semi-autoregressive and radix decoders repeat a word right after itself ("on the
    beach beach", "in field field field"); this counts exactly that, on the words of :func:`caption_words`.

    Returns ``{"captions": n, "distinct_captions": distinct normalised captions, "distinct_fraction":
    distinct / n, "repeat_caption_fraction": share of captions with some word equal to the word before it,
    "repeated_token_rate": words equal to the word before them / all words (0 when there are no words)}``.
    ``"a man and a dog"`` repeats nothing ("a" comes back, but not right after itself); ``"field field field"``
    has 2 repeated words out of 3.
    """
    caps = list(captions)
    if not caps:
        raise ValueError("repetition_stats needs at least one caption")
    words = [caption_words(c) for c in caps]
    repeats = [sum(a == b for a, b in pairwise(w)) for w in words]
    total = sum(len(w) for w in words)
    n = len(caps)
    distinct = len({normalize_caption(c) for c in caps})
    return {
        "captions": n,
        "distinct_captions": distinct,
        "distinct_fraction": distinct / n,
        "repeat_caption_fraction": sum(r > 0 for r in repeats) / n,
        "repeated_token_rate": sum(repeats) / total if total else 0.0,
    }
