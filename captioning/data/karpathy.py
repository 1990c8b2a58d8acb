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
import json
import logging
import os
import threading
import warnings
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from captioning.data.text import tokenize
from captioning.errors import InputError
from captioning.jsonio import iter_array_field
from captioning.progress import bar as progress_bar

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
KARPATHY_SPLITS = {"train", "val", "test", "restval"}
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
IMAGE_FORMATS = {"JPEG", "PNG", "BMP", "GIF", "WEBP", "TIFF", "MPO"}
FORMAT_VERSION = "capflow-dataset/1"


class DatasetError(InputError, ValueError):
    """The annotation file itself is malformed, or too many entries are bad."""


@dataclass
class ImageEntry:
    image_id: int
    file: str  # path relative to the images root
    split: str  # train | val | test
    captions: list[str]  # tokenised captions, words joined by single spaces
    sentids: list[int]
    size: int = -1  # file size in bytes (-1 = not checked)
    sha256: str = ""  # file content hash ("" = not checked)


@dataclass
class Rejection:
    entry: int  # index of the entry in the annotation file
    image_id: int | None
    file: str
    reason: str
    sentid: int | None = None  # set for a dropped caption


@dataclass
class Dataset:
    images: list[ImageEntry]
    rejected: list[Rejection] = field(default_factory=list)
    dropped_captions: list[Rejection] = field(default_factory=list)
    excluded: list[Rejection] = field(default_factory=list)  # good entries left out by config (restval=drop)
    source: str = ""
    images_root: str | None = None
    files_checked: bool = False
    entries: int = 0
    digest: str = ""

    # ------------------------------------------------------------------ views
    def split(self, name: str) -> list[ImageEntry]:
        return [e for e in self.images if e.split == name]

    def captions(self, split: str | None = None) -> Iterable[list[str]]:
        for e in self.images:
            if split is None or e.split == split:
                for c in e.captions:
                    yield c.split()

    def summary(self) -> dict[str, Any]:
        counts = Counter(e.split for e in self.images)
        return {
            "images": len(self.images),
            "captions": sum(len(e.captions) for e in self.images),
            "splits": {s: counts.get(s, 0) for s in SPLITS},
            "rejected": [
                {"image_id": r.image_id, "file": r.file, "reason": r.reason, "entry": r.entry}
                for r in self.rejected
            ],
            "dropped_captions": [
                {"image_id": r.image_id, "sentid": r.sentid, "reason": r.reason} for r in self.dropped_captions
            ],
            "excluded": len(self.excluded),
            "files_checked": self.files_checked,
            "digest": self.digest,
        }

    def image_path(self, entry: ImageEntry) -> Path:
        if self.images_root is None:
            raise DatasetError("this dataset has no images root (annotations only)")
        return Path(self.images_root) / entry.file

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write the normalised dataset (one JSON object; written entry by entry, so that saving never holds a
        second copy of the dataset as one string)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        head = {"format": FORMAT_VERSION, "digest": self.digest, "source": self.source,
                "images_root": self.images_root, "files_checked": self.files_checked, "entries": self.entries}
        tail = {name: [_rejection_dict(r) for r in rows] for name, rows in (
            ("rejected", self.rejected), ("dropped_captions", self.dropped_captions), ("excluded", self.excluded))}
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "images": [')
            for k, e in enumerate(self.images):
                f.write((", " if k else "") + json.dumps(_entry_dict(e), ensure_ascii=False))
            f.write("], " + json.dumps(tail, ensure_ascii=False)[1:])
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Dataset:
        d: dict[str, Any] = {}
        try:  # entry by entry: the file is never in memory whole
            images = [ImageEntry(**e) for e in iter_array_field(path, "images", "normalised dataset", DatasetError,
                                                                 others=d)]
        except DatasetError:
            if d.get("format") == FORMAT_VERSION:
                raise
            images = []  # not ours: said below
        if d.get("format") != FORMAT_VERSION:
            raise DatasetError(f"{path}: not a normalised capflow dataset (format {d.get('format')!r})")
        return cls(
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


_ENTRY_FIELDS = tuple(f.name for f in fields(ImageEntry))
_REJECTION_FIELDS = tuple(f.name for f in fields(Rejection))


def _entry_dict(e: ImageEntry) -> dict[str, Any]:
    """``asdict`` of an entry without its deep copy (the lists are only read: 5x faster at COCO's 123k)."""
    return {name: getattr(e, name) for name in _ENTRY_FIELDS}


def _rejection_dict(r: Rejection) -> dict[str, Any]:
    return {name: getattr(r, name) for name in _REJECTION_FIELDS}


# ---------------------------------------------------------------------- file checks
class FileHashCache:
    """sha256 of image files keyed by (path, size, mtime): re-ingesting an unchanged tree re-reads nothing."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._data: dict[str, list] = {}
        if self.path and self.path.is_file():
            try:
                self._data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                log.warning("ignoring unreadable hash cache %s", self.path)

    def get(self, p: Path, st: os.stat_result, mode: str) -> str | None:
        """The cached hash if the file is unchanged and passed a check at least as strict as ``mode``."""
        hit = self._data.get(str(p))
        if (
            hit
            and len(hit) == 4
            and hit[0] == st.st_size
            and hit[1] == st.st_mtime_ns
            and _CHECK_LEVEL[hit[3]] >= _CHECK_LEVEL[mode]
        ):
            return hit[2]
        return None

    def put(self, p: Path, st: os.stat_result, digest: str, mode: str) -> None:
        with self._lock:
            self._data[str(p)] = [st.st_size, st.st_mtime_ns, digest, mode]

    def save(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._data), encoding="utf-8")
            tmp.replace(self.path)


_CHECK_LEVEL = {"none": 0, "header": 1, "decode": 2}
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


def read_karpathy(
    annotations: str | Path,
    images_root: str | Path | None = None,
    *,
    max_words: int = 16,
    restval_split: str = "train",
    image_check: str = "header",
    max_reject_fraction: float = 0.01,
    hash_workers: int = 4,
    hash_cache: str | Path | None = None,
    progress: bool = False,
) -> Dataset:
    """Read and validate a Karpathy JSON (+ images root when given). See the module docstring."""
    if restval_split not in (*SPLITS, "drop"):
        raise ValueError(f"restval_split must be one of train/val/test/drop, got {restval_split!r}")
    if image_check not in _CHECK_LEVEL:
        raise ValueError(f"image_check must be one of {sorted(_CHECK_LEVEL)}, got {image_check!r}")
    path = Path(annotations)
    # entries are parsed one at a time: a COCO-sized file is never in memory as Python objects (only what is kept)
    raw_images = iter_array_field(path, "images", "annotation", DatasetError, DatasetError)

    rejected: list[Rejection] = []
    dropped: list[Rejection] = []
    excluded: list[Rejection] = []
    candidates: list[tuple[int, ImageEntry]] = []
    first_seen: dict[int, int] = {}
    n = 0
    for idx, entry in enumerate(raw_images):
        n = idx + 1
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
        if image_id in first_seen:
            rejected.append(
                Rejection(idx, image_id, rel,
                          f"duplicate image_id {image_id} (first at images[{first_seen[image_id]}])")
            )
            continue
        first_seen[image_id] = idx
        if split == "restval":
            if restval_split == "drop":
                excluded.append(Rejection(idx, image_id, rel, "restval entry excluded (dataset.restval_split=drop)"))
                continue
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
            continue
        candidates.append((idx, ImageEntry(image_id, rel, split, caps, sids)))

    files_checked = images_root is not None
    if files_checked:
        root = Path(images_root)
        if not root.is_dir():
            raise DatasetError(f"images root {root} is not a folder")
        cache = FileHashCache(hash_cache)
        real_root = root.resolve()

        def check(batch: list[tuple[int, ImageEntry]]) -> list[tuple[int, str, str | None]]:
            return [_check_file(root / e.file, image_check, cache, real_root) for _, e in batch]

        # files in batches: one pool task per file costs more than hashing a cached or small file
        step = 64
        batches = [candidates[i: i + step] for i in range(0, len(candidates), step)]
        results: list[tuple[int, str, str | None]] = []
        with ThreadPoolExecutor(max_workers=hash_workers) as pool, progress_bar(
                total=len(candidates), desc="checking images", enabled=progress, unit="img") as bar:
            for got in pool.map(check, batches):
                results += got
                bar.update(len(got))
        cache.save()
        kept: list[ImageEntry] = []
        for (idx, e), (size, digest, reason) in zip(candidates, results, strict=True):
            if reason:
                rejected.append(Rejection(idx, e.image_id, e.file, reason))
            else:
                e.size, e.sha256 = size, digest
                kept.append(e)
    else:
        kept = [e for _, e in candidates]
    rejected.sort(key=lambda r: r.entry)

    ds = Dataset(
        images=sorted(kept, key=lambda e: e.image_id),
        rejected=rejected,
        dropped_captions=dropped,
        excluded=excluded,
        source=str(path),
        # absolute: the normalised dataset is read by other processes too (Dask workers), in other directories
        images_root=os.path.abspath(images_root) if images_root is not None else None,
        files_checked=files_checked,
        entries=n,
    )
    if n and len(rejected) / n > max_reject_fraction:
        listing = "\n".join(f"  images[{r.entry}] image_id={r.image_id} {r.file}: {r.reason}" for r in rejected)
        raise DatasetError(
            f"{path}: {len(rejected)} of {n} entries are bad ({len(rejected) / n:.1%} > "
            f"dataset.max_reject_fraction={max_reject_fraction}):\n{listing}\n"
            "Fix or remove these entries, or raise dataset.max_reject_fraction to skip them."
        )
    for r in rejected:
        log.warning("rejected images[%d] image_id=%s %s: %s", r.entry, r.image_id, r.file, r.reason)
    if not ds.images:
        raise DatasetError(f"{path}: no usable images")
    ds.digest = dataset_digest(ds)
    return ds


def dataset_digest(ds: Dataset) -> str:
    """sha256 over the normalised annotations and every kept image file's size and content hash."""
    h = hashlib.sha256()
    h.update(FORMAT_VERSION.encode())
    for e in ds.images:  # sorted by image_id
        rec = [e.image_id, e.file, e.split, e.captions, e.size, e.sha256]
        h.update(json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()
