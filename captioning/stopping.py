"""A process-wide "please stop" for long work running in any thread.

A signal handler runs in the main thread only; training in a worker thread (the pipeline's students run in
Prefect's thread pool) never sees the exception a handler raises there. :func:`request` (called by the CLI's
SIGTERM/SIGINT handling, or by the flow when Prefect's own handler interrupted it) sets one event; long loops call
:func:`check` between units of work (a training step) and unwind with :class:`Stopped`, which is a
``BaseException``: ``except Exception`` handlers (a student's failure report, retries) let it through, context
managers still clean up (an MLflow run ends KILLED), and the last epoch checkpoint stays the resume point.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

_event = threading.Event()
_signum: list[int] = []
_hooks: list[Callable[[int], None]] = []


class Stopped(BaseException):
    """The process was asked to stop (SIGTERM, SIGINT): unwind, keep what is saved, exit."""

    def __init__(self, signum: int = signal.SIGTERM, where: str = ""):
        self.signum = int(signum)
        try:
            name = signal.Signals(self.signum).name
        except ValueError:
            name = f"signal {self.signum}"
        super().__init__(f"stopped by {name}" + (f" ({where})" if where else ""))


def request(signum: int = signal.SIGTERM) -> bool:
    """Ask every cooperating loop to stop; True the first time. Hooks (e.g. the CLI's grace-period watchdog) run
    once, on the first request."""
    if _event.is_set():
        return False
    _signum.append(int(signum))
    _event.set()
    for hook in list(_hooks):
        hook(int(signum))
    return True


def requested() -> bool:
    return _event.is_set()


def signum() -> int:
    """The signal of the first request (SIGTERM when none was named)."""
    return _signum[0] if _signum else int(signal.SIGTERM)


def check(where: str = "") -> None:
    """Raise :class:`Stopped` if a stop was requested (cheap: call it between steps)."""
    if _event.is_set():
        raise Stopped(signum(), where)


def on_request(hook: Callable[[int], None]) -> None:
    """Run ``hook(signum)`` at the first :func:`request` (registered once per hook)."""
    if hook not in _hooks:
        _hooks.append(hook)


def remove_hook(hook: Callable[[int], None]) -> None:
    if hook in _hooks:
        _hooks.remove(hook)


def reset() -> None:
    """Forget a request (a new command in the same process, tests)."""
    _event.clear()
    _signum.clear()
