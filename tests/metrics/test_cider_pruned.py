"""SCST's CSR scorer keeps only the n-grams of two images or more (captioning.metrics.cider_pruned), built in chunks
of images smaller than the blocks of the full table: its scores stay those of the full (dict-built) table bit for
bit, and its df and table size are the full table's."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from captioning.metrics import cider as cider_mod
from captioning.metrics import cider_pruned
from captioning.metrics.cider import CiderD
from captioning.metrics.cider_pruned import chunk_edges

EOS = 2


def _corpus(seed: int, images: int = 250, words: int = 50):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, words + 1) ** 1.1
    p /= p.sum()

    def caption(lo=0, hi=15):
        return (3 + rng.choice(words, size=int(rng.integers(lo, hi)), p=p)).tolist()

    ids = rng.permutation(10_000)[:images].astype(np.int64) * 3 + 5
    refs = {int(i): [caption() for _ in range(int(rng.integers(1, 7)))] for i in ids}
    caps = [c for v in refs.values() for c in v]
    lengths = np.array([len(c) for c in caps], np.int64)
    csr = (np.array([t for c in caps for t in c], np.int64), np.concatenate([[0], np.cumsum(lengths)]),
           np.concatenate([[0], np.cumsum([len(v) for v in refs.values()])]), np.array(list(refs), np.int64))
    return rng, refs, csr, caption


def _candidates(rng, refs, caption, count=300):
    keys = list(refs)
    cands, rids = [], []
    for j in range(count):
        k = keys[int(rng.integers(len(keys)))]
        own = refs[k][int(rng.integers(len(refs[k])))]
        if j % 3 == 0:  # its own reference: matches the n-grams only this image has
            c = [*own, EOS]
        elif j % 3 == 1:  # a reference of its own, cut, with a random caption's words
            c = own[: max(1, len(own) // 2)] + caption(0, 6) + [EOS]
        else:
            c = caption(0, 18) + ([10**7 + j % 5] if j % 7 == 0 else [])
        cands.append(c)
        rids.append(k)
    return cands, rids


@pytest.mark.parametrize(("block_refs", "chunk_refs", "part_entries"),
                         [(10**9, 23, 1 << 20), (61, 17, 1), (61, 17, 40), (40, 10**9, 7), (97, 1, 300)])
@pytest.mark.parametrize("seed", [0, 1])
def test_pruned_scores_equal_the_full_table_bit_for_bit(seed, block_refs, chunk_refs, part_entries, monkeypatch):
    """``part_entries``: an order's count in partitions of about that many entries (1: as many partitions as the
    first chunk has keys; 1 << 20: one)."""
    monkeypatch.setattr(cider_mod, "_BLOCK_REFS", block_refs)
    monkeypatch.setattr(cider_mod, "_MAX_BLOCKS", 10**6)
    monkeypatch.setattr(cider_pruned, "_CHUNK_REFS", chunk_refs)
    monkeypatch.setattr(cider_pruned, "_PART_ENTRIES", part_entries)
    rng, refs, csr, caption = _corpus(seed)
    full = CiderD.from_token_ids({k: [[*r, EOS] for r in v] for k, v in refs.items()})
    pruned = CiderD.from_csr(*csr, append=EOS)
    cands, rids = _candidates(rng, refs, caption)
    want = full.score_batch(cands, rids)
    assert np.array_equal(pruned.score_batch(cands, rids), want)
    assert np.array_equal(pruned.score_batch(cands[:7], rids[:7]), want[:7])
    assert (want > 1.0).sum() > 50
    # the table: only n-grams of >= 2 images (much smaller), but the full table's size and document counts
    assert pruned.table_size == full.table_size and len(pruned.df) < full.table_size // 2
    for r in [*refs[rids[0]], *refs[rids[1]]]:
        r = [*r, EOS]
        for k in range(1, 5):
            for i in range(len(r) - k + 1):
                assert pruned.df[tuple(r[i:i + k])] == full.df[tuple(r[i:i + k])]
    assert pruned.df[(3, 10**7)] == 0.0 and pruned.df[(3, 3, 3, 3, 3)] == 0.0


def test_chunks_stay_inside_blocks_and_bounded():
    n_refs = np.array([3, 5, 1, 9, 2, 2, 2, 7, 1, 1, 4], np.int64)
    blocks = [(0, 4), (4, 8), (8, 11)]
    got = chunk_edges(blocks, n_refs, 6)
    assert got[0][0] == 0 and got[-1][1] == len(n_refs) and all(a[1] == b[0] for a, b in pairwise(got))
    for lo, hi, b in got:
        assert blocks[b][0] <= lo < hi <= blocks[b][1]
        assert hi - lo == 1 or n_refs[lo:hi].sum() <= 6
    assert chunk_edges([(0, 0)], np.zeros(0, np.int64), 6) == []


def test_the_counter_sums_counts_and_keeps_the_first_block_over_partitions(monkeypatch):
    monkeypatch.setattr(cider_pruned, "_PART_ENTRIES", 3)
    c = cider_pruned._Counter(9, np.uint8)  # 3 partitions, bounded by the first chunk's keys: [.., 5), [5, 9), [9, ..)
    c.add(np.array([3, 5, 9]), np.array([1, 1, 1]), 0)
    c.add(np.array([1, 5, 12]), np.array([2, 3, 1]), 1)
    c.add(np.array([1, 7, 12]), np.array([1, 1, 1]), 2)
    c.add(np.array([4, 12]), np.array([1, 4]), 3)
    assert c.bounds.tolist() == [5, 9] and len(c.parts) == 3
    keys, count, first = c.kept(2)
    assert keys.tolist() == [1, 5, 12] and count.tolist() == [3, 4, 6] and first.tolist() == [1, 0, 1]
    assert count.dtype == np.int32 and first.dtype == np.uint8
    assert c.distinct == 7 and c.parts == []


@pytest.mark.parametrize("ids", [[3, 8, 20, 21], [20, 3, 21, 8]])
def test_reference_positions_by_id_whether_or_not_the_ids_come_sorted(ids):
    from captioning.metrics.cider_refs import CsrReferences

    refs = CsrReferences(np.arange(8), np.arange(9), np.array([0, 2, 4, 6, 8]), np.array(ids, np.int64))
    assert refs.index_of([21, 3, 20, 20, 8]).tolist() == [ids.index(i) for i in (21, 3, 20, 20, 8)]
    with pytest.raises(KeyError, match="no references for id 9"):
        refs.index_of([3, 9])
    with pytest.raises(ValueError, match="distinct"):
        CsrReferences(np.arange(8), np.arange(9), np.array([0, 2, 4, 6, 8]), np.array([3, 8, 8, 9]))
