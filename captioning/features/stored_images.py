"""Images that reach extraction workers through the run store (``run.store``) instead of a shared filesystem: the
flow stores each pending image once, by content, and a chunk item names it ``blob:<sha256>``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from captioning.data.columnar import DatasetFile
from captioning.data.karpathy import Dataset
from captioning.data.tar_members import MemberError

BLOB = "blob:"  # a chunk item's image read from the run store by its sha256


def load_stored(store_uri: str, sha: str, *, min_side: int, max_pixels: int):
    """An image of the run store decoded like a file (:func:`load_rgb`); the local copy is removed afterwards. A
    store that cannot give the image raises (the chunk's task fails and runs again), it is not a rejected image."""
    from captioning.features.images import load_rgb
    from captioning.objectstore import ObjectStore

    scratch = Path(tempfile.gettempdir()) / "capflow-images"
    path = ObjectStore(store_uri).get_blob(sha, scratch / f"{sha}.{os.getpid()}")
    try:
        return load_rgb(path, min_side=min_side, max_pixels=max_pixels)
    finally:
        path.unlink(missing_ok=True)


def publish_images(store_uri: str, ds: Dataset | DatasetFile, todo: Iterable[tuple[int, list[tuple[int, str]]]]
                   ) -> Iterator[tuple[int, list[tuple[int, str]]]]:
    """The images of ``todo`` stored on the run store (each once: blobs are named by content) and the items
    rewritten ``blob:<sha256>``, for workers that share nothing with this machine but the store; a chunk at a
    time, as they are asked for. An image this machine cannot read keeps its path (the worker rejects it as
    missing)."""
    from captioning.objectstore import ObjectStore

    store = ObjectStore(store_uri)
    store.stored_blobs()
    for c, items in todo:
        sha = [e.sha256 for e in ds.entries_of([image_id for image_id, _ in items])]
        rewritten = []
        for (image_id, path), digest in zip(items, sha, strict=True):
            try:
                rewritten.append((image_id, BLOB + _put(store, path, digest or None)))
            except (OSError, MemberError):
                rewritten.append((image_id, path))
        yield c, rewritten


def _put(store, path: str, sha: str | None) -> str:
    """The image at ``path`` stored as a blob; a tar-shard member (``<shard>.tar#<offset>:<size>``, WebDataset
    ingest) is stored as its own bytes, so that a worker never needs the shard."""
    from captioning.data.tar_members import MemberRef, read_member

    ref = MemberRef.parse(path)
    if ref is None:
        return store.put_blob(path, sha)
    with tempfile.TemporaryDirectory(prefix="capflow-member-") as tmp:  # a shard member
        local = Path(tmp) / "image"
        local.write_bytes(read_member(ref))
        return store.put_blob(local, sha)
