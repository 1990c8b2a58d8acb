"""The label store (``labels.zarr``), one row per caption:
  tokens (M, L) int32 word ids without BOS/EOS, 0-padded | length (M,) int16 | image_row (M,) int32 (row in
  the feature store) | image_id (M,) int64 | split (M,) int8 (0 train, 1 val, 2 test) | source (M,) int8
with the group attribute ``sources`` naming each source code (0 = ground truth, others e.g. SeqKD runs).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from captioning.data.stores.chunked import ChunkedStore
from captioning.data.stores.common import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS,
    DIGEST_BYTES,
    GROUND_TRUTH,
    LABEL_SCHEMA,
    ChunkFault,
    CorruptDataError,
    StoreError,
    VerifyReport,
    open_group,
    values_digest,
)


@dataclass
class Labels:
    """The label store in memory (small: ~600k COCO captions x 16 words x 4 bytes = 38 MB)."""

    tokens: np.ndarray
    length: np.ndarray
    image_row: np.ndarray
    image_id: np.ndarray
    split: np.ndarray
    source: np.ndarray
    sources: dict[int, str]

    def select(self, mask: np.ndarray) -> Labels:
        return Labels(self.tokens[mask], self.length[mask], self.image_row[mask], self.image_id[mask],
                      self.split[mask], self.source[mask], dict(self.sources))


class LabelStore(ChunkedStore):
    """Captions as word ids. Every chunk's checksums are recorded when it is written (:meth:`create`,
    :meth:`add_source`; one writer at a time) and checked by :meth:`read`, so damaged labels never train."""

    ARRAYS = ("tokens", "length", "image_row", "image_id", "split", "source")
    KIND = "label"

    def __init__(self, uri: str, group: zarr.Group):
        self.uri = uri
        self.group = group
        if group.attrs.get("schema") != LABEL_SCHEMA:
            raise StoreError(f"{uri}: not a capflow label store (schema {group.attrs.get('schema')!r})")

    @classmethod
    def create(
        cls,
        uri: str,
        tokens: np.ndarray,
        length: np.ndarray,
        image_row: np.ndarray,
        image_id: np.ndarray,
        split: np.ndarray,
        *,
        attrs: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        chunk: int = 65536,
    ) -> LabelStore:
        store = cls.allocate(uri, len(tokens), tokens.shape[1], attrs=attrs, overwrite=overwrite, chunk=chunk)
        store.write_rows(0, tokens, length, image_row, image_id, split)
        return store

    @classmethod
    def allocate(cls, uri: str, m: int, seq: int, *, attrs: Mapping[str, Any] | None = None,
                 overwrite: bool = False, chunk: int = 65536) -> LabelStore:
        """A store of ``m`` ground-truth rows of ``seq`` tokens, to be filled by :meth:`write_rows` (a chunk of
        rows at a time: the caller never holds the whole arrays)."""
        g = open_group(uri, "w" if overwrite else "w-")
        specs = {
            "tokens": ((m, seq), (chunk, seq), "int32"),
            "length": ((m,), (chunk,), "int16"),
            "image_row": ((m,), (chunk,), "int32"),
            "image_id": ((m,), (chunk,), "int64"),
            "split": ((m,), (chunk,), "int8"),
            "source": ((m,), (chunk,), "int8"),
        }
        for name, (shape, chunks, dtype) in specs.items():
            g.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0)
        g.create_array(CHECKSUMS, shape=(-(-m // chunk), len(cls.ARRAYS), DIGEST_BYTES),
                       chunks=(1, len(cls.ARRAYS), DIGEST_BYTES), dtype="uint8", fill_value=0)
        g.attrs.update({"schema": LABEL_SCHEMA, "max_words": seq, "sources": {str(GROUND_TRUTH): "ground_truth"},
                        "checksums": {"algorithm": CHECKSUM_ALGORITHM, "arrays": list(cls.ARRAYS)},
                        **(dict(attrs) if attrs else {})})
        return cls(uri, g)

    @property
    def chunk_rows(self) -> int:
        return self._rows_per_chunk

    def write_rows(self, start: int, tokens: np.ndarray, length: np.ndarray, image_row: np.ndarray,
                   image_id: np.ndarray, split: np.ndarray) -> None:
        """Ground-truth rows ``start..`` (and the checksums of the chunks they touch)."""
        self._write(start, tokens, length, image_row, image_id, split, np.full(len(tokens), GROUND_TRUTH, np.int8))

    def repair_hint(self, name: str | None = None) -> str:
        return ("A label store is not repaired in place: rebuild it (`capflow vocab`), or run `capflow verify "
                "--repair` on the pipeline's workdir, which removes it and the stage records that point at it so "
                "that `capflow run` rebuilds it.")

    @classmethod
    def open(cls, uri: str, mode: str = "r") -> LabelStore:
        return cls(uri, open_group(uri, mode))

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    def _write(self, start, tokens, length, image_row, image_id, split, source) -> None:
        """Write rows ``start..`` and record the checksums of every chunk they touch (read back as stored)."""
        stop = start + len(tokens)
        g = self.group
        g["tokens"][start:stop] = np.asarray(tokens, np.int32)
        g["length"][start:stop] = np.asarray(length, np.int16)
        g["image_row"][start:stop] = np.asarray(image_row, np.int32)
        g["image_id"][start:stop] = np.asarray(image_id, np.int64)
        g["split"][start:stop] = np.asarray(split, np.int8)
        g["source"][start:stop] = np.asarray(source, np.int8)
        sums = self._sums()
        if sums is not None and stop > start:
            c = self._rows_per_chunk
            for k, dig, errors, _ in self._compute(list(range(start // c, -(-stop // c)))):
                if errors:
                    files = ", ".join(self.chunk_file(n, k) for n in errors)
                    raise CorruptDataError(f"label store {self.uri}: {files} cannot be read back after writing "
                                           f"({'; '.join(errors.values())}). {self.repair_hint()}")
                sums[k] = dig

    def add_source(self, name: str, tokens, length, image_row, image_id, split) -> int:
        """Append captions from a new source (e.g. SeqKD from teacher run X); returns its source code."""
        sources = {int(k): v for k, v in self.group.attrs["sources"].items()}
        if name in sources.values():
            raise StoreError(f"{self.uri}: source {name!r} already present")
        code = max(sources) + 1
        if code > 127:
            raise StoreError("too many label sources")
        m0 = self.group["tokens"].shape[0]
        seq = self.group["tokens"].shape[1]
        if tokens.shape[1] != seq:
            raise StoreError(f"tokens have width {tokens.shape[1]}, store has {seq}")
        sums = self._sums()
        if sums is not None and m0 % self._rows_per_chunk:  # the partial last chunk is rewritten: check it first
            self._raise_faults(self.verify([m0 // self._rows_per_chunk]))
        m1 = m0 + len(tokens)
        for a in self.ARRAYS:
            arr = self.group[a]
            arr.resize((m1, *arr.shape[1:]))
        if sums is not None:
            sums.resize((-(-m1 // self._rows_per_chunk), *sums.shape[1:]))
        self._write(m0, tokens, length, image_row, image_id, split, np.full(len(tokens), code, np.int8))
        sources[code] = name
        self.group.attrs["sources"] = {str(k): v for k, v in sources.items()}
        return code

    def read(self, verify: bool = True) -> Labels:
        """Every caption; with ``verify`` (default) each chunk is checked against its recorded checksums and a
        damaged chunk raises :class:`CorruptDataError` naming its files (a store without checksums reads as is)."""
        vals = {n: self._read(n) for n in self.ARRAYS}
        sums, bad = self._recorded_sums() if verify else (None, {})
        if bad:
            raise CorruptDataError(f"label store {self.uri}: cannot read the checksums of chunks {sorted(bad)} "
                                   f"({self.chunk_file(CHECKSUMS, min(bad))}, ...). {self.repair_hint()}")
        if sums is not None:
            faults = [f for k in range(self._chunks) for f in self._faults(sums, k, vals, 0, self.ARRAYS)]
            self._raise_faults(VerifyReport(self.uri, "labels", self._chunks, self._chunks, faults))
        return Labels(
            tokens=vals["tokens"],
            length=vals["length"].astype(np.int64),
            image_row=vals["image_row"].astype(np.int64),
            image_id=vals["image_id"],
            split=vals["split"],
            source=vals["source"],
            sources=self.sources,
        )

    @property
    def sources(self) -> dict[int, str]:
        """Source code -> name (0: the ground truth)."""
        return {int(k): v for k, v in self.group.attrs["sources"].items()}

    def _faults(self, sums: np.ndarray, k: int, values: Mapping[str, np.ndarray], offset: int,
                names: Iterable[str]) -> list[ChunkFault]:
        """Chunk ``k``'s arrays ``names`` (``values`` hold rows from ``offset`` on, as stored) that differ from the
        checksums recorded when it was written (none: a chunk without a record)."""
        if not sums[k].any():
            return []
        a, b = self._range(k)
        wrong = [n for n in names if not np.array_equal(values_digest(values[n][a - offset: b - offset]),
                                                        sums[k, self.ARRAYS.index(n)])]
        if not wrong:
            return []
        return [ChunkFault(k, (a, b), wrong, [self.chunk_file(n, k) for n in wrong],
                           "values differ from the checksum recorded when the chunk was written")]

    def blocks(self, names: Iterable[str] | None = None, *, verify: bool = True
               ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``(first row, {array: values})`` a chunk at a time, in :meth:`read`'s dtypes and checked (with
        ``verify``) against the recorded checksums as :meth:`read` checks them, a damaged chunk raising
        :class:`CorruptDataError` before its rows are handed out: memory is that of a chunk, whatever the store's
        size."""
        names = list(self.ARRAYS if names is None else names)
        unknown = sorted(set(names) - set(self.ARRAYS))
        if unknown:
            raise ValueError(f"label store arrays are {', '.join(self.ARRAYS)}; not {', '.join(unknown)}")
        sums, bad = self._recorded_sums() if verify else (None, {})
        if bad:
            raise CorruptDataError(f"label store {self.uri}: cannot read the checksums of chunks {sorted(bad)} "
                                   f"({self.chunk_file(CHECKSUMS, min(bad))}, ...). {self.repair_hint()}")
        for k in range(self._chunks):
            start, stop = self._range(k)
            vals = {n: self._read(n, start, stop) for n in names}
            if sums is not None:
                self._raise_faults(VerifyReport(self.uri, "labels", self._chunks, self._chunks,
                                                self._faults(sums, k, vals, start, names)))
            for n in ("length", "image_row"):
                if n in vals:
                    vals[n] = vals[n].astype(np.int64)
            yield start, vals

    def _raise_faults(self, report: VerifyReport) -> None:
        if report.faults:
            raise CorruptDataError(f"label store {self.uri} is damaged: " + "; ".join(map(str, report.faults)) +
                                   f". {self.repair_hint()}")

    def verify(self, chunks: Iterable[int] | None = None, *, record: bool = False,
               threads: int | None = None) -> VerifyReport:
        """Compare every chunk (or ``chunks``) with its recorded checksums; with ``record``, chunks without one
        (a store written before checksums) get one from their current values."""
        t0 = time.perf_counter()
        report = VerifyReport(self.uri, "labels", self._chunks, 0)
        sums, bad = self._recorded_sums()
        for k, e in bad.items():
            report.faults.append(ChunkFault(k, self._range(k), [CHECKSUMS], [self.chunk_file(CHECKSUMS, k)],
                                            f"checksum record cannot be read ({type(e).__name__}: {e})"))
        todo = [k for k in (range(self._chunks) if chunks is None else chunks) if k not in bad]
        fresh = self._verify_chunks(todo, report, sums, threads) if todo else {}
        report.faults.sort(key=lambda f: f.chunk)
        if record:
            self._record(fresh, report)
        report.seconds = time.perf_counter() - t0
        return report

    def digest(self) -> str:
        """sha256 of every array's values (in :meth:`read`'s dtypes) and the source names, read a chunk at a time
        (:meth:`blocks`, one array after another) and each chunk checked against its checksums as :meth:`read` does:
        the store is never in memory whole."""
        h = hashlib.sha256()
        for name in self.ARRAYS:
            for _, vals in self.blocks((name,)):
                h.update(np.ascontiguousarray(vals[name]))  # no bytes copy
        h.update(json.dumps(self.sources, sort_keys=True).encode())
        return h.hexdigest()
