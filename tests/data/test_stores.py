import numpy as np
import pytest
import zarr

from captioning.data.stores import (
    FEATURE_SCHEMA,
    OK,
    PENDING,
    REJECTED,
    FeatureStore,
    LabelStore,
    StoreError,
)
from captioning.data.stores import features as features_mod


def _rows(n, b=6, d=16, seed=0):
    rng = np.random.default_rng(seed)
    nb = rng.integers(1, b + 1, size=n)
    f = np.zeros((n, b, d), np.float32)
    bx = np.zeros((n, b, 4), np.float32)
    for i in range(n):
        f[i, : nb[i]] = rng.standard_normal((nb[i], d))
        bx[i, : nb[i]] = rng.random((nb[i], 4))
    return f, bx, nb


def _store(tmp_path, n=10, chunk=4, **kw):
    return FeatureStore.create(str(tmp_path / "f.zarr"), np.arange(100, 100 + n), max_boxes=6, feature_dim=16,
                               chunk_rows=chunk, **kw)


def test_schema_and_layout(tmp_path):
    s = _store(tmp_path, attrs={"dataset_digest": "abc"})
    g = zarr.open_group(str(tmp_path / "f.zarr"), mode="r")
    assert g.attrs["schema"] == FEATURE_SCHEMA and g.attrs["dataset_digest"] == "abc"
    assert g["features"].dtype == np.float16 and g["features"].shape == (10, 6, 16)
    assert g["features"].chunks == (4, 6, 16)  # chunks span whole rows
    assert g["boxes"].dtype == np.float32 and g["num_boxes"].dtype == np.int16
    assert g["image_size"].dtype == np.int32 and g["image_id"].dtype == np.int64 and g["status"].dtype == np.int8
    assert s.num_chunks == 3 and s.chunk_range(2) == (8, 10)
    assert s.status().tolist() == [PENDING] * 10
    assert s.pending_chunks() == [0, 1, 2]
    with pytest.raises(StoreError):  # exists already
        _store(tmp_path)


def test_write_whole_chunks_and_read_back(tmp_path):
    s = _store(tmp_path)
    f, bx, nb = _rows(10)
    st = np.full(10, OK, np.int8)
    st[3] = REJECTED
    reasons = [""] * 10
    reasons[3] = "truncated JPEG"
    for c in range(s.num_chunks):
        a, b = s.chunk_range(c)
        s.write_rows(a, features=f[a:b], boxes=bx[a:b], num_boxes=nb[a:b], image_size=np.full((b - a, 2), 7),
                     status=st[a:b], reject_reason=reasons[a:b])
    r = FeatureStore.open(str(tmp_path / "f.zarr"))
    blk = r.read_block(0, 10)
    assert np.array_equal(blk.features, f.astype(np.float16))
    assert np.array_equal(blk.boxes, bx) and blk.num_boxes.tolist() == nb.tolist()
    assert r.rejects() == [{"row": 3, "image_id": 103, "reason": "truncated JPEG"}]
    summ = r.summary()
    assert summ["ok"] == 9 and summ["pending"] == 0 and summ["boxes"]["max"] == int(nb[st == OK].max())
    assert r.pending_chunks() == []
    assert r.row_of()[105] == 5
    m1 = r.manifest()["digest"]
    assert m1 == FeatureStore.open(str(tmp_path / "f.zarr")).manifest()["digest"]


