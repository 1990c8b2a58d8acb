"""``capflow bench scale``: captions per image (1 = Conceptual-Captions-shaped), the WebDataset shards input, the
median of repeats, the quiet check (the machine's load during each run) and the ``cc3m-dry`` preset - small real
runs whose counts are checked against the generator's."""

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from captioning.bench.scale import (
    NOISY_CORES,
    PRESETS,
    SHARD_SPLITS,
    LoadWindow,
    busy_cpu_seconds,
    estimate,
    generate,
    image_id,
    run,
)

PLANTED = {"bad_image_every": 40, "blank_caption_every": 50, "rejected_row_every": 30}


def _dataset_ids(path: Path) -> list[int]:
    from captioning.data.karpathy import open_dataset

    return [e.image_id for e in open_dataset(path).iter_entries()]


def test_shards_one_caption_per_image_every_stage_reads_them(tmp_path):
    """Shards input, 1 caption per image: ingest (dataset.format=webdataset) finds exactly the planted faults
    (empty images and the images whose only caption is blank rejected), splits by hash as the generator expects,
    and every stage that reads the dataset or its labels runs on it; the feature store's rows are the dataset's
    images in its order."""
    from captioning.data.stores import FeatureStore

    stages = ["ingest", "vocab", "loader", "cider", "coco-eval", "digests"]
    res = run(sizes=(120, 300), stages=stages, disk=False, planted=PLANTED, workdir=str(tmp_path), keep=True,
              input_kind="shards", captions_per_image=1)
    p = res["params"]
    assert p["input"] == "shards" and p["captions_per_image"] == 1 and p["shard_splits"] == SHARD_SPLITS
    root = Path(p["kept"])
    for gen in res["generated"]:
        n = gen["images"]
        base = root / f"n{n}"
        assert gen["input"] == "shards" and gen["captions"] == n and gen["blank_captions"] == n // 50
        # one caption each: an image whose caption is blank has none left, and ingest rejects it
        assert gen["no_caption_images"] == len([i for i in range(49, n, 50) if i % 40 != 39]) > 0
        assert gen["rejected"] == gen["bad_images"] + gen["no_caption_images"] == n - gen["kept"]
        assert not (base / "annotations.json").exists() and [f.name for f in (base / "shards").iterdir()] == [
            "00000.tar"]
        rows = {r["stage"]: r["counts"] for r in res["rows"] if r["images"] == n}
        ing = rows["ingest"]
        assert ing["entries"] == n and ing["rejected"] == gen["rejected"] and ing["images"] == gen["kept"]
        assert ing["captions"] == gen["kept_captions"] == gen["kept"]
        assert ing["dropped_captions"] == gen["blank_captions"]
        assert ing["splits"] == {"train": gen["kept"] - gen["val"] - gen["test"], "val": gen["val"],
                                 "test": gen["test"]}
        assert gen["val"] == gen["test"] == int(0.1 * gen["kept"])  # 5000 each, capped at 10% of the kept
        assert rows["vocab"]["label_rows"] == gen["kept_captions"]
        assert rows["loader"]["epoch_images"] == gen["train_ok_rows"]
        assert rows["cider"]["train_images"] == ing["splits"]["train"]
        assert rows["coco-eval"]["test_images"] == gen["test"]
        # the feature store's rows: the kept images (ids = the shards' decimal keys), in the dataset's order
        ids = _dataset_ids(Path((base / "out" / "ingest" / "dataset.path").read_text()))
        store = FeatureStore.open(str(base / "features.zarr"))
        assert store.image_ids().tolist() == ids == sorted(ids)
        assert rows["digests"]["labels_digest"] == rows["vocab"]["digest"]
    json.dumps(res)


