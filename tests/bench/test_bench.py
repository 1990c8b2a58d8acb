import json
import math
import statistics

import pytest
import torch

from captioning.bench.loader import run
from flows.cli import main


def test_bench_loader_reports_rows_and_ratios(tmp_path):
    res = run(images=24, batch_size=6, max_boxes=8, dim=16, chunk_rows=4, repeats=1, epochs=1, workdir=str(tmp_path))
    assert res["bench"] == "loader"
    assert {"python", "cpus", "torch"} <= res["machine"].keys()
    got = {(r["source"], r["cache"]) for r in res["rows"]}
    assert got == {("zarr", "warm"), ("zarr", "cold"), ("npy", "warm"), ("npy", "cold"), ("memory", "warm")}
    for r in res["rows"]:
        assert r["batches"] == 4 and r["seconds"] > 0
        assert abs(r["images_per_second"] - r["batches_per_second"] * 6) < 1e-6
    bps = {(r["source"], r["cache"]): r["batches_per_second"] for r in res["rows"]}
    assert abs(res["ratios"]["zarr_vs_npy"] - bps[("zarr", "cold")] / bps[("npy", "cold")]) < 1e-9
    assert abs(res["ratios"]["zarr_vs_memory"] - bps[("zarr", "cold")] / bps[("memory", "warm")]) < 1e-9
    assert list(tmp_path.iterdir()) == []  # temporary data removed


