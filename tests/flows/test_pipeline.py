"""The whole DAG at tiny scale under a Prefect test harness with a temporary MLflow store: runs, lineage,
artifacts, registry alias, planted bad input, cached re-run, partial re-run, kill-and-resume."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from captioning.data.synthetic import generate_synthetic
from captioning.training import checkpoint
from flows.pipeline import pipeline

pytestmark = pytest.mark.slow
STUDENTS = {"acort": "acort-base", "expansionnet": "expansionnet", "lw": "lw-1x", "satic": "satic-k4",
            "zodiac": "zodiac-sigmoid"}
FAKE_SECRET = "capflow-test-not-a-real-secret-42"


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """40 synthetic images with a truncated image, a missing image and an empty caption planted."""
    out = tmp_path_factory.mktemp("planted")
    ann = generate_synthetic(out, 40, 1, min_size=64, max_size=112)
    d = json.loads(ann.read_text())
    imgs = [e for e in d["images"] if e["split"] == "train"]
    bad = out / "images" / imgs[0]["filepath"] / imgs[0]["filename"]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 3])
    (out / "images" / imgs[1]["filepath"] / imgs[1]["filename"]).unlink()
    imgs[2]["sentences"][0]["tokens"], imgs[2]["sentences"][0]["raw"] = [], "   "
    ann.write_text(json.dumps(d))
    return ann, out / "images", (imgs[0]["cocoid"], imgs[1]["cocoid"])


def _overrides(work, ann, images):
    return [f"run.workdir={work}", f"dataset.annotations={ann}", f"dataset.images={images}",
            "dataset.max_reject_fraction=0.2"]


def test_pipeline_end_to_end_lineage_cache_and_partial_rerun(harness, planted, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    ann, images, bad_ids = planted
    res = pipeline(preset="tiny", overrides=_overrides(tmp_path, ann, images))
    assert res["failed"] == [] and {r["student"] for r in res["leaderboard"]} == set(STUDENTS)
    ciders = [r["metrics"]["CIDEr"] for r in res["leaderboard"]]
    assert ciders == sorted(ciders, reverse=True)
    assert all(r["params"] > 0 and r["latency_ms"] > 0 and r["metrics"]["SPICE"] is None for r in res["leaderboard"])
    assert res["champion"]["changed"] and res["champion"]["version"] == res["leaderboard"][0]["model_version"]
    assert all(v == "ran" for v in res["stages"].values())
    # every stage's wall time in this run, in the summary
    assert set(res["seconds"]) == {"ingest", "extract", "vocab", "teacher", "seqkd", "leaderboard", "promote",
                                   *(f"student-{n}" for n in STUDENTS)}
    assert all(v > 0 for v in res["seconds"].values())
    # the most-frequent-caption baseline on the same test split, beside the students
    base = res["baseline"]
    from collections import Counter

    from captioning.data.karpathy import Dataset

    ds = Dataset.load(next((tmp_path / "datasets").glob("dataset-*.parquet")))
    counts = Counter(c for e in ds.split("train") for c in e.captions)
    assert counts[base["caption"]] == max(counts.values())
    assert 0 <= base["metrics"]["CIDEr"] < 10 and "METEOR" not in base["metrics"]

    c = MlflowClient(res["tracking_uri"])
    parent = c.get_run(res["mlflow_run_id"])
    assert parent.data.tags["prefect.flow_run_id"] and len(parent.data.tags["git_commit"]) >= 7
    assert parent.data.tags["config_digest"] and parent.data.params["students.names"]
    # the planted faults are counted in the parent run and listed in an artifact
    assert parent.data.metrics["rejected_images"] == 2 and parent.data.metrics["dropped_captions"] == 1
    arts = {a.path for a in c.list_artifacts(parent.info.run_id)}
    assert {"leaderboard.json", "leaderboard.md", "leaderboard.png", "rejects.json", "config.yaml",
            "promotion.json"} <= arts
    assert parent.data.metrics["baseline_test_CIDEr"] == pytest.approx(base["metrics"]["CIDEr"])
    rejects = json.loads(Path(c.download_artifacts(parent.info.run_id, "rejects.json", str(tmp_path / "dl"))
                              ).read_text())
    assert {r["image_id"] for r in rejects["rejected"]} == set(bad_ids) and len(rejects["dropped_captions"]) == 1

    runs = c.search_runs([res["experiment_id"]], max_results=500)
    children = {r.data.tags.get("mlflow.runName"): r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"ingest", "extract", "vocab", "teacher", "seqkd", *STUDENTS.values()}
    for name, pname in STUDENTS.items():
        srun = children[pname]
        assert srun.data.metrics["test_CIDEr"] == next(r["metrics"]["CIDEr"] for r in res["leaderboard"]
                                                       if r["student"] == name)
        nested = {r.data.tags["mlflow.runName"] for r in runs if r.data.tags.get("mlflow.parentRunId") ==
                  srun.info.run_id}
        assert nested == {"scst", "evaluate"}
        assert len(c.get_metric_history(srun.info.run_id, "loss")) == 1  # tiny: 1 XE epoch, logged per epoch
        inputs = {d.dataset.name: d.dataset.digest for d in srun.inputs.dataset_inputs}
        assert {"dataset", "features", "labels"} <= set(inputs)
        if name == "satic":
            assert {"seqkd-captions", "teacher-checkpoint"} <= set(inputs)
            assert srun.data.params["init_from_teacher"] == "true" and srun.data.metrics["init_loaded"] > 0
        # the student's model is an MLflow Model: a LoggedModel output of its run, with the test metrics linked
        (out,) = srun.outputs.model_outputs
        lm = c.get_logged_model(out.model_id)
        assert lm.source_run_id == srun.info.run_id and lm.tags["capflow.student"] == name
        linked = {m.key: m for m in lm.metrics}
        assert linked["test_CIDEr"].value == srun.data.metrics["test_CIDEr"]
        assert linked["test_CIDEr"].dataset_name == "dataset" and linked["test_CIDEr"].dataset_digest == \
            inputs["dataset"]
    teacher_inputs = {d.dataset.name for d in children["teacher"].inputs.dataset_inputs}
    assert teacher_inputs == {"dataset", "features", "labels"}
    (teacher_out,) = children["teacher"].outputs.model_outputs  # the teacher is an MLflow Model too, not registered
    teacher_model = c.get_logged_model(teacher_out.model_id)
    assert teacher_model.tags["capflow.student"] == "teacher" and {m.key for m in teacher_model.metrics} == \
        {"best_val_CIDEr"}
    # registry: one version per student, made from its LoggedModel; champion = best
    versions = c.search_model_versions("name='capflow-captioner'")
    assert len(versions) == 5
    logged = {m.model_id: m for m in c.search_logged_models([res["experiment_id"]])
              if m.tags["capflow.student"] != "teacher"}
    assert len(logged) == 5 and {v.source for v in versions} == {f"models:/{m}" for m in logged}
    champ = c.get_model_version_by_alias("capflow-captioner", "champion")
    assert str(champ.version) == res["champion"]["version"]
    assert champ.tags["student"] == res["leaderboard"][0]["student"]
    # no secret from the environment anywhere in params or tags
    for r in runs:
        assert FAKE_SECRET not in json.dumps(r.data.params) + json.dumps(r.data.tags)

    # re-run with nothing changed: every stage cached, same results, champion unchanged
    t0 = time.perf_counter()
    again = pipeline(preset="tiny", overrides=_overrides(tmp_path, ann, images))
    assert all(v == "cached" for v in again["stages"].values()), again["stages"]
    assert again["leaderboard"] == res["leaderboard"] and not again["champion"]["changed"]
    assert time.perf_counter() - t0 < 60

    # a changed student set: only the new student trains, the rest is cached
    part = pipeline(preset="tiny", overrides=_overrides(tmp_path, ann, images), students=["lw", "satic-k2"],
                    scst=True)
    assert part["stages"]["student-satic-k2"] == "ran"
    assert all(v == "cached" for k, v in part["stages"].items() if k != "student-satic-k2")

    # one front door: the single-stage commands find the run's outputs without path flags
    _single_stage_commands_after_the_run(tmp_path, ann, images, res, capsys)
    # new data: a champion scored on another test set is re-scored on this one before a challenger can take over
    _champion_rescored_on_a_changed_test_set(tmp_path, ann, images, res)


def _loads(path: Path) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
        return True
    except OSError:  # the planted truncated image
        return False


def _single_stage_commands_after_the_run(work, ann, images, res, capsys):
    from flows.cli import main

    capsys.readouterr()
    args = ["--preset", "tiny", *(x for o in _overrides(work, ann, images) for x in ("--set", o))]
    vocab_records = sorted((work / "stages").glob("vocab-*.json"))
    # `capflow train --model lw` is the pipeline's student job: found in the stage records, not trained again
    lw = next(r for r in res["leaderboard"] if r["student"] == "lw")
    assert main(["train", "--json", "--model", "lw", *args]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["status"] == "cached" and found["result"]["metrics"] == lw["metrics"]
    assert found["result"]["model_version"] == lw["model_version"]
    assert sorted((work / "stages").glob("vocab-*.json")) == vocab_records  # the pipeline's label store, reused
    # a custom training (its own captions choice) trains in its own folder
    assert main(["train", "--json", "--model", "lw", "--captions", "ground_truth", *args]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["epochs_run"] == 1 and Path(trained["last_checkpoint"]).is_file()
    assert Path(trained["last_checkpoint"]).parent.name.startswith("train-lw-")

    assert main(["evaluate", "--json", "--student", "lw", *args]) == 0
    scored = json.loads(capsys.readouterr().out)
    lw = next(r for r in res["leaderboard"] if r["student"] == "lw")
    assert scored["metrics"]["CIDEr"] == pytest.approx(lw["metrics"]["CIDEr"], abs=1e-9)

    image = next(p for p in sorted(images.rglob("*")) if p.suffix in (".jpg", ".png") and _loads(p))
    assert main(["caption", "--json", "--no-progress", str(image), *args]) == 0  # the run's champion, from MLflow
    (cap,) = json.loads(capsys.readouterr().out)
    assert cap["file"] == str(image) and isinstance(cap["caption"], str)


def test_pipeline_rejects_bad_parameters_before_running(harness, tmp_path):
    from captioning.config import ConfigError

    with pytest.raises(ConfigError, match=r"students\.xe\.epochs"):
        pipeline(preset="tiny", overrides=[f"run.workdir={tmp_path}", "students.xe.epochs=0"])
    with pytest.raises(ValueError, match="unknown student 'nope'"):
        pipeline(preset="tiny", overrides=[f"run.workdir={tmp_path}"], students=["nope"])
    assert not (tmp_path / "stages").exists()


def test_killed_run_resumes_student_from_its_checkpoint(tmp_path):
    """SIGKILL `capflow run` while a student trains; the next run resumes that student and redoes nothing else."""
    sets = [f"run.workdir={tmp_path}", "features.source=synthetic-informative", "features.feature_dim=16",
            "features.min_boxes=1", "students.names=[lw,zodiac]", "students.xe.epochs=4",
            "students.scst.enabled=false"]
    cmd = [sys.executable, "-m", "flows.cli", "run", "--json", "--preset", "tiny",
           *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    zodiac_last = None
    while time.time() < deadline and proc.poll() is None:
        found = list((tmp_path / "runs").glob("student-zodiac-*/xe/last.pt")) if (tmp_path / "runs").exists() else []
        if found:
            zodiac_last = found[0]
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert zodiac_last is not None, "the run finished or stalled before the second student's first epoch"
    done_epoch = checkpoint.load(zodiac_last)["epoch"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["stages"]["student-zodiac"] == "ran"
    assert all(v == "cached" for k, v in res["stages"].items() if k != "student-zodiac"), res["stages"]
    c = MlflowClient(res["tracking_uri"])
    run = next(c.get_run(r["model_version"] and c.get_model_version("capflow-captioner", r["model_version"]).run_id)
               for r in res["leaderboard"] if r["student"] == "zodiac")
    assert run.data.metrics["xe_resumed_from_epoch"] == done_epoch + 1
    # the killed run's MLflow runs were left RUNNING by SIGKILL; the next run ended them KILLED (issue 18, finding 4)
    runs = c.search_runs([res["experiment_id"]], max_results=500)
    assert not [r.data.tags["mlflow.runName"] for r in runs if r.info.status == "RUNNING"]
    killed = {r.data.tags["mlflow.runName"] for r in runs if r.info.status == "KILLED"}
    assert {"pipeline", STUDENTS["zodiac"]} <= killed


def _champion_rescored_on_a_changed_test_set(work, ann, images, res):
    """Promotion after a test-set change, with the run's real stores and models: the champion is re-scored on
    this run's test set by the same evaluation (so exactly its leaderboard CIDEr), a planted challenger just below
    that stays out, one just above takes over; a champion of other feature settings is scored from the images."""
    from captioning.config import load_config
    from tasks.cache import StageCache
    from tasks.common import RunContext
    from tasks.data import extract, ingest, vocab
    from tasks.refs import Leaderboard, Row
    from tasks.report import promote, rescore_champion
    from tasks.tracking import Tracker

    cfg = load_config("tiny", None, _overrides(work, ann, images))
    tr = Tracker(cfg)
    c = tr.client
    version, tags = tr.champion()
    champion = {"model_version": version}
    other = next(r for r in res["leaderboard"] if r["model_version"] != version)
    tr.client.set_model_version_tag("capflow-captioner", version, "test_set", "an-older-test-set")
    cider = float(tags["test_CIDEr"])
    with tr.run("promotion-check") as parent:
        rc = RunContext(cfg, tr, parent, StageCache(cfg.workdir))
        data = ingest(rc)
        feats = extract(rc, data)
        labels = vocab(rc, data, feats)
        planted = Row(student="planted", preset="lw-1x", metrics={"CIDEr": cider - 1e-3}, params=1, latency_ms=1.0,
                      unique_fraction=1.0, distinct_captions=1, repeated_token_rate=0.0, run_id="",
                      model_version=other["model_version"])
        kept = promote(rc, Leaderboard((planted,)), data.digest, data, feats, labels)
        assert not kept.changed and kept.champion_version == champion["model_version"], kept
        assert kept.champion_cider == pytest.approx(cider, abs=1e-9) and "re-scored" in kept.reason
        assert tr.champion()[0] == champion["model_version"]
        # re-scored by the same evaluation: every metric is the one its run recorded on the same test set
        assert kept.rescored == "decoded from this run's feature store"
        recorded = c.get_run(c.get_model_version("capflow-captioner", version).run_id).data.metrics
        again = {k[len("champion_rescored_test_"):]: v for k, v in c.get_run(parent).data.metrics.items()
                 if k.startswith("champion_rescored_test_")}
        assert again["Bleu_1"] > 0 and again == pytest.approx({k: recorded[f"test_{k}"] for k in again}, abs=1e-9)
        # the same champion under other feature settings: its own extraction of the test images
        other_cfg = load_config("tiny", None, [*_overrides(work, ann, images), "features.max_boxes=11"])
        extracted = rescore_champion(RunContext(other_cfg, tr, parent, StageCache(cfg.workdir)),
                                     champion["model_version"], data, feats, labels)
        assert extracted.how.startswith("its own feature settings differ") and extracted.cider >= 0, extracted
        planted = dataclasses.replace(planted, metrics={"CIDEr": cider + 1e-3})
        taken = promote(rc, Leaderboard((planted,)), data.digest, data, feats, labels)
        assert taken.changed and tr.champion()[0] == other["model_version"]
        assert taken.reason.startswith(f"better than the current champion v{champion['model_version']} re-scored")
    record = json.loads(Path(c.download_artifacts(parent, "promotion.json", str(work / "dl-promotion"))).read_text())
    assert record["champion_cider"] == pytest.approx(cider, abs=1e-9) and record["reason"] == taken.reason
