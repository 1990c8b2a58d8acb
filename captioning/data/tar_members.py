"""An image stored as one member of a tar shard, named by its byte range: ``<shard>.tar#<offset>:<size>``.

Ingest of WebDataset shards (:mod:`captioning.data.shards`) records each image as such a reference, relative to
the images root (``shards/00012.tar#1536:48213``); the dataset joins it to the root like any file
(``Dataset.image_path``), and the image loader (:func:`captioning.features.images.load_rgb`) reads the range
straight from the shard: nothing is unpacked. ``offset`` is that of the member's data (``TarInfo.offset_data``),
``size`` its length.

A reference is checked before a byte is trusted: the shard is a regular file (inside the images root when the
root is given), the range lies inside the file, the data starts on a tar block and the 512-byte block before it
is a valid tar header (checksum) of a regular member of exactly ``size`` bytes. Stdlib only: image decoder
processes import this.
"""

from __future__ import annotations

import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from captioning.errors import InputError

BLOCK = tarfile.BLOCKSIZE  # 512
_REF = re.compile(r"(?P<shard>.+\.tar)#(?P<offset>[0-9]{1,15}):(?P<size>[0-9]{1,15})", re.DOTALL)


class MemberError(InputError, ValueError):
    """A member reference that cannot be read; the message says why (an image's reject reason)."""


@dataclass(frozen=True)
class MemberRef:
    """The bytes ``[offset, offset + size)`` of the tar file ``shard`` (a path: relative to the images root in a
    dataset, absolute once joined to it)."""

    shard: str
    offset: int
    size: int

    def __str__(self) -> str:
        return f"{self.shard}#{self.offset}:{self.size}"

    @classmethod
    def parse(cls, text: str | os.PathLike) -> MemberRef | None:
        """The reference ``text`` names, or None when it is a plain path (no ``.tar#<offset>:<size>`` ending)."""
        m = _REF.fullmatch(os.fspath(text))
        if m is None:
            return None
        return cls(m["shard"], int(m["offset"]), int(m["size"]))

    def relative_ok(self) -> bool:
        """Whether the shard part is a clean relative path (no root, no ``..``): what a dataset may record."""
        p = PurePosixPath(self.shard)
        return not p.is_absolute() and ".." not in p.parts and "\\" not in self.shard and "\0" not in self.shard


def read_member(ref: MemberRef, root: str | Path | None = None) -> bytes:
    """The member's bytes after the checks of the module docstring; :class:`MemberError` naming the fault.
    With ``root``, a relative shard is taken below it and the shard's real path must stay inside it."""
    path = Path(ref.shard)
    if ".." in path.parts:
        raise MemberError(f"shard path {ref.shard!r} climbs out of its folder ('..'): refused")
    if root is not None:
        if path.is_absolute():
            raise MemberError(f"shard path {ref.shard!r} must be relative to the images root")
        path = Path(root) / path
        try:
            real, real_root = path.resolve(), Path(root).resolve()
        except (OSError, RuntimeError) as e:
            raise MemberError(f"shard path cannot be resolved: {e}") from None
        if not real.is_relative_to(real_root):
            raise MemberError(f"shard {ref.shard} leads outside the images root (to {real}): refused")
    if ref.size <= 0:
        raise MemberError(f"zero-byte member in {path.name} at offset {ref.offset}")
    if ref.offset < BLOCK or ref.offset % BLOCK:
        raise MemberError(f"offset {ref.offset} in {path.name} is not the start of a tar member's data")
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise MemberError(f"shard {path} is not a regular file")
            if ref.offset + ref.size > st.st_size:
                raise MemberError(f"member range {ref.offset}+{ref.size} lies outside shard {path.name} "
                                  f"({st.st_size} bytes): truncated shard or stale dataset")
            f.seek(ref.offset - BLOCK)
            head = f.read(BLOCK)
            _check_header(head, ref, path)
            data = f.read(ref.size)
    except FileNotFoundError:
        raise MemberError(f"missing shard: {path}") from None
    except IsADirectoryError:
        raise MemberError(f"shard {path} is not a regular file") from None
    except OSError as e:
        raise MemberError(f"cannot read shard {path}: {type(e).__name__}: {e}") from None
    if len(data) != ref.size:
        raise MemberError(f"shard {path.name} ended inside the member at {ref.offset} (truncated shard)")
    return data


def _check_header(head: bytes, ref: MemberRef, path: Path) -> None:
    """The block before the data must be a tar header of a regular member of ``ref.size`` bytes (a reference into
    the middle of a member, or into another file, fails here)."""
    try:
        info = tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    except tarfile.TarError as e:
        raise MemberError(f"no tar header before offset {ref.offset} in {path.name} ({e}): not a member's data"
                          ) from None
    if not info.isreg():
        raise MemberError(f"the tar member before offset {ref.offset} in {path.name} is not a regular file")
    # a pax header may carry the real size of a member over 8 GiB; the ustar field holds every image's size
    if info.size != ref.size:
        raise MemberError(f"the tar member at {ref.offset} in {path.name} holds {info.size} bytes, the reference "
                          f"says {ref.size}: stale dataset (re-run ingest)")
