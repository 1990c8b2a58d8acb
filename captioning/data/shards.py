"""Ingest WebDataset tar shards as img2dataset writes them, images left inside the shards.

Input (``dataset.format: webdataset``): the tar files ``dataset.shards.files`` names (globs below
``dataset.images``). A sample is the adjacent members sharing a key: ``{key}.jpg`` (or ``.jpeg``/``.png``/
``.webp``), its caption ``{key}.txt`` and/or ``{key}.json`` (``"caption"``; optionally a ``"captions"`` list,
``"status"``, ``"error_message"``). Beside a shard, img2dataset's ``{shard}.parquet`` (columns ``key``,
``caption``, ``status``, ``error_message``, ...) is read when present (``dataset.shards.metadata``): its rows
whose download failed are entries too, rejected with img2dataset's error as the reason, and its caption serves a
sample that carries none.

Output: the normalised dataset file (:mod:`captioning.data.columnar`), exactly as Karpathy ingest writes it. An
image's ``file`` is a member reference ``<shard>#<offset>:<size>`` (:mod:`captioning.data.tar_members`), read as
a byte range of the shard by extraction; nothing is unpacked. ``image_id`` is the decimal key as an integer
(a key that is not a decimal number is rejected: an id made by hashing could collide). The split is
deterministic: the kept images ranked by a hash of their image id, the first ``val_images`` go to val, the next
``test_images`` to test (each capped at ``max_split_fraction`` of the kept images, at least one when there are
three or more), the rest to train - a function of the set of kept images, so adding shards can move images
between splits.

Every entry that is left out is recorded with its reason, as Karpathy ingest records them: a key that is not a
decimal number, a repeated key (in any shard; the first is kept), a member twice in one sample, no image member
or several, an empty/unreadable/truncated image (:func:`check_image_bytes`, ``dataset.image_check``), no
caption, a failed img2dataset status; empty captions are dropped with a reason. More than
``max_reject_fraction`` of the entries bad fails the ingest and lists them. Shards are read one at a time per
thread (``hash_workers``), their images one at a time (member hashes cached by the shard's size and mtime);
what is held per sample is its image id (:class:`captioning.data.columnar.FirstSeen`, for repeated keys: 16 bytes
a sample) and, until written into a sorted run, its entry.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
import tarfile
import tempfile
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from captioning.data.columnar import DatasetFile, DatasetWriter, FirstSeen, RunWriter
from captioning.data.entries import DatasetError, ImageEntry, Rejection
from captioning.data.karpathy import FileHashCache, check_image_bytes
from captioning.data.tar_members import MemberRef
from captioning.data.text import tokenize
from captioning.progress import bar as progress_bar

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
MAX_TEXT_BYTES = 1 << 20  # a caption member larger than this is not a caption
MAX_ID = 2**63 - 1  # image ids are int64 in every store
RUN_ROWS = 50_000
_DIGITS = re.compile(r"[0-9]+")
_CHECK_MODES = ("none", "header", "decode")


@dataclass
class _Sample:
    """One sample of a shard as read: what ingest needs of it, never its image bytes."""

    key: str
    image_id: int | None = None
    ref: str = ""  # the image member, relative to the images root
    captions: list[str] = field(default_factory=list)
    dropped: list[tuple[int, str]] = field(default_factory=list)  # (sentid, reason)
    size: int = -1
    sha256: str = ""
    reason: str | None = None


@dataclass
class _Shard:
    rel: str  # the shard's path relative to the images root
    samples: list[_Sample]
    missing: list[tuple[str, int | None, str]]  # metadata rows with no sample in the tar: (key, image_id, reason)


@dataclass(frozen=True)
class _Options:
    root: Path
    max_words: int
    image_check: str
    metadata: str
    cache: FileHashCache


# ---------------------------------------------------------------------- finding the shards
_COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
def find_shards(root: str | Path, patterns: Sequence[str]) -> list[tuple[Path, str]]:
    """(path, path relative to the root) of every tar file the glob ``patterns`` match below ``root``, in name
    order; a pattern that leaves the root, or a shard that resolves outside it (a link), is an error."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"images root {root} is not a folder (dataset.images: the folder holding the shards)")
    real_root = root.resolve()
    found: dict[str, Path] = {}
    for pat in patterns:
        if not pat or Path(pat).is_absolute() or ".." in Path(pat).parts:
            raise DatasetError(f"dataset.shards.files pattern {pat!r} must be a glob relative to dataset.images")
        for p in root.glob(pat):
            if p.name.endswith(_COMPRESSED_TAR) and p.is_file():
                raise DatasetError(
                    f"shard {p} is a compressed tar: images are read from the shards in place, by byte offset, "
                    "which a compressed stream does not allow; decompress the shards (e.g. `gunzip` leaves a .tar) "
                    "or write them uncompressed (img2dataset's webdataset output is .tar by default)")
            if not p.name.endswith(".tar") or not p.is_file():
                continue
            if not p.resolve().is_relative_to(real_root):
                raise DatasetError(f"shard {p} leads outside the images root {root} (a link to {p.resolve()}): "
                                   "refused; copy the shard into the root")
            rel = p.relative_to(root).as_posix()
            if MemberRef.parse(f"{rel}#512:1") != MemberRef(rel, 512, 1) or not MemberRef(rel, 512, 1).relative_ok():
                raise DatasetError(f"shard name {rel!r} cannot be named by a member reference")
            found[rel] = p
    if not found:
        raise DatasetError(f"no tar shards match dataset.shards.files={list(patterns)} below {root}")
    return [(found[rel], rel) for rel in sorted(found)]


