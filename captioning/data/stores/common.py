"""What both stores share: schema names, row status codes, the errors, where a store opens (local path or
fsspec URI, credentials from the environment) and the per-chunk checksums with the reports that check them."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from captioning.errors import InputError

FEATURE_SCHEMA = "capflow-features/1"
LABEL_SCHEMA = "capflow-labels/1"
PENDING, OK, REJECTED = 0, 1, 2
GROUND_TRUTH = 0
CHECKSUMS = "checksum"  # the per-chunk checksum array of both stores
CHECKSUM_ALGORITHM = "sha256/128"  # per array and chunk: the first 16 bytes of sha256(dtype, shape, values)
DIGEST_BYTES = 16

# The stores' one logger, named as when they were a single module (``captioning.data.stores``).
log = logging.getLogger("captioning.data.stores")


class StoreError(InputError, ValueError):
    """A store is missing, has the wrong schema, or a write breaks the store's contract."""


class CorruptDataError(StoreError):
    """A stored file (a store's chunk, a checkpoint, a stage record) is damaged: the message names the file and
    says how to repair it."""


def storage_options_for(uri: str) -> dict[str, Any] | None:
    """fsspec options for remote URIs, from the environment only (``AWS_ENDPOINT_URL`` etc.)."""
    if uri.startswith("s3://"):
        opts: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
        return opts
    return None


def open_group(uri: str, mode: str):
    """The Zarr v3 group at ``uri``; a missing or (when creating) already existing store is a StoreError."""
    try:
        return zarr.open_group(store=uri, mode=mode, storage_options=storage_options_for(uri), zarr_format=3)
    except FileNotFoundError:
        raise StoreError(f"no Zarr store at {uri}") from None
    except FileExistsError:
        raise StoreError(f"a store already exists at {uri} (remove it or ask to overwrite)") from None


# ---------------------------------------------------------------------- chunk checksums
def values_digest(values: Any) -> np.ndarray:
    """16-byte digest (uint8) of an array's values as stored: dtype, shape and bytes; strings as UTF-8."""
    a = np.asarray(values)
    h = hashlib.sha256()
    if a.dtype.kind in "OUST":  # reject reasons: str / StringDType / object arrays of str
        h.update(f"str{a.shape};".encode())
        for text in a.ravel().tolist():
            enc = str(text).encode("utf-8", "surrogatepass")
            h.update(len(enc).to_bytes(8, "little"))
            h.update(enc)
    else:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape};".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return np.frombuffer(h.digest()[:DIGEST_BYTES], np.uint8)


@dataclass
class ChunkFault:
    """A chunk whose files cannot be read or whose values differ from the checksum recorded when it was written."""

    chunk: int
    rows: tuple[int, int]
    arrays: list[str]
    files: list[str]
    problem: str

    def __str__(self) -> str:
        return f"chunk {self.chunk} (rows {self.rows[0]}..{self.rows[1] - 1}): {self.problem}: {', '.join(self.files)}"


@dataclass
class VerifyReport:
    """What :meth:`FeatureStore.verify` / :meth:`LabelStore.verify` found (and, with ``repair``, did)."""

    uri: str
    kind: str  # "features" | "labels"
    chunks: int  # chunks in the store
    checked: int  # chunks whose values were compared with their checksums
    faults: list[ChunkFault] = field(default_factory=list)
    unverified: list[int] = field(default_factory=list)  # finished chunks without a recorded checksum
    recorded: list[int] = field(default_factory=list)  # checksums recorded now (from values that could not be checked)
    repaired: list[int] = field(default_factory=list)  # damaged chunks marked pending (features: re-extracted next)
    pending: int = 0  # feature chunks not finished yet (nothing to verify)
    bytes: int = 0  # decoded bytes read and hashed
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.faults

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "kind": self.kind, "chunks": self.chunks, "checked": self.checked,
                "faults": [{"chunk": f.chunk, "rows": list(f.rows), "arrays": f.arrays, "files": f.files,
                            "problem": f.problem}
                           for f in self.faults],
                "unverified": len(self.unverified), "recorded": len(self.recorded), "repaired": self.repaired,
                "pending": self.pending, "bytes": self.bytes, "seconds": round(self.seconds, 3)}
