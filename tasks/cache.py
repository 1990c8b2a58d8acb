"""Stage-level caching: a stage whose key (its inputs' digests + its config section + the code version) is
unchanged returns its recorded result instead of running again.

Results are small JSON documents (URIs, digests, run ids, metrics) kept under ``<workdir>/stages/``; a result is
written only after the stage has finished, so a crashed stage runs again (and resumes from its own checkpoints
or chunk status). The key covers everything a stage writes, so a cached stage never hides a changed output
(the trap of caching side-effecting tasks on inputs alone).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from captioning.data.stores import CorruptDataError
from captioning.objectstore import ObjectStoreError
from captioning.util import atomic_write, safe_relative, source_digest
from captioning.workdir import Workdir
from tasks.refs import RecordMismatch, Ref

log = logging.getLogger("capflow.pipeline")
R = TypeVar("R", bound=Ref)
#: the shape of the stage records (tasks/refs.py); a change re-keys every stage instead of misreading old records
RECORD_VERSION = 2

#: the library code each stage's output depends on (a change there invalidates the stage and what follows)
STAGE_CODE: dict[str, tuple[str, ...]] = {
    "ingest": ("captioning/data",),
    "extract": ("captioning/features", "captioning/data/stores", "captioning/data/synthetic_features.py"),
    "vocab": ("captioning/data",),
}
TRAINING_CODE = ("captioning",)
REPO_ROOT = Path(__file__).resolve().parents[1]


@cache
def code_version(*paths: str) -> str:
    """Digest of the sources under ``paths`` (relative to the repository; default: the whole library)."""
    try:
        return source_digest(REPO_ROOT, *(paths or ("captioning",)))[:16]
    except FileNotFoundError as e:  # STAGE_CODE names a moved module
        raise FileNotFoundError(f"code_version: {e}") from None


class StageRecordError(CorruptDataError):
    """A stage record under ``<workdir>/stages/`` cannot be read (truncated, overwritten)."""


def read_record(path: str | Path) -> dict[str, Any]:
    """A stage record ``{"stage", "key", "result"}``; a damaged one raises :class:`StageRecordError` naming the
    file and the repair."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
        if not (isinstance(doc, dict) and isinstance(doc.get("key"), str) and isinstance(doc.get("result"), dict)):
            raise ValueError("not a stage record: expected an object with 'key' and 'result'")
    except (UnicodeDecodeError, ValueError) as e:
        raise StageRecordError(
            f"stage record {p} is damaged ({type(e).__name__}: {e}). Remove it - or run `capflow verify --repair "
            f"{p.parent.parent}`, which removes every damaged record of that workdir - and run again: the stage "
            "then runs again instead of being reused") from None
    return doc


