"""A run's outputs on an object store (``run.store``: ``s3://bucket/prefix``, or a local folder), for workers that
share nothing with the flow but that store.

Layout under the store's URI:

```
blobs/<sha256>                 file contents, addressed by their sha256 (written once, never replaced)
trees/<relative path>.json     a folder (or file) of the workdir: {"files": {name: [sha256, size]}} - its manifest
stages/<stage>-<key20>.json    stage records (written by tasks.cache.StageCache)
```

Nothing half-written is ever read as complete: a blob is checked against its name when it is read; a manifest is
written (one PUT, atomic on S3; temp + rename on a local folder) only after every blob it names is stored, and a
stage record only after the manifests of every path it names. Replacing a manifest (a stage folder published again
after another epoch) never touches the blobs a reader of the older manifest is fetching.

Credentials and the endpoint come from the environment only (``AWS_*``, ``AWS_ENDPOINT_URL``), as for the feature
stores.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from captioning.errors import CapflowError

BLOB_CHUNK = 1 << 20


class ObjectStoreError(CapflowError, RuntimeError):
    """A run-store object is missing, damaged or unreadable."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOB_CHUNK):
            h.update(block)
    return h.hexdigest()


def _hidden(name: str) -> bool:
    """Temporary files of atomic writes (``.<name>.<pid>.tmp``, ``*.tmp``): never published."""
    return name.startswith(".") or name.endswith(".tmp")


