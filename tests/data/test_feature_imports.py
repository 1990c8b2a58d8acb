"""``capflow import-features`` formats and the feature store's optional per-region arrays.

Every format is built here, at test time, from the real bottom-up features of five COCO images
(``external/bu_features``: ``cocobu_att/<id>.npy`` float32, ``cocobu_box_relative/<id>.npy``), with small writers
that follow each format's producer (bottom-up-attention's ``generate_tsv.py``, M2's ``coco_detections.hdf5``,
MILVLG's ``np.savez_compressed``, ruotianluo's ``make_bu_data.py``/``dump_to_lmdb.py``). The pixel boxes are the
relative boxes times the image size (the relative files are float32 pixel boxes divided in float64, so this gives
back the detector's own float32 pixels exactly), and the imports must give back the same float32 features and the
same boxes bit for bit. Malformed variants of each format must become rejected rows with their reasons.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from captioning.data.imports import (
    ButdTsvSource,
    FeatureImportError,
    M2HDF5Source,
    MilvlgSource,
    RuotianluoSource,
    import_source,
    read_image_sizes,
    resolve,
)
from captioning.data.stores import EXTRAS, OK, FeatureStore, StoreError
from flows.cli import main
from tests.data.conftest import IDS

FMT_NAME = {57870: "COCO_train2014_%012d", 384029: "COCO_train2014_%012d"}


# ---------------------------------------------------------------------- the real features
def sizes_of(bu: dict) -> dict[int, tuple[int, int]]:
    return {i: v["size"] for i, v in bu.items()}


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def coco_name(iid: int) -> str:
    return FMT_NAME.get(iid, "COCO_val2014_%012d") % iid


# ---------------------------------------------------------------------- writers, one per format
def tsv_line(iid: int, v: dict, *, lxmert: bool = False, **override: str) -> str:
    h, w = v["size"]
    f = {"image_id": coco_name(iid) if lxmert else str(iid), "image_w": str(w), "image_h": str(h),
         "num_boxes": str(v["n"]), "boxes": b64(v["px"]), "features": b64(v["att"]),
         "objects_id": b64(v["object_id"].astype("<i8")), "objects_conf": b64(v["object_conf"]),
         "attrs_id": b64(v["attr_id"].astype("<i8")), "attrs_conf": b64(v["attr_conf"])}
    f.update(override)
    order = ("image_id", "image_h", "image_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes",
             "boxes", "features") if lxmert else ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
    return "\t".join(f[k] for k in order) + "\r\n"  # csv.DictWriter's line terminator


def write_tsv(path: Path, bu: dict, *, lxmert: bool = False, extra_lines: list[str] = (), tail: str = "") -> Path:
    with open(path, "w", newline="") as out:
        for iid in IDS:
            out.write(tsv_line(iid, bu[iid], lxmert=lxmert))
        for line in extra_lines:
            out.write(line)
        out.write(tail)
    return path


def write_hdf5(path: Path, bu: dict, *, cls: bool = True, skip: tuple[int, ...] = ()) -> Path:
    import h5py

    with h5py.File(path, "w") as f:
        for iid in IDS:
            if iid in skip:
                continue
            v = bu[iid]
            f.create_dataset(f"{iid}_features", data=v["att"])
            f.create_dataset(f"{iid}_boxes", data=v["px"])
            if cls:
                f.create_dataset(f"{iid}_cls_prob", data=cls_prob(v))
    return path


def cls_prob(v: dict) -> np.ndarray:
    """(n, 1601) class probabilities whose arg-max over the object classes is the image's object_id."""
    n = v["n"]
    p = np.full((n, 1601), 1e-6, np.float32)
    p[:, 0] = 1.0  # background: the largest column, never an object
    p[np.arange(n), v["object_id"] + 1] = v["object_conf"]
    return p


