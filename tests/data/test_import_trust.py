"""Feature files from elsewhere are not trusted (what the probe of the imports found): HDF5 data kept in other files
is never read, a declared shape is checked before any data is read (memory bounded by the settings, not by the
file), an image size past 32 bits is a counted reject, a damaged LMDB is one line, not a traceback, and a stopped
import resumes. Real files written here, the real features of five COCO images (``bu``)."""

from __future__ import annotations

import io
import tracemalloc
import zipfile

import numpy as np
import pytest

from captioning.data.imports import (
    ButdTsvSource,
    FeatureImportError,
    M2HDF5Source,
    MilvlgSource,
    RuotianluoSource,
    import_source,
)
from captioning.data.stores import FeatureStore
from tests.data.conftest import IDS
from tests.data.test_feature_imports import imported, npz_bytes, tsv_line, write_hdf5, write_lmdb


def _kinds(res) -> dict[str, int]:
    return dict(res.reasons)


def test_hdf5_external_storage_and_links_are_never_read(bu, tmp_path):
    import h5py

    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(2 * 2048, dtype=np.float32).tobytes())  # a local file the import must not copy
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("data", data=np.ones((2, 2048), np.float32))
    path = write_hdf5(tmp_path / "f.hdf5", bu, cls=False, skip=IDS[:2])
    a, b = IDS[:2]
    with h5py.File(path, "a") as f:
        f.create_dataset(f"{a}_features", shape=(2, 2048), dtype="float32", external=[(str(secret), 0, 2 * 2048 * 4)])
        f.create_dataset(f"{a}_boxes", data=np.array([[0, 0, 5, 5], [1, 1, 6, 6]], np.float32))
        f[f"{b}_features"] = h5py.ExternalLink(str(other), "data")
        f.create_dataset(f"{b}_boxes", data=np.array([[0, 0, 5, 5], [1, 1, 6, 6]], np.float32))
    res = imported(M2HDF5Source(path, 100, 2048), tmp_path / "s.zarr", bu)
    assert res.ok == len(IDS) - 2 and _kinds(res) == {"external data": 2}
    store = FeatureStore.open(str(tmp_path / "s.zarr"))
    feats = np.asarray(store.read_block(0, store.num_rows).features)
    assert np.isin(np.arange(1, 4096, dtype=np.float32), feats).sum() < 100  # the secret's values are not there
    why = {r["image_id"]: r["reason"] for r in store.rejects()}
    assert "external storage" in why[a] and "link to another file" in why[b]


def test_a_declared_shape_is_checked_before_any_data_is_read(bu, tmp_path):
    """A tiny HDF5 file declaring a (4,000,000, 64) float32 dataset (1 GB once read) and a MILVLG .npz whose member
    declares the same: rejected as too many boxes with a few MB of memory, not after reading a gigabyte."""
    import h5py

    path = write_hdf5(tmp_path / "f.hdf5", bu, cls=False, skip=IDS[:1])
    with h5py.File(path, "a") as f:  # chunked and empty: a few KB on disk
        f.create_dataset(f"{IDS[0]}_features", shape=(4_000_000, 64), dtype="float32", chunks=(4096, 64),
                         compression="gzip")
        f.create_dataset(f"{IDS[0]}_boxes", data=np.zeros((1, 4), np.float32))
    folder = tmp_path / "milvlg"
    folder.mkdir()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (4_000_000, 64)})
    with zipfile.ZipFile(folder / f"{IDS[0]}.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", header.getvalue() + bytes(64 * 4))
        for k, v in (("bbox", np.zeros((1, 4), np.float32)), ("num_bbox", np.array(4_000_000)),
                     ("image_h", np.array(10)), ("image_w", np.array(10))):
            buf = io.BytesIO()
            np.save(buf, v)
            z.writestr(f"{k}.npy", buf.getvalue())
    for name, source in (("hdf5", M2HDF5Source(path, 100, 64)), ("milvlg", MilvlgSource(folder, 100, 64))):
        tracemalloc.start()
        res = import_source(source, str(tmp_path / f"{name}.zarr"), feature_dim=64, max_boxes=100, chunk_rows=4,
                            dtype="float32", sizes={i: v["size"] for i, v in bu.items()})
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert _kinds(res).get("max_boxes") == 1, (name, _kinds(res))
        assert peak < 64 << 20, (name, peak)  # the declaration alone would be 1 GB
        why = [r["reason"] for r in FeatureStore.open(str(tmp_path / f"{name}.zarr")).rejects()]
        assert any("4000000 boxes > max_boxes=100" in w for w in why), why


