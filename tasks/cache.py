"""Stage-level caching: a stage whose key (its inputs' digests + its config section + the code version) is
unchanged returns its recorded result instead of running again.

Results are small JSON documents (URIs, digests, run ids, metrics) kept under ``<workdir>/stages/``; a result is
written only after the stage has finished, so a crashed stage runs again (and resumes from its own checkpoints
or chunk status). The key covers everything a stage writes, so a cached stage never hides a changed output
(the trap of caching side-effecting tasks on inputs alone).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from captioning.data.stores import CorruptDataError
from captioning.util import atomic_write
from captioning.workdir import Workdir
from tasks.refs import RecordMismatch, Ref

log = logging.getLogger("capflow.pipeline")
R = TypeVar("R", bound=Ref)
#: the shape of the stage records (tasks/refs.py); a change re-keys every stage instead of misreading old records
RECORD_VERSION = 2

#: the library code each stage's output depends on (a change there invalidates the stage and what follows)
STAGE_CODE: dict[str, tuple[str, ...]] = {
    "ingest": ("captioning/data",),
    "extract": ("captioning/features", "captioning/data/stores.py", "captioning/data/synthetic_features.py"),
    "vocab": ("captioning/data",),
}
TRAINING_CODE = ("captioning",)


@cache
def code_version(*paths: str) -> str:
    """Digest of the sources under ``paths`` (relative to the repository; default: the whole library)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in paths or ("captioning",):
        base = root / rel
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for p in files:
            if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


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


class StageCache:
    """Stage records under ``<workdir>/stages/``: the typed result (:mod:`tasks.refs`) of each finished stage."""

    def __init__(self, workdir: str | Path):
        self.workdir_layout = Workdir(workdir)
        self.root = self.workdir_layout.stages()

    def path(self, stage: str, key: str) -> Path:
        return self.workdir_layout.record(stage, key)

    def get(self, stage: str, key: str, kind: type[R]) -> R | None:
        """The recorded result of ``stage`` under ``key``, or None (never run, another key, another shape)."""
        p = self.path(stage, key)
        if not p.exists():
            return None
        doc = read_record(p)
        if doc["key"] != key:
            return None
        try:
            return kind.from_record(doc["result"])
        except RecordMismatch as e:
            log.warning("%s: %s; the stage runs again", p, e)
            return None

    def put(self, stage: str, key: str, result: Ref) -> None:
        p = self.path(stage, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        doc = json.dumps({"stage": stage, "key": key, "result": result.to_record()}, default=str)
        atomic_write(p, lambda f: f.write(doc.encode("utf-8")), "stage record")  # no temp file left behind

    def forget(self, stage: str, key: str) -> None:
        """Drop the record and the folder of ``stage`` under ``key`` (the stage then runs from scratch, not from
        its checkpoints)."""
        self.path(stage, key).unlink(missing_ok=True)
        shutil.rmtree(self.workdir_layout.stage_dir(stage, key), ignore_errors=True)

    def latest(self, stage: str, kind: type[R]) -> R | None:
        """The most recently written readable record of ``stage`` (what single-stage commands fall back to);
        ``stage`` may end in ``*`` (``student-*``: any student)."""
        if not self.root.is_dir():
            return None
        prefix = stage[:-1] if stage.endswith("*") else None
        pattern = f"{prefix}*.json" if prefix is not None else f"{stage}-*.json"
        for p in sorted(self.root.glob(pattern), key=lambda q: q.stat().st_mtime, reverse=True):
            try:
                doc = read_record(p)
                name = str(doc.get("stage", ""))
                if name == stage or (prefix is not None and name.startswith(prefix)):
                    return kind.from_record(doc["result"])
            except (StageRecordError, RecordMismatch):
                continue
        return None

    def workdir(self, stage: str, key: str) -> Path:
        """A private folder for the stage's outputs (checkpoints), stable across re-runs with the same key."""
        d = self.workdir_layout.stage_dir(stage, key)
        d.mkdir(parents=True, exist_ok=True)
        return d