class Trap:
    """Unpickling this creates the file ``path``: a reader that unpickles what it should not leaves it behind."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def write_milvlg(folder: Path, bu: dict, trap: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for iid in IDS:
        v = bu[iid]
        h, w = v["size"]
        info = np.array({"image_id": coco_name(iid), "objects_id": v["object_id"], "trap": Trap(trap)}, dtype=object)
        np.savez_compressed(folder / coco_name(iid), x=v["att"], bbox=v["px"], num_bbox=v["n"], image_h=h, image_w=w,
                            info=info)
    return folder


def write_ruotianluo_npz(root: Path, bu: dict) -> Path:
    (root / "cocobu_att").mkdir(parents=True)
    (root / "cocobu_box").mkdir()
    for iid in IDS:
        np.savez_compressed(root / "cocobu_att" / str(iid), feat=bu[iid]["att"])
        np.save(root / "cocobu_box" / f"{iid}.npy", bu[iid]["px"])
    return root


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def write_lmdb(path: Path, items: dict[bytes, bytes], trap: Path) -> Path:
    """An LMDB as ruotianluo's dump_to_lmdb.py (lmdbdict, value method identity) writes it: one file, keys the
    ascii image ids, values the bytes of each .npz; plus lmdbdict's own pickled entries."""
    import lmdb

    env = lmdb.open(str(path), subdir=False, map_size=1 << 28)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v)
        txn.put(b"__keys__", pickle.dumps(Trap(trap)))
        txn.put(b"__value_dumps__", pickle.dumps("identity"))
    env.close()
    return path


# ---------------------------------------------------------------------- checks
def imported(source, uri: Path, bu: dict, **kw):
    kw.setdefault("sizes", sizes_of(bu))
    kw.setdefault("max_boxes", 100)
    return import_source(source, str(uri), feature_dim=2048, dtype="float32", chunk_rows=4, **kw)


def check_round_trip(store: FeatureStore, bu: dict, *, pixels: bool, objects: bool = False,
                     attributes: bool = False, sizes: bool = True) -> None:
    want_extras = (("object_id", "object_conf") if objects else ()) + (("attr_id", "attr_conf") if attributes
                                                                      else ()) + (("boxes_px",) if pixels else ())
    assert store.extras == want_extras
    assert store.verify().ok
    row = store.row_of()
    block = store.read_block(0, store.num_rows)
    assert block.features.dtype == np.float32
    for iid in IDS:
        k, v = row[iid], bu[iid]
        n = v["n"]
        assert block.status[k] == OK and block.num_boxes[k] == n
        assert np.array_equal(block.features[k, :n], v["att"]), iid  # bit-exact
        assert not block.features[k, n:].any()
        assert np.array_equal(block.boxes[k, :n], v["rel"].astype(np.float32)), iid  # bit-exact too
        assert not block.boxes[k, n:].any()
        assert block.image_size[k].tolist() == (list(v["size"]) if sizes else [-1, -1])
        ex = block.extras
        if pixels:
            assert np.array_equal(ex["boxes_px"][k, :n], v["px"]) and not ex["boxes_px"][k, n:].any()
        for name, on in (("object_id", objects), ("object_conf", objects), ("attr_id", attributes),
                         ("attr_conf", attributes)):
            if on:
                assert np.array_equal(ex[name][k, :n], v[name].astype(EXTRAS[name][1])), (iid, name)
                assert (ex[name][k, n:] == EXTRAS[name][2]).all()


def rejects(store: FeatureStore) -> dict[int, str]:
    return {r["image_id"]: r["reason"] for r in store.rejects()}


# ---------------------------------------------------------------------- round trips
def test_butd_tsv_round_trip(bu, tmp_path):
    tsv = write_tsv(tmp_path / "trainval_resnet101_faster_rcnn_genome_36.tsv", bu)
    spec = resolve("auto", tsv)
    assert spec.format == "butd-tsv"
    res = imported(spec.open(max_boxes=100, feature_dim=2048), tmp_path / "f.zarr", bu)
    assert (res.records, res.ok, res.rejected) == (5, 5, 0)
    assert res.store.image_ids().tolist() == IDS  # the file's order
    check_round_trip(res.store, bu, pixels=True)
    assert res.store.attrs["source"] == "import-butd-tsv"


