"""CiderD and its document frequencies built a block of images at a time (what keeps SCST's set-up memory that of a
block at COCO scale) give the scores of the one-block build and of pycocoevalcap."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from pycocoevalcap.cider.cider import Cider

from captioning.metrics import cider as cider_mod
from captioning.metrics.cider import CiderD, DocumentFrequency, _blocks


def _corpus(seed: int, images: int = 60):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(40)]
    p = 1.0 / np.arange(1, 41)
    p /= p.sum()

    def caption():
        return " ".join(rng.choice(words, size=rng.integers(0, 14), p=p))
    gts = {100 + i: [caption() for _ in range(rng.integers(1, 6))] for i in range(images)}
    res = {k: caption() for k in gts}
    return gts, res


@pytest.fixture
def tiny_blocks(monkeypatch):
    monkeypatch.setattr(cider_mod, "_BLOCK_REFS", 7)
    monkeypatch.setattr(cider_mod, "_MAX_BLOCKS", 1000)


def test_blocks_cover_the_corpus_in_order(tiny_blocks):
    caps = [["a"] * k for k in (3, 5, 1, 9, 2, 2, 2, 7)]
    blocks = _blocks(caps)
    assert blocks[0][0] == 0 and blocks[-1][1] == len(caps) and len(blocks) > 3
    assert all(a[1] == b[0] for a, b in pairwise(blocks))
    assert _blocks([]) == [(0, 0)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_built_scores_equal_pycocoevalcap_and_one_block(seed, monkeypatch):
    gts, res = _corpus(seed)
    one = CiderD(gts)
    one_df = DocumentFrequency.from_references(gts)
    monkeypatch.setattr(cider_mod, "_BLOCK_REFS", 7)
    monkeypatch.setattr(cider_mod, "_MAX_BLOCKS", 1000)
    assert len(_blocks(list(gts.values()))) > 10
    many = CiderD(gts)
    keys = list(gts)
    a = many.score_batch([res[k] for k in keys], keys)
    b = one.score_batch([res[k] for k in keys], keys)
    assert np.abs(a - b).max() <= 1e-12
    _, expect = Cider().compute_score(gts, {k: [res[k]] for k in keys})
    assert np.abs(a - np.asarray(expect)).max() <= 1e-9
    df = DocumentFrequency.from_references(gts)
    assert len(df) == len(one_df) and df.n_docs == one_df.n_docs
    for cap in [c for v in list(gts.values())[:10] for c in v]:
        w = cap.split()
        for k in range(1, 5):
            for i in range(len(w) - k + 1):
                assert df[tuple(w[i:i + k])] == one_df[tuple(w[i:i + k])]


def test_block_built_scorer_with_a_df_that_lacks_ngrams(tiny_blocks, monkeypatch):
    """SCST's other set-up: df from the training corpus, references with n-grams it lacks in a later block."""
    gts, res = _corpus(3)
    keys = list(gts)
    train = {k: gts[k] for k in keys[:30]}
    df = DocumentFrequency.from_references(train)
    n_before = len(df)
    val = {k: gts[k] for k in keys[20:]}
    val[-1] = ["a novel xylophone caption", "xylophone"]
    scorer = CiderD(val, df=df)
    assert len(df) == n_before and scorer.table_size > n_before
    # against the definition with the training df: same as the one-block build
    monkeypatch.setattr(cider_mod, "_BLOCK_REFS", 10**9)
    monkeypatch.setattr(cider_mod, "_MAX_BLOCKS", 1)
    ref = CiderD(val, df=DocumentFrequency.from_references(train))
    vk = list(val)
    cands = [res.get(k, "a xylophone") for k in vk]
    assert np.abs(scorer.score_batch(cands, vk) - ref.score_batch(cands, vk)).max() <= 1e-12