def test_write_contract_is_enforced(tmp_path):
    s = _store(tmp_path)
    f, bx, nb = _rows(4)
    ok = np.full(4, OK, np.int8)
    with pytest.raises(StoreError, match="whole chunks"):
        s.write_rows(2, features=f, boxes=bx, num_boxes=nb, image_size=np.zeros((4, 2)), status=ok)
    with pytest.raises(StoreError, match="final status"):
        s.write_rows(0, features=f, boxes=bx, num_boxes=nb, image_size=np.zeros((4, 2)),
                     status=np.zeros(4, np.int8))
    with pytest.raises(StoreError, match="expected features"):
        s.write_rows(0, features=f[:, :, :8], boxes=bx, num_boxes=nb, image_size=np.zeros((4, 2)), status=ok)
    with pytest.raises(StoreError, match="num_boxes"):
        s.write_rows(0, features=f, boxes=bx, num_boxes=np.full(4, 7), image_size=np.zeros((4, 2)), status=ok)
    # the last, partial chunk may be written as it is
    f2, bx2, nb2 = _rows(2)
    s.write_rows(8, features=f2, boxes=bx2, num_boxes=nb2, image_size=np.zeros((2, 2)), status=np.full(2, OK))
    assert s.status().tolist() == [PENDING] * 8 + [OK] * 2
    assert s.pending_chunks() == [0, 1]


def test_append_keeps_existing_rows(tmp_path):
    s = _store(tmp_path, n=4)
    f, bx, nb = _rows(4)
    s.write_rows(0, features=f, boxes=bx, num_boxes=nb, image_size=np.zeros((4, 2)), status=np.full(4, OK))
    new = s.append_images([500, 501, 502])
    assert list(new) == [4, 5, 6]
    r = FeatureStore.open(str(tmp_path / "f.zarr"))
    assert r.num_rows == 7 and r.image_ids().tolist() == [100, 101, 102, 103, 500, 501, 502]
    assert r.status().tolist() == [OK] * 4 + [PENDING] * 3
    assert np.array_equal(r.read_block(0, 4).features, f.astype(np.float16))
    assert r.pending_chunks() == [1]
    with pytest.raises(StoreError, match="already in the store"):
        s.append_images([101])


def test_open_rejects_foreign_groups(tmp_path):
    zarr.open_group(str(tmp_path / "x.zarr"), mode="w").attrs["schema"] = "other"
    with pytest.raises(StoreError, match="not a capflow feature store"):
        FeatureStore.open(str(tmp_path / "x.zarr"))
    with pytest.raises(StoreError, match="no Zarr store"):
        FeatureStore.open(str(tmp_path / "missing.zarr"))
    assert not FeatureStore.exists(str(tmp_path / "missing.zarr"))
    with pytest.raises(StoreError, match="unique"):
        FeatureStore.create(str(tmp_path / "d.zarr"), [1, 1], max_boxes=2)


def test_float32_store_is_exact(tmp_path):
    s = _store(tmp_path, n=4, dtype="float32", compressor="zstd")
    f, bx, nb = _rows(4)
    s.write_rows(0, features=f, boxes=bx, num_boxes=nb, image_size=np.zeros((4, 2)), status=np.full(4, OK))
    assert np.array_equal(FeatureStore.open(s.uri).read_block(0, 4).features, f)


def test_label_store_round_trip_and_sources(tmp_path):
    tokens = np.array([[5, 6, 0], [7, 0, 0], [5, 5, 5]], np.int32)
    uri = str(tmp_path / "labels.zarr")
    s = LabelStore.create(uri, tokens, np.array([2, 1, 3]), np.array([0, 0, 1]), np.array([9, 9, 4]),
                          np.array([0, 0, 2]), attrs={"vocab_digest": "v"})
    lab = LabelStore.open(uri).read()
    assert np.array_equal(lab.tokens, tokens) and lab.length.tolist() == [2, 1, 3]
    assert lab.image_row.tolist() == [0, 0, 1] and lab.image_id.tolist() == [9, 9, 4]
    assert lab.split.tolist() == [0, 0, 2] and lab.source.tolist() == [0, 0, 0]
    assert lab.sources == {0: "ground_truth"}
    d0 = s.digest()
    code = s.add_source("seqkd:teacher-run-1", np.array([[8, 9, 0]]), np.array([2]), np.array([1]),
                        np.array([4]), np.array([0]))
    assert code == 1
    lab = LabelStore.open(uri).read()
    assert lab.sources == {0: "ground_truth", 1: "seqkd:teacher-run-1"}
    assert lab.source.tolist() == [0, 0, 0, 1] and lab.tokens[3].tolist() == [8, 9, 0]
    assert s.digest() != d0
    with pytest.raises(StoreError, match="already present"):
        s.add_source("seqkd:teacher-run-1", np.array([[1, 0, 0]]), [1], [0], [9], [0])
    with pytest.raises(StoreError, match="width"):
        s.add_source("other", np.array([[1, 0]]), [1], [0], [9], [0])


