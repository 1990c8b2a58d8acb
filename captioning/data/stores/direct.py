"""Reads of a local store's per-row arrays chunk file by chunk file, bypassing zarr's per-chunk cost."""

from __future__ import annotations

import os

import numpy as np
import zarr

_DIRECT_MIN_CHUNKS = 32  # fewer chunks than this: zarr's own read (its fixed cost is small then)


def read_rows_direct(group: zarr.Group, arr, start: int | None, stop: int | None) -> np.ndarray | None:
    """Rows ``start..stop`` of a local, row-chunked numeric array read chunk file by chunk file (bytes + one Zstd
    or Blosc codec), or None when that does not apply or anything fails (the caller then reads through zarr, which
    names a damaged file). The arrays indexed by row (ids, status, box counts, checksums) are chunked by
    ``chunk_rows``, i.e. ~1 file per image at 8 rows: zarr spends ~0.6 ms per chunk on them (15 s per array at
    COCO's 123k images), a plain read and decode ~0.08 ms."""
    try:
        store = group.store
        root = getattr(store, "root", None)
        meta = arr.metadata
        c = arr.chunks[0]
        n = arr.shape[0]
        start, stop, _ = slice(start, stop).indices(n)
        first, last = start // c, -(-stop // c)
        if (root is None or type(store).__name__ != "LocalStore" or last - first < _DIRECT_MIN_CHUNKS
                or tuple(arr.chunks[1:]) != tuple(arr.shape[1:]) or arr.dtype.kind not in "iufb"):
            return None
        codecs = list(meta.codecs)
        if type(codecs[0]).__name__ != "BytesCodec" or len(codecs) > 2:
            return None
        if len(codecs) == 2:
            import numcodecs

            kind = type(codecs[1]).__name__
            if kind == "ZstdCodec":
                decode = numcodecs.Zstd().decode
            elif kind == "BloscCodec":
                decode = numcodecs.Blosc().decode
            else:
                return None
        else:
            def decode(b: bytes) -> bytes:
                return b
        endian = getattr(codecs[0].endian, "value", codecs[0].endian)
        dtype = np.dtype(arr.dtype).newbyteorder("<" if endian in ("little", None) else ">")
        shape = (c, *arr.shape[1:])
        out = np.empty((stop - start, *arr.shape[1:]), arr.dtype)
        base = os.path.join(str(root), arr.path)
        for k in range(first, last):
            lo, hi = max(k * c, start), min((k + 1) * c, stop)
            key = meta.encode_chunk_key((k,) + (0,) * (arr.ndim - 1))
            try:
                with open(os.path.join(base, key), "rb") as f:
                    raw = f.read()
            except FileNotFoundError:  # never written: the fill value, as zarr reads it
                out[lo - start: hi - start] = arr.fill_value
                continue
            chunk = np.frombuffer(decode(raw), dtype).reshape(shape)
            out[lo - start: hi - start] = chunk[lo - k * c: hi - k * c]
        return out
    except Exception:
        return None
