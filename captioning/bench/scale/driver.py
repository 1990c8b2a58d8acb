"""The scale bench's driver (:func:`run`): per size, the data generated in a child process, then every selected
stage measured in fresh processes (``repeats`` runs: the median wall and CPU time, the largest peak memory; with
``quiet_check`` the machine's load during each run); then each stage's fit, the feature-store disk table
(:func:`disk_table`) and the markdown table. :data:`PRESETS`: named runs (``cc3m-dry``), with a time estimate
(:func:`captioning.bench.scale.report.estimate`)."""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from captioning.bench.machine import machine_info
from captioning.bench.scale.data import CAPTIONS_PER_IMAGE, INPUTS, PLANTED, SHARD_SAMPLES, SHARD_SPLITS, ZIPF
from captioning.bench.scale.measure import NOISY_CORES, LoadWindow, MotoEndpoint, spawn, tree_bytes
from captioning.bench.scale.report import EXTRAPOLATE_TO, fit_stage, table
from captioning.bench.scale.stages import STAGES, Stage

__all__ = ["PRESETS", "disk_table", "run"]

# named runs of `capflow bench scale --preset NAME`: run()'s keyword arguments (--sizes overrides sizes)
PRESETS: dict[str, dict[str, Any]] = {
    # the data side of a Conceptual Captions 3M dry run, stage by stage: 3.3M images of one caption each in
    # img2dataset tar shards -> ingest -> vocabulary + label store -> SCST's CIDEr-D set-up + reward batches,
    # plus the lineage digests; one size (no exponents: the time of each stage at CC3M's count)
    "cc3m-dry": {"sizes": (3_300_000,), "stages": ("ingest", "vocab", "cider", "digests"), "captions_per_image": 1,
                 "input_kind": "shards", "disk": False, "repeats": 1, "quiet_check": True},
}

_GENERATE = "captioning.bench.scale.data:generate"


def _closure(names: Sequence[str], stages: Mapping[str, Stage]) -> list[str]:
    want: set[str] = set()

    def add(n: str) -> None:
        if n not in stages:
            raise ValueError(f"unknown stage {n!r} (known: {', '.join(stages)})")
        if n not in want:
            want.add(n)
            for d in stages[n].needs:
                add(d)
    for n in names:
        add(n)
    return [n for n in stages if n in want]  # registry order = dependency order


