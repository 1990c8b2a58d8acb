"""Small helpers shared across the library: file digests, atomic writes, torch device resolution, handing freed heap
memory back to the system."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    import torch


from captioning.errors import InfrastructureError


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's or ``taskset``'s limit), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on
    except (AttributeError, OSError, TypeError):  # pragma: no cover - not glibc (macOS, musl, Windows): nothing
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing where there is none).

    numpy's arrays below glibc's mapping threshold (which rises to up to 32 MB as large blocks are freed) come from
    the heap; a build whose large temporaries come and go between long-lived arrays leaves the heap holding tens of
    MB of freed pages, resident until the process ends: ``free`` only gives back the heap's top. Called between the
    phases of such a build (SCST's CIDEr-D set-up), it keeps the peak to what is live."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def resolve_device(spec: str, what: str = "device") -> torch.device:
    """``auto`` -> CUDA when present else CPU; an explicit CUDA device must exist."""
    import torch  # here, not at the top: the data stages import this module and never need torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {spec!r} requested but CUDA is not available")
    return dev


class DiskFull(InfrastructureError, OSError):
    """No space left on the device while writing a file: the message names the file and the free space."""

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full_message(path: str | Path, what: str = "") -> str:
    p = Path(path)
    try:
        free = f"{shutil.disk_usage(p.parent if not p.is_dir() else p).free / 2**20:,.1f} MiB free there"
    except OSError:
        free = "free space unknown"
    return f"no space left on device writing {what + ' ' if what else ''}{p} ({free}): free some space and run again"


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], object], what: str = "") -> Path:
    """Write ``path`` all or nothing: ``write(f)`` fills a hidden temporary file beside it, which then replaces
    ``path``. On any failure or interruption the temporary file is removed and ``path`` is left as it was; a full
    disk raises :class:`DiskFull` naming the file (not a codec's "unexpected pos" or a bare errno)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a leftover of a killed writer of this pid, or a link planted there: never written through
        with open_new(tmp) as f:
            write(f)
        os.replace(tmp, path)  # replaces a link at ``path`` itself, never what it points to
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not isinstance(e, DiskFull) and _no_space(e):
            raise DiskFull(errno.ENOSPC, disk_full_message(path, what)) from None
        raise
    return path


def _no_space(exc: BaseException) -> bool:
    """An ENOSPC anywhere in the chain (torch reports a failed write as a RuntimeError raised while handling it)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    return False


def safe_relative(name: str, what: str) -> str:
    """``name`` (a path read from a file, a store or a record) as a relative POSIX path that stays inside the root it
    is joined to: no absolute path, no ``..``/``.``/empty component, no backslash, no NUL (:class:`ValueError` naming
    ``what`` otherwise). ``""`` is the root itself."""
    if not isinstance(name, str):
        raise ValueError(f"{what}: a path must be a string, not {type(name).__name__}")
    if name == "":
        return name
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts) \
            or (len(parts[0]) >= 2 and parts[0][1] == ":"):
        raise ValueError(f"{what}: {name!r} is not a path inside its root (absolute, '..', '.', empty part, "
                         "backslash or NUL)")
    return name


def inside(root: str | Path, path: str | Path) -> bool:
    """Whether ``path`` - symbolic links resolved, also in its existing parents - lies within ``root``."""
    base = os.path.realpath(root)
    p = os.path.realpath(path)
    return p == base or p.startswith(base.rstrip(os.sep) + os.sep)


def open_new(path: str | Path) -> IO[bytes]:
    """``path`` created for writing, refusing to follow a symbolic link placed there (or to reuse any file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return os.fdopen(fd, "wb")


def source_digest(root: str | Path, *paths: str) -> str:
    """sha256 of the Python and YAML sources under ``root/<path>`` for each of ``paths`` (files in sorted order, each
    named relative to ``root``; ``__pycache__`` skipped): the identity of a piece of code wherever it lies - the
    stage keys' code version, the library an MLflow Model carries. A path that does not exist raises."""
    root = Path(root)
    h = hashlib.sha256()
    for rel in paths:
        base = root / rel
        if not base.exists():  # a moved module must not silently drop out of a digest
            raise FileNotFoundError(f"source_digest: {base} does not exist")
        for p in [base] if base.is_file() else sorted(base.rglob("*")):
            if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()
