"""The two-pass import of a :class:`~captioning.data.imports.base.Source` into a feature store
(:func:`import_source`).

Every record of the source becomes a row of the store or is part of a rejected row, never dropped: a malformed
record (bad base64, wrong length, shape mismatch, NaN/inf, a box outside the image, an image id the dataset does not
have, an id given twice, a truncated record or file) is a row with status ``rejected``, its reason and its kind (the
kind the code that rejects it states, counted in the report); a record whose image id cannot be read is a rejected
row whose image id is minus its record number (1-based). A container that cannot be opened at all is a
:class:`~captioning.data.imports.base.FeatureImportError` (one line).

Two passes: the first reads only the image ids (for a TSV: the first field of each line), which fixes the rows, the
duplicates and the unknown ids before anything is written (the plan); the second reads one record at a time
and writes whole chunks. Memory stays bounded by one chunk of rows plus one record (a TSV line is read with a length
bound), never by the size of the source. Boxes are stored relative (x1/w, y1/h, x2/w, y2/h in float32) and, where
the source gives pixels, also as ``boxes_px``; object/attribute ids and confidences where the source gives them.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from captioning.data.imports.base import (
    ABSENT,
    DUPLICATE_ID,
    IMAGE_SIZE,
    MAX_BOXES,
    NO_ID,
    NO_REGIONS,
    NON_FINITE,
    NOT_IN_DATASET,
    OTHER,
    OUTSIDE,
    SHAPE,
    FeatureImportError,
    Regions,
    Rejected,
    Scan,
    Source,
)
from captioning.data.stores import OK, PENDING, REJECTED, FeatureStore, StoreError
from captioning.progress import bar as progress_bar

log = logging.getLogger(__name__)

REASON = "cannot import features: "


class _StreamOutOfStep(AssertionError):
    """A streamed source gave another record than the plan expected (a bug: the import stops)."""


# ---------------------------------------------------------------------- image sizes
def read_image_sizes(path: Path) -> dict[int, tuple[int, int]]:
    """(height, width) per image id from a COCO-format JSON (``images``: ``id``, ``width``, ``height``; e.g.
    ``captions_train2014.json``)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise FeatureImportError(f"cannot read image sizes from {path}: {e}") from None
    images = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(images, list):
        raise FeatureImportError(f"{path}: no 'images' list (a COCO-format JSON with id, width, height per image)")
    out: dict[int, tuple[int, int]] = {}
    for k, im in enumerate(images):
        try:
            out[int(im["id"])] = (int(im["height"]), int(im["width"]))
        except (KeyError, TypeError, ValueError):
            raise FeatureImportError(f"{path}: images[{k}] lacks an integer id, width or height") from None
    return out


# ---------------------------------------------------------------------- the import
LOAD, DUPLICATE, UNKNOWN, MISSING, PROBLEM = range(5)


@dataclass
class _Plan:
    """The store's rows: image id, what to do (code), and the record each row reads (-1: none)."""

    ids: np.ndarray
    code: np.ndarray
    record: np.ndarray
    duplicates: dict[int, list[int]]


def _plan(source: Source, scan: Scan, wanted: Sequence[int] | None) -> _Plan:
    """The rows, from the first pass's ids (numpy throughout: a few bytes per record, no per-record objects)."""
    ids = scan.ids
    valid = ids != NO_ID
    rec_valid = np.flatnonzero(valid)
    vals, first, counts = np.unique(ids[valid], return_index=True, return_counts=True)
    first_rec = rec_valid[first]
    dup_vals = vals[counts > 1]
    duplicates: dict[int, list[int]] = {}
    if len(dup_vals):
        order = np.argsort(ids[valid], kind="stable")
        sorted_ids = ids[valid][order]
        lo = np.searchsorted(sorted_ids, dup_vals, side="left")
        hi = np.searchsorted(sorted_ids, dup_vals, side="right")
        for v, a, b in zip(dup_vals.tolist(), lo.tolist(), hi.tolist()):
            duplicates[v] = rec_valid[order[a:b]].tolist()
    wanted_arr = None if wanted is None else np.asarray(wanted, np.int64).reshape(-1)
    if wanted_arr is not None and len(np.unique(wanted_arr)) != len(wanted_arr):
        raise FeatureImportError("the dataset's image ids are not unique")
    invalid = np.flatnonzero(~valid)
    placeholder = -(invalid + 1)  # minus the record number (1-based)
    if source.keyed:
        if wanted_arr is not None:
            pos = np.minimum(np.searchsorted(vals, wanted_arr), max(len(vals) - 1, 0))
            present = (vals[pos] == wanted_arr) if len(vals) else np.zeros(len(wanted_arr), bool)
            rec_wanted = np.where(present, first_rec[pos] if len(vals) else -1, -1)
            other = ~np.isin(vals, wanted_arr)
            row_ids = np.concatenate([wanted_arr, vals[other], placeholder])
            record = np.concatenate([rec_wanted, first_rec[other], invalid])
        else:
            row_ids = np.concatenate([vals, placeholder])
            record = np.concatenate([first_rec, invalid])
    else:
        keep = np.zeros(len(ids), bool)
        keep[first_rec] = True
        keep[invalid] = True
        record = np.flatnonzero(keep)
        row_ids = np.where(ids[record] == NO_ID, -(record + 1), ids[record])
        if wanted_arr is not None:
            missing = wanted_arr[~np.isin(wanted_arr, vals)]
            row_ids = np.concatenate([row_ids, missing])
            record = np.concatenate([record, np.full(len(missing), -1, np.int64)])
    row_ids, record = row_ids.astype(np.int64), record.astype(np.int64)
    code = np.full(len(row_ids), LOAD, np.int8)
    has = record >= 0
    problem = np.zeros(len(row_ids), bool)
    problem[has] = ids[record[has]] == NO_ID
    dup = has & ~problem & np.isin(row_ids, dup_vals)
    code[dup] = DUPLICATE
    if wanted_arr is not None:
        code[has & ~problem & ~dup & ~np.isin(row_ids, wanted_arr)] = UNKNOWN
    code[problem] = PROBLEM
    code[~has] = MISSING
    return _Plan(row_ids, code, record, duplicates)