class _Measurement:
    """One run's measurements: the stages to measure at each size, how, and the rows gathered so far."""

    def __init__(self, registry: Mapping[str, Stage], names: Sequence[str], data: Mapping[str, Any],
                 rates: Mapping[str, int], s3_max_images: int, repeats: int, moto: MotoEndpoint,
                 progress: bool, quiet_check: bool = False) -> None:
        self.registry, self.names = registry, names
        self.data, self.rates = data, rates  # the generator's parameters and planted fault rates
        self.s3_max_images, self.repeats, self.moto, self.progress = s3_max_images, max(1, repeats), moto, progress
        self.quiet_check = quiet_check
        self.rows: list[dict[str, Any]] = []
        self.not_measured: list[dict[str, Any]] = []
        self.generated: list[dict[str, Any]] = []

    def say(self, msg: str) -> None:
        if self.progress:
            print(msg, file=sys.stderr, flush=True)

    def size(self, n: int, base: Path, use_s3: bool) -> None:
        """Generate the data of ``n`` images under ``base`` (when a stage reads it), then measure every stage."""
        s3_uri = f"s3://{self.moto.bucket}/n{n}/features.zarr" if use_s3 and n <= self.s3_max_images else None
        if any(self.registry[name].data for name in self.names):
            self.generate(n, base, s3_uri)
        outs = {name: base / "out" / (self.registry[name].out_of or name) for name in self.registry}
        common = {"images": n, "annotations": str(base / "annotations.json"), "images_root": str(base / "images"),
                  "shards_root": str(base / "shards"), "input": self.data["input"],
                  "captions_per_image": self.data["captions_per_image"],
                  "features": str(base / "features.zarr"), "root": str(base),
                  **{f"{name.replace('-', '_')}_out": str(path) for name, path in outs.items()}}
        for name in self.names:
            self.stage(name, n, outs[name], common, s3_uri)

    def generate(self, n: int, base: Path, s3_uri: str | None) -> None:
        self.say(f"[scale] generating {n} images")
        t0 = time.perf_counter()
        gen = spawn({"func": _GENERATE, "params": {"root": str(base), "images": n, **self.data,
                                                   "s3_features": s3_uri, **self.rates}}, env=self.moto.env)
        self.generated.append({"images": n, **gen["counts"], "seconds": time.perf_counter() - t0})

    def stage(self, name: str, n: int, out: Path, common: Mapping[str, Any], s3_uri: str | None) -> None:
        """Measure stage ``name`` at ``n`` images (working in ``out``), or say why it is not measured there."""
        st = self.registry[name]
        if st.s3 and s3_uri is None:
            self.not_measured.append({"stage": name, "images": n, "reason": (
                f"the S3 endpoint here is moto, which holds every object in memory and is no throughput "
                f"reference: measured up to {self.s3_max_images} images")})
            return
        out.mkdir(parents=True, exist_ok=True)
        params = {**common, "out": str(out), **({"features": s3_uri} if st.s3 else {})}
        self.say(f"[scale] {name} at {n} images")
        runs = self.runs({"func": st.func, "imports": list(st.imports), "params": params}, st, out)
        row = _summarise(runs, quiet=self.quiet_check)
        self.rows.append({"stage": name, "images": n, **row})
        self.say(f"[scale]   {row['seconds']:.2f} s, peak {row['peak_rss_mb']:.0f} MiB"
                 + (f" ({len(runs)} runs: median, max)" if len(runs) > 1 else "")
                 + (f", others {row['others_cpu_per_s']:.2f} cores" + (" NOISY" if row["noisy"] else "")
                    if self.quiet_check and row.get("others_cpu_per_s") is not None else ""))

    def runs(self, spec: Mapping[str, Any], st: Stage, out: Path) -> list[dict[str, Any]]:
        """``repeats`` runs of ``spec``, each in a fresh process, every one from the same start (the output folder
        emptied before each but the first, unless the stage works in another's folder: ingest's cold hash cache
        lives there); with the quiet check, each with the machine's load meanwhile (``load``)."""
        got = []
        for k in range(self.repeats):
            if k and st.out_of is None:
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir(parents=True)
            window = LoadWindow()
            window.start()
            res = spawn(spec, env=self.moto.env)
            if self.quiet_check:
                res["load"] = window.stop()
            got.append(res)
        return got


_RAW = ("seconds", "cpu_seconds", "peak_rss_mb", "start_rss_mb", "write_bytes")


def _summarise(runs: Sequence[Mapping[str, Any]], quiet: bool) -> dict[str, Any]:
    """One row from a stage's runs at one size: the median wall and CPU seconds (other work on a shared machine
    adds time to some runs; the median of 3 ignores one such run either way), the largest peak memory and memory
    above the start, the smallest start; bytes and counts of the last run (whose outputs are left behind); every
    run's own numbers in ``runs``. With the quiet check: the median and largest ``others_cpu_per_s`` (cores other
    processes used meanwhile), the first run's load average, and ``noisy`` when the median is above
    :data:`~captioning.bench.scale.measure.NOISY_CORES`."""
    last = runs[-1]
    row = {"seconds": statistics.median(r["seconds"] for r in runs),
           "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
           "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "start_rss_mb": min(r["start_rss_mb"] for r in runs),
           "work_rss_mb": max(max(0.0, r["peak_rss_mb"] - r["start_rss_mb"]) for r in runs),
           "write_bytes": last["write_bytes"], "output_bytes": last["output_bytes"],
           "peak_reset": all(r["peak_reset"] for r in runs), "counts": last["counts"]}
    raw = []
    for r in runs:
        one = {k: r[k] for k in _RAW}
        if quiet:
            one.update({k: r["load"][k] for k in ("others_cpu_per_s", "loadavg_start", "noisy")})
        raw.append(one)
    row["runs"] = raw
    if quiet:
        others = [r["load"]["others_cpu_per_s"] for r in runs if r["load"]["others_cpu_per_s"] is not None]
        med = statistics.median(others) if others else None
        row.update({"others_cpu_per_s": med, "others_cpu_per_s_max": max(others) if others else None,
                    "loadavg_start": runs[0]["load"]["loadavg_start"],
                    "noisy": None if med is None else med > NOISY_CORES})
    return row