# ---------------------------------------------------------------------- one shard
def _split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name, the rest its extension."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (ext.lower() if dot else "")


def _image_id(key: str) -> tuple[int | None, str | None]:
    if not _DIGITS.fullmatch(key):
        return None, (f"key {key!r} is not a decimal number (image ids are img2dataset's numeric keys; a made-up id "
                      "could collide)")
    v = int(key)
    if v > MAX_ID:
        return None, f"key {key!r} is larger than an int64 image id"
    return v, None


def _read_metadata(path: Path, rel: str, mode: str) -> dict[str, tuple[str, str, Any]] | None:
    """img2dataset's per-shard Parquet: key -> (status, error_message, caption); None when there is none."""
    pq_path = path.with_name(path.name[: -len(".tar")] + ".parquet")
    if mode == "ignore" or not pq_path.is_file():
        if mode == "required":
            raise DatasetError(f"shard {rel} has no metadata file {pq_path.name} (dataset.shards.metadata=required)")
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(pq_path).names
        if "key" not in names:
            raise DatasetError(f"{pq_path}: img2dataset metadata without a 'key' column (columns: {names})")
        cols = [c for c in ("key", "status", "error_message", "caption") if c in names]
        table = pq.read_table(pq_path, columns=cols)
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{pq_path}: not a readable Parquet file ({e})") from None
    data = {c: table.column(c).to_pylist() for c in cols}
    n = table.num_rows
    out: dict[str, tuple[str, str, Any]] = {}
    for i in range(n):
        key = data["key"][i]
        if key is None:
            continue
        status = data["status"][i] if "status" in data else "success"
        error = data["error_message"][i] if "error_message" in data else None
        out[str(key)] = (str(status or "unknown"), str(error or ""), data["caption"][i] if "caption" in data else None)
    return out


