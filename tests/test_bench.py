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