def _quiet_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    measured = [r for r in rows if r.get("others_cpu_per_s") is not None]
    loads = [r["loadavg_start"] for r in rows if r.get("loadavg_start") is not None]
    return {"threshold_cores": NOISY_CORES, "rows": len(rows), "measured_rows": len(measured),
            "noisy_rows": sum(bool(r.get("noisy")) for r in rows),
            "noisy": [f"{r['stage']}@{r['images']}" for r in rows if r.get("noisy")],
            "max_others_cpu_per_s": max((r["others_cpu_per_s"] for r in measured), default=None),
            "max_loadavg_start": max(loads, default=None)}


def _fits(names: Sequence[str], rows: Sequence[Mapping[str, Any]], registry: Mapping[str, Stage]
          ) -> dict[str, dict[str, Any]]:
    """Each stage's fit (:func:`fit_stage`), with what it measures and whether its time grows at most linearly."""
    fits = {}
    for name in names:
        f = fit_stage([r for r in rows if r["stage"] == name])
        te = f["time_exponent"]
        f["what"] = registry[name].what
        fitted = [r for r in rows if r["stage"] == name and r["images"] in f["sizes"]]
        if any("noisy" in r for r in fitted):
            f["noisy"] = any(bool(r.get("noisy")) for r in fitted)
        f["time_ok"] = te is None or te <= 1.1 or bool(f.get("time_noise"))
        fits[name] = f
    return fits


def run(sizes: Sequence[int] = (1000, 10_000, 100_000), stages: Sequence[str] | None = None, *,
        extra_stages: Mapping[str, Stage] | None = None, dim: int = 64, max_boxes: int = 36, chunk_rows: int = 8,
        dtype: str = "float16", s3_max_images: int = 10_000, disk: bool = True,
        planted: Mapping[str, int] | None = None, repeats: int = 1, workdir: str | None = None, keep: bool = False,
        progress: bool = False, captions_per_image: int = CAPTIONS_PER_IMAGE, input_kind: str = "karpathy",
        quiet_check: bool = False) -> dict[str, Any]:
    """Measure ``stages`` (default: every default stage, with ``extra_stages`` added after the library's) at each
    of ``sizes`` images. ``planted``: the fault rates (:data:`PLANTED` keys). ``captions_per_image``: 5 =
    COCO-shaped, 1 = Conceptual-Captions-shaped. ``input_kind``: ``karpathy`` (annotations.json + image files) or
    ``shards`` (WebDataset tar shards, ingested with ``dataset.format=webdataset``). ``repeats``: runs of each
    stage at each size, each in a fresh process and (unless it works in another stage's folder) on an emptied
    output folder; the row reports the median wall and the median CPU time (use 3 for exponents: one disturbed run
    moves neither), the largest peak memory, and every run's own numbers (``runs``). ``quiet_check``: measure the
    cores other processes used during every run (``others_cpu_per_s``, ``loadavg_start``) and mark a row ``noisy``
    above :data:`~captioning.bench.scale.measure.NOISY_CORES`; summarised in ``quiet_check``. See the
    :mod:`captioning.bench.scale` docstring."""
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] < 20:
        raise ValueError("sizes must be image counts of at least 20")
    if input_kind not in INPUTS:
        raise ValueError(f"input must be one of {', '.join(INPUTS)}, not {input_kind!r}")
    if captions_per_image < 1 or repeats < 1:
        raise ValueError("captions per image and repeats must be at least 1")
    rates = {**PLANTED, **(planted or {})}
    registry = {**STAGES, **(extra_stages or {})}
    names = _closure(list(stages) if stages else [n for n, s in registry.items() if s.default], registry)
    root = Path(tempfile.mkdtemp(prefix="capflow-bench-scale-", dir=workdir))
    moto = MotoEndpoint()
    use_s3 = any(registry[n].s3 for n in names) and sizes[0] <= s3_max_images
    data = {"dim": dim, "max_boxes": max_boxes, "chunk_rows": chunk_rows, "dtype": dtype, "input": input_kind,
            "captions_per_image": captions_per_image}
    bench = _Measurement(registry, names, data, rates, s3_max_images, repeats, moto, progress, quiet_check)
    try:
        if use_s3:
            moto.start()
        for n in sizes:
            base = root / f"n{n}"
            base.mkdir()
            bench.size(n, base, use_s3)
            if not keep:
                shutil.rmtree(base, ignore_errors=True)  # the next size needs the disk
    finally:
        moto.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    fits = _fits(names, bench.rows, registry)
    out = {
        "bench": "scale",
        "machine": machine_info(),
        "params": {"sizes": sizes, "stages": names, "feature_dim": dim, "max_boxes": max_boxes,
                   "chunk_rows": chunk_rows, "dtype": dtype, "captions_per_image": captions_per_image,
                   "input": input_kind,
                   **({"shard_samples": SHARD_SAMPLES, "shard_splits": SHARD_SPLITS} if input_kind == "shards" else {}),
                   "s3_max_images": s3_max_images, "extrapolate_to": list(EXTRAPOLATE_TO), "zipf": ZIPF,
                   "planted": rates, "repeats": repeats, "repeats_summary": "median wall and CPU s, max peak RSS",
                   "quiet_check": quiet_check, "kept": str(root) if keep else None},
        "generated": bench.generated,
        "rows": bench.rows,
        "stages": fits,
        "not_measured": bench.not_measured,
        "ratios": {f"{k}_time_exponent": v["time_exponent"] for k, v in fits.items()
                   if v["time_exponent"] is not None},
    }
    if quiet_check:
        out["quiet_check"] = _quiet_summary(bench.rows)
    if disk:
        out["disk_per_100k_images"] = disk_table(workdir=workdir)
    out["table"] = table(out)
    return out


