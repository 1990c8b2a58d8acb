"""The ``capflow`` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from captioning.config import ConfigError, PipelineConfig, describe_keys, dump_yaml, load_config, preset_names

log = logging.getLogger("capflow")


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def _config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--preset", help=f"named preset ({', '.join(preset_names())})")
    g.add_argument("--config", metavar="FILE", help="YAML config file")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set dataset.max_reject_fraction=0.05 (repeatable)")


def _pipeline_args(p: argparse.ArgumentParser) -> None:
    """The pipeline flow's own parameters besides the configuration (capflow run, capflow deploy)."""
    p.add_argument("--students", help="comma-separated students (default: students.names of the config)")
    p.add_argument("--no-scst", action="store_true", help="skip SCST fine-tuning")


def parse_students(text: str | None) -> list[str] | None:
    """``--students a,b`` -> ["a", "b"]; not given -> None (the config's students.names). Given but naming no
    student (``--students ""``, ``--students ,``) is an error, not "all of them"."""
    if text is None:
        return None
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise CLIError(f"--students {text!r} names no student: give comma-separated names (e.g. --students "
                       "acort,lw) or leave --students out to train students.names of the config")
    return names


def _cfg(args: argparse.Namespace) -> PipelineConfig:
    return load_config(args.preset, args.config, args.overrides)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str, ensure_ascii=False))


# ---------------------------------------------------------------------- commands
def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "show":
        if args.name and (args.preset or args.config):
            raise CLIError("give the preset either as an argument or with --preset/--config")
        cfg = load_config(args.name or args.preset, args.config, args.overrides)
        print(dump_yaml(cfg), end="")
    elif args.action == "keys":
        for key, default, desc in describe_keys():
            print(f"{key} = {json.dumps(default, default=str)}\n    {desc}")
    elif args.action == "presets":
        print("\n".join(preset_names()))
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from captioning.data.prepare import ingest

    cfg = _cfg(args)
    ds = ingest(cfg, progress=not args.json)
    out = cfg.workdir / "dataset"
    ds.save(out / "dataset.json")
    summary = ds.summary()
    (out / "rejects.json").write_text(json.dumps(
        {"rejected": summary["rejected"], "dropped_captions": summary["dropped_captions"]}, indent=1,
        ensure_ascii=False), encoding="utf-8")
    if args.json:
        _print_json({k: summary[k] for k in ("images", "captions", "splits", "rejected", "digest")}
                    | {"dropped_captions": summary["dropped_captions"], "entries": ds.entries,
                       "files_checked": ds.files_checked, "output": str(out / "dataset.json")})
    else:
        print(f"ingested {summary['images']} images, {summary['captions']} captions from {ds.source}")
        print("splits: " + ", ".join(f"{k} {v}" for k, v in summary["splits"].items()))
        print(f"rejected {len(ds.rejected)} entries, dropped {len(ds.dropped_captions)} captions "
              f"(list: {out / 'rejects.json'})")
        for r in ds.rejected:
            print(f"  images[{r.entry}] image_id={r.image_id} {r.file}: {r.reason}")
        print(f"digest {ds.digest}")
    return 0


def cmd_vocab(args: argparse.Namespace) -> int:
    from captioning.data.prepare import ingest, vocab_and_labels
    from captioning.data.stores import FeatureStore

    cfg = _cfg(args)
    ds = ingest(cfg, progress=not args.json)
    rows = None
    if args.features:
        rows = FeatureStore.open(args.features).row_of()
    res = vocab_and_labels(cfg, ds, rows)
    radix = res.vocab.radix()
    info = {
        "vocab": str(res.vocab_path),
        "words": len(res.vocab.words),
        "ids": len(res.vocab),
        "min_count": res.vocab.min_count,
        "radix": {"base": radix.base, "digits": radix.digits, "size": radix.size},
        "labels": res.labels_uri,
        "captions": res.captions,
        "vocab_digest": res.vocab.digest(),
        "dataset_digest": ds.digest,
    }
    if args.json:
        _print_json(info)
    else:
        print(f"vocabulary: {info['words']} words (count >= {info['min_count']}) -> {info['vocab']}")
        print(f"radix: base {radix.base}, {radix.digits} digits per word, {radix.size} output classes")
        print(f"label store: {info['captions']} captions -> {info['labels']}")
    return 0


