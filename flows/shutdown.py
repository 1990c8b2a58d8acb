"""Graceful shutdown of a ``capflow`` command on SIGTERM / SIGINT.

The first signal asks every stage to stop (:mod:`captioning.stopping`: training in any thread ends after its
current step; the last epoch checkpoint is the resume point), interrupts the main thread, and starts a watchdog:
a command that has not exited within the grace period (``CAPFLOW_STOP_GRACE``, default 25 s - under Kubernetes'
30 s before SIGKILL) stops the processes it started (Prefect's temporary server, Dask workers, DDP ranks, JVMs)
and exits at once. A second SIGINT exits at once too; a second SIGTERM only waits for the first to finish (Prefect
re-sends the signal to the previous handler after its flow run ended Crashed). The exit status is 128 + the
signal number (143 for SIGTERM, 130 for SIGINT), after the temporary Prefect server was stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from captioning import stopping

GRACE_ENV = "CAPFLOW_STOP_GRACE"
DEFAULT_GRACE = 25.0
_watchdog: list[threading.Thread] = []


def grace_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, DEFAULT_GRACE)))
    except ValueError:
        return DEFAULT_GRACE


def is_stop(exc: BaseException) -> bool:
    """Whether ``exc`` is a stop request unwinding: ours, Prefect's SIGTERM bridge or a KeyboardInterrupt."""
    return isinstance(exc, stopping.Stopped | KeyboardInterrupt) or type(exc).__name__ == "TerminationSignal"


def exit_status(exc: BaseException) -> int:
    if isinstance(exc, stopping.Stopped):
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt) and not stopping.requested():
        return 128 + signal.SIGINT
    sig = getattr(exc, "signal", None)  # Prefect's TerminationSignal carries it
    if isinstance(sig, int) and not stopping.requested():
        return 128 + sig
    return 128 + stopping.signum()


def children(pid: int | None = None) -> list[int]:
    """Direct child processes of ``pid`` (default: this process), from /proc (Linux; [] elsewhere)."""
    pid = os.getpid() if pid is None else pid
    out: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(name))
    return out


def stop_prefect_servers() -> None:
    """Stop Prefect's temporary API server(s) this process started (idempotent)."""
    mod = sys.modules.get("prefect.server.api.server")
    if mod is None:
        return
    for server in list(getattr(mod.SubprocessASGIServer, "_instances", {}).values()):
        with contextlib.suppress(Exception):
            server.stop()


def prefect_server_gone(signum: int) -> bool:
    """Whether Prefect's temporary server of this process has died (the signal reached its whole process group:
    Ctrl-C in a terminal, systemd): Prefect's exit would then wait for a server that cannot answer. After SIGINT,
    which a terminal sends to the group, it gets 3 s to finish dying."""
    mod = sys.modules.get("prefect.server.api.server")
    if mod is None:
        return False
    for server in list(getattr(mod.SubprocessASGIServer, "_instances", {}).values()):
        proc = getattr(server, "server_process", None)
        if proc is None:
            continue
        with contextlib.suppress(Exception):
            if proc.poll() is None and signum == signal.SIGINT:
                proc.wait(timeout=3)
        if proc.poll() is not None:
            return True
    return False


def exit_now(code: int) -> None:
    """Exit at once with ``code`` (output flushed, logs closed, child processes stopped), skipping the exit
    handlers that would wait on a dead Prefect server."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
    stop_children()
    os._exit(code)


def stop_children(timeout: float = 3.0) -> None:
    """SIGTERM every child process (and, after ``timeout``, SIGKILL what is left)."""
    kids = children()
    for pid in kids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while kids and time.monotonic() < deadline:
        kids = [p for p in kids if _running(p)]
        time.sleep(0.05)
    for pid in kids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _hard_exit(signum: int, grace: float) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"capflow: did not stop within {grace:.0f} s of {signal.Signals(signum).name}: exiting "
                         "now (the processes it started are stopped; the next run resumes from the last "
                         "checkpoints)\n")
        sys.stderr.flush()
    if logging.getLogger().isEnabledFor(logging.INFO):  # capflow -v: where each thread was stuck
        import faulthandler

        faulthandler.dump_traceback(all_threads=True)
    stop_prefect_servers()
    stop_children()
    os._exit(128 + signum)


def _start_watchdog(signum: int) -> None:
    if _watchdog:
        return
    grace = grace_seconds()

    def watch() -> None:
        time.sleep(grace)
        _hard_exit(signum, grace)

    t = threading.Thread(target=watch, name="capflow-stop-watchdog", daemon=True)
    t.start()
    _watchdog.append(t)


def _announce(signum: int) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"capflow: {signal.Signals(signum).name} received: stopping (the current training step "
                         f"finishes; exit within {grace_seconds():.0f} s)\n")
        sys.stderr.flush()


def _handler(signum: int, frame) -> None:
    if stopping.request(signum):
        raise stopping.Stopped(signum)  # interrupts the main thread wherever it waits
    if signum == signal.SIGINT:  # a second Ctrl-C: now
        _hard_exit(signum, 0.0)
    # a second SIGTERM (or Prefect re-sending it after its flow ended): the first one is being handled


def _first_request(signum: int) -> None:
    _announce(signum)
    _start_watchdog(signum)


def exiting(signum: int) -> None:
    """The command is returning because of a stop: make sure the watchdog bounds the rest of the exit (Prefect's
    own SIGTERM handler may have taken the signal, so ours never ran)."""
    stopping.request(signum)
    _start_watchdog(signum)


@contextlib.contextmanager
def graceful() -> Iterator[None]:
    """Handle SIGTERM/SIGINT as above for the block (main thread only; elsewhere a no-op). The previous handlers
    come back afterwards (commands called in-process, tests)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping.reset()
    stopping.on_request(_first_request)
    previous = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        stopping.remove_hook(_first_request)  # a watchdog already started stays armed until the process exits
        for s, h in previous.items():
            signal.signal(s, h)
