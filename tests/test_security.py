"""Issue 18, finding 1: nothing from a detector weights file or a model folder runs code.

A malicious pickle (its ``__reduce__`` opens - and so creates - a marker file) is planted as (a) a model folder's
detector weights, (b) the weights named in a config that is extracted with, (c) a registered model version read
through a real local MLflow store; the marker must never appear and the error must name the file and the
forbidden global. A legitimate detectron2-format ``.pkl`` still loads with the same weights, and a model folder's
``capflow.json`` cannot name weights outside the folder or without a recorded sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from captioning.config import load_config
from captioning.data.text import build_vocabulary
from captioning.features.extractor import RegionExtractor
from captioning.inference import CaptionerError, ImageCaptioner
from captioning.models.registry import build
from captioning.safe_pickle import UnsafePickleError, load_detectron2_pkl, safe_load
from captioning.training import checkpoint
from captioning.training.recipe import student_arch
from flows.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(model_config_file="COCO-Detection/faster_rcnn_R_50_C4_3x.yaml", min_size=96, max_size=128,
             proposals=30, conf_threshold=0.0, batch_size=2, device="cpu")


class _Planted:
    """Unpickling this calls ``open(marker, "w")``: the file appearing proves code from the pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: Path, marker: Path, layout: str = "zoo") -> Path:
    """A pickle shaped like detectron2 weights with the payload among the arrays."""
    weights = {"backbone.stem.conv1.weight": np.zeros((4, 3, 3, 3), np.float32), "payload": _Planted(marker)}
    data = {"model": weights, "__author__": "attacker"} if layout == "zoo" else {"blobs": weights}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=2)
    return path


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPFLOW_MODEL_CACHE", str(tmp_path / "model-cache"))
    monkeypatch.setenv("CAPFLOW_WEIGHTS_CACHE", str(tmp_path / "weights-cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PWNED"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _refusal(text: str, path: Path) -> None:
    assert "refused to unpickle" in text and "io.open" in text and str(path) in text, text


# ---------------------------------------------------------------------- the restricted unpickler itself
def test_the_planted_pickle_runs_code_with_plain_pickle(tmp_path, marker):
    """Control: the payload is live (plain pickle.load creates the marker), so the tests below can fail."""
    path = plant(tmp_path / "evil.pkl", marker)
    with open(path, "rb") as f:
        pickle.load(f)
    assert marker.exists()


@pytest.mark.parametrize("layout", ["zoo", "caffe2"])
def test_restricted_unpickler_refuses_the_payload(tmp_path, marker, layout):
    path = plant(tmp_path / "evil.pkl", marker, layout)
    with pytest.raises(UnsafePickleError) as e:
        load_detectron2_pkl(path)
    _refusal(str(e.value), path)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    (os.system, ("true",)),
    (getattr, (np.ndarray, "tofile")),  # an admitted class does not make its attributes reachable
    (shutil.rmtree, ("/nonexistent",)),
])
def test_restricted_unpickler_refuses_any_other_global(tmp_path, payload):
    class P:
        def __reduce__(self):
            return payload

    path = tmp_path / "x.pkl"
    path.write_bytes(pickle.dumps({"model": {"w": P()}, "__author__": "x"}))
    with pytest.raises(UnsafePickleError, match=r"refused to unpickle: it asks for \S+\.(system|getattr|rmtree)"):
        safe_load(path)


def test_object_arrays_and_junk_are_refused(tmp_path):
    obj = tmp_path / "obj.pkl"
    obj.write_bytes(pickle.dumps({"blobs": {"w": np.array([1, None], dtype=object)}}))
    with pytest.raises(UnsafePickleError, match="holds Python objects"):
        load_detectron2_pkl(obj)
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(b"\x80\x02not a pickle at all")
    with pytest.raises(UnsafePickleError, match=f"{junk}: not a readable detector weights pickle"):
        load_detectron2_pkl(junk)
    text = tmp_path / "text.pkl"
    text.write_bytes(pickle.dumps({"model": {"w": "a string"}, "__author__": "x"}))
    with pytest.raises(UnsafePickleError, match=r"weight 'w' is a str, not an array"):
        load_detectron2_pkl(text)


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_plain_arrays_load_in_every_protocol(tmp_path, protocol):
    state = OrderedDict(a=np.arange(6, dtype=np.float32).reshape(2, 3).T, b=np.array([1, 2], dtype=">i8"),
                        c=np.float16(0.5), d=np.zeros((0, 4), np.float64))
    path = tmp_path / "w.pkl"
    path.write_bytes(pickle.dumps({"model": state, "__author__": "me", "meta": [1, "x"]}, protocol=protocol))
    ck = load_detectron2_pkl(path)
    assert ck["__author__"] == "me" and ck["meta"] == [1, "x"] and list(ck["model"]) == list(state)
    for k, v in state.items():
        t = ck["model"][k]
        assert isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), np.asarray(v))
        assert t.numpy().dtype == np.asarray(v).dtype.newbyteorder("=")


