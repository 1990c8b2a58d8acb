"""``capflow stack``: a local Prefect server, MLflow server and S3 endpoint, all on 127.0.0.1.

Start order: S3 endpoint (moto server) -> bucket -> MLflow server (SQLite backend, artifacts proxied to
``s3://<bucket>/mlflow``) -> Prefect server -> Prefect process worker for the ``capflow`` work pool. Stop order is
the reverse (workers before the server, or they hang). State lives in one project-local folder
(``.capflow/stack`` unless ``CAPFLOW_STACK_HOME`` or ``--home`` says otherwise): ``stack.json`` (ports, PIDs,
bucket; mode 0600 because it holds the local endpoint's throw-away credentials), ``logs/``, the MLflow and
Prefect databases, and ``s3/`` - a snapshot of the bucket taken at ``down`` and restored at ``up``, because the
moto server keeps objects in memory only. ``status`` says running / degraded (N of M services healthy) / stopped;
when the S3 endpoint died, ``status`` and ``down`` say that what it held since the last snapshot is lost.

Everything binds 127.0.0.1. Credentials for the local endpoint are random per stack and never logged; against
real servers, credentials come from the environment (see infra/README.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.errors import InputError
from captioning.locks import pid_alive

log = logging.getLogger("capflow.stack")

HOST = "127.0.0.1"
DEFAULT_PORTS = {"s3": 9000, "mlflow": 5000, "prefect": 4200}
WORK_POOL = "capflow"
ORDER = ("s3", "mlflow", "prefect", "worker")


class StackError(InputError, RuntimeError):
    pass


def stack_home(home: str | Path | None = None) -> Path:
    return Path(home or os.environ.get("CAPFLOW_STACK_HOME") or Path.cwd() / ".capflow" / "stack").resolve()


def _bin(name: str) -> str:
    """A console script of this environment (the venv's), falling back to PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise StackError(f"{name} is not installed in this environment (pip install capflow[dev] for moto_server)")
    return found


def port_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _alive(pid: int | None) -> bool:
    if not pid or not pid_alive(pid):
        return False
    try:  # a zombie child of ours counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@dataclass
class Stack:
    """The local stack's configuration and recorded state (``stack.json``)."""

    home: Path
    ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    bucket: str = "capflow"
    pids: dict[str, int] = field(default_factory=dict)
    key_id: str = ""
    secret: str = ""
    started_at: float | None = None

    # ------------------------------------------------------------------ state
    @property
    def state_file(self) -> Path:
        return self.home / "stack.json"

    @classmethod
    def load(cls, home: str | Path | None = None) -> Stack:
        h = stack_home(home)
        f = h / "stack.json"
        if not f.exists():
            return cls(home=h)
        d = json.loads(f.read_text())
        return cls(home=h, ports={**DEFAULT_PORTS, **d.get("ports", {})}, bucket=d.get("bucket", "capflow"),
                   pids={k: int(v) for k, v in d.get("pids", {}).items()}, key_id=d.get("key_id", ""),
                   secret=d.get("secret", ""), started_at=d.get("started_at"))

    def save(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"ports": self.ports, "bucket": self.bucket, "pids": self.pids, "key_id": self.key_id,
                       "secret": self.secret, "started_at": self.started_at}, f, indent=2)
        tmp.replace(self.state_file)

    # ------------------------------------------------------------------ URLs and environment
    @property
    def s3_endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{HOST}:{self.ports['mlflow']}"

    @property
    def prefect_ui(self) -> str:
        return f"http://{HOST}:{self.ports['prefect']}"

    @property
    def prefect_api(self) -> str:
        return f"{self.prefect_ui}/api"

    def s3_env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": self.s3_endpoint,
                "MLFLOW_S3_ENDPOINT_URL": self.s3_endpoint}

    def client_env(self) -> dict[str, str]:
        """What a shell needs to use the stack (``capflow stack env``)."""
        return {"PREFECT_API_URL": self.prefect_api, "MLFLOW_TRACKING_URI": self.mlflow_url,
                "CAPFLOW_STACK_HOME": str(self.home), "CAPFLOW_BUCKET": self.bucket, **self.s3_env()}

    def _service_env(self, name: str) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
            env.pop(k, None)
        env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                    "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_HOME": str(self.home / "prefect"),
                    "MPLCONFIGDIR": str(self.home / "matplotlib"), "PYTHONUNBUFFERED": "1"})
        if name == "s3":
            return env
        env.update(self.s3_env())
        if name == "mlflow":
            env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        if name == "prefect":  # the UI's browser code calls the API at this address
            env["PREFECT_UI_API_URL"] = self.prefect_api
        if name == "worker":
            env.update(self.client_env())
            env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "5")
        return env

    # ------------------------------------------------------------------ services
    def _command(self, name: str) -> list[str]:
        if name == "s3":
            return [_bin("moto_server"), "-H", HOST, "-p", str(self.ports["s3"])]
        if name == "mlflow":
            db = self.home / "mlflow.db"
            return [_bin("mlflow"), "server", "--host", HOST, "--port", str(self.ports["mlflow"]),
                    "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", f"s3://{self.bucket}/mlflow",
                    "--workers", "1"]
        if name == "prefect":
            return [_bin("prefect"), "server", "start", "--host", HOST, "--port", str(self.ports["prefect"])]
        if name == "worker":
            return [_bin("prefect"), "worker", "start", "--pool", WORK_POOL, "--type", "process",
                    "--name", f"capflow-{socket.gethostname()}", "--install-policy", "never"]
        raise ValueError(name)

    def _healthy(self, name: str) -> bool:
        if name == "s3":
            return _http_ok(f"{self.s3_endpoint}/moto-api/")
        if name == "mlflow":
            return _http_ok(f"{self.mlflow_url}/health")
        if name == "prefect":
            return _http_ok(f"{self.prefect_api}/health")
        if name == "worker":
            return self._worker_online()
        raise ValueError(name)

    def _worker_online(self) -> bool:
        req = urllib.request.Request(f"{self.prefect_api}/work_pools/{WORK_POOL}/workers/filter", data=b"{}",
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=3) as r:
                workers = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return any(w.get("status") == "ONLINE" for w in workers)

    def service_status(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name in ORDER:
            pid = self.pids.get(name)
            out[name] = {"pid": pid, "alive": _alive(pid), "healthy": _alive(pid) and self._healthy(name),
                         "log": str(self.home / "logs" / f"{name}.log")}
        return out

    def status(self) -> dict[str, Any]:
        services = self.service_status()
        started = {n: s for n, s in services.items() if s["pid"]}  # services this stack started (--no-worker)
        healthy = [n for n, s in started.items() if s["healthy"]]
        state = ("stopped" if not any(s["alive"] for s in started.values())
                 else "running" if len(healthy) == len(started) else "degraded")
        out = {"running": state == "running", "state": state,
               "healthy": f"{len(healthy)} of {len(started) or len(ORDER)}",
               "prefect_api": self.prefect_api, "mlflow": self.mlflow_url, "s3_endpoint": self.s3_endpoint,
               "bucket": self.bucket, "prefect_ui": self.prefect_ui, "home": str(self.home), "services": services}
        if "s3" in started and not started["s3"]["alive"]:
            out["s3_lost"] = self.s3_loss_note()
        return out

    # the moto server keeps objects in memory: what a dead one took with it
    @property
    def snapshot_dir(self) -> Path:
        return self.home / "s3" / self.bucket

    def snapshot_info(self) -> dict[str, Any]:
        try:
            return json.loads((self.home / "s3" / f"{self.bucket}.snapshot.json").read_text())
        except (OSError, ValueError):
            return {}

    def s3_loss_note(self) -> str:
        snap = self.snapshot_info()
        since = (f"since the snapshot of {snap['time']} ({snap.get('objects', '?')} objects in {self.snapshot_dir})"
                 if snap.get("time") else "since it started (no snapshot was ever taken)")
        return (f"the S3 endpoint (moto, objects in memory only) is not running: the objects written {since} are "
                "lost; MLflow artifacts and feature stores written there since then must be produced again")

    def _start(self, name: str, timeout: float) -> None:
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        logf = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(self._command(name), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self._service_env(name), cwd=self.home, start_new_session=True)
        logf.close()
        self.pids[name] = proc.pid
        self.save()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"{name} exited with code {proc.returncode} while starting; see {logs / name}.log:\n"
                                 + _tail(logs / f"{name}.log"))
            if self._healthy(name):
                log.info("%s up (pid %d)", name, proc.pid)
                return
            time.sleep(0.5)
        raise StackError(f"{name} did not become healthy within {timeout:.0f} s; see {logs / name}.log:\n"
                         + _tail(logs / f"{name}.log"))

    def _stop(self, name: str, grace: float = 20.0) -> None:
        pid = self.pids.pop(name, None)
        if not pid or not _alive(pid):
            self.save()
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(pid):
            time.sleep(0.2)
        if _group_alive(pid):
            log.warning("%s (pid %d) did not stop in %.0f s; killing", name, pid, grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            time.sleep(0.5)
        with contextlib.suppress(ChildProcessError):  # reap it if it is our child (up and down in one process)
            os.waitpid(pid, os.WNOHANG)
        self.save()

    # ------------------------------------------------------------------ up / down
    def up(self, *, worker: bool = True, timeout: float = 90.0) -> dict[str, Any]:
        current = self.service_status()
        if any(s["alive"] for s in current.values()):
            if all(s["healthy"] for n, s in current.items() if worker or n != "worker"):
                return self.status()
            raise StackError(f"a stack in {self.home} is partly running ({_describe(current)}); "
                             "run 'capflow stack down' first")
        names = [n for n in ORDER if worker or n != "worker"]
        busy = [f"{n} port {self.ports[n]}" for n in names if n in self.ports and not port_free(self.ports[n])]
        if busy:
            raise StackError(f"port in use on {HOST}: {', '.join(busy)} - stop whatever listens there or pick "
                             "another port (--s3-port / --mlflow-port / --prefect-port)")
        self.home.mkdir(parents=True, exist_ok=True)
        if not self.key_id:
            self.key_id, self.secret = "local" + secrets.token_hex(6), secrets.token_hex(20)
        self.pids = {}
        self.started_at = time.time()
        self.save()
        try:
            for n in names:
                self._start(n, timeout)
                if n == "s3":
                    self._restore_bucket()
        except BaseException:
            self.down()
            raise
        return self.status()

    def down(self, *, snapshot: bool = True) -> dict[str, Any]:
        """Stop everything. The result says what happened to the bucket: ``s3_kept`` (objects snapshot to disk)
        or ``s3_lost`` (the endpoint was dead, or the snapshot failed: what it held since the last snapshot is
        gone - moto keeps objects in memory only)."""
        s3: dict[str, Any] = {}
        if snapshot and _alive(self.pids.get("s3")):
            try:
                s3["s3_kept"] = {"objects": self._snapshot_bucket(), "snapshot": str(self.snapshot_dir)}
            except Exception as e:  # keep stopping; say what was not kept
                log.error("could not snapshot bucket %s: %s", self.bucket, e)
                s3["s3_lost"] = f"the bucket could not be saved ({type(e).__name__}: {e}); " + self.s3_loss_note()
        elif snapshot and self.pids.get("s3"):  # started by this stack, dead now
            s3["s3_lost"] = self.s3_loss_note()
        for n in reversed(ORDER):
            self._stop(n)
        self.started_at = None
        self.save()
        left = [f"{n}:{p}" for n, p in self.ports.items() if not port_free(p)]
        return {"stopped": True, "ports_still_in_use": left, "runs_killed": self.end_orphaned_runs(), **s3}

    def end_orphaned_runs(self) -> list[str]:
        """With the servers stopped: end KILLED the MLflow runs left RUNNING in the stack's store whose process is
        gone (a killed pipeline or worker) - nothing can write to them any more. Runs of a process that still
        lives stay RUNNING (it ends them itself, or the next run of its pipeline does)."""
        db = self.home / "mlflow.db"
        if not db.is_file():
            return []
        try:
            from mlflow import MlflowClient

            from tasks.tracking import end_orphaned_runs

            client = MlflowClient(f"sqlite:///{db}")
            ids = [e.experiment_id for e in client.search_experiments(max_results=1000)]
            ended = end_orphaned_runs(client, ids, unowned=True, note="capflow stack down: its process was gone")
        except Exception as e:  # stopping has succeeded; say what was not done
            log.error("could not mark the stack's unfinished MLflow runs KILLED (%s): %s", db, e)
            return []
        if ended:
            log.info("marked %d unfinished MLflow run(s) KILLED", len(ended))
        return ended

    # ------------------------------------------------------------------ bucket snapshot (moto keeps memory only)
    def s3_client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.s3_endpoint, aws_access_key_id=self.key_id,
                            aws_secret_access_key=self.secret, region_name="us-east-1",
                            config=Config(retries={"max_attempts": 5, "mode": "standard"}))

    def objects(self, prefix: str = "") -> list[str]:
        s3 = self.s3_client()
        keys: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys

    def _snapshot_bucket(self) -> int:
        s3 = self.s3_client()
        dest = self.snapshot_dir
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        n = 0
        for key in self.objects():
            target = tmp / key
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(self.bucket, key, str(target))
            n += 1
        tmp.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.replace(dest)
        (dest.parent / f"{self.bucket}.snapshot.json").write_text(json.dumps(
            {"time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "objects": n}))
        log.info("bucket %s: %d objects kept in %s", self.bucket, n, dest)
        return n

    def _restore_bucket(self) -> None:
        s3 = self.s3_client()
        s3.create_bucket(Bucket=self.bucket)
        src = self.home / "s3" / self.bucket
        if not src.is_dir():
            return
        n = 0
        for f in sorted(src.rglob("*")):
            if f.is_file():
                s3.upload_file(str(f), self.bucket, f.relative_to(src).as_posix())
                n += 1
        log.info("bucket %s: %d objects restored from %s", self.bucket, n, src)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # only zombies left? (our own un-reaped child)
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().split(")")[-1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _describe(services: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{n}: {'healthy' if s['healthy'] else 'up, unhealthy' if s['alive'] else 'down'}"
                     for n, s in services.items())


def env_lines(stack: Stack) -> str:
    import shlex

    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in stack.client_env().items())
