"""Read, validate and normalise a Karpathy-format ``dataset_coco.json`` plus its images root.

Structural faults (not JSON, no ``images`` list, an entry without a required field, an unknown split) raise
:class:`DatasetError` naming the file, entry and field. Bad entries (missing, empty, unreadable or truncated
image file; no usable caption; a duplicate image id) are rejected with a reason; if more than
``max_reject_fraction`` of the entries are bad the whole ingest fails and lists them all. Empty captions of an
otherwise good image are dropped with a reason. Nothing disappears without a record.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from captioning.data.columnar import DatasetFile, DatasetWriter, FirstSeen, RunWriter, is_columnar
from captioning.data.entries import (
    DIGEST_FORMAT,
    SPLIT_CODES,
    SPLITS,
    DatasetError,
    DigestHasher,
    ImageEntry,
    Rejection,
    dataset_summary,
)
from captioning.data.hashcache import CHECK_LEVEL, FileHashCache
from captioning.data.text import tokenize
from captioning.jsonio import iter_array_field
from captioning.progress import bar as progress_bar

log = logging.getLogger(__name__)

__all__ = ["SPLITS", "SPLIT_CODES", "Dataset", "DatasetError", "FileHashCache", "ImageEntry", "Rejection",
           "dataset_digest", "ingest_karpathy", "read_karpathy"]

KARPATHY_SPLITS = {"train", "val", "test", "restval"}
IMAGE_FORMATS = {"JPEG", "PNG", "BMP", "GIF", "WEBP", "TIFF", "MPO"}
JSON_FORMAT = DIGEST_FORMAT  # the one-JSON-document format earlier versions wrote (still read)
RUN_ROWS = 10_000  # candidates checked, sorted and written per ingest run (bounds ingest's memory)


@dataclass
class Dataset:
    """A normalised dataset in memory (small datasets, tests, and the stages that still need one whole); the
    data-side stages stream its file instead (:class:`captioning.data.columnar.DatasetFile`)."""

    images: list[ImageEntry]
    rejected: list[Rejection] = field(default_factory=list)
    dropped_captions: list[Rejection] = field(default_factory=list)
    excluded: list[Rejection] = field(default_factory=list)  # good entries left out by config (restval=drop)
    source: str = ""
    images_root: str | None = None
    files_checked: bool = False
    entries: int = 0
    digest: str = ""
    _by_id: dict[int, ImageEntry] | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ views (those of DatasetFile too)
    num_images = property(lambda self: len(self.images))
    num_captions = property(lambda self: sum(len(e.captions) for e in self.images))

    def iter_entries(self, split: str | None = None) -> Iterable[ImageEntry]:
        return iter(self.images) if split is None else iter(self.split(split))

    def split(self, name: str) -> list[ImageEntry]:
        return [e for e in self.images if e.split == name]

    def captions(self, split: str | None = None) -> Iterable[list[str]]:
        for e in self.images:
            if split is None or e.split == split:
                for c in e.captions:
                    yield c.split()

    def summary(self) -> dict[str, Any]:
        counts = Counter(e.split for e in self.images)
        return dataset_summary(len(self.images), sum(len(e.captions) for e in self.images), counts, self.rejected,
                       self.dropped_captions, len(self.excluded), self.files_checked, self.digest)

    def image_path(self, entry: ImageEntry) -> Path:
        if self.images_root is None:
            raise DatasetError("this dataset has no images root (annotations only)")
        return Path(self.images_root) / entry.file

    def entries_of(self, image_ids: Sequence[int] | np.ndarray) -> list[ImageEntry]:
        """The entries of ``image_ids`` (KeyError naming an id the dataset does not have)."""
        if self._by_id is None or len(self._by_id) != len(self.images):
            self._by_id = {e.image_id: e for e in self.images}
        return [self._by_id[int(i)] for i in image_ids]

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write the normalised dataset file (:mod:`captioning.data.columnar`); its digest is computed as it is
        written."""
        w = DatasetWriter(path, source=self.source, images_root=self.images_root, files_checked=self.files_checked)
        try:
            for e in self.images:
                w.add(e)
        except BaseException:
            w.abort()
            raise
        f = w.close(entries=self.entries, rejected=self.rejected, dropped_captions=self.dropped_captions,
                    excluded=self.excluded)
        if self.digest and self.digest != f.digest:
            f.path.unlink()
            raise DatasetError(f"{path}: the dataset's digest {self.digest[:16]} is not that of its entries "
                               f"({f.digest[:16]}): not written")
        self.digest = f.digest
        return f.path

    @classmethod
    def load(cls, path: str | Path) -> Dataset:
        """A normalised dataset file: the columnar format, or the JSON document earlier versions wrote."""
        got = open_dataset(path)
        return cls.from_file(got) if isinstance(got, DatasetFile) else got

    @classmethod
    def from_file(cls, f: DatasetFile) -> Dataset:
        return cls(images=list(f.iter_entries()), rejected=f.rejected,
                   dropped_captions=f.dropped_captions, excluded=f.excluded,
                   source=f.source, images_root=f.images_root, files_checked=f.files_checked, entries=f.entries,
                   digest=f.digest)


