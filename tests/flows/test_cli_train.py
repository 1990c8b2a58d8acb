"""`capflow extract` (informative synthetic features), `capflow train` (XE, SCST, --nproc 2), resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flows.cli import main

SETS = ["dataset.synthetic.num_images=40", "features.source=synthetic-informative", "features.feature_dim=16",
        "features.max_boxes=10", "features.min_boxes=1", "teacher.xe.epochs=2", "students.scst.epochs=1",
        "students.scst.samples=2"]


def _args(tmp_path):
    out = ["--preset", "tiny", "--set", f"run.workdir={tmp_path}"]
    for s in SETS:
        out += ["--set", s]
    return out


def test_train_cli_xe_scst_and_data_parallel(tmp_path, capsys):
    a = _args(tmp_path)
    assert main(["extract", "--json", *a]) == 0
    ext = json.loads(capsys.readouterr().out)
    assert ext["source"] == "synthetic-informative" and ext["images"] == ext["ok"] == 40
    assert main(["vocab", "--json", *a]) == 0
    capsys.readouterr()
    custom = ["--captions", "ground_truth"]  # a custom training, not the recipe's teacher job
    assert main(["train", "--json", *custom, *a]) == 0
    xe = json.loads(capsys.readouterr().out)
    assert xe["epochs_run"] == 2 and xe["processes"] == 1 and "CIDEr" in xe["history"][0]
    # a second call finds the finished run and does not train again
    assert main(["train", "--json", *custom, *a]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["resumed_from_epoch"] == 2 and again["history"] == xe["history"]
    assert main(["train", "--json", "--scst-from", xe["best_checkpoint"], *a]) == 0
    sc = json.loads(capsys.readouterr().out)
    assert sc["epochs_run"] == 1 and "reward" in sc["history"][0]
    assert main(["train", "--json", "--nproc", "2", "--out", str(tmp_path / "ddp"), *a]) == 0
    dp = json.loads(capsys.readouterr().out)
    assert dp["processes"] == 2 and dp["epochs_run"] == 2 and (tmp_path / "ddp" / "last.pt").exists()
    # SCST data-parallel: rank 0 validates the start and every rank takes the same best decision
    assert main(["train", "--json", "--nproc", "2", "--scst-from", xe["best_checkpoint"],
                 "--out", str(tmp_path / "ddp-scst"), *a]) == 0
    ds = json.loads(capsys.readouterr().out)
    assert ds["processes"] == 2 and ds["epochs_run"] == 1 and "reward" in ds["history"][0]
    start_score = torch.load(xe["best_checkpoint"], weights_only=True)["extra"]["metrics"]["CIDEr"]
    assert ds["best_metric"] == max(start_score, ds["history"][0]["CIDEr"])
    assert ds["best_epoch"] == (-1 if start_score >= ds["history"][0]["CIDEr"] else 0)


def test_train_cli_errors(tmp_path, capsys):
    assert main(["train", *_args(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no feature store recorded" in err and "capflow extract" in err and "capflow import-features" in err
    assert main(["train", "--labels", str(tmp_path / "l.zarr"), *_args(tmp_path)]) == 2
    assert "give --labels and --vocab together" in capsys.readouterr().err
    assert main(["train", "--model", "nope", *_args(tmp_path)]) == 2
    assert "unknown student 'nope'" in capsys.readouterr().err
    assert main(["train", "--model", "lw", "--retrain", "--init", "x.pt", *_args(tmp_path)]) == 2
    assert "--retrain applies to the recipe's job; with --init this is a custom training" in capsys.readouterr().err


def test_train_is_the_recipe_job_tracked_only_with_a_tracking_uri(tmp_path, capsys, monkeypatch):
    """`capflow train --model lw` is the pipeline's student job: recorded (a second call finds it, --retrain trains
    it anew); with MLFLOW_TRACKING_URI it leaves a FINISHED `capflow train` run with the student's run and its
    LoggedModel under it; without one, or with --no-track, nothing is tracked anywhere."""
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    a = [*_args(tmp_path), "--set", "students.xe.epochs=1"]
    lw = ["train", "--json", "--model", "lw", "--no-scst"]
    assert main(["extract", "--json", *a]) == 0
    capsys.readouterr()
    assert main([*lw, *a]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["stage"] == "student-lw" and first["status"] == "ran" and first["result"]["model_version"] is None
    assert (Path(first["result"]["checkpoint"]).parent / "capflow.json").is_file()
    assert not list(tmp_path.rglob("*.db")) and not list(tmp_path.rglob("mlartifacts"))  # nothing tracked
    assert main([*lw, *a]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["status"] == "cached" and again["result"] == first["result"]

    uri = f"sqlite:///{tmp_path / 'tracking' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main([*lw, "--retrain", *a]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["status"] == "ran" and res["result"]["model_version"] == "1"
    c = MlflowClient(uri)
    (exp,) = [e for e in c.search_experiments() if e.name != "Default"]
    runs = {r.data.tags["mlflow.runName"]: r for r in c.search_runs([exp.experiment_id])}
    assert set(runs) == {"capflow train", "lw-1x", "evaluate"}
    parent, student = runs["capflow train"], runs["lw-1x"]
    assert parent.info.status == student.info.status == "FINISHED"
    assert parent.data.tags["capflow.command"] == "train" and "config.yaml" in {
        f.path for f in c.list_artifacts(parent.info.run_id)}
    assert student.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.data.tags["stages"] == "ingest=cached,extract=cached,vocab=cached,student-lw=ran"
    (out,) = student.outputs.model_outputs
    model = c.get_logged_model(out.model_id)
    assert model.source_run_id == student.info.run_id and model.tags["capflow.student"] == "lw"
    linked = {m.key: m.value for m in model.metrics}
    assert linked["test_CIDEr"] == pytest.approx(res["result"]["metrics"]["CIDEr"])
    assert c.get_model_version("capflow-captioner", "1").source == f"models:/{out.model_id}"

    # --no-track: no run, even with the tracking URI set
    assert main([*lw, "--retrain", "--no-track", *a]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ran"
    assert len(c.search_runs([exp.experiment_id])) == 3

    # `capflow evaluate` of the student's predictions: a tracked run with the scores
    assert main(["evaluate", "--json", "--student", "lw", *a]) == 0
    scored = json.loads(capsys.readouterr().out)
    ev = [r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("mlflow.parentRunId") and
          c.get_run(r.data.tags["mlflow.parentRunId"]).data.tags["mlflow.runName"] == "capflow evaluate"]
    assert len(ev) == 1 and ev[0].data.metrics["CIDEr"] == pytest.approx(scored["metrics"]["CIDEr"])
    assert {d.dataset.name for d in ev[0].inputs.dataset_inputs} == {"results", "references"}


def test_import_features_then_train_uses_the_imported_store(tmp_path, capsys):
    """`capflow import-features` then `capflow vocab`-less `capflow train`: the imported store (in the
    feature-store folder, recorded) is what the label store points at and what the model trains on."""
    import numpy as np

    from captioning.data.karpathy import Dataset
    from captioning.data.loader import ZarrFeatures

    a = ["--preset", "tiny", "--set", f"run.workdir={tmp_path / 'w'}", "--set", "dataset.synthetic.num_images=40",
         "--set", "features.feature_dim=16", "--set", "features.max_boxes=10", "--set", "features.min_boxes=1",
         "--set", "students.xe.epochs=1"]
    assert main(["ingest", "--json", *a]) == 0
    ds = Dataset.load(json.loads(capsys.readouterr().out)["output"])
    rng = np.random.default_rng(0)
    for sub in ("att", "box"):
        (tmp_path / sub).mkdir()
    for e in ds.images:  # per-image .npy features in the bottom-up layout
        n = int(rng.integers(2, 10))
        np.save(tmp_path / "att" / f"{e.image_id}.npy", rng.normal(size=(n, 16)).astype(np.float32))
        np.save(tmp_path / "box" / f"{e.image_id}.npy", np.sort(rng.uniform(size=(n, 4)), axis=1))
    assert main(["import-features", "--att-dir", str(tmp_path / "att"), "--box-dir", str(tmp_path / "box"),
                 "--json", *a]) == 0
    imported = json.loads(capsys.readouterr().out)["store"]
    assert imported.startswith(str(tmp_path / "w" / "features" / "imported-")) and imported.endswith(".zarr")
    assert main(["train", "--json", "--model", "lw", "--captions", "ground_truth", *a]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["epochs_run"] == 1 and res["processes"] == 1
    ckpt = torch.load(res["last_checkpoint"], weights_only=True)
    assert ckpt["arch"]["d_in"] == 16  # the imported width, not the configured detector's 2048
    # the label store the training used was built on the imported store's rows
    (rec,) = (tmp_path / "w" / "stages").glob("vocab-*.json")
    labels = json.loads(rec.read_text())["result"]
    assert labels["features_uri"] == imported
    assert ZarrFeatures(imported).store.num_rows == len(ds.images)
    assert "/runs/train-lw-" in res["last_checkpoint"]
