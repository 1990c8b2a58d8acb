"""Issue 18, finding 2: a secret never reaches MLflow params/tags/artifacts, config.yaml, logs, warnings or
error messages, and a tracking URI with credentials is refused before anything (Prefect included) records it."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest

from captioning.config import ConfigError, load_config
from captioning.redact import has_credentials, redact, redact_obj
from flows.cli import main

SECRET = "planted-Secret-7f3a9c"


def _files_with_secret(*roots: Path) -> list[str]:
    """Every file under ``roots`` (databases, artifacts, logs, anything) whose bytes hold SECRET."""
    hits = []
    for root in roots:
        for p in Path(root).rglob("*"):
            if p.is_file() and not p.is_symlink() and SECRET.encode() in p.read_bytes():
                hits.append(str(p))
    return hits


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the one redaction
@pytest.mark.parametrize(("text", "want"), [
    (f"http://alice:{SECRET}@host:5000/x", "http://alice:***@host:5000/x"),
    (f"error connecting to https://{SECRET}@github.com/o/r.git: refused",
     "error connecting to https://***@github.com/o/r.git: refused"),
    (f"postgresql://bob:{SECRET}@db:5432/mlflow", "postgresql://bob:***@db:5432/mlflow"),
    (f"s3://b/k?X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}&v=1", "s3://b/k?X-Amz-Credential=***&X-Amz-Signature=***&v=1"),
    (f"http://h/api?token={SECRET}", "http://h/api?token=***"),
    ("http://127.0.0.1:5000/api/2.0/runs?run_id=42 for bob@example.com",
     "http://127.0.0.1:5000/api/2.0/runs?run_id=42 for bob@example.com"),
])
def test_redact_masks_credentials_and_nothing_else(text, want):
    assert redact(text) == want


def test_redact_obj_masks_secret_keys_and_strings_everywhere():
    obj = {"tracking": {"tracking_uri": f"http://a:{SECRET}@h/", "experiment": None},
           "store": [{"aws_secret_access_key": SECRET, "api_token": None}], "n": 3}
    out = redact_obj(obj)
    assert SECRET not in json.dumps(out)
    assert out == {"tracking": {"tracking_uri": "http://a:***@h/", "experiment": None},
                   "store": [{"aws_secret_access_key": "***", "api_token": None}], "n": 3}
    assert has_credentials(f"http://a:{SECRET}@h/") and has_credentials(f"https://{SECRET}@h/")
    assert has_credentials(f"http://h/?access_token={SECRET}")
    assert not has_credentials("http://127.0.0.1:5000") and not has_credentials("sqlite:///tmp/mlflow.db")


# ---------------------------------------------------------------------- credentials in a config: refused
def test_tracking_uri_with_credentials_is_refused_on_every_entry_path(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"http://alice:{SECRET}@127.0.0.1:{_closed_port()}/"
    work = tmp_path / "work"
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides=[f"tracking.tracking_uri={uri}"])
    msg = str(e.value)
    assert SECRET not in msg and "alice:***@" in msg
    assert "MLFLOW_TRACKING_USERNAME" in msg and "MLFLOW_TRACKING_PASSWORD" in msg
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(f"run:\n  workdir: {work}\ntracking:\n  tracking_uri: {uri}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_PASSWORD"):
        load_config(path=cfg_file)
    # `capflow run` refuses before the Prefect flow run (and its parameters) exists; nothing is written
    for argv in (["run", "--preset", "tiny", "--set", f"run.workdir={work}", "--set", f"tracking.tracking_uri={uri}"],
                 ["run", "--config", str(cfg_file)],
                 ["config", "show", "tiny", "--set", f"tracking.tracking_uri={uri}"],
                 ["deploy", "--preset", "tiny", "--set", f"tracking.tracking_uri={uri}"]):
        rc, out, err = run(capsys, *argv)
        assert rc == 2, (argv, err)
        assert SECRET not in out + err and "MLFLOW_TRACKING_PASSWORD" in err
    assert not work.exists()
    cfg_file.unlink()
    assert _files_with_secret(tmp_path, Path(os.environ["PREFECT_HOME"])) == []


def test_a_secret_in_a_config_value_is_never_written_to_mlflow(tmp_path, monkeypatch):
    """What the pipeline writes for its parent run (params, tags, config.yaml, inputs), through the real
    Tracker into a real local MLflow store: then every file of the store and its artifacts is grepped."""
    from mlflow import MlflowClient

    from tasks.tracking import Tracker, config_yaml

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config("tiny", overrides=[f"run.workdir={tmp_path / 'work'}",
                                         f"dataset.annotations=https://alice:{SECRET}@data.example/ann.json",
                                         f"features.store=s3://bucket/features?X-Amz-Signature={SECRET}"])
    tracker = Tracker(cfg)
    parent = tracker.start("pipeline", tags={"source": f"https://{SECRET}@git.example/repo", "api_token": SECRET})
    tracker.params(parent, {**cfg.model_dump(mode="json"), "aws_secret_access_key": SECRET})
    tracker.text_artifact(parent, "config.yaml", config_yaml(cfg))
    tracker.json_artifact(parent, "stage.json", {"uri": f"postgresql://bob:{SECRET}@db/x"})
    tracker.dataset(parent, "dataset", "0" * 64, cfg.dataset.annotations or "", "input", {"token": SECRET})
    tracker.tags(parent, {"note": f"http://carol:{SECRET}@h/", "password": SECRET})
    tracker.end(parent)
    run_ = MlflowClient(tracker.uri).get_run(parent)
    assert run_.data.params["dataset.annotations"] == "https://alice:***@data.example/ann.json"
    assert run_.data.params["features.store"] == "s3://bucket/features?X-Amz-Signature=***"
    assert "aws_secret_access_key" not in run_.data.params and "api_token" not in run_.data.tags
    yaml_text = (Path(tracker.client.download_artifacts(parent, "config.yaml", str(tmp_path)))).read_text()
    assert "annotations: https://alice:***@data.example/ann.json" in yaml_text
    assert _files_with_secret(tmp_path / "work") == []


def test_credentials_in_mlflow_tracking_uri_never_reach_logs_or_errors(tmp_path, monkeypatch, caplog, capsys):
    """The environment's tracking URI may carry credentials (the user's choice); capflow's retry warnings,
    its error and the run's files never show them."""
    from flows.pipeline import run_pipeline

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{SECRET}@127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries are finding 6, not this
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    cfg = load_config("tiny", overrides=[f"run.workdir={tmp_path / 'work'}"])
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tasks.tracking")  # Prefect's logging setup may stop propagation to caplog
    logger.addHandler(handler)
    try:
        with pytest.raises(RuntimeError) as e:
            run_pipeline(cfg)
    finally:
        logger.removeHandler(handler)
    assert "MLflow" in str(e.value) and SECRET not in str(e.value)
    assert e.value.__cause__ is None and e.value.__context__ is None  # MLflow's own message is not chained
    # the preflight's "not reachable ... trying again" and the retry helper's "retrying" warnings
    warnings = [r.getMessage() for r in records if "trying again" in r.getMessage() or "retrying" in r.getMessage()]
    assert warnings, "the retry warnings were logged"
    assert all(SECRET not in w for w in warnings) and any("alice:***@" in w for w in warnings)
    out, err = capsys.readouterr()
    assert SECRET not in caplog.text + out + err
    assert _files_with_secret(tmp_path) == []