def open_dataset(path: str | Path) -> Dataset | DatasetFile:
    """A normalised dataset file to stream (the columnar format), or read whole (the JSON of earlier versions)."""
    try:
        columnar = is_columnar(path)
    except FileNotFoundError:
        raise DatasetError(f"normalised dataset {path} not found") from None
    return DatasetFile(path) if columnar else _load_json(path)


def image_ids_of(ds: Dataset | DatasetFile) -> np.ndarray:
    """Every image id of a dataset, in its order, as int64 (a column: 8 bytes an image)."""
    if isinstance(ds, DatasetFile):
        return ds.column("image_id")
    return np.fromiter((e.image_id for e in ds.images), np.int64, len(ds.images))


def _load_json(path: str | Path) -> Dataset:
    d: dict[str, Any] = {}
    try:  # entry by entry: the file is never in memory whole
        images = [ImageEntry(**e) for e in iter_array_field(path, "images", "normalised dataset", DatasetError,
                                                             others=d)]
    except DatasetError:
        if d.get("format") == JSON_FORMAT:
            raise
        images = []  # not ours: said below
    if d.get("format") != JSON_FORMAT:
        raise DatasetError(f"{path}: not a normalised capflow dataset (format {d.get('format')!r})")
    return Dataset(
        images=images,
        rejected=[Rejection(**r) for r in d["rejected"]],
        dropped_captions=[Rejection(**r) for r in d["dropped_captions"]],
        excluded=[Rejection(**r) for r in d.get("excluded", [])],
        source=d["source"],
        images_root=d["images_root"],
        files_checked=d["files_checked"],
        entries=d["entries"],
        digest=d["digest"],
    )


# ---------------------------------------------------------------------- file checks
_CHECK_LEVEL = CHECK_LEVEL
_TAIL_MARKERS = {"JPEG": (b"\xff\xd9",), "MPO": (b"\xff\xd9",), "PNG": (b"IEND\xaeB`\x82",)}


def check_image_bytes(data: bytes, mode: str) -> str | None:
    """Return a rejection reason, or None if the image passes the ``mode`` check (none/header/decode)."""
    if not data:
        return "zero-byte image file"
    if mode == "none":
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            fmt = img.format
            if fmt not in IMAGE_FORMATS:
                return f"unsupported image format {fmt}"
            w, h = img.size
            if w < 1 or h < 1:
                return f"degenerate image size {w}x{h}"
            if mode == "decode":
                img.load()
    except UnidentifiedImageError:
        return "not a readable image (unknown format or corrupt header)"
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        return f"image too large to decode safely: {e}"
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        return f"image cannot be decoded: {e}"
    markers = _TAIL_MARKERS.get(fmt)
    if markers and not data.rstrip(b"\x00").endswith(markers):
        return f"truncated {fmt} file (no end-of-image marker)"
    return None


