"""``capflow bench import``: a synthetic bottom-up TSV (``tools/generate_tsv.py``'s six fields) imported into a
feature store at several row counts, each in a fresh process, reporting the time and the process's peak resident
memory per row count: the import streams, so the peak must stay flat while the rows grow (COCO's TSV is tens of
GB; a reader that held the file, or one array per record, would grow with it).

Every ``bad_every``-th record carries a corrupt base64 features field, so the counts are checked too: ``ok +
rejected == rows`` and ``rejected == rows // bad_every``. The feature width is small by default (16) so that the
files stay small (~4 KB per record, 0.4 GB at 100k rows) and the time goes into the import's own per-record work,
not into base64 of 2048-d features; the memory bound does not depend on it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from captioning.bench.machine import machine_info, status_mb


def write_tsv(path: Path, rows: int, *, dim: int, boxes: int, bad_every: int = 0, seed: int = 0) -> int:
    """Write ``rows`` records (image ids 1..rows, 640x480 images, ``boxes`` regions of ``dim`` float32 each) one
    line at a time; every ``bad_every``-th record's features field is not base64. Returns the expected rejects."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(64):  # a pool of distinct records, reused: writing is not what is measured
        xy = rng.random((boxes, 2), dtype=np.float32) * np.float32(300)
        px = np.concatenate([xy, xy + 10 + rng.random((boxes, 2), dtype=np.float32) * 150], 1).astype(np.float32)
        f = np.maximum(rng.standard_normal((boxes, dim), dtype=np.float32), 0)
        pool.append((base64.b64encode(px.tobytes()).decode(), base64.b64encode(f.tobytes()).decode()))
    bad = 0
    with open(path, "w", encoding="ascii", newline="") as out:
        for i in range(1, rows + 1):
            b64_boxes, b64_feats = pool[i % len(pool)]
            if bad_every and i % bad_every == 0:
                b64_feats = "!" + b64_feats[1:]
                bad += 1
            out.write(f"{i}\t640\t480\t{boxes}\t{b64_boxes}\t{b64_feats}\r\n")
    return bad


def _child(params: dict) -> dict:
    """One import in this (fresh) process: seconds, counts, resident memory before and at peak."""
    from captioning.data.imports.butd_tsv import ButdTsvSource
    from captioning.data.imports.importer import import_source
    from captioning.data.stores import OK, REJECTED

    start_rss = status_mb("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    src = ButdTsvSource(Path(params["tsv"]), max_boxes=params["boxes"], feature_dim=params["dim"])
    res = import_source(src, params["out"], max_boxes=params["boxes"], feature_dim=params["dim"],
                        chunk_rows=params["chunk_rows"], dtype=params["dtype"], overwrite=True)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = status_mb("VmHWM")  # the import's peak (reading the whole status array back below is not the import)
    status = res.store.status()
    return {"seconds": seconds, "cpu_seconds": cpu, "records": res.records, "ok": int((status == OK).sum()),
            "rejected": int((status == REJECTED).sum()), "reject_kinds": res.reasons, "start_rss_mb": start_rss,
            "peak_rss_mb": peak}


def run(rows: tuple[int, ...] = (10_000, 100_000), dim: int = 16, boxes: int = 36, chunk_rows: int = 8,
        bad_every: int = 1000, dtype: str = "float16", workdir: str | None = None) -> dict:
    if not rows or min(rows) < 1:
        raise ValueError("rows must be positive row counts")
    root = Path(tempfile.mkdtemp(prefix="capflow-bench-import-", dir=workdir))
    out_rows = []
    try:
        for n in sorted(rows):
            tsv = root / f"synthetic-{n}.tsv"
            bad = write_tsv(tsv, n, dim=dim, boxes=boxes, bad_every=bad_every)
            file_mb = tsv.stat().st_size / 2**20
            params = {"tsv": str(tsv), "out": str(root / f"store-{n}.zarr"), "dim": dim, "boxes": boxes,
                      "chunk_rows": chunk_rows, "dtype": dtype}
            proc = subprocess.run([sys.executable, "-m", "captioning.bench.imports", json.dumps(params)],
                                  capture_output=True, text=True, check=False,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                      str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))})
            if proc.returncode != 0:
                raise RuntimeError(f"the import of {n} rows failed: {proc.stderr.strip()[-2000:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            store_mb = sum(p.stat().st_size for p in Path(params["out"]).rglob("*") if p.is_file()) / 2**20
            out_rows.append({"rows": n, "file_mb": round(file_mb, 1), "store_mb": round(store_mb, 1),
                             "expected_rejects": bad, **got, "rows_per_second": n / got["seconds"],
                             "counts_ok": got["ok"] + got["rejected"] == n and got["rejected"] == bad})
            tsv.unlink()
            shutil.rmtree(params["out"], ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first, last = out_rows[0], out_rows[-1]
    growth = last["peak_rss_mb"] - first["peak_rss_mb"]
    return {
        "bench": "import",
        "machine": machine_info(),
        "params": {"format": "butd-tsv", "rows": sorted(rows), "dim": dim, "boxes": boxes, "chunk_rows": chunk_rows,
                   "dtype": dtype, "bad_every": bad_every},
        "rows": out_rows,
        "ratios": {
            # 1.0 = the peak does not grow with the rows (what streaming promises)
            "peak_rss_smallest_vs_largest": first["peak_rss_mb"] / last["peak_rss_mb"],
            "rows_per_second_largest_vs_smallest": last["rows_per_second"] / first["rows_per_second"],
        },
        "peak_rss_growth_mb": growth,
    }


if __name__ == "__main__":  # the measured child process
    print(json.dumps(_child(json.loads(sys.argv[1]))))
