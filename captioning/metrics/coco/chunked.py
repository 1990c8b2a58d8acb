"""BLEU and CIDEr of pycocoevalcap over chunks of images: the same numbers, bit for bit, in memory bounded by the
chunk instead of by the number of images scored.

pycocoevalcap cooks every image's references into dicts of n-gram tuples before it scores any (measured: 20,000
images of 5 references took +420 MiB for BLEU and +690 MiB for CIDEr, most of it those dicts and CIDEr's document
frequencies). Here pycocoevalcap's own code still does the arithmetic:

* **BLEU**: each chunk is cooked by ``BleuScorer`` and only its per-image statistics (``ctest``: test length,
  reference lengths, guessed and correct n-gram counts; ~1 KB an image) are kept; one ``BleuScorer`` holding all
  of them computes the corpus and per-image scores (``compute_score`` reads only those statistics when the option
  is given, and "closest" is what ``Bleu`` passes).
* **CIDEr**: the document frequencies (images whose references contain an n-gram) come from
  :class:`captioning.metrics.cider_pruned.PrunedTable` over the tokenised references as integer arrays (the n-grams
  of two images or more, built in bounded chunks). An n-gram in one image weighs what an absent one does
  (``log(max(1, df))`` is 0 for df 0 and 1), so a chunk's ``CiderScorer`` gets the counts of its own n-grams that
  are in the table and scores its images with pycocoevalcap's ``compute_cider``; ``log(N)`` is taken over every
  image scored (the scorer's reference list is padded to N, and only the chunk's images are paired with a
  candidate). The corpus score is ``np.mean`` of all per-image scores, in order, as ``compute_score`` takes it.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Iterator, Sequence
from itertools import chain, repeat

import numpy as np

from captioning.metrics.cider_pruned import PrunedTable
from captioning.metrics.cider_refs import CsrReferences

__all__ = ["CHUNK_IMAGES", "bleu_in_chunks", "cider_in_chunks"]

#: images cooked at once (pycocoevalcap's dicts: ~20-35 KB an image with 5 references)
CHUNK_IMAGES = 1_000
_TABLE_CHUNK_REFS = 16_384  # references per chunk of the document-count table's build (~100 bytes a token)


def _chunks(ids: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for lo in range(0, len(ids), max(1, size)):
        yield ids[lo: lo + size]


def bleu_in_chunks(gts: dict[int, list[str]], res: dict[int, list[str]], chunk_images: int = CHUNK_IMAGES):
    """``BleuScorer(n=4)`` over ``gts``' images (their order) with option "closest", cooked a chunk at a time:
    ``(scores[4], per_image[4], the scorer holding every image's statistics)``."""
    from pycocoevalcap.bleu.bleu_scorer import BleuScorer

    ids = list(gts)
    stats: list[dict] = []
    for part in _chunks(ids, chunk_images):
        cooked = BleuScorer(n=4)
        for i in part:
            cooked += (res[i][0], gts[i])
        stats.extend(cooked.ctest)  # the references' n-gram dicts go with ``cooked``
    scorer = BleuScorer(n=4)
    scorer.ctest = stats
    score, per_image = scorer.compute_score(option="closest", verbose=0)
    return score, per_image, scorer


class _Words:
    """Word -> integer id over the tokenised references (their vocabulary), and the references as CSR arrays."""

    def __init__(self, gts: dict[int, list[str]], ids: Sequence[int]):
        self.ids: dict[str, int] = {}
        tokens, tok_off, cap_off = array("q"), array("q", [0]), array("q", [0])  # 8 bytes a value, no int objects
        for i in ids:
            for ref in gts[i]:
                tokens.extend(self.ids.setdefault(w, len(self.ids)) for w in ref.split())
                tok_off.append(len(tokens))
            cap_off.append(len(tok_off) - 1)
        self.refs = CsrReferences(np.frombuffer(tokens, np.int64), np.frombuffer(tok_off, np.int64),
                                  np.frombuffer(cap_off, np.int64), np.arange(len(ids), dtype=np.int64))


def _document_counts(table: PrunedTable, words: _Words, grams: set[tuple[str, ...]]) -> dict[tuple, float]:
    """The document count of each n-gram of ``grams`` that the table holds (two images or more; every word)."""
    out: dict[tuple, float] = {}
    by_order: dict[int, list[tuple[str, ...]]] = defaultdict(list)
    for g in grams:
        by_order[len(g)].append(g)
    for k, gs in by_order.items():
        flat = chain.from_iterable(gs)
        toks = np.fromiter(map(words.ids.get, flat, repeat(-1)), np.int64, len(gs) * k).reshape(len(gs), k)
        counts = table.document_counts(toks)
        out.update((g, float(c)) for g, c in zip(gs, counts.tolist(), strict=True) if c > 0)
    return out


def cider_in_chunks(gts: dict[int, list[str]], res: dict[int, list[str]], chunk_images: int = CHUNK_IMAGES
                    ) -> tuple[float, np.ndarray]:
    """pycocoevalcap's ``Cider().compute_score(gts, res)`` (n = 4, sigma = 6), a chunk of images at a time."""
    from pycocoevalcap.cider.cider_scorer import CiderScorer

    ids = list(gts)
    words = _Words(gts, ids)
    table = PrunedTable(words.refs, 4, [(0, len(ids))], chunk_refs=_TABLE_CHUNK_REFS)
    del words.refs
    scores: list[float] = []
    for part in _chunks(ids, chunk_images):
        scorer = CiderScorer(n=4, sigma=6.0)
        for i in part:
            scorer += (res[i][0], gts[i])
        grams = {g for refs in scorer.crefs for ref in refs for g in ref}
        grams.update(g for test in scorer.ctest for g in test)
        scorer.document_frequency = defaultdict(float, _document_counts(table, words, grams))
        scorer.crefs.extend([None] * (len(ids) - len(part)))  # log(N) over every image; zip pairs the chunk's
        scores.extend(scorer.compute_cider())
    return float(np.mean(np.array(scores))), np.array(scores)