# ---------------------------------------------------------------------- checksums and damaged files (issue 18)
def _written(tmp_path, n=12, chunk=4, name="f.zarr", seed=0):
    s = FeatureStore.create(str(tmp_path / name), np.arange(100, 100 + n), max_boxes=6, feature_dim=16,
                            chunk_rows=chunk)
    f, bx, nb = _rows(n, seed=seed)
    st = np.full(n, OK, np.int8)
    st[1] = REJECTED
    reasons = ["" if i != 1 else "too small" for i in range(n)]
    for c in range(s.num_chunks):
        a, b = s.chunk_range(c)
        s.write_rows(a, features=f[a:b], boxes=bx[a:b], num_boxes=nb[a:b], image_size=np.full((b - a, 2), 64),
                     status=st[a:b], reject_reason=reasons[a:b])
    return s


def _chunk(uri, array, k):
    """The file of row chunk ``k`` of ``array`` (Zarr v3 default keys: c/k, c/k/0, c/k/0/0)."""
    from pathlib import Path

    p = Path(uri) / array / "c" / str(k)
    while p.is_dir():
        p = p / "0"
    return p


def test_manifest_digest_covers_the_values(tmp_path):
    a = _written(tmp_path, name="a.zarr", seed=0)
    b = _written(tmp_path, name="b.zarr", seed=1)  # same ids, status, attributes; other features
    assert a.manifest()["digest"] != b.manifest()["digest"]
    assert a.manifest()["unverified_chunks"] == 0 and a.manifest()["checksums"]
    assert a.manifest()["digest"] == _written(tmp_path, name="c.zarr", seed=0).manifest()["digest"]


def test_another_chunks_bytes_are_detected_named_and_repaired(tmp_path):
    s = _written(tmp_path)
    digest = s.manifest()["digest"]
    clean = s.verify()
    assert clean.ok and clean.checked == 3 and clean.bytes > 0
    good = _chunk(s.uri, "features", 1).read_bytes()
    _chunk(s.uri, "features", 1).write_bytes(_chunk(s.uri, "features", 0).read_bytes())  # valid, wrong chunk
    r = FeatureStore.open(s.uri).verify()
    assert [f.chunk for f in r.faults] == [1] and r.faults[0].arrays == ["features"]
    assert r.faults[0].files == [str(_chunk(s.uri, "features", 1))] and "differ" in r.faults[0].problem
    assert FeatureStore.open(s.uri).pending_chunks() == []  # without repair nothing changes
    fixed = FeatureStore.open(s.uri, mode="r+").verify(repair=True)
    assert fixed.repaired == [1]
    w = FeatureStore.open(s.uri, mode="r+")
    assert w.pending_chunks() == [1] and w.manifest()["digest"] != digest
    _chunk(s.uri, "features", 1).write_bytes(good)  # what re-extraction writes back: the same values
    f, bx, nb = _rows(12)
    w.write_rows(4, features=f[4:8], boxes=bx[4:8], num_boxes=nb[4:8], image_size=np.full((4, 2), 64),
                 status=np.full(4, OK, np.int8))
    assert w.verify().ok and w.manifest()["digest"] == digest


def test_truncated_chunk_names_its_file_and_the_repair(tmp_path):
    from captioning.data.loader import ZarrFeatures
    from captioning.data.stores import CorruptDataError

    s = _written(tmp_path)
    path = _chunk(s.uri, "features", 2)
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(CorruptDataError, match=rf"{path}.*capflow verify --repair {s.uri}"):
        FeatureStore.open(s.uri).read_block(0, 12)
    with pytest.raises(CorruptDataError, match=str(path)):  # the training loader's reads
        ZarrFeatures(s.uri).read(np.arange(8, 12))
    ZarrFeatures(s.uri).read(np.arange(0, 8))  # other chunks read as before
    r = FeatureStore.open(s.uri).verify()
    assert [f.chunk for f in r.faults] == [2] and "cannot be read" in r.faults[0].problem
    nb = _chunk(s.uri, "num_boxes", 0)
    nb.write_bytes(nb.read_bytes()[:3])
    with pytest.raises(CorruptDataError, match=str(nb)):
        FeatureStore.open(s.uri).num_boxes()


