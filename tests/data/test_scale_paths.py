"""The faster and streaming paths found by ``capflow bench scale`` give exactly what the paths they replace gave:
the streamed annotation reader, the ASCII tokenizer, the vectorised label builder, the chunk-by-chunk label
digest and the direct reads of a store's per-row arrays."""

import hashlib
import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from captioning.data.karpathy import SPLIT_CODES, Dataset, ImageEntry
from captioning.data.prepare import build_labels
from captioning.data.stores import OK, REJECTED, CorruptDataError, FeatureStore, LabelStore
from captioning.data.stores.direct import read_rows_direct
from captioning.data.text import _JOINERS, _SPACE_LIKE, build_vocabulary, tokenize
from captioning.jsonio import iter_array_field


class _Bad(ValueError):
    pass


def _reference_tokenize(text, max_words=None):
    """tokenize's documented rule, character by character (its path for non-ASCII text)."""
    text = unicodedata.normalize("NFKC", text).lower()
    out, buf = [], []
    for ch in text:
        if ch in _JOINERS:
            continue
        cat = unicodedata.category(ch)
        if cat[0] in "PS" or cat in _SPACE_LIKE or cat == "Cf":
            if buf:
                out.append("".join(buf))
                buf = []
        else:
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out[:max_words] if max_words is not None else out


def test_ascii_tokenize_matches_the_character_rule():
    rng = random.Random(0)
    texts = ["A man's dog, on\tthe-beach.", "don't  STOP!!", "x\x1cy\x1fz", "a_b c~d e`f", "", "   "]
    texts += ["".join(chr(rng.randrange(128)) for _ in range(rng.randrange(40))) for _ in range(3000)]
    for t in texts:
        assert tokenize(t) == _reference_tokenize(t), repr(t)
        assert tokenize(t, 3) == _reference_tokenize(t, 3), repr(t)
    assert tokenize("Café au lait") == ["café", "au", "lait"]  # non-ASCII: the character path