def stage_key(stage: str, **parts: Any) -> str:
    code = code_version(*STAGE_CODE.get(stage, TRAINING_CODE))
    blob = json.dumps({"stage": stage, "code": code, "record": RECORD_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


#: the fields of the stage results that hold a file path or a store URI
PATH_FIELDS = frozenset({"path", "rejects_path", "uri", "vocab_path", "labels_uri", "features_uri", "checkpoint",
                         "predictions", "references", "xe_predictions"})
#: how a record on the run store names a path inside the workdir (each reader's own workdir)
PORTABLE = "@run/"
#: workdir folders published whole, by their first two path components (a stage folder, a store, a dataset's images)
TREE_ROOTS = ("runs", "features", "synthetic")


def portable_rel(value: str, what: str) -> str:
    """The workdir-relative path of a portable ``@run/...`` value read from a record; a path that would leave the
    workdir makes the record a :class:`RecordMismatch` (not this stage's: it runs again), never a file outside."""
    try:
        return safe_relative(value[len(PORTABLE):], f"a {what} record")
    except ValueError as e:
        raise RecordMismatch(str(e)) from None


def tree_of(rel: str) -> str:
    """The published tree a workdir path belongs to: ``runs/<stage>-<key>``, ``features/<store>``, ... or the file."""
    parts = rel.split("/")
    return "/".join(parts[:2]) if parts[0] in TREE_ROOTS and len(parts) > 1 else rel


class LocalRecords:
    """The run-store strategy without a run store: :class:`captioning.objectstore.ObjectStore`'s interface doing
    nothing - records and outputs live in the workdir only (workers share its filesystem). With ``run.store`` the
    store itself is the strategy: records and outputs mirrored to it, what one machine finished another finds."""

    uri = None

    def publish(self, rel: str, local: Path) -> None: ...
    def put_json(self, name: str, doc: Any) -> None: ...
    def delete(self, name: str) -> None: ...
    def forget(self, rel: str) -> None: ...

    def get_json(self, name: str) -> None:
        return None

    def fetch(self, rel: str, local: Path) -> bool:
        return False

    def documents(self, prefix: str) -> list[tuple[str, float]]:
        return []

    def has_blob(self, sha: str) -> bool:
        return False


class StageCache:
    """Stage records under ``<workdir>/stages/``: the typed result (:mod:`tasks.refs`) of each finished stage.

    With a run store (``run.store``, :class:`captioning.objectstore.ObjectStore`) the workdir is a local cache of
    it: a finished stage publishes the workdir folders its result names (``runs/<stage>-<key16>/``, a dataset file,
    a feature store) and then its record, with those paths relative to the workdir (``@run/...``); a record found
    only on the store is materialised - folders fetched, paths made this workdir's - before it is returned. A stage
    folder is fetched when the stage starts (a killed attempt on another machine resumes from its checkpoints) and
    published again by :meth:`sync` (after every epoch)."""

    def __init__(self, workdir: str | Path, store: Any = None):
        from captioning.objectstore import ObjectStore

        self.workdir_layout = Workdir(workdir)
        self.root = self.workdir_layout.stages()
        store = ObjectStore(store) if isinstance(store, str) else store
        #: where records are mirrored besides the workdir (the run store, or nowhere): chosen once, here
        self.records: Any = store if store is not None else LocalRecords()
        self.mirrored = store is not None

    @property
    def store(self) -> Any:
        """The run store (None without one)."""
        return self.records if self.mirrored else None

    @classmethod
    def of(cls, cfg: Any) -> StageCache:
        """The stage cache of a config: its workdir, and its run store when ``run.store`` is set."""
        return cls(cfg.run.workdir, cfg.run.store)

    def path(self, stage: str, key: str) -> Path:
        return self.workdir_layout.record(stage, key)

    def get(self, stage: str, key: str, kind: type[R]) -> R | None:
        """The recorded result of ``stage`` under ``key``, or None (never run, another key, another shape)."""
        p = self.path(stage, key)
        if not p.exists():
            return self._from_store(stage, key, kind)
        doc = read_record(p)
        if doc["key"] != key:
            return None
        try:
            return kind.from_record(doc["result"])
        except RecordMismatch as e:
            log.warning("%s: %s; the stage runs again", p, e)
            return None

    def put(self, stage: str, key: str, result: Ref) -> None:
        self._write_local(stage, key, result)
        for tree in self.trees(result):  # the outputs first: a record on the store names only complete trees
            self.records.publish(tree, self.workdir_layout.root / tree)
        self.records.put_json(self._store_name(stage, key), {"stage": stage, "key": key,
                                                             "result": self.portable(result).to_record()})

    def _write_local(self, stage: str, key: str, result: Ref) -> None:
        p = self.path(stage, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        doc = json.dumps({"stage": stage, "key": key, "result": result.to_record()}, default=str)
        atomic_write(p, lambda f: f.write(doc.encode("utf-8")), "stage record")  # no temp file left behind

    def forget(self, stage: str, key: str) -> None:
        """Drop the record and the folder of ``stage`` under ``key`` (the stage then runs from scratch, not from
        its checkpoints)."""
        self.path(stage, key).unlink(missing_ok=True)
        folder = self.workdir_layout.stage_dir(stage, key)
        shutil.rmtree(folder, ignore_errors=True)
        self.records.delete(self._store_name(stage, key))
        self.records.forget(self._relative(str(folder)) or "")

    def latest(self, stage: str, kind: type[R]) -> R | None:
        """The most recently written readable record of ``stage`` (what single-stage commands fall back to);
        ``stage`` may end in ``*`` (``student-*``: any student). The workdir's records first, then the store's."""
        prefix = stage[:-1] if stage.endswith("*") else None
        if self.root.is_dir():
            pattern = f"{prefix}*.json" if prefix is not None else f"{stage}-*.json"
            for p in sorted(self.root.glob(pattern), key=lambda q: q.stat().st_mtime, reverse=True):
                try:
                    doc = read_record(p)
                    name = str(doc.get("stage", ""))
                    if name == stage or (prefix is not None and name.startswith(prefix)):
                        return kind.from_record(doc["result"])
                except (StageRecordError, RecordMismatch):
                    continue
        for name, _ in self.records.documents("stages"):
            base = name.rsplit("/", 1)[-1]
            if not base.startswith(prefix if prefix is not None else f"{stage}-"):
                continue
            doc = self.records.get_json(name)
            if not isinstance(doc, dict) or not isinstance(doc.get("result"), dict):
                continue
            got = str(doc.get("stage", ""))
            if got == stage or (prefix is not None and got.startswith(prefix)):
                try:
                    return self.materialise(kind.from_record(doc["result"]))
                except RecordMismatch:
                    continue
        return None

    def workdir(self, stage: str, key: str) -> Path:
        """A private folder for the stage's outputs (checkpoints), stable across re-runs with the same key; with a
        run store, what an earlier attempt published of it is fetched first."""
        d = self.workdir_layout.stage_dir(stage, key)
        rel = self._relative(str(d))
        if rel and self.records.fetch(rel, d):
            log.info("%s: resumed from %s", d, self.records.uri)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def sync(self, path: str | Path) -> None:
        """Publish the workdir tree holding ``path`` to the run store again (nothing without one)."""
        rel = self._relative(str(path))
        if rel is not None:
            tree = tree_of(rel)
            self.records.publish(tree, self.workdir_layout.root / tree)

    def blob(self, sha256: str, dest: Path) -> Path | None:
        """A content-addressed file of the run store (the images extraction put there) at ``dest``; None when it is
        not there (or there is no run store)."""
        return Path(self.records.get_blob(sha256, dest)) if self.records.has_blob(sha256) else None

    def shipped(self, ref: R) -> R:
        """``ref`` as another process receives it: its workdir paths ``@run/...`` when the records are mirrored
        (the receiver materialises them from the run store), else absolute (it shares this filesystem)."""
        if self.mirrored:
            return self.portable(ref)
        fields = {k: os.path.abspath(v) for k, v in self._paths(ref).items() if "://" not in v}
        return dataclasses.replace(ref, **fields) if fields else ref

    # ------------------------------------------------------------------ the run store's form of a record
    def _store_name(self, stage: str, key: str) -> str:
        return f"stages/{self.path(stage, key).name}"

    def _from_store(self, stage: str, key: str, kind: type[R]) -> R | None:
        doc = self.records.get_json(self._store_name(stage, key))
        if doc is None:
            return None
        if not (isinstance(doc, dict) and doc.get("key") == key and isinstance(doc.get("result"), dict)):
            log.warning("%s/%s is not a record of this stage; the stage runs again", self.records.uri,
                        self._store_name(stage, key))
            return None
        try:
            result = self.materialise(kind.from_record(doc["result"]))
        except RecordMismatch as e:
            log.warning("%s/%s: %s; the stage runs again", self.records.uri, self._store_name(stage, key), e)
            return None
        self._write_local(stage, key, result)
        return result

    def _relative(self, value: str) -> str | None:
        """``value`` relative to the workdir (posix), or None: a URI, or a path outside it."""
        if not value or "://" in value:
            return None
        root = os.path.abspath(self.workdir_layout.root)
        p = os.path.abspath(value)
        if p == root or not p.startswith(root + os.sep):
            return None
        return Path(os.path.relpath(p, root)).as_posix()

    def _paths(self, ref: Ref) -> dict[str, str]:
        return {f.name: getattr(ref, f.name) for f in dataclasses.fields(ref)
                if f.name in PATH_FIELDS and isinstance(getattr(ref, f.name), str)}

    def trees(self, ref: Ref) -> list[str]:
        """The workdir trees a result names (what must be on the store before its record)."""
        rels = [r for v in self._paths(ref).values() if (r := self._relative(v)) is not None]
        return sorted({tree_of(r) for r in rels})

    def portable(self, ref: R) -> R:
        """``ref`` with its paths inside the workdir written ``@run/<relative path>``."""
        fields = {k: PORTABLE + r for k, v in self._paths(ref).items() if (r := self._relative(v)) is not None}
        return dataclasses.replace(ref, **fields) if fields else ref

    def materialise(self, ref: R) -> R:
        """A portable ``ref`` made this workdir's: the trees it names fetched from the run store, its
        ``@run/...`` paths under this workdir."""
        rels = {k: portable_rel(v, type(ref).__name__) for k, v in self._paths(ref).items() if v.startswith(PORTABLE)}
        if not rels:
            return ref
        if not self.mirrored:
            raise ObjectStoreError(f"a {type(ref).__name__} names run-store paths ({sorted(rels.values())}) but "
                                   "no run.store is configured")
        root = self.workdir_layout.root
        for tree in sorted({tree_of(r) for r in rels.values()}):
            if not self.records.fetch(tree, root / tree):
                raise ObjectStoreError(f"{self.records.uri} has no {tree}, which a {type(ref).__name__} names")
        return dataclasses.replace(ref, **{k: str(root / r) for k, r in rels.items()})
