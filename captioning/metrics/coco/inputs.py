"""The inputs of a coco-caption evaluation: COCO references and results files (or mappings) read and checked,
with errors that name the file and the offending ids (:class:`EvaluationInputError`), and the references
document :func:`load_references` reads."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from captioning.errors import InputError
from captioning.jsonio import read_json

_MAX_NAMED = 10  # ids named in one error message


class EvaluationInputError(InputError, ValueError):
    """A references or results file (or mapping) that cannot be scored; the message says where and why."""


def _read_json(path: str | Path, what: str) -> Any:
    return read_json(path, what, EvaluationInputError)


def _caption_item(obj: Any, label: str) -> tuple[int, str]:
    """(image_id, caption) of one annotation/result object, or an error naming ``label``."""
    if not isinstance(obj, dict):
        raise EvaluationInputError(f"{label} is not an object")
    for key in ("image_id", "caption"):
        if key not in obj:
            raise EvaluationInputError(f"{label} is missing key '{key}'")
    iid, cap = obj["image_id"], obj["caption"]
    if not _is_int(iid):
        raise EvaluationInputError(f"{label} has a non-integer image_id {iid!r}")
    if not isinstance(cap, str):
        raise EvaluationInputError(f"{label} (image_id {iid}) has a non-string caption")
    return iid, cap


def _name_ids(ids: Iterable[Any]) -> str:
    ids = list(ids)
    shown = ", ".join(repr(i) for i in ids[:_MAX_NAMED])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > _MAX_NAMED else "")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_references(path: str | Path) -> dict[int, list[str]]:
    """Reference captions from a COCO annotation file: ``{image_id: [caption, ...]}`` in file order.

    The file is ``{"images": [{"id": int, ...}], "annotations": [{"image_id": int, "caption": str}, ...]}``
    (``images`` may be left out; when present, every annotation must point at a listed image). Images listed
    without any caption are left out with a warning.
    """
    data = _read_json(path, "references")
    where = f"references file {path}"
    if not isinstance(data, dict):
        raise EvaluationInputError(f"{where}: expected a COCO annotation object with an 'annotations' list, "
                                   f"got {type(data).__name__}")
    if "annotations" not in data:
        raise EvaluationInputError(f"{where}: missing key 'annotations' (keys: {sorted(data)[:10]})")
    anns = data["annotations"]
    if not isinstance(anns, list):
        raise EvaluationInputError(f"{where}: 'annotations' must be a list, got {type(anns).__name__}")
    if not anns:
        raise EvaluationInputError(f"{where}: 'annotations' is empty")

    image_ids: set[int] | None = None
    if "images" in data:
        images = data["images"]
        if not isinstance(images, list):
            raise EvaluationInputError(f"{where}: 'images' must be a list, got {type(images).__name__}")
        image_ids = set()
        for i, img in enumerate(images):
            if not isinstance(img, dict) or "id" not in img:
                raise EvaluationInputError(f"{where}: images[{i}] has no 'id'")
            if not _is_int(img["id"]):
                raise EvaluationInputError(f"{where}: images[{i}] has a non-integer id {img['id']!r}")
            image_ids.add(img["id"])

    refs: dict[int, list[str]] = {}
    for i, ann in enumerate(anns):
        iid, cap = _caption_item(ann, f"{where}: annotations[{i}]")
        refs.setdefault(iid, []).append(cap)

    if image_ids is not None:
        unknown = [i for i in refs if i not in image_ids]
        if unknown:
            raise EvaluationInputError(f"{where}: annotations point at image ids not in 'images': "
                                       f"{_name_ids(unknown)}")
        bare = sorted(image_ids - refs.keys())
        if bare:
            warnings.warn(f"{where}: {len(bare)} image(s) have no caption and are left out: {_name_ids(bare)}",
                          stacklevel=2)
    return refs


def references_document(refs: Mapping[int, Sequence[str]]) -> dict[str, Any]:
    """``{image_id: [captions]}`` -> the COCO-format annotation document that :func:`load_references` reads."""
    ids = sorted(int(i) for i in refs)
    anns = [{"image_id": i, "id": n, "caption": c} for n, (i, c) in enumerate((i, c) for i in ids for c in refs[i])]
    return {"images": [{"id": i} for i in ids], "annotations": anns, "type": "captions", "info": {}, "licenses": []}


def load_results(path: str | Path, references: Mapping[int, Sequence[str]] | None = None, *,
                 duplicates: str = "error") -> dict[int, str]:
    """Generated captions from a COCO results file ``[{"image_id": int, "caption": str}, ...]``.

    ``duplicates="error"`` (default) rejects an image id that occurs twice, naming it: the official toolkit
    cannot score two captions for one image. ``duplicates="first"`` keeps the first caption and warns.
    With ``references`` given, ids that have no references are an error naming them. Extra keys are ignored.
    """
    if duplicates not in ("error", "first"):
        raise ValueError(f"duplicates must be 'error' or 'first', not {duplicates!r}")
    data = _read_json(path, "results")
    where = f"results file {path}"
    if not isinstance(data, list):
        raise EvaluationInputError(f"{where}: expected a list of {{'image_id', 'caption'}} objects, "
                                   f"got {type(data).__name__}")
    if not data:
        raise EvaluationInputError(f"{where}: no results")
    out: dict[int, str] = {}
    dups: list[int] = []
    for i, r in enumerate(data):
        iid, cap = _caption_item(r, f"{where}: item {i}")
        if iid in out:
            dups.append(iid)
            continue
        out[iid] = cap
    if dups:
        uniq = list(dict.fromkeys(dups))
        msg = f"{where}: duplicate image_id {_name_ids(uniq)}"
        if duplicates == "error":
            raise EvaluationInputError(msg + " (one caption per image: fix the file, or keep the first caption "
                                             "of each with `capflow evaluate --duplicates first`)")
        warnings.warn(msg + f"; kept the first caption of each ({len(dups)} later ones dropped)", stacklevel=2)
    if references is not None:
        check_ids(out, references, where)
    return out


def check_ids(results: Mapping[int, str], references: Mapping[int, Sequence[str]], where: str) -> None:
    """Every result id must have references; the error names the ids that have none."""
    missing = [i for i in results if i not in references]
    if missing:
        raise EvaluationInputError(f"{where}: {len(missing)} image id(s) have no references: {_name_ids(missing)}")
