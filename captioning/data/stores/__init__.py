"""Zarr v3 stores: region features (``features.zarr``) and caption labels (``labels.zarr``).

Feature store, one row per image in a fixed order (ARCHITECTURE.md, "Data contracts"):
  features (N, B_max, D) float16 | boxes (N, B_max, 4) float32 (x1,y1,x2,y2 / image size) |
  num_boxes (N,) int16 | image_size (N, 2) int32 (height, width; -1 = unknown) | image_id (N,) int64 |
  status (N,) int8 (0 pending, 1 ok, 2 rejected) | reject_reason (N,) str
Optional per-region arrays (``extras``, chosen when the store is created, :data:`EXTRAS`):
  object_id (N, B_max) int32 (-1 = none) | object_conf (N, B_max) float32 | attr_id (N, B_max) int32 (-1 = none) |
  attr_conf (N, B_max) float32 | boxes_px (N, B_max, 4) float32 (x1,y1,x2,y2 in original-image pixels)
Chunks span whole rows (``chunk_rows`` images); each writer owns whole chunks and writes ``status`` last, so a
row is ``ok`` only once its data is on storage. Arrays are created (or grown) once, before any fan-out.

Label store, one row per caption:
  tokens (M, L) int32 word ids without BOS/EOS, 0-padded | length (M,) int16 | image_row (M,) int32 (row in
  the feature store) | image_id (M,) int64 | split (M,) int8 (0 train, 1 val, 2 test) | source (M,) int8
  with the group attribute ``sources`` naming each source code (0 = ground truth, others e.g. SeqKD runs).

Both stores open from a local path or any fsspec URI (``s3://bucket/prefix``); credentials come from the
environment, never from code or configs.
"""

from captioning.data.stores.chunked import ChunkedStore
from captioning.data.stores.common import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS,
    DIGEST_BYTES,
    FEATURE_SCHEMA,
    GROUND_TRUTH,
    LABEL_SCHEMA,
    OK,
    PENDING,
    REJECTED,
    ChunkFault,
    CorruptDataError,
    StoreError,
    VerifyReport,
    storage_options_for,
    values_digest,
)
from captioning.data.stores.features import EXTRAS, FeatureBlock, FeatureStore
from captioning.data.stores.labels import Labels, LabelStore

__all__ = [
    "CHECKSUMS",
    "CHECKSUM_ALGORITHM",
    "DIGEST_BYTES",
    "EXTRAS",
    "FEATURE_SCHEMA",
    "GROUND_TRUTH",
    "LABEL_SCHEMA",
    "OK",
    "PENDING",
    "REJECTED",
    "ChunkFault",
    "ChunkedStore",
    "CorruptDataError",
    "FeatureBlock",
    "FeatureStore",
    "LabelStore",
    "Labels",
    "StoreError",
    "VerifyReport",
    "storage_options_for",
    "values_digest",
]
