"""WebDataset tar shards as img2dataset writes them, from real COCO images: ingest (counts, rejections with
reasons, splits), the images read back as byte ranges of the shards, and feature extraction from the shards."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from captioning.config import load_config
from captioning.data.karpathy import DatasetError
from captioning.data.plans import ingest_plan
from captioning.data.prepare import image_sizes, ingest, ingest_file
from captioning.data.shards import split_rank
from captioning.data.tar_members import MemberError, MemberRef, read_member
from captioning.features.images import ImageRejected, load_rgb


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


def _write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]], rows: list[dict] | None) -> None:
    """A shard as img2dataset writes it: each sample's members adjacent; ``rows`` its metadata Parquet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                _add(tar, f"{key}.{ext}", data)
    if rows is not None:
        cols = ("key", "caption", "url", "status", "error_message", "width", "height")
        pq.write_table(pa.table({c: [r.get(c) for r in rows] for c in cols}), path.with_suffix(".parquet"))


@dataclass
class Shards:
    root: Path
    files: dict[int, Path]  # image id -> the original JPEG
    captions: dict[int, list[str]]  # image id -> its COCO captions
    keys: dict[int, str] = field(default_factory=dict)  # image id -> key
    faults: dict[str, str] = field(default_factory=dict)  # what was planted -> key


@pytest.fixture(scope="module")
def coco(external: Path) -> list[dict]:
    index = json.loads((external / "images" / "index_all.json").read_text(encoding="utf-8"))
    out = [dict(x, path=external / "images" / x["file_name"]) for x in index if x["captions"]]
    assert len(out) == 27 and all(x["path"].is_file() for x in out)
    return out