def test_store_without_checksums_is_unverified_until_repaired(tmp_path):
    s = _written(tmp_path)
    g = zarr.open_group(s.uri, mode="r+")
    del g["checksum"]  # as a store written before capflow recorded checksums
    del g.attrs["checksums"]
    old = FeatureStore.open(s.uri)
    assert not old.has_checksums and old.read_block(0, 12).features.shape == (12, 6, 16)
    assert old.manifest()["unverified_chunks"] == 3 and old.manifest()["checksums"] is None
    r = old.verify()
    assert r.ok and r.unverified == [0, 1, 2] and r.checked == 0 and not r.recorded
    rec = FeatureStore.open(s.uri, mode="r+").verify(repair=True)
    assert rec.recorded == [0, 1, 2] and rec.ok
    again = FeatureStore.open(s.uri).verify()
    assert again.checked == 3 and not again.unverified and again.ok


def test_appending_to_a_partial_chunk_keeps_verification(tmp_path):
    s = _written(tmp_path, n=6)  # chunks [0..3], [4, 5]
    s.append_images([500, 501, 502])
    r = FeatureStore.open(s.uri).verify()
    assert r.ok and r.checked == 1 and r.pending == 2  # chunk 1 gained pending rows, chunk 2 is new
    f, bx, nb = _rows(5, seed=3)
    s.write_rows(4, features=f[:4], boxes=bx[:4], num_boxes=nb[:4], image_size=np.zeros((4, 2)),
                 status=np.full(4, OK, np.int8))
    s.write_rows(8, features=f[4:], boxes=bx[4:], num_boxes=nb[4:], image_size=np.zeros((1, 2)),
                 status=np.full(1, OK, np.int8))
    r = FeatureStore.open(s.uri).verify()
    assert r.ok and r.checked == 3


def test_label_store_checksums_catch_swapped_chunks(tmp_path):
    from captioning.data.stores import CorruptDataError

    tokens = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
    uri = str(tmp_path / "labels.zarr")
    s = LabelStore.create(uri, tokens, np.full(5, 3), np.arange(5), np.arange(5), np.zeros(5), chunk=2)
    assert s.verify().ok and s.verify().checked == 3
    s.add_source("seqkd:x", np.array([[1, 2, 3]]), [3], [4], [4], [0])  # the partial last chunk is rewritten
    assert LabelStore.open(uri).verify().ok and len(LabelStore.open(uri).read().tokens) == 6
    t0, t1 = _chunk(uri, "tokens", 0), _chunk(uri, "tokens", 1)
    t1.write_bytes(t0.read_bytes())
    with pytest.raises(CorruptDataError, match=rf"chunk 1 .*{t1}.*capflow verify --repair"):
        LabelStore.open(uri).read()
    with pytest.raises(CorruptDataError):
        LabelStore.open(uri).digest()
    r = LabelStore.open(uri).verify()
    assert [f.chunk for f in r.faults] == [1] and r.faults[0].files == [str(t1)]


def test_resuming_an_older_store_records_checksums_from_then_on(tmp_path):
    s = _store(tmp_path, n=12)
    g = zarr.open_group(s.uri, mode="r+")
    del g["checksum"]
    del g.attrs["checksums"]
    old = FeatureStore.open(s.uri, mode="r+")
    f, bx, nb = _rows(12)
    old.write_rows(0, features=f[:4], boxes=bx[:4], num_boxes=nb[:4], image_size=np.zeros((4, 2)),
                   status=np.full(4, OK, np.int8))  # written without a checksum, as older capflow did
    r = old.verify(repair=True)  # what `capflow extract` does on resume
    assert r.recorded == [0] and r.pending == 2 and old.has_checksums
    old.write_rows(4, features=f[4:8], boxes=bx[4:8], num_boxes=nb[4:8], image_size=np.zeros((4, 2)),
                   status=np.full(4, OK, np.int8))
    r = FeatureStore.open(s.uri).verify()
    assert r.checked == 2 and not r.unverified and r.ok


