"""``capflow stack status`` / ``down`` tell the truth (issue 34): a stack with one service dead is "degraded
(N of M healthy)", not "not running"; when the in-memory S3 endpoint (moto) died, status and down say that the
objects written since its last snapshot are lost, and a clean down says how many objects it kept. A real moto
server; the dead service is a process that has exited."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flows.stack import HOST, Stack

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_status_and_down_tell_the_truth_about_a_dead_service_and_the_lost_bucket(tmp_path: Path, capsys) -> None:
    from flows.cli import main

    home = tmp_path / "stack"
    st = Stack(home=home, ports={"s3": _free_port(), "mlflow": _free_port(), "prefect": _free_port()},
               bucket="truth", key_id="localtest", secret="not-a-secret")
    st.home.mkdir(parents=True)
    try:
        st._start("s3", 60)
        st._restore_bucket()
        st.s3_client().put_object(Bucket="truth", Key="kept.txt", Body=b"1")
        st.pids["mlflow"] = _dead_pid()  # a service of this stack that died
        st.save()

        assert main(["stack", "status", "--home", str(home)]) == 1
        out = capsys.readouterr().out
        assert f"stack in {home.resolve()}: degraded (1 of 2 services healthy)" in out
        assert "mlflow   stopped" in out and "s3       healthy" in out and "worker   not started" in out

        del st.pids["mlflow"]
        st.save()
        assert main(["stack", "down", "--home", str(home)]) == 0  # the bucket is snapshot to disk
        out = capsys.readouterr().out
        assert f"bucket truth: 1 objects kept in {home.resolve() / 's3' / 'truth'}" in out

        st = Stack.load(home)
        st._start("s3", 60)
        st._restore_bucket()
        st.s3_client().put_object(Bucket="truth", Key="written-after.txt", Body=b"2")
        os.killpg(st.pids["s3"], signal.SIGKILL)  # the in-memory endpoint dies with both objects
        os.waitpid(st.pids["s3"], 0)

        assert main(["stack", "status", "--home", str(home), "--json"]) == 1
        cap = capsys.readouterr()
        res = json.loads(cap.out)
        assert res["state"] == "stopped" and "objects written since the snapshot of" in res["s3_lost"]
        assert "(1 objects in" in res["s3_lost"] and "are lost" in res["s3_lost"]
        assert main(["stack", "down", "--home", str(home)]) == 0
        err = capsys.readouterr().err
        assert err.startswith("capflow stack down: warning: the S3 endpoint (moto, objects in memory only) is not "
                              "running: the objects written since the snapshot of"), err
        assert sorted(p.name for p in (home / "s3" / "truth").iterdir()) == ["kept.txt"]  # the old snapshot stays
    finally:
        for pid in st.pids.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