def _encodable(text: str) -> bool:
    """False for text that cannot be written as UTF-8 (lone surrogates such as ``\\ud800``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_file(path: Path, mode: str, cache: FileHashCache,
                root: Path | None = None) -> tuple[int, str, str | None]:
    """(size, sha256, reason or None). Reads the file once for both the hash and the check. With ``root`` (the
    resolved images root), a file that resolves outside it (through a symlink) is refused, not read."""
    if root is not None:
        try:
            real = path.resolve()
        except (OSError, RuntimeError) as e:  # e.g. a symlink loop
            return -1, "", f"image path cannot be resolved: {e}"
        if not real.is_relative_to(root):
            return -1, "", (f"image file leads outside the images root (a symlink to {real}): refused; copy the "
                            "file into the root, or set dataset.images to a folder that holds it")
    try:
        st = path.stat()
    except FileNotFoundError:
        return -1, "", "image file not found"
    except OSError as e:
        return -1, "", f"image file not accessible: {e}"
    if not path.is_file():
        return -1, "", "image path is not a file"
    if st.st_size == 0:
        return 0, "", "zero-byte image file"
    cached = cache.get(path, st, mode)
    if cached is not None:
        return st.st_size, cached, None
    try:
        data = path.read_bytes()
    except OSError as e:
        return st.st_size, "", f"image file not readable: {e}"
    digest = hashlib.sha256(data).hexdigest()
    reason = check_image_bytes(data, mode)
    if reason is None:
        cache.put(path, st, digest, mode)
    return st.st_size, digest, reason


# ---------------------------------------------------------------------- parsing
def _require(entry: dict, key: str, idx: int, path: Path, types: tuple[type, ...]) -> Any:
    if key not in entry:
        raise DatasetError(f"{path}: images[{idx}] is missing required field '{key}'")
    val = entry[key]
    if not isinstance(val, types) or isinstance(val, bool):
        names = "/".join(t.__name__ for t in types)
        raise DatasetError(f"{path}: images[{idx}].{key} must be {names}, got {type(val).__name__}")
    return val


def _image_id(entry: dict, idx: int, path: Path) -> int:
    for key in ("cocoid", "imgid", "id"):
        if key in entry:
            v = entry[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise DatasetError(f"{path}: images[{idx}].{key} must be an integer, got {v!r}")
            return v
    raise DatasetError(f"{path}: images[{idx}] is missing required field 'cocoid' (or 'imgid')")


def _parse_entry(entry: Any, idx: int, path: Path, max_words: int, restval_split: str, seen: FirstSeen,
                 dropped: list[Rejection], excluded: list[Rejection], rejected: list[Rejection]) -> ImageEntry | None:
    """The entry as a candidate, or None when it is left out (recorded in the lists). Structural faults raise
    :class:`DatasetError`."""
    if not isinstance(entry, dict):
        raise DatasetError(f"{path}: images[{idx}] must be an object, got {type(entry).__name__}")
    image_id = _image_id(entry, idx, path)
    filename = _require(entry, "filename", idx, path, (str,))
    filepath = entry.get("filepath", "") or ""
    if not isinstance(filepath, str):
        raise DatasetError(f"{path}: images[{idx}].filepath must be a string")
    rel = f"{filepath}/{filename}" if filepath else filename
    if "\0" in rel or not _encodable(rel):
        raise DatasetError(f"{path}: images[{idx}] file name {rel!r} holds a NUL byte or invalid Unicode "
                           "(a lone surrogate): fix the entry's filepath/filename")
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise DatasetError(f"{path}: images[{idx}] file {rel!r} must be relative to the images root")
    split = _require(entry, "split", idx, path, (str,))
    if split not in KARPATHY_SPLITS:
        raise DatasetError(
            f"{path}: images[{idx}] (image_id {image_id}) has unknown split {split!r}; "
            f"expected one of {sorted(KARPATHY_SPLITS)}"
        )
    sentences = _require(entry, "sentences", idx, path, (list,))
    first = seen.first(image_id, idx)
    if first != idx:
        rejected.append(Rejection(idx, image_id, rel, f"duplicate image_id {image_id} (first at images[{first}])"))
        return None
    if split == "restval":
        if restval_split == "drop":
            excluded.append(Rejection(idx, image_id, rel, "restval entry excluded (dataset.restval_split=drop)"))
            return None
        split = restval_split
    caps: list[str] = []
    sids: list[int] = []
    for k, sent in enumerate(sentences):
        sid = sent.get("sentid", k) if isinstance(sent, dict) else k
        if not isinstance(sent, dict):
            dropped.append(Rejection(idx, image_id, rel, "sentence is not an object", sid))
            continue
        text = sent.get("raw")
        if isinstance(text, str) and not _encodable(text):
            dropped.append(Rejection(idx, image_id, rel, "caption is invalid Unicode (a lone surrogate such "
                                     "as \\ud800)", sid))
            continue
        if isinstance(text, str):
            toks = tokenize(text, max_words)
        elif isinstance(sent.get("tokens"), list) and all(isinstance(t, str) and _encodable(t)
                                                          for t in sent["tokens"]):
            toks = tokenize(" ".join(sent["tokens"]), max_words)
        else:
            dropped.append(Rejection(idx, image_id, rel, "sentence has neither 'raw' text nor 'tokens'", sid))
            continue
        if not toks:
            dropped.append(Rejection(idx, image_id, rel, "empty caption (no words after tokenisation)", sid))
            continue
        caps.append(" ".join(toks))
        sids.append(int(sid) if isinstance(sid, int) else k)
    if not caps:
        rejected.append(Rejection(idx, image_id, rel, "no captions (none non-empty)"))
        return None
    return ImageEntry(image_id, rel, split, caps, sids)


class _FileChecks:
    """The image files of one run of candidates, checked and hashed by a thread pool (batches of 64: one pool task
    per file costs more than hashing a cached or small file)."""

    def __init__(self, images_root: str | Path, image_check: str, hash_cache: str | Path | None, workers: int,
                 bar: Any) -> None:
        self.root = Path(images_root)
        if not self.root.is_dir():
            raise DatasetError(f"images root {self.root} is not a folder")
        self.real_root, self.mode, self.workers, self.bar = self.root.resolve(), image_check, workers, bar
        self.cache = FileHashCache(hash_cache)

    def failed(self, pending: list[tuple[int, ImageEntry]], rejected: list[Rejection]) -> set[int]:
        """Set each entry's size and hash; the entry indices of those that fail (recorded in ``rejected``)."""
        def check(batch: list[tuple[int, ImageEntry]]) -> list[tuple[int, str, str | None]]:
            return [_check_file(self.root / e.file, self.mode, self.cache, self.real_root) for _, e in batch]

        batches = [pending[i: i + 64] for i in range(0, len(pending), 64)]
        bad: set[int] = set()
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for batch, got in zip(batches, pool.map(check, batches), strict=True):
                for (idx, e), (size, digest, reason) in zip(batch, got, strict=True):
                    if reason:
                        rejected.append(Rejection(idx, e.image_id, e.file, reason))
                        bad.add(idx)
                    else:
                        e.size, e.sha256 = size, digest
                self.bar.update(len(batch))
        return bad