def test_row_index_maps_ids_to_rows_like_a_dict(tmp_path):
    from captioning.data.stores.features import RowIndex

    ids = np.array([40, 7, 99, 12, 5], np.int64)
    idx = RowIndex(ids)
    assert dict(idx) == {40: 0, 7: 1, 99: 2, 12: 3, 5: 4} and list(idx) == [40, 7, 99, 12, 5] and len(idx) == 5
    assert idx[99] == 2 and idx.get(6) is None and 6 not in idx and 5 in idx
    with pytest.raises(KeyError):
        idx[100]


def test_reads_through_zarr_go_a_block_of_chunks_at_a_time_and_chunk_states_are_per_chunk(tmp_path, monkeypatch):
    """Zarr reads of a row range are split into blocks of chunks (zarr holds its per-chunk bookkeeping for every
    chunk of one read): the same values whatever the block, strings included; pending, finished and unverified
    chunks are found per chunk, a partly written chunk pending, and ``verify`` counts the pending ones."""
    from captioning.data.stores import chunked

    s = _store(tmp_path, n=23, chunk=2)  # 12 chunks, the last one of one row
    f, bx, nb = _rows(23)
    st = np.full(23, OK, np.int8)
    st[5] = REJECTED
    reasons = [f"reason {i}" if i == 5 else "" for i in range(23)]
    for c in (0, 1, 2, 4, 7, 11):
        a, b = s.chunk_range(c)
        s.write_rows(a, features=f[a:b], boxes=bx[a:b], num_boxes=nb[a:b], image_size=np.full((b - a, 2), 7),
                     status=st[a:b], reject_reason=reasons[a:b])
    s._a["status"][12] = OK  # chunk 6 half written: still pending
    want = s._zarr_rows(s._a["reject_reason"], None, None, None).tolist()
    assert want[5] == "reason 5" and want.count("") == 22
    for block in (1, 3, 5, 100):
        monkeypatch.setattr(chunked, "_ZARR_BLOCK_CHUNKS", block)
        assert s._zarr_rows(s._a["reject_reason"], 3, 21, None).tolist() == want[3:21]
        assert s._zarr_rows(s._a["status"], None, None, None).tolist() == s.status().tolist()
        assert np.array_equal(s._zarr_rows(s._a["features"], 1, 22, 3), s._a["features"][1:22, :3])
    assert s.pending_chunks() == [3, 5, 6, 8, 9, 10]
    assert s.finished_chunks() == [0, 1, 2, 4, 7, 11]
    rep = s.verify()
    assert (rep.checked, rep.pending, rep.faults) == (6, 6, [])
    rep = s.verify([11, 3, 0, 6, 0])
    assert (rep.checked, rep.pending, rep.faults) == (2, 2, [])
    for outside in (12, -1):  # no chunk of that number (a negative one is not counted from the end)
        with pytest.raises(ValueError, match=f"chunks 0..11; asked to verify {outside}"):
            s.verify([0, outside])
    assert s.manifest()["unverified_chunks"] == 0
    s.group["checksum"][4] = 0  # forget one chunk's checksum
    s = FeatureStore.open(str(tmp_path / "f.zarr"))
    whole = s.manifest()
    assert whole["unverified_chunks"] == 1
    for block in (1, 2, 5):  # the row index and status hashed a block of chunks at a time: the same manifest
        monkeypatch.setattr(features_mod, "_MANIFEST_BLOCK", block)
        assert s.manifest() == whole
    assert chunked._runs(np.array([0, 1, 2, 4, 7, 8, 9, 10, 11]), 3) == [
        range(0, 3), range(4, 5), range(7, 10), range(10, 12)]
