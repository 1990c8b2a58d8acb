"""The base class of both stores: row chunks spanning every array, reads that name a damaged chunk file, and
the per-chunk checksums (computed, recorded, compared) behind ``verify``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zarr

from captioning.data.stores.common import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS,
    DIGEST_BYTES,
    ChunkFault,
    CorruptDataError,
    VerifyReport,
    log,
    values_digest,
)
from captioning.data.stores.direct import read_rows_direct
from captioning.util import usable_cpus

_ZARR_BLOCK_CHUNKS = 4096  # chunks per zarr read of a row range (zarr's per-chunk bookkeeping is held at once)


def _runs(chunks: np.ndarray, most: int) -> list[range]:
    """``chunks`` (increasing) as runs of consecutive chunks, ``most`` chunks a run at most (ranges: nothing per
    chunk)."""
    if not len(chunks):
        return []
    starts = np.flatnonzero(np.concatenate([[True], np.diff(chunks) != 1]))
    ends = np.append(starts[1:], len(chunks))
    out = []
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        first = int(chunks[a])
        out.extend(range(first + i, first + min(i + most, b - a)) for i in range(0, b - a, most))
    return out


class ChunkedStore:
    """What both stores share: row chunks spanning every array, reads that name a damaged chunk file, and a
    checksum per array and chunk (``checksum`` array, shape (chunks, arrays, 16) uint8, one Zarr chunk per row
    chunk, so writers that own whole chunks also own their checksums; all zero = none recorded)."""

    ARRAYS: tuple[str, ...] = ()
    KIND = ""
    uri: str
    group: zarr.Group

    # -------------------------------------------------------------- layout
    def _array(self, name: str):
        return self.group[name]

    @property
    def _n(self) -> int:
        return self._array(self.ARRAYS[0]).shape[0]

    @property
    def _rows_per_chunk(self) -> int:
        return self._array(self.ARRAYS[0]).chunks[0]

    @property
    def _chunks(self) -> int:
        return -(-self._n // self._rows_per_chunk)

    def _range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self._rows_per_chunk
        return start, min(start + self._rows_per_chunk, self._n)

    def _sums(self):
        return self.group.get(CHECKSUMS)

    @property
    def has_checksums(self) -> bool:
        return self._sums() is not None

    def chunk_file(self, name: str, chunk: int) -> str:
        """Where the file of array ``name``'s row chunk ``chunk`` lives (path or URI)."""
        arr = self._array(name)
        key = arr.metadata.encode_chunk_key((chunk,) + (0,) * (arr.ndim - 1))
        return f"{self.uri.rstrip('/')}/{arr.path}/{key}"

    def repair_hint(self, name: str | None = None) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    # -------------------------------------------------------------- reads that name damaged files
    def _read(self, name: str, start: int | None = None, stop: int | None = None, width: int | None = None):
        arr = self._array(name)
        if width is None:
            fast = read_rows_direct(self.group, arr, start, stop)
            if fast is not None:
                return fast
        try:
            return self._zarr_rows(arr, start, stop, width)
        except Exception as e:
            err = self._unreadable(name, start, stop, e)
            if err is None:
                raise
            raise err from e

    @staticmethod
    def _zarr_rows(arr, start: int | None, stop: int | None, width: int | None) -> np.ndarray:
        """Rows through zarr, :data:`_ZARR_BLOCK_CHUNKS` chunks a read: zarr schedules every chunk of a read at
        once (a few KB each), so one read of a million-row array in 8-row chunks would hold ~125,000 of them."""
        start, stop, _ = slice(start, stop).indices(arr.shape[0])
        step = _ZARR_BLOCK_CHUNKS * arr.chunks[0]
        parts = [arr[lo: min(lo + step, stop)] if width is None else arr[lo: min(lo + step, stop), :width]
                 for lo in range(start, stop, step)]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else (arr[start:stop] if width is None else arr[start:stop, :width])

    def _unreadable(self, name: str, start: int | None, stop: int | None, error: Exception
                    ) -> CorruptDataError | None:
        """The error naming the chunk files of rows start..stop that cannot be read (None if each reads alone)."""
        start = 0 if start is None else start
        stop = self._n if stop is None else stop
        c = self._rows_per_chunk
        bad = []
        for k in range(start // c, -(-stop // c)):
            a, b = self._range(k)
            try:
                self._array(name)[a:b]
            except Exception as e:
                bad.append((k, e))
        if not bad:
            return None
        files = "; ".join(f"{self.chunk_file(name, k)} (rows {self._range(k)[0]}..{self._range(k)[1] - 1}: "
                          f"{type(e).__name__}: {e})" for k, e in bad)
        return CorruptDataError(f"{self.KIND} store {self.uri}: cannot read {files}: the chunk file is damaged "
                                f"(truncated or overwritten). {self.repair_hint(name)}")

    # -------------------------------------------------------------- checksums
    def _chunk_values(self, values: Mapping[str, Any], offset: int, chunk: int) -> dict[str, Any]:
        a, b = self._range(chunk)
        return {n: values[n][a - offset : b - offset] for n in self.ARRAYS}

    def _digests(self, values: Mapping[str, Any]) -> np.ndarray:
        return np.stack([values_digest(values[n]) for n in self.ARRAYS])

    def _ensure_sums(self):
        """The checksum array, created (all zero: nothing recorded) for a store written before checksums."""
        sums = self._sums()
        if sums is None:
            sums = self.group.create_array(CHECKSUMS, shape=(self._chunks, len(self.ARRAYS), DIGEST_BYTES),
                                           chunks=(1, len(self.ARRAYS), DIGEST_BYTES), dtype="uint8", fill_value=0)
            self.group.attrs["checksums"] = {"algorithm": CHECKSUM_ALGORITHM, "arrays": list(self.ARRAYS)}
        return sums

    def _recorded_sums(self) -> tuple[np.ndarray | None, dict[int, Exception]]:
        """Recorded checksums (None: the store has none) and the chunks whose checksum file cannot be read."""
        sums = self._sums()
        if sums is None:
            return None, {}
        fast = read_rows_direct(self.group, sums, None, None)
        if fast is not None:
            return fast, {}
        try:
            return sums[:], {}
        except Exception:
            out = np.zeros(sums.shape, np.uint8)
            bad: dict[int, Exception] = {}
            for k in range(sums.shape[0]):
                try:
                    out[k] = sums[k]
                except Exception as e:
                    bad[k] = e
            return out, bad

    def _compute(self, chunks: Sequence[int]) -> list[tuple[int, np.ndarray | None, dict[str, str], int]]:
        """Digests of consecutive ``chunks`` from the stored values: (chunk, digests | None, {array: error},
        bytes). One read per array for the whole run; a read that fails is retried chunk by chunk to name the
        damaged files."""
        start, stop = self._range(chunks[0])[0], self._range(chunks[-1])[1]

        def read(name: str):
            fast = read_rows_direct(self.group, self._array(name), start, stop)  # a run of many small chunks
            return fast if fast is not None else self._array(name)[start:stop]
        try:
            values = {n: read(n) for n in self.ARRAYS}
        except Exception:
            values = None
        if values is not None:
            out = []
            for k in chunks:
                v = self._chunk_values(values, start, k)
                out.append((k, self._digests(v), {}, sum(np.asarray(x).nbytes for x in v.values())))
            return out
        out = []
        for k in chunks:
            a, b = self._range(k)
            v, errors = {}, {}
            for n in self.ARRAYS:
                try:
                    v[n] = self._array(n)[a:b]
                except Exception as e:
                    errors[n] = f"{type(e).__name__}: {e}"
            out.append((k, None if errors else self._digests(v), errors,
                        sum(np.asarray(x).nbytes for x in v.values())))
        return out

    def _verify_chunks(self, todo: Sequence[int], report: VerifyReport, recorded: np.ndarray | None,
                       threads: int | None) -> dict[int, np.ndarray]:
        """Compare chunks ``todo`` with their recorded checksums (faults and unverified chunks go into
        ``report``); returns the digests computed for the unverified ones."""
        per_chunk = sum(int(np.prod(self._array(n).chunks)) * self._array(n).dtype.itemsize
                        for n in self.ARRAYS if self._array(n).dtype.kind not in "OUST")
        group = max(1, min(64, (32 << 20) // max(per_chunk, 1)))  # ~32 MB of decoded values per read
        runs = _runs(np.asarray(todo, np.int64), group)
        workers = threads or min(4, usable_cpus())
        fresh: dict[int, np.ndarray] = {}
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="capflow-verify") as pool:
            for results in pool.map(self._compute, runs):
                for k, dig, errors, nbytes in results:
                    report.bytes += nbytes
                    rows = self._range(k)
                    if errors:
                        files = [self.chunk_file(n, k) for n in errors]
                        report.faults.append(ChunkFault(k, rows, list(errors), files, "cannot be read (" + "; ".join(
                            f"{n}: {e}" for n, e in errors.items()) + ")"))
                        continue
                    assert dig is not None
                    if recorded is None or not recorded[k].any():
                        report.unverified.append(k)
                        fresh[k] = dig
                        continue
                    report.checked += 1
                    wrong = [n for i, n in enumerate(self.ARRAYS) if not np.array_equal(dig[i], recorded[k, i])]
                    if wrong:
                        report.faults.append(ChunkFault(k, rows, wrong, [self.chunk_file(n, k) for n in wrong],
                                                        "values differ from the checksum recorded when the chunk "
                                                        "was written"))
        return fresh

    def _record(self, fresh: Mapping[int, np.ndarray], report: VerifyReport) -> None:
        """Record ``fresh`` checksums; the checksum array is added to an older store even when nothing is
        finished yet, so that chunks written from now on record theirs."""
        sums = self._ensure_sums()
        if not fresh:
            return
        for k, dig in sorted(fresh.items()):
            sums[k] = dig
            report.recorded.append(k)
        log.warning("%s store %s: %d chunks had no checksum (written before capflow recorded them); recorded them "
                    "now from their current values, which could not be checked", self.KIND, self.uri, len(fresh))
