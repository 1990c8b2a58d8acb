"""Arrays too large to hold, written once and then read by their parts: :class:`SpilledArray` and its reader
:class:`FileArray`.

The values go, a block at a time, into an unlinked temporary file (gone with the process, whatever ends it) and are
read back by position with ``pread``: a slice is one read, a gather one read per run of consecutive positions. Reads
copy what was asked for and nothing else stays in the process - no memory map, whose page faults map whole
page-cache folios (on Linux 6.x, 500 scattered reads of a 128 MB mapped file made all 128 MB resident).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["FileArray", "SpilledArray"]


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Bytes read at ``offset`` into ``view`` (``preadv`` where the system has it, else ``pread`` and a copy)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    got = os.pread(fd, len(view), offset)  # pragma: no cover - systems without preadv
    view[:len(got)] = got  # pragma: no cover
    return len(got)  # pragma: no cover


class FileArray:
    """A one-dimensional, read-only array in a file, read by position: ``a[i]``, ``a[lo:hi]`` and ``a[indices]``
    (an integer array) give numpy arrays as indexing a numpy array does; ``np.asarray(a)`` reads it whole."""

    ndim = 1

    def __init__(self, file, dtype, length: int):
        self._file = file  # kept open: the reader owns it
        self._fd = file.fileno()
        self.dtype = np.dtype(dtype)
        self._n = int(length)

    def __len__(self) -> int:
        return self._n

    @property
    def shape(self) -> tuple[int]:
        return (self._n,)

    @property
    def nbytes(self) -> int:
        return self._n * self.dtype.itemsize

    def _read(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Positions lo..hi-1 as a new array, read straight into it (or into ``out``, of that length): no bytes
        object in between, so reading a part holds it once."""
        if out is None:
            out = np.empty(hi - lo, self.dtype)
        view = memoryview(out.view(np.uint8).reshape(-1))
        offset, done = lo * self.dtype.itemsize, 0
        while done < len(view):
            got = _pread_into(self._fd, view[done:], offset + done)
            if got <= 0:
                raise OSError(f"short read of a spilled array: {done} of {len(view)} bytes")
            done += got
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(self._n)
            if step != 1:
                return self._read(lo, max(lo, hi))[::step] if step > 0 else np.asarray(self)[key]
            return self._read(lo, max(lo, hi))
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self._n if key < 0 else 0)
            if not 0 <= i < self._n:
                raise IndexError(f"index {int(key)} is out of bounds for a spilled array of {self._n}")
            return self._read(i, i + 1)[0]
        idx = np.asarray(key)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"a spilled array is indexed by integers, slices or integer arrays, not {idx.dtype}")
        flat = idx.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + self._n, flat)
        if len(flat) and (flat.min() < 0 or flat.max() >= self._n):
            raise IndexError(f"index out of bounds for a spilled array of {self._n}")
        if len(flat) == 0:
            return np.zeros(idx.shape, self.dtype)
        if len(flat) == int(flat[-1]) - int(flat[0]) + 1 and (np.diff(flat) == 1).all():  # one run: one read
            return self._read(int(flat[0]), int(flat[-1]) + 1).reshape(idx.shape)
        pos, inv = np.unique(flat, return_inverse=True)
        cut = np.flatnonzero(np.diff(pos) != 1) + 1
        out = np.empty(len(pos), self.dtype)
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(pos)], strict=True):
            self._read(int(pos[a]), int(pos[b - 1]) + 1, out[a:b])
        return out[inv.reshape(-1)].reshape(idx.shape)

    def __array__(self, dtype=None, copy=None):
        whole = self._read(0, self._n)
        return whole if dtype is None else whole.astype(dtype, copy=False)


class SpilledArray:
    """A one-dimensional array of ``dtype`` built by :meth:`append`, then read through :meth:`array`. ``directory``:
    where the temporary file lives (default: the system's temporary folder)."""

    def __init__(self, dtype, directory: str | Path | None = None):
        self.dtype = np.dtype(dtype)
        self._directory = directory
        self._file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 - it lives as long as the array
        self._n = 0
        self._reader: FileArray | None = None

    def __len__(self) -> int:
        return self._n

    def append(self, values: np.ndarray) -> None:
        if self._reader is not None:
            raise RuntimeError("a spilled array is written before it is read")
        v = np.ascontiguousarray(values, self.dtype).reshape(-1)
        if len(v):
            self._file.write(memoryview(v.view(np.uint8)))  # any dtype, records too, as its bytes
            self._n += len(v)

    def widened(self, dtype) -> SpilledArray:
        """The values so far as ``dtype`` in a new spilled array (read back a block at a time); this one is closed."""
        out = SpilledArray(dtype, self._directory)
        self._file.flush()
        self._file.seek(0)
        block = 1 << 20
        for lo in range(0, self._n, block):
            out.append(np.fromfile(self._file, self.dtype, min(block, self._n - lo)))
        self.close()
        return out

    def array(self) -> FileArray:
        """The values, read by position from the file (:class:`FileArray`)."""
        if self._reader is None:
            self._file.flush()
            self._reader = FileArray(self._file, self.dtype, self._n)
        return self._reader

    def close(self) -> None:
        """Drop the file (a reader taken from it can no longer read)."""
        self._reader = None
        self._file.close()
