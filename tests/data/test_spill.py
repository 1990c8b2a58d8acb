"""SpilledArray / FileArray: values written a block at a time to an unlinked file and read back by position - as
numpy indexing reads them, and without the file's pages staying in the process."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from captioning.data.spill import FileArray, SpilledArray


def _rss_kb() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_values_round_trip_and_widening(tmp_path):
    s = SpilledArray(np.uint16, tmp_path)
    s.append(np.array([1, 2, 65535]))
    s.append(np.zeros(0))
    s.append(np.arange(5))
    assert len(s) == 8 and os.listdir(tmp_path) == []  # unlinked from the start
    w = s.widened(np.int32)
    w.append(np.array([70000]))
    a = w.array()
    assert isinstance(a, FileArray) and a.dtype == np.int32 and a.shape == (9,) and a.nbytes == 36
    assert np.asarray(a).tolist() == [1, 2, 65535, 0, 1, 2, 3, 4, 70000]
    with pytest.raises(RuntimeError):
        w.append(np.array([1]))
    assert np.asarray(SpilledArray(np.int64).array()).tolist() == []


def test_indexing_reads_what_numpy_indexing_gives():
    values = np.random.default_rng(0).integers(-9, 10**6, 5000).astype(np.int64)
    s = SpilledArray(np.int64)
    for lo in range(0, len(values), 777):
        s.append(values[lo:lo + 777])
    a = s.array()
    keys = [3, -1, np.int64(4999), slice(10, 20), slice(4990, 6000), slice(7, 3), slice(5, 50, 7), slice(None),
            np.array([5, 3, 3, 4, 4999, 0, 6, 7]), np.arange(100, 200), np.array([[1, 2], [-1, 9]]),
            np.zeros(0, np.int64)]
    for key in keys:
        got, want = a[key], values[key]
        assert np.array_equal(got, want) and np.shape(got) == np.shape(want), key
    for bad in (5000, -5001, np.array([1, 5000])):
        with pytest.raises(IndexError):
            a[bad]
    with pytest.raises(TypeError):
        a[np.array([0.5])]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_scattered_reads_keep_nothing_resident():
    n = 32 << 20  # 128 MiB of int32
    s = SpilledArray(np.int32)
    for lo in range(0, n, 1 << 20):
        s.append(np.arange(lo, lo + (1 << 20), dtype=np.int32))
    a = s.array()
    idx = np.random.default_rng(0).integers(0, n, 2000)
    before = _rss_kb()
    for _ in range(5):
        assert np.array_equal(a[idx], idx.astype(np.int32))
    assert _rss_kb() - before < 16 << 10  # a memory map would hold most of the 128 MiB here


def test_reads_hold_the_values_once_and_are_writable():
    """A read goes straight into the array it returns (no bytes object copied after it): reading a spilled array
    whole peaks at about its size, not twice it; records round trip as their bytes."""
    n = 2 << 20  # 16 MiB of int64
    s = SpilledArray(np.int64)
    s.append(np.arange(n, dtype=np.int64))
    a = s.array()
    tracemalloc.start()
    try:
        whole = np.asarray(a)
        part = a[1000:n - 1000]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(whole, np.arange(n)) and np.array_equal(part, np.arange(1000, n - 1000))
    assert peak < 2.2 * a.nbytes  # whole + the part; a bytes object under each read made it ~4x
    part[0] = -1  # a new array, not a view of a buffer
    assert a[1000] == 1000
    rec = np.dtype([("key", np.int64), ("count", np.int32), ("first", np.uint8)])
    r = SpilledArray(rec)
    values = np.array([(5, 2, 1), (-3, 7, 0), (9, 1, 255)], rec)
    r.append(values)
    got = r.array()
    assert np.array_equal(np.asarray(got), values) and np.array_equal(got[np.array([2, 0])], values[[2, 0]])
