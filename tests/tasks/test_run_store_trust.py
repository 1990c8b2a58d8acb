"""What a run store holds is not trusted: a bucket that someone else can write must not make capflow write, read or
delete anything outside the store or the workdir, and a damaged blob must not outlive its repair. On a real store
folder (the same code as on S3)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from captioning.objectstore import ObjectStore, ObjectStoreError
from tasks.cache import StageCache, stage_key
from tasks.refs import TeacherRef
from tasks.verify import verify


def _blob(store: ObjectStore, data: bytes, tmp: Path) -> str:
    src = tmp / "blob-src"
    src.write_bytes(data)
    return store.put_blob(src)


@pytest.mark.parametrize("name", ["/{outside}/absolute.txt", "../../../outside/dotdot.txt", "a/../../x.txt",
                                  "a//b", "./a", "a\\..\\b"])
def test_a_manifest_naming_a_file_outside_its_tree_is_refused_and_writes_nothing(tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = ObjectStore(str(tmp_path / "store"))
    sha = _blob(store, b"planted", tmp_path)
    store.put_json("trees/runs/teacher-abc.json", {"files": {name.format(outside=str(outside).lstrip("/")):
                                                             [sha, 7]}})
    work = tmp_path / "w" / "a" / "b"
    with pytest.raises(ObjectStoreError, match="not a path inside its root"):
        store.fetch("runs/teacher-abc", work / "runs" / "teacher-abc")
    assert list(outside.iterdir()) == [] and not (tmp_path / "w").exists()


def test_a_manifest_entry_that_is_not_a_blob_name_is_refused(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    (tmp_path / "secret").write_text("s")
    store.put_json("trees/t.json", {"files": {"f": ["../../secret", 1]}})
    with pytest.raises(ObjectStoreError, match=r"is not \[sha256, size\]"):
        store.fetch("t", tmp_path / "w")
    with pytest.raises(ObjectStoreError, match="not a blob name"):
        store.get_blob("../../secret", tmp_path / "x")
    assert not (tmp_path / "w").exists() and not (tmp_path / "x").exists()


def test_a_tree_is_not_written_through_a_link_out_of_its_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = ObjectStore(str(tmp_path / "store"))
    sha = _blob(store, b"planted", tmp_path)
    store.put_json("trees/runs/t.json", {"files": {"sub/f.txt": [sha, 7]}})
    local = tmp_path / "w" / "runs" / "t"
    local.mkdir(parents=True)
    os.symlink(outside, local / "sub")
    with pytest.raises(ObjectStoreError, match="outside"):
        store.fetch("runs/t", local)
    assert list(outside.iterdir()) == []


def test_a_record_naming_a_path_out_of_the_workdir_is_not_materialised(tmp_path):
    """A stage record on the store whose path is ``@run/../../x``: the stage runs again; nothing is fetched or
    written outside the workdir."""
    store = ObjectStore(str(tmp_path / "store"))
    sha = _blob(store, b"planted", tmp_path)
    key = stage_key("teacher", x=1)
    bad = {"run_id": "r", "checkpoint": "@run/../../x", "checkpoint_digest": sha, "best_val_cider": 0.1}
    store.put_json(f"stages/teacher-{key[:20]}.json", {"stage": "teacher", "key": key, "result": bad})
    cache = StageCache(tmp_path / "a" / "w", str(tmp_path / "store"))
    assert cache.get("teacher", key, TeacherRef) is None
    assert cache.latest("teacher", TeacherRef) is None
    assert not (tmp_path / "x").exists() and not (tmp_path / "a" / "x").exists()
    with pytest.raises(ObjectStoreError, match="not a path inside its root"):
        store.put_json("trees/../../escape.json", {})
    assert not (tmp_path / "escape.json").exists()


def test_verify_repair_never_deletes_outside_the_store(tmp_path):
    """``capflow verify --repair`` with a record whose path escapes the store removes that record only."""
    victim = tmp_path / "victim.json"
    victim.write_text('{"precious": true}')
    store = ObjectStore(str(tmp_path / "store"))
    key = stage_key("teacher", y=1)
    store.put_json(f"stages/teacher-{key[:20]}.json", {"stage": "teacher", "key": key, "result": {
        "run_id": "r", "checkpoint": "@run/../../victim", "checkpoint_digest": "0" * 64, "best_val_cider": 0.0}})
    res = verify([], repair=True, run_store=str(tmp_path / "store"))
    assert victim.read_text() == '{"precious": true}'
    (finding,) = [f for f in res.findings if f.kind == "stage record"]
    assert finding.state == "repaired" and "not a path inside its root" in finding.detail
    assert store.documents("stages") == []


def test_a_damaged_blob_is_healed_by_repair_and_the_next_publish(tmp_path):
    """A blob whose content no longer matches its name: repair drops it with the record and manifest, and the
    stage's next publish stores it again, so a fresh workdir can fetch the tree (before: the damaged blob stayed
    and every later fetch failed). A blob of the wrong size is replaced by the next publish alone."""
    store_dir = tmp_path / "store"
    a = StageCache(tmp_path / "a", str(store_dir))
    key = stage_key("teacher", z=1)
    folder = a.workdir("teacher", key)
    (folder / "best.pt").write_bytes(b"best weights")
    sha = hashlib.sha256(b"best weights").hexdigest()
    ref = TeacherRef(run_id="r", checkpoint=str(folder / "best.pt"), checkpoint_digest=sha, best_val_cider=0.5)
    a.put("teacher", key, ref)
    blob = store_dir / "blobs" / sha
    blob.write_bytes(b"best weighTs")  # same size, other bytes
    res = verify([], repair=True, run_store=str(store_dir))
    assert {f.state for f in res.findings} == {"repaired"} and not blob.exists()
    a2 = StageCache(tmp_path / "a", str(store_dir))
    a2.put("teacher", key, ref)  # the stage ran again and published its folder
    fresh = StageCache(tmp_path / "b", str(store_dir)).get("teacher", key, TeacherRef)
    assert fresh is not None and Path(fresh.checkpoint).read_bytes() == b"best weights"
    blob.write_bytes(b"truncated")  # another size
    StageCache(tmp_path / "a", str(store_dir)).put("teacher", key, ref)
    assert blob.read_bytes() == b"best weights"
    assert json.loads((store_dir / "trees" / f"runs/teacher-{key[:16]}.json").read_text())["files"]
