"""``capflow train``: one model, in one or N data-parallel processes.

``capflow train --model NAME`` is the pipeline's own job for that model (:func:`tasks.training.model_job`): the
teacher, or a student with the recipe's captions, initialisation, SCST, evaluation and registration, under the
pipeline's stage keys - so after ``capflow run`` it finds the student instead of training it again, and
``--retrain`` trains it anew. Any of ``--captions``, ``--seqkd-source``, ``--init``, ``--scst-from``, ``--features``,
``--labels``, ``--out`` or ``--torchrun-job`` makes it a custom training instead (one XE or SCST run in its own
folder, which a killed run resumes: :func:`tasks.training.custom_training`).

Inputs are the workdir's recorded stages: the dataset, the feature store (extracted, imported or written by
``capflow run``) and its label store (built now when missing). With a tracking URI set the command records an MLflow
run ``capflow train`` with the stage runs and the model's LoggedModel under it (``--no-track``: none)."""

from __future__ import annotations

import argparse
from pathlib import Path

from flows.cli.common import CLIError, config_args, print_json, stage_context, tracking_args


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
        # stores given by path only: their identity is their URI (no recorded digest)
        return {"vocab": args.vocab, "labels": args.labels, "features": args.features, "dataset": None,
                "labels_identity": args.labels, "features_identity": args.features, "dataset_identity": None}
    data = ingest(rc)
    try:
        feats = features_of_store(args.features) if args.features else features_for(rc, data)
    except MissingStageError as e:
        raise CLIError(str(e)) from None
    labels = vocab(rc, data, feats)  # the recorded one (the pipeline's, for the same settings) or built now
    return {"vocab": labels.vocab_path, "labels": labels.labels_uri, "features": feats.uri, "dataset": data.path,
            "labels_identity": labels.labels_digest, "features_identity": feats.digest, "dataset_identity": data.digest}


def _seqkd_source(rc, args: argparse.Namespace, captions: str) -> str | None:
    if captions == "ground_truth" or args.seqkd_source:
        return args.seqkd_source
    from tasks.refs import SeqKDRef

    kd = rc.cache.latest("seqkd", SeqKDRef)
    if kd is None:
        raise CLIError(f"--captions {captions} needs teacher captions in the label store: give --seqkd-source "
                       "or run the pipeline (`capflow run`), whose seqkd stage writes them")
    return kd.source


#: the options that make `capflow train` a custom training instead of the recipe's job
CUSTOM = ("captions", "seqkd_source", "init", "scst_from", "features", "labels", "vocab", "out", "torchrun_job")


def cmd_train(args: argparse.Namespace) -> int:
    from captioning.models.names import TEACHER_NAMES, preset_name

    if args.nproc is not None and args.nproc < 1:
        raise CLIError("--nproc must be >= 1")
    if args.model not in TEACHER_NAMES:
        try:
            preset_name(args.model)
        except ValueError as e:
            raise CLIError(str(e)) from None
    custom = [f"--{f.replace('_', '-')}" for f in CUSTOM if getattr(args, f)]
    if custom and (args.retrain or args.no_scst):
        raise CLIError(f"{'--retrain' if args.retrain else '--no-scst'} applies to the recipe's job; with "
                       f"{', '.join(custom)} this is a custom training, which resumes its folder (remove it, or give "
                       "another --out, to start over)")
    return _custom(args) if custom else _recipe(args)


