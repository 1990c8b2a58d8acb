"""``capflow train``: one model (the teacher or a student; XE, or SCST from a checkpoint), in one or N
data-parallel processes, through the same training job as the pipeline
(:func:`captioning.training.stages.run_training`).

Without path options it trains on the workdir's recorded stages: the dataset, the feature store (extracted,
imported or written by ``capflow run``) and the label store for them (the vocab stage's record, built now when
missing) - so ``capflow run`` then ``capflow train --model lw`` needs no flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from flows.cli.common import CLIError, config_args, local_context, print_json


def _inputs(args: argparse.Namespace, rc) -> dict[str, str | None]:
    """vocab, labels, features (and dataset when known) for the run: flags win, else the recorded stages."""
    from tasks.data import MissingStageError, features_for, features_of_store, ingest, vocab

    if bool(args.labels) != bool(args.vocab):
        raise CLIError("give --labels and --vocab together (or neither: the workdir's recorded label store)")
    if args.labels:
        for flag, p in (("--vocab", args.vocab), ("--labels", args.labels)):
            if "://" not in p and not Path(p).exists():
                raise CLIError(f"{flag} {p} not found")
        if not args.features:
            raise CLIError("with --labels/--vocab give the --features store they point at")
        return {"vocab": args.vocab, "labels": args.labels, "features": args.features, "dataset": None,
                "labels_digest": args.labels}
    data = ingest(rc)
    try:
        feats = features_of_store(args.features) if args.features else features_for(rc, data)
    except MissingStageError as e:
        raise CLIError(str(e)) from None
    labels = vocab(rc, data, feats)  # the recorded one (the pipeline's, for the same settings) or built now
    return {"vocab": labels.vocab_path, "labels": labels.labels_uri, "features": feats.uri, "dataset": data.path,
            "labels_digest": labels.labels_digest}


def _seqkd_source(rc, args: argparse.Namespace) -> str | None:
    if args.captions == "ground_truth" or args.seqkd_source:
        return args.seqkd_source
    from tasks.refs import SeqKDRef

    kd = rc.cache.latest("seqkd", SeqKDRef)
    if kd is None:
        raise CLIError(f"--captions {args.captions} needs teacher captions in the label store: give --seqkd-source "
                       "or run the pipeline (`capflow run`), whose seqkd stage writes them")
    return kd.source


def cmd_train(args: argparse.Namespace) -> int:
    from captioning.training.recipe import preset_name
    from captioning.training.stages import TrainSpec, run_training
    from tasks.cache import stage_key

    if args.nproc < 1:
        raise CLIError("--nproc must be >= 1")
    if args.model not in ("teacher", "aic"):
        try:
            preset_name(args.model)
        except ValueError as e:
            raise CLIError(str(e)) from None
    rc = local_context(args, progress=not args.json)
    cfg = rc.cfg
    paths = _inputs(args, rc)
    seqkd_source = _seqkd_source(rc, args)
    stage = f"train-{args.model}" + ("-scst" if args.scst_from else "")
    settings = "teacher" if args.model in ("teacher", "aic") else "students"
    key = stage_key(stage, labels=paths["labels_digest"], features=paths["features"], captions=args.captions,
                    seqkd=seqkd_source, init=args.init, scst_from=args.scst_from, settings=cfg.digest(settings),
                    loader=cfg.digest("loader"), seed=cfg.run.seed, max_words=cfg.dataset.max_words,
                    nproc=args.nproc)
    spec = TrainSpec(model=args.model, vocab_path=paths["vocab"], labels_uri=paths["labels"],
                     features_uri=paths["features"], out=args.out or str(rc.workdir.stage_dir(stage, key)),
                     captions=args.captions, seqkd_source=seqkd_source, init_from=args.init,
                     scst_from=args.scst_from, dataset_path=paths["dataset"])
    if args.torchrun_job:
        return _write_torchrun_job(args, cfg, spec)
    res = run_training(cfg, spec, nproc=args.nproc, progress=not args.json)
    if args.json:
        print_json(res)
    else:
        for h in res["history"]:
            print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in h.items()))
        at = "the starting weights" if res["best_epoch"] < 0 else f"epoch {res['best_epoch'] + 1}"
        print(f"best {res['best_metric']:.4f} at {at}: {res['best_checkpoint']}")
    return 0


def _write_torchrun_job(args: argparse.Namespace, cfg, spec) -> int:
    """The stage as a job for ``torchrun ... -m captioning.training.torchrun JOB`` (every path absolute: the
    launcher's processes may start in other directories, on other nodes)."""
    import dataclasses

    from captioning.training.torchrun import write_job
    from tasks.fanout import absolute, worker_config

    spec = dataclasses.replace(spec, **{f.name: absolute(getattr(spec, f.name)) for f in dataclasses.fields(spec)
                                        if f.name in ("vocab_path", "labels_uri", "features_uri", "out", "init_from",
                                                      "scst_from", "dataset_path")})
    path = write_job(args.torchrun_job, worker_config(cfg).model_dump_json(), spec, args.nproc)
    command = (f"torchrun --nnodes 1 --nproc-per-node {args.nproc} -m captioning.training.torchrun "
               f"{path.resolve()}")
    if args.json:
        print_json({"job": str(path.resolve()), "nproc": args.nproc, "out": spec.out, "command": command})
    else:
        print(f"job for {args.nproc} processes: {path.resolve()}\ncheckpoints: {spec.out}\nrun it on one node "
              f"with:\n  {command}\n(several nodes: --nnodes N --nproc-per-node {args.nproc}/N --rdzv-backend "
              "c10d --rdzv-endpoint HOST:PORT on each; infra/README.md)")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train one model (XE or SCST), optionally data-parallel", description=(
        "Train the teacher or one student with cross-entropy, or fine-tune a checkpoint with SCST. Without path "
        "options it uses the workdir's recorded stages (dataset, feature store, label store: what `capflow run`, "
        "`capflow extract` or `capflow import-features` left; the label store is built when missing). "
        "Checkpoints go to <workdir>/runs/train-<model>-<key>/; a killed run resumes from its last epoch "
        "checkpoint. --nproc N runs N data-parallel processes (torch DDP: gloo on CPU, NCCL on GPUs)."))
    config_args(t)
    t.add_argument("--model", default="teacher",
                   help="teacher, a student family (acort, expansionnet, lw, satic, zodiac) or a registry preset")
    t.add_argument("--captions", choices=["ground_truth", "seqkd", "both"], default="ground_truth",
                   help="which label-store captions to train on")
    t.add_argument("--seqkd-source", help="name of the SeqKD source in the label store (default: the recorded "
                   "seqkd stage's)")
    t.add_argument("--init", help="checkpoint whose matching tensors initialise the model (SATIC weight-init)")
    t.add_argument("--scst-from", help="fine-tune this XE checkpoint with SCST instead of XE training")
    t.add_argument("--nproc", type=int, default=1, help="data-parallel processes (default 1)")
    t.add_argument("--features", help="feature store URI (default: the recorded one)")
    t.add_argument("--labels", help="label store (default: the recorded one; give --vocab and --features too)")
    t.add_argument("--vocab", help="vocabulary (with --labels)")
    t.add_argument("--out", help="checkpoint folder (default <workdir>/runs/train-<model>-<key>)")
    t.add_argument("--torchrun-job", metavar="FILE", help="write the stage as a job for torchrun (--nproc = its "
                   "world size, all nodes) instead of training here: torchrun ... -m captioning.training.torchrun FILE")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(func=cmd_train)
