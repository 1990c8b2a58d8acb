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
import os
from functools import cache
from pathlib import Path
from typing import Any

from captioning.data.stores import CorruptDataError

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
    blob = json.dumps({"stage": stage, "code": code, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class StageCache:
    def __init__(self, workdir: str | Path):
        self.root = Path(workdir) / "stages"

    def path(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key[:20]}.json"

    def get(self, stage: str, key: str) -> dict[str, Any] | None:
        p = self.path(stage, key)
        if not p.exists():
            return None
        doc = read_record(p)
        return doc["result"] if doc["key"] == key else None

    def put(self, stage: str, key: str, result: dict[str, Any]) -> None:
        p = self.path(stage, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stage": stage, "key": key, "result": result}, default=str), encoding="utf-8")
        os.replace(tmp, p)

    def workdir(self, stage: str, key: str) -> Path:
        """A private folder for the stage's outputs (checkpoints), stable across re-runs with the same key."""
        d = self.root.parent / "runs" / f"{stage}-{key[:16]}"
        d.mkdir(parents=True, exist_ok=True)
        return d
