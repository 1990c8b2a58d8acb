"""The user docs stay true: every internal link resolves, every ``capflow`` command they name exists, and every
config key they name (``section.key`` in backticks) is a real setting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "infra" / "README.md"]
SECTIONS = ("run", "dataset", "features", "vocab", "loader", "teacher", "students", "evaluation", "tracking")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _named_entries(model=None, prefix: str = "") -> set[str]:
    """``key.*.field`` for every setting that maps names to a section (``students.per_student.*.seqkd``)."""
    import typing

    from pydantic import BaseModel

    from captioning.config import PipelineConfig

    out: set[str] = set()
    for name, f in (model or PipelineConfig).model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= _named_entries(ann, f"{prefix}{name}.")
        elif typing.get_origin(ann) is dict:
            value = typing.get_args(ann)[1]
            if isinstance(value, type) and issubclass(value, BaseModel):
                out |= {f"{prefix}{name}.*.{sub}" for sub in value.model_fields}
    return out


def _config_keys() -> set[str]:
    from captioning.config import describe_keys

    keys = {k for k, _, _ in describe_keys()} | _named_entries()
    # every prefix of a key is a section that docs may name
    return keys | {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 1)}


def _as_pattern(key: str) -> str:
    """A cited key with the entry name of a named-entries setting as ``*`` (``students.per_student.lw.seqkd`` ->
    ``students.per_student.*.seqkd``)."""
    for entry in _named_entries():
        head = entry.split(".*.", 1)[0] + "."
        if key.startswith(head) and key.count(".") == entry.count("."):
            return head + "*." + key.rsplit(".", 1)[1]
    return key


def _commands() -> set[str]:
    from flows.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    return set(sub.choices)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_internal_links_resolve(doc):
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(doc)):
        if re.match(r"[a-z]+://|mailto:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            bad.append(target)
    assert not bad, f"{doc.name}: links to missing files {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_commands_and_config_keys_exist(doc):
    text = _text(doc)
    commands = _commands()
    code = re.findall(r"`([^`\n]+)`", text)  # inline code spans
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):  # fenced blocks, line by line
        code.extend(block.splitlines())
    named = {m for c in code for m in re.findall(r"(?:^|[\s$(;&|])capflow ([a-z][a-z-]+)", c.strip())}
    assert not (named - commands), f"{doc.name}: unknown capflow commands {sorted(named - commands)}"
    if doc.name == "ARCHITECTURE.md":  # the code map names modules (features.parallel...), not settings
        return
    keys = _config_keys()
    files = ("json", "pkl", "py", "yaml", "yml", "md", "zarr", "pt", "pth", "npy", "npz", "tsv", "hdf5", "db")
    cited = {m for m in re.findall(r"`(?:--set )?([a-z_]+(?:\.[a-z_0-9]+)+)(?:[:=][^`]*)?`", text)
             if m.split(".")[0] in SECTIONS and m.rsplit(".", 1)[1] not in files}
    unknown = sorted(k for k in cited if _as_pattern(k) not in keys)
    assert not unknown, f"{doc.name}: config keys that do not exist: {unknown}"
