"""Measuring one scale-bench stage in a fresh child process (time, CPU, peak resident memory, bytes written and
output bytes), the machine's load while it ran (:class:`LoadWindow`), and the moto S3 endpoint the ``loader-s3``
stage reads from.

The child (:func:`child`, run by ``python -m captioning.bench.scale SPEC``) imports the stage's modules first,
waits until the threads they started are idle, resets the peak resident memory (``/proc/self/clear_refs``), then
times the stage's call.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from captioning.bench.machine import status_mb

NOISY_CORES = 0.25  # other processes using more than this many cores on average mark a measurement noisy

__all__ = ["NOISY_CORES", "LoadWindow", "MotoEndpoint", "busy_cpu_seconds", "child", "spawn", "tree_bytes"]


def tree_bytes(path: str | Path) -> int:
    """Bytes of the file at ``path``, or of every file under the folder at ``path`` (0 when neither)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def _io_write_bytes() -> int | None:
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - not Linux, or no task I/O accounting
        pass
    return None


def _reset_peak() -> bool:
    """Reset this process's peak resident memory (``VmHWM``) to its current resident memory (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:  # pragma: no cover - not Linux, or not allowed
        return False


def _quiesce(limit: float = 1.0) -> None:
    """Wait (at most ``limit`` seconds) until the process uses no CPU while its main thread sleeps: native threads
    started by the imports (BLAS pools spin for a while) would otherwise be counted in the stage's CPU time."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        c0 = time.process_time()
        time.sleep(0.02)
        if time.process_time() - c0 < 0.002:
            return


def child(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Run one stage in this process (fresh): imports first, then the timed call; seconds, memory, bytes."""
    for m in spec.get("imports", ()):
        importlib.import_module(m)
    mod, fn = spec["func"].split(":")
    func = getattr(importlib.import_module(mod), fn)
    _quiesce()
    reset = _reset_peak()
    start_rss = status_mb("VmRSS")
    io0 = _io_write_bytes()
    c0, t0 = time.process_time(), time.perf_counter()
    counts = dict(func(spec["params"]) or {})
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = status_mb("VmHWM")
    io1 = _io_write_bytes()
    outputs = counts.pop("outputs", [])
    return {"seconds": seconds, "cpu_seconds": cpu, "start_rss_mb": start_rss, "peak_rss_mb": peak, "peak_reset": reset,
            "write_bytes": (io1 - io0) if io0 is not None and io1 is not None else None,
            "output_bytes": sum(tree_bytes(o) for o in outputs), "counts": counts}


def spawn(spec: Mapping[str, Any], env: Mapping[str, str] | None = None, timeout: float | None = None
          ) -> dict[str, Any]:
    """Run ``spec`` (``func``, ``imports``, ``params``) through :func:`child` in a fresh Python process; its
    result."""
    repo = str(Path(__file__).resolve().parents[3])
    full_env = {**os.environ, **(env or {}),
                "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "captioning.bench.scale", json.dumps(spec)], capture_output=True,
                          text=True, check=False, env=full_env, timeout=timeout, cwd=repo)
    if proc.returncode != 0:
        raise RuntimeError(f"stage {spec['func']} failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine (every CPU ``/proc/stat`` lists; in a container, the host's) has been busy
    since boot: user + nice + system + irq + softirq + steal (guest time is inside user). None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:  # pragma: no cover - not Linux
        return None
    if not fields or fields[0] != "cpu":  # pragma: no cover
        return None
    ticks = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children waited for (the measured child and what it waited for)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class LoadWindow:
    """The machine's load around one measured child run: :meth:`start` before it is spawned, :meth:`stop` after it
    was waited for. ``others_cpu_per_s`` = (CPU seconds the whole machine was busy - those of this process and its
    waited-for children) / wall seconds: the average cores other processes used meanwhile (``/proc/stat`` counts
    in 1/100 s ticks per CPU: about +-0.02 cores per CPU over a 1 s window). ``loadavg_start``: the 1-minute load
    average when it started (it includes the bench's own previous runs)."""

    def __init__(self, threshold: float = NOISY_CORES) -> None:
        self.threshold = threshold
        self.busy0: float | None = None
        self.own0 = self.t0 = 0.0
        self.load0: float | None = None

    def start(self) -> None:
        try:
            self.load0 = os.getloadavg()[0]
        except OSError:  # pragma: no cover - not available
            self.load0 = None
        self.busy0, self.own0, self.t0 = busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        busy1, own1 = busy_cpu_seconds(), _own_cpu_seconds()
        if self.busy0 is None or busy1 is None or wall <= 0:  # pragma: no cover - not Linux
            return {"others_cpu_per_s": None, "loadavg_start": self.load0, "window_seconds": wall, "noisy": None}
        machine, own = busy1 - self.busy0, own1 - self.own0
        others = max(0.0, machine - own) / wall
        return {"others_cpu_per_s": others, "machine_cpu_seconds": machine, "own_cpu_seconds": own,
                "loadavg_start": self.load0, "window_seconds": wall, "noisy": others > self.threshold}


class MotoEndpoint:
    """A moto S3 server on 127.0.0.1 with throw-away credentials, for the ``loader-s3`` stage."""

    def __init__(self, bucket: str = "capflow-bench"):
        self.bucket = bucket
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def start(self, timeout: float = 60.0) -> None:
        exe = Path(sys.executable).with_name("moto_server")
        if not exe.exists():
            found = shutil.which("moto_server")
            if found is None:
                raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
            exe = Path(found)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
        endpoint = f"http://127.0.0.1:{port}"
        self.env = {"AWS_ACCESS_KEY_ID": "bench-" + secrets.token_hex(4),
                    "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16), "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL_S3": endpoint}
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on {endpoint}") from None
                time.sleep(0.3)
        req = urllib.request.Request(f"{endpoint}/{self.bucket}", method="PUT")  # moto accepts unsigned requests
        with urllib.request.urlopen(req, timeout=10):
            pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