def test_generated_shards_are_webdataset_samples(tmp_path):
    """The shard writer: img2dataset's layout (``{key:09d}.jpg`` + ``.txt``, the other captions in ``.json``),
    SHARD_SAMPLES-like splitting into shards, and ingest reads back every caption."""
    from captioning.bench.scale.stages import stage_ingest

    out = tmp_path / "d"
    out.mkdir()
    gen = generate({"root": str(out), "images": 250, "dim": 8, "max_boxes": 12, "chunk_rows": 8, "input": "shards",
                    "captions_per_image": 5, "shard_samples": 100, **PLANTED})
    shards = sorted((out / "shards").glob("*.tar"))
    assert [s.name for s in shards] == ["00000.tar", "00001.tar", "00002.tar"] and gen["shards"] == 3
    with tarfile.open(shards[0]) as tar:
        names = tar.getnames()
        first = f"{int(image_id(0)):09d}"
        assert names[:3] == [f"{first}.jpg", f"{first}.txt", f"{first}.json"] and len(names) == 300
        doc = json.loads(tar.extractfile(f"{first}.json").read())
        assert len(doc["captions"]) == 4
    assert gen["no_caption_images"] == 0 and gen["rejected"] == gen["bad_images"]  # 5 captions: never all blank
    (tmp_path / "o").mkdir()
    ing = stage_ingest({"input": "shards", "shards_root": str(out / "shards"), "out": str(tmp_path / "o")})
    assert ing["images"] == gen["kept"] and ing["captions"] == gen["kept_captions"]
    assert ing["dropped_captions"] == gen["blank_captions"] and ing["rejected"] == gen["rejected"]


def test_karpathy_one_caption_per_image(tmp_path):
    """The Karpathy input at 1 caption per image: the generator's counts, the store's rows and ingest agree (an
    image whose only caption is blank is rejected there too, and has no feature-store row)."""
    res = run(sizes=(100, 200), stages=["ingest", "vocab", "loader"], disk=False, planted=PLANTED,
              workdir=str(tmp_path), captions_per_image=1)
    assert res["params"]["captions_per_image"] == 1 and res["params"]["input"] == "karpathy"
    for gen in res["generated"]:
        rows = {r["stage"]: r["counts"] for r in res["rows"] if r["images"] == gen["images"]}
        assert gen["captions"] == gen["images"] and gen["no_caption_images"] > 0
        assert rows["ingest"]["rejected"] == gen["rejected"] and rows["ingest"]["images"] == gen["kept"]
        assert rows["ingest"]["splits"]["test"] == gen["test"] <= gen["held_out"]
        assert rows["vocab"]["label_rows"] == gen["kept_captions"] == gen["kept"]
        assert rows["loader"]["epoch_images"] == gen["train_ok_rows"]


def test_repeats_report_the_median_and_keep_every_run():
    res = run(sizes=(300, 600), stages=["planted-quadratic"], disk=False, repeats=3)
    assert res["params"]["repeats"] == 3
    for r in res["rows"]:
        runs = r["runs"]
        assert len(runs) == 3
        assert r["seconds"] == sorted(x["seconds"] for x in runs)[1]
        assert r["cpu_seconds"] == sorted(x["cpu_seconds"] for x in runs)[1]
        assert r["peak_rss_mb"] == max(x["peak_rss_mb"] for x in runs)
        assert r["start_rss_mb"] == min(x["start_rss_mb"] for x in runs)
        assert "others_cpu_per_s" not in r  # no quiet check asked


