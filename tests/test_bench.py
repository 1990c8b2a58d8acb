import json

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
