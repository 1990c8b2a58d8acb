"""The format registry: :data:`FORMATS` maps each format's name to its :class:`Format` (how a source of it is opened
and how :func:`captioning.data.imports.detect.resolve` recognises it), and :class:`ImportSpec` (what to import)
opens its source through it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioning.data.imports.base import FeatureImportError, Source
from captioning.data.imports.butd_tsv import ButdTsvSource, is_tsv_file, is_tsv_name
from captioning.data.imports.m2_hdf5 import M2HDF5Source, is_hdf5_file, is_hdf5_name
from captioning.data.imports.milvlg import MILVLG_MEMBERS, MilvlgSource
from captioning.data.imports.ruotianluo import (
    NPZ_MEMBERS,
    RuotianluoSource,
    is_lmdb_file,
    is_lmdb_name,
    is_npy_name,
)


@dataclass(frozen=True)
class Format:
    """One external format: how its source is opened and how ``resolve`` recognises it (``format auto``)."""

    name: str
    #: (spec, max_boxes, feature_dim) -> the source
    opener: Callable[[ImportSpec, int, int], Source]
    #: ruotianluo's layout: a features folder/LMDB with a boxes folder/LMDB (``--att-dir``/``--box-dir``, or a root
    #: holding ``cocobu_att`` and ``cocobu_box*``), not one source path; a single file of it is not a source
    paired: bool = False
    #: whether a source file is this format's (tried in registry order, paired formats last)
    file: Callable[[Path], bool] | None = None
    #: whether a folder entry (by name) is one of this format's files
    entry: Callable[[str], bool] | None = None
    #: the members that make a ``.npz`` file this format's (the format needing the most of a file's members wins)
    npz_members: frozenset[str] = frozenset()
    #: a folder holding only this format's files is a source of it
    folder: bool = False
    #: the source takes ``--tsv-fields`` (a detected spec keeps them)
    tsv_fields: bool = False


def _ruotianluo(spec: ImportSpec, max_boxes: int, feature_dim: int) -> Source:
    return RuotianluoSource(spec.att, spec.box, fmt=spec.format, boxes=spec.boxes)


def _butd_tsv(spec: ImportSpec, max_boxes: int, feature_dim: int) -> Source:
    return ButdTsvSource(spec.path, fields=spec.tsv_fields, max_boxes=max_boxes, feature_dim=feature_dim)


#: format name -> :class:`Format`, in the order formats are listed to users
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("npy", _ruotianluo, paired=True, entry=is_npy_name),
    Format("npz", _ruotianluo, paired=True, npz_members=NPZ_MEMBERS),
    Format("lmdb", _ruotianluo, paired=True, file=is_lmdb_file, entry=is_lmdb_name),
    Format("butd-tsv", _butd_tsv, file=is_tsv_file, entry=is_tsv_name, folder=True, tsv_fields=True),
    Format("m2-hdf5", lambda spec, boxes, dim: M2HDF5Source(spec.path, boxes, dim), file=is_hdf5_file,
           entry=is_hdf5_name),
    Format("milvlg-npz", lambda spec, boxes, dim: MilvlgSource(spec.path, boxes, dim), npz_members=MILVLG_MEMBERS,
           folder=True),
)}


@dataclass
class ImportSpec:
    """What to import: the format and its paths (resolved from a source path or the ruotianluo folders)."""

    format: str
    path: Path | None = None  # TSV file/folder, HDF5 file, MILVLG folder
    att: Path | None = None  # ruotianluo: features (folder or LMDB)
    box: Path | None = None  # ruotianluo: boxes (folder or LMDB)
    boxes: str = "relative"  # ruotianluo boxes: relative | pixels
    tsv_fields: tuple[str, ...] | None = None

    def ident(self) -> dict[str, Any]:
        """What names the imported store (paths resolved)."""
        paths = {k: str(Path(v).resolve()) for k, v in (("path", self.path), ("att", self.att), ("box", self.box))
                 if v is not None}
        return {"format": self.format, **paths, "boxes": self.boxes,
                "tsv_fields": list(self.tsv_fields) if self.tsv_fields else None}

    def open(self, *, max_boxes: int, feature_dim: int) -> Source:
        """The source, opened by its format's entry in :data:`FORMATS`."""
        fmt = FORMATS.get(self.format)
        if fmt is not None and fmt.paired:
            assert self.att is not None and self.box is not None
        else:
            assert self.path is not None
        if fmt is None:
            raise FeatureImportError(f"unknown format {self.format!r} (one of {', '.join(FORMATS)})")
        return fmt.opener(self, max_boxes, feature_dim)