class ObjectStore:
    """Blobs, manifests and JSON documents under one URI (see the module docstring)."""

    def __init__(self, uri: str):
        import fsspec

        from captioning.data.stores import storage_options_for

        if not uri or "\0" in uri:
            raise ObjectStoreError(f"not a store URI: {uri!r}")
        self.uri = uri.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.uri, **(storage_options_for(self.uri) or {}))
        self.root = root.rstrip("/")
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self._hashes: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256
        self._known: set[str] = set()  # blobs known to be stored

    def __repr__(self) -> str:
        return f"ObjectStore({self.uri!r})"

    def key(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # ------------------------------------------------------------------ blobs
    def sha256(self, path: Path) -> str:
        st = path.stat()
        k = (str(path), st.st_size, st.st_mtime_ns)
        if k not in self._hashes:
            self._hashes[k] = file_sha256(path)
        return self._hashes[k]

    def stored_blobs(self) -> set[str]:
        """Every blob's name (one listing; used to skip uploads of what is there)."""
        self.fs.invalidate_cache()  # s3fs keeps listings: other processes write here
        try:
            names = self.fs.find(self.key("blobs"))
        except FileNotFoundError:
            names = []
        self._known.update(n.rsplit("/", 1)[-1] for n in names)
        return set(self._known)

    def has_blob(self, sha: str) -> bool:
        if sha in self._known:
            return True
        if self.fs.exists(self.key("blobs", sha)):
            self._known.add(sha)
            return True
        return False

    def put_blob(self, path: str | Path, sha: str | None = None) -> str:
        """Store the file's contents (if not stored yet); returns its sha256."""
        path = Path(path)
        sha = sha or self.sha256(path)
        if not self.has_blob(sha):
            self._put_file(path, self.key("blobs", sha))
            self._known.add(sha)
        return sha

    def get_blob(self, sha: str, dest: str | Path) -> Path:
        """The blob written to ``dest`` (atomically), after checking its content against its name."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            try:
                self.fs.get_file(self.key("blobs", sha), str(tmp))
            except FileNotFoundError:
                raise ObjectStoreError(f"{self.uri}: blob {sha} is missing (named by a manifest)") from None
            got = file_sha256(tmp)
            if got != sha:
                raise ObjectStoreError(f"{self.uri}: blob {sha} is damaged (its content hashes to {got})")
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return dest

    def _put_file(self, path: Path, key: str) -> None:
        if self.local:  # a local folder: temp + rename (an S3 PUT is all-or-nothing by itself)
            tmp = f"{key}.{uuid.uuid4().hex[:8]}.tmp"
            self.fs.makedirs(key.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), tmp)
            self.fs.mv(tmp, key)
        else:
            self.fs.put_file(str(path), key)

    # ------------------------------------------------------------------ documents
    def put_json(self, name: str, doc: Any) -> None:
        data = json.dumps(doc, sort_keys=True, default=str).encode("utf-8")
        key = self.key(name)
        if self.local:
            tmp = f"{key}.{uuid.uuid4().hex[:8]}.tmp"
            self.fs.makedirs(key.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, key)
        else:
            self.fs.pipe_file(key, data)

    def get_json(self, name: str) -> Any | None:
        """The document, or None when there is none."""
        try:
            data = self.fs.cat_file(self.key(name))
        except FileNotFoundError:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise ObjectStoreError(f"{self.uri}/{name} is not valid JSON ({e})") from None

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.key(name))

    def documents(self, prefix: str) -> list[tuple[str, float]]:
        """(name relative to the store, modification time) of the documents under ``prefix``, newest first."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.key(prefix), detail=True)
        except FileNotFoundError:
            return []
        out = []
        for full, info in found.items():
            name = full[len(self.root) + 1:] if full.startswith(self.root + "/") else full
            if _hidden(name.rsplit("/", 1)[-1]):
                continue
            t = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
            out.append((name, t.timestamp() if hasattr(t, "timestamp") else float(t)))
        return sorted(out, key=lambda x: x[1], reverse=True)

    # ------------------------------------------------------------------ trees (a workdir folder or file)
    @staticmethod
    def _manifest_name(rel: str) -> str:
        return f"trees/{rel.strip('/')}.json"

    def publish(self, rel: str, local: str | Path) -> dict[str, list]:
        """Store the file or folder ``local`` as the tree ``rel``: its blobs, then its manifest."""
        local = Path(local)
        if local.is_file():
            files = {"": local}
        elif local.is_dir():
            files = {p.relative_to(local).as_posix(): p for p in sorted(local.rglob("*"))
                     if p.is_file() and not any(_hidden(part) for part in p.relative_to(local).parts)}
        else:
            raise ObjectStoreError(f"nothing to publish at {local}")
        if len(files) > 8 and not self._known:
            self.stored_blobs()  # one listing instead of a HEAD per file
        manifest = {name: [self.put_blob(p), p.stat().st_size] for name, p in files.items()}
        self.put_json(self._manifest_name(rel), {"files": manifest})
        return manifest

    def forget(self, rel: str) -> None:
        """Remove the tree ``rel``'s manifest (its blobs stay: other manifests may name them)."""
        self.delete(self._manifest_name(rel))

    def manifest(self, rel: str) -> dict[str, list] | None:
        doc = self.get_json(self._manifest_name(rel))
        if doc is None:
            return None
        files = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(files, dict):
            raise ObjectStoreError(f"{self.uri}/{self._manifest_name(rel)} is not a manifest")
        return files

    def fetch(self, rel: str, local: str | Path) -> bool:
        """The tree ``rel`` materialised at ``local`` (files already there with the same content are kept);
        False when the store has no such tree."""
        files = self.manifest(rel)
        if files is None:
            return False
        local = Path(local)
        for name, (sha, size) in files.items():
            dest = local / name if name else local
            if dest.is_file() and dest.stat().st_size == size and self.sha256(dest) == sha:
                continue
            self.get_blob(sha, dest)
        return True

    def check(self, rels: Iterable[str] | None = None, content: bool = True) -> list[str]:
        """Problems with the trees ``rels`` (default: every tree): a missing manifest or blob, a blob of the wrong
        size or (``content``) content. Empty: intact."""
        problems = []
        self.fs.invalidate_cache()
        if rels is None:
            rels = [n[len("trees/"):-len(".json")] for n, _ in self.documents("trees") if n.endswith(".json")]
        for rel in rels:
            try:
                files = self.manifest(rel)
            except ObjectStoreError as e:
                problems.append(str(e))
                continue
            if files is None:
                problems.append(f"{rel}: no manifest in {self.uri}")
                continue
            for name, (sha, size) in files.items():
                key = self.key("blobs", sha)
                try:
                    got_size = self.fs.size(key)
                except FileNotFoundError:
                    problems.append(f"{rel}/{name}: blob {sha[:16]} missing")
                    continue
                if got_size != size:
                    problems.append(f"{rel}/{name}: blob {sha[:16]} holds {got_size} bytes, not {size}")
                elif content:
                    h = hashlib.sha256()
                    with self.fs.open(key, "rb") as f:
                        while block := f.read(BLOB_CHUNK):
                            h.update(block)
                    if h.hexdigest() != sha:
                        problems.append(f"{rel}/{name}: blob {sha[:16]} is damaged")
        return problems