def cmd_import_features(args: argparse.Namespace) -> int:
    from captioning.data.prepare import image_sizes, import_npy_features, ingest

    cfg = _cfg(args)
    root = Path(args.npy_root) if args.npy_root else None
    att = Path(args.att_dir) if args.att_dir else (root / "cocobu_att" if root else None)
    box = Path(args.box_dir) if args.box_dir else (root / "cocobu_box_relative" if root else None)
    if att is None or box is None:
        raise CLIError("give --npy-root (with cocobu_att/ and cocobu_box_relative/) or --att-dir and --box-dir")
    for d in (att, box):
        if not d.is_dir():
            raise CLIError(f"{d} is not a folder")
    sizes: dict[int, tuple[int, int]] = {}
    if cfg.dataset.annotations:
        ds = ingest(cfg, progress=False)
        ids = [e.image_id for e in ds.images]
        sizes = image_sizes(ds)
    else:
        ids = sorted(int(p.stem) for p in att.glob("*.npy") if p.stem.isdigit())
        if not ids:
            raise CLIError(f"no <image_id>.npy files in {att}")
    uri = args.out or cfg.feature_store_uri()
    f = cfg.features
    store = import_npy_features(att, box, ids, uri, max_boxes=f.max_boxes, feature_dim=f.feature_dim,
                                chunk_rows=f.chunk_rows, dtype=f.dtype, compressor=f.compressor,
                                image_sizes=sizes, overwrite=args.overwrite, progress=not args.json)
    summary = store.summary()
    if args.json:
        _print_json(summary)
    else:
        print(f"imported {summary['ok']} of {summary['images']} images into {uri} "
              f"(boxes min {summary['boxes']['min']} mean {summary['boxes']['mean']:.1f} "
              f"max {summary['boxes']['max']}); rejected {len(summary['rejected'])}")
        for r in summary["rejected"]:
            print(f"  image_id={r['image_id']}: {r['reason']}")
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    from captioning.data.prepare import ingest
    from captioning.features.parallel import extract_features, store_uri

    cfg = _cfg(args)
    ds = ingest(cfg, progress=not args.json)
    uri = args.out or store_uri(cfg)
    if cfg.features.source == "synthetic-informative":
        from captioning.data.synthetic_features import informative_store_for

        st = informative_store_for(cfg, ds, uri, progress=not args.json)
        info = {"store": st.uri, "source": "synthetic-informative", **st.summary()}
        if args.json:
            _print_json(info)
        else:
            print(f"feature store (synthetic-informative): {st.uri}, {st.num_rows} images")
        return 0
    if not args.resume:
        _remove_store(uri)
    res = extract_features(cfg, ds, workers=args.workers, uri=uri, progress=not args.json)
    if args.json:
        _print_json(res.to_json())
        return 0
    b = res.boxes
    print(f"feature store: {res.store}")
    print(f"images {res.images}: ok {res.ok}, rejected {len(res.rejected)}; extracted now {res.extracted} "
          f"({res.skipped_chunks} chunks already done, {res.appended} rows added)")
    print(f"boxes per image: min {b['min']} mean {b['mean']:.1f} max {b['max']}; "
          f"{res.seconds_per_image:.3f} s per extracted image")
    for r in res.rejected:
        print(f"  rejected image_id={r['image_id']}: {r['reason']}")
    for r in res.reextracted:
        print(f"  re-extracted chunk {r['chunk']} (rows {r['rows'][0]}..{r['rows'][1] - 1}): {r['problem']}: "
              f"{', '.join(r['files'])}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tasks.verify import default_paths, format_text, verify

    cfg = _cfg(args)
    if not args.paths and not cfg.workdir.is_dir():
        raise CLIError(f"run.workdir {cfg.workdir} does not exist: nothing to verify (give paths or --set "
                       "run.workdir=)")
    res = verify(args.paths or default_paths(cfg), repair=args.repair, workdirs=[cfg.workdir])
    if args.json:
        _print_json(res.to_json())
    else:
        print(format_text(res))
    return 1 if res.damaged else 0


def _remove_store(uri: str) -> None:
    import fsspec

    from captioning.data.stores import storage_options_for

    fs, path = fsspec.core.url_to_fs(uri, **(storage_options_for(uri) or {}))
    if fs.exists(path):
        log.warning("removing %s (--no-resume)", uri)
        fs.rm(path, recursive=True)


def _train_rank(rank: int, world: int, cfg_json: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One process of ``capflow train`` (rank 0 of 1 without --nproc): build the context, train, report."""
    from captioning.config import PipelineConfig
    from captioning.training.ddp import rank_device
    from captioning.training.recipe import scst_settings, student_arch, teacher_arch, xe_settings
    from captioning.training.stages import StageContext, fit_scst, fit_xe

    cfg = PipelineConfig.model_validate_json(cfg_json)
    ctx = StageContext.from_paths(cfg, opts["vocab"], opts["labels"], opts["features"], progress=opts["progress"])
    if world > 1:
        ctx.device = rank_device()
    out = Path(opts["out"])
    if opts["scst_from"]:
        _, res = fit_scst(ctx, opts["scst_from"], out, settings=scst_settings(cfg.students.scst, cfg))
    else:
        teacher = opts["model"] in ("teacher", "aic")
        arch = teacher_arch(cfg.teacher.model, ctx.vocab, ctx.d_in, cfg.dataset.max_words) if teacher else \
            student_arch(opts["model"], cfg.students.size, ctx.vocab, ctx.d_in, cfg.dataset.max_words)
        xe = cfg.teacher.xe if teacher else cfg.students.xe
        _, res, _ = fit_xe(ctx, arch, out, settings=xe_settings(xe, cfg), captions=opts["captions"],
                           seqkd_source=opts["seqkd_source"], init_from=opts["init"])
    return {"best_metric": res.best_metric, "best_epoch": res.best_epoch, "epochs_run": res.epochs_run,
            "resumed_from_epoch": res.resumed_from_epoch, "history": res.history, "processes": world,
            "best_checkpoint": str(res.best_checkpoint), "last_checkpoint": str(res.last_checkpoint)}


def cmd_train(args: argparse.Namespace) -> int:
    from captioning.features.parallel import store_uri

    cfg = _cfg(args)
    labels_dir = cfg.workdir / "labels"
    opts = {
        "model": args.model, "captions": args.captions, "seqkd_source": args.seqkd_source, "init": args.init,
        "scst_from": args.scst_from, "progress": not args.json,
        "vocab": args.vocab or str(labels_dir / "vocab.json"), "labels": args.labels or str(labels_dir / "labels.zarr"),
        "features": args.features or store_uri(cfg),
        "out": args.out or str(cfg.workdir / "train" / (f"{args.model}-scst" if args.scst_from else args.model)),
    }
    for key in ("vocab", "labels"):
        if not Path(opts[key]).exists():
            raise CLIError(f"{opts[key]} not found: run `capflow vocab` first (or pass --{key})")
    if args.nproc < 1:
        raise CLIError("--nproc must be >= 1")
    if args.model not in ("teacher", "aic"):
        from captioning.training.recipe import preset_name

        try:
            preset_name(args.model)
        except ValueError as e:
            raise CLIError(str(e)) from None
    if args.nproc == 1:
        res = _train_rank(0, 1, cfg.model_dump_json(), opts)
    else:
        from captioning.training.ddp import launch

        device = "cuda" if cfg.run.device in ("auto", "cuda") and _cuda() else "cpu"
        res = launch(_train_rank, args.nproc, cfg.model_dump_json(), opts, device=device)
    if args.json:
        _print_json(res)
    else:
        for h in res["history"]:
            print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in h.items()))
        at = "the starting weights" if res["best_epoch"] < 0 else f"epoch {res['best_epoch'] + 1}"
        print(f"best {res['best_metric']:.4f} at {at}: {res['best_checkpoint']}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import os

    if os.environ.get("PREFECT_HOME"):  # Prefect's local server cannot create its database in a missing folder
        Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    from flows.pipeline import PrefectUnavailable, build_config, pipeline, start_prefect_api
    from tasks.tracking import TrackingUnavailable, preflight, tracking_uri

    students = parse_students(args.students)
    try:
        cfg = build_config(args.preset or ("demo" if not args.config else None), args.config, args.overrides,
                           students, not args.no_scst)
    except ValueError as e:
        raise CLIError(str(e)) from None
    try:
        preflight(tracking_uri(cfg))  # an unreachable tracking server: a clear error before anything starts
        start_prefect_api()  # Prefect's temporary server (no PREFECT_API_URL): its failure named, with a way out
        res = pipeline(preset=args.preset or ("demo" if not args.config else None), config_path=args.config,
                       overrides=list(args.overrides), students=students, scst=not args.no_scst)
    except (TrackingUnavailable, PrefectUnavailable) as e:
        raise CLIError(str(e)) from None
    if args.json:
        _print_json(res)
        return 0 if not res["failed"] else 1
    print()
    print(f"{'student':14s} {'preset':16s} {'CIDEr':>7s} {'BLEU-4':>7s} {'METEOR':>7s} {'params':>12s} {'ms':>7s}")
    for r in res["leaderboard"]:
        m = r["metrics"]
        print(f"{r['student']:14s} {r['preset']:16s} {m['CIDEr']:7.3f} {m['Bleu_4']:7.3f} {m['METEOR']:7.3f} "
              f"{r['params']:12,d} {r['latency_ms']:7.1f}")
    for f in res["failed"]:
        print(f"{f['student']:14s} FAILED: {f['error']}")
    ch = res["champion"]
    print(f"champion: {cfg.tracking.model_name} v{ch['version']} ({ch['reason']})")
    cached = [k for k, v in res["stages"].items() if v == "cached"]
    if cached:
        print(f"cached stages: {', '.join(cached)}")
    print(f"MLflow run {res['mlflow_run_id']} in {res['tracking_uri']}")
    if res["tracking_uri"].startswith("sqlite:"):
        print(f"  look next: mlflow ui --backend-store-uri {res['tracking_uri']} --host 127.0.0.1 --port 5000")
    return 0 if not res["failed"] else 1


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_params(args: argparse.Namespace) -> int:
    import torch

    from captioning.models.encoder_decoder import Captioner
    from captioning.models.params import count
    from captioning.models.registry import PAPER_PARAMS, preset

    out = {}
    for name, (paper, convention) in PAPER_PARAMS.items():
        with torch.device("meta"):  # counts need shapes only
            n = count(Captioner(preset(name)), convention)
        out[name] = {"params": n, "paper": paper, "convention": convention,
                     "rel_diff": (n - paper) / paper if paper else None}
    if args.json:
        _print_json({"presets": out})
    else:
        for name, r in out.items():
            paper = f"{r['paper']:>12,}" if r["paper"] else "           -"
            diff = f"{r['rel_diff']:+.4%}" if r["rel_diff"] is not None else "-"
            print(f"{name:16s} {r['params']:>12,} {paper}  {diff:>9}  ({r['convention']})")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from captioning.metrics.coco import EvaluationInputError, evaluate_files

    for flag, path in (("--results", args.results), ("--references", args.references)):
        if path and Path(path).is_dir():
            raise CLIError(f"{flag} {path} is a folder, not a JSON file: give the file itself")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = evaluate_files(args.results, args.references, spice_jars=args.spice_jars,
                                 duplicates=args.duplicates)
    except (EvaluationInputError, FileNotFoundError) as e:
        raise CLIError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read --results {args.results} / --references {args.references}: "
                       f"{type(e).__name__}: {e}") from None
    for w in caught:  # e.g. --duplicates first: which captions were dropped
        print(f"capflow evaluate: warning: {w.message}", file=sys.stderr)
    unscored = res.get("unscored_references") or 0
    if unscored:  # on stderr in both modes: scores of a few images are not the scores of the reference set
        total = res["images"] + unscored
        print(f"capflow evaluate: warning: the results caption {res['images']} of the {total} reference images "
              f"({res['images'] / total:.1%}); the scores cover those only ({unscored} reference images have no "
              "result)", file=sys.stderr)
    if args.json:
        _print_json(res)
    else:
        for k, v in res["metrics"].items():
            print(f"{k:8s} {v:.4f}" if v is not None else f"{k:8s} n/a ({res.get('spice', '')})")
        print(f"images: {res['images']}" + (f" of {res['images'] + unscored} reference images" if unscored else ""))
    return 0


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
                                 overrides=tuple(args.overrides), threads=args.threads, workdir=args.tmp)
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
        from captioning.bench.learning import run as run_learning

        result = run_learning(preset=args.preset or "learning", overrides=tuple(args.overrides), workdir=args.tmp,
                              progress=not args.json)
    else:  # pragma: no cover - argparse restricts choices
        raise CLIError(f"unknown bench {args.name}")
    if args.json:
        print(json.dumps(result, default=str))
    else:
        for r in result["rows"]:
            print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        for k, v in result["ratios"].items():
            target = result.get("targets", {}).get(k)
            print(f"{k}: {v:.2f}" + (f" (target >= {target})" if target else ""))
    return 0


def cmd_caption(args: argparse.Namespace) -> int:
    import os

    from captioning.inference import Captioner, CaptionerError
    from tasks.models import ModelResolveError, resolve_model

    if args.batch_size < 1:
        raise CLIError("--batch-size must be >= 1")
    if args.beam is not None and args.beam < 1:
        raise CLIError("--beam must be >= 1")
    registry = args.model.startswith("models:/")
    try:
        uri = None
        if registry:
            from tasks.tracking import tracking_uri

            uri = tracking_uri(_cfg(args))
        folder = resolve_model(args.model, uri)
        captioner = Captioner(folder, device=args.device, beam=args.beam, batch_size=args.batch_size,
                              progress=not (args.json or args.no_progress), precision=args.precision)
    except ModelResolveError as e:
        hint = ""
        if registry and not (args.preset or args.config or os.environ.get("MLFLOW_TRACKING_URI")):
            hint = " (another pipeline's store: pass its --preset/--config, e.g. --preset demo, or set " \
                   "MLFLOW_TRACKING_URI)"
        raise CLIError(f"{e}{hint}") from None
    except CaptionerError as e:
        raise CLIError(str(e)) from None
    try:
        res = captioner.caption(args.images)
    except CaptionerError as e:
        raise CLIError(str(e)) from None
    if args.json:
        print(json.dumps(res.captions, indent=2, ensure_ascii=False))
    else:
        for c in res.captions:
            print(f"{c['file']}\t{c['caption']}")
    for r in res.rejected:
        print(f"capflow caption: rejected {r['file']}: {r['error']}", file=sys.stderr)
    empty = sum(not c["caption"] for c in res.captions)
    if empty:  # a model output, not an input error: reported, and the exit status stays 0
        print(f"capflow caption: {empty} of {len(res.captions)} captions are empty (the model ended them at once: "
              "it is undertrained, or the images are unlike its training data)", file=sys.stderr)
    if not res.captions:
        print(f"capflow caption: none of the {len(args.images)} images could be captioned", file=sys.stderr)
        return 2
    return 1 if res.rejected else 0


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capflow", description="Train and compare compact, fast image captioners.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("config", help="show presets and settings", description="Show presets and settings.")
    c.add_argument("action", choices=["show", "keys", "presets"], help="show a config as YAML | list every key "
                   "with its default and description | list presets")
    c.add_argument("name", nargs="?", help="preset name (for show)")
    _config_args(c)
    c.set_defaults(func=cmd_config)

    i = sub.add_parser("ingest", help="read and validate the dataset", description=(
        "Read and validate the Karpathy-format dataset (dataset.annotations + dataset.images, or the synthetic "
        "dataset when no annotations are set); write the normalised dataset and the reject list to the workdir."))
    _config_args(i)
    i.add_argument("--json", action="store_true", help="print a JSON summary")
    i.set_defaults(func=cmd_ingest)

    v = sub.add_parser("vocab", help="build the vocabulary and the label store", description=(
        "Build vocab.json from the train split (count >= vocab.min_count) and labels.zarr with every caption."))
    _config_args(v)
    v.add_argument("--features", metavar="URI", help="feature store whose rows the labels point at "
                   "(default: the dataset's own order)")
    v.add_argument("--json", action="store_true", help="print a JSON summary")
    v.set_defaults(func=cmd_vocab)

    f = sub.add_parser("import-features", help="import per-image .npy features into a feature store",
                       description=("Import bottom-up features in the per-image .npy layout (cocobu_att/{id}.npy, "
                                    "cocobu_box_relative/{id}.npy) into a Zarr feature store. Image ids come from "
                                    "dataset.annotations when set, else from the file names."))
    _config_args(f)
    f.add_argument("--npy-root", help="folder holding cocobu_att/ and cocobu_box_relative/")
    f.add_argument("--att-dir", help="folder of {image_id}.npy region features (N x D)")
    f.add_argument("--box-dir", help="folder of {image_id}.npy relative boxes (N x 4)")
    f.add_argument("--out", metavar="URI", help="store to write (default: features.store or <workdir>/features)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing store")
    f.add_argument("--json", action="store_true", help="print a JSON summary")
    f.set_defaults(func=cmd_import_features)

    x = sub.add_parser("extract", help="extract region features into the feature store", description=(
        "Extract bottom-up region features (detectron2 Faster R-CNN, C4 backbone) for every dataset image into a "
        "chunked Zarr store, in parallel on Dask. Re-running resumes: finished chunks are skipped and new images "
        "are appended; other extractor settings or weights make a new store."))
    _config_args(x)
    x.add_argument("--workers", type=int, help="Dask worker processes (default features.workers; 0 = no Dask)")
    x.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue the store of these settings (default); --no-resume deletes it and starts over")
    x.add_argument("--out", metavar="URI", help="store URI (default: <features.store>/<settings digest>.zarr)")
    x.add_argument("--json", action="store_true", help="print a JSON summary")
    x.set_defaults(func=cmd_extract)

    ve = sub.add_parser("verify", help="check stores, stage records and checkpoints; --repair fixes what it can",
                        description=("Check a workdir's feature and label stores (every chunk against the checksum "
                                     "recorded when it was written), stage records and checkpoints. --repair marks "
                                     "damaged feature chunks for re-extraction, removes damaged records, checkpoints "
                                     "and label stores (and the records that name them), and records checksums for "
                                     "stores written before capflow kept them; the next `capflow extract` / "
                                     "`capflow run` redoes the rest. Exit status 1 when something damaged is left."))
    _config_args(ve)
    ve.add_argument("paths", nargs="*", metavar="PATH", help="stores, records, checkpoints or folders to check "
                    "(default: run.workdir and the feature store folder)")
    ve.add_argument("--repair", action="store_true", help="repair what is damaged (see above)")
    ve.add_argument("--json", action="store_true", help="print one JSON object")
    ve.set_defaults(func=cmd_verify)

    r = sub.add_parser("run", help="run the whole pipeline (Prefect flow, MLflow tracking)", description=(
        "Run the DAG ingest -> extract -> vocab -> teacher -> SeqKD -> students -> SCST -> evaluation -> "
        "leaderboard -> promotion as a Prefect flow, recording everything in MLflow. Finished stages are cached; "
        "a killed run resumes. Honours PREFECT_API_URL and MLFLOW_TRACKING_URI."))
    _config_args(r)
    _pipeline_args(r)
    r.add_argument("--json", action="store_true", help="print the run summary as JSON")
    r.set_defaults(func=cmd_run)

    t = sub.add_parser("train", help="train one model (XE or SCST), optionally data-parallel", description=(
        "Train the teacher or one student with cross-entropy, or fine-tune a checkpoint with SCST, on the "
        "workdir's label and feature stores. A killed run resumes from its last epoch checkpoint. "
        "--nproc N runs N data-parallel processes (torch DDP: gloo on CPU, NCCL on GPUs)."))
    _config_args(t)
    t.add_argument("--model", default="teacher",
                   help="teacher, a student family (acort, expansionnet, lw, satic, zodiac) or a registry preset")
    t.add_argument("--captions", choices=["ground_truth", "seqkd", "both"], default="ground_truth",
                   help="which label-store captions to train on")
    t.add_argument("--seqkd-source", help="name of the SeqKD source in the label store")
    t.add_argument("--init", help="checkpoint whose matching tensors initialise the model (SATIC weight-init)")
    t.add_argument("--scst-from", help="fine-tune this XE checkpoint with SCST instead of XE training")
    t.add_argument("--nproc", type=int, default=1, help="data-parallel processes (default 1)")
    t.add_argument("--features", help="feature store URI (default: the configured store)")
    t.add_argument("--labels", help="label store (default <workdir>/labels/labels.zarr)")
    t.add_argument("--vocab", help="vocabulary (default <workdir>/labels/vocab.json)")
    t.add_argument("--out", help="checkpoint folder (default <workdir>/train/<model>)")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(func=cmd_train)

    pa = sub.add_parser("params", help="parameter counts of every paper preset vs the papers' figures",
                        description="Count parameters of every paper-size preset with its paper's convention "
                        "(full model with shared modules once, or LW-Transformer's layer stacks only).")
    pa.add_argument("--json", action="store_true", help="print one JSON object")
    pa.set_defaults(func=cmd_params)

    ev = sub.add_parser("evaluate", help="score a COCO results file with pycocoevalcap",
                        description="Score [{image_id, caption}] results against COCO-format references with "
                        "pycocoevalcap (BLEU-1..4, METEOR, ROUGE_L, CIDEr; SPICE only with CoreNLP jars).")
    ev.add_argument("--results", required=True, help="COCO results JSON")
    ev.add_argument("--references", required=True, help="COCO-format references JSON (annotations)")
    ev.add_argument("--spice-jars", help="folder with stanford-corenlp-3.6.0(-models).jar; else SPICE is null")
    ev.add_argument("--duplicates", choices=["error", "first"], default="error",
                    help="an image id with several captions in --results: error (default) or keep the first")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=cmd_evaluate)

    cp = sub.add_parser("caption", help="caption image files with a trained model", description=(
        "Caption image files with a trained model: a registered version (models:/NAME@ALIAS or "
        "models:/NAME/VERSION, downloaded once from MLflow: MLFLOW_TRACKING_URI, else the store of the "
        "--preset/--config given, else the default workdir's), a model folder (model.pt, vocab.json, capflow.json) "
        "or its model.pt. Regions are extracted with the same detector settings the model was trained on, then "
        "beam-decoded as in evaluation. Output: one 'file<TAB>caption' line per captioned image, or with --json "
        "exactly the JSON list [{\"file\": ..., \"caption\": ...}] of the captioned images. Files that cannot "
        "be captioned (missing, unreadable, corrupt, too small) are reported on stderr only, never in the JSON. "
        "Exit status: 0 all captioned, 1 some rejected, 2 none captioned or the model cannot be used."))
    cp.add_argument("images", nargs="+", metavar="IMAGE", help="image files")
    cp.add_argument("--model", default="models:/capflow-captioner@champion",
                    help="models:/NAME@ALIAS, models:/NAME/VERSION, a model folder or a model.pt "
                    "(default models:/capflow-captioner@champion)")
    cp.add_argument("--json", action="store_true", help="print the captions as a JSON list of {file, caption}")
    cp.add_argument("--batch-size", type=int, default=16, help="images loaded, extracted and decoded together "
                    "(default 16)")
    cp.add_argument("--device", default="auto", help="torch device for the detector and the model: auto (CUDA "
                    "when present), cpu, cuda, cuda:N")
    cp.add_argument("--beam", type=int, help="beam width (default: the pipeline's evaluation.beam stored with the "
                    "model; 1 = greedy)")
    cp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    cp.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                    help="captioning model precision on CUDA (auto: bf16 where supported; CPUs run fp32)")
    _config_args(cp)
    cp.set_defaults(func=cmd_caption)

    b = sub.add_parser("bench", help="benchmarks (JSON ratios against an anchor)",
                       description="Benchmarks; with --json one JSON object with rows and ratios (>1 = better).")
    b.add_argument("name", choices=["loader", "extract", "decode", "cider", "learning", "train"],
                   help="loader: Zarr store vs per-image .npy vs memory; extract: Dask vs a sequential loop; "
                   "decode: greedy latency/throughput of every architecture vs AIC; "
                   "cider: fast CIDEr-D vs pycocoevalcap on the Karpathy test references + ACORT outputs; "
                   "learning: XE/SCST CIDEr of every model family vs the most-frequent-caption baseline; "
                   "train: XE/SCST images/s of every family at paper size, fast path vs fp32 eager")
    b.add_argument("--external", help="cider: folder of the external COCO material (default: $CAPFLOW_EXTERNAL)")
    b.add_argument("--device", default="cpu", help="decode, train: torch device (cpu, cuda); extract: cuda runs "
                   "the GPU benchmark (coco settings, image files -> Zarr, vs the reference path)")
    b.add_argument("--images-dir", help="extract --device cuda: real images to replicate (default: synthetic)")
    b.add_argument("--presets", help="decode: comma-separated architecture presets (default: all)")
    b.add_argument("--decode-threads", dest="threads_decode", type=int, help="decode: torch threads")
    b.add_argument("--preset", help="extract: preset whose extractor settings are used (default demo); "
                   "learning: training preset (default learning)")
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extract, learning: config overrides")
    b.add_argument("--threads", type=int, default=1, help="extract: torch threads per model")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--images", type=int, help="images (loader default 1000, extract default 48)")
    b.add_argument("--batch-size", type=int, help="images per batch (loader, cider; default 50)")
    b.add_argument("--max-boxes", type=int, default=100, help="B_max (boxes per image drawn from 10..B_max)")
    b.add_argument("--chunk-rows", type=int, default=8, help="images per Zarr chunk / read block")
    b.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    b.add_argument("--repeats", type=int, help="timed passes (loader default 2, decode default 5)")
    b.add_argument("--epochs", type=int, default=2, help="epochs per timed pass")
    b.add_argument("--tmp", help="folder for the benchmark's temporary files (default: system temp)")
    b.add_argument("--quick", action="store_true", help="train: small models and batches (a quick CPU check)")
    b.add_argument("--compile", action="store_true", help="train: add torch.compile'd XE rows")
    b.add_argument("--graphs", action="store_true", help="train: add CUDA-graph-captured XE rows (run.compile=graphs)")
    b.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="train: precision of the fast path (auto: bf16 on CUDA where supported)")
    b.set_defaults(func=cmd_bench)

    from flows.platform_cli import add_commands

    add_commands(sub, _config_args, _pipeline_args)

    from flows.import_cli import add_import_command

    add_import_command(sub, _config_args)
    return p


def main(argv: list[str] | None = None) -> int:
    # before anything imports prefect (it reads its settings once): the temporary Prefect server that `capflow run`
    # starts gets 90 s instead of Prefect's 20 s, which a loaded machine overran (an explicit setting wins)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    func: Callable[[argparse.Namespace], int] = args.func
    from captioning.data.karpathy import DatasetError
    from captioning.data.stores import StoreError
    from captioning.safe_pickle import UnsafePickleError
    from flows.stack import StackError

    try:
        return func(args)
    except (ConfigError, DatasetError, StoreError, StackError, CLIError, UnsafePickleError) as e:
        from captioning.redact import redact

        print(f"capflow {args.command}: error: {redact(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # run the importable module's main, so that `python -m flows.cli` and the `capflow` script share one set of
    # classes (CLIError raised by command modules that import flows.cli)
    from flows.cli import main as _main

    sys.exit(_main())