def test_butd_tsv_with_objects_and_attributes_round_trip(bu, tmp_path):
    """The 10-field variant (LXMERT order, COCO_..._<id> image ids): ids and confidences are stored too; the
    sizes come from the file (none given)."""
    tsv = write_tsv(tmp_path / "train2014_obj36.tsv", bu, lxmert=True)
    res = imported(ButdTsvSource(tsv), tmp_path / "f.zarr", bu, sizes={})
    assert res.ok == 5
    check_round_trip(res.store, bu, pixels=True, objects=True, attributes=True)
    # the same file with a header line naming the fields, and with --tsv-fields: the same store
    header = "img_id\timg_h\timg_w\tobjects_id\tobjects_conf\tattrs_id\tattrs_conf\tnum_boxes\tboxes\tfeatures\n"
    headed = tmp_path / "headed.tsv"
    headed.write_bytes(header.encode() + tsv.read_bytes())
    again = imported(ButdTsvSource(headed), tmp_path / "g.zarr", bu)
    assert again.records == 5 and again.ok == 5
    given = imported(ButdTsvSource(tsv, fields=header.strip().split("\t")), tmp_path / "h.zarr", bu)
    for other in (again, given):
        for name in ("features", "boxes", "object_id", "attr_conf", "boxes_px"):
            assert np.array_equal(other.store.group[name][:], res.store.group[name][:])


def test_m2_hdf5_round_trip(bu, tmp_path):
    h5 = write_hdf5(tmp_path / "coco_detections.hdf5", bu)
    assert resolve("auto", h5).format == "m2-hdf5"
    res = imported(M2HDF5Source(h5), tmp_path / "f.zarr", bu)
    assert res.ok == 5 and res.store.image_ids().tolist() == sorted(IDS)
    # object ids: arg-max over the object classes (column 0 is background), as generate_tsv.py stores them
    check_round_trip(res.store, bu, pixels=True, objects=True)


def test_milvlg_npz_round_trip_never_unpickles_info(bu, tmp_path):
    trap = tmp_path / "unpickled"
    folder = write_milvlg(tmp_path / "milvlg", bu, trap)
    assert resolve("auto", folder).format == "milvlg-npz"
    res = imported(MilvlgSource(folder), tmp_path / "f.zarr", bu, sizes={})
    assert res.ok == 5
    check_round_trip(res.store, bu, pixels=True)  # sizes from the files; no object ids (they live in `info`)
    assert not trap.exists()


def test_ruotianluo_npy_npz_and_lmdb_round_trip(bu, tmp_path, external):
    # npy with relative boxes (the layout imported before the other formats): no pixel boxes to store
    npy = RuotianluoSource(external / "bu_features" / "cocobu_att", external / "bu_features" / "cocobu_box_relative",
                           fmt="npy", boxes="relative")
    res = imported(npy, tmp_path / "npy.zarr", bu, image_ids=IDS)
    check_round_trip(res.store, bu, pixels=False)
    # npz (key feat) with cocobu_box/ pixel boxes, found from the root folder
    root = write_ruotianluo_npz(tmp_path / "data", bu)
    spec = resolve("auto", root)
    assert (spec.format, spec.boxes, spec.box.name) == ("npz", "pixels", "cocobu_box")
    res = imported(spec.open(max_boxes=100, feature_dim=2048), tmp_path / "npz.zarr", bu)
    check_round_trip(res.store, bu, pixels=True)
    # LMDB of the .npz bytes (dump_to_lmdb.py), boxes from the folder; lmdbdict's pickles are never read
    trap = tmp_path / "unpickled"
    db = write_lmdb(tmp_path / "cocobu_att.lmdb", {str(i).encode(): npz_bytes(feat=bu[i]["att"]) for i in IDS},
                    trap)
    spec = resolve("auto", None, att=db, box=root / "cocobu_box")
    assert spec.format == "lmdb"
    res = imported(spec.open(max_boxes=100, feature_dim=2048), tmp_path / "lmdb.zarr", bu)
    assert res.records == 5
    check_round_trip(res.store, bu, pixels=True)
    assert not trap.exists()