def test_bench_loader_cli_json(capsys, tmp_path):
    rc = main(["bench", "loader", "--json", "--images", "16", "--max-boxes", "6", "--chunk-rows", "4",
               "--batch-size", "4", "--repeats", "1", "--epochs", "1", "--tmp", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "loader" and set(out["ratios"]) >= {"zarr_vs_npy", "zarr_vs_memory"}
    assert all(v > 0 for v in out["ratios"].values())


def test_bench_decode_reports_speedups():
    from captioning.bench.decode import run as run_decode

    res = run_decode(names=["aic", "satic-k2"], max_words=4, regions=4, repeats=1, batch=2)
    assert res["bench"] == "decode" and [r["preset"] for r in res["rows"]] == ["aic", "satic-k2"]
    aic, k2 = res["rows"]
    assert (aic["steps"], k2["steps"]) == (4, 2) and aic["tokens"] == k2["tokens"] == 4
    assert res["ratios"]["satic_k2_vs_aic"] == aic["latency_ms_batch1"] / k2["latency_ms_batch1"]
    assert res["ratios"]["cached_vs_uncached"] == aic["uncached_latency_ms_batch1"] / aic["latency_ms_batch1"]
    assert all(r["encoder_ms_batch1"] > 0 and r["images_per_s_batch2"] > 0 for r in res["rows"])


def test_bench_learning_cli_json_small(capsys, tmp_path):
    """Every stage of the learning bench at the smallest size, one seed (``--seeds 1``): structure, consistency,
    the baseline."""
    sets = ["dataset.synthetic.num_images=48", "dataset.synthetic.val_fraction=0.2",
            "dataset.synthetic.test_fraction=0.2", "students.size=tiny", "teacher.model.d_model=32",
            "teacher.model.layers=1", "teacher.model.heads=2", "teacher.model.d_ff=64", "teacher.xe.epochs=1",
            "students.xe.epochs=1", "students.scst.epochs=1", "students.scst.samples=2", "loader.batch_size=16",
            "evaluation.beam=2", "students.seqkd_beam=2", "students.per_student.expansionnet.scst_epochs=2"]
    threads = torch.get_num_threads()
    rc = main(["bench", "learning", "--json", "--seeds", "1", "--threads", "1", "--tmp", str(tmp_path),
               *[a for s in sets for a in ("--set", s)]])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    # --threads holds for the bench (recorded with the CPU capability) and is given back afterwards
    assert out["machine"]["threads"] == 1
    assert out["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert torch.get_num_threads() == threads
    # students.per_student: ExpansionNet's SCST ran its own epoch count, every other model students.scst.epochs
    scst_epochs = {f: len(m["scst_val_cider"]) for f, m in out["runs"][0]["models"].items()}
    assert scst_epochs == {"aic": 1, "acort": 1, "expansionnet": 2, "lw": 1, "satic": 1, "zodiac": 1}
    assert out["bench"] == "learning" and out["images"] == 48
    assert set(out["models"]) == {"aic", "acort", "expansionnet", "lw", "satic", "zodiac"}
    assert set(out["satic_ablation"]) == {"base", "seqkd", "weight_init"}
    assert out["models"]["satic"] == out["satic_ablation"]["weight_init"]
    abl = out["satic_ablation"]
    assert abl["weight_init"]["init"] == "teacher" and abl["weight_init"]["init_tensors_loaded"] > 0
    assert abl["base"]["init"] == "random" and abl["base"]["captions"] == "ground_truth"
    assert abl["seqkd"]["captions"] == "seqkd"
    for m in out["models"].values():
        for stage in ("xe", "scst"):
            assert m[stage]["CIDEr"] >= 0 and m[stage]["SPICE"] is None and m[stage]["params"] > 0
    assert len(out["rows"]) == 2 * 8  # aic, acort, expansionnet, lw, zodiac, 3 SATIC variants
    assert out["baseline_cider"] == out["baseline_metrics"]["CIDEr"] >= 0
    assert out["seqkd"]["captions"] == out["splits"]["train"]
    worst = min(m["xe"]["CIDEr"] for m in out["models"].values())
    assert out["ratios"]["xe_vs_baseline_min"] == worst / max(out["baseline_cider"], 1e-9)
    # one seed: the means are that seed's numbers, no sd; the diversity figures of the test captions
    assert out["seeds"] == 1 and out["run_seeds"] == [0] and out["dataset_seeds"] == [0] and len(out["runs"]) == 1
    assert out["runs"][0]["rows"][0]["CIDEr"] == out["rows"][0]["CIDEr"] and out["rows"][0]["CIDEr_sd"] is None
    assert out["claims"]["seeds"] == 1 and set(out["claims"]["scst_gt_xe"]) == set(out["models"])
    assert out["claims"]["satic_order"] in (0, 1)
    for r in out["rows"]:
        assert r["seeds"] == 1 and 1 <= r["distinct_captions"] <= out["splits"]["test"]
        assert r["distinct_fraction"] == r["distinct_captions"] / out["splits"]["test"]
        assert 0 <= r["repeated_token_rate"] <= r["repeat_caption_fraction"] <= 1 or r["repeat_caption_fraction"] == 0
    assert out["models"]["aic"]["per_seed"]["xe"]["CIDEr"] == [out["models"]["aic"]["xe"]["CIDEr"]]
    # the pipeline's own jobs made every number: their stage records are in the seed's workdir, so the same bench
    # again finds every stage recorded and reports the same figures without training
    stages = out["runs"][0]["stages"]
    assert stages == {s: "ran" for s in ("ingest", "extract", "vocab", "teacher", "student-teacher", "seqkd",
                                         "student-acort", "student-expansionnet", "student-lw", "student-satic-base",
                                         "student-satic-seqkd", "student-satic-weight_init", "student-zodiac")}
    assert main(["bench", "learning", "--json", "--seeds", "1", "--threads", "1", "--tmp", str(tmp_path),
                 *[a for s in sets for a in ("--set", s)]]) == 0
    again = json.loads(capsys.readouterr().out)
    assert set(again["runs"][0]["stages"].values()) == {"cached"}
    assert again["models"] == out["models"] and again["rows"] == out["rows"] and again["ratios"] == out["ratios"]


def _fake_run(seed: int, xe: dict, scst: dict, base: float, abl: tuple[float, float, float]) -> dict:
    def model(x, s):
        return {"arch": "a", "xe": {"CIDEr": x, "SPICE": None}, "scst": {"CIDEr": s, "SPICE": None},
                "xe_best_val_cider": x, "scst_best_val_cider": s, "scst_best_epoch": seed - 1,
                "scst_val_cider": [x, s]}

    models = {f: model(xe[f], scst[f]) for f in xe}
    ablation = {v: model(c, c) for v, c in zip(("base", "seqkd", "weight_init"), abl, strict=True)}
    models["satic"] = ablation["weight_init"]
    rows = [{"model": f, "stage": st, "CIDEr": models[f][st]["CIDEr"], "params": 10, "distinct_captions": seed}
            for f in models for st in ("xe", "scst")]
    return {"seed": seed, "dataset_seed": seed, "baseline_cider": base, "baseline_caption": f"cap {seed}",
            "models": models, "satic_ablation": ablation, "rows": rows}


def test_bench_learning_aggregates_seeds_and_counts_claims():
    """Means, sample sds, per-seed values, ratios on the means and the claim counts, on known numbers."""
    from captioning.bench import learning

    runs = [_fake_run(0, {"aic": 1.0, "lw": 0.6}, {"aic": 1.2, "lw": 0.5}, 0.19, (0.3, 0.5, 0.9)),
            _fake_run(1, {"aic": 1.2, "lw": 0.8}, {"aic": 1.1, "lw": 0.9}, 0.35, (0.6, 0.5, 0.8)),
            _fake_run(2, {"aic": 0.8, "lw": 0.7}, {"aic": 1.5, "lw": 0.95}, 0.3, (0.2, 0.4, 0.7))]
    mean, sd, per = learning.aggregate([r["models"]["aic"] for r in runs])
    assert mean["xe"]["CIDEr"] == pytest.approx(1.0) and sd["xe"]["CIDEr"] == pytest.approx(0.2)
    assert per["scst"]["CIDEr"] == [1.2, 1.1, 1.5] and mean["xe"]["SPICE"] is None and mean["arch"] == "a"
    assert mean["scst_val_cider"] == pytest.approx([1.0, (1.2 + 1.1 + 1.5) / 3])  # element by element
    assert learning.aggregate([1, 2])[1] == pytest.approx(2 ** -0.5) and learning.aggregate([3])[1] is None
    assert learning.aggregate(["x", "y"])[0] == ["x", "y"]

    claims = learning.claims(runs)
    assert claims["seeds"] == 3
    assert claims["scst_gt_xe"] == {"aic": 2, "lw": 2, "satic": 0}  # satic: SCST == XE in the fake runs
    assert claims["xe_vs_baseline_3x"] == {"aic": 2, "lw": 1, "satic": 1}  # 3x baselines 0.57, 1.05, 0.9
    assert claims["satic_order"] == 2  # seed 1: 0.6 > 0.5

    rows = learning.rows_of(runs)
    assert [(r["model"], r["stage"]) for r in rows][:2] == [("aic", "xe"), ("aic", "scst")]
    assert rows[0]["CIDEr"] == pytest.approx(1.0) and rows[0]["CIDEr_sd"] == pytest.approx(0.2)
    assert rows[0]["distinct_captions"] == 1.0 and rows[0]["distinct_captions_sd"] == 1.0
    assert rows[0]["params"] == 10 and "params_sd" not in rows[0] and rows[0]["seeds"] == 3

    models = {f: learning.family([r["models"][f] for r in runs]) for f in ("aic", "lw")}
    ratios = learning.ratios_of(0.3, models, {})
    assert ratios["scst_vs_xe_aic"] == pytest.approx((3.8 / 3) / 1.0)
    assert ratios["xe_vs_baseline_min"] == pytest.approx(0.7 / 0.3)  # on the means, not per seed
    assert models["lw"]["sd"]["scst"]["CIDEr"] == pytest.approx(statistics.stdev([0.5, 0.9, 0.95]))


def test_bench_learning_seeds_change_data_split_and_run_seed(tmp_path):
    """Seed i raises run.seed and the synthetic dataset's seed by i: other images, another split."""
    from captioning.bench.learning import seed_overrides, split_digest
    from captioning.config import load_config
    from captioning.data.plans import ingest_plan
    from captioning.data.prepare import ingest

    base = ["dataset.synthetic.num_images=24", "run.seed=5", "dataset.synthetic.seed=7"]
    cfg0 = load_config("learning", overrides=[*base, f"run.workdir={tmp_path}"])
    assert seed_overrides(cfg0, 0) == ["run.seed=5", "dataset.synthetic.seed=7"]
    assert seed_overrides(cfg0, 2) == ["run.seed=7", "dataset.synthetic.seed=9"]
    splits = []
    for i in range(2):
        cfg = load_config("learning", overrides=[*base, f"run.workdir={tmp_path / str(i)}", *seed_overrides(cfg0, i)])
        assert (cfg.run.seed, cfg.dataset.synthetic.seed) == (5 + i, 7 + i)
        ds = ingest(ingest_plan(cfg))
        splits.append((split_digest(ds), sorted(e.image_id for e in ds.split("test")),
                       ds.split("train")[0].captions))
    assert splits[0][0] != splits[1][0]
    assert splits[0][1] != splits[1][1] or splits[0][2] != splits[1][2]


def test_bench_train_rows_and_ratios():
    """The train bench at quick size on CPU: both paths per family and stage, the batch-size rows, consistent
    numbers (no timing is asserted), and on a CPU both paths compute the same XE loss (fp32 either way)."""
    from captioning.bench.train import run as run_train

    res = run_train(families=["aic", "acort"], quick=True, steps=1, warmup=1, memory_batches=(4,))
    assert res["bench"] == "train" and res["machine"]["device"] == "cpu"
    assert {"python", "cpus", "torch"} <= res["machine"].keys()
    assert res["params"]["precision"] == "fp32" and res["params"]["batch"] == 8
    got = [(r["family"], r["stage"], r["path"], r["batch"]) for r in res["rows"]]
    per_family = [("xe", "fp32_eager", 8), ("xe", "fast", 8), ("scst", "fp32_eager", 8), ("scst", "fast", 8)]
    assert got == [("aic", *k) for k in per_family] + [("aic", "xe", "fast", 4)] + [("acort", *k) for k in per_family]
    for r in res["rows"]:
        assert r["steps"] == 1 and r["seconds"] > 0 and r["precision"] == "fp32" and r["memory_peak_mb"] is None
        assert r["images_per_s"] == pytest.approx(r["batch"] / r["seconds"], rel=1e-12)
        assert r["attention"] == "explicit"  # CPUs keep the explicit path (attention mode auto)
        assert math.isfinite(r["loss"])
        tokens = r["tokens_per_s"] * r["seconds"]
        assert tokens == pytest.approx(round(tokens), abs=1e-6)
        per_word = 2 if r["family"] == "acort" else 1  # radix digits per word
        if r["stage"] == "xe":  # captions of 5..8 words + EOS
            assert r["captions"] == 2 and r["layers"] == "2+2" and r["d_model"] == 64
            assert r["batch"] * 2 * (5 * per_word + 1) <= round(tokens) <= r["batch"] * 2 * (8 * per_word + 1)
        else:  # 2 samples per image, each 1..max_tokens rewarded tokens
            assert r["captions"] == 2 and r["batch"] * 2 <= round(tokens) <= r["batch"] * 2 * (8 * per_word + 1)
    rows = {(r["family"], r["stage"], r["path"], r["batch"]): r for r in res["rows"]}
    for fam in ("aic", "acort"):
        a, f = rows[(fam, "xe", "fp32_eager", 8)], rows[(fam, "xe", "fast", 8)]
        assert f["loss"] == pytest.approx(a["loss"], abs=1e-4)  # same model, same batch, same step
        for stage in ("xe", "scst"):
            ratio = rows[(fam, stage, "fast", 8)]["images_per_s"] / rows[(fam, stage, "fp32_eager", 8)]["images_per_s"]
            assert res["ratios"][f"{stage}_speedup_vs_fp32_eager_{fam}"] == pytest.approx(ratio, rel=1e-12)
    assert res["ratios"]["speedup_vs_fp32_eager"] == res["ratios"]["xe_speedup_vs_fp32_eager_aic"]
    assert res["ratios"]["scst_speedup_vs_fp32_eager"] == res["ratios"]["scst_speedup_vs_fp32_eager_aic"]
    assert all(v > 0 for v in res["ratios"].values())


def test_bench_train_cli_json(capsys):
    rc = main(["bench", "train", "--json", "--quick", "--presets", "satic", "--repeats", "1", "--batch-size", "4"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "train" and out["params"]["families"] == ["satic"] and out["params"]["batch"] == 4
    assert {(r["stage"], r["path"]) for r in out["rows"] if r["batch"] == 4} == {
        ("xe", "fp32_eager"), ("xe", "fast"), ("scst", "fp32_eager"), ("scst", "fast")}
    assert out["rows"][0]["preset"] == "satic-k4"
    assert set(out["ratios"]) >= {"speedup_vs_fp32_eager", "scst_speedup_vs_fp32_eager"}


def test_bench_train_graphs_row():
    """--graphs adds an XE row fast_graphs per family (on a CPU the eager step: same loss as fast), its ratio,
    and makes it the headline path."""
    from captioning.bench.train import run as run_train

    res = run_train(families=["aic"], quick=True, steps=1, warmup=1, memory_batches=(), scst=False, graphs=True)
    rows = {r["path"]: r for r in res["rows"]}
    assert list(rows) == ["fp32_eager", "fast", "fast_graphs"]
    g = rows["fast_graphs"]
    assert g["compile"] == "graphs" and g["stage"] == "xe" and "graph_replays" not in g  # CPU: no graph
    assert g["loss"] == pytest.approx(rows["fast"]["loss"], abs=1e-6)
    ratio = g["images_per_s"] / rows["fp32_eager"]["images_per_s"]
    assert res["ratios"]["xe_graphs_speedup_vs_fp32_eager_aic"] == pytest.approx(ratio, rel=1e-12)
    assert res["ratios"]["speedup_vs_fp32_eager"] == res["ratios"]["xe_graphs_speedup_vs_fp32_eager_aic"]
    assert res["headline_path"] == {"xe": "fast_graphs"} and res["params"]["graphs"] is True
