"""``capflow params | evaluate | caption``: parameter counts of the paper presets, scoring captions with
pycocoevalcap, captioning image files with a trained model."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from flows.cli.common import CLIError, config_args, load_cfg, print_json, stage_context, tracking_args


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
        print_json({"presets": out})
    else:
        for name, r in out.items():
            paper = f"{r['paper']:>12,}" if r["paper"] else "           -"
            diff = f"{r['rel_diff']:+.4%}" if r["rel_diff"] is not None else "-"
            print(f"{name:16s} {r['params']:>12,} {paper}  {diff:>9}  ({r['convention']})")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from captioning.metrics.coco import EvaluationInputError, evaluate_files

    if bool(args.results) != bool(args.references):
        raise CLIError("give --results and --references together, or neither (a trained student's test "
                       "predictions from the workdir's stage records: --student NAME or the latest)")
    if not args.results:
        args.results, args.references = _recorded_predictions(args)
    for flag, path in (("--results", args.results), ("--references", args.references)):
        if path and Path(path).is_dir():
            raise CLIError(f"{flag} {path} is a folder, not a JSON file: give the file itself")
    from tasks.report import scored_files

    try:
        with warnings.catch_warnings(record=True) as caught, stage_context(args, progress=False) as rc:
            warnings.simplefilter("always")
            res = evaluate_files(args.results, args.references, spice_jars=args.spice_jars,
                                 duplicates=args.duplicates)
            scored_files(rc, args.results, args.references, res)
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
        print_json(res)
    else:
        for k, v in res["metrics"].items():
            print(f"{k:8s} {v:.4f}" if v is not None else f"{k:8s} n/a ({res.get('spice', '')})")
        print(f"images: {res['images']}" + (f" of {res['images'] + unscored} reference images" if unscored else ""))
    return 0


def _recorded_predictions(args: argparse.Namespace) -> tuple[str, str]:
    """(predictions, references) of the pipeline's student ``--student`` (default: the latest to finish)."""
    from tasks.cache import StageCache
    from tasks.refs import StudentResult

    cfg = load_cfg(args)
    cache = StageCache.of(cfg)
    rec = cache.latest(f"student-{args.student}" if args.student else "student-*", StudentResult)
    if rec is None:
        who = f"student {args.student!r}" if args.student else "any student"
        raise CLIError(f"no finished {who} recorded in {cfg.workdir}: run `capflow run` with the same "
                       "--preset/--config first, or give --results and --references")
    print(f"capflow evaluate: {rec.student} ({rec.preset}, run {rec.run_id or '-'}): {rec.predictions}",
          file=sys.stderr)
    return rec.predictions, rec.references


def _draw(args: argparse.Namespace, res) -> None:
    """``--draw OUT``: each captioned image with its regions and caption - OUT itself for one image given a file
    name with an image suffix, else ``OUT/<name>-captioned.png``."""
    from captioning.drawing import class_names, draw

    try:
        objects, attributes = class_names(args.object_names), class_names(args.attribute_names)
    except OSError as e:
        raise CLIError(f"class-name file: {e}") from None
    out = Path(args.draw)
    single = len(args.images) == 1 and out.suffix.lower() in (".png", ".jpg", ".jpeg")
    for c in res.captions:
        target = out if single else out / f"{Path(c['file']).stem}-captioned.png"
        draw(c["file"], res.regions[c["file"]], c["caption"], target, objects=objects, attributes=attributes)
        print(f"capflow caption: drew {target}", file=sys.stderr)


def cmd_caption(args: argparse.Namespace) -> int:
    import os

    from captioning.inference import CaptionerError, ImageCaptioner
    from tasks.model_refs import ModelResolveError, resolve_model

    if args.batch_size < 1:
        raise CLIError("--batch-size must be >= 1")
    if args.beam is not None and args.beam < 1:
        raise CLIError("--beam must be >= 1")
    registry = args.model.startswith("models:/")
    try:
        uri = None
        if registry:
            from tasks.tracking import tracking_uri

            uri = tracking_uri(load_cfg(args))
        folder = resolve_model(args.model, uri)
        captioner = ImageCaptioner(folder, device=args.device, beam=args.beam, batch_size=args.batch_size,
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
        res = captioner.caption(args.images, keep_regions=bool(args.draw))
    except CaptionerError as e:
        raise CLIError(str(e)) from None
    if args.draw:
        _draw(args, res)
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


def add_commands(sub: argparse._SubParsersAction) -> None:
    pa = sub.add_parser("params", help="parameter counts of every paper preset vs the papers' figures",
                        description="Count parameters of every paper-size preset with its paper's convention "
                        "(full model with shared modules once, or LW-Transformer's layer stacks only).")
    pa.add_argument("--json", action="store_true", help="print one JSON object")
    pa.set_defaults(func=cmd_params)

    ev = sub.add_parser("evaluate", help="score a COCO results file with pycocoevalcap",
                        description="Score [{image_id, caption}] results against COCO-format references with "
                        "pycocoevalcap (BLEU-1..4, METEOR, ROUGE_L, CIDEr; SPICE only with CoreNLP jars). "
                        "Without --results/--references: a student's test predictions from the workdir of "
                        "--preset/--config (--student NAME, default the latest to finish).")
    ev.add_argument("--results", help="COCO results JSON")
    ev.add_argument("--references", help="COCO-format references JSON (annotations)")
    ev.add_argument("--student", help="without --results: whose recorded predictions (default: the latest)")
    ev.add_argument("--spice-jars", help="folder with stanford-corenlp-3.6.0(-models).jar; else SPICE is null")
    ev.add_argument("--duplicates", choices=["error", "first"], default="error",
                    help="an image id with several captions in --results: error (default) or keep the first")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    config_args(ev)
    tracking_args(ev)
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
    cp.add_argument("--draw", metavar="OUT", help="also write each captioned image with its selected regions and "
                    "caption: OUT (one image, a .png/.jpg name) or OUT/<name>-captioned.png")
    cp.add_argument("--object-names", metavar="FILE", help="--draw: the detector's object class names, one a line "
                    "(objects_vocab.txt); without it regions are labelled by class id (or rank)")
    cp.add_argument("--attribute-names", metavar="FILE", help="--draw: the attribute class names, one a line")
    cp.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                    help="captioning model precision on CUDA (auto: bf16 where supported; CPUs run fp32)")
    config_args(cp)
    cp.set_defaults(func=cmd_caption)
