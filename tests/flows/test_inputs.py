"""Issue 18, findings 9/10 (config and CLI inputs): each mistake is a clear error naming the input, exit 2,
not a traceback and not a silent reinterpretation."""

from __future__ import annotations

import json

import pytest

from captioning.config import ConfigError, load_config
from flows.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_latin1_config_file_is_a_clear_error(capsys, tmp_path):
    cfg = tmp_path / "latin1.yaml"
    cfg.write_bytes("run:\n  name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file {cfg} is not UTF-8 text \(byte 0xe9 .*save it as UTF-8"):
        load_config(path=cfg)
    rc, out, err = run(capsys, "config", "show", "--config", str(cfg))
    assert rc == 2 and out == "" and "not UTF-8" in err and "Traceback" not in err


def test_config_folder_is_named_as_a_folder(capsys, tmp_path):
    with pytest.raises(ConfigError, match=rf"config file {tmp_path} is a folder: give a YAML file"):
        load_config(path=tmp_path)
    rc, _, err = run(capsys, "config", "show", "--config", str(tmp_path))
    assert rc == 2 and "is a folder" in err and "does not exist" not in err


@pytest.mark.parametrize(("override", "key"), [
    ("run.seed=true", "run.seed"),
    ("features.extractor.conf_threshold=false", "features.extractor.conf_threshold"),
    ("features.extractor.fixed_boxes=true", "features.extractor.fixed_boxes"),
])
def test_booleans_are_not_numbers(capsys, override, key):
    with pytest.raises(ConfigError, match=rf"'{key}': .*expected a number, got the boolean"):
        load_config("tiny", overrides=[override])
    rc, _, err = run(capsys, "config", "show", "tiny", "--set", override)
    assert rc == 2 and key in err
    # booleans stay booleans, numbers stay numbers
    cfg = load_config("tiny", overrides=["features.extractor.amp=true", "run.seed=3"])
    assert cfg.features.extractor.amp is True and cfg.run.seed == 3


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_workdir_is_refused(capsys, value):
    with pytest.raises(ConfigError, match=r"'run\.workdir': .*run\.workdir is empty"):
        load_config("tiny", overrides=[f"run.workdir={value}"])
    rc, _, err = run(capsys, "config", "show", "tiny", "--set", f"run.workdir={value}")
    assert rc == 2 and "run.workdir is empty" in err


@pytest.mark.parametrize("students", ["", ",", " , "])
def test_students_naming_nobody_is_refused_not_all_of_them(capsys, tmp_path, students):
    rc, out, err = run(capsys, "run", "--preset", "tiny", "--set", f"run.workdir={tmp_path / 'w'}",
                       "--students", students)
    assert rc == 2 and out == "" and "names no student" in err
    assert not (tmp_path / "w").exists()  # refused before anything ran


def test_students_list_is_trimmed():
    from flows.cli import parse_students

    assert parse_students(None) is None
    assert parse_students(" acort, lw ,") == ["acort", "lw"]


def test_evaluate_with_a_folder_is_a_clear_error(capsys, tmp_path):
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps({"images": [], "annotations": []}), encoding="utf-8")
    rc, out, err = run(capsys, "evaluate", "--results", str(tmp_path), "--references", str(refs))
    assert rc == 2 and out == "" and f"--results {tmp_path} is a folder" in err
    rc, out, err = run(capsys, "evaluate", "--results", str(refs), "--references", str(tmp_path))
    assert rc == 2 and f"--references {tmp_path} is a folder" in err


# ---------------------------------------------------------------------- ingest (findings 7, 8, 9)
def _dataset(synthetic_small, tmp_path, edit) -> list[str]:
    """A copy of the small synthetic dataset, ``edit(entries, images_root)`` applied; the ingest overrides."""
    import shutil

    root = tmp_path / "ds"
    shutil.copytree(synthetic_small, root)
    ann = root / "dataset.json"
    d = json.loads(ann.read_text(encoding="utf-8"))
    edit(d["images"], root / "images")
    ann.write_text(json.dumps(d), encoding="utf-8")
    return [f"run.workdir={tmp_path / 'work'}", f"dataset.annotations={ann}", f"dataset.images={root / 'images'}",
            "dataset.max_reject_fraction=0.5"]


def _ingest(overrides):
    from captioning.data.plans import ingest_plan
    from captioning.data.prepare import ingest

    return ingest(ingest_plan(load_config("tiny", overrides=overrides)))


def test_a_dataset_without_a_test_split_fails_at_ingest(synthetic_small, tmp_path, capsys):
    from captioning.data.karpathy import DatasetError

    def no_test(entries, _):
        for e in entries:
            if e["split"] == "test":
                e["split"] = "train"

    over = _dataset(synthetic_small, tmp_path, no_test)
    with pytest.raises(DatasetError, match=r"no usable images in the test split \(usable images per split: "
                                           r"train \d+, val \d+, test 0\)"):
        _ingest(over)
    rc, _, err = run(capsys, "ingest", "--preset", "tiny", *[x for o in over for x in ("--set", o)])
    assert rc == 2 and "test split" in err


def test_a_symlink_leaving_the_images_root_is_refused(synthetic_small, tmp_path):
    outside = tmp_path / "secret.jpg"

    def link(entries, images):
        e = entries[0]
        target = images / e["filepath"] / e["filename"] if e.get("filepath") else images / e["filename"]
        outside.write_bytes(target.read_bytes())  # a valid image, so only where it lives is wrong
        target.unlink()
        target.symlink_to(outside)
        link.image_id = e["cocoid"]

    over = _dataset(synthetic_small, tmp_path, link)
    ds = _ingest(over)
    assert link.image_id not in {e.image_id for e in ds.images}
    (r,) = [r for r in ds.rejected if r.image_id == link.image_id]
    assert "outside the images root" in r.reason and str(outside) in r.reason


def test_a_symlink_inside_the_images_root_is_fine(synthetic_small, tmp_path):
    def link(entries, images):
        e = entries[0]
        target = images / e["filepath"] / e["filename"] if e.get("filepath") else images / e["filename"]
        moved = images / "elsewhere" / target.name
        moved.parent.mkdir()
        target.rename(moved)
        target.symlink_to(moved)

    ds = _ingest(_dataset(synthetic_small, tmp_path, link))
    assert not ds.rejected


def test_lone_surrogate_caption_is_dropped_with_a_reason(synthetic_small, tmp_path):
    def surrogate(entries, _):
        entries[0]["sentences"][0]["raw"] = "a dog \ud800 on grass"
        entries[0]["sentences"][0]["tokens"] = ["a", "dog", "\ud800"]
        surrogate.image_id = entries[0]["cocoid"]

    ds = _ingest(_dataset(synthetic_small, tmp_path, surrogate))
    assert any(r.image_id == surrogate.image_id and "lone surrogate" in r.reason for r in ds.dropped_captions)
    ds.save(tmp_path / "normalised.json")  # writes as UTF-8 without an encoding error


def test_nul_byte_in_a_file_name_is_a_clear_error(synthetic_small, tmp_path, capsys):
    from captioning.data.karpathy import DatasetError

    def nul(entries, _):
        entries[3]["filename"] = "bad\x00name.jpg"

    over = _dataset(synthetic_small, tmp_path, nul)
    with pytest.raises(DatasetError, match=r"images\[3\] file name .* holds a NUL byte"):
        _ingest(over)
