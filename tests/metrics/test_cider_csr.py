"""CiderD.from_csr (references as compact arrays, SCST's reward) scores exactly - bit for bit - what the
dict-of-token-lists scorer scores, whatever the blocks of the build."""

from __future__ import annotations

import numpy as np
import pytest

from captioning.metrics import cider as cider_mod
from captioning.metrics.cider import CiderD

EOS = 2


def _corpus(seed: int, images: int = 300, words: int = 60):
    """Token-id references (Zipf words, so that candidates share many n-grams with them) as a dict and as CSR."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, words + 1) ** 1.1
    p /= p.sum()

    def caption(lo=0, hi=16):
        return (3 + rng.choice(words, size=int(rng.integers(lo, hi)), p=p)).tolist()

    ids = rng.permutation(10_000)[:images].astype(np.int64) * 7 + 1
    refs = {int(i): [caption() for _ in range(int(rng.integers(1, 7)))] for i in ids}
    caps = [c for v in refs.values() for c in v]
    lengths = np.array([len(c) for c in caps], np.int64)
    tokens = np.array([t for c in caps for t in c], np.int32)
    token_offsets = np.concatenate([[0], np.cumsum(lengths)])
    caption_offsets = np.concatenate([[0], np.cumsum([len(v) for v in refs.values()])])
    return rng, refs, (tokens, token_offsets, caption_offsets, np.array(list(refs), np.int64)), caption


def _candidates(rng, refs, caption, count: int = 400):
    keys = list(refs)
    cands, rids = [], []
    for j in range(count):
        k = keys[int(rng.integers(len(keys)))]
        kind = j % 4
        if kind == 0:  # one of its own references, with EOS (high scores, many matched n-grams)
            c = [*refs[k][int(rng.integers(len(refs[k])))], EOS]
        elif kind == 1:  # another image's reference
            o = keys[int(rng.integers(len(keys)))]
            c = [*refs[o][0], EOS]
        elif kind == 2:  # random words, sometimes an unknown token
            c = caption(0, 20) + ([10**6 + j % 3] if j % 8 == 2 else [])
        else:  # a reference, shuffled and cut (as numpy array)
            r = list(refs[k][0])
            rng.shuffle(r)
            c = np.asarray(r[: max(1, len(r) - 1)], np.int64)
        cands.append(c)
        rids.append(k)
    return cands, rids


def _old(refs):
    """The dict path as SCST used it: Python-int lists, EOS appended."""
    return CiderD.from_token_ids({k: [[*map(int, r), EOS] for r in v] for k, v in refs.items()})


@pytest.mark.parametrize("blocks", ["one", "many"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_csr_scores_are_bit_exact(seed, blocks, monkeypatch):
    if blocks == "many":
        monkeypatch.setattr(cider_mod, "_BLOCK_REFS", 37)
        monkeypatch.setattr(cider_mod, "_MAX_BLOCKS", 1000)
    rng, refs, csr, caption = _corpus(seed)
    old, new = _old(refs), CiderD.from_csr(*csr, append=EOS)
    assert new.table_size == old.table_size and new.df.n_docs == old.df.n_docs == len(refs)
    cands, rids = _candidates(rng, refs, caption)
    a = old.score_batch(cands, rids)
    for batch in (slice(0, 400), slice(0, 250), slice(250, 400)):  # the batch's images differ: same scores
        b = new.score_batch(cands[batch], rids[batch])
        assert np.array_equal(a[batch], b), np.abs(a[batch] - b).max()
    assert (a > 1.0).sum() > 50  # the comparison is about real scores
    # single candidates (each its own batch) and numpy image ids too
    pairs = list(zip(cands[:40], rids[:40], strict=True))
    a1 = np.array([old.score_batch([c], [r])[0] for c, r in pairs])
    b1 = np.array([new.score_batch([c], np.array([r]))[0] for c, r in pairs])
    assert np.array_equal(a1, b1)
    assert new.df[(3,)] == old.df[(3,)] and new.df[(3, 4)] == old.df[(3, 4)]


def test_csr_without_append_equals_dict_without_eos():
    rng, refs, csr, caption = _corpus(5, images=80)
    old = CiderD.from_token_ids({k: [list(map(int, r)) for r in v] for k, v in refs.items()})
    new = CiderD.from_csr(*csr)
    cands, rids = _candidates(rng, refs, caption, 120)
    assert np.array_equal(old.score_batch(cands, rids), new.score_batch(cands, rids))


def test_csr_errors():
    *_, (tokens, toff, coff, ids), _ = _corpus(6, images=10)
    scorer = CiderD.from_csr(tokens, toff, coff, ids, append=EOS)
    with pytest.raises(KeyError, match="no references for id 123456789"):
        scorer.score_batch([[3, 4]], [123456789])
    with pytest.raises(KeyError):
        scorer.score_batch([[3, 4]], ["a"])
    with pytest.raises(ValueError, match="distinct"):
        CiderD.from_csr(tokens, toff, coff, np.r_[ids[:-1], ids[0]])
    with pytest.raises(ValueError, match="empty"):
        CiderD.from_csr(tokens, toff, np.r_[coff[:2], coff[1:]], np.r_[ids[:1], ids])
    with pytest.raises(ValueError, match="needs references"):
        CiderD.from_csr(tokens[:0], np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))