def _check(reg: Regions, known: tuple[int, int] | None, *, max_boxes: int, feature_dim: int,
           dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, int] | None,
                                     dict[str, np.ndarray]]:
    """Validate one image's regions: (features in the store's dtype, relative boxes, pixel boxes or None, size
    (h, w) or None, extras), or :class:`Rejected` with the reason."""
    f = np.asarray(reg.features)
    if f.ndim != 2 or f.shape[1] != feature_dim:
        raise Rejected(SHAPE, f"features have shape {f.shape}, expected (N, {feature_dim})")
    if f.dtype.kind != "f":
        raise Rejected(OTHER, f"features have dtype {f.dtype}, expected floats")
    n = f.shape[0]
    if n == 0:
        raise Rejected(NO_REGIONS, "no regions")
    if n > max_boxes:
        raise Rejected(MAX_BOXES, f"{n} boxes > max_boxes={max_boxes}")
    b = np.asarray(reg.boxes)
    if b.shape != (n, 4):
        raise Rejected(SHAPE, f"boxes have shape {b.shape}, expected ({n}, 4)")
    if b.dtype.kind not in "fiu":
        raise Rejected(OTHER, f"boxes have dtype {b.dtype}, expected numbers")
    for name, v in reg.extras.items():
        if v.shape != (n,):
            raise Rejected(SHAPE, f"{name} has shape {v.shape}, expected ({n},)")
    if not np.isfinite(f).all():
        raise Rejected(NON_FINITE, "non-finite values (NaN/inf) in features")
    if not np.isfinite(b).all():
        raise Rejected(NON_FINITE, "non-finite values (NaN/inf) in boxes")
    for name, v in reg.extras.items():
        if v.dtype.kind == "f" and not np.isfinite(v).all():
            raise Rejected(NON_FINITE, f"non-finite values (NaN/inf) in {name}")
        if name.endswith("_id") and (v.dtype.kind not in "iu" or (v.size and (v.min() < 0 or v.max() > 2**31 - 1))):
            raise Rejected(OUTSIDE, f"{name} holds values outside 0..2^31-1")
    size = reg.size
    if size is not None and not all(-(2**31) <= int(v) < 2**31 for v in size):
        raise Rejected(IMAGE_SIZE, f"image size {size[1]}x{size[0]} (w x h) is past 2^31-1: not an image's size")
    if size is not None and known is not None and tuple(size) != tuple(known):
        raise Rejected(IMAGE_SIZE, f"image size {size[1]}x{size[0]} (w x h) in the source differs from the image "
                                   f"file's {known[1]}x{known[0]}")
    size = size if size is not None else known
    box = b.astype(np.float32, copy=False)
    x1, y1, x2, y2 = box.T
    if reg.pixels:
        if size is None:
            raise Rejected(IMAGE_SIZE, "image size unknown: pixel boxes cannot be made relative (give dataset.images, "
                                       "or --image-sizes with a COCO annotation file)")
        h, w = size
        if h <= 0 or w <= 0:
            raise Rejected(IMAGE_SIZE, f"image size {w}x{h} is not positive")
        bad = (x1 < 0) | (y1 < 0) | (x2 > w) | (y2 > h) | (x1 > x2) | (y1 > y2)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise Rejected(OUTSIDE, f"box {k} ({', '.join(f'{v:g}' for v in box[k].tolist())}) is outside the "
                                    f"{w}x{h} image ({int(bad.sum())} such boxes)")
        px = box
        rel = px / np.array([w, h, w, h], np.float32)
    else:
        bad = (box < 0).any(1) | (box > 1).any(1) | (x1 > x2) | (y1 > y2)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise Rejected(OUTSIDE, f"box {k} ({', '.join(f'{v:g}' for v in box[k].tolist())}) is outside the "
                                    "image: relative boxes lie in [0, 1] with x1 <= x2, y1 <= y2 (pixel boxes? "
                                    "--boxes pixels)")
        px, rel = None, box
    out = f.astype(dtype, copy=False)
    if dtype != f.dtype and not np.isfinite(out).all():
        raise Rejected(OTHER, f"features overflow {dtype} (import with features.dtype=float32)")
    return out, rel, px, size, dict(reg.extras)