def _recipe(args: argparse.Namespace) -> int:
    """The pipeline's job for the model: its stage record when it has one (``--retrain``: trained anew)."""
    from captioning.models.names import TEACHER_NAMES
    from tasks.data import MissingStageError, features_for, ingest, vocab
    from tasks.refs import StudentFailure, StudentResult
    from tasks.training import model_job

    is_teacher = args.model in TEACHER_NAMES
    if args.nproc is not None:
        args.overrides = [*args.overrides, f"{'teacher' if is_teacher else 'students'}.nproc={args.nproc}"]
    if args.no_scst:
        args.overrides = [*args.overrides, "students.scst.enabled=false"]
    stage = "teacher" if is_teacher else f"student-{args.model}"
    with stage_context(args, progress=True, rerun=frozenset({stage} if args.retrain else ())) as rc:
        data = ingest(rc)
        try:
            feats = features_for(rc, data)
        except MissingStageError as e:
            raise CLIError(str(e)) from None
        labels = vocab(rc, data, feats)
        res = model_job(rc, args.model, data, feats, labels)
        if isinstance(res, StudentFailure):
            raise CLIError(f"student {args.model} failed: {res.error}")
    status = rc.stages.get(stage, "ran")
    if args.json:
        print_json({"model": args.model, "stage": stage, "status": status, "result": res.to_record()})
    elif isinstance(res, StudentResult):
        how = "found in the stage records (--retrain trains it again)" if status == "cached" else "trained"
        cider = res.metrics.get("CIDEr")
        print(f"{res.student} ({res.preset}): {how}; test CIDEr {cider:.4f}" if cider is not None else
              f"{res.student} ({res.preset}): {how}")
        print(f"model {Path(res.checkpoint).parent}" + (f"; registered version {res.model_version}"
                                                        if res.model_version else ""))
    else:
        how = "found in the stage records (--retrain trains it again)" if status == "cached" else "trained"
        print(f"teacher: {how}; best validation CIDEr {res.best_val_cider:.4f}: {res.checkpoint}")
    return 0


def _custom(args: argparse.Namespace) -> int:
    """One XE or SCST training with the given captions / initialisation / stores, in its own folder."""
    import dataclasses

    from captioning.training.recipe import model_plan
    from captioning.training.stages import Inputs
    from tasks.cache import stage_key
    from tasks.training import custom_training

    nproc = args.nproc or 1
    if args.torchrun_job:
        args.no_track = True  # the job is written here and trains elsewhere: nothing to record now
    with stage_context(args, progress=True) as rc:
        cfg = rc.cfg
        paths = _inputs(args, rc)
        captions = args.captions or "ground_truth"
        seqkd_source = _seqkd_source(rc, args, captions)
        stage = f"train-{args.model}" + ("-scst" if args.scst_from else "")
        plan = dataclasses.replace(model_plan(cfg, args.model), captions=captions, init_from_teacher=False,
                                   nproc=nproc)
        key = stage_key(stage, labels=paths["labels_identity"], features=paths["features_identity"],
                        model=plan.digest(through="evaluation" if args.scst_from else "xe"), seqkd=seqkd_source,
                        init=args.init, scst_from=args.scst_from)
        inputs = Inputs(vocab=paths["vocab"], labels=paths["labels"], features=paths["features"],
                        dataset=paths["dataset"])
        out = args.out or str(rc.workdir.stage_dir(stage, key))
        phase, start = ("scst", args.scst_from) if args.scst_from else ("xe", args.init)
        if args.torchrun_job:
            return _write_torchrun_job(args, plan, inputs, out, phase, start, seqkd_source)
        res = custom_training(rc, stage, plan, inputs, out, phase=phase, start=start, seqkd_source=seqkd_source,
                              digests={"features": paths["features_identity"], "labels": paths["labels_identity"],
                                       "dataset": paths["dataset_identity"]})
    if args.json:
        print_json(dataclasses.asdict(res))
    else:
        for h in res.history:
            print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in h.items()))
        at = "the starting weights" if (res.best_epoch or 0) < 0 else f"epoch {(res.best_epoch or 0) + 1}"
        print(f"best {res.best_metric:.4f} at {at}: {res.best_checkpoint}")
    return 0


