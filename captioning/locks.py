"""Inter-process locks: one run per workdir, and serialised one-time set-up (a fresh SQLite tracking store).

Both are ``flock`` locks on a small file (``fcntl``; local file systems and NFS through the kernel's emulation).
The kernel drops such a lock when its holder exits, however it exits (SIGKILL, power loss of the process): a
lock file left by a dead run is "stale" only in its content, and the next run simply takes it over. Forked
children (data-loader workers) close their inherited copy at once, so they never keep a dead run's lock.

:func:`hold_workdir` never waits: a second run on a workdir stops at once with :class:`WorkdirBusy`, whose one-line
message names the holder (command, pid, host, start time). The holder's details are written into the lock file
(``<workdir>/capflow.lock``, JSON) after it took the lock and cleared when it lets go (a workdir the lock created
and nothing else wrote into is removed again). Within one process the lock is re-entrant (``capflow run`` takes it
before Prefect starts, the flow again for runs started by a worker).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from captioning.errors import InfrastructureError, InputError

log = logging.getLogger(__name__)
LOCK_NAME = "capflow.lock"


class LockFileLink(InputError, RuntimeError):
    """A lock file is a symbolic link: capflow never writes through one (it would truncate the link's target)."""


def _open_lock_file(path: str | Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LockFileLink(f"{path} is a symbolic link, which capflow does not write through: remove it (capflow "
                               "creates the lock file itself)") from None
        raise


class WorkdirBusy(InfrastructureError, RuntimeError):
    """Another process holds the workdir's lock (a second run would do every stage twice)."""


_guard = threading.Lock()
_held: dict[str, list[Any]] = {}  # realpath of the lock file -> [fd, depth]


def _close_in_child() -> None:
    """After fork: the child's copies of held lock descriptors are closed, so a forked worker that outlives the
    run does not keep the workdir locked (the parent's own descriptor still holds the lock)."""
    for entry in list(_held.values()):
        with contextlib.suppress(OSError):
            os.close(entry[0])
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def holder_info(path: Path) -> dict[str, Any]:
    """What the lock file says about its holder ({} when empty or unreadable)."""
    try:
        text = path.read_text(encoding="utf-8")
        info = json.loads(text) if text.strip() else {}
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_holder(info: dict[str, Any]) -> str:
    if not info:
        return "another process (it has not recorded its pid yet)"
    what = info.get("command") or "a capflow command"
    return f"{what!r} (pid {info.get('pid', '?')} on {info.get('host', '?')}, started {info.get('started', '?')})"


@contextlib.contextmanager
def hold_workdir(workdir: str | Path, command: str) -> Iterator[Path]:
    """Hold ``<workdir>/capflow.lock`` for the block (creating the workdir); :class:`WorkdirBusy` when another
    process holds it. Yields the lock file's path."""
    root = Path(workdir)
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    path = root.resolve() / LOCK_NAME  # the folder resolved, never the lock file: a link there is refused
    key = str(path)
    with _guard:
        if key in _held:  # this process holds it already (re-entrant)
            _held[key][1] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield path
        finally:
            with _guard:
                _held[key][1] -= 1
        return
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        info = holder_info(path)
        extra = ""
        if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int) \
                and not pid_alive(info["pid"]):
            extra = (f"; pid {info['pid']} has exited but a process it started still holds the lock (see "
                     f"'fuser {path}'): stop it or wait for it to exit")
        raise WorkdirBusy(f"workdir {root} is in use by {describe_holder(info)}{extra}: one run per workdir - wait "
                          f"for it to finish, stop it, or give this run another run.workdir") from None
    previous = holder_info(path)
    if previous.get("pid") and previous.get("pid") != os.getpid():
        log.warning("workdir %s: took over the lock of %s, which ended without releasing it", root,
                    describe_holder(previous))
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "argv": sys.argv[:8]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    with _guard:
        _held[key] = [fd, 1]
    try:
        yield path
    finally:
        with _guard:
            _held.pop(key, None)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # not deleted: a waiting process may have it open already
        if created and [p.name for p in root.iterdir()] == [LOCK_NAME]:
            # a command refused before writing anything leaves no workdir behind (as before the lock existed)
            with contextlib.suppress(OSError):
                path.unlink()
                root.rmdir()
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def file_lock(path: str | Path, what: str, timeout: float = 120.0) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created), waiting up to ``timeout`` s for other processes; for
    one-time set-up that two processes must not do at once. ``TimeoutError`` names ``what`` and the file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = _open_lock_file(p)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: another process held {p} for more than {timeout:.0f} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)