_PROGRESS = "import_progress"  # the counts of the rows written so far, while an import runs


def _resumed(uri: str, ids: np.ndarray, info: Mapping[str, Any], per_write: int, overwrite: bool
             ) -> tuple[FeatureStore | None, int, Counter[str], int]:
    """An unfinished store of this very import (same source description and image ids): (the store, the first row
    to write, the reject counts and OK rows so far); (None, 0, ...) when there is none or ``overwrite``. A finished
    store or one of another import raises :class:`StoreError` as creating over it would."""
    if overwrite or not FeatureStore.exists(uri):
        return None, 0, Counter(), 0
    store = FeatureStore.open(uri, mode="r+")
    done = store.attrs.get("import") or {}
    same = {k: v for k, v in done.items() if k not in ("ok", "rejected", "reject_kinds")} == dict(info)
    if not same or not np.array_equal(store.image_ids(), ids):
        raise StoreError(f"a store already exists at {uri} holding another import (remove it or ask to overwrite)")
    status = store.status()
    pending = np.flatnonzero(status == PENDING)
    if not len(pending):  # a finished import is not done again without asking
        raise StoreError(f"a store already exists at {uri} (remove it or ask to overwrite)")
    first = int(pending[0]) // per_write * per_write
    counts = store.attrs.get(_PROGRESS) or {}
    before = status[:first]
    if counts.get("ok") != int((before == OK).sum()):  # written rows the counts do not cover: count afresh
        return store, 0, Counter(), 0
    log.info("%s: resuming the import at row %d of %d", uri, first, store.num_rows)
    return store, first, Counter(counts.get("reject_kinds") or {}), int(counts["ok"])


@dataclass
class ImportResult:
    store: FeatureStore
    records: int
    ok: int
    rejected: int
    reasons: dict[str, int]  # reject counts by kind