def _write_torchrun_job(args: argparse.Namespace, plan, inputs, out: str, phase: str, start: str | None,
                        seqkd_source: str | None) -> int:
    """The stage as a job for ``torchrun ... -m captioning.training.torchrun JOB`` (every path absolute: the
    launcher's processes may start in other directories, on other nodes)."""
    import dataclasses

    from captioning.training.torchrun import write_job
    from tasks.fanout import absolute

    inputs = dataclasses.replace(inputs, **{f.name: absolute(getattr(inputs, f.name))
                                            for f in dataclasses.fields(inputs)})
    spice = plan.spice_jars
    plan = dataclasses.replace(plan, spice_jars=absolute(spice) if spice else None)
    out = str(absolute(out))
    path = write_job(args.torchrun_job, plan, inputs, out, plan.nproc, phase=phase, start=absolute(start),
                     seqkd_source=seqkd_source)
    nproc = plan.nproc
    command = (f"torchrun --nnodes 1 --nproc-per-node {nproc} -m captioning.training.torchrun "
               f"{path.resolve()}")
    if args.json:
        print_json({"job": str(path.resolve()), "nproc": nproc, "out": out, "command": command})
    else:
        print(f"job for {nproc} processes: {path.resolve()}\ncheckpoints: {out}\nrun it on one node "
              f"with:\n  {command}\n(several nodes: --nnodes N --nproc-per-node {nproc}/N --rdzv-backend "
              "c10d --rdzv-endpoint HOST:PORT on each; infra/README.md)")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train one model as the pipeline does (or a custom XE/SCST run)", description=(
        "Train the teacher or one student as the pipeline does: the recipe's captions (SeqKD where the config says "
        "so; the teacher and its captions are found or made first), initialisation, SCST, test evaluation and the "
        "registered MLflow Model, under the pipeline's stage keys - after `capflow run` the student is found, not "
        "trained again (--retrain: trained anew). Any of --captions, --seqkd-source, --init, --scst-from, "
        "--features, --labels, --out, --torchrun-job makes it a custom training: one XE run (or SCST from a "
        "checkpoint) in <workdir>/runs/train-<model>-<key>/ (or --out), which a killed run resumes. Inputs are the "
        "workdir's recorded stages (what `capflow run`, `capflow extract` or `capflow import-features` left; the "
        "label store is built when missing). --nproc N runs N data-parallel processes (torch DDP: gloo on CPU, "
        "NCCL on GPUs). With MLFLOW_TRACKING_URI or tracking.tracking_uri set, an MLflow run `capflow train` "
        "records it (the model as a LoggedModel)."))
    config_args(t)
    tracking_args(t)
    t.add_argument("--model", default="teacher",
                   help="teacher, a student family (acort, expansionnet, lw, satic, zodiac) or a registry preset")
    t.add_argument("--retrain", action="store_true", help="train the recipe's model anew although it is recorded")
    t.add_argument("--no-scst", action="store_true", help="the recipe's student without SCST fine-tuning")
    t.add_argument("--captions", choices=["ground_truth", "seqkd", "both"],
                   help="custom training on these label-store captions (default of a custom run: ground_truth)")
    t.add_argument("--seqkd-source", help="name of the SeqKD source in the label store (default: the recorded "
                   "seqkd stage's)")
    t.add_argument("--init", help="checkpoint whose matching tensors initialise the model (SATIC weight-init)")
    t.add_argument("--scst-from", help="fine-tune this XE checkpoint with SCST instead of XE training")
    t.add_argument("--nproc", type=int, help="data-parallel processes (default: teacher.nproc / students.nproc; "
                   "a custom run: 1)")
    t.add_argument("--features", help="feature store URI (default: the recorded one)")
    t.add_argument("--labels", help="label store (default: the recorded one; give --vocab and --features too)")
    t.add_argument("--vocab", help="vocabulary (with --labels)")
    t.add_argument("--out", help="checkpoint folder (default <workdir>/runs/train-<model>-<key>)")
    t.add_argument("--torchrun-job", metavar="FILE", help="write the stage as a job for torchrun (--nproc = its "
                   "world size, all nodes) instead of training here: torchrun ... -m captioning.training.torchrun FILE")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(func=cmd_train)
