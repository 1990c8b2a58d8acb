"""The run store (``run.store``) as the stage cache's second level, on a local folder (the same code as on S3, which
`test_shared_nothing.py` runs against a real S3 endpoint): what is published, what another workdir materialises,
that nothing incomplete or damaged is read as complete, and `capflow verify` on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioning.objectstore import ObjectStore, ObjectStoreError, file_sha256
from tasks.cache import StageCache, stage_key
from tasks.refs import DatasetRef, LabelsRef, SeqKDRef, TeacherRef
from tasks.verify import verify


def _teacher(work: Path, cache: StageCache, key: str) -> TeacherRef:
    folder = cache.workdir("teacher", key)
    (folder / "best.pt").write_bytes(b"best weights")
    (folder / "last.pt").write_bytes(b"last weights")
    (folder / ".last.pt.123.tmp").write_bytes(b"half written")  # an atomic write in progress: never published
    (folder / "model").mkdir()
    (folder / "model" / "capflow.json").write_text("{}")
    return TeacherRef(run_id="r1", checkpoint=str(folder / "best.pt"),
                      checkpoint_digest=file_sha256(folder / "best.pt"), best_val_cider=0.5)


def test_a_record_published_in_one_workdir_is_materialised_in_another(tmp_path):
    store = tmp_path / "store"
    a = StageCache(tmp_path / "a", str(store))
    key = stage_key("teacher", x=1)
    ref = _teacher(tmp_path / "a", a, key)
    a.put("teacher", key, ref)
    # on the store: the record names the checkpoint relative to the workdir; the folder's manifest lists its files
    doc = json.loads((store / "stages" / a.path("teacher", key).name).read_text())
    assert doc["result"]["checkpoint"] == f"@run/runs/teacher-{key[:16]}/best.pt"
    manifest = json.loads((store / "trees" / "runs" / f"teacher-{key[:16]}.json").read_text())["files"]
    assert sorted(manifest) == ["best.pt", "last.pt", "model/capflow.json"]
    assert manifest["best.pt"] == [ref.checkpoint_digest, 12]

    b = StageCache(tmp_path / "b", str(store))  # another machine: nothing local
    got = b.get("teacher", key, TeacherRef)
    assert got is not None and Path(got.checkpoint) == tmp_path / "b" / "runs" / f"teacher-{key[:16]}" / "best.pt"
    assert Path(got.checkpoint).read_bytes() == b"best weights" and got.checkpoint_digest == ref.checkpoint_digest
    assert b.path("teacher", key).is_file()  # now cached locally too
    assert b.latest("teacher", TeacherRef) == got
    # without the store, the other workdir has nothing
    assert StageCache(tmp_path / "c").get("teacher", key, TeacherRef) is None
    assert StageCache(tmp_path / "c", str(store)).latest("teacher", TeacherRef) is not None


def test_a_stage_folder_resumes_from_what_an_earlier_attempt_published(tmp_path):
    store = str(tmp_path / "store")
    a = StageCache(tmp_path / "a", store)
    key = stage_key("student-lw", x=1)
    folder = a.workdir("student-lw", key)
    (folder / "xe").mkdir()
    (folder / "xe" / "last.pt").write_bytes(b"epoch 0")
    a.sync(folder / "xe")  # after an epoch; no record yet: the stage is not finished
    assert StageCache(tmp_path / "b", store).get("student-lw", key, TeacherRef) is None
    resumed = StageCache(tmp_path / "b", store).workdir("student-lw", key)
    assert (resumed / "xe" / "last.pt").read_bytes() == b"epoch 0"
    (folder / "xe" / "last.pt").write_bytes(b"epoch 1")
    a.sync(folder / "xe")  # a newer manifest; the older blob stays for whoever is reading it
    StageCache(tmp_path / "b", store).workdir("student-lw", key)
    assert (resumed / "xe" / "last.pt").read_bytes() == b"epoch 1"
    assert len(list((tmp_path / "store" / "blobs").iterdir())) == 2


def test_paths_outside_the_workdir_and_uris_stay_as_they_are(tmp_path):
    cache = StageCache(tmp_path / "w", str(tmp_path / "store"))
    ds = tmp_path / "w" / "datasets" / "dataset-x.json"
    ds.parent.mkdir(parents=True)
    ds.write_text("{}")
    labels = LabelsRef(run_id="", vocab_path="/elsewhere/vocab.json", labels_uri="s3://b/l.zarr", labels_digest="d",
                       vocab_digest="v", features_uri=None, features_digest=None)
    assert cache.portable(labels) == labels and cache.trees(labels) == []
    data = DatasetRef(run_id="", path=str(ds), digest="d", images=1, captions=5, rejected_images=0,
                      dropped_captions=0)
    assert cache.portable(data).path == "@run/datasets/dataset-x.json"
    assert cache.trees(data) == ["datasets/dataset-x.json"]
    kd = SeqKDRef(run_id="", source="seqkd:x", labels_digest="d", report={})
    assert cache.portable(kd) == kd
    with pytest.raises(ObjectStoreError, match=r"no run\.store"):
        StageCache(tmp_path / "v").materialise(cache.portable(data))


def test_nothing_incomplete_or_damaged_is_read_as_complete(tmp_path):
    root = tmp_path / "store"
    store = ObjectStore(str(root))
    f = tmp_path / "file.bin"
    f.write_bytes(b"x" * 1000)
    sha = store.put_blob(f)
    assert store.get_blob(sha, tmp_path / "copy").read_bytes() == b"x" * 1000
    # a tree whose manifest is not written yet does not exist for readers
    store.put_blob(f)
    assert store.fetch("runs/teacher-1", tmp_path / "t") is False
    # a damaged blob is refused (and nothing is left at the destination)
    (root / "blobs" / sha).write_bytes(b"y" * 1000)
    with pytest.raises(ObjectStoreError, match="damaged"):
        store.get_blob(sha, tmp_path / "copy2")
    assert not (tmp_path / "copy2").exists() and not list(tmp_path.glob(".copy2*"))
    with pytest.raises(ObjectStoreError, match="missing"):
        store.get_blob("0" * 64, tmp_path / "copy3")
    assert not list(root.rglob("*.tmp"))  # local-folder writes go through temp + rename


def test_verify_checks_the_run_store_and_repair_removes_what_is_damaged(tmp_path):
    store = tmp_path / "store"
    cache = StageCache(tmp_path / "a", str(store))
    key = stage_key("teacher", x=1)
    cache.put("teacher", key, _teacher(tmp_path / "a", cache, key))
    res = verify([], run_store=str(store))
    assert [(f.kind, f.state) for f in res.findings] == [("stage record", "ok")]
    manifest = json.loads((store / "trees" / "runs" / f"teacher-{key[:16]}.json").read_text())["files"]
    blob = store / "blobs" / manifest["best.pt"][0]
    blob.write_bytes(b"BEST weights")  # same size, other content
    res = verify([], run_store=str(store))
    assert res.damaged and "best.pt" in res.damaged[0].detail and "damaged" in res.damaged[0].detail
    res = verify([], run_store=str(store), repair=True)
    assert [f.state for f in res.findings] == ["repaired"]
    assert not list((store / "stages").glob("*.json"))
    assert StageCache(tmp_path / "b", str(store)).get("teacher", key, TeacherRef) is None  # the stage runs again