def import_source(source: Source, uri: str, *, image_ids: Sequence[int] | None = None,
                  sizes: Mapping[int, tuple[int, int]] | None = None, max_boxes: int = 100, feature_dim: int = 2048,
                  chunk_rows: int = 8, dtype: str = "float16", compressor: str = "lz4", overwrite: bool = False,
                  progress: bool = False, attrs: Mapping[str, Any] | None = None) -> ImportResult:
    """Import ``source`` into a new feature store at ``uri``. ``image_ids``: the dataset's images (then every one
    is a row, records of other images are rejected rows; without it the source's records are the rows); ``sizes``:
    (height, width) of images whose files are known, for pixel boxes without a size in the source and to check the
    size a source states. Rows of a keyed source come in the dataset's order (else by image id), a streamed
    source's in its own order; the images without a record come last.

    An import that was stopped resumes: an unfinished store at ``uri`` of this import (the same source and image
    ids) is completed from its first unwritten rows; a finished store, or one of another import, is refused
    unless ``overwrite``."""
    sizes = sizes or {}
    stream = None
    try:
        scan = source.scan()
        if not len(scan.ids) and image_ids is None:
            raise FeatureImportError(f"no feature records in {source.describe()['path']}")
        plan = _plan(source, scan, image_ids)
        info = {"format": source.format, **source.describe(), "records": len(scan.ids)}
        want_dtype = np.dtype(dtype)
        # several whole chunks per write (fewer, larger Zarr writes), within ~16 MiB of row buffers
        row_bytes = max_boxes * (feature_dim * want_dtype.itemsize + 16 + 16 * len(source.extras))
        per_write = chunk_rows * max(1, min(64, (16 << 20) // max(1, chunk_rows * row_bytes)))
        store, first, reasons, ok = _resumed(uri, plan.ids, info, per_write, overwrite)
        if store is None:
            store = FeatureStore.create(
                uri, plan.ids, max_boxes=max_boxes, feature_dim=feature_dim, chunk_rows=chunk_rows, dtype=dtype,
                compressor=compressor, overwrite=overwrite, extras=source.extras,
                attrs={"source": f"import-{source.format}", "import": info, **(dict(attrs) if attrs else {})})
        if not source.keyed:
            rows = np.arange(len(plan.ids))
            stream = source.stream(np.sort(plan.record[(plan.code == LOAD) & (rows >= first)]))
        bar = progress_bar(total=store.num_rows, initial=first, desc="importing", enabled=progress, unit="image")
        for start in range(first, store.num_rows, per_write):
            stop = min(start + per_write, store.num_rows)
            bar.update(stop - start)
            m = stop - start
            feats = np.zeros((m, max_boxes, feature_dim), want_dtype)
            boxes = np.zeros((m, max_boxes, 4), np.float32)
            nb = np.zeros(m, np.int16)
            size = np.full((m, 2), -1, np.int32)
            status = np.full(m, OK, np.int8)
            why = [""] * m
            extras = {e: np.full((m, max_boxes, 4) if e == "boxes_px" else (m, max_boxes),
                                 -1 if e.endswith("_id") else 0, np.int32 if e.endswith("_id") else np.float32)
                      for e in source.extras}
            for k in range(m):
                row = start + k
                iid, code, rec = int(plan.ids[row]), int(plan.code[row]), int(plan.record[row])
                known = sizes.get(iid)
                try:
                    if code == DUPLICATE:
                        where = ", ".join(source.where(r) for r in plan.duplicates[iid][:5])
                        more = len(plan.duplicates[iid]) - 5
                        raise Rejected(DUPLICATE_ID, f"duplicate image id {iid} ({len(plan.duplicates[iid])} records: "
                                                     f"{where}" + (f", and {more} more" if more > 0 else "") + ")")
                    if code == UNKNOWN:
                        raise Rejected(NOT_IN_DATASET, f"{source.where(rec)}: image id {iid} is not in the dataset")
                    if code == MISSING:
                        raise source.missing(iid)
                    if code == PROBLEM:
                        problem = scan.problems[rec] if rec in scan.problems else Rejected(ABSENT, "no image id")
                        raise Rejected(problem.kind, f"{source.where(rec)}: {problem.text}")
                    if stream is not None:
                        got, regions = next(stream, (None, None))
                        if got != rec:  # a bug, not a record's fault
                            raise _StreamOutOfStep(f"the stream of {source.format} records gave record {got}, "
                                                   f"expected {rec}")
                        if isinstance(regions, Rejected):
                            raise regions
                    else:
                        regions = source.load(rec)
                    f, rel, px, hw, ex = _check(regions, known, max_boxes=max_boxes, feature_dim=feature_dim,
                                                dtype=want_dtype)
                except (FeatureImportError, _StreamOutOfStep):
                    raise
                except Exception as e:
                    # a rejection states its kind; an error the reading library raised (a record capflow did not
                    # foresee) is of kind OTHER, its text the error's type and message
                    kind, text = (e.kind, e.text) if isinstance(e, Rejected) else (OTHER, f"{type(e).__name__}: {e}")
                    if code == LOAD and not text.startswith(source.where(rec)):
                        text = f"{source.where(rec)}: {text}"
                    status[k], why[k] = REJECTED, REASON + text
                    reasons[kind] += 1
                    if sum(reasons.values()) <= 20:
                        log.warning("image %s: %s", iid, why[k])
                    continue
                n = f.shape[0]
                feats[k, :n], boxes[k, :n], nb[k] = f, rel, n
                if hw is not None:
                    size[k] = hw
                if px is not None and "boxes_px" in extras:
                    extras["boxes_px"][k, :n] = px
                for name, v in ex.items():
                    if name in extras:
                        extras[name][k, :n] = v
                ok += 1
            store.write_rows(start, features=feats, boxes=boxes, num_boxes=nb, image_size=size, status=status,
                             reject_reason=why, extras=extras)
            store.group.attrs[_PROGRESS] = {"ok": ok, "reject_kinds": dict(reasons)}  # what a resumed import counts on
        bar.close()
        rejected = store.num_rows - ok
        store.group.attrs["import"] = {**info, "ok": ok, "rejected": rejected, "reject_kinds": dict(reasons)}
        with contextlib.suppress(KeyError):
            del store.group.attrs[_PROGRESS]
        if rejected > 20:
            log.warning("%d rows rejected in all (%s); the list: FeatureStore.rejects() / capflow import-features "
                        "--json", rejected, ", ".join(f"{k}: {v}" for k, v in reasons.most_common()))
        return ImportResult(store, len(scan.ids), ok, rejected, dict(reasons))
    finally:
        if stream is not None:
            stream.close()
        source.close()

