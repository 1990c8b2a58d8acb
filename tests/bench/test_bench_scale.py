"""``capflow bench scale``: the fit itself (a planted O(N^2) stage reads ~2), and a small real run whose counts and
bytes come from the stages' own work (checked against the generator's and the files left behind)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from captioning.bench.scale import (
    COCO_IMAGES,
    STAGES,
    extrapolate,
    fit_stage,
    growth_exponent,
    held_out,
    run,
    tree_bytes,
)


def test_growth_exponent_and_extrapolation():
    assert growth_exponent(1000, 2.0, 10_000, 20.0) == pytest.approx(1.0)
    assert growth_exponent(1000, 1.0, 10_000, 100.0) == pytest.approx(2.0)
    assert growth_exponent(1000, 3.0, 10_000, 3.0) == pytest.approx(0.0)
    assert growth_exponent(1000, 0.0, 10_000, 1.0) is None  # log of 0
    assert growth_exponent(1000, 1.0, 1000, 2.0) is None
    assert extrapolate(100_000, 10.0, 1.0, 1_000_000) == pytest.approx(100.0)
    assert extrapolate(100_000, 10.0, 2.0, 1_000_000) == pytest.approx(1000.0)
    assert extrapolate(100_000, 10.0, None, 1_000_000) is None


def test_fit_uses_the_two_largest_sizes_and_memory_above_the_start():
    def row(n, sec, work):
        return {"images": n, "seconds": sec, "start_rss_mb": 100.0, "work_rss_mb": work}

    # time: quadratic between the two largest (the smallest size, off the curve, is ignored); memory: linear
    f = fit_stage([row(10, 5.0, 1.0), row(1000, 1.0, 10.0), row(2000, 4.0, 20.0)])
    assert f["sizes"] == [1000, 2000]
    assert f["time_exponent"] == pytest.approx(2.0) and f["rss_exponent"] == pytest.approx(1.0)
    coco = f["extrapolated"][str(COCO_IMAGES)]
    assert coco["seconds"] == pytest.approx(4.0 * (COCO_IMAGES / 2000) ** 2)
    assert coco["peak_rss_mb"] == pytest.approx(100.0 + 20.0 * COCO_IMAGES / 2000)
    # flat memory (below 1 MiB above the start at both sizes) reads as exponent 0, extrapolated flat
    flat = fit_stage([row(1000, 1.0, 0.2), row(2000, 2.0, 0.5)])
    assert flat["rss_exponent"] == pytest.approx(0.0) and flat["memory_flat"]
    assert flat["extrapolated"][str(COCO_IMAGES)]["peak_rss_mb"] == pytest.approx(100.5)
    assert fit_stage([row(1000, 1.0, 1.0)])["time_exponent"] is None


def test_planted_quadratic_stage_reads_about_two():
    """The planted stage is an O(N^2) loop measured like every stage (fresh process, wall time): the exponent the
    bench fits from it must be ~2, or the fit (or the measurement) is wrong."""
    res = run(sizes=(2000, 6000), stages=["planted-quadratic"], disk=False, repeats=3)
    rows = res["rows"]
    assert [(r["stage"], r["images"]) for r in rows] == [("planted-quadratic", 2000), ("planted-quadratic", 6000)]
    assert [r["counts"]["pairs"] for r in rows] == [2000 * 1999 // 2, 6000 * 5999 // 2]
    # no timing assertion (times move with the machine's load): the fit applied to the work the stage really did
    # (its counted pairs) reads 2, and the bench reports a fitted time exponent for the stage
    pairs = [r["counts"]["pairs"] for r in rows]
    assert growth_exponent(2000, pairs[0], 6000, pairs[1]) == pytest.approx(2.0, abs=0.01)
    fit = res["stages"]["planted-quadratic"]
    assert "cpu_exponent" in fit and "time_ok" in fit
    assert res["generated"] == []  # the planted stage reads no data: none was generated
    assert "planted-quadratic" in res["table"]


def test_small_run_counts_and_bytes_are_real(tmp_path):
    planted = {"bad_image_every": 40, "blank_caption_every": 50, "rejected_row_every": 30}
    res = run(sizes=(120, 240), stages=["ingest", "vocab", "digests", "loader"], disk=False, planted=planted,
              workdir=str(tmp_path), keep=True)
    root = Path(res["params"]["kept"])
    assert res["params"]["stages"] == ["ingest", "vocab", "loader", "digests"]  # dependency order
    for gen in res["generated"]:
        n = gen["images"]
        assert gen["bad_images"] == n // 40 and gen["kept"] == n - n // 40
        assert gen["captions"] == 5 * n and gen["blank_captions"] == 5 * n // 50
        assert gen["held_out"] == held_out(n) and gen["store_rows"] == gen["kept"]
        rows = {r["stage"]: r for r in res["rows"] if r["images"] == n}
        ing = rows["ingest"]["counts"]
        # ingest found exactly the planted faults: empty files rejected, blank captions dropped
        assert ing["entries"] == n and ing["rejected"] == gen["bad_images"]
        assert ing["images"] == gen["kept"] and ing["captions"] == gen["kept_captions"]
        assert ing["dropped_captions"] == gen["blank_captions"]
        assert rows["vocab"]["counts"]["label_rows"] == gen["kept_captions"]
        assert rows["loader"]["counts"]["epoch_images"] == gen["train_ok_rows"]
        assert rows["loader"]["counts"]["batches"] == math.ceil(gen["train_ok_rows"] / 50)
        # bytes: what the stage's outputs hold on disk, as left behind
        base = root / f"n{n}"
        assert rows["ingest"]["output_bytes"] == tree_bytes(base / "out" / "ingest") > 0
        assert rows["vocab"]["output_bytes"] == tree_bytes(base / "out" / "vocab") > 0
        assert rows["loader"]["output_bytes"] == 0
        for r in rows.values():
            assert r["seconds"] > 0 and r["peak_rss_mb"] >= r["start_rss_mb"] > 0
            assert r["write_bytes"] is None or r["write_bytes"] >= 0
        # digests are the stores' own
        from captioning.data.karpathy import Dataset
        from captioning.data.stores import FeatureStore, LabelStore

        dig = rows["digests"]["counts"]
        assert dig["features_digest"] == FeatureStore.open(str(base / "features.zarr")).manifest()["digest"][:16]
        labels = LabelStore.open(str(base / "out" / "vocab" / "labels.zarr"))
        assert dig["labels_digest"] == labels.digest()[:16] == rows["vocab"]["counts"]["digest"]
        ds = Dataset.load((base / "out" / "ingest" / "dataset.path").read_text())
        assert len(ds.images) == gen["kept"] and dig["dataset_digest"] == ds.digest[:16]
        assert int(labels.group["tokens"].shape[0]) == gen["kept_captions"]
    for name in ("ingest", "vocab", "digests", "loader"):
        assert res["stages"][name]["sizes"] == [120, 240]
        assert res["stages"][name]["time_exponent"] is not None
    json.dumps(res)  # the result is plain JSON


def test_generated_captions_follow_the_coco_shape(tmp_path):
    from captioning.bench.scale import LENGTHS, generate

    out = tmp_path / "d"
    out.mkdir()
    gen = generate({"root": str(out), "images": 400, "dim": 8, "max_boxes": 12, "chunk_rows": 8})
    doc = json.loads((out / "annotations.json").read_text())
    sents = [s for e in doc["images"] for s in e["sentences"] if s["tokens"]]
    lengths = np.array([len(s["tokens"]) for s in sents])
    want = sum(k * v for k, v in LENGTHS.items()) / sum(LENGTHS.values())
    assert abs(lengths.mean() - want) < 0.3 and lengths.min() >= min(LENGTHS) and lengths.max() <= max(LENGTHS)
    assert all(s["raw"][0].isupper() and s["raw"].endswith(".") for s in sents)
    splits = [e["split"] for e in doc["images"]]
    assert splits.count("val") == splits.count("test") == held_out(400) == gen["held_out"]
    assert {"train", "restval"} <= set(splits)
    assert len(list((out / "images").rglob("*.jpg"))) == 400


def test_cli_bench_scale_json(capsys):
    from flows.cli import main

    rc = main(["bench", "scale", "--sizes", "300,600", "--stages", "planted-quadratic", "--no-disk", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "scale" and out["params"]["sizes"] == [300, 600]
    assert {"python", "cpus", "torch"} <= out["machine"].keys()
    assert "planted-quadratic_time_exponent" in out["ratios"]


def test_cli_bench_scale_refuses_unknown_stage(capsys):
    from flows.cli import main

    assert main(["bench", "scale", "--sizes", "300,600", "--stages", "nope", "--json"]) != 0
    assert "unknown stage 'nope'" in capsys.readouterr().err


def test_every_default_stage_is_named_and_importable():
    import importlib

    from tasks.bench_scale import STAGES as PIPELINE

    for st in [*STAGES.values(), *PIPELINE.values()]:
        mod, fn = st.func.split(":")
        assert callable(getattr(importlib.import_module(mod), fn)), st.name
        assert all(d in STAGES for d in st.needs), st.name
