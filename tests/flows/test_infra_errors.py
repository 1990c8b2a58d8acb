"""Infrastructure failures as one-line errors (issue 34): a full disk while writing a checkpoint or a store chunk
names the path and "no space left" and leaves no temporary file; an S3 endpoint that does not answer during
``capflow extract`` is named, exit 3 (not 2: the input was fine), no traceback unless ``-v``; training does not
abort because the tracker missed one epoch's metrics."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from captioning.training import checkpoint
from captioning.util import DiskFull


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 64 KiB tmpfs (root only); None where it cannot be mounted (the test then fakes the full disk)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_while_writing_a_checkpoint_names_the_file_and_leaves_no_temp_file(small_disk, tmp_path,
                                                                                     monkeypatch) -> None:
    folder = small_disk or tmp_path / "ckpt"
    last = folder / "last.pt"
    checkpoint.save(last, model=torch.nn.Linear(2, 2), arch={"kind": "small"}, epoch=0)  # fits
    big = torch.nn.Linear(256, 256)  # 257 KiB of weights: more than the disk holds
    if small_disk is None:  # no tmpfs here: the write fails as a full disk's does, after writing some bytes
        real_save = torch.save

        def full(obj, f, *a, **k):
            f.write(b"x" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(torch, "save", full)
    with pytest.raises(DiskFull) as e:
        checkpoint.save(last, model=big, arch={"kind": "big"}, epoch=1)
    msg = str(e.value)
    assert msg.startswith(f"no space left on device writing checkpoint {last} (") and "MiB free there" in msg
    assert e.value.errno == errno.ENOSPC and "unexpected pos" not in msg
    assert sorted(p.name for p in folder.iterdir()) == ["last.pt"]  # the partial temporary file is gone
    if small_disk is None:
        monkeypatch.setattr(torch, "save", real_save)
    assert checkpoint.load(last)["arch"] == {"kind": "small"}  # the previous checkpoint is intact


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # s3fs's and botocore's bounded retries: about 10 s
def test_extract_with_the_s3_endpoint_down_is_one_line_naming_it(tmp_path, monkeypatch, capsys) -> None:
    from flows.cli import main

    port = _closed_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "local")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    args = ["extract", "--preset", "tiny", "--set", f"run.workdir={tmp_path / 'w'}", "--set",
            "features.store=s3://capflow/features", "--set", "features.source=synthetic-informative", "--set",
            "features.feature_dim=16", "--set", "features.min_boxes=1"]
    assert main(args) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"capflow extract: error: the S3 endpoint http://127.0.0.1:{port} does not answer "
                          "(EndpointConnectionError: "), err
    assert "start it (capflow stack up) or fix AWS_ENDPOINT_URL" in err
    assert main(["-v", *args]) == 3  # -v keeps the traceback for debugging
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_extract_with_a_full_disk_names_the_store_folder(small_disk, tmp_path, capsys) -> None:
    if small_disk is None:
        pytest.skip("needs root to mount a small tmpfs (a full disk under zarr's chunk writes cannot be faked "
                    "faithfully)")
    from flows.cli import main

    store = small_disk / "features"
    rc = main(["extract", "--preset", "tiny", "--set", f"run.workdir={tmp_path / 'w'}", "--set",
               f"features.store={store}", "--set", "features.source=synthetic-informative"])
    err = capsys.readouterr().err.strip()
    assert rc == 3, err[-3000:]
    assert err.splitlines()[-1].startswith(f"capflow extract: error: no space left on device writing the feature "
                                           f"store folder {store} ("), err[-2000:]
    assert "Traceback" not in err
    assert not [p for p in small_disk.rglob("*") if p.name.endswith(".tmp") or ".partial" in p.name]


class _FlakyTracker:
    """Fails the first ``failures`` metric calls as tasks.tracking.retry does when the server is down."""

    def __init__(self, failures: int):
        self.failures, self.logged = failures, []

    def metrics(self, run, metrics, step=0, prefix=""):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("MLflow log metrics failed: ConnectionError: connection refused")
        self.logged.append((step, dict(metrics)))


def test_training_goes_on_when_one_epochs_metrics_cannot_be_logged() -> None:
    from types import SimpleNamespace

    from tasks.training import EpochLogger

    tr = _FlakyTracker(failures=1)
    log = EpochLogger(SimpleNamespace(tracker=tr), "run")
    log(0, {"epoch": 0, "loss": 2.0})  # the server is down: kept, training goes on
    log(1, {"epoch": 1, "loss": 1.5})  # back: both epochs are sent, in order
    log.flush()
    assert tr.logged == [(0, {"loss": 2.0}), (1, {"loss": 1.5})]
    down = _FlakyTracker(failures=100)
    log = EpochLogger(SimpleNamespace(tracker=down), "run")
    log(0, {"epoch": 0, "loss": 2.0})
    with pytest.raises(RuntimeError, match="MLflow log metrics failed"):  # still down at the end: the stage fails
        log.flush()


def test_describe_names_the_tracking_server_and_a_full_disk_without_a_file_name(monkeypatch) -> None:
    from flows.cli.failures import describe

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    try:  # what tasks.tracking.retry raises once MLflow stayed down, wrapped by a later stage
        try:
            raise RuntimeError("MLflow set tags failed: MlflowException: API request failed: Connection refused")
        except RuntimeError as inner:
            raise ValueError("leaderboard could not be recorded") from inner
    except ValueError as e:
        msg = describe(e, "run")
    assert msg.startswith("the MLflow tracking server http://127.0.0.1:5999 stopped answering: MLflow set tags "
                          "failed") and "run the same command again" in msg
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # zarr's chunk write names no file
    assert describe(full, "extract", "the feature store folder /data/f").startswith(
        "no space left on device writing the feature store folder /data/f")
    assert describe(ValueError("bad input"), "run") is None  # not the environment: not described here


def test_each_kind_of_capflow_error_ends_with_its_exit_status(monkeypatch, capsys):
    """captioning.errors: refused input -> exit 2, a failed environment -> exit 3, any other CapflowError -> exit 1;
    each with its message on one line and no traceback. Anything else is a bug and propagates."""
    import flows.cli.workdir as workdir_cli
    from captioning.errors import CapflowError, InfrastructureError, InputError
    from flows.cli import main

    for exc, code in ((InputError("the file x is not a dataset"), 2),
                      (InfrastructureError("the server y does not answer"), 3),
                      (CapflowError("model z produced non-finite numbers"), 1)):
        def boom(args, e=exc):
            raise e
        monkeypatch.setattr(workdir_cli, "cmd_config", boom)
        assert main(["config", "keys"]) == code
        err = capsys.readouterr().err
        assert err == f"capflow config: error: {exc}\n", err
    monkeypatch.setattr(workdir_cli, "cmd_config", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["config", "keys"])


def test_every_error_class_of_capflow_has_the_common_base():
    """Every exception class the three packages define derives from CapflowError, except the named internal
    signals that never reach the user."""
    import importlib
    import inspect
    import pkgutil

    from captioning.errors import CapflowError

    internal = {"Stopped", "RecordMismatch", "Rejected", "_StreamOutOfStep", "ImageRejected"}
    missing = []
    for pkg in ("captioning", "tasks", "flows"):
        root = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(root.__path__, f"{pkg}."):
            if info.name.endswith("__main__"):
                continue
            mod = importlib.import_module(info.name)
            for name, obj in vars(mod).items():
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__
                        and not issubclass(obj, CapflowError) and name not in internal):
                    missing.append(f"{mod.__name__}.{name}")
    assert missing == []