@dataclass(frozen=True)
class _Bad:
    """A caption member that could not be read as text."""

    reason: str


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _captions(s: _Sample, texts: list[tuple[str, Any]], max_words: int) -> None:
    """Tokenise the caption texts (source, value) into ``s``; the same text given twice (``.txt`` and ``.json``
    both, as img2dataset writes) is one caption. Unusable ones are dropped with a reason."""
    seen: set[str] = set()
    k = 0
    for source, text in texts:
        if isinstance(text, _Bad):
            s.dropped.append((k, text.reason))
            k += 1
            continue
        if not isinstance(text, str):
            s.dropped.append((k, f"caption in {source} is not text"))
            k += 1
            continue
        text = text.strip()
        if text in seen:
            continue
        seen.add(text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            s.dropped.append((k, f"caption in {source} is invalid Unicode (a lone surrogate)"))
            k += 1
            continue
        toks = tokenize(text, max_words)
        if toks:
            s.captions.append(" ".join(toks))
        else:
            s.dropped.append((k, f"empty caption in {source} (no words after tokenisation)"))
        k += 1


def _member_bytes(tar: tarfile.TarFile, m: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(m)
    assert f is not None  # regular members only
    return f.read()


def _sample(tar: tarfile.TarFile, key: str, members: list[tuple[str, tarfile.TarInfo]], rel: str,
            st: os.stat_result, meta: dict | None, o: _Options) -> _Sample:
    s = _Sample(key)
    s.image_id, s.reason = _image_id(key)
    exts = [ext for ext, _ in members]
    twice = sorted({e for e in exts if exts.count(e) > 1})
    if twice and s.reason is None:
        s.reason = f"member {key}.{twice[0]} appears more than once in the sample"
    images = [m for ext, m in members if ext in IMAGE_EXTS]
    texts: list[tuple[str, Any]] = []
    for ext, m in members:
        if ext not in ("txt", "json"):
            continue
        if m.size > MAX_TEXT_BYTES:
            texts.append((m.name, _Bad(f"{m.name} is larger than {MAX_TEXT_BYTES} bytes: not a caption")))
            continue
        if m.offset_data + m.size > st.st_size:
            texts.append((m.name, _Bad(f"{m.name} is cut off at the end of the shard (truncated shard)")))
            continue
        text = _text(_member_bytes(tar, m))
        if text is None:
            texts.append((m.name, _Bad(f"{m.name} is not UTF-8 text")))
        elif ext == "txt":
            texts.append((m.name, text))
        else:
            try:
                doc = json.loads(text)
            except ValueError:
                doc = None
            if not isinstance(doc, dict):
                s.reason = s.reason or f"{m.name} is not a JSON object"
                continue
            if doc.get("status") not in (None, "success"):
                s.reason = s.reason or f"img2dataset {doc.get('status')}: {doc.get('error_message') or 'no message'}"
            if "caption" in doc and doc["caption"] is not None:
                texts.append((m.name, doc["caption"]))
            extra = doc.get("captions")
            if isinstance(extra, list):
                texts += [(m.name, c) for c in extra]
    if meta is not None and key in meta:
        status, error, caption = meta[key]
        if status != "success":
            s.reason = s.reason or f"img2dataset {status}: {error or 'no message'}"
        if not texts and caption is not None:
            texts.append(("the metadata", caption))
    _captions(s, texts, o.max_words)
    if s.reason is None and not images:
        s.reason = f"no image member ({'/'.join(f'{key}.{e}' for e in IMAGE_EXTS)}) in the sample"
    if s.reason is None and len(images) > 1:
        s.reason = f"more than one image member ({', '.join(m.name for m in images)})"
    if s.reason is None and not s.captions:
        s.reason = "no captions (none non-empty)"
    if images:
        img = images[0]
        s.ref = str(MemberRef(rel, img.offset_data, img.size))
    if s.reason is None:
        s.size = images[0].size
        s.sha256, s.reason = _check_image(tar, images[0], rel, st, o)
    return s


def _check_image(tar: tarfile.TarFile, m: tarfile.TarInfo, rel: str, st: os.stat_result,
                 o: _Options) -> tuple[str, str | None]:
    """(sha256, reject reason or None) of the image member: read once for both, unless the cache has it (same
    shard size and mtime, a check at least as strict)."""
    if m.offset_data + m.size > st.st_size:
        return "", f"image member {m.name} is cut off at the end of the shard (truncated shard)"
    if m.size == 0:
        return "", "zero-byte image file"
    where = o.root / str(MemberRef(rel, m.offset_data, m.size))
    cached = o.cache.get(where, st, o.image_check)
    if cached is not None:
        return cached, None
    data = _member_bytes(tar, m)
    if len(data) != m.size:
        return "", f"image member {m.name} is cut off at the end of the shard (truncated shard)"
    digest = hashlib.sha256(data).hexdigest()
    reason = check_image_bytes(data, o.image_check)
    if reason is None:
        o.cache.put(where, st, digest, o.image_check)
    return digest, reason


def scan_shard(path: Path, rel: str, o: _Options) -> _Shard:
    """Every sample of one shard (and the metadata rows without one), in tar order."""
    meta = _read_metadata(path, rel, o.metadata)
    samples: list[_Sample] = []
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            with tarfile.open(fileobj=fh, mode="r:") as tar:
                key: str | None = None
                group: list[tuple[str, tarfile.TarInfo]] = []
                while True:
                    m = tar.next()
                    tar.members = []  # read as a stream: no list of every member of the shard
                    if m is None or (m.isreg() and _split_name(m.name)[0] != key):
                        if key is not None:
                            samples.append(_sample(tar, key, group, rel, st, meta, o))
                        if m is None:
                            break
                        key, group = _split_name(m.name)[0], []
                    if m.isreg():
                        group.append((_split_name(m.name)[1], m))
    except (tarfile.TarError, EOFError) as e:
        raise DatasetError(f"shard {rel} is not a readable tar file ({type(e).__name__}: {e}); re-download it or "
                           "leave it out of dataset.shards.files") from None
    except OSError as e:
        raise DatasetError(f"shard {rel} cannot be read: {e}") from None
    missing: list[tuple[str, int | None, str]] = []
    if meta is not None:
        present = {s.key for s in samples}
        for k, (status, error, _) in meta.items():
            if k in present:
                continue
            reason = (f"img2dataset {status}: {error or 'no message'}" if status != "success"
                      else "img2dataset recorded a success but the shard holds no sample of this key")
            missing.append((k, _image_id(k)[0], reason))
    return _Shard(rel, samples, missing)


def _scans(files: list[tuple[Path, str]], o: _Options, workers: int) -> Iterator[_Shard]:
    """The shards scanned ``workers`` at a time, handed out in name order (a few scanned ahead at most)."""
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="capflow-shards") as pool:
        ahead: deque[Future] = deque()
        todo = iter(files)
        for path, rel in todo:
            ahead.append(pool.submit(scan_shard, path, rel, o))
            if len(ahead) >= 2 * max(1, workers):
                break
        while ahead:
            scan = ahead.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                ahead.append(pool.submit(scan_shard, nxt[0], nxt[1], o))
            yield scan


# ---------------------------------------------------------------------- splits
def split_rank(image_id: int) -> int:
    """The hash that orders images for the split (stable across runs, machines and Python versions)."""
    return int.from_bytes(hashlib.blake2b(b"capflow-split:%d" % image_id, digest_size=8).digest(), "big")


def assign_splits(ids: np.ndarray, val_images: int, test_images: int, max_fraction: float
                  ) -> tuple[frozenset[int], frozenset[int]]:
    """(val ids, test ids) of the kept ``ids``: see the module docstring."""
    n = len(ids)

    def count(want: int) -> int:
        k = min(want, int(max_fraction * n))
        return max(k, 1) if want and n >= 3 else k

    k_val, k_test = count(val_images), count(test_images)
    ranks = np.fromiter((split_rank(int(i)) for i in ids), np.uint64, n)
    order = np.lexsort((ids, ranks))
    return (frozenset(ids[order[:k_val]].tolist()), frozenset(ids[order[k_val: k_val + k_test]].tolist()))


# ---------------------------------------------------------------------- ingest
def ingest_webdataset(
    images_root: str | Path,
    out: str | Path,
    *,
    shards: Sequence[str] = ("*.tar",),
    metadata: str = "auto",
    val_images: int = 5000,
    test_images: int = 5000,
    max_split_fraction: float = 0.1,
    max_words: int = 16,
    image_check: str = "header",
    max_reject_fraction: float = 0.01,
    hash_workers: int = 4,
    hash_cache: str | Path | None = None,
    progress: bool = False,
    run_rows: int = RUN_ROWS,
) -> DatasetFile:
    """Read and validate the shards below ``images_root`` into the normalised dataset file ``out`` (see the
    module docstring), streaming: shards are scanned a few at a time, the candidates sorted ``run_rows`` at a
    time into temporary runs beside ``out`` and merged in image-id order into ``out``."""
    if image_check not in _CHECK_MODES:
        raise ValueError(f"image_check must be one of {list(_CHECK_MODES)}, got {image_check!r}")
    if metadata not in ("auto", "required", "ignore"):
        raise ValueError(f"metadata must be auto, required or ignore, got {metadata!r}")
    root, out = Path(images_root), Path(out)
    files = find_shards(root, shards)
    out.parent.mkdir(parents=True, exist_ok=True)
    opts = _Options(root, max_words, image_check, metadata, FileHashCache(hash_cache))
    rejected: list[Rejection] = []
    dropped: list[Rejection] = []
    first = FirstSeen()  # image id -> its first entry: repeated keys, in any shard
    starts: list[int] = []  # each shard's first entry (names the shard of an entry)
    kept: list[np.ndarray] = []
    n = 0
    source = f"webdataset:{os.path.abspath(root)}"
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".ingest-") as tmp, progress_bar(
            desc="reading + checking shards", enabled=progress, unit="img") as bar:
        runs = RunWriter(Path(tmp), run_rows)
        ids: list[int] = []
        try:  # the cache's database is closed whatever happens (written in batches: see its save)
            for scan in _scans(files, opts, hash_workers):
                starts.append(n)
                for s in scan.samples:
                    idx, where = n, f"{scan.rel}:{s.key}"
                    n += 1
                    if s.image_id is not None:
                        e0 = first.first(s.image_id, idx)
                        if e0 != idx:
                            shard0 = files[bisect.bisect_right(starts, e0) - 1][1]
                            rejected.append(Rejection(idx, s.image_id, where, f"duplicate key {s.key} (image id "
                                                      f"{s.image_id}; first in {shard0}, entry {e0})"))
                            continue
                    dropped += [Rejection(idx, s.image_id, where, reason, sid) for sid, reason in s.dropped]
                    if s.reason is not None:
                        rejected.append(Rejection(idx, s.image_id, where, s.reason))
                        continue
                    assert s.image_id is not None
                    runs.add(idx, ImageEntry(s.image_id, s.ref, "train", s.captions, list(range(len(s.captions))),
                                             s.size, s.sha256))
                    ids.append(s.image_id)
                    if runs.full:
                        runs.write()
                        kept.append(np.asarray(ids, np.int64))
                        ids.clear()
                for key, image_id, reason in scan.missing:
                    rejected.append(Rejection(n, image_id, f"{scan.rel}:{key}", reason))
                    n += 1
                bar.update(len(scan.samples))
        finally:
            opts.cache.close()
        runs.write()
        kept.append(np.asarray(ids, np.int64))
        rejected.sort(key=lambda r: r.entry)
        if n and len(rejected) / n > max_reject_fraction:
            listing = "\n".join(f"  entry {r.entry} image_id={r.image_id} {r.file}: {r.reason}" for r in rejected)
            raise DatasetError(
                f"{root}: {len(rejected)} of {n} shard entries are bad ({len(rejected) / n:.1%} > "
                f"dataset.max_reject_fraction={max_reject_fraction}):\n{listing}\n"
                "Fix or remove these samples, or raise dataset.max_reject_fraction to skip them.")
        for r in rejected:
            log.warning("rejected entry %d image_id=%s %s: %s", r.entry, r.image_id, r.file, r.reason)
        all_ids = np.concatenate(kept)
        if not len(all_ids):
            raise DatasetError(f"{root}: no usable images in {len(files)} shard(s)")
        val, test = assign_splits(all_ids, val_images, test_images, max_split_fraction)
        writer = DatasetWriter(out, source=source, images_root=os.path.abspath(root), files_checked=True)
        try:
            for e in runs.merged():
                e.split = "val" if e.image_id in val else "test" if e.image_id in test else "train"
                writer.add(e)
        except BaseException:
            writer.abort()
            raise
        return writer.close(entries=n, rejected=rejected, dropped_captions=dropped)