def test_an_image_size_past_32_bits_is_a_counted_reject(bu, tmp_path):
    path = tmp_path / "f.tsv"
    with open(path, "w", newline="") as out:
        out.write(tsv_line(IDS[0], bu[IDS[0]], image_w=str(2**31)))
        for iid in IDS[1:]:
            out.write(tsv_line(iid, bu[iid]))
    res = imported(ButdTsvSource(path, max_boxes=100, feature_dim=2048), tmp_path / "s.zarr", bu, sizes={})
    assert res.ok == len(IDS) - 1 and _kinds(res) == {"image size": 1}


@pytest.mark.parametrize("seed", range(24))
def test_a_damaged_lmdb_is_counted_rejects_or_one_line_never_a_traceback(bu, tmp_path, seed):
    """Random bytes of the LMDB file flipped: the import either finishes (a record it cannot read is a counted
    reject) or stops with one FeatureImportError naming the file; no lmdb error escapes."""
    att = write_lmdb(tmp_path / "att.lmdb", {str(i).encode(): npz_bytes(feat=bu[i]["att"]) for i in IDS},
                     tmp_path / "trap")
    box = tmp_path / "box"
    box.mkdir()
    for i in IDS:
        np.save(box / f"{i}.npy", bu[i]["rel"])
    data = bytearray(att.read_bytes())
    rng = np.random.default_rng(seed)
    for pos in rng.integers(0, min(len(data), 3 * 4096), 16):  # the meta and first pages: the tree itself
        data[int(pos)] ^= 0xFF
    att.write_bytes(bytes(data))
    try:
        res = imported(RuotianluoSource(att, box, fmt="lmdb", boxes="relative"), tmp_path / "s.zarr", bu)
    except FeatureImportError as e:
        assert str(att) in str(e) and "\n" not in str(e)
    else:
        assert res.ok + res.rejected == res.store.num_rows
    assert not (tmp_path / "trap").exists()


def test_a_stopped_import_resumes_and_ends_as_a_whole_import(bu, tmp_path, monkeypatch):
    """An import killed after its first chunks is completed by the same call (the store's digest equals an
    uninterrupted import's); a finished store is still refused without asking to overwrite."""
    from captioning.data.stores import StoreError

    path = tmp_path / "f.tsv"
    with open(path, "w", newline="") as out:
        for iid in IDS:
            out.write(tsv_line(iid, bu[iid]))

    def source():
        return ButdTsvSource(path, max_boxes=100, feature_dim=2048)

    def run(uri):  # rows of 1,000 boxes: two rows a write, three writes
        return import_source(source(), str(uri), feature_dim=2048, max_boxes=1000, chunk_rows=1, dtype="float32",
                             sizes={i: v["size"] for i, v in bu.items()})

    whole = run(tmp_path / "whole.zarr")
    real = FeatureStore.write_rows
    calls = []

    def dies_after_two(self, *a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(FeatureStore, "write_rows", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "s.zarr")
    assert len(calls) == 2
    monkeypatch.setattr(FeatureStore, "write_rows", real)
    res = run(tmp_path / "s.zarr")
    assert res.ok == whole.ok and res.store.manifest()["digest"] == whole.store.manifest()["digest"]
    with pytest.raises(StoreError, match="already exists"):
        run(tmp_path / "s.zarr")
