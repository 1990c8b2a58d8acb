"""A task that fails on one of capflow's expected errors (here: an annotation file that is not JSON) leaves one line
in the log, not Prefect's traceback, and is not retried (the same input fails the same way); ``capflow -v`` shows the
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    bad = tmp_path / "bad.json"
    bad.write_text('{"images": [\n')
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, "-m", "flows.cli", *extra, "run", "--preset", "tiny", "--set",
                           f"run.workdir={tmp_path / 'w'}", "--set", f"dataset.annotations={bad}", "--set",
                           f"dataset.images={tmp_path}"], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_an_expected_task_failure_is_one_line_and_not_retried(tmp_path):
    out = _run(tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr
    assert "Traceback" not in err and "Retry 1/1" not in err, err[-3000:]
    failed = [line for line in err.splitlines() if "prefect.task_runs" in line and "Failed" in line]
    assert len(failed) == 1 and "is not valid JSON" in failed[0]
    assert err.strip().splitlines()[-2].startswith("capflow run: error: annotation file")


def test_verbose_keeps_the_traceback(tmp_path):
    out = _run(tmp_path, "-v")
    assert out.returncode == 2 and "Traceback" in out.stderr
