"""``capflow verify``: check a workdir's feature and label stores, stage records and checkpoints; with ``repair``,
leave things so that the next ``capflow extract`` / ``capflow run`` redoes exactly what is damaged.

What is checked, and what repair does:

- feature stores: every finished chunk's values against the checksums recorded when it was written (a file that
  cannot be read fails too). Repair marks a damaged chunk's rows pending (re-extracted next) and removes the
  ``extract`` stage records of that store, so a cached pipeline stage cannot hide it. Stores written before
  checksums are reported "unverified"; repair records their checksums from the current values.
- label stores: the same check. A label store is rebuilt rather than patched: repair removes it, the ``vocab``
  records that name it and the ``seqkd`` records (their captions lived in it), so ``capflow run`` rebuilds them.
- stage records (``<workdir>/stages/*.json``): each must parse; a teacher record's checkpoint must still have the
  sha256 it recorded. Repair removes a damaged record (its stage runs again).
- checkpoints (``*.pt``): the zip archive torch writes, every member's CRC. Repair removes a damaged checkpoint
  and the stage records that name it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.data.stores import FEATURE_SCHEMA, LABEL_SCHEMA, FeatureStore, LabelStore, StoreError
from captioning.util import sha256_file
from tasks.cache import StageRecordError, read_record

log = logging.getLogger("capflow.pipeline")

#: folders under a workdir that hold no capflow stores, records or checkpoints worth reading
SKIP_DIRS = {"__pycache__", ".git", "prefect", "cache"}


@dataclass
class Finding:
    path: str
    kind: str  # "feature store" | "label store" | "stage record" | "checkpoint"
    state: str  # "ok" | "unverified" | "damaged" | "repaired"
    detail: str = ""
    action: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "state": self.state, "detail": self.detail,
                "action": self.action}


@dataclass
class VerifyResult:
    findings: list[Finding] = field(default_factory=list)
    bytes: int = 0  # store values read and hashed
    store_seconds: float = 0.0  # time spent on store chunks
    seconds: float = 0.0

    @property
    def damaged(self) -> list[Finding]:
        return [f for f in self.findings if f.state == "damaged"]

    def to_json(self) -> dict[str, Any]:
        return {"findings": [f.to_json() for f in self.findings], "damaged": len(self.damaged),
                "repaired": sum(f.state == "repaired" for f in self.findings),
                "unverified": sum(f.state == "unverified" for f in self.findings),
                "bytes": self.bytes, "store_seconds": round(self.store_seconds, 3),
                "seconds": round(self.seconds, 3)}


# ---------------------------------------------------------------------- discovery
def _schema(path: Path) -> str | None:
    try:
        doc = json.loads((path / "zarr.json").read_text(encoding="utf-8"))
        return (doc.get("attributes") or {}).get("schema")
    except (OSError, ValueError):
        return None


def discover(root: Path) -> tuple[list[str], list[Path], list[Path]]:
    """Stores (local folders with a capflow schema), stage records and checkpoints under ``root``."""
    stores: list[str] = []
    records: list[Path] = []
    ckpts: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if "zarr.json" in filenames and _schema(d) in (FEATURE_SCHEMA, LABEL_SCHEMA):
            stores.append(str(d))
            dirnames[:] = []
            continue
        dirnames[:] = sorted(n for n in dirnames if n not in SKIP_DIRS and (
            not n.endswith(".zarr") or _schema(d / n) in (FEATURE_SCHEMA, LABEL_SCHEMA)))
        for name in sorted(filenames):
            if name.endswith(".json") and d.name == "stages":
                records.append(d / name)
            elif name.endswith(".pt"):
                ckpts.append(d / name)
    return stores, records, ckpts


# ---------------------------------------------------------------------- checks
def check_checkpoint(path: Path) -> str | None:
    """What is wrong with a checkpoint file (None: its zip archive and every member's CRC are sound)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return f"member {bad} fails its CRC" if bad else None


def _norm(text: str) -> str:
    return text.rstrip("/") if "://" in text else os.path.realpath(text)


def _records_naming(records: Iterable[Path], *needles: str, stages: Sequence[str] = (),
                    within: Sequence[str] | None = None) -> list[Path]:
    """Readable records whose result names one of ``needles`` (a path or URI), or whose stage is in ``stages``;
    with ``within``, only records of those stages."""
    want = {_norm(n) for n in needles}
    out = []
    for p in records:
        if not p.exists():
            continue
        try:
            doc = read_record(p)
        except StageRecordError:
            continue
        values = {_norm(v) for v in doc["result"].values() if isinstance(v, str) and v}
        if within is not None and doc.get("stage") not in within:
            continue
        if doc.get("stage") in stages or want & values:
            out.append(p)
    return out


def _remove_records(paths: Iterable[Path]) -> list[str]:
    removed = []
    for p in paths:
        p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def _feature_store(uri: str, repair: bool, records: list[Path], res: VerifyResult) -> Finding:
    store = FeatureStore.open(uri, mode="r+" if repair else "r")
    rep = store.verify(repair=repair)
    res.bytes += rep.bytes
    res.store_seconds += rep.seconds
    detail = f"{rep.checked} chunks checked ({rep.bytes / 1e6:.1f} MB in {rep.seconds:.2f} s)"
    if rep.pending:
        detail += f", {rep.pending} not extracted yet"
    if rep.faults:
        detail += "; " + "; ".join(map(str, rep.faults))
        if not repair:
            return Finding(uri, "feature store", "damaged", detail,
                           f"`capflow verify --repair {uri}` marks the chunks for re-extraction")
        left = [f for f in rep.faults if f.chunk not in rep.repaired]
        # the extract record would hide the re-extraction; records built on the store are re-keyed by its digest
        removed = _remove_records(_records_naming(records, uri, within=("extract",)))
        action = (f"chunks {rep.repaired} marked pending: `capflow extract` or `capflow run` re-extracts them"
                  + (f"; removed stage records {removed}" if removed else ""))
        if left:
            return Finding(uri, "feature store", "damaged", detail, action + "; " + store.repair_hint("image_id"))
        return Finding(uri, "feature store", "repaired", detail, action)
    if rep.recorded:
        return Finding(uri, "feature store", "repaired", detail,
                       f"recorded checksums for {len(rep.recorded)} chunks written before capflow kept them "
                       "(their values could not be checked)")
    if rep.unverified:
        return Finding(uri, "feature store", "unverified",
                       f"{detail}; {len(rep.unverified)} finished chunks have no checksum (written before capflow "
                       "recorded them)", f"`capflow verify --repair {uri}` records them from the current values")
    return Finding(uri, "feature store", "ok", detail)


def _label_store(uri: str, repair: bool, records: list[Path], res: VerifyResult) -> Finding:
    store = LabelStore.open(uri, mode="r+" if repair else "r")
    rep = store.verify(record=repair)
    res.bytes += rep.bytes
    res.store_seconds += rep.seconds
    detail = f"{rep.checked} chunks checked"
    if rep.faults:
        detail += "; " + "; ".join(map(str, rep.faults))
        if not repair:
            return Finding(uri, "label store", "damaged", detail, store.repair_hint())
        removed = _remove_records(_records_naming(records, uri, stages=("seqkd",)))
        remove_store(uri)
        return Finding(uri, "label store", "repaired", detail,
                       "removed the store" + (f" and stage records {removed}" if removed else "") +
                       ": `capflow run` rebuilds it (or `capflow vocab`)")
    if rep.recorded:
        return Finding(uri, "label store", "repaired", detail,
                       f"recorded checksums for {len(rep.recorded)} chunks written before capflow kept them")
    if rep.unverified:
        return Finding(uri, "label store", "unverified", f"{detail}; {len(rep.unverified)} chunks have no checksum",
                       f"`capflow verify --repair {uri}` records them from the current values")
    return Finding(uri, "label store", "ok", detail)


def remove_store(uri: str) -> bool:
    """Remove the store at ``uri`` (a folder or an ``s3://`` prefix); False when there was none."""
    if "://" in uri:
        import fsspec

        from captioning.data.stores import storage_options_for

        fs, path = fsspec.core.url_to_fs(uri, **(storage_options_for(uri) or {}))
        if not fs.exists(path):
            return False
        fs.rm(path, recursive=True)
        return True
    existed = Path(uri).exists()
    shutil.rmtree(uri, ignore_errors=True)
    return existed


def _store(uri: str, repair: bool, records: list[Path], res: VerifyResult) -> Finding:
    try:
        return _feature_store(uri, repair, records, res)
    except StoreError as e:
        if "not a capflow feature store" not in str(e):
            return Finding(uri, "feature store", "damaged", str(e))
    try:
        return _label_store(uri, repair, records, res)
    except StoreError as e:
        return Finding(uri, "store", "damaged", str(e))


def _record(path: Path, repair: bool) -> Finding:
    try:
        doc = read_record(path)
    except StageRecordError as e:
        if repair:
            path.unlink(missing_ok=True)
            return Finding(str(path), "stage record", "repaired", str(e), "removed: the stage runs again")
        return Finding(str(path), "stage record", "damaged", str(e), f"`capflow verify --repair {path}` removes it")
    result = doc["result"]
    ckpt, digest = result.get("checkpoint"), result.get("checkpoint_digest")
    if isinstance(ckpt, str) and isinstance(digest, str) and Path(ckpt).is_file() and sha256_file(ckpt) != digest:
        detail = f"its checkpoint {ckpt} no longer has the sha256 the stage recorded ({digest[:12]}...)"
        if repair:
            path.unlink(missing_ok=True)
            return Finding(str(path), "stage record", "repaired", detail, "removed: the stage runs again")
        return Finding(str(path), "stage record", "damaged", detail, f"`capflow verify --repair {path}` removes it")
    return Finding(str(path), "stage record", "ok")


def _checkpoint(path: Path, repair: bool, records: list[Path]) -> Finding:
    problem = check_checkpoint(path)
    if problem is None:
        return Finding(str(path), "checkpoint", "ok")
    detail = f"damaged checkpoint ({problem})"
    if not repair:
        return Finding(str(path), "checkpoint", "damaged", detail,
                       f"`capflow verify --repair {path.parent}` removes it and the stage records that name it")
    removed = _remove_records(_records_naming(records, str(path)))
    path.unlink(missing_ok=True)
    return Finding(str(path), "checkpoint", "repaired", detail,
                   "removed" + (f" with stage records {removed}" if removed else "") +
                   ": the stage that wrote it trains again")


def _run_store(uri: str, repair: bool, res: VerifyResult) -> None:
    """A run store (``run.store``): every stage record parses, every workdir tree it names has its manifest and
    every blob of it is there with the content its name says; a recorded checkpoint digest is its blob's; no path in
    a record leaves the run. Repair removes a damaged record (its stage runs again; a damaged tree's manifest goes
    with it, and so do its damaged blobs, which the stage's next publish stores again)."""
    from captioning.objectstore import ObjectStore, ObjectStoreError
    from tasks.cache import PORTABLE, portable_rel, tree_of
    from tasks.refs import RecordMismatch

    store = ObjectStore(uri)
    trees: dict[str, list[str]] = {}
    damaged: set[str] = set()
    for name, _ in store.documents("stages"):
        where = f"{uri}/{name}"
        try:
            doc = store.get_json(name)
            if not (isinstance(doc, dict) and isinstance(doc.get("key"), str) and isinstance(doc.get("result"), dict)):
                raise ObjectStoreError("not a stage record")
        except ObjectStoreError as e:
            if repair:
                store.delete(name)
                res.findings.append(Finding(where, "stage record", "repaired", str(e), "removed: the stage runs again"))
            else:
                res.findings.append(Finding(where, "stage record", "damaged", str(e),
                                            "`capflow verify --repair` removes it"))
            continue
        problems = []
        result = doc["result"]
        for v in result.values():
            if isinstance(v, str) and v.startswith(PORTABLE):
                try:
                    rel = portable_rel(v, str(doc.get("stage")))
                except RecordMismatch as e:  # a path out of the run: the record is damaged, nothing else is touched
                    problems.append(str(e))
                    continue
                tree = tree_of(rel)
                if tree not in trees:
                    trees[tree] = store.check([tree], damaged=damaged)
                problems += trees[tree]
                digest = result.get("checkpoint_digest")
                if v == result.get("checkpoint") and isinstance(digest, str) and not trees[tree]:
                    files = store.manifest(tree) or {}
                    inner = rel[len(tree) + 1:] if rel != tree else ""
                    if inner in files and files[inner][0] != digest:
                        problems.append(f"{rel}: stored with sha256 {files[inner][0][:12]}..., "
                                        f"recorded {digest[:12]}...")
        if not problems:
            res.findings.append(Finding(where, "stage record", "ok"))
        elif repair:
            store.delete(name)
            res.findings.append(Finding(where, "stage record", "repaired", "; ".join(problems[:5]),
                                        "removed: the stage runs again"))
        else:
            res.findings.append(Finding(where, "stage record", "damaged", "; ".join(problems[:5]),
                                        "`capflow verify --repair` removes it (the stage runs again)"))
    if repair:
        for tree, problems in trees.items():
            if problems:
                store.forget(tree)
        for sha in damaged:  # else the stage's next publish would name the damaged blob again
            store.drop_blob(sha)


# ---------------------------------------------------------------------- entry point
def verify(paths: Sequence[str | Path], *, repair: bool = False, workdirs: Sequence[str | Path] = (),
           run_store: str | None = None) -> VerifyResult:
    """Check ``paths`` (folders are searched: stores, ``stages/*.json``, ``*.pt``; or single stores, records,
    checkpoints) and the run store ``run_store`` (its records and the trees they name). ``workdirs``: whose stage
    records a repair may remove (besides those found under ``paths``)."""
    t0 = time.perf_counter()
    res = VerifyResult()
    if run_store:
        _run_store(run_store, repair, res)
    stores: list[str] = []
    records: list[Path] = []
    ckpts: list[Path] = []
    for raw in paths:
        text = str(raw)
        p = Path(text)
        if "://" in text or (p.is_dir() and _schema(p) is not None):
            stores.append(text)
        elif p.is_dir():
            s, r, c = discover(p)
            stores += s
            records += r
            ckpts += c
        elif p.suffix == ".json":
            records.append(p)
        elif p.suffix == ".pt":
            ckpts.append(p)
        elif not p.exists():
            res.findings.append(Finding(text, "path", "damaged", "does not exist"))
        else:
            res.findings.append(Finding(text, "path", "damaged", "not a store, stage record, checkpoint or folder"))
    known = list(dict.fromkeys(records))
    for w in workdirs:
        st = Path(w) / "stages"
        if st.is_dir():
            known += [p for p in sorted(st.glob("*.json")) if p not in known]
    for p in dict.fromkeys(records):
        res.findings.append(_record(p, repair))
    for c in dict.fromkeys(ckpts):
        res.findings.append(_checkpoint(c, repair, known))
    for s in dict.fromkeys(stores):
        res.findings.append(_store(s, repair, known, res))
    res.seconds = time.perf_counter() - t0
    return res


def default_paths(cfg) -> list[str]:
    """What ``capflow verify`` checks without paths: the config's workdir, plus its feature store folder when
    that lies elsewhere (a remote one: the store of the configured settings)."""
    paths = [str(cfg.workdir)] if Path(cfg.workdir).is_dir() or not cfg.run.store else []
    base = cfg.feature_store_uri()
    if "://" in base:
        from captioning.features.naming import store_uri

        uri = store_uri(cfg)
        if FeatureStore.exists(uri):
            paths.append(uri)
    elif Path(base).is_dir() and not Path(base).resolve().is_relative_to(Path(cfg.workdir).resolve()):
        paths.append(base)
    return paths


def format_text(res: VerifyResult) -> str:
    lines = []
    for f in res.findings:
        show = f.detail if (f.state != "ok" or f.kind.endswith("store")) else ""
        lines.append(f"{f.state.upper():10s} {f.kind} {f.path}" + (f": {show}" if show else ""))
        if f.action:
            lines.append(f"{'':10s} -> {f.action}")
    counts: dict[str, int] = {}
    for f in res.findings:
        counts[f.state] = counts.get(f.state, 0) + 1
    rate = f" ({res.bytes / 1e6 / res.store_seconds:.0f} MB/s)" if res.store_seconds > 0 and res.bytes else ""
    lines.append(f"{len(res.findings)} checked: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) +
                 f"; store values read {res.bytes / 1e6:.1f} MB in {res.store_seconds:.2f} s{rate}")
    return "\n".join(lines)


def features_intact(uri: str, digest: str) -> bool:
    """For a cached ``extract`` stage: does the store still have the digest the stage recorded, and does every
    finished chunk pass its checksums? If not, a warning names what changed and the stage runs again (resuming
    the store re-extracts exactly the damaged chunks)."""
    if not FeatureStore.exists(uri):
        log.warning("extract: feature store %s is gone: extracting it again", uri)
        return False
    store = FeatureStore.open(uri)
    try:
        now = store.manifest()["digest"]
        if now != digest:
            log.warning("extract: feature store %s changed since the stage recorded it (digest %s, now %s): "
                        "extracting again", uri, digest[:12], now[:12])
            return False
        rep = store.verify()
    except StoreError as e:
        log.warning("extract: %s: extracting again", e)
        return False
    for fault in rep.faults:
        log.warning("extract: feature store %s: %s: extracting it again", uri, fault)
    return not rep.faults
