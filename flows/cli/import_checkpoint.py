"""``capflow import-checkpoint``: a paper's released checkpoint -> a capflow model folder.

The conversion is :func:`captioning.models.released.import_checkpoint` (key mapping, id remapping, the
``released`` flavour of the code base's preset); the folder is written by
:func:`captioning.training.checkpoint.save_model_dir` (``model.pt``, ``vocab.json``, ``capflow.json``), so
``capflow caption --model MODEL_DIR`` loads it like a folder the pipeline registered. The configuration given
(``--preset/--config/--set``) supplies what the weights do not hold: the ``features`` section (the region
extractor a captioner rebuilds; its ``feature_dim`` must be the checkpoint's input width), ``dataset.max_words``
and ``evaluation.beam``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flows.cli.common import CLIError


def cmd_import_checkpoint(args: argparse.Namespace) -> int:
    from captioning.config import load_config
    from captioning.models.released import ImportCheckpointError, import_checkpoint
    from captioning.training.checkpoint import MODEL_FILE, save_model_dir
    from captioning.workdir import Workdir

    for flag, path in (("CKPT", args.ckpt), ("--vocab", args.vocab)):
        p = Path(path)
        if not p.exists():
            raise CLIError(f"{flag} {p} does not exist")
        if p.is_dir():
            raise CLIError(f"{flag} {p} is a folder: give the file itself")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} is a file: give a folder for the model")
    if (out / MODEL_FILE).exists() and not args.force:
        raise CLIError(f"--out {out} already holds a model ({MODEL_FILE}): give another folder or --force")
    if args.group_size is not None and args.group_size < 1:
        raise CLIError("--group-size must be >= 1")
    if args.heads < 1:
        raise CLIError("--heads must be >= 1")
    cfg = load_config(args.preset, args.config, args.overrides)  # ConfigError: reported by capflow's main
    d_want = cfg.features.feature_dim
    try:
        model, vocab = import_checkpoint(args.family, args.ckpt, args.vocab, heads=args.heads,
                                         group_size=args.group_size, zodiac_gate=args.gate,
                                         released_acort_cache=args.released_acort_cache)
    except ImportCheckpointError as e:
        raise CLIError(str(e)) from None
    except ValueError as e:  # the released vocabulary does not make a capflow one (e.g. a duplicate word)
        raise CLIError(f"{args.vocab}: {e}") from None
    d_in = int(model.cfg.d_in)
    if d_want != d_in:
        raise CLIError(f"the checkpoint takes {d_in}-d region features but the configuration's extractor gives "
                       f"features.feature_dim={d_want}: give a preset/config whose features match (or --set "
                       f"features.feature_dim={d_in})")
    preset = f"{_preset_name(args)}@released"
    folder = save_model_dir(
        out, model=model, arch=model.cfg.to_dict(), vocab=vocab, features=cfg.features.model_dump(mode="json"),
        student=args.family, preset=preset, max_words=cfg.dataset.max_words,
        beam=cfg.evaluation.beam, weights_cache_dir=Workdir.of(cfg).weights_cache())
    summary: dict[str, Any] = {
        "model_dir": str(folder), "family": args.family, "checkpoint": str(args.ckpt),
        "params": sum(p.numel() for p in model.parameters()), "words": len(vocab.words),
        "layers": [model.cfg.enc_layers, model.cfg.dec_layers], "d_model": model.cfg.d_model}
    if args.family == "zodiac":
        summary["gate"] = args.gate
    if args.released_acort_cache:
        summary["released_acort_cache"] = True
    from flows.cli.common import stage_context
    from tasks.training import imported_checkpoint

    with stage_context(args, progress=False) as rc:  # an MLflow Model too when a tracking URI is set
        model_id = imported_checkpoint(rc, folder, family=args.family, preset=preset, checkpoint=str(args.ckpt),
                                       params={k: summary[k] for k in ("params", "words", "layers", "d_model",
                                                                       "gate", "released_acort_cache")
                                               if k in summary})
    if model_id:
        summary["model_id"] = model_id
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"imported {args.family} {args.ckpt} -> {folder} ({summary['params']:,} parameters, "
              f"{summary['words']} words)" + (f"; MLflow Model {model_id}" if model_id else ""))
    if cfg.features.source != "detector":
        print(f"capflow import-checkpoint: features.source={cfg.features.source!r}: capflow caption needs "
              "detector features, so it will refuse this folder", file=sys.stderr)
    return 0


def _preset_name(args: argparse.Namespace) -> str:
    return f"zodiac-{args.gate}" if args.family == "zodiac" else args.family


def add_import_command(sub: Any, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``capflow import-checkpoint`` on ``sub`` (the parser's subparsers); ``config_args`` adds
    ``--preset/--config/--set``."""
    from captioning.models.released import CODEBASES

    p = sub.add_parser("import-checkpoint", help="convert a paper's released checkpoint into a model folder",
                       description=(
                           "Convert a paper's released checkpoint (a state dict, read with "
                           "torch.load(weights_only=True)) and its vocabulary into a capflow model folder "
                           "(model.pt, vocab.json, capflow.json) running the family's released flavour; "
                           "`capflow caption --model MODEL_DIR` then captions with it. The configuration "
                           "supplies the features section (its feature_dim must be the checkpoint's input "
                           "width), dataset.max_words and evaluation.beam. Unknown or missing keys are errors "
                           "naming them (exit status 2)."))
    p.add_argument("--from", dest="family", required=True, choices=list(CODEBASES),
                   help="the released code base: " + ", ".join(CODEBASES))
    p.add_argument("ckpt", metavar="CKPT", help="the released checkpoint (a state dict of tensors)")
    p.add_argument("--vocab", required=True, metavar="VOCAB",
                   help="the released vocabulary: aic/satic/zodiac a JSON list of words (ids 1..V) or an "
                   "ix_to_word mapping (cocotalk.json); expansionnet its caption_idx2word_list (JSON list, ids "
                   "0..V-1) or caption_word2idx_dict; ort/acort the SentencePiece tokenizer/word.vocab (or a JSON "
                   "list of its pieces); lw the M2 vocabulary's itos as a JSON list (ids 0..V-1; its vocab_<exp>.pkl "
                   "is a pickle, not read); ort/acort also read the run's config.json beside CKPT when there "
                   "(share_att_encoder/decoder, num_heads, radix_base)")
    p.add_argument("--out", required=True, metavar="MODEL_DIR", help="the model folder to write")
    p.add_argument("--heads", type=int, default=8, help="attention heads (not stored in the weights; default 8)")
    p.add_argument("--group-size", type=int, help="satic: the group size K (not stored in the weights)")
    p.add_argument("--gate", choices=["sigmoid", "tanh"],
                   help="zodiac (required): the released run's --caption_model zodiac-sigmoid (ZTransformerModel) or "
                   "zodiac-tanh (ZTransformerModel2); their weights have the same keys and shapes")
    p.add_argument("--released-acort-cache", action="store_true",
                   help="ort/acort: caption with the released code's step cache (one self-attention cache per shared "
                   "decoder layer), which gives the published ACORT captions; without it the model decodes the "
                   "function it was trained with (the released whole-prefix decoding)")
    p.add_argument("--force", action="store_true", help="overwrite a model already in --out")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    config_args(p)
    from flows.cli.common import tracking_args

    tracking_args(p)
    p.set_defaults(func=cmd_import_checkpoint)