# ---------------------------------------------------------------------- malformed records
def test_butd_tsv_malformed_records_are_counted_rejects(bu, tmp_path):
    v = bu[57870]
    h, w = v["size"]
    bad_px = v["px"].copy()
    bad_px[3, 2] = w + 5  # x2 past the right edge
    nan = v["att"].copy()
    nan[1, 7] = np.nan
    cut = tsv_line(522418, bu[522418])
    lines = [
        tsv_line(1001, v, features="!!" + b64(v["att"])[2:]),  # bad base64
        tsv_line(1002, v, boxes=b64(v["px"][:, :3])),  # wrong length
        tsv_line(1003, v, features=b64(nan)),  # NaN
        tsv_line(1004, v, boxes=b64(bad_px)),  # box outside the image
        tsv_line(1005, v), tsv_line(1005, v),  # duplicate id
        tsv_line(1006, v),  # not in the dataset
        "1007\t640\t480\t31\n",  # too few fields
        tsv_line(1008, v).replace("1008", "img-x", 1),  # no image id
        tsv_line(1009, v, image_w="500"),  # size differs from the image file's
        tsv_line(1010, v, num_boxes="0"),  # no regions
    ]
    tsv = write_tsv(tmp_path / "t.tsv", bu, extra_lines=lines, tail=cut[: len(cut) // 2].replace("522418", "1011"))
    wanted = [*IDS, *range(1001, 1006), 1007, 1009, 1010, 1011, 1012]  # 1006 unknown, 1012 has no record
    sizes = {**sizes_of(bu), **{i: (h, w) for i in wanted if i not in bu}}
    res = imported(ButdTsvSource(tsv), tmp_path / "f.zarr", bu, image_ids=wanted, sizes=sizes)
    store = res.store
    got = rejects(store)
    assert res.records == 17 and res.ok == 5 and res.rejected == len(got) == 12
    assert store.num_rows == 17  # 15 dataset images + the unknown id + the unreadable one
    assert sorted(store.summary()["rejected"], key=lambda r: r["row"]) == store.rejects()
    expect = {
        1001: "bad base64 in field 'features'",
        1002: "field 'boxes' has 372 bytes, expected num_boxes x 4 x 4 = 496",
        1003: "non-finite values (NaN/inf) in features",
        1004: f"box 3 ({', '.join(f'{x:g}' for x in bad_px[3])}) is outside the 640x480 image (1 such boxes)",
        1005: f"duplicate image id 1005 (2 records: {tsv}:10, {tsv}:11)",
        1006: f"{tsv}:12: image id 1006 is not in the dataset",
        1007: "4 fields, expected 6",
        -14: f"{tsv}:14: image id field 'img-x' is not an image id",
        1009: "image size 500x480 (w x h) in the source differs from the image file's 640x480",
        1010: "num_boxes is 0",
        1011: "truncated record: the file ends inside it",
        1012: f"no record for image 1012 in {tsv}",
    }
    assert set(got) == set(expect)
    for iid, text in expect.items():
        assert got[iid].startswith("cannot import features: ") and text in got[iid], (iid, got[iid])
    check_round_trip_subset(store, bu)
    assert res.reasons["duplicate image id"] == 1 and sum(res.reasons.values()) == 12
    assert store.attrs["import"]["rejected"] == 12 and store.verify().ok


def check_round_trip_subset(store: FeatureStore, bu: dict) -> None:
    row = store.row_of()
    for iid in IDS:
        k, n = row[iid], bu[iid]["n"]
        assert store.status(k, k + 1)[0] == OK
        assert np.array_equal(store.read_block(k, k + 1).features[0, :n], bu[iid]["att"])


def test_butd_tsv_overlong_and_foreign_lines(bu, tmp_path):
    """A line longer than any record of max_boxes x feature_dim is read only up to the bound (memory stays
    bounded) and rejected; a file with no 6- or 10-field record is an error that names the layouts."""
    v = bu[391895]
    tsv = write_tsv(tmp_path / "t.tsv", bu, extra_lines=[tsv_line(2001, v, features=b64(np.tile(v["att"], 3)))])
    src = ButdTsvSource(tsv, max_boxes=40, feature_dim=2048)
    res = imported(src, tmp_path / "f.zarr", bu, sizes={**sizes_of(bu), 2001: v["size"]}, max_boxes=40)
    got = rejects(res.store)
    assert "record longer than" in got[2001]
    assert bu[184613]["n"] == 47 and res.ok == 4 and "47 boxes > max_boxes=40" in got[184613]
    foreign = tmp_path / "x.tsv"
    foreign.write_text("1\t2\t3\n4\t5\t6\n")
    with pytest.raises(FeatureImportError, match=r"no record has 6 .* or 10 .* give --tsv-fields"):
        imported(ButdTsvSource(foreign), tmp_path / "g.zarr", bu)
    with pytest.raises(FeatureImportError, match=r"unknown TSV fields \['colour'\]"):
        ButdTsvSource(foreign, fields=["image_id", "colour"])


def test_m2_hdf5_malformed_datasets_are_counted_rejects(bu, tmp_path):
    import h5py

    h5 = write_hdf5(tmp_path / "coco_detections.hdf5", bu)
    v = bu[57870]
    with h5py.File(h5, "a") as f:
        nan = v["att"].copy()
        nan[0, 0] = np.inf
        f["3001_features"], f["3001_boxes"], f["3001_cls_prob"] = nan, v["px"], cls_prob(v)
        f["3002_features"], f["3002_boxes"], f["3002_cls_prob"] = v["att"], v["px"][:, :3], cls_prob(v)
        f["3003_features"], f["3003_cls_prob"] = v["att"], cls_prob(v)  # no boxes
        f["3004_features"], f["3004_boxes"], f["3004_cls_prob"] = v["att"], v["px"], cls_prob(v)[:5]
        f["3005_features"], f["3005_boxes"], f["3005_cls_prob"] = v["att"], v["px"], cls_prob(v)  # no size known
        f["3006_features"], f["3006_boxes"], f["3006_cls_prob"] = v["att"], v["px"] * 2, cls_prob(v)
        f["3007_features"], f["3007_boxes"], f["3007_cls_prob"] = v["att"], v["px"], cls_prob(v)  # not in dataset
        f["readme"] = np.zeros(1)  # not an image record: ignored (logged, counted in the attributes)
    wanted = [*IDS, *range(3001, 3007)]
    sizes = {**sizes_of(bu), **{i: v["size"] for i in range(3001, 3008) if i != 3005}}
    res = imported(M2HDF5Source(h5), tmp_path / "f.zarr", bu, image_ids=wanted, sizes=sizes)
    got = rejects(res.store)
    assert res.ok == 5 and res.rejected == len(got) == 7
    expect = {3001: "non-finite values (NaN/inf) in features", 3002: "boxes have shape (31, 3), expected (31, 4)",
              3003: "no dataset '3003_boxes'", 3004: "cls_prob has shape (5, 1601), expected (31, 1 + classes)",
              3005: "image size unknown", 3006: "is outside the 640x480 image", 3007: "is not in the dataset"}
    for iid, text in expect.items():
        assert text in got[iid], (iid, got[iid])
    assert res.store.attrs["import"]["ignored_entries"] == 1
    check_round_trip_subset(res.store, bu)


def test_truncated_or_foreign_containers_are_one_line_errors(bu, tmp_path):
    h5 = write_hdf5(tmp_path / "coco_detections.hdf5", bu)
    data = h5.read_bytes()
    cut = tmp_path / "cut.hdf5"
    cut.write_bytes(data[: len(data) // 2])
    # HDF5 keeps its index at the end of the file: a truncated file does not open
    with pytest.raises(FeatureImportError, match=r"cut\.hdf5: not a readable HDF5 file") as ei:
        M2HDF5Source(cut)
    assert "\n" not in str(ei.value)
    junk = tmp_path / "junk.hdf5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(FeatureImportError, match="not a readable HDF5 file"):
        resolve("auto", junk).open(max_boxes=100, feature_dim=2048)
    bad_lmdb = tmp_path / "x.lmdb"
    bad_lmdb.write_bytes(b"\0" * 100)
    with pytest.raises(FeatureImportError, match="not a readable LMDB"):
        RuotianluoSource(bad_lmdb, tmp_path, fmt="lmdb", boxes="relative").scan()


def test_milvlg_npz_malformed_files_are_counted_rejects(bu, tmp_path):
    folder = write_milvlg(tmp_path / "m", bu, tmp_path / "unpickled")
    v = bu[57870]
    h, w = v["size"]
    full = (folder / (coco_name(57870) + ".npz")).read_bytes()
    (folder / "COCO_val2014_000000004001.npz").write_bytes(full[: len(full) // 2])  # truncated
    np.savez(folder / "COCO_val2014_000000004002", x=v["att"], bbox=v["px"], num_bbox=30, image_h=h, image_w=w)
    np.savez(folder / "COCO_val2014_000000004003", bbox=v["px"], num_bbox=v["n"], image_h=h, image_w=w)  # boxes only
    np.savez(folder / "COCO_val2014_000000004004", x=v["att"], bbox=v["px"], num_bbox=v["n"], image_h=h // 2,
             image_w=w)  # boxes below the bottom edge
    shutil.copy(folder / (coco_name(391895) + ".npz"), folder / "391895.npz")  # the same image twice
    np.savez(folder / "features", x=v["att"])  # no image id in the name
    res = imported(MilvlgSource(folder), tmp_path / "f.zarr", bu, sizes={})
    got = rejects(res.store)
    assert res.records == 11 and res.ok == 4 and res.rejected == len(got) == 6
    assert "BadZipFile" in got[4001] or "truncated" in got[4001].lower() or "EOF" in got[4001]
    assert "x has shape (31, 2048), num_bbox is 30" in got[4002]
    assert "no array 'x'" in got[4003]
    assert "is outside the 640x240 image" in got[4004]
    assert got[391895].startswith("cannot import features: duplicate image id 391895 (2 records: ")
    placeholder = [k for k in got if k < 0]
    assert len(placeholder) == 1 and "file name 'features.npz' does not end with an image id" in got[placeholder[0]]
    assert not (tmp_path / "unpickled").exists()


def test_ruotianluo_malformed_files_are_counted_rejects(bu, tmp_path):
    root = write_ruotianluo_npz(tmp_path / "data", bu)
    v = bu[57870]
    np.savez(root / "cocobu_att" / "5001", features=v["att"])  # no feat
    np.savez(root / "cocobu_att" / "5002", feat=v["att"])  # no boxes file
    np.savez(root / "cocobu_att" / "5003", feat=v["att"])
    np.save(root / "cocobu_box" / "5003.npy", v["px"])  # pixel boxes, image size unknown
    res = imported(resolve("auto", root).open(max_boxes=100, feature_dim=2048), tmp_path / "f.zarr", bu)
    got = rejects(res.store)
    assert res.ok == 5 and res.rejected == 3
    assert "no array 'feat' (has features)" in got[5001]
    assert f"no {root / 'cocobu_box' / '5002.npy'}" in got[5002]
    assert "image size unknown" in got[5003]
    # relative boxes that are not: a clear hint
    (root / "rel").mkdir()
    for iid in IDS:
        np.save(root / "rel" / f"{iid}.npy", bu[iid]["px"] if iid == 57870 else bu[iid]["rel"])
    res = imported(RuotianluoSource(root / "cocobu_att", root / "rel", fmt="npz", boxes="relative"),
                   tmp_path / "g.zarr", bu, image_ids=IDS)
    assert res.ok == 4 and "outside the image: relative boxes lie in [0, 1]" in rejects(res.store)[57870]
    assert "--boxes pixels" in rejects(res.store)[57870]
    # an LMDB whose values are not .npy/.npz bytes, and a key that is not an image id
    values = {b"57870": pickle.dumps(v["att"]), b"184613": npz_bytes(feat=bu[184613]["att"]),
              b"abc": npz_bytes(feat=v["att"])}
    db = write_lmdb(tmp_path / "a.lmdb", values, tmp_path / "unpickled")
    res = imported(RuotianluoSource(db, root / "cocobu_box", fmt="lmdb", boxes="pixels"), tmp_path / "h.zarr", bu)
    got = rejects(res.store)
    assert res.ok == 1 and res.rejected == 2
    assert "not the bytes of a .npy or .npz file" in got[57870] and "pickled values are never loaded" in got[57870]
    assert "key 'abc' is not an image id" in got[-3]
    assert not (tmp_path / "unpickled").exists()


# ---------------------------------------------------------------------- detection and the command
def test_format_detection_names_candidates(bu, tmp_path):
    mixed = tmp_path / "mixed"
    write_milvlg(mixed, bu, tmp_path / "unpickled")
    write_tsv(mixed / "a.tsv", bu)
    with pytest.raises(FeatureImportError, match="candidates: butd-tsv, milvlg-npz"):
        resolve("auto", mixed)
    assert resolve("butd-tsv", mixed).format == "butd-tsv"
    other = tmp_path / "features.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(FeatureImportError, match="candidates: butd-tsv, m2-hdf5"):
        resolve("auto", other)
    with pytest.raises(FeatureImportError, match="does not exist"):
        resolve("auto", tmp_path / "none")
    npy_folder = tmp_path / "att"
    npy_folder.mkdir()
    np.save(npy_folder / "1.npy", np.zeros((1, 4), np.float32))
    with pytest.raises(FeatureImportError, match="--att-dir with --box-dir"):
        resolve("auto", npy_folder)


def test_cli_imports_each_format(capsys, bu, tmp_path):
    tsv = write_tsv(tmp_path / "trainval_36.tsv", bu)
    h5 = write_hdf5(tmp_path / "coco_detections.hdf5", bu)
    coco = tmp_path / "captions_val2014.json"
    coco.write_text(json.dumps({"images": [{"id": i, "width": v["size"][1], "height": v["size"][0]}
                                           for i, v in bu.items()]}))
    assert read_image_sizes(coco) == sizes_of(bu)
    common = ["--json", "--set", "features.dtype=float32", "--set", f"run.workdir={tmp_path / 'wd'}"]
    for args, fmt in (([str(tsv)], "butd-tsv"), ([str(h5), "--image-sizes", str(coco)], "m2-hdf5")):
        out_uri = tmp_path / f"{fmt}.zarr"
        capsys.readouterr()
        assert main(["import-features", *args, "--out", str(out_uri), *common]) == 0
        s = json.loads(capsys.readouterr().out)
        assert (s["format"], s["ok"], s["rejected"], s["records"]) == (fmt, 5, [], 5)
        check_round_trip(FeatureStore.open(str(out_uri)), bu, pixels=True, objects=fmt == "m2-hdf5")
    # the default store name in the feature-store folder, recorded for the next stages
    capsys.readouterr()
    assert main(["import-features", str(tsv), *common]) == 0
    uri = json.loads(capsys.readouterr().out)["store"]
    assert Path(uri).parent == tmp_path / "wd" / "features" and Path(uri).name.startswith("imported-")
    # an unreadable container: exit 2, one line naming it
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"junk")
    capsys.readouterr()
    assert main(["import-features", str(junk), "--out", str(tmp_path / "j.zarr")]) == 2
    err = capsys.readouterr().err.strip()
    assert "junk.h5: not a readable HDF5 file" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------------- the store's optional arrays
def small_rows(n: int, b: int, d: int) -> dict:
    base = np.arange(n * b * d, dtype=np.float32).reshape(n, b, d) / 7
    return {"features": base, "boxes": np.full((n, b, 4), 0.25, np.float32), "num_boxes": np.full(n, b - 1),
            "image_size": np.full((n, 2), 100), "status": np.full(n, OK, np.int8)}


def extras_rows(n: int, b: int) -> dict:
    return {"object_id": np.arange(n * b).reshape(n, b), "object_conf": np.full((n, b), 0.5, np.float32),
            "attr_id": np.full((n, b), -1), "attr_conf": np.zeros((n, b), np.float32),
            "boxes_px": np.full((n, b, 4), 12.5, np.float32)}


def test_store_extras_api_checksums_and_repair(tmp_path):
    with pytest.raises(StoreError, match=r"unknown extra feature-store arrays \['colour'\]"):
        FeatureStore.create(str(tmp_path / "x.zarr"), [1], max_boxes=2, extras=["colour"])
    uri = str(tmp_path / "e.zarr")
    store = FeatureStore.create(uri, [1, 2, 3], max_boxes=3, feature_dim=2, chunk_rows=2,
                                extras=["boxes_px", "object_id", "object_conf", "attr_id", "attr_conf"])
    assert store.extras == ("object_id", "object_conf", "attr_id", "attr_conf", "boxes_px")  # EXTRAS order
    assert store.group["object_id"].chunks == (2, 3) and store.group["boxes_px"].chunks == (2, 3, 4)
    rows, ex = small_rows(2, 3, 2), extras_rows(2, 3)
    with pytest.raises(StoreError, match=r"exactly the store's extras.*missing \['attr_conf'\]"):
        store.write_rows(0, **rows, extras={k: v for k, v in ex.items() if k != "attr_conf"})
    with pytest.raises(StoreError, match=r"missing .*unexpected \[\]"):
        store.write_rows(0, **rows)
    with pytest.raises(StoreError, match="object_id has shape"):
        store.write_rows(0, **rows, extras={**ex, "object_id": ex["object_id"][:, :2]})
    with pytest.raises(StoreError, match="outside int32"):
        store.write_rows(0, **rows, extras={**ex, "object_id": ex["object_id"] + 2**40})
    store.write_rows(0, **rows, extras=ex)
    store.write_rows(2, **small_rows(1, 3, 2), extras=extras_rows(1, 3))
    again = FeatureStore.open(uri, "r+")
    block = again.read_block(0, 2)
    assert set(block.extras) == set(ex)
    for k, v in ex.items():
        assert np.array_equal(block.extras[k], v.astype(EXTRAS[k][1])) and block.extras[k].dtype == EXTRAS[k][1]
    assert again.verify().ok and again.verify().checked == 2
    m = again.manifest()
    assert m["extras"] == list(again.extras)
    # an extra array's chunk overwritten with another chunk's bytes: found, named, and repaired
    obj = again.group["object_id"]
    obj[0:2] = obj[0:2] + 1
    report = FeatureStore.open(uri, "r+").verify(repair=True)
    assert [f.chunk for f in report.faults] == [0] and report.faults[0].arrays == ["object_id"]
    assert FeatureStore.open(uri).manifest()["digest"] != m["digest"]
    fixed = FeatureStore.open(uri, "r+")
    assert (fixed.status(0, 2) == 0).all() and (fixed.group["object_id"][0:2] == -1).all()
    assert (fixed.group["boxes_px"][0:2] == 0).all()
    # appending rows grows the extras with the rest
    fixed.append_images([4])
    assert fixed.group["attr_id"].shape == (4, 3) and fixed.group["boxes_px"].shape == (4, 3, 4)


def test_store_without_extras_keeps_its_layout_and_digest(tmp_path):
    """A store without extras has the arrays, checksum columns, attributes and manifest digest it had before
    extras existed: the digest below was computed by the store code before the change."""
    store = FeatureStore.create(str(tmp_path / "s.zarr"), [5, 3, 9], max_boxes=2, feature_dim=3, chunk_rows=2,
                                attrs={"source": "x"})
    for c in range(store.num_chunks):
        a, b = store.chunk_range(c)
        rows = small_rows(b - a, 2, 3)
        rows["features"] = rows["features"] + a
        store.write_rows(a, **rows, reject_reason=[""] * (b - a))
    assert "extras" not in store.attrs and store.extras == ()
    assert store.group["checksum"].shape == (2, 7, 16)
    assert store.read_block(0, 3).extras == {}
    m = store.manifest()
    assert "extras" not in m
    assert m["digest"] == LEGACY_DIGEST


LEGACY_DIGEST = "b2554b734fdc38dc507c89fd3d596f840803c8220377f4f97335dca74c45947e"


# ---------------------------------------------------------------------- the bench
def test_bench_import_counts_are_real(capsys, tmp_path):
    """`capflow bench import` at a tiny size: each row count imported in its own process, every record counted
    (the corrupt ones as rejects), the peak memory reported per count."""
    assert main(["bench", "import", "--json", "--rows", "150,300", "--dim", "4", "--max-boxes", "6",
                 "--bad-every", "40", "--tmp", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "import" and out["machine"]["cpus"] >= 1
    assert out["params"] == {"format": "butd-tsv", "rows": [150, 300], "dim": 4, "boxes": 6, "chunk_rows": 8,
                             "dtype": "float16", "bad_every": 40}
    for r, n in zip(out["rows"], (150, 300)):
        assert r["rows"] == r["records"] == n and r["counts_ok"]
        assert r["ok"] + r["rejected"] == n and r["rejected"] == r["expected_rejects"] == n // 40
        assert r["reject_kinds"] == {"bad base64": n // 40}
        assert 0 < r["start_rss_mb"] <= r["peak_rss_mb"] and r["seconds"] > 0
    assert set(out["ratios"]) == {"peak_rss_smallest_vs_largest", "rows_per_second_largest_vs_smallest"}
    assert list(tmp_path.iterdir()) == []  # the files and stores are removed


def test_bench_import_rejects_are_counted(tmp_path):
    from captioning.bench.imports import write_tsv as bench_tsv

    tsv = tmp_path / "s.tsv"
    assert bench_tsv(tsv, 25, dim=4, boxes=3, bad_every=10) == 2
    res = import_source(ButdTsvSource(tsv, max_boxes=3, feature_dim=4), str(tmp_path / "s.zarr"), max_boxes=3,
                        feature_dim=4)
    assert (res.records, res.ok, res.rejected) == (25, 23, 2)
    assert [r["image_id"] for r in res.store.rejects()] == [10, 20]
    assert res.reasons == {"bad base64": 2}