def disk_table(widths: Sequence[int] = (512, 1024, 2048), dtypes: Sequence[str] = ("float16", "float32"), *,
               images: int = 128, min_boxes: int = 10, max_boxes: int = 100, chunk_rows: int = 8,
               workdir: str | None = None) -> list[dict[str, Any]]:
    """Measured feature-store bytes per image at each width and dtype (10..100 boxes per image, zero-padded to
    100, lz4; values like pooled ReLU features: ~30% zeros, mean ~0.8), scaled to 100k images; plus the label
    store per 100k images (5 captions, 16 words)."""
    from captioning.data.stores import OK, FeatureStore

    out = []
    rng = np.random.default_rng(0)
    nb = rng.integers(min_boxes, max_boxes + 1, size=images).astype(np.int16)
    with tempfile.TemporaryDirectory(prefix="capflow-bench-disk-", dir=workdir) as tmp:
        for d in widths:
            feats = np.maximum(rng.standard_normal((images, max_boxes, d), dtype=np.float32) + np.float32(0.52), 0)
            feats *= np.float32(1.4)
            feats[np.arange(max_boxes)[None, :] >= nb[:, None]] = 0
            boxes = np.zeros((images, max_boxes, 4), np.float32)
            boxes[..., 2:] = 0.5
            for dt in dtypes:
                uri = str(Path(tmp) / f"f{d}{dt}.zarr")
                st = FeatureStore.create(uri, np.arange(images), max_boxes=max_boxes, feature_dim=d,
                                         chunk_rows=chunk_rows, dtype=dt, compressor="lz4")
                st.write_rows(0, features=feats, boxes=boxes, num_boxes=nb, image_size=np.full((images, 2), 480),
                              status=np.full(images, OK, np.int8))
                per = tree_bytes(uri) / images
                raw = max_boxes * d * np.dtype(dt).itemsize
                out.append({"feature_dim": d, "dtype": dt, "bytes_per_image": round(per),
                            "gb_per_100k_images": round(per * 1e5 / 1e9, 2), "raw_bytes_per_image": raw,
                            "mean_boxes": float(nb.mean())})
                shutil.rmtree(uri, ignore_errors=True)
    return out