def test_caffe2_layout_drops_momentum_and_asks_for_name_matching(tmp_path):
    path = tmp_path / "c2.pkl"
    blobs = {"conv1_w": np.ones((2, 2), np.float32), "conv1_w_momentum": np.ones((2, 2), np.float32)}
    path.write_bytes(pickle.dumps({"blobs": blobs, "cfg": "MODEL: ..."}, protocol=2))
    ck = load_detectron2_pkl(path)
    assert ck["__author__"] == "Caffe2" and ck["matching_heuristics"] is True  # detectron2 renames c2 keys on load
    assert list(ck["model"]) == ["conv1_w"] and torch.equal(ck["model"]["conv1_w"], torch.ones(2, 2))


# ---------------------------------------------------------------------- (b) weights named in a config
@pytest.fixture(scope="module")
def reference() -> RegionExtractor:
    """A small random-weight detector whose weights are written out below as detectron2 ``.pkl`` files."""
    return RegionExtractor(load_config("tiny").features.extractor.model_copy(update={"device": "cpu"}),
                           min_boxes=10, max_boxes=12)


def zoo_pkl(extractor: RegionExtractor, path: Path) -> Path:
    """What a detectron2 model-zoo file holds: numpy arrays under "model", and "__author__"."""
    sd = {k: v.numpy().copy() for k, v in extractor.model.state_dict().items()}
    with open(path, "wb") as f:
        pickle.dump({"model": sd, "__author__": "capflow tests", "matching_heuristics": False}, f, protocol=2)
    return path


def test_legitimate_detectron2_pkl_loads_the_same_weights(reference, tmp_path):
    path = zoo_pkl(reference, tmp_path / "zoo.pkl")
    ex = RegionExtractor(load_config("tiny", overrides=[f"features.extractor.weights={path}",
                                                        "features.extractor.device=cpu"]).features.extractor,
                         min_boxes=10, max_boxes=12)
    assert ex.random_init is False and ex.warnings == []
    assert ex.weights_digest == hashlib.sha256(path.read_bytes()).hexdigest()
    want, got = reference.model.state_dict(), ex.model.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_malicious_pkl_named_in_a_config_is_refused(tmp_path, marker):
    path = plant(tmp_path / "weights" / "model_final.pkl", marker)
    cfg = load_config("tiny", overrides=[f"features.extractor.weights={path}", "features.extractor.device=cpu"])
    with pytest.raises(UnsafePickleError) as e:
        RegionExtractor(cfg.features.extractor, min_boxes=10, max_boxes=12)
    _refusal(str(e.value), path)
    assert not marker.exists()


def test_capflow_extract_with_a_malicious_pkl_in_the_config(capsys, tmp_path, marker):
    """The whole `capflow extract` path (ingest, then detector construction in the extraction workers)."""
    path = plant(tmp_path / "weights" / "model_final.pkl", marker)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"run:\n  workdir: {tmp_path / 'work'}\ndataset:\n  synthetic:\n    num_images: 10\n"
                   f"features:\n  dask_workers: 1\n  max_boxes: 12\n  extractor:\n    weights: {path}\n"
                   "    model_config_file: COCO-Detection/faster_rcnn_R_50_C4_3x.yaml\n    device: cpu\n",
                   encoding="utf-8")
    rc, out, err = run(capsys, "extract", "--config", str(cfg), "--workers", "1", "--json")
    assert rc == 2 and out == ""
    _refusal(err, path)
    assert not marker.exists()


# ---------------------------------------------------------------------- (a) model folders
def _model_folder(folder: Path, features: dict) -> Path:
    torch.manual_seed(0)
    vocab = build_vocabulary([["a", "dog", "on", "grass"], ["a", "cat"]], min_count=1, radix_base=16)
    arch = student_arch("lw", "tiny", vocab, features["feature_dim"], 16)
    return checkpoint.save_model_dir(folder, model=build(arch), arch=arch.to_dict(), vocab=vocab, features=features,
                                     student="lw", preset="lw-tiny", max_words=16, beam=2)


def _features(weights: Path | None) -> dict:
    over = [f"features.extractor.weights={weights}"] if weights else []
    return load_config("tiny", overrides=over).features.model_dump(mode="json")


