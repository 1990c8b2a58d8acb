"""Data-parallel training started the way clusters start it (issue 32): `torchrun --nnodes 1 --nproc-per-node 2`
(gloo on CPU, c10d rendezvous on 127.0.0.1) running a stage through capflow's rank function ends with the same
weights as capflow's own launcher (`capflow train --nproc 2`, captioning/training/ddp.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.integration]
BIN = Path(sys.executable).parent


def test_torchrun_two_processes_equal_capflows_launcher(tmp_path, capsys):
    from flows.cli import main

    work = tmp_path / "w"
    args = [x for o in (f"run.workdir={work}", "features.source=synthetic-informative", "features.feature_dim=16",
                        "features.max_boxes=10", "features.min_boxes=1", "students.xe.epochs=2")
            for x in ("--set", o)]
    assert main(["extract", "--json", "--preset", "tiny", *args]) == 0
    capsys.readouterr()
    assert main(["train", "--json", "--model", "lw", "--captions", "ground_truth", "--nproc", "2", "--preset", "tiny",
                 *args]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["processes"] == 2

    job = tmp_path / "job.json"
    out = tmp_path / "torchrun-out"  # its own folder: the launcher's finished one would just be returned
    assert main(["train", "--json", "--model", "lw", "--nproc", "2", "--out", str(out), "--torchrun-job", str(job),
                 "--preset", "tiny", *args]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["job"] == str(job) and written["out"] == str(out) and not out.exists()  # nothing trained yet
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "capflow-test", "-m", "captioning.training.torchrun",
           str(job)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # gloo on loopback (on several nodes: their NIC)
    (tmp_path / "elsewhere").mkdir()  # the launcher's processes start in a directory of their own
    p = subprocess.run(cmd, cwd=tmp_path / "elsewhere", env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((out / "torchrun-result.json").read_text())
    assert res["processes"] == 2 and res["epochs_run"] == own["epochs_run"] == 2
    untimed = [[{k: v for k, v in h.items() if k != "seconds"} for h in r["history"]] for r in (res, own)]
    assert untimed[0] == untimed[1]  # losses, learning rates, validation scores per epoch
    a = torch.load(own["last_checkpoint"], weights_only=True)
    b = torch.load(res["last_checkpoint"], weights_only=True)
    assert a["epoch"] == b["epoch"] and a["step"] == b["step"] > 0
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k


def test_a_job_for_another_world_size_is_refused(tmp_path):
    """A job written for 2 processes under a launch of 1: refused before training (its folder and data shards are
    those of 2 processes)."""
    from captioning.config import load_config
    from captioning.training.recipe import model_plan
    from captioning.training.stages import Inputs
    from captioning.training.torchrun import write_job

    cfg = load_config("tiny", None, [f"run.workdir={tmp_path}"])
    job = write_job(tmp_path / "job.json", model_plan(cfg, "lw"), Inputs("v", "l", "f"), str(tmp_path / "out"), 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    p = subprocess.run([sys.executable, "-m", "captioning.training.torchrun", str(job)], env=env, capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert p.returncode != 0 and "written for 2 processes, this launch has 1" in p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, says", [("{not json", "cannot be read"), ("[1, 2]", "not a capflow training job"),
                                        ('{"format": "capflow-train-job/3"}', "missing")])
def test_a_malformed_job_is_one_line_and_exit_2(tmp_path, capsys, text, says):
    """A damaged or hand-edited job file: exit 2 and one line naming the file, no traceback (before any process
    group is joined)."""
    from captioning.training.torchrun import main

    job = tmp_path / "job.json"
    job.write_text(text, encoding="utf-8")
    assert main([str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {job}:") and says in err and len(err.splitlines()) == 1
