import json

import numpy as np
import pytest

from captioning.data.karpathy import read_karpathy
from captioning.data.text import (
    BOS,
    EOS,
    N_SPECIAL,
    PAD,
    RadixCodec,
    Vocabulary,
    build_vocabulary,
    tokenize,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("A man riding a Horse.", ["a", "man", "riding", "a", "horse"]),
        ("A “red” circle… left—of", ["a", "red", "circle", "left", "of"]),
        ("Don't stop", ["dont", "stop"]),
        ("Ｆｕｌｌ-width  ＡＢＣ", ["full", "width", "abc"]),
        ("two cats,on a\tmat!!", ["two", "cats", "on", "a", "mat"]),
        ("café crème", ["café", "crème"]),
        ("...  ---  ", []),
        ("zero\u200bwidth", ["zero", "width"]),
    ],
)
def test_tokenize(text, expected):
    assert tokenize(text) == expected


def test_tokenize_truncates():
    assert tokenize("one two three four five", max_words=3) == ["one", "two", "three"]


def test_vocabulary_order_threshold_and_ids():
    caps = [["a", "b", "a"], ["c", "a", "b"], ["d"]]
    v = build_vocabulary(caps, min_count=2, radix_base=4)
    assert v.words == ["a", "b"]  # by count, then alphabetical
    assert v.counts == [3, 2]
    assert v.unk_count == 2  # c and d
    assert v.id_of("a") == N_SPECIAL and v.id_of("b") == N_SPECIAL + 1
    assert v.id_of("zzz") == v.unk == N_SPECIAL + 2
    assert len(v) == N_SPECIAL + 3
    assert v.decode([BOS, v.id_of("b"), v.id_of("a"), EOS, v.id_of("a")]) == ["b", "a"]
    ties = build_vocabulary([["z", "y", "x"]], min_count=1)
    assert ties.words == ["x", "y", "z"]


def test_vocabulary_save_load(tmp_path):
    v = build_vocabulary([["x", "y", "y"]], min_count=1, radix_base=5)
    p = v.save(tmp_path / "vocab.json")
    d = json.loads(p.read_text())
    assert d["special"] == {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 5}
    assert d["radix"] == {"base": 5, "digits": 1, "size": 8}
    v2 = Vocabulary.load(p)
    assert v2 == v and v2.digest() == v.digest()
    p.write_text("{}")
    with pytest.raises(ValueError, match="not a capflow vocabulary"):
        Vocabulary.load(p)


def test_radix_digits_follow_the_paper():
    # ranks 0..num_words-1, digits most significant first, shifted by one (0 = padding)
    c = RadixCodec(base=10, num_words=250)
    assert c.digits == 3  # largest rank 249 needs 3 base-10 digits
    assert (c.bos, c.eos, c.size) == (11, 12, 13)
    ids = np.array([[N_SPECIAL + 0, N_SPECIAL + 7, N_SPECIAL + 249, PAD]])
    got = c.word_ids_to_digits(ids)
    assert got.tolist() == [[1, 1, 1, 1, 1, 8, 3, 5, 10, 0, 0, 0]]
    assert c.digits_to_word_ids(got).tolist() == ids.tolist()
    # ACORT's COCO setting: base 768, about 10k words -> 2 digits, 771 output classes
    coco = RadixCodec(768, 10_000)
    assert coco.digits == 2 and coco.size == 771 and coco.bos == 769 and coco.eos == 770
    assert RadixCodec(768, 768).digits == 1 and RadixCodec(768, 769).digits == 2


def test_radix_rejects_and_repairs_invalid():
    c = RadixCodec(base=4, num_words=10)  # ranks 0..9 -> 2 digits
    with pytest.raises(ValueError):
        c.word_ids_to_digits(np.array([[BOS]]))
    bad = np.array([[4, 4]])  # rank 15 > 9
    with pytest.raises(ValueError):
        c.digits_to_word_ids(bad)
    assert c.digits_to_word_ids(bad, strict=False).tolist() == [[N_SPECIAL + 9]]  # <unk> is the last word
    # decode_caption: skip BOS, stop at EOS, drop an incomplete group
    assert c.decode_caption([c.bos, 1, 2, 1, 1, 3, c.eos, 2, 2]) == [N_SPECIAL + 1, N_SPECIAL + 0]
    assert c.decode_caption([c.bos, 1, c.bos, 1]) == [N_SPECIAL + 0]
    assert c.encode_caption([N_SPECIAL + 5]) == [c.bos, 2, 2, c.eos]


def test_radix_round_trip_on_real_karpathy_test(external):
    ds = read_karpathy(external / "coco_eval" / "karpathy_test_dataset.json", max_words=100)
    caps = [c.split() for e in ds.images for c in e.captions]
    vocab = build_vocabulary(caps, min_count=1, radix_base=768)
    codec = vocab.radix()
    assert codec.digits == 2 and codec.size == 771
    assert 5000 < len(vocab.words) < 768 * 768
    length = max(len(c) for c in caps)
    ids = np.zeros((len(caps), length), np.int64)
    for k, c in enumerate(caps):
        ids[k, : len(c)] = vocab.encode(c)
    assert not np.any(ids == vocab.unk)  # threshold 1: every word is in the vocabulary
    digits = codec.word_ids_to_digits(ids)
    assert digits.shape == (len(caps), 2 * length)
    assert digits.max() <= 768 and digits[digits > 0].min() >= 1
    back = codec.digits_to_word_ids(digits)
    assert np.array_equal(back, ids)
    for k in range(0, len(caps), 997):  # caption-level API too
        toks = codec.encode_caption(ids[k][ids[k] > 0])
        assert vocab.decode(codec.decode_caption(toks)) == caps[k]
    assert sum(len(c) for c in caps) == int((back > 0).sum())
