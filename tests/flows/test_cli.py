"""Tests for the ``capflow`` command (flows.cli), run in-process."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from captioning.config import PipelineConfig, describe_keys, load_config
from captioning.data.karpathy import Dataset, read_karpathy
from captioning.data.prepare import import_npy_features
from captioning.data.stores import OK, REJECTED, FeatureStore, LabelStore
from captioning.data.text import Vocabulary
from captioning.workdir import Workdir
from flows.cli import main
from tests.data.test_karpathy import REASON_WORDS, excerpt_root, plant_faults

BU_IDS = [57870, 184613, 384029, 391895, 522418]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything written relative to the working directory (e.g. a default .capflow) stays in tmp."""
    monkeypatch.chdir(tmp_path)


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def sets(**kv: object) -> list[str]:
    out: list[str] = []
    for k, v in kv.items():
        out += ["--set", f"{k.replace('__', '.')}={v}"]
    return out


def dataset_args(ann: Path, images: Path | None, workdir: Path) -> list[str]:
    args = ["--set", f"dataset.annotations={ann}", "--set", f"run.workdir={workdir}"]
    if images is not None:
        args += ["--set", f"dataset.images={images}"]
    return args


# ---------------------------------------------------------------------- config
def test_config_show_tiny_round_trips(capsys) -> None:
    rc, out, _ = run(capsys, "config", "show", "tiny")
    assert rc == 0
    assert PipelineConfig.model_validate(yaml.safe_load(out)) == load_config("tiny")
    rc, out, _ = run(capsys, "config", "show", "--preset", "tiny", "--set", "run.seed=9")
    assert rc == 0
    cfg = PipelineConfig.model_validate(yaml.safe_load(out))
    assert cfg.run.seed == 9 and cfg.dataset.synthetic.num_images == 40
    rc, out, _ = run(capsys, "config", "show")
    assert rc == 0 and PipelineConfig.model_validate(yaml.safe_load(out)) == PipelineConfig()


def test_config_show_errors(capsys) -> None:
    rc, out, err = run(capsys, "config", "show", "tiny", "--preset", "demo")
    assert rc == 2 and out == "" and "capflow config: error:" in err
    rc, _, err = run(capsys, "config", "show", "tiny", "--set", "run.sed=1")
    assert rc == 2 and "unknown key 'run.sed'" in err
    rc, _, err = run(capsys, "config", "show", "nosuch")
    assert rc == 2 and "unknown preset 'nosuch'" in err


