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

What the store holds is not trusted: every name used as a key (a document, a tree, a blob) and every file name a
manifest lists must be a relative path that stays inside its root (no absolute path, no ``..``), a blob's name must
be a sha256, and a tree is materialised only inside its local folder - a bucket that someone else can write cannot
make capflow read, write or delete anything outside the store or the workdir. A blob whose content or size does not
match its name is refused when read and replaced when published again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from captioning.errors import CapflowError
from captioning.util import inside, safe_relative

BLOB_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


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
        self._known: dict[str, int] = {}  # blobs known to be stored -> their stored size

    def __repr__(self) -> str:
        return f"ObjectStore({self.uri!r})"

    def key(self, *parts: str) -> str:
        """The store key of the name ``parts`` (joined with ``/``), which must stay inside the store."""
        try:
            return "/".join([self.root, safe_relative("/".join(parts), f"{self.uri}: an object name")])
        except ValueError as e:
            raise ObjectStoreError(str(e)) from None

    def _blob(self, sha: str) -> str:
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise ObjectStoreError(f"{self.uri}: {sha!r} is not a blob name (a sha256 in hex)")
        return self.key("blobs", sha)

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
            found = self.fs.find(self.key("blobs"), detail=True)
        except FileNotFoundError:
            found = {}
        self._known.update((n.rsplit("/", 1)[-1], int(info.get("size") or 0)) for n, info in found.items())
        return set(self._known)

    def has_blob(self, sha: str) -> bool:
        return self._stored_size(sha) is not None

    def _stored_size(self, sha: str) -> int | None:
        if sha not in self._known:
            try:
                self._known[sha] = int(self.fs.size(self._blob(sha)))
            except FileNotFoundError:
                return None
        return self._known[sha]

    def put_blob(self, path: str | Path, sha: str | None = None) -> str:
        """Store the file's contents (unless a blob of that name and size is stored: one of another size is damaged
        and replaced); returns its sha256."""
        path = Path(path)
        sha = sha or self.sha256(path)
        size = path.stat().st_size
        if self._stored_size(sha) != size:
            self._put_file(path, self._blob(sha))
            self._known[sha] = size
        return sha

    def drop_blob(self, sha: str) -> None:
        """Remove a damaged blob (the next publish of a file with that content stores it again)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._blob(sha))
        self._known.pop(sha, None)

    def get_blob(self, sha: str, dest: str | Path) -> Path:
        """The blob written to ``dest`` (atomically), after checking its content against its name."""
        dest = Path(dest)
        key = self._blob(sha)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            try:
                self.fs.get_file(key, str(tmp))
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
        """The tree ``rel``'s files: relative name -> [sha256, size], every entry checked (a name that leaves the
        tree, a blob name that is not a sha256 or a size that is not a count makes the manifest damaged)."""
        where = f"{self.uri}/{self._manifest_name(rel)}"
        doc = self.get_json(self._manifest_name(rel))
        if doc is None:
            return None
        files = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(files, dict):
            raise ObjectStoreError(f"{where} is not a manifest")
        for name, entry in files.items():
            try:
                safe_relative(name, f"{where}: a file name")
            except ValueError as e:
                raise ObjectStoreError(str(e)) from None
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and _SHA256.fullmatch(entry[0]) and isinstance(entry[1], int) and entry[1] >= 0):
                raise ObjectStoreError(f"{where}: entry {name!r} is not [sha256, size]")
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
            if name and not inside(local, dest.parent):  # a folder of the tree is a link out of it
                raise ObjectStoreError(f"{self.uri}: {rel}/{name} would be written outside {local} (a symbolic "
                                       "link in the way); remove the link and run again")
            if dest.is_file() and not dest.is_symlink() and dest.stat().st_size == size and self.sha256(dest) == sha:
                continue
            self.get_blob(sha, dest)
        return True

    def check(self, rels: Iterable[str] | None = None, content: bool = True,
              damaged: set[str] | None = None) -> list[str]:
        """Problems with the trees ``rels`` (default: every tree): a missing manifest or blob, a blob of the wrong
        size or (``content``) content - those blobs' names are added to ``damaged``. Empty: intact."""
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
                key = self._blob(sha)
                try:
                    got_size = self.fs.size(key)
                except FileNotFoundError:
                    problems.append(f"{rel}/{name}: blob {sha[:16]} missing")
                    continue
                if got_size != size:
                    problems.append(f"{rel}/{name}: blob {sha[:16]} holds {got_size} bytes, not {size}")
                    if damaged is not None:
                        damaged.add(sha)
                elif content:
                    h = hashlib.sha256()
                    with self.fs.open(key, "rb") as f:
                        while block := f.read(BLOB_CHUNK):
                            h.update(block)
                    if h.hexdigest() != sha:
                        problems.append(f"{rel}/{name}: blob {sha[:16]} is damaged")
                        if damaged is not None:
                            damaged.add(sha)
        return problems
