"""The image hash cache of ingest: sha256 of image files keyed by path, valid while the file's size and mtime are
unchanged (and only for a check at least as strict as the one asked), so re-ingesting an unchanged tree re-reads
nothing.

An SQLite file, looked up one file at a time and written in batches: its memory stays flat whatever the number of
images (the JSON dict of earlier versions held every path, ~300 bytes an image). Caches of earlier versions
(``file_hashes.json``) are not read: the first ingest after an upgrade hashes once more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from pathlib import Path

log = logging.getLogger(__name__)

CHECK_LEVEL = {"none": 0, "header": 1, "decode": 2}
_BATCH = 4096  # puts written per transaction


class FileHashCache:
    """``get``/``put`` from any thread; ``save`` writes what is pending. ``path`` None: a cache that remembers
    nothing."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._pending: list[tuple[str, int, int, str, str]] = []
        self._db: sqlite3.Connection | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        assert self.path is not None
        if self.path.is_symlink():  # never written through a link planted at the name
            log.warning("hash cache %s is a symbolic link: replaced by a file", self.path)
            self.path.unlink()
        try:
            return self._connect()
        except sqlite3.DatabaseError:
            log.warning("ignoring unreadable hash cache %s (not an SQLite database): started afresh", self.path)
            self.path.unlink()
            return self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, timeout=60)
        try:
            db.execute("CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, size INTEGER NOT NULL, "
                       "mtime_ns INTEGER NOT NULL, sha256 TEXT NOT NULL, mode TEXT NOT NULL)")
            db.commit()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def get(self, p: Path, st: os.stat_result, mode: str) -> str | None:
        """The cached hash if the file is unchanged and passed a check at least as strict as ``mode``."""
        if self._db is None:
            return None
        with self._lock:
            row = self._db.execute("SELECT size, mtime_ns, sha256, mode FROM files WHERE path = ?",
                                   (str(p),)).fetchone()
        if (row and row[0] == st.st_size and row[1] == st.st_mtime_ns
                and CHECK_LEVEL.get(row[3], -1) >= CHECK_LEVEL[mode]):
            return row[2]
        return None

    def put(self, p: Path, st: os.stat_result, digest: str, mode: str) -> None:
        if self._db is None:
            return
        with self._lock:
            self._pending.append((str(p), st.st_size, st.st_mtime_ns, digest, mode))
            if len(self._pending) >= _BATCH:
                self._write()

    def _write(self) -> None:
        assert self._db is not None
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)", self._pending)
        self._pending = []

    def entries(self) -> dict[str, tuple[int, int, str, str]]:
        """Every cached file: path -> (size, mtime_ns, sha256, mode) (for tests and inspection; small caches)."""
        if self._db is None:
            return {}
        with self._lock:
            return {r[0]: tuple(r[1:]) for r in self._db.execute("SELECT * FROM files")}

    def save(self) -> None:
        if self._db is not None:
            with self._lock:
                if self._pending:
                    self._write()

    def close(self) -> None:
        self.save()
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