def test_config_keys_and_presets(capsys) -> None:
    rc, out, _ = run(capsys, "config", "keys")
    assert rc == 0
    lines = out.splitlines()
    i = lines.index("dataset.max_reject_fraction = 0.01")
    desc = {k: d for k, _, d in describe_keys()}
    assert lines[i + 1].strip() == desc["dataset.max_reject_fraction"] != ""
    listed = [ln.split(" = ")[0] for ln in lines if not ln.startswith(" ")]
    assert listed == [k for k, _, _ in describe_keys()]
    assert 'run.workdir = ".capflow"' in lines
    assert "dataset.annotations = null" in lines
    rc, out, _ = run(capsys, "config", "presets")
    assert rc == 0 and out.split() == ["coco", "coco-dry", "demo", "learning", "tiny"]


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("ingest", ["--preset", "--config", "--set", "--json"]),
        ("vocab", ["--preset", "--config", "--set", "--features", "--json"]),
        ("import-features", ["--npy-root", "--att-dir", "--box-dir", "--out", "--overwrite", "--json", "--set"]),
        ("config", ["show", "keys", "presets", "--preset", "--set"]),
        ("bench", ["loader", "--json", "--images", "--batch-size", "--max-boxes", "--chunk-rows", "--workers",
                   "--repeats", "--tmp"]),
    ],
)
def test_subcommand_help(capsys, command: str, options: list[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main([command, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: capflow {command}")
    for opt in options:
        assert opt in out, opt


def test_top_level_help_lists_commands(capsys) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for command in ("config", "ingest", "vocab", "import-features", "bench"):
        assert command in out
    with pytest.raises(SystemExit) as ei:
        main(["frobnicate"])
    assert ei.value.code == 2


# ---------------------------------------------------------------------- ingest
def test_ingest_json_on_planted_faults(capsys, synthetic_small: Path, tmp_path: Path) -> None:
    f = plant_faults(synthetic_small, tmp_path / "faulty")
    wd = tmp_path / "wd"
    rc, out, _ = run(capsys, "ingest", "--json", *dataset_args(f.annotations, f.images, wd),
                     "--set", "dataset.max_reject_fraction=0.5")
    assert rc == 0
    s = json.loads(out)
    assert {"images", "captions", "splits", "rejected", "digest"} <= set(s)
    expected = read_karpathy(f.annotations, f.images, max_reject_fraction=0.5)
    assert s["images"] == len(expected.images) == len(f.kept_entries())
    assert s["captions"] == sum(len(e.captions) for e in expected.images)
    assert s["splits"] == expected.summary()["splits"]
    assert s["digest"] == expected.digest
    assert s["entries"] == len(f.entries) and s["files_checked"] is True
    by_id: dict[int, list[dict]] = {}
    for r in s["rejected"]:
        assert set(r) >= {"image_id", "file", "reason"}
        by_id.setdefault(r["image_id"], []).append(r)
    assert sorted(r["image_id"] for r in s["rejected"]) == sorted(f.image_id(i) for i in f.bad.values())
    for case, idx in f.bad.items():
        e = f.entries[idx]
        (r,) = [r for r in by_id[e["cocoid"]] if r["entry"] == idx]
        assert r["file"] == f"{e['filepath']}/{e['filename']}"
        for word in REASON_WORDS[case]:
            assert word in r["reason"], (case, r)
    n_dropped = 1 + len(f.entries[f.bad["punctuation_only"]]["sentences"])
    assert [d["reason"] for d in s["dropped_captions"]] == ["empty caption (no words after tokenisation)"] * n_dropped
    # written outputs
    layout = Workdir(wd)
    saved = Dataset.load(layout.dataset(s["digest"]))
    assert saved.digest == s["digest"] and len(saved.images) == s["images"]
    assert s["output"] == str(layout.dataset(s["digest"])) == str(wd / "datasets" /
                                                                 f"dataset-{s['digest'][:16]}.parquet")
    assert s["rejects"] == str(layout.rejects(s["digest"]))
    rejects = json.loads(Path(s["rejects"]).read_text())
    assert [r["image_id"] for r in rejects["rejected"]] == [r["image_id"] for r in s["rejected"]]
    assert rejects["dropped_captions"] == s["dropped_captions"]
    assert (wd / "cache" / "file_hashes.sqlite").is_file()


def test_ingest_text_output(capsys, synthetic_small: Path, tmp_path: Path) -> None:
    f = plant_faults(synthetic_small, tmp_path / "faulty")
    rc, out, _ = run(capsys, "ingest", *dataset_args(f.annotations, f.images, tmp_path / "wd"),
                     "--set", "dataset.max_reject_fraction=0.5")
    assert rc == 0
    n_kept = len(f.kept_entries())
    assert re.search(rf"^ingested {n_kept} images, \d+ captions from {re.escape(str(f.annotations))}$", out, re.M)
    n_dropped = 1 + len(f.entries[f.bad["punctuation_only"]]["sentences"])
    assert f"rejected {len(f.bad)} entries, dropped {n_dropped} captions" in out
    for idx in f.bad.values():
        assert f"images[{idx}] image_id={f.image_id(idx)} " in out
    expected = read_karpathy(f.annotations, f.images, max_reject_fraction=0.5)
    assert f"digest {expected.digest}" in out


def test_ingest_too_many_rejects_exits_2(capsys, synthetic_small: Path, tmp_path: Path) -> None:
    f = plant_faults(synthetic_small, tmp_path / "faulty")
    wd = tmp_path / "wd"
    rc, out, err = run(capsys, "ingest", "--json", *dataset_args(f.annotations, f.images, wd))
    assert rc == 2
    assert out == ""
    assert err.startswith("capflow ingest: error: ")
    assert f"{len(f.bad)} of {len(f.entries)} entries are bad" in err
    for idx in f.bad.values():
        assert f"images[{idx}] image_id={f.image_id(idx)} " in err
    for idx in f.kept_entries():
        assert f"images[{idx}] " not in err
    assert "Traceback" not in err
    assert not list(wd.glob("datasets/*")) and not list(wd.glob("datasets/.*"))  # no dataset, no partial file, no run


def test_ingest_malformed_json_exits_2(capsys, tmp_path: Path) -> None:
    ann = tmp_path / "broken.json"
    ann.write_text('{"images": [\n  {"filename": "a.jpg"\n  "split": "train"}\n]}\n')
    rc, out, err = run(capsys, "ingest", "--json", *dataset_args(ann, None, tmp_path / "wd"))
    assert rc == 2 and out == ""
    assert str(ann) in err
    assert re.search(r"malformed JSON at line 3 column \d+", err)
    rc, _, err = run(capsys, "ingest", *dataset_args(tmp_path / "missing.json", None, tmp_path / "wd"))
    assert rc == 2 and "missing.json not found" in err


def test_ingest_bad_config_exits_2(capsys, tmp_path: Path) -> None:
    rc, _, err = run(capsys, "ingest", "--set", "dataset.max_reject_fraction=2")
    assert rc == 2 and "'dataset.max_reject_fraction'" in err
    rc, _, err = run(capsys, "ingest", "--set", "dataset.annotatons=x.json")
    assert rc == 2 and "unknown key 'dataset.annotatons'" in err
    assert not (tmp_path / ".capflow").exists()


# ---------------------------------------------------------------------- vocab
def test_vocab_json_on_synthetic(capsys, synthetic_small: Path, tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    args = [*dataset_args(synthetic_small / "dataset.json", synthetic_small / "images", wd),
            "--set", "vocab.min_count=2", "--set", "vocab.radix_base=8"]
    rc, out, _ = run(capsys, "ingest", "--json", *args)
    assert rc == 0
    ingested = json.loads(out)
    rc, out, _ = run(capsys, "vocab", "--json", *args)
    assert rc == 0
    info = json.loads(out)
    assert info["captions"] == ingested["captions"] == 24 * 5
    assert info["dataset_digest"] == ingested["digest"]
    vocab_path, labels_uri = Path(info["vocab"]), info["labels"]
    # the vocab stage's folder of the pipeline's layout, recorded for `capflow train`
    assert vocab_path.parent.parent == wd / "runs" and vocab_path.parent.name.startswith("vocab-")
    assert vocab_path.name == "vocab.json" and vocab_path.is_file()
    assert labels_uri == str(vocab_path.parent / "labels.zarr") and Path(labels_uri).is_dir()
    assert info["features"] is None  # no feature store yet: rows in dataset order
    assert len(list((wd / "stages").glob("vocab-*.json"))) == 1

    # the vocabulary, recomputed independently from the train split (restval counts as train)
    ds = read_karpathy(synthetic_small / "dataset.json", synthetic_small / "images")
    counts = Counter(w for e in ds.images if e.split == "train" for c in e.captions for w in c.split())
    words = sorted((w for w, c in counts.items() if c >= 2), key=lambda w: (-counts[w], w))
    vocab = Vocabulary.load(vocab_path)
    assert vocab.words == words and vocab.counts == [counts[w] for w in words]
    assert vocab.unk_count == sum(c for c in counts.values() if c < 2)
    assert info["words"] == len(words) and info["ids"] == len(words) + 4
    assert info["vocab_digest"] == vocab.digest()
    digits = 1
    while 8**digits <= len(words):  # ranks 0..len(words) (<unk> last) in base 8
        digits += 1
    assert info["radix"] == {"base": 8, "digits": digits, "size": 11}

    # the label store: one row per caption, in dataset order, decodes back to the captions
    labels = LabelStore.open(labels_uri).read()
    rows = [(i, e, c) for i, e in enumerate(ds.images) for c in e.captions]
    assert labels.tokens.shape == (len(rows), 16)
    assert labels.image_row.tolist() == [i for i, _, _ in rows]
    assert labels.image_id.tolist() == [e.image_id for _, e, _ in rows]
    assert labels.split.tolist() == [{"train": 0, "val": 1, "test": 2}[e.split] for _, e, _ in rows]
    assert labels.length.tolist() == [len(c.split()) for _, _, c in rows]
    assert (labels.source == 0).all() and labels.sources == {0: "ground_truth"}
    known = set(words)
    for k, (_, _, c) in enumerate(rows):
        want = [w if w in known else "<unk>" for w in c.split()]
        assert vocab.decode(labels.tokens[k]) == want
        assert (labels.tokens[k, labels.length[k]:] == 0).all()
    assert LabelStore.open(labels_uri).attrs["dataset_digest"] == ingested["digest"]

    # a second run finds the recorded stage and gives the same result
    rc, out2, _ = run(capsys, "vocab", "--json", *args)
    assert rc == 0 and json.loads(out2) == info


def test_vocab_without_train_split_fails(capsys, external: Path, tmp_path: Path) -> None:
    ann = external / "coco_eval" / "karpathy_test_dataset.json"
    rc, out, err = run(capsys, "vocab", "--json", *dataset_args(ann, None, tmp_path / "wd"))
    assert rc == 2 and out == ""
    # refused at ingest, before any stage: the dataset has no train images
    assert "no usable images in the train" in err and "karpathy_test_dataset.json" in err


# ---------------------------------------------------------------------- import-features
def bu_arrays(root: Path, iid: int) -> tuple[np.ndarray, np.ndarray]:
    return np.load(root / "cocobu_att" / f"{iid}.npy"), np.load(root / "cocobu_box_relative" / f"{iid}.npy")


def check_store_rows(store: FeatureStore, npy_root: Path, dtype: type, ok_ids: set[int]) -> None:
    ids = store.image_ids().tolist()
    block = store.read_block(0, store.num_rows)
    assert block.features.dtype == dtype
    for k, iid in enumerate(ids):
        if iid not in ok_ids:
            assert block.status[k] == REJECTED
            assert block.num_boxes[k] == 0 and not block.features[k].any()
            continue
        att, box = bu_arrays(npy_root, iid)
        n = att.shape[0]
        assert block.status[k] == OK
        assert block.num_boxes[k] == n
        want = att if dtype == np.float32 else att.astype(np.float16)
        assert np.array_equal(block.features[k, :n], want), iid
        assert not block.features[k, n:].any()
        assert np.array_equal(block.boxes[k, :n], box.astype(np.float32)), iid
        assert not block.boxes[k, n:].any()


def test_import_features_float32_bit_exact(capsys, external: Path, tmp_path: Path) -> None:
    npy = external / "bu_features"
    out_uri = tmp_path / "f.zarr"
    rc, out, _ = run(capsys, "import-features", "--npy-root", str(npy), "--set", "features.dtype=float32",
                     "--set", f"run.workdir={tmp_path / 'wd'}", "--out", str(out_uri), "--json")
    assert rc == 0
    s = json.loads(out)
    rows = {iid: bu_arrays(npy, iid)[0].shape[0] for iid in BU_IDS}
    assert s["images"] == 5 and s["ok"] == 5 and s["pending"] == 0 and s["rejected"] == []
    assert s["boxes"]["min"] == min(rows.values()) and s["boxes"]["max"] == max(rows.values())
    assert s["boxes"]["mean"] == pytest.approx(sum(rows.values()) / 5)
    store = FeatureStore.open(str(out_uri))
    assert store.image_ids().tolist() == BU_IDS
    assert store.max_boxes == 100 and store.feature_dim == 2048
    check_store_rows(store, npy, np.float32, set(BU_IDS))
    assert (store.read_block(0, 5).image_size == -1).all()  # no dataset given: sizes unknown


def test_import_features_float16_default(capsys, external: Path, tmp_path: Path) -> None:
    npy = external / "bu_features"
    out_uri = tmp_path / "f16.zarr"
    rc, out, _ = run(capsys, "import-features", "--att-dir", str(npy / "cocobu_att"), "--box-dir",
                     str(npy / "cocobu_box_relative"), "--set", "features.chunk_rows=2", "--out", str(out_uri),
                     "--json")
    assert rc == 0 and json.loads(out)["ok"] == 5
    store = FeatureStore.open(str(out_uri))
    assert store.chunk_rows == 2 and store.num_chunks == 3
    check_store_rows(store, npy, np.float16, set(BU_IDS))


def test_import_features_with_dataset_records_image_sizes(capsys, external: Path, tmp_path: Path) -> None:
    root = tmp_path / "coco"
    ann, _ = excerpt_root(external, root)
    out_uri = tmp_path / "f.zarr"
    rc, out, _ = run(capsys, "import-features", "--npy-root", str(external / "bu_features"), "--json",
                     "--out", str(out_uri), *dataset_args(ann, root, tmp_path / "wd"))
    assert rc == 0 and json.loads(out)["ok"] == 5
    store = FeatureStore.open(str(out_uri))
    assert store.image_ids().tolist() == sorted(BU_IDS)
    index = {e["coco_id"]: e for e in json.loads((external / "images" / "index_all.json").read_text())}
    sizes = store.read_block(0, 5).image_size
    names = {int(p.stem.split("_")[-1]): p for p in (external / "images").glob("COCO_*.jpg")}
    for k, iid in enumerate(store.image_ids().tolist()):
        with Image.open(names[iid]) as im:
            assert sizes[k].tolist() == [im.height, im.width]
        w, h = index[iid]["width_height"]
        assert sizes[k].tolist() == [h, w]
    check_store_rows(store, external / "bu_features", np.float16, set(BU_IDS))


def test_import_features_broken_files_become_rejected_rows(capsys, external: Path, tmp_path: Path) -> None:
    npy = tmp_path / "bu"
    shutil.copytree(external / "bu_features", npy)
    for p in npy.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (npy / "cocobu_box_relative" / "391895.npy").unlink()  # missing
    (npy / "cocobu_att" / "184613.npy").write_bytes(b"\x93NUMPY garbage, not an array")  # corrupt
    att = np.load(npy / "cocobu_att" / "57870.npy")
    np.save(npy / "cocobu_box_relative" / "57870.npy", np.zeros((att.shape[0], 5)))  # wrong shape
    out_uri = tmp_path / "f.zarr"
    rc, out, _ = run(capsys, "import-features", "--npy-root", str(npy), "--out", str(out_uri), "--json",
                     "--set", "features.dtype=float32")
    assert rc == 0
    s = json.loads(out)
    assert s["images"] == 5 and s["ok"] == 2
    rejected = {r["image_id"]: r["reason"] for r in s["rejected"]}
    assert set(rejected) == {391895, 184613, 57870}
    for reason in rejected.values():
        assert reason.startswith("cannot import features:")
    assert "391895.npy" in rejected[391895]
    assert "boxes have shape (" in rejected[57870]
    store = FeatureStore.open(str(out_uri))
    assert {r["image_id"] for r in store.rejects()} == set(rejected)
    check_store_rows(store, external / "bu_features", np.float32, {384029, 522418})


def test_import_features_missing_npy_for_dataset_image(capsys, external: Path, tmp_path: Path) -> None:
    root = tmp_path / "coco"
    ann, _ = excerpt_root(external, root)
    npy = tmp_path / "bu"
    shutil.copytree(external / "bu_features", npy)
    (npy / "cocobu_att").chmod(0o755)
    (npy / "cocobu_att" / "522418.npy").unlink()
    rc, out, _ = run(capsys, "import-features", "--npy-root", str(npy), "--json", "--out", str(tmp_path / "f.zarr"),
                     *dataset_args(ann, root, tmp_path / "wd"))
    assert rc == 0
    s = json.loads(out)
    assert s["ok"] == 4 and [r["image_id"] for r in s["rejected"]] == [522418]
    assert "522418.npy" in s["rejected"][0]["reason"]


def test_import_features_argument_errors(capsys, external: Path, tmp_path: Path) -> None:
    rc, _, err = run(capsys, "import-features", "--out", str(tmp_path / "f.zarr"))
    assert rc == 2 and "--npy-root" in err
    rc, _, err = run(capsys, "import-features", "--npy-root", str(tmp_path / "nothing"))
    assert rc == 2 and "is not a folder" in err
    rc, _, err = run(capsys, "import-features", "--npy-root", str(external / "bu_features"),
                     "--set", "dataset.features.dtype=float32", "--out", str(tmp_path / "f.zarr"))
    assert rc == 2 and "unknown key 'dataset.features'" in err
    assert not (tmp_path / "f.zarr").exists()


def test_import_features_existing_store_needs_overwrite(capsys, external: Path, tmp_path: Path) -> None:
    argv = ["import-features", "--npy-root", str(external / "bu_features"), "--json",
            "--out", str(tmp_path / "f.zarr")]
    assert run(capsys, *argv)[0] == 0
    # a second import into the same store without --overwrite is a user error: exit 2 with a message
    try:
        rc, out, err = run(capsys, *argv)
    except Exception as e:  # report the crash as the failure it is
        pytest.fail(f"capflow import-features crashed instead of exiting 2 with a message: {e!r}")
    assert rc == 2 and out == ""
    assert str(tmp_path / "f.zarr") in err or "--overwrite" in err
    rc, out, _ = run(capsys, *argv, "--overwrite")
    assert rc == 0 and json.loads(out)["ok"] == 5


def test_vocab_rows_follow_a_feature_store(capsys, external: Path, tmp_path: Path) -> None:
    root = tmp_path / "coco"
    ann, _ = excerpt_root(external, root)
    npy = tmp_path / "bu"
    shutil.copytree(external / "bu_features", npy)
    # a store whose row order differs from the dataset order (ids from file names, 384029 missing)
    (npy / "cocobu_att").chmod(0o755)
    (npy / "cocobu_att" / "384029.npy").unlink()
    store_uri = tmp_path / "f.zarr"
    assert run(capsys, "import-features", "--att-dir", str(npy / "cocobu_att"), "--box-dir",
               str(npy / "cocobu_box_relative"), "--out", str(store_uri), "--json")[0] == 0
    args = [*dataset_args(ann, root, tmp_path / "wd"), "--set", "vocab.min_count=1"]
    rc, _, err = run(capsys, "vocab", "--json", "--features", str(store_uri), *args)
    assert rc == 2 and "384029" in err  # an image without a feature-store row is an error, not a silent gap
    # a store with the images in another order than the dataset's: the labels point at the store's rows
    reordered = str(tmp_path / "reordered.zarr")
    import_npy_features(external / "bu_features" / "cocobu_att", external / "bu_features" / "cocobu_box_relative",
                        list(reversed(BU_IDS)), reordered, max_boxes=100)
    rc, out, _ = run(capsys, "vocab", "--json", "--features", reordered, *args)
    assert rc == 0
    labels = LabelStore.open(json.loads(out)["labels"]).read()
    assert labels.tokens.shape[0] == 25
    assert labels.image_row.tolist() == [4 - BU_IDS.index(int(i)) for i in labels.image_id]
    assert sorted(set(labels.image_row.tolist())) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_evaluate_reproduces_fakecap(external: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["evaluate", "--results", str(external / "coco_eval" / "fakecap_results.json"),
               "--references", str(external / "coco_eval" / "fakecap_refs.json"), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["images"] == 1000
    assert round(out["metrics"]["CIDEr"], 3) == 0.600 and round(out["metrics"]["Bleu_4"], 3) == 0.191
    assert out["metrics"]["SPICE"] is None and out["spice"].startswith("unavailable")


def test_evaluate_bad_results_exit_2(tmp_path: Path, external: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "r.json"
    bad.write_text('[{"image_id": 1, "caption": "x"}')
    rc = main(["evaluate", "--results", str(bad), "--references", str(external / "coco_eval" / "fakecap_refs.json")])
    assert rc == 2 and "r.json" in capsys.readouterr().err


def test_import_checkpoint_is_registered_and_names_a_missing_file(capsys, tmp_path: Path) -> None:
    rc, out, err = run(capsys, "import-checkpoint", "--from", "aic", str(tmp_path / "none.pth"), "--vocab",
                       str(tmp_path / "vocab.json"), "--out", str(tmp_path / "model"))
    assert rc == 2 and out == ""
    assert "none.pth" in err and "does not exist" in err
    assert not (tmp_path / "model").exists()


def test_import_features_that_imports_nothing_or_too_little_exits_2(capsys, external: Path, tmp_path: Path) -> None:
    """Every row rejected: exit 2 naming the reject kinds, and the store removed (the same command runs again once
    the input is fixed). With a dataset, more than features.max_reject_fraction of its images without features:
    the same. A partial import within the bound exits 0 (test_import_features_missing_npy_for_dataset_image)."""
    npy = tmp_path / "bu"
    shutil.copytree(external / "bu_features", npy)
    for p in npy.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    for p in (npy / "cocobu_box_relative").glob("*.npy"):
        np.save(p, np.zeros((3, 5)))  # every record's boxes of the wrong shape
    rc, out, err = run(capsys, "import-features", "--npy-root", str(npy), "--out", str(tmp_path / "f.zarr"))
    assert rc == 2 and out == ""
    assert "no row of 5 was imported (rejects by kind: shape: 5)" in err and "the store was removed" in err
    assert not (tmp_path / "f.zarr").exists()

    root = tmp_path / "coco"
    ann, _ = excerpt_root(external, root)
    few = tmp_path / "few"
    shutil.copytree(external / "bu_features", few)
    for p in few.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    for iid in BU_IDS[1:]:
        (few / "cocobu_att" / f"{iid}.npy").unlink()  # 4 of the dataset's 5 images without features
    rc, _, err = run(capsys, "import-features", "--npy-root", str(few), "--out", str(tmp_path / "g.zarr"),
                     *dataset_args(ann, root, tmp_path / "wd"))
    assert rc == 2 and "4 of the dataset's 5 images have no usable features" in err
    assert "features.max_reject_fraction=0.5" in err and not (tmp_path / "g.zarr").exists()
