"""Trained captioners as MLflow Models (issue 29): the registered version is a pyfunc *model from code* that MLflow
loads and serves, a LoggedModel of its run with its test metrics on the evaluation dataset, and ``capflow caption``
still reads it (no mocks: a real SQLite tracking store, a real model folder, real COCO images).

The model folder is the ``tiny`` preset's (random-weight R50-C4 detector, there are no detector weights offline)
around an untrained tiny LW student: its captions mean nothing, but they are deterministic, so MLflow's answers are
compared word for word with :class:`captioning.inference.ImageCaptioner`'s and ``capflow caption``'s.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from captioning.config import load_config
from captioning.data.text import build_vocabulary, tokenize
from captioning.inference import ImageCaptioner
from captioning.models.registry import build
from captioning.training import checkpoint
from captioning.training.recipe import student_arch
from tasks.model_refs import resolve_model
from tasks.model_server import mlflow_model_server
from tasks.tracking import Tracker

MAX_WORDS = 12
FILES = ["COCO_val2014_000000078707.jpg", "COCO_val2014_000000165547.jpg", "COCO_train2014_000000057870.jpg"]
TEST_SET = "d" * 64

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPFLOW_MODEL_CACHE", str(tmp_path / "model-cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def images(external) -> list[Path]:
    return [external / "images" / f for f in FILES]


@pytest.fixture(scope="module")
def registered(tmp_path_factory, external, images):
    """A model folder logged as an MLflow Model of a student run, registered and made champion, as the pipeline's
    student job does it (Tracker.log_model, metrics with model_id, Tracker.register)."""
    work = tmp_path_factory.mktemp("mlflow-models")
    features = load_config("tiny").features
    index = json.loads((external / "images" / "index_all.json").read_text(encoding="utf-8"))
    vocab = build_vocabulary([tokenize(c, MAX_WORDS) for e in index for c in e.get("captions") or []],
                             min_count=2, radix_base=16)
    arch = student_arch("lw", "tiny", vocab, features.feature_dim, MAX_WORDS)
    torch.manual_seed(0)
    folder = checkpoint.save_model_dir(work / "model", model=build(arch), arch=arch.to_dict(), vocab=vocab,
                                       features=features.model_dump(mode="json"), student="lw", preset="lw-1x",
                                       max_words=MAX_WORDS, beam=2, test_metrics={"CIDEr": 0.25})
    before = os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        tr = Tracker(load_config("tiny", None, [f"run.workdir={work}"]))
        with tr.run("lw-1x") as run:
            tr.dataset(run, "dataset", TEST_SET, str(work / "dataset.json"), "input")
            model_id = tr.log_model(run, folder, name="lw-1x", example=images[0],
                                    params={"student": "lw", "arch": arch.to_dict()},
                                    tags={"capflow.student": "lw", "capflow.params": 1234})
            tr.metrics(run, {"test_CIDEr": 0.25, "test_Bleu_4": 0.125}, model_id=model_id,
                       dataset=("dataset", TEST_SET))
            version = tr.register(run, "model", {"student": "lw", "test_CIDEr": 0.25, "test_set": TEST_SET},
                                  model_id=model_id)
        tr.set_champion(version)
    finally:
        if before is not None:
            os.environ["MLFLOW_TRACKING_URI"] = before
    return {"uri": tr.uri, "experiment_id": tr.experiment_id, "run_id": run, "model_id": model_id,
            "version": version, "folder": folder}


@pytest.fixture(scope="module")
def reference(registered, images) -> dict[str, list[str]]:
    """ImageCaptioner's captions of FILES from the model folder itself: beam 2 (the folder's) and greedy."""
    cap = ImageCaptioner(registered["folder"], device="cpu", progress=False)
    out = {}
    for beam in (2, 1):
        cap.beam = beam
        res = cap.caption(images)
        assert not res.rejected
        out[f"beam{beam}"] = [c["caption"] for c in res.captions]
    return out


def test_registered_version_is_a_logged_pyfunc_model_from_code_with_metrics_and_dataset(registered, images,
                                                                                       tmp_path):
    c = MlflowClient(registered["uri"])
    mid = registered["model_id"]
    # the LoggedModel: an output of the student run, READY, with its metrics on the evaluation dataset
    (lm,) = c.search_logged_models([registered["experiment_id"]])
    assert lm.model_id == mid and lm.source_run_id == registered["run_id"] and str(lm.status) == "READY"
    assert lm.model_type == "image-captioner" and lm.name == "lw-1x"
    metrics = {m.key: m for m in lm.metrics}
    assert metrics["test_CIDEr"].value == 0.25 and metrics["test_CIDEr"].dataset_name == "dataset"
    assert metrics["test_CIDEr"].dataset_digest == TEST_SET[:36]
    assert lm.tags["capflow.student"] == "lw" and lm.tags["capflow.params"] == "1234"
    assert lm.params["student"] == "lw" and "arch.d_model" in lm.params
    assert json.loads(lm.tags["mlflow.modelVersions"]) == [{"name": "capflow-captioner",
                                                             "version": int(registered["version"])}]
    assert [o.model_id for o in c.get_run(registered["run_id"]).outputs.model_outputs] == [mid]
    # the registered version points at it
    mv = c.get_model_version_by_alias("capflow-captioner", "champion")
    assert mv.source == f"models:/{mid}" and mv.tags["capflow.model_id"] == mid
    # the MLflow Model: pyfunc loaded from code, the capflow folder as artifacts, a real image as input example
    root = Path(c.download_artifacts(registered["run_id"], "", str(tmp_path / "run")))  # nothing duplicated there
    assert not any(root.iterdir())
    import mlflow.artifacts

    got = Path(mlflow.artifacts.download_artifacts(artifact_uri=lm.artifact_location, dst_path=str(tmp_path / "m"),
                                                   tracking_uri=registered["uri"]))
    import yaml

    conf = yaml.safe_load((got / "MLmodel").read_text())
    pyfunc = conf["flavors"]["python_function"]
    assert pyfunc["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    assert (got / pyfunc["model_code_path"].split("/")[-1]).is_file() and "python_model" not in pyfunc
    assert conf["model_id"] == mid and conf["run_id"] == registered["run_id"]
    assert (got / "code" / "captioning" / "inference.py").is_file()  # the library that trained it
    folder = got / pyfunc["artifacts"]["model"]["path"]
    assert (folder / "model.pt").read_bytes() == (registered["folder"] / "model.pt").read_bytes()
    # nothing in the model is a pickle of Python objects: no .pkl/.pickle files, model.pt loads weights-only
    assert not [p for p in got.rglob("*") if p.suffix in (".pkl", ".pickle", ".cloudpickle")]
    checkpoint.load(folder / "model.pt")  # torch.load(weights_only=True)
    example = json.loads((got / "input_example.json").read_text())
    assert base64.b64decode(example["data"][0][0]) == images[0].read_bytes()
    sig = conf["signature"]
    assert json.loads(sig["inputs"]) == [{"type": "binary", "name": "image", "required": True}]
    assert [p["name"] for p in json.loads(sig["params"])] == ["beam", "max_words"]
    reqs = (got / "requirements.txt").read_text().split()
    assert f"torch=={torch.__version__.split('+')[0]}" in {r.split("+")[0] for r in reqs}
    assert any(r.startswith("mlflow==") for r in reqs)


def test_mlflow_loads_the_champion_and_captions_like_the_folder(registered, reference, images, monkeypatch):
    import mlflow.pyfunc
    import pandas as pd
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    model = mlflow.pyfunc.load_model("models:/capflow-captioner@champion")
    batch = pd.DataFrame({"image": [p.read_bytes() for p in images]})
    assert model.predict(batch)["caption"].tolist() == reference["beam2"]
    assert model.predict(batch, params={"beam": 1})["caption"].tolist() == reference["beam1"]
    with pytest.raises(MlflowException, match=r"row 1: not an image"):
        model.predict(pd.DataFrame({"image": [images[0].read_bytes(), b"not an image"]}))
    # capflow caption reads the capflow folder out of the new-style version (old-style runs:/ versions:
    # tests/test_caption.py; the pipeline's own champion: tests/flows/test_pipeline.py)
    folder = resolve_model("models:/capflow-captioner@champion")
    assert (folder / "model.pt").read_bytes() == (registered["folder"] / "model.pt").read_bytes()
    assert {p.name for p in folder.iterdir()} == {"model.pt", "vocab.json", "capflow.json"}


def _huge_png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


@pytest.mark.integration
def test_mlflow_models_serve_answers_captions_and_400_for_bad_input(registered, reference, images, tmp_path):
    env = {"MLFLOW_TRACKING_URI": registered["uri"], "CAPFLOW_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
           "CAPFLOW_MAX_REQUEST_BYTES": str(32 << 20)}
    with mlflow_model_server("models:/capflow-captioner@champion", tmp_path / "serve.log", env=env) as server:
        b64 = [base64.b64encode(p.read_bytes()).decode() for p in images]
        status, body = server.post({"dataframe_split": {"columns": ["image"], "data": [[b] for b in b64]}})
        assert status == 200, body
        assert [p["caption"] for p in body["predictions"]] == reference["beam2"]
        status, body = server.post({"dataframe_records": [{"image": b64[0]}], "params": {"beam": 1}})
        assert status == 200 and body["predictions"] == [{"caption": reference["beam1"][0]}]
        data = images[0].read_bytes()
        bad = {"not an image": [[base64.b64encode(b"not an image").decode()]],
               "truncated": [[base64.b64encode(data[: len(data) // 2]).decode()]],
               "not base64": [["@@not base64!"]],
               "empty": [[""]],
               # a few hundred bytes that decode to more pixels than features.extractor.max_image_pixels
               "oversized": [[base64.b64encode(_huge_png()).decode()]],
               "too many": [[b64[0]]] * 65}
        for what, rows in bad.items():
            status, body = server.post({"dataframe_split": {"columns": ["image"], "data": rows}})
            assert status == 400 and body.get("message"), (what, status, body)
            assert "Traceback" not in body["message"], (what, body)
        status, body = server.post({"dataframe_split": {"columns": ["picture"], "data": [[b64[0]]]}})
        assert status == 400 and "image" in body["message"]
        status, body = server.post({"dataframe_split": {"columns": ["image"], "data": [[b64[0]]]},
                                    "params": {"beam": 99}})
        assert status == 400 and "beam" in body["message"]
        # request limits before MLflow parses anything: a body over CAPFLOW_MAX_REQUEST_BYTES (32 MB here) is 413
        # without being read, a JSON nested 200,000 deep is 400 (MLflow's parser: a RecursionError and a 500)
        status, body = _declare_body(server.url, 300 << 20)  # headers only: answered before a byte of the body is sent
        assert status == 413 and "CAPFLOW_MAX_REQUEST_BYTES" in body["message"]
        status, body = _post_raw(server.url, b"[" * 200_000 + b"]" * 200_000)
        assert status == 400 and "nested too deeply" in body["message"]
        # the server is still there and answers after the bad requests
        status, body = server.post({"dataframe_split": {"columns": ["image"], "data": [[b64[1]]]}})
        assert status == 200 and body["predictions"] == [{"caption": reference["beam2"][1]}]


def _declare_body(url: str, length: int) -> tuple[int, dict]:
    """Send only the headers of a request declaring a ``length``-byte body; the server's answer."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(f"POST /invocations HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode())
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < int(
                raw.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0] if b"content-length: " in raw else 0):
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, body = raw.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _post_raw(url: str, data: bytes) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url}/invocations", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.integration
def test_bench_serve_reports_throughput_and_latency_per_concurrency(registered, images, tmp_path, capsys,
                                                                    monkeypatch):
    import shutil

    from flows.cli import main

    assert main(["bench", "serve", "--json"]) == 2
    assert "bench serve needs --model" in capsys.readouterr().err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    monkeypatch.setenv("CAPFLOW_DEVICE", "cpu")
    folder = tmp_path / "images"
    folder.mkdir()
    for p in images:
        shutil.copy(p, folder / p.name)
    assert main(["bench", "serve", "--json", "--model", "models:/capflow-captioner@champion", "--images-dir",
                 str(folder), "--concurrency", "1,2", "--requests", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "serve" and out["images"] == 3 and out["startup_s"] > 0
    assert [r["concurrency"] for r in out["rows"]] == [1, 2]
    for r in out["rows"]:  # every answer came back, and with the caption the image got when sent alone
        assert (r["ok"], r["errors"], r["wrong_captions"]) == (4, 0, 0)
        assert 0 < r["p50_ms"] <= r["p95_ms"] <= r["max_ms"] and r["requests_per_s"] > 0
    assert out["ratios"]["throughput_c2"] == pytest.approx(out["rows"][1]["requests_per_s"] /
                                                           out["rows"][0]["requests_per_s"])
    assert out["machine"]["device"] == "cpu" and out["machine"]["cpus"] >= 1


def test_a_model_whose_code_is_not_the_installed_library_is_not_served(registered, images, tmp_path, capsys,
                                                                        monkeypatch):
    """MLflow imports a model's ``code/`` when it serves it: whoever can write the registry's artifacts chooses
    that code. The logged model records the library's digest, and `capflow bench serve` refuses a model whose code
    differs from the installed capflow (exit 2, one line) before any server starts."""
    from urllib.parse import urlparse

    from flows.cli import main
    from tasks.mlflow_models import check_model_code, library_digest

    c = MlflowClient(registered["uri"])
    lm = c.get_logged_model(registered["model_id"])
    assert lm.tags["capflow.code_sha256"] == library_digest()
    root = Path(urlparse(lm.artifact_location).path) if "://" in lm.artifact_location else Path(lm.artifact_location)
    assert check_model_code(root) == library_digest()
    planted = root / "code" / "captioning" / "util.py"
    original = planted.read_bytes()
    try:
        planted.write_bytes(original + b"\nimport os  # runs in the server\n")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
        assert main(["bench", "serve", "--json", "--model", "models:/capflow-captioner@champion", "--images-dir",
                     str(images[0].parent), "--requests", "1", "--concurrency", "1"]) == 2
        err = capsys.readouterr().err
        assert "is not the installed capflow library" in err and "--trust-model-code" in err
        assert "Traceback" not in err and sum("error:" in line for line in err.splitlines()) == 1
    finally:
        planted.write_bytes(original)


def test_the_served_model_bounds_what_decoding_costs_before_it_decodes(registered, reference, images, monkeypatch):
    """An image's decoded size (its mode counted: a float TIFF costs 4 bytes a pixel) and a request's total are
    checked on the headers before any pixel is decoded - refused as bad input, not a 12 s, 3 GB decode - and the
    images are decoded before the model is taken (the captions are unchanged)."""
    import io

    import mlflow.pyfunc
    import pandas as pd
    from mlflow.exceptions import MlflowException
    from PIL import Image

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    first = Image.open(images[0])
    w, h = first.size
    monkeypatch.setenv("CAPFLOW_MAX_DECODED_BYTES", str(w * h * 3 + 1))  # the first image (RGB) just fits
    monkeypatch.setenv("CAPFLOW_MAX_REQUEST_DECODED_BYTES", str(2 * w * h * 3))
    model = mlflow.pyfunc.load_model("models:/capflow-captioner@champion")
    assert model.predict(pd.DataFrame({"image": [images[0].read_bytes()]}))["caption"].tolist() == \
        reference["beam2"][:1]
    buf = io.BytesIO()
    Image.new("F", (w, h)).save(buf, format="TIFF", compression="tiff_deflate")  # as many pixels, 4 bytes each
    with pytest.raises(MlflowException, match=rf"row 0: the image decodes to {w * h * 7:,} bytes"):
        model.predict(pd.DataFrame({"image": [buf.getvalue()]}))
    with pytest.raises(MlflowException, match="one request may take: send fewer per request"):
        model.predict(pd.DataFrame({"image": [images[0].read_bytes()] * 3}))


def test_downloading_a_registered_model_leaves_mlflows_global_uris_as_they_were(registered, tmp_path, monkeypatch):
    """``local_model`` points MLflow's process-global URIs at the store for the download and restores all of them:
    MLflow's ``set_registry_uri`` also writes ``MLFLOW_REGISTRY_URI``, and a variable left behind sent every later
    client's registry calls to this store (a model registered elsewhere turned up as another store's champion)."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils

    from tasks.mlflow_models import capflow_folder, local_model

    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    before = mlflow.get_tracking_uri(), registry_utils._registry_uri
    root = local_model("models:/capflow-captioner@champion", tmp_path / "dl", registered["uri"])
    assert capflow_folder(root) is not None
    assert "MLFLOW_REGISTRY_URI" not in os.environ and "MLFLOW_TRACKING_URI" not in os.environ
    assert (mlflow.get_tracking_uri(), registry_utils._registry_uri) == before
    # a client of another store finds its own (empty) registry, not this one's champion
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert MlflowClient(other)._registry_uri == other
