"""Hints the CLI prints name commands and options that exist (issue 18, finding 10): ``capflow stack`` hints carry
``--home``; the duplicate-id hint names ``capflow evaluate --duplicates first``, which exists; evaluating a few
of many reference images warns on stderr with and without ``--json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _coco(tmp_path: Path, images: int, results: list[tuple[int, str]]) -> tuple[Path, Path]:
    refs = {"images": [{"id": i} for i in range(1, images + 1)],
            "annotations": [{"id": 10 * i + k, "image_id": i, "caption": c}
                            for i in range(1, images + 1)
                            for k, c in enumerate(["a dog runs on the grass", "a brown dog is running"])]}
    r, a = tmp_path / "results.json", tmp_path / "refs.json"
    a.write_text(json.dumps(refs))
    r.write_text(json.dumps([{"image_id": i, "caption": c} for i, c in results]))
    return r, a


def test_evaluate_warns_when_few_reference_images_are_scored_also_without_json(tmp_path, capsys):
    r, a = _coco(tmp_path, 1000, [(1, "a dog runs on grass")])
    for extra in ([], ["--json"]):
        rc, _, err = _run(capsys, "evaluate", "--results", str(r), "--references", str(a), *extra)
        assert rc == 0
        assert "warning: the results caption 1 of the 1000 reference images (0.1%)" in err
        assert "999 reference images have no result" in err
    assert "images: 1 of 1000 reference images" in _run(capsys, "evaluate", "--results", str(r), "--references",
                                                         str(a))[1]


def test_duplicate_image_ids_hint_names_an_option_the_cli_has(tmp_path, capsys):
    r, a = _coco(tmp_path, 2, [(1, "a dog runs"), (1, "a second caption"), (2, "a brown dog")])
    rc, _, err = _run(capsys, "evaluate", "--results", str(r), "--references", str(a))
    assert rc == 2 and "duplicate image_id 1" in err and "capflow evaluate --duplicates first" in err
    rc, out, err = _run(capsys, "evaluate", "--results", str(r), "--references", str(a), "--duplicates", "first",
                        "--json")
    assert rc == 0 and json.loads(out)["images"] == 2
    assert "kept the first caption of each (1 later ones dropped)" in err


def test_stack_hints_carry_home(tmp_path, capsys):
    home = tmp_path / "my stack"
    rc, _, err = _run(capsys, "stack", "env", "--home", str(home))
    assert rc == 2 and f"run 'capflow stack up --home '{home}'' first" in err