def ingest_karpathy(
    annotations: str | Path,
    images_root: str | Path | None,
    out: str | Path,
    *,
    max_words: int = 16,
    restval_split: str = "train",
    image_check: str = "header",
    max_reject_fraction: float = 0.01,
    hash_workers: int = 4,
    hash_cache: str | Path | None = None,
    progress: bool = False,
    run_rows: int = RUN_ROWS,
) -> DatasetFile:
    """Read and validate a Karpathy JSON (+ images root when given) into the normalised dataset file ``out``
    (see the module docstring), streaming: entries are parsed one at a time, checked and sorted ``run_rows`` at a
    time into temporary runs beside ``out``, and merged in image-id order into ``out``."""
    if restval_split not in (*SPLITS, "drop"):
        raise ValueError(f"restval_split must be one of train/val/test/drop, got {restval_split!r}")
    if image_check not in _CHECK_LEVEL:
        raise ValueError(f"image_check must be one of {sorted(_CHECK_LEVEL)}, got {image_check!r}")
    path, out = Path(annotations), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rejected: list[Rejection] = []
    dropped: list[Rejection] = []
    excluded: list[Rejection] = []
    seen = FirstSeen()
    n = 0
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".ingest-") as tmp, progress_bar(
            desc="reading + checking images", enabled=progress, unit="img") as bar:
        checks = (_FileChecks(images_root, image_check, hash_cache, hash_workers, bar)
                  if images_root is not None else None)
        runs = RunWriter(Path(tmp), run_rows)

        def flush() -> None:
            bad = checks.failed(runs.pending, rejected) if checks is not None else set()
            runs.write(lambda idx, e: idx not in bad)

        try:  # the hash cache is closed (its pending hashes written) whatever happens
            # entries are parsed one at a time: a COCO-sized file is never in memory as Python objects
            for idx, entry in enumerate(iter_array_field(path, "images", "annotation", DatasetError, DatasetError)):
                n = idx + 1
                cand = _parse_entry(entry, idx, path, max_words, restval_split, seen, dropped, excluded, rejected)
                if cand is not None:
                    runs.add(idx, cand)
                    if runs.full:
                        flush()
            flush()
        finally:
            if checks is not None:
                checks.cache.close()
        rejected.sort(key=lambda r: r.entry)
        if n and len(rejected) / n > max_reject_fraction:
            listing = "\n".join(f"  images[{r.entry}] image_id={r.image_id} {r.file}: {r.reason}" for r in rejected)
            raise DatasetError(
                f"{path}: {len(rejected)} of {n} entries are bad ({len(rejected) / n:.1%} > "
                f"dataset.max_reject_fraction={max_reject_fraction}):\n{listing}\n"
                "Fix or remove these entries, or raise dataset.max_reject_fraction to skip them."
            )
        for r in rejected:
            log.warning("rejected images[%d] image_id=%s %s: %s", r.entry, r.image_id, r.file, r.reason)
        # absolute: the normalised dataset is read by other processes too (Dask workers), in other directories
        writer = DatasetWriter(out, source=str(path), files_checked=checks is not None,
                               images_root=os.path.abspath(images_root) if images_root is not None else None)
        try:
            for e in runs.merged():
                writer.add(e)
        except BaseException:
            writer.abort()
            raise
        if not writer.head["images"]:
            writer.abort()
            raise DatasetError(f"{path}: no usable images")
        return writer.close(entries=n, rejected=rejected, dropped_captions=dropped, excluded=excluded)


def read_karpathy(annotations: str | Path, images_root: str | Path | None = None, **options: Any) -> Dataset:
    """:func:`ingest_karpathy` into a temporary file, read back whole (small datasets and tests)."""
    with tempfile.TemporaryDirectory(prefix="capflow-dataset-") as tmp:
        return Dataset.from_file(ingest_karpathy(annotations, images_root, Path(tmp) / "dataset.parquet", **options))


def file_digest(path: str | Path) -> str:
    """The digest of a normalised dataset file recomputed from its entries (streamed), to check it against the
    digest it records."""
    return _digest(open_dataset(path).iter_entries())


def _digest(entries: Iterable[ImageEntry]) -> str:
    h = DigestHasher()
    for e in entries:
        h.add(e.image_id, e.file, e.split, e.captions, e.size, e.sha256)
    return h.hexdigest()


def dataset_digest(ds: Dataset) -> str:
    """sha256 over the normalised annotations and every kept image file's size and content hash
    (:class:`captioning.data.entries.DigestHasher`, which the dataset file's writer feeds as it writes)."""
    return _digest(ds.images)  # sorted by image_id