def test_summary_of_runs_is_median_time_and_max_memory():
    from captioning.bench.scale.driver import _summarise

    def one(sec, cpu, peak, others):
        return {"seconds": sec, "cpu_seconds": cpu, "peak_rss_mb": peak, "start_rss_mb": 50.0, "write_bytes": 1,
                "output_bytes": 2, "peak_reset": True, "counts": {"k": sec},
                "load": {"others_cpu_per_s": others, "loadavg_start": 1.5, "noisy": others > NOISY_CORES}}

    row = _summarise([one(1.0, 0.9, 100.0, 0.0), one(9.0, 1.2, 80.0, 1.5), one(2.0, 1.0, 120.0, 0.1)], quiet=True)
    assert row["seconds"] == 2.0 and row["cpu_seconds"] == 1.0 and row["peak_rss_mb"] == 120.0
    assert row["work_rss_mb"] == 70.0 and row["counts"] == {"k": 2.0}  # the last run's counts
    # one disturbed run of three: the median is quiet, so the row is not marked; the largest is kept
    assert row["others_cpu_per_s"] == 0.1 and row["others_cpu_per_s_max"] == 1.5 and row["noisy"] is False
    assert [x["noisy"] for x in row["runs"]] == [False, True, False]


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_quiet_check_marks_a_run_beside_busy_processes_noisy():
    """Two busy-loop processes running beside a tiny stage: the rows say other processes used more than half a
    core on average (2 cores' worth on an idle machine, at least ~0.7 on a 2-core one whatever else runs), and are
    marked noisy."""
    procs = _busy(2)
    try:
        time.sleep(0.3)
        res = run(sizes=(300, 600), stages=["planted-quadratic"], disk=False, quiet_check=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r in res["rows"]:
        assert r["others_cpu_per_s"] > 0.5 and r["noisy"] is True, r
        assert r["runs"][0]["others_cpu_per_s"] == r["others_cpu_per_s"]
    q = res["quiet_check"]
    assert q["noisy_rows"] == q["rows"] == 2 and q["max_others_cpu_per_s"] > 0.5
    assert q["threshold_cores"] == NOISY_CORES and "others' cores" in res["table"] and "(noisy)" in res["table"]
    assert res["stages"]["planted-quadratic"]["noisy"] is True


def test_quiet_check_fields_on_an_ordinary_run():
    """Without extra load (a shared box may still be busy: no quietness asserted), the fields are there and sane."""
    res = run(sizes=(300, 600), stages=["planted-quadratic"], disk=False, quiet_check=True)
    for r in res["rows"]:
        assert r["others_cpu_per_s"] >= 0 and isinstance(r["noisy"], bool)
        assert r["loadavg_start"] >= 0
    assert res["quiet_check"]["rows"] == 2 and res["params"]["quiet_check"] is True


def test_load_window_counts_a_busy_process_but_not_its_own_children():
    before = busy_cpu_seconds()
    assert before is not None and before > 0
    w = LoadWindow()
    w.start()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: "
                    "pass"], check=True)
    own = w.stop()
    assert own["own_cpu_seconds"] >= 0.45  # the waited-for child's CPU is this run's own, not others'
    assert own["others_cpu_per_s"] >= 0 and own["window_seconds"] >= 0.5


def test_estimate_is_linear_in_images_along_the_reference():
    one = estimate([100_000], ["ingest", "vocab"])
    two = estimate([200_000], ["ingest", "vocab"], repeats=1)
    assert one["seconds"] > 0 and set(one["per_stage"]) == {"generate", "ingest", "vocab"}
    assert two["seconds"] == pytest.approx(one["seconds"] * 2, rel=0.3)
    assert estimate([1000], ["nope"])["unknown"] == ["nope"]
    cc3m = PRESETS["cc3m-dry"]
    assert cc3m["sizes"] == (3_300_000,) and cc3m["captions_per_image"] == 1 and cc3m["input_kind"] == "shards"
    assert set(cc3m["stages"]) == {"ingest", "vocab", "cider", "digests"}


def test_cli_cc3m_dry_preset_at_a_small_size(capsys, tmp_path):
    """``--preset cc3m-dry`` with ``--sizes`` overriding its 3.3M images: the preset's stages, input and captions
    per image, end to end; the estimate is printed before the run starts."""
    from flows.cli import main

    rc = main(["bench", "scale", "--preset", "cc3m-dry", "--sizes", "400", "--json", "--tmp", str(tmp_path)])
    assert rc == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    p = out["params"]
    assert p["sizes"] == [400] and p["input"] == "shards" and p["captions_per_image"] == 1
    assert p["stages"] == ["ingest", "vocab", "cider", "digests"] and p["quiet_check"] is True
    assert "disk_per_100k_images" not in out
    assert "preset cc3m-dry" in cap.err and "estimated" in cap.err
    assert cap.err.index("estimated") < cap.err.index("[scale] generating")
    rows = {r["stage"]: r["counts"] for r in out["rows"]}
    gen = out["generated"][0]
    assert rows["ingest"]["images"] == gen["kept"] and rows["vocab"]["label_rows"] == gen["kept_captions"]
    assert rows["cider"]["train_images"] == rows["ingest"]["splits"]["train"]
    assert np.isfinite(rows["digests"]["dataset_digest_seconds"])


def test_cli_scale_refuses_bad_preset_and_input(capsys):
    from flows.cli import main

    assert main(["bench", "scale", "--preset", "nope", "--json"]) != 0
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["bench", "scale", "--sizes", "300", "--captions-per-image", "0", "--stages", "ingest",
                 "--json"]) != 0
    assert "at least 1" in capsys.readouterr().err