def test_pipeline_model_folder_bundles_its_weights_with_their_digest(reference, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    src = zoo_pkl(reference, tmp_path / "elsewhere" / "zoo.pkl")
    folder = _model_folder(tmp_path / "model", _features(src))
    ex = json.loads((folder / "capflow.json").read_text())["features"]["extractor"]
    assert ex["weights"] == "detector/zoo.pkl"
    assert ex["weights_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert (folder / "detector" / "zoo.pkl").read_bytes() == src.read_bytes()
    shutil.rmtree(tmp_path / "elsewhere")  # the folder is self-contained
    cap = ImageCaptioner(folder, device="cpu", progress=False)
    assert cap.extractor.weights_path == (folder / "detector" / "zoo.pkl").resolve()
    want, got = reference.model.state_dict(), cap.extractor.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    # the bundled file is checked against the digest recorded at training time
    (folder / "detector" / "zoo.pkl").write_bytes(b"tampered")
    with pytest.raises(CaptionerError, match="sha256 mismatch"):
        ImageCaptioner(folder, device="cpu")


def test_malicious_pkl_in_a_model_folder_is_refused(capsys, tmp_path, marker):
    evil = plant(tmp_path / "incoming" / "model_final.pkl", marker)
    folder = _model_folder(tmp_path / "model", _features(evil))  # bundled + its digest, as a real folder would be
    assert (folder / "detector" / "model_final.pkl").is_file() and not marker.exists()
    with pytest.raises(CaptionerError) as e:
        ImageCaptioner(folder, device="cpu")
    _refusal(str(e.value), folder.resolve() / "detector" / "model_final.pkl")
    rc, out, err = run(capsys, "caption", "any.jpg", "--model", str(folder), "--device", "cpu")
    assert rc == 2 and out == ""
    _refusal(err, folder.resolve() / "detector" / "model_final.pkl")
    assert not marker.exists()


@pytest.mark.parametrize("how", ["absolute", "dotdot", "uri", "symlink", "no-digest", "missing"])
def test_capflow_json_cannot_point_outside_the_folder_or_skip_the_digest(capsys, tmp_path, marker, how):
    evil = plant(tmp_path / "outside" / "model_final.pkl", marker)
    folder = _model_folder(tmp_path / "model", _features(None))
    meta_path = folder / "capflow.json"
    meta = json.loads(meta_path.read_text())
    ex = meta["features"]["extractor"]
    ex["weights_sha256"] = hashlib.sha256(evil.read_bytes()).hexdigest()
    expect = "points outside the model folder"
    if how == "absolute":
        ex["weights"] = str(evil)
    elif how == "dotdot":
        ex["weights"] = "detector/../../outside/model_final.pkl"
    elif how == "uri":
        ex["weights"] = evil.as_uri()
    elif how == "symlink":
        (folder / "detector").mkdir()
        (folder / "detector" / "model_final.pkl").symlink_to(evil)
        ex["weights"] = "detector/model_final.pkl"
    elif how == "no-digest":
        shutil.copytree(evil.parent, folder / "detector")
        ex["weights"], ex["weights_sha256"] = "detector/model_final.pkl", None
        expect = "no weights_sha256 recorded at training time"
    else:
        ex["weights"] = "detector/model_final.pkl"
        expect = "no such file in the model folder"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CaptionerError, match=expect):
        ImageCaptioner(folder, device="cpu")
    rc, _, err = run(capsys, "caption", "any.jpg", "--model", str(folder))
    assert rc == 2 and expect in err and str(meta_path) in err
    assert not marker.exists()


# ---------------------------------------------------------------------- (c) a registry version
def test_malicious_registry_version_is_refused(capsys, tmp_path, monkeypatch, marker):
    """Registered in a real local MLflow store (SQLite + file artifacts), resolved and downloaded by
    ``capflow caption --model models:/...``: the planted weights are never unpickled."""
    from mlflow import MlflowClient

    evil = plant(tmp_path / "incoming" / "model_final.pkl", marker)
    folder = _model_folder(tmp_path / "model", _features(evil))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("capflow-test", artifact_location=(tmp_path / "mlartifacts").as_uri())
    run_id = client.create_run(exp, run_name="lw-tiny").info.run_id
    client.log_artifacts(run_id, str(folder), "model")
    client.set_terminated(run_id)
    client.create_registered_model("capflow-captioner")
    mv = client.create_model_version("capflow-captioner", f"runs:/{run_id}/model", run_id=run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    rc, out, err = run(capsys, "caption", "any.jpg", "--model", f"models:/capflow-captioner/{mv.version}",
                       "--device", "cpu")
    assert rc == 2 and out == ""
    assert "refused to unpickle" in err and "io.open" in err and "model_final.pkl" in err
    downloaded = list((tmp_path / "model-cache").rglob("model_final.pkl"))
    assert downloaded, "the version was downloaded from the registry before it was refused"
    assert not marker.exists()
