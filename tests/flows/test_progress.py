"""Long commands show their progress on stderr: a bar with rate and time left on a terminal, plain periodic lines in
a pipe, nothing with --quiet (here `capflow ingest` of a synthetic dataset: its images are generated and checked)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cmd(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *extra, "ingest", "--preset", "learning", "--set",
            "dataset.synthetic.num_images=40", "--set", f"run.workdir={tmp_path / 'w'}"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CAPFLOW_QUIET", "CAPFLOW_PROGRESS_EVERY")}
    return {**env, **extra}


def test_a_terminal_sees_a_bar_with_rate_and_time_left(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))  # a terminal 120 columns wide
    p = subprocess.Popen(_cmd(tmp_path), stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=_env(), close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the other end closed
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=120) == 0
    os.close(master)
    out = b"".join(chunks).decode("utf-8", "replace")
    assert "synthetic images: 100%|" in out and "img/s]" in out and "\r" in out  # bar, rate, redrawn in place
    assert "<00:00" in out  # time left


def test_a_pipe_sees_periodic_lines_and_quiet_sees_nothing(tmp_path):
    piped = subprocess.run(_cmd(tmp_path), capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env=_env(CAPFLOW_PROGRESS_EVERY="0"))
    assert piped.returncode == 0, piped.stderr[-2000:]
    lines = [line for line in piped.stderr.splitlines() if line.startswith("synthetic images: ")]
    assert len(lines) >= 2 and "\r" not in piped.stderr
    assert lines[-1].startswith("synthetic images: 40/40 img (100%)") and ", left " in lines[-1]
    default = subprocess.run(_cmd(tmp_path / "d"), capture_output=True, text=True, cwd=ROOT, timeout=120, env=_env())
    assert default.returncode == 0 and "synthetic images:" not in default.stderr  # shorter than the 30 s period
    quiet = subprocess.run(_cmd(tmp_path / "q", "--quiet"), capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env=_env(CAPFLOW_PROGRESS_EVERY="0"))
    assert quiet.returncode == 0 and "synthetic images" not in quiet.stderr and "checking images" not in quiet.stderr
