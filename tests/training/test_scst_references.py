"""The training references as compact arrays (recipe.references) and SCST's reward built from them: the same
captions, text and rows as the dict-building implementation, and bit-identical rewards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from captioning.data.karpathy import SPLIT_CODES
from captioning.data.spill import FileArray
from captioning.data.stores import GROUND_TRUTH, CorruptDataError, Labels, LabelStore
from captioning.data.text import BOS, EOS, PAD, Vocabulary
from captioning.metrics.cider import CiderD
from captioning.training import recipe
from captioning.training.recipe import references
from captioning.training.scst import ScstLoss

VOCAB = Vocabulary(words=[f"w{i}" for i in range(40)], counts=[100 - i for i in range(40)])


def _labels(seed: int, images: int = 150, width: int = 12) -> Labels:
    rng = np.random.default_rng(seed)
    per = rng.integers(1, 6, images)
    n = int(per.sum())
    image_id = np.repeat(rng.permutation(10**6)[:images] + 3, per)
    image_row = np.repeat(rng.permutation(images), per)
    order = rng.permutation(n)  # an image's captions are not contiguous in the store
    p = 1.0 / np.arange(1, 41)
    tokens = (4 + rng.choice(40, size=(n, width), p=p / p.sum())).astype(np.int32)
    length = rng.integers(0, width + 1, n).astype(np.int32)
    tokens[np.arange(width) >= length[:, None]] = PAD
    tokens[rng.random((n, width)) < 0.02] = PAD  # PAD inside a caption: dropped
    tokens[5, 0], tokens[6, 1] = BOS, EOS  # specials: decoded as the old text did
    length[5], length[6] = max(length[5], 3), max(length[6], 3)
    split = rng.choice([SPLIT_CODES["train"], SPLIT_CODES["val"]], n, p=[0.8, 0.2]).astype(np.int8)
    by_image = {int(i): int(s) for i, s in zip(image_id, split, strict=True)}  # one split per image
    split = np.array([by_image[int(i)] for i in image_id], np.int8)
    source = np.where(rng.random(n) < 0.15, 1, GROUND_TRUTH).astype(np.int8)
    return Labels(tokens[order], length[order], image_row[order], image_id[order], split[order], source[order],
                  {GROUND_TRUTH: "ground_truth", 1: "seqkd"})


def _old_references(labels: Labels, vocab: Vocabulary, split: str):
    """The dict-building implementation it replaces."""
    sel = labels.select((labels.split == SPLIT_CODES[split]) & (labels.source == GROUND_TRUTH))
    ids, text, rows = {}, {}, {}
    words = [vocab.word_of(i) for i in range(len(vocab))]
    for tok, n, iid, row in zip(sel.tokens.tolist(), sel.length.tolist(), sel.image_id.tolist(),
                                sel.image_row.tolist(), strict=True):
        w = [t for t in tok[:n] if t != PAD]
        ids.setdefault(iid, []).append(w)
        text.setdefault(iid, []).append(" ".join(vocab.decode(w) if BOS in w or EOS in w else [words[t] for t in w]))
        rows[iid] = row
    return ids, text, rows


@pytest.mark.parametrize("chunk", [65_536, 7])
@pytest.mark.parametrize("split", ["train", "val"])
def test_references_equal_the_dict_implementation(split, chunk, monkeypatch):
    monkeypatch.setattr(recipe, "_REF_CHUNK", chunk)
    labels = _labels(0)
    got = references(labels, VOCAB, split)
    ids, text, rows = _old_references(labels, VOCAB, split)
    assert list(got.ids) == list(ids) and got.ids == ids
    assert list(got.text) == list(text) and got.text == text
    assert got.rows == rows
    assert len(got) == len(ids) and got.tokens.dtype == np.uint16 and got.image_ids.dtype == np.int64
    assert got.token_offsets[-1] == len(got.tokens) and got.caption_offsets[-1] == len(got.token_offsets) - 1


@pytest.mark.parametrize("seed", [1, 2])
def test_scst_rewards_from_compact_references_are_bit_identical(seed):
    labels = _labels(seed, images=200)
    refs = references(labels, VOCAB, "train")
    compact = ScstLoss(refs, samples=2, max_tokens=14)
    from_dict = ScstLoss(refs.ids, samples=2, max_tokens=14)
    old = CiderD.from_token_ids({k: [[*map(int, r), EOS] for r in v] for k, v in refs.ids.items()})
    assert compact.cider.references is None and compact.cider.table_size == old.table_size
    rng = np.random.default_rng(seed)
    keys = list(refs.ids)
    rows, rids = [], []
    for j in range(300):
        k = keys[int(rng.integers(len(keys)))]
        src = refs.ids[keys[int(rng.integers(len(keys)))] if j % 3 else k][0]
        row = [*src, EOS] if j % 2 else list(rng.integers(3, 44, int(rng.integers(1, 13))))
        rows.append((row + [PAD] * 14)[:14])
        rids.append(k)
    toks = torch.tensor(rows)
    want = old.score_batch(compact.words(toks), rids)
    assert np.array_equal(compact.rewards(toks, rids), want)
    assert np.array_equal(from_dict.rewards(toks, rids), want)
    assert (want > 0.5).sum() > 30


def _store(tmp_path, labels: Labels, chunk: int) -> LabelStore:
    """``labels`` as a label store of ``chunk`` rows per chunk: ground truth first, the other source appended."""
    gt = labels.source == GROUND_TRUTH
    s = LabelStore.create(str(tmp_path / f"labels-{chunk}.zarr"), labels.tokens[gt], labels.length[gt],
                          labels.image_row[gt], labels.image_id[gt], labels.split[gt], chunk=chunk)
    o = ~gt
    s.add_source("seqkd", labels.tokens[o], labels.length[o], labels.image_row[o], labels.image_id[o],
                 labels.split[o])
    return LabelStore.open(s.uri)


def _by_image(labels: Labels) -> Labels:
    """The rows regrouped image by image (in the order of their first row), as the vocab stage writes them."""
    _, first, inv = np.unique(labels.image_id, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first, kind="stable"), kind="stable")
    return labels.select(np.argsort(rank[inv.reshape(-1)], kind="stable"))


def _assert_same(got, want) -> None:
    for name in ("tokens", "token_offsets", "caption_offsets", "image_ids", "image_rows"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name


@pytest.mark.parametrize("spill", [False, True])
@pytest.mark.parametrize("chunk", [3, 7, 64, 65_536])
@pytest.mark.parametrize("split", ["train", "val"])
def test_references_streamed_from_the_store_equal_the_in_memory_ones(tmp_path, split, chunk, spill, monkeypatch):
    """Images whose captions run across chunk boundaries, the other source after the ground truth: one pass over the
    store, the store never read whole, the same arrays as from the labels in memory (``spill``: mapped from
    temporary files, and the same SCST rewards bit for bit)."""
    labels = _by_image(_labels(3, images=120))
    labels.image_row = np.arange(len(labels.image_row))  # each caption its own row: the last one's is kept
    store = _store(tmp_path, labels, chunk)
    want = references(store.read(), VOCAB, split)

    def whole(*a, **k):
        raise AssertionError("the store was read whole")

    monkeypatch.setattr(LabelStore, "read", whole)
    got = references(store, VOCAB, split, spill=spill)
    _assert_same(got, want)
    assert got.ids == want.ids and got.rows == want.rows and len(got) > 10
    assert isinstance(got.tokens, FileArray) == spill and isinstance(got.token_offsets, FileArray) == spill
    if spill:
        keys = list(want.ids)[:40]
        cands = [[*want.ids[k][0][:3], EOS] for k in keys[::-1]]
        scored = ScstLoss(got, samples=2).cider.score_batch(cands, keys)
        assert np.array_equal(scored, ScstLoss(want, samples=2).cider.score_batch(cands, keys))
        assert (scored > 0).any()


def test_references_of_a_store_not_written_image_by_image_read_it_whole(tmp_path):
    labels = _labels(0)  # an image's captions are scattered over the store
    store = _store(tmp_path, labels, 16)
    _assert_same(references(store, VOCAB, "train"), references(store.read(), VOCAB, "train"))


def test_references_from_a_damaged_store_name_the_chunk(tmp_path):
    store = _store(tmp_path, _by_image(_labels(4)), 16)
    f1, f2 = (Path(store.uri) / "tokens" / "c" / f"{k}" / "0" for k in (1, 2))
    f1.write_bytes(f2.read_bytes())  # another chunk's valid bytes
    with pytest.raises(CorruptDataError, match=rf"chunk 1 .*{f1}"):
        references(LabelStore.open(store.uri), VOCAB, "train")
