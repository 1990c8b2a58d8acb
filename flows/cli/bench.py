"""``capflow bench NAME``: the benchmarks (:mod:`captioning.bench`), each printing its rows and ratios against the
anchor measured in the same run (with ``--json`` one JSON object)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from flows.cli.common import CLIError


def cmd_bench(args: argparse.Namespace) -> int:
    if args.name == "loader":
        from captioning.bench.loader import run

        result = run(images=args.images or 1000, batch_size=args.batch_size or 50, max_boxes=args.max_boxes,
                     chunk_rows=args.chunk_rows, workers=args.workers, repeats=args.repeats or 2, epochs=args.epochs,
                     workdir=args.tmp)
    elif args.name == "extract":
        from captioning.bench.extract import run as run_extract

        if args.device.startswith("cuda"):
            from captioning.bench.extract import run_gpu

            result = run_gpu(images=args.images or 1080, preset=args.preset or "coco",
                             overrides=tuple(args.overrides), images_dir=args.images_dir, workdir=args.tmp,
                             device=args.device)
        else:
            result = run_extract(images=args.images or 48, preset=args.preset or "demo",
                                 overrides=tuple(args.overrides), threads=args.threads or 1, workdir=args.tmp)
    elif args.name == "heads":
        from captioning.bench.heads import run as run_heads

        result = run_heads(images=args.images or 2, proposals=args.proposals, min_size=args.min_size,
                           device=args.device, threads=args.threads)
    elif args.name == "cider":
        from captioning.bench.cider import run as run_cider

        ext_dir = args.external or os.environ.get("CAPFLOW_EXTERNAL")
        if not ext_dir:
            raise CLIError("bench cider needs the external COCO material: --external DIR or CAPFLOW_EXTERNAL")
        ext = Path(ext_dir)
        result = run_cider(ext / "coco_eval" / "karpathy_test_refs.json",
                           ext / "model_outputs" / "acort_karpathy_test.json",
                           batch_images=args.batch_size or 50, samples=5, repeats=args.repeats or 3,
                           images=args.images)
    elif args.name == "decode":
        from captioning.bench.decode import run as run_decode

        names = args.presets.split(",") if args.presets else None
        result = run_decode(names=names, repeats=args.repeats or 5, device=args.device, threads=args.threads_decode)
    elif args.name == "train":
        from captioning.bench.train import run as run_train

        result = run_train(families=args.presets.split(",") if args.presets else None, device=args.device,
                           batch=args.batch_size, steps=args.repeats, precision=args.precision,
                           compile=args.compile, graphs=args.graphs, quick=args.quick)
    elif args.name == "learning":
        from tasks.bench_learning import run as run_learning

        if args.seeds < 1:
            raise CLIError("--seeds must be >= 1")
        if args.threads is not None and args.threads < 1:
            raise CLIError("--threads must be >= 1")
        result = run_learning(preset=args.preset or "learning", overrides=tuple(args.overrides), workdir=args.tmp,
                              progress=True, seeds=args.seeds, threads=args.threads)
    elif args.name == "import":
        from captioning.bench.imports import run as run_import

        try:
            rows = tuple(int(r) for r in (args.rows or "10000,100000").split(","))
        except ValueError:
            raise CLIError(f"--rows takes comma-separated row counts, not {args.rows!r}") from None
        if min(rows) < 1 or args.dim < 1:
            raise CLIError("--rows and --dim must be positive")
        result = run_import(rows=rows, dim=args.dim, boxes=min(36, args.max_boxes), chunk_rows=args.chunk_rows,
                            bad_every=args.bad_every, workdir=args.tmp)
    elif args.name == "scale":
        result = _bench_scale(args)
    elif args.name == "serve":
        from tasks.bench_serve import run as run_serve

        if not args.model:
            raise CLIError("bench serve needs --model: a models:/NAME@ALIAS (with MLFLOW_TRACKING_URI), runs:/ or "
                           "a local MLflow Model folder")
        folder = args.images_dir or (str(Path(os.environ["CAPFLOW_EXTERNAL"]) / "images")
                                     if os.environ.get("CAPFLOW_EXTERNAL") else None)
        if not folder or not Path(folder).is_dir():
            raise CLIError("bench serve needs real images: --images-dir DIR (or CAPFLOW_EXTERNAL with images/)")
        images = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        try:
            levels = tuple(int(c) for c in args.concurrency.split(","))
            result = run_serve(args.model, images[: args.images or 8], concurrency=levels,
                               requests=args.requests, beam=args.beam, workers=args.server_workers, workdir=args.tmp,
                               trust_code=args.trust_model_code)
        except ValueError as e:
            raise CLIError(f"bench serve: {e}") from None
    else:  # pragma: no cover - argparse restricts choices
        raise CLIError(f"unknown bench {args.name}")
    if args.json:
        print(json.dumps(result, default=str))
    elif "table" in result:  # a bench that renders its own table
        print(result["table"])
    else:
        for r in result["rows"]:
            print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        for k, v in result["ratios"].items():
            target = result.get("targets", {}).get(k)
            print(f"{k}: {v:.2f}" + (f" (target >= {target})" if target else ""))
    return 0


def _scale_options(args: argparse.Namespace) -> dict:
    """``run``'s keyword arguments for ``bench scale``: the preset's (``--preset``), then the options given."""
    from captioning.bench.scale import PRESETS

    if args.preset and args.preset not in PRESETS:
        raise CLIError(f"bench scale --preset: unknown preset {args.preset!r} (known: {', '.join(PRESETS)})")
    opts = dict(PRESETS[args.preset]) if args.preset else {"sizes": (1000, 10_000, 100_000), "stages": None,
                                                          "disk": True, "repeats": 1, "quiet_check": False}
    if args.sizes:
        try:
            opts["sizes"] = tuple(int(s) for s in args.sizes.split(","))
        except ValueError:
            raise CLIError(f"--sizes takes comma-separated image counts, not {args.sizes!r}") from None
    if args.stages:
        opts["stages"] = args.stages.split(",")
    if args.captions_per_image is not None:
        opts["captions_per_image"] = args.captions_per_image
    if args.input is not None:
        opts["input_kind"] = args.input
    if args.repeats is not None:
        opts["repeats"] = args.repeats
    if args.no_disk:
        opts["disk"] = False
    if args.quiet_check:
        opts["quiet_check"] = True
    return opts


def _bench_scale(args: argparse.Namespace) -> dict:
    import sys

    from captioning.bench.scale import estimate
    from captioning.bench.scale import run as run_scale
    from flows.bench_prefect import STAGES as PIPELINE_STAGES

    opts = _scale_options(args)
    if args.preset:
        est = estimate(opts["sizes"], opts["stages"], opts["repeats"])
        per = ", ".join(f"{k} {v / 60:.1f} min" for k, v in est["per_stage"].items())
        print(f"[scale] preset {args.preset}: {', '.join(f'{n:,}' for n in opts['sizes'])} images, "
              f"{opts.get('captions_per_image', 5)} caption(s) each, input {opts.get('input_kind', 'karpathy')}, "
              f"stages {','.join(opts['stages'])}; estimated {est['seconds'] / 60:.0f} min on the project's 2-core "
              f"machine ({per}; removing the data afterwards adds more) and {est['disk_bytes'] / 1e9:.1f} GB of "
              f"disk at the largest size", file=sys.stderr, flush=True)
    try:
        return run_scale(opts.pop("sizes"), opts.pop("stages"), extra_stages=PIPELINE_STAGES, dim=args.feature_dim,
                         max_boxes=min(36, args.max_boxes), chunk_rows=args.chunk_rows,
                         s3_max_images=args.s3_max_images, workdir=args.tmp, progress=True, **opts)
    except ValueError as e:
        raise CLIError(str(e)) from None


def add_commands(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks (JSON ratios against an anchor)",
                       description="Benchmarks; with --json one JSON object with rows and ratios (>1 = better).")
    b.add_argument("name", choices=["loader", "extract", "heads", "decode", "cider", "learning", "train",
                                       "import", "scale", "serve"],
                   help="loader: Zarr store vs per-image .npy vs memory; extract: Dask vs a sequential loop; "
                   "heads: the bottom-up flavours' detector cost vs the stock detectron2 C4 model; "
                   "decode: greedy latency/throughput of every architecture vs AIC; "
                   "cider: fast CIDEr-D vs pycocoevalcap on the Karpathy test references + ACORT outputs; "
                   "learning: XE/SCST CIDEr of every model family vs the most-frequent-caption baseline; "
                   "train: XE/SCST images/s of every family at paper size, fast path vs fp32 eager; "
                   "import: a synthetic butd TSV imported at several row counts, time and peak memory per count; "
                   "scale: every data-side stage at several dataset sizes (time, peak memory, bytes, growth "
                   "exponents, extrapolation to COCO and 3.3M); "
                   "serve: a model behind `mlflow models serve` on 127.0.0.1, requests/s and p50/p95 latency at "
                   "several concurrency levels vs concurrency 1")
    b.add_argument("--external", help="cider: folder of the external COCO material (default: $CAPFLOW_EXTERNAL)")
    b.add_argument("--device", default="cpu", help="decode, train: torch device (cpu, cuda); extract: cuda runs "
                   "the GPU benchmark (coco settings, image files -> Zarr, vs the reference path)")
    b.add_argument("--images-dir", help="extract --device cuda: real images to replicate (default: synthetic); "
                   "serve: the images sent (default $CAPFLOW_EXTERNAL/images)")
    b.add_argument("--model", help="serve: the MLflow Model (models:/capflow-captioner@champion, runs:/..., a folder)")
    b.add_argument("--concurrency", default="1,4,16", help="serve: client concurrency levels (default 1,4,16)")
    b.add_argument("--requests", type=int, default=32, help="serve: requests per concurrency level (default 32)")
    b.add_argument("--beam", type=int, help="serve: the beam param of every request (default: the model's)")
    b.add_argument("--server-workers", type=int, default=1, help="serve: the server's worker processes (default 1)")
    b.add_argument("--trust-model-code", action="store_true", help="serve: start the server although the model's "
                   "code/ (which MLflow runs) differs from the installed capflow library")
    b.add_argument("--presets", help="decode: comma-separated architecture presets (default: all)")
    b.add_argument("--decode-threads", dest="threads_decode", type=int, help="decode: torch threads")
    b.add_argument("--preset", help="extract: preset whose extractor settings are used (default demo); "
                   "learning: training preset (default learning); scale: a named bench run, not a pipeline preset - "
                   "cc3m-dry = the data side of a CC3M dry run stage by stage: 3,300,000 images of 1 caption in "
                   "WebDataset shards, ingest, vocab, cider, digests, one size, a time estimate first (hours; "
                   "--sizes and the other scale options override it)")
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extract, learning: config overrides")
    b.add_argument("--threads", type=int, help="extract: torch threads per model (default 1); learning: torch "
                   "threads (default: torch's own, one per core) - a CPU run reproduces to the bit only with the same "
                   "threads and CPU capability (docs/training.md, 'What reproduces where')")
    b.add_argument("--seeds", type=int, default=3, help="learning: full runs with seeds 0..N-1 added to the preset's "
                   "(default 3); every number as mean and sd, ratios on the means, claims counted per seed")
    b.add_argument("--proposals", type=int, default=100, help="heads: ROI-head boxes per image (default 100)")
    b.add_argument("--min-size", type=int, default=600, help="heads: short image side at inference (default 600)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--images", type=int, help="images (loader default 1000, extract default 48, serve: the first 8 "
                   "of --images-dir)")
    b.add_argument("--batch-size", type=int, help="images per batch (loader, cider; default 50)")
    b.add_argument("--max-boxes", type=int, default=100, help="B_max (boxes per image drawn from 10..B_max)")
    b.add_argument("--chunk-rows", type=int, default=8, help="images per Zarr chunk / read block")
    b.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    b.add_argument("--repeats", type=int, help="timed passes (loader default 2, decode default 5; scale: runs of "
                   "each stage per size, each in a fresh process: the median wall and CPU time and the largest peak "
                   "memory reported, every run kept in the row; default 1, 3 for exponents)")
    b.add_argument("--epochs", type=int, default=2, help="epochs per timed pass")
    b.add_argument("--rows", help="import: comma-separated TSV row counts, each imported in a fresh process "
                   "(default 10000,100000)")
    b.add_argument("--dim", type=int, default=16, help="import: feature width of the synthetic records (default 16; "
                   "36 regions per record, or --max-boxes if smaller)")
    b.add_argument("--feature-dim", type=int, default=64, help="scale: feature width of the synthetic store "
                   "(default 64; B_max 36, or --max-boxes if smaller)")
    b.add_argument("--sizes", help="scale: comma-separated image counts (default 1000,10000,100000)")
    b.add_argument("--stages", help="scale: comma-separated stages (default: all; those they read from run too)")
    b.add_argument("--s3-max-images", type=int, default=10_000, help="scale: largest size the S3 loader epoch runs "
                   "at (moto holds the store in memory; default 10000)")
    b.add_argument("--no-disk", action="store_true", help="scale: skip the disk-per-100k-images table")
    b.add_argument("--captions-per-image", type=int, help="scale: captions per synthetic image (5 = COCO-shaped, "
                   "the default; 1 = Conceptual-Captions-shaped)")
    b.add_argument("--input", choices=["karpathy", "shards"], help="scale: the synthetic data as a Karpathy "
                   "annotations.json + image files (default) or as WebDataset tar shards (10,000 samples each, "
                   "ingested with dataset.format=webdataset: val/test assigned by hash)")
    b.add_argument("--quiet-check", action="store_true", help="scale: measure the cores other processes used "
                   "during each stage run (/proc/stat minus the run's own CPU) and the load average; a row where "
                   "others used more than 0.25 cores is marked noisy")
    b.add_argument("--bad-every", type=int, default=1000, help="import: every N-th record has a corrupt features "
                   "field, to be counted as a reject (default 1000; 0 = none)")
    b.add_argument("--tmp", help="folder for the benchmark's temporary files (default: system temp)")
    b.add_argument("--quick", action="store_true", help="train: small models and batches (a quick CPU check)")
    b.add_argument("--compile", action="store_true", help="train: add torch.compile'd XE rows")
    b.add_argument("--graphs", action="store_true", help="train: add CUDA-graph-captured XE rows (run.compile=graphs)")
    b.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="train: precision of the fast path (auto: bf16 on CUDA where supported)")
    b.set_defaults(func=cmd_bench)
