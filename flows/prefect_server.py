"""Prefect-server plumbing of capflow's commands: Prefect's temporary (ephemeral) API server started with a clear
failure and outside capflow's process group; Prefect's "database is locked" tracebacks turned into one-line
warnings, and a task failed by one of capflow's expected errors logged as one line (the traceback with ``-v``).
The flow itself is :mod:`flows.pipeline`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from captioning.errors import InfrastructureError, InputError


class SQLiteLockedFilter(logging.Filter):
    """Turns an ERROR with a traceback about Prefect's SQLite database being busy ("database is locked": Prefect
    retries these itself) into a one-line WARNING, so that a busy local database does not print tracebacks on the
    user's terminal; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        chain, seen = [], set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            chain.append(str(exc))
            exc = exc.__cause__ or exc.__context__
        if "database is locked" not in " ".join([record.getMessage(), *chain]):
            return True
        record.msg, record.args = "Prefect's database was busy (database is locked); the call is retried", ()
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def caused_by(exc: BaseException | None, kind: type | tuple[type, ...] = (InputError, InfrastructureError)) -> bool:
    """Whether ``exc`` or an exception it was raised from is a ``kind`` (default: one of capflow's expected errors -
    bad input or an unavailable service, each already one line that names what to do)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class ExpectedErrorFilter(logging.Filter):
    """A Prefect record that carries one of capflow's expected errors (:func:`caused_by`) keeps its message, which
    names the error, without the traceback; with ``capflow -v`` (the root logger at INFO or below) it keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.name.split(".")[0] == "prefect" and caused_by(record.exc_info[1]) \
                and not logging.getLogger().isEnabledFor(logging.INFO):
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def quiet_prefect_logs(*filters: logging.Filter) -> None:
    """Install :class:`SQLiteLockedFilter` and :class:`ExpectedErrorFilter` (or ``filters``) on every handler of the
    root logger and of Prefect's loggers (filters on handlers see the records of every child logger). Idempotent.
    Prefect's logging is configured first (its console handler is set up when its main module loads), so the
    filters land on the handlers that will print."""
    import prefect.main  # noqa: F401

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
                                      if n.split(".")[0] in ("prefect", "uvicorn", "docket"))]
    for f in filters or _FILTERS:
        for lg in loggers:
            for h in getattr(lg, "handlers", []):
                if f not in h.filters:
                    h.addFilter(f)


_FILTERS = (SQLiteLockedFilter(), ExpectedErrorFilter())


@contextlib.contextmanager
def _server_outside_our_process_group() -> Iterator[None]:
    """Prefect's temporary server is started in a session of its own that dies with this process (Linux parent-
    death signal): a Ctrl-C or a process-group SIGTERM then reaches capflow only, which reports its flow run's end
    to the server and stops it at exit, instead of the server dying first and Prefect waiting on it until the
    grace period ran out; a SIGKILLed capflow still takes the server with it."""
    import ctypes
    import signal as _signal

    from prefect.server.api import server as prefect_server

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the server stays in capflow's process group
        yield
        return

    def die_with_parent() -> None:  # in the child, before exec: one system call
        prctl(1, int(_signal.SIGTERM))  # PR_SET_PDEATHSIG

    real = prefect_server.subprocess.Popen

    def popen(*args: Any, **kwargs: Any):
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("preexec_fn", die_with_parent)
        return real(*args, **kwargs)

    prefect_server.subprocess = _PopenOverride(prefect_server.subprocess, popen)
    try:
        yield
    finally:
        prefect_server.subprocess = prefect_server.subprocess.module


class _PopenOverride:
    """The ``subprocess`` module as Prefect's server module sees it during the start: Popen replaced."""

    def __init__(self, module: Any, popen: Any):
        self.module, self.Popen = module, popen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


class PrefectUnavailable(InfrastructureError, RuntimeError):
    """Prefect's temporary API server did not start."""


def start_prefect_api() -> str | None:
    """Without ``PREFECT_API_URL``, start Prefect's temporary (ephemeral) API server now - the flow would start it
    on its first call - so that a failure says what happened and what to do instead of Prefect's bare
    RuntimeError. The start-up timeout is ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (capflow's
    default 90 s: Prefect's 20 s is too short on a loaded machine). Returns the API URL in use."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    quiet_prefect_logs()
    api = PREFECT_API_URL.value()
    if api or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return api or None
    from prefect.server.api.server import SubprocessASGIServer

    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    server = SubprocessASGIServer()
    try:
        with _server_outside_our_process_group():
            server.start(timeout=timeout)
    except Exception as e:
        server.stop()  # a server still starting is not left behind
        cause = " ".join(str(e).split())
        cause = cause if len(cause) <= 600 else cause[:300] + " ... " + cause[-300:]
        raise PrefectUnavailable(
            f"Prefect's temporary API server did not start within {timeout} s ({cause}). A busy machine is the usual "
            f"cause: allow it longer (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={max(2 * timeout, 180)}), or "
            "run a lasting server once and reuse it: capflow stack up --home DIR, then "
            'eval "$(capflow stack env --home DIR)" and run again') from None
    return server.api_url
