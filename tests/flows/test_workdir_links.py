"""Files capflow writes in a workdir are never written through a symbolic link placed there: the workdir lock is
refused with one line naming it (exit 2), the dataset's rejects file is replaced, not followed."""

from __future__ import annotations

import json
import os

from flows.cli import main

ARGS = ["--preset", "learning", "--set", "dataset.synthetic.num_images=12"]


def test_a_linked_lock_file_is_refused_and_its_target_untouched(tmp_path, capsys):
    work = tmp_path / "w"
    work.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, work / "capflow.lock")
    assert main(["ingest", *ARGS, "--set", f"run.workdir={work}"]) == 2
    err = capsys.readouterr().err
    assert "capflow.lock is a symbolic link" in err and "Traceback" not in err
    assert victim.read_text() == "keep me"


def test_a_linked_rejects_file_is_replaced_not_followed(tmp_path, capsys):
    work = tmp_path / "w"
    assert main(["ingest", "--json", *ARGS, "--set", f"run.workdir={work}"]) == 0
    capsys.readouterr()
    (rejects,) = (work / "datasets").glob("rejects-*.json")
    victim = tmp_path / "victim.json"
    victim.write_text("keep me")
    rejects.unlink()
    os.symlink(victim, rejects)
    assert main(["ingest", "--json", *ARGS, "--set", f"run.workdir={work}"]) == 0
    assert victim.read_text() == "keep me"
    assert not rejects.is_symlink() and set(json.loads(rejects.read_text())) >= {"rejected", "dropped_captions"}
