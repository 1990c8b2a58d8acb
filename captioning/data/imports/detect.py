"""Which format a source path is (:func:`resolve`, for ``--format auto``), from the format registry: file names,
a file's first bytes, a few ``.npz`` files' member names at most - never a whole record."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from pathlib import Path

from captioning.data.imports.base import FeatureImportError
from captioning.data.imports.butd_tsv import tsv_fields as parse_tsv_fields
from captioning.data.imports.registry import FORMATS, ImportSpec
from captioning.data.imports.ruotianluo import box_kind, is_lmdb, ruotianluo_root


def _npz_members(p: Path) -> set[str]:
    try:
        with zipfile.ZipFile(p) as z:
            return {n[:-4] if n.endswith(".npy") else n for n in z.namelist()}
    except (OSError, zipfile.BadZipFile):
        return set()


def folder_kinds(folder: Path) -> set[str]:
    """The formats the files of ``folder`` could be (a few .npz files are peeked at: member names only)."""
    kinds: set[str] = set()
    npz: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError as e:
        raise FeatureImportError(f"cannot list {folder}: {e}") from None
    for e in entries:
        fmt = next((f.name for f in FORMATS.values() if f.entry is not None and f.entry(e.name)), None)
        if fmt is not None:
            kinds.add(fmt)
        elif e.name.endswith(".npz") and len(npz) < 3:
            npz.append(Path(e.path))
    by_members = [f for f in FORMATS.values() if f.npz_members]
    for p in npz:
        members = _npz_members(p)
        fits = [f for f in by_members if f.npz_members <= members]
        if fits:  # the format that needs the most of the file's members (MILVLG's x + bbox before a feat)
            kinds.add(max(fits, key=lambda f: len(f.npz_members)).name)
    return kinds


def att_format(att: Path) -> str:
    """The ruotianluo format of a features folder or LMDB (``lmdb``, ``npy`` or ``npz``)."""
    if is_lmdb(att):
        return "lmdb"
    if not att.is_dir():
        raise FeatureImportError(f"{att} is not a folder")
    kinds = folder_kinds(att) & {"npy", "npz"}  # the folder formats of the layout
    if len(kinds) == 1:
        return kinds.pop()
    if not kinds:
        raise FeatureImportError(f"no <image_id>.npy or .npz (key feat) files in {att}")
    raise FeatureImportError(f"{att} holds both .npy and .npz files: give --format npy or --format npz")


def resolve(fmt: str = "auto", source: Path | None = None, *, att: Path | None = None, box: Path | None = None,
            boxes: str = "auto", tsv_fields: Sequence[str] | None = None) -> ImportSpec:
    """The import of ``source`` (a file or folder) or of the ruotianluo folders ``att`` + ``box``; ``fmt`` ``auto``
    detects the format from the path (a few .npz files' member names at most), and is an error listing the
    candidates where the path fits more than one."""
    if fmt != "auto" and fmt not in FORMATS:
        raise FeatureImportError(f"unknown format {fmt!r} (one of auto, {', '.join(FORMATS)})")
    fields = parse_tsv_fields(tsv_fields) if tsv_fields else None
    if boxes not in ("auto", "relative", "pixels"):
        raise FeatureImportError(f"--boxes must be auto, relative or pixels, not {boxes!r}")
    if source is not None and (att is not None or box is not None):
        raise FeatureImportError("give a source path or --att-dir/--box-dir, not both")
    if source is None:
        if att is None or box is None:
            raise FeatureImportError("give a source file or folder, or --att-dir with --box-dir")
        got = att_format(att) if fmt == "auto" else fmt
        if not FORMATS[got].paired:
            paired = ", ".join(name for name, f in FORMATS.items() if f.paired)
            raise FeatureImportError(f"--att-dir/--box-dir are ruotianluo's layout ({paired}), not {got}")
        return ImportSpec(got, att=att, box=box, boxes=box_kind(box, boxes))
    if not source.exists():
        raise FeatureImportError(f"{source} does not exist")
    pair = ruotianluo_root(source) if source.is_dir() else None
    if (fmt != "auto" and FORMATS[fmt].paired) or (fmt == "auto" and pair):
        if pair is None:
            raise FeatureImportError(f"{source} holds no cocobu_att/ (or cocobu_att.lmdb) with cocobu_box_relative/ "
                                     "or cocobu_box/: give --att-dir and --box-dir")
        a, b = pair
        got = att_format(a) if fmt == "auto" else fmt
        return ImportSpec(got, att=a, box=b, boxes=box_kind(b, boxes))
    if fmt != "auto":
        return ImportSpec(fmt, path=source, tsv_fields=fields)
    if source.is_file():
        return _file_spec(source, fields)
    return _folder_spec(source, fields)


def _file_spec(source: Path, fields: tuple[str, ...] | None) -> ImportSpec:
    """The format of a source file: the first format (in registry order) whose ``file`` test it passes."""
    singles = [f for f in FORMATS.values() if f.file is not None and not f.paired]
    for f in singles:
        if f.file(source):
            return ImportSpec(f.name, path=source, tsv_fields=fields if f.tsv_fields else None)
    if any(f.file(source) for f in FORMATS.values() if f.file is not None and f.paired):  # an LMDB file
        raise FeatureImportError(f"{source} is an LMDB of features: give it as --att-dir with --box-dir")
    raise FeatureImportError(f"cannot tell the format of {source} (candidates: {', '.join(f.name for f in singles)}): "
                             "give --format")


def _folder_spec(source: Path, fields: tuple[str, ...] | None) -> ImportSpec:
    """The format of a source folder: the one format its files are, where that format reads a folder."""
    kinds = folder_kinds(source)
    if len(kinds) == 1 and FORMATS[next(iter(kinds))].folder:
        f = FORMATS[next(iter(kinds))]
        return ImportSpec(f.name, path=source, tsv_fields=fields if f.tsv_fields else None)
    if kinds and all(FORMATS[k].paired for k in kinds):
        raise FeatureImportError(f"{source} looks like a ruotianluo features folder ({', '.join(sorted(kinds))}): "
                                 "give it as --att-dir with --box-dir (the boxes folder)")
    if not kinds:
        raise FeatureImportError(f"no feature files in {source} (looked for .tsv, .hdf5/.h5, .npz, .npy, data.mdb, "
                                 "cocobu_att/)")
    raise FeatureImportError(f"{source} could be more than one format (candidates: {', '.join(sorted(kinds))}): "
                             "give --format")
