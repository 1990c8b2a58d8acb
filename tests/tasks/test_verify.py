"""Damaged files are named with their repair (issue 18, finding 3): stage records, checkpoints, store chunks, and
``capflow verify [--repair]`` over a workdir."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from captioning.data.stores import OK, FeatureStore, LabelStore, StoreError
from captioning.training import checkpoint
from flows.cli import main
from tasks.cache import StageCache, StageRecordError
from tasks.refs import FeaturesRef, LabelsRef, SeqKDRef, StudentResult, TeacherRef
from tasks.verify import features_intact


def _chunk(uri: str, array: str, k: int) -> Path:
    p = Path(uri) / array / "c" / str(k)
    while p.is_dir():
        p = p / "0"
    return p


def _features(uri: str, n: int = 12, seed: int = 0) -> FeatureStore:
    s = FeatureStore.create(uri, np.arange(n), max_boxes=4, feature_dim=8, chunk_rows=4)
    rng = np.random.default_rng(seed)
    for c in range(s.num_chunks):
        a, b = s.chunk_range(c)
        s.write_rows(a, features=rng.standard_normal((b - a, 4, 8)), boxes=rng.random((b - a, 4, 4)),
                     num_boxes=np.full(b - a, 4), image_size=np.full((b - a, 2), 32), status=np.full(b - a, OK))
    return s


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# ---------------------------------------------------------------------- stage records and checkpoints
def test_truncated_stage_record_names_the_file_and_the_repair(tmp_path):
    cache = StageCache(tmp_path)
    ref = SeqKDRef(run_id="r", source="seqkd:1", labels_digest="x")
    cache.put("vocab", "k" * 64, ref)
    assert cache.get("vocab", "k" * 64, SeqKDRef) == ref
    path = cache.path("vocab", "k" * 64)
    _truncate(path)
    with pytest.raises(StageRecordError, match=rf"{path} is damaged.*capflow verify --repair {tmp_path}"):
        cache.get("vocab", "k" * 64, SeqKDRef)
    path.write_text("[1, 2]", encoding="utf-8")  # parses, but is no record
    with pytest.raises(StageRecordError, match="not a stage record"):
        cache.get("vocab", "k" * 64, SeqKDRef)
    assert issubclass(StageRecordError, StoreError)  # the CLI prints it as an error (exit 2), no traceback


def test_truncated_checkpoint_names_the_file_and_the_repair(tmp_path):
    path = checkpoint.save(tmp_path / "last.pt", model=torch.nn.Linear(4, 3), arch={"d": 4}, epoch=2)
    assert checkpoint.load(path)["epoch"] == 2
    for keep in (0.5, 0.99, 0.0):
        shutil.copy(path, tmp_path / "cut.pt")
        _truncate(tmp_path / "cut.pt", keep)
        with pytest.raises(checkpoint.CheckpointError, match=rf"{tmp_path / 'cut.pt'} is damaged.*capflow verify"):
            checkpoint.load(tmp_path / "cut.pt")
    torch.save({"format": "something else"}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a capflow checkpoint") as ei:
        checkpoint.load(tmp_path / "foreign.pt")
    assert not isinstance(ei.value, checkpoint.CheckpointError)


# ---------------------------------------------------------------------- the pipeline's cached extract stage
def test_cached_extract_stage_rechecks_its_store(tmp_path, caplog):
    s = _features(str(tmp_path / "f.zarr"))
    digest = s.manifest()["digest"]
    assert features_intact(s.uri, digest)
    bad = _chunk(s.uri, "features", 2)
    shutil.copy(_chunk(s.uri, "features", 0), bad)  # another chunk's valid bytes
    with caplog.at_level(logging.WARNING, logger="capflow.pipeline"):
        assert not features_intact(s.uri, digest)  # the digest is unchanged: only the values tell
    assert str(bad) in caplog.text
    FeatureStore.open(s.uri, mode="r+").verify(repair=True)
    assert not features_intact(s.uri, digest)  # chunk 2 pending: the digest moved
    assert not features_intact(str(tmp_path / "gone.zarr"), digest)


# ---------------------------------------------------------------------- capflow verify
@pytest.fixture
def workdir(tmp_path):
    """A workdir with a feature store, a label store, stage records and checkpoints, all sound."""
    w = tmp_path / "work"
    feats = _features(str(w / "features" / "abc.zarr"))
    labels = str(w / "runs" / "vocab-1" / "labels.zarr")
    LabelStore.create(labels, np.arange(15, dtype=np.int32).reshape(5, 3), np.full(5, 3), np.arange(5),
                      np.arange(5), np.zeros(5), chunk=2)
    ckpt = checkpoint.save(w / "runs" / "teacher-1" / "best.pt", model=torch.nn.Linear(4, 3), arch={})
    cache = StageCache(w)
    cache.put("extract", "e" * 64, FeaturesRef(run_id="", uri=feats.uri, digest=feats.manifest()["digest"], ok=5,
                                               rejected=0))
    cache.put("vocab", "v" * 64, LabelsRef(run_id="", vocab_path=str(w / "runs" / "vocab-1" / "vocab.json"),
                                           labels_uri=labels, labels_digest="x", vocab_digest="v",
                                           features_uri=feats.uri, features_digest="f"))
    cache.put("seqkd", "s" * 64, SeqKDRef(run_id="", source="seqkd:1", labels_digest="y"))
    cache.put("teacher", "t" * 64, TeacherRef(run_id="", checkpoint=str(ckpt), checkpoint_digest="0" * 64,
                                              best_val_cider=0.0))  # stale digest
    lw = w / "models" / "lw"
    cache.put("student-lw", "l" * 64, StudentResult(
        student="lw", preset="lw-1x", run_id="", metrics={}, params=1, latency_ms=1.0, novel_fraction=0.0,
        avg_length=1.0, unique_fraction=1.0, model_version=None, test_set="t", checkpoint=str(lw / "model.pt"),
        predictions=str(lw / "predictions.json"), references=str(lw / "references.json")))
    return w, feats.uri, labels, ckpt, cache


def _verify(capsys, w, *extra):
    rc = main(["verify", "--set", f"run.workdir={w}", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def _states(doc):
    return {(f["kind"], Path(f["path"]).name): f["state"] for f in doc["findings"]}


def test_verify_finds_names_and_repairs_damage(capsys, workdir):
    w, feats, _labels, ckpt, cache = workdir
    rc, doc = _verify(capsys, w)
    assert rc == 1 and doc["damaged"] == 1  # only the teacher record, whose checkpoint digest is stale
    assert _states(doc)[("stage record", cache.path("teacher", "t" * 64).name)] == "damaged"
    assert all(f["state"] == "ok" for f in doc["findings"] if f["kind"] != "stage record")
    assert main(["verify", "--set", f"run.workdir={w}", "--repair", "--json"]) == 0
    capsys.readouterr()
    assert not cache.path("teacher", "t" * 64).exists()

    shutil.copy(_chunk(feats, "features", 0), _chunk(feats, "features", 1))  # another chunk's valid bytes
    _truncate(_chunk(feats, "boxes", 2), 0.3)
    _truncate(cache.path("student-lw", "l" * 64))
    _truncate(ckpt)
    rc, doc = _verify(capsys, w)
    assert rc == 1 and doc["damaged"] == 3
    store = next(f for f in doc["findings"] if f["kind"] == "feature store")
    assert store["state"] == "damaged"
    assert str(_chunk(feats, "features", 1)) in store["detail"] and str(_chunk(feats, "boxes", 2)) in store["detail"]
    assert f"capflow verify --repair {feats}" in store["action"]
    assert FeatureStore.open(feats).pending_chunks() == []  # nothing changed without --repair

    rc, doc = _verify(capsys, w, "--repair")
    assert rc == 0 and doc["damaged"] == 0 and doc["repaired"] == 3
    assert FeatureStore.open(feats).pending_chunks() == [1, 2]  # re-extracted by the next extract / run
    assert not ckpt.exists() and not cache.path("student-lw", "l" * 64).exists()
    assert not cache.path("extract", "e" * 64).exists()  # the cached stage cannot hide the re-extraction
    assert cache.path("vocab", "v" * 64).exists()
    rc, doc = _verify(capsys, w)
    assert rc == 0 and {f["state"] for f in doc["findings"]} == {"ok"}


def test_verify_rebuilds_a_damaged_label_store(capsys, workdir):
    w, _feats, labels, _ckpt, cache = workdir
    shutil.copy(_chunk(labels, "tokens", 0), _chunk(labels, "tokens", 1))
    rc = main(["verify", labels])
    out = capsys.readouterr().out
    assert rc == 1 and "DAMAGED" in out and str(_chunk(labels, "tokens", 1)) in out
    rc, _doc = _verify(capsys, w, "--repair")
    assert rc == 0
    assert not Path(labels).exists()  # rebuilt by the vocab stage, whose record goes; SeqKD captions lived in it
    assert not cache.path("vocab", "v" * 64).exists() and not cache.path("seqkd", "s" * 64).exists()
    assert cache.path("extract", "e" * 64).exists()


def test_verify_records_checksums_of_an_older_store(capsys, tmp_path):
    import zarr

    s = _features(str(tmp_path / "old.zarr"))
    g = zarr.open_group(s.uri, mode="r+")
    del g["checksum"]  # written before capflow recorded checksums
    del g.attrs["checksums"]
    rc = main(["verify", s.uri])
    out = capsys.readouterr().out
    assert rc == 0 and "UNVERIFIED" in out and "3 finished chunks have no checksum" in out
    assert main(["verify", "--repair", s.uri]) == 0
    assert "recorded checksums for 3 chunks" in capsys.readouterr().out
    assert FeatureStore.open(s.uri).verify().checked == 3


def test_verify_without_a_workdir_is_a_clear_error(capsys, tmp_path):
    assert main(["verify", "--set", f"run.workdir={tmp_path / 'none'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