@pytest.fixture(scope="module")
def shards(coco: list[dict], tmp_path_factory: pytest.TempPathFactory) -> Shards:
    """27 real COCO images in 3 shards of 9 (img2dataset keys ``SSSSSIIII``), plus planted faults: a truncated
    JPEG and a sample without a caption (shard 1), a repeated key and a non-numeric key (shard 2), a failed
    download in shard 2's metadata, and an empty .txt caption beside a good .json one (shard 0)."""
    root = tmp_path_factory.mktemp("webdataset") / "data"
    out = Shards(root, {}, {})
    per: dict[int, list[tuple[str, dict[str, bytes]]]] = {0: [], 1: [], 2: []}
    rows: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for n, x in enumerate(coco):
        s, i = divmod(n, 9)
        key = f"{s:05d}{i:04d}"
        data = x["path"].read_bytes()
        caps = x["captions"]
        doc = {"key": key, "caption": caps[0], "url": f"http://images.cocodataset.org/{x['file_name']}",
               "status": "success", "error_message": None, "width": x["width_height"][0],
               "height": x["width_height"][1]}
        if s == 0:  # all five COCO captions, as a list beside img2dataset's one caption
            doc["captions"] = caps
        txt = caps[0]
        if n == 1:
            txt = " ... !! "  # no words: dropped with a reason, the .json caption kept
            doc["caption"] = caps[1]
        per[s].append((key, {"jpg": data, "json": json.dumps(doc).encode(), "txt": txt.encode()}))
        rows[s].append(doc)
        iid = int(key)
        out.files[iid], out.keys[iid] = x["path"], key
        out.captions[iid] = caps
    first = coco[0]["path"].read_bytes()
    out.faults = {"truncated": "000010100", "no caption": "000010101", "duplicate": "000000003",
                  "not numeric": "img-7", "failed download": "000020100"}
    per[1].append(("000010100", {"jpg": first[: len(first) // 2], "txt": b"a cut off picture"}))
    rows[1].append({"key": "000010100", "caption": "a cut off picture", "status": "success"})
    per[1].append(("000010101", {"jpg": first, "json": json.dumps({"key": "000010101"}).encode()}))
    rows[1].append({"key": "000010101", "caption": None, "status": "success"})
    per[2].append(("000000003", {"jpg": first, "txt": b"the same key again"}))
    per[2].append(("img-7", {"jpg": first, "txt": b"a key that is no number"}))
    rows[2].append({"key": "000020100", "caption": "never downloaded", "status": "failed_to_download",
                    "error_message": "HTTP Error 404: Not Found"})
    for s in per:
        _write_shard(root / "shards" / f"{s:05d}.tar", per[s], rows[s])
    return out


def _cfg(tmp: Path, root: Path, *extra: str):
    return load_config("tiny", overrides=[
        f"run.workdir={tmp / 'work'}", "dataset.format=webdataset", f"dataset.images={root}",
        "dataset.shards.files=[shards/*.tar]", "dataset.max_reject_fraction=0.2", *extra])


def test_shards_ingest_counts_rejections_splits_and_images(shards: Shards, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, shards.root, "dataset.shards.val_images=3", "dataset.shards.test_images=4",
               "dataset.shards.max_split_fraction=0.2")
    ds = ingest(ingest_plan(cfg))
    # 27 good samples; 32 entries: + truncated, no caption, repeated key, non-numeric key, failed download
    assert ds.entries == 32 and ds.files_checked
    assert [e.image_id for e in ds.images] == sorted(shards.files)
    reasons = {r.file: r.reason for r in ds.rejected}
    assert set(reasons) == {"shards/00001.tar:000010100", "shards/00001.tar:000010101",
                            "shards/00002.tar:000000003", "shards/00002.tar:img-7", "shards/00002.tar:000020100"}
    assert "cannot be decoded" in reasons["shards/00001.tar:000010100"]  # tiny checks by a full decode
    assert reasons["shards/00001.tar:000010101"] == "no captions (none non-empty)"
    assert reasons["shards/00002.tar:000000003"].startswith(
        "duplicate key 000000003 (image id 3; first in shards/00000.tar, entry 3)")
    assert "not a decimal number" in reasons["shards/00002.tar:img-7"]
    assert reasons["shards/00002.tar:000020100"] == "img2dataset failed_to_download: HTTP Error 404: Not Found"
    assert {r.image_id for r in ds.rejected} == {10100, 10101, 3, None, 20100}
    assert [r.entry for r in ds.rejected] == sorted(r.entry for r in ds.rejected)
    assert [(r.image_id, r.reason) for r in ds.dropped_captions] == [
        (1, "empty caption in 000000001.txt (no words after tokenisation)")]
    # captions: .txt and .json's caption are one; shard 0 carries all five COCO captions
    by_id = {e.image_id: e for e in ds.images}
    for iid, e in by_id.items():
        assert len(e.captions) == (5 if iid < 10000 else 1)
        assert e.captions[0].split()[0] in shards.captions[iid][0 if iid != 1 else 1].lower()
    # splits: exact counts, the images ranked by the documented hash
    counts = {s: len(ds.split(s)) for s in ("train", "val", "test")}
    assert counts == {"train": 20, "val": 3, "test": 4}
    ranked = sorted(by_id, key=lambda i: (split_rank(i), i))
    assert {e.image_id for e in ds.split("val")} == set(ranked[:3])
    assert {e.image_id for e in ds.split("test")} == set(ranked[3:7])
    # every image read back from its shard: the original bytes, hash and pixels
    for iid, e in by_id.items():
        original = shards.files[iid].read_bytes()
        ref = MemberRef.parse(e.file)
        assert ref is not None and ref.shard.startswith("shards/") and ref.size == len(original) == e.size
        assert read_member(ref, shards.root) == original
        assert e.sha256 == hashlib.sha256(original).hexdigest()
        got = load_rgb(ds.image_path(e))
        assert np.array_equal(got, load_rgb(shards.files[iid]))
        with Image.open(shards.files[iid]) as im:
            assert got.shape == (im.height, im.width, 3)
    # the same shards give the same dataset; the digest covers the member references
    again = ingest(ingest_plan(cfg))
    assert again.digest == ds.digest and again.images == ds.images


def test_image_sizes_of_a_shard_dataset_come_from_the_shards(shards: Shards, tmp_path: Path) -> None:
    """``capflow import-features`` makes pixel boxes relative with these sizes: each image's header read from its
    byte range of the shard (the streamed dataset file and the dataset in memory alike), the truncated one too."""
    plan = ingest_plan(_cfg(tmp_path, shards.root))
    streamed = ingest_file(plan, tmp_path / "dataset.parquet")
    want = {}
    for iid, path in shards.files.items():
        with Image.open(path) as im:
            want[iid] = (im.height, im.width)
    whole = ingest(plan)
    assert image_sizes(streamed) == want and image_sizes(whole) == want and len(want) == 27
    assert all(MemberRef.parse(e.file) is not None for e in whole.images)
    moved = dataclasses.replace(whole, images_root=str(tmp_path / "elsewhere"))  # shards not found: no sizes
    assert image_sizes(moved) == {}


def test_default_splits_and_the_reject_limit(shards: Shards, tmp_path: Path) -> None:
    ds = ingest(ingest_plan(_cfg(tmp_path, shards.root)))  # val/test 5000 each, capped at 10%: 2 each of 27
    assert {s: len(ds.split(s)) for s in ("train", "val", "test")} == {"train": 23, "val": 2, "test": 2}
    with pytest.raises(DatasetError, match=r"(?s)5 of 32 shard entries are bad .*img2dataset failed_to_download"):
        ingest(ingest_plan(_cfg(tmp_path, shards.root, "dataset.max_reject_fraction=0.1")))


def test_metadata_ignored_or_required(shards: Shards, tmp_path: Path) -> None:
    ds = ingest(ingest_plan(_cfg(tmp_path, shards.root, "dataset.shards.metadata=ignore")))
    assert ds.entries == 31 and 20100 not in {r.image_id for r in ds.rejected}
    (shards.root / "extra").mkdir(exist_ok=True)
    _write_shard(shards.root / "extra" / "lonely.tar", [("000090000", {"jpg": b"x", "txt": b"y"})], None)
    with pytest.raises(DatasetError, match=r"no metadata file lonely\.parquet"):
        ingest(ingest_plan(_cfg(tmp_path, shards.root, "dataset.shards.metadata=required",
                                "dataset.shards.files=[shards/*.tar, extra/*.tar]")))
    (shards.root / "extra" / "lonely.tar").unlink()


def test_a_caption_from_the_metadata_serves_a_sample_without_one(coco: list[dict], tmp_path: Path) -> None:
    root = tmp_path / "d"
    samples, rows = [], []
    for i, x in enumerate(coco[:4]):
        key = f"{i:09d}"
        samples.append((key, {"jpg": x["path"].read_bytes()}))
        rows.append({"key": key, "caption": x["captions"][2], "status": "success"})
    _write_shard(root / "00000.tar", samples, rows)
    cfg = load_config("tiny", overrides=[f"run.workdir={tmp_path / 'w'}", "dataset.format=webdataset",
                                         f"dataset.images={root}"])
    ds = ingest(ingest_plan(cfg))
    assert len(ds.images) == 4 and not ds.rejected
    assert [e.captions for e in ds.images] == [[" ".join(x["captions"][2].lower().replace(".", "").split())]
                                               for x in coco[:4]]


def test_member_references_are_checked(shards: Shards, tmp_path: Path) -> None:
    ds = ingest(ingest_plan(_cfg(tmp_path, shards.root)))
    e = ds.images[0]
    ref = MemberRef.parse(e.file)
    assert ref is not None and str(ref) == e.file
    shard = shards.root / ref.shard
    size = shard.stat().st_size
    bad = {
        MemberRef(ref.shard, size - 512, 4096): "outside shard",  # past the end of the file
        MemberRef(ref.shard, ref.offset + 512, ref.size - 512): "no tar header|not a regular|holds",  # mid-member
        MemberRef(ref.shard, ref.offset, ref.size - 1): "holds .* bytes, the reference says",  # wrong size
        MemberRef(ref.shard, ref.offset + 3, ref.size): "not the start",
        MemberRef("shards/missing.tar", ref.offset, ref.size): "missing shard",
    }
    for r, words in bad.items():
        with pytest.raises(MemberError, match=words):
            read_member(r, shards.root)
        with pytest.raises(ImageRejected, match=words):  # extraction's loader: a rejected image, never garbage
            load_rgb(shards.root / str(r))
    with pytest.raises(MemberError, match=r"'\.\.'"):
        read_member(MemberRef("../data/shards/00000.tar", ref.offset, ref.size), shards.root)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (shards.root / "link").symlink_to(outside)
    try:
        (outside / "x.tar").write_bytes(shard.read_bytes())
        with pytest.raises(MemberError, match="outside the images root"):
            read_member(MemberRef("link/x.tar", ref.offset, ref.size), shards.root)
        with pytest.raises(DatasetError, match="leads outside the images root"):
            ingest(ingest_plan(_cfg(tmp_path, shards.root, "dataset.shards.files=[shards/*.tar, link/*.tar]")))
    finally:
        (shards.root / "link").unlink()
    assert MemberRef.parse("a/b.jpg") is None and MemberRef.parse("a.tar#1:x") is None


def test_webdataset_settings_are_checked(tmp_path: Path) -> None:
    from captioning.config import ConfigError

    with pytest.raises(ConfigError, match=r"dataset\.images"):
        load_config("tiny", overrides=["dataset.format=webdataset"])
    with pytest.raises(ConfigError, match="leave it unset"):
        load_config("tiny", overrides=["dataset.format=webdataset", "dataset.images=/d", "dataset.annotations=a"])
    with pytest.raises(ConfigError, match=r"relative to dataset\.images"):
        load_config("tiny", overrides=["dataset.format=webdataset", "dataset.images=/d",
                                       "dataset.shards.files=[../x/*.tar]"])
    with pytest.raises(DatasetError, match="no tar shards match"):
        ingest(ingest_plan(load_config("tiny", overrides=[f"run.workdir={tmp_path}", "dataset.format=webdataset",
                                                          f"dataset.images={tmp_path}"])))
    # a compressed shard the patterns match is named, with why it cannot be read in place (never skipped)
    (tmp_path / "00000.tar.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(DatasetError, match=r"00000\.tar\.gz is a compressed tar: .* decompress"):
        ingest(ingest_plan(load_config("tiny", overrides=[f"run.workdir={tmp_path}", "dataset.format=webdataset",
                                                          f"dataset.images={tmp_path}",
                                                          'dataset.shards.files=["*.tar", "*.tar.gz"]'])))


@pytest.mark.slow
def test_extraction_from_shards_equals_extraction_from_the_unpacked_files(coco: list[dict], tmp_path: Path,
                                                                          one_torch_thread) -> None:
    """The tiny preset's detector (random weights) on six COCO images read from two shards gives, image by image,
    the features, boxes and sizes it gives on the same JPEG files unpacked (a Karpathy dataset of them)."""
    from captioning.data.plans import extract_plan
    from captioning.data.stores import OK, FeatureStore
    from captioning.features.parallel import extract_features

    picked = coco[:6]
    root = tmp_path / "shards"
    for s in range(2):
        part = picked[3 * s: 3 * s + 3]
        _write_shard(root / f"{s:05d}.tar", [(f"{s:05d}{i:04d}", {"jpg": x["path"].read_bytes(),
                                                                  "txt": x["captions"][0].encode()})
                                             for i, x in enumerate(part)], None)
    small = ["features.extractor.min_size=64", "features.extractor.max_size=96", "features.extractor.proposals=24",
             "features.chunk_rows=4"]
    shard_cfg = load_config("tiny", overrides=[f"run.workdir={tmp_path / 'a'}", "dataset.format=webdataset",
                                               f"dataset.images={root}", *small])
    sds = ingest(ingest_plan(shard_cfg))
    assert len(sds.images) == 6 and all(MemberRef.parse(e.file) for e in sds.images)
    # the same images as files, under the same ids and splits
    files = tmp_path / "files"
    files.mkdir()
    doc = {"images": []}
    for e in sds.images:
        s, i = divmod(e.image_id, 10_000)
        x = picked[3 * s + i]
        (files / f"{e.image_id}.jpg").write_bytes(x["path"].read_bytes())
        doc["images"].append({"filename": f"{e.image_id}.jpg", "cocoid": e.image_id, "split": e.split,
                              "sentences": [{"raw": x["captions"][0]}]})
    (tmp_path / "dataset.json").write_text(json.dumps(doc), encoding="utf-8")
    file_cfg = load_config("tiny", overrides=[f"run.workdir={tmp_path / 'b'}", f"dataset.images={files}",
                                              f"dataset.annotations={tmp_path / 'dataset.json'}", *small])
    fds = ingest(ingest_plan(file_cfg))
    assert [(e.image_id, e.split, e.sha256) for e in fds.images] == [(e.image_id, e.split, e.sha256)
                                                                     for e in sds.images]
    a = extract_features(extract_plan(shard_cfg), sds, workers=0, progress=False)
    b = extract_features(extract_plan(file_cfg), fds, workers=0, progress=False)
    assert a.store != b.store and a.ok == b.ok == 6 and not a.rejected
    sa, sb = FeatureStore.open(a.store), FeatureStore.open(b.store)
    assert sa.image_ids().tolist() == sb.image_ids().tolist() == [e.image_id for e in sds.images]
    xa, xb = sa.read_block(0, sa.num_rows), sb.read_block(0, sb.num_rows)
    assert np.all(xa.status == OK) and np.all(xa.num_boxes >= 10)
    for name in ("features", "boxes", "num_boxes", "image_size", "status"):
        assert np.array_equal(getattr(xa, name), getattr(xb, name)), name
    assert {tuple(s) for s in xa.image_size} == {(x["width_height"][1], x["width_height"][0]) for x in picked}


def test_shard_images_reach_workers_through_the_run_store(shards: Shards, tmp_path: Path) -> None:
    """Workers that share no filesystem get each image from the run store: a shard member goes up as its own
    bytes (named by their sha256), and is decoded there like the original file."""
    from captioning.features.stored_images import BLOB, load_stored, publish_images

    ds = ingest(ingest_plan(_cfg(tmp_path, shards.root)))
    picked = ds.images[:3]
    store = str(tmp_path / "run-store")
    todo = [(0, [(e.image_id, str(ds.image_path(e))) for e in picked])]
    [(_, items)] = publish_images(store, ds, todo)
    for (row, item), e in zip(items, picked, strict=True):
        assert row == e.image_id and item == BLOB + e.sha256
        got = load_stored(store, e.sha256, min_side=16, max_pixels=10**8)
        assert np.array_equal(got, load_rgb(shards.files[e.image_id]))


def test_streaming_runs_and_the_hash_cache(shards: Shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However the samples fall into sorted runs the dataset is the same; with the hash cache a second ingest of
    unchanged shards checks no image again, and a changed shard is read again."""
    from captioning.data import shards as mod
    from captioning.data.karpathy import Dataset

    opts = {"shards": ["shards/*.tar"], "max_reject_fraction": 0.2, "image_check": "decode",
            "hash_cache": tmp_path / "hashes.json"}
    one = Dataset.from_file(mod.ingest_webdataset(shards.root, tmp_path / "a.parquet", **opts))
    small = Dataset.from_file(mod.ingest_webdataset(shards.root, tmp_path / "b.parquet", run_rows=2, **opts))
    assert small == one and len(one.images) == 27

    checked: list[int] = []
    real_check = mod.check_image_bytes

    def counting(data: bytes, mode: str) -> str | None:
        checked.append(len(data))
        return real_check(data, mode)

    monkeypatch.setattr(mod, "check_image_bytes", counting)
    again = Dataset.from_file(mod.ingest_webdataset(shards.root, tmp_path / "c.parquet", **opts))
    assert again == one
    truncated = len(shards.files[0].read_bytes()) // 2
    assert checked == [truncated]  # only the image that failed (a failure is never cached)
    checked.clear()
    shutil.copytree(shards.root / "shards", tmp_path / "copy" / "shards")  # other files: not in the cache
    mod.ingest_webdataset(tmp_path / "copy", tmp_path / "d.parquet", **opts)
    # every image of a sample that is otherwise whole: the 27, the truncated one and the repeated key's (repeats
    # are found after the shards are read); not those of the uncaptioned or non-numeric samples
    assert len(checked) == 27 + 2