def _random_value(rng, depth=0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.randrange(-10**6, 10**6)
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-5, 8)
    if kind == 2:
        return "".join(rng.choice('ab\n"\\é☃ {}[],:') for _ in range(rng.randrange(6)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return 123456789012345678
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(rng.randrange(9)): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_streamed_array_equals_json_loads_at_any_window(tmp_path):
    """Random documents, some corrupted, read with windows of 1..64 characters (values cut anywhere, numbers
    included): the elements and other members equal json.loads's; malformed JSON is reported at json's line and
    column; nothing json.loads refuses is accepted."""
    rng = random.Random(1)
    path = tmp_path / "doc.json"
    for _ in range(1500):
        doc = {"a": _random_value(rng), "images": [_random_value(rng) for _ in range(rng.randrange(6))],
               "z": _random_value(rng)}
        keys = list(doc)
        rng.shuffle(keys)
        text = json.dumps({k: doc[k] for k in keys}, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < .5)
        if rng.random() < 0.3:
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice([",", "}", "x", "", "]", '"', "1", "."]) + text[i + 1:]
        path.write_text(text, encoding="utf-8")
        try:
            want = json.loads(text)
        except json.JSONDecodeError as e:
            want = e
        others: dict = {}
        try:
            got = list(iter_array_field(path, "images", "test", _Bad, others=others,
                                        block=rng.choice([1, 2, 3, 7, 64])))
        except _Bad as e:
            assert not (isinstance(want, dict) and isinstance(want.get("images"), list)), (text, e)
            if isinstance(want, json.JSONDecodeError) and "not valid JSON" in str(e):
                assert f"line {want.lineno} column {want.colno}" in str(e), (text, e, want)
            continue
        assert isinstance(want, dict), text
        assert got == want["images"] and others == {k: v for k, v in want.items() if k != "images"}


def test_streamed_array_structural_errors(tmp_path):
    def read(doc):
        p = tmp_path / "d.json"
        p.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
        return list(iter_array_field(p, "images", "test", _Bad))

    with pytest.raises(_Bad, match="top level must be an object"):
        read([1])
    with pytest.raises(_Bad, match="missing required field 'images'"):
        read({"x": 1})
    with pytest.raises(_Bad, match="'images' must be a list, got dict"):
        read({"images": {}})
    with pytest.raises(_Bad, match="'images' is given twice"):
        read('{"images": [], "images": [1]}')
    with pytest.raises(_Bad, match="Extra data"):
        read('{"images": []} x')
    with pytest.raises(FileNotFoundError, match=r"test file .* not found"):
        list(iter_array_field(tmp_path / "none.json", "images", "test", _Bad))
    with pytest.raises(_Bad, match="nested too deeply"):  # an element nested 100,000 deep: refused, no traceback
        read('{"images": [' + "[" * 100_000 + "]" * 100_000 + "]}")


def _dataset(n=40, seed=0):
    rng = np.random.default_rng(seed)
    words = ["a", "dog", "on", "the", "beach", "red", "car", "sits"]
    images = []
    for i in range(n):
        caps = [" ".join(rng.choice(words, size=rng.integers(1, 22))) for _ in range(rng.integers(1, 7))]
        images.append(ImageEntry(image_id=10 + 3 * i, file=f"{i}.jpg", split=("train", "val", "test")[i % 3],
                                 captions=caps, sentids=list(range(len(caps)))))
    images[5].captions[0] += " zebra okapi"  # seen once: <unk> at min_count > 1
    return Dataset(images=images, digest="d" * 64)


def test_build_labels_equals_the_caption_by_caption_encoding(tmp_path):
    ds = _dataset()
    vocab = build_vocabulary((c.split() for e in ds.images for c in e.captions), min_count=8)
    rows = {e.image_id: 1000 - k for k, e in enumerate(ds.images)}
    lab = build_labels(ds, vocab, str(tmp_path / "l.zarr"), 16, rows).read()
    k = 0
    for e in ds.images:
        for c in e.captions:
            w = vocab.encode(c.split()[:16])
            assert lab.tokens[k, : len(w)].tolist() == w and not lab.tokens[k, len(w):].any()
            assert (lab.length[k], lab.image_row[k], lab.image_id[k]) == (len(w), rows[e.image_id], e.image_id)
            assert lab.split[k] == SPLIT_CODES[e.split]
            k += 1
    assert k == len(lab.tokens)
    assert (lab.tokens == vocab.unk).any()  # rare words became <unk>
    with pytest.raises(ValueError, match="have no feature-store row"):
        build_labels(ds, vocab, str(tmp_path / "m.zarr"), 16, {})


def test_label_digest_streams_to_the_whole_read_digest_and_checks_chunks(tmp_path):
    rng = np.random.default_rng(0)
    m = 1000
    uri = str(tmp_path / "labels.zarr")
    s = LabelStore.create(uri, rng.integers(0, 99, (m, 7)).astype(np.int32), rng.integers(1, 7, m),
                          rng.integers(0, 300, m), rng.integers(0, 10**9, m), rng.integers(0, 3, m), chunk=64)
    s.add_source("seqkd:x", np.ones((5, 7), np.int32), [7] * 5, [1] * 5, [2] * 5, [0] * 5)
    lab = LabelStore.open(uri).read()  # what digest() hashed before it streamed
    h = hashlib.sha256()
    for arr in (lab.tokens, lab.length, lab.image_row, lab.image_id, lab.split, lab.source):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(json.dumps(lab.sources, sort_keys=True).encode())
    assert LabelStore.open(uri).digest() == h.hexdigest()
    f3 = Path(uri) / "length" / "c" / "3"
    f3.write_bytes((Path(uri) / "length" / "c" / "4").read_bytes())  # another chunk's valid bytes
    with pytest.raises(CorruptDataError, match=rf"chunk 3 .*{f3}"):
        LabelStore.open(uri).digest()


def test_direct_reads_equal_zarr_reads(tmp_path):
    n, chunk = 301, 4  # 76 chunks, a partial last one
    uri = str(tmp_path / "f.zarr")
    s = FeatureStore.create(uri, np.arange(7, 7 + n), max_boxes=5, feature_dim=6, chunk_rows=chunk)
    rng = np.random.default_rng(0)
    written = n - 41  # the last chunks stay unwritten: fill values
    written -= written % chunk
    st = np.where(rng.random(written) < 0.1, REJECTED, OK).astype(np.int8)
    s.write_rows(0, features=rng.random((written, 5, 6)), boxes=rng.random((written, 5, 4)),
                 num_boxes=rng.integers(0, 6, written), image_size=rng.integers(1, 999, (written, 2)), status=st)
    s = FeatureStore.open(uri)
    for name in ("image_id", "status", "num_boxes", "image_size", "boxes", "checksum", "features"):
        arr = s.group[name]
        m = arr.shape[0]  # the checksum array has a row per chunk
        for start, stop in ((None, None), (3, m - 2), (m // 4, m), (1, m // 2 + 5)):
            got = read_rows_direct(s.group, arr, start, stop)
            assert got is not None and got.dtype == arr.dtype, (name, start, stop)
            np.testing.assert_array_equal(got, arr[start:stop])
    assert read_rows_direct(s.group, s.group["status"], 0, 8) is None  # a few chunks: zarr's own read
    assert read_rows_direct(s.group, s.group["reject_reason"], None, None) is None  # strings: zarr
    np.testing.assert_array_equal(s.status()[written:], 0)  # pending rows read as the fill value
    # a damaged chunk file: the direct read gives way to zarr's, which names the file
    bad = Path(uri) / "num_boxes" / "c" / "5"
    bad.write_bytes(bad.read_bytes()[:3])
    assert read_rows_direct(s.group, s.group["num_boxes"], None, None) is None
    with pytest.raises(CorruptDataError, match=str(bad)):
        FeatureStore.open(uri).num_boxes()
