"""MLflow's own scoring server for a capflow model, behind capflow's request limits (:mod:`tasks.serving_app`: the
app ``mlflow models serve --env-manager local`` runs, wrapped), as a managed child process: bound to 127.0.0.1 on a
free port, ready when ``/ping`` answers, stopped with its whole process group (uvicorn's workers: none is left
behind). Used by ``capflow bench serve`` and the serving tests."""

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


_ROOT = Path(__file__).resolve().parents[1]  # where uvicorn imports tasks.serving_app from


@contextlib.contextmanager
def mlflow_model_server(model_uri: str, log: Path, *, env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
                        port: int | None = None, timeout: float = 180.0, workers: int = 1) -> Iterator[ModelServer]:
    """The model ``model_uri`` (downloaded first when it is a ``models:/`` or ``runs:/`` URI) served by
    ``uvicorn tasks.serving_app:app`` in this Python environment; yields once it answers ``/ping``. ``env`` is added
    to this process's environment (e.g. ``MLFLOW_TRACKING_URI`` for ``models:/``)."""
    from mlflow.pyfunc.scoring_server import _SERVER_MODEL_PATH

    from tasks.mlflow_models import local_model

    port = port or free_port(host)
    full = {**os.environ, **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    local = local_model(model_uri, log.parent / "model", full.get("MLFLOW_TRACKING_URI"))
    full[_SERVER_MODEL_PATH] = str(local)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--host", host, "--port", str(port), "--workers",
                                 str(workers), "tasks.serving_app:app"], env=full, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=_ROOT)
        try:
            url = f"http://{host}:{port}"
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise ServerError(f"the model server exited with status {proc.returncode}:\n{_tail(log)}")
                with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
                if time.monotonic() > deadline:
                    raise ServerError(f"the model server did not answer /ping within {timeout:.0f}s:\n{_tail(log)}")
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
