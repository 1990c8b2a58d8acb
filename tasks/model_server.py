"""MLflow's own scoring server for a capflow model (``mlflow models serve --env-manager local``) as a managed child
process: bound to 127.0.0.1 on a free port, ready when ``/ping`` answers, stopped with its whole process group
(the server forks uvicorn workers: none is left behind). Used by ``capflow bench serve`` and the serving tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioning.errors import InfrastructureError


class ServerError(InfrastructureError, RuntimeError):
    """The model server did not start (its log's tail is in the message)."""


@dataclass
class ModelServer:
    url: str
    log: Path
    pid: int

    def post(self, body: Mapping[str, Any], timeout: float = 300.0) -> tuple[int, dict[str, Any]]:
        """POST ``body`` to ``/invocations``; (HTTP status, the JSON answer)."""
        req = urllib.request.Request(f"{self.url}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"message": raw.decode("utf-8", "replace")[:2000]}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-n:]
    except OSError:
        return ""


@contextlib.contextmanager
def mlflow_model_server(model_uri: str, log: Path, *, env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
                        port: int | None = None, timeout: float = 180.0, workers: int = 1) -> Iterator[ModelServer]:
    """``mlflow models serve -m MODEL_URI --env-manager local`` in this Python environment; yields once it answers
    ``/ping``. ``env`` is added to this process's environment (e.g. ``MLFLOW_TRACKING_URI`` for ``models:/``)."""
    port = port or free_port(host)
    bindir = str(Path(sys.executable).parent)  # MLflow starts `uvicorn` from PATH: this environment's
    full = {**os.environ, **(env or {}), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager",
                                 "local", "-h", host, "-p", str(port), "-w", str(workers)], env=full, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://{host}:{port}"
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise ServerError(f"mlflow models serve exited with status {proc.returncode}:\n{_tail(log)}")
                with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
                if time.monotonic() > deadline:
                    raise ServerError(f"mlflow models serve did not answer /ping within {timeout:.0f}s:\n{_tail(log)}")
                time.sleep(0.5)
            yield ModelServer(url=url, log=log, pid=proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
