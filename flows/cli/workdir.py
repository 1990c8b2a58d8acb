"""``capflow config | verify``: the configuration (presets, keys, a resolved config) and the workdir's integrity
(stores, stage records, checkpoints)."""

from __future__ import annotations

import argparse
import json

from captioning.config import describe_keys, dump_yaml, load_config, preset_names
from flows.cli.common import CLIError, config_args, load_cfg, print_json


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


def cmd_verify(args: argparse.Namespace) -> int:
    from tasks.verify import default_paths, format_text, verify

    cfg = load_cfg(args)
    if not args.paths and not cfg.workdir.is_dir() and not cfg.run.store:
        raise CLIError(f"run.workdir {cfg.workdir} does not exist: nothing to verify (give paths or --set "
                       "run.workdir=)")
    res = verify(args.paths or default_paths(cfg), repair=args.repair, workdirs=[cfg.workdir],
                 run_store=None if args.paths else cfg.run.store)
    if args.json:
        print_json(res.to_json())
    else:
        print(format_text(res))
    return 1 if res.damaged else 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="show presets and settings", description="Show presets and settings.")
    c.add_argument("action", choices=["show", "keys", "presets"], help="show a config as YAML | list every key "
                   "with its default and description | list presets")
    c.add_argument("name", nargs="?", help="preset name (for show)")
    config_args(c)
    c.set_defaults(func=cmd_config)

    ve = sub.add_parser("verify", help="check stores, stage records and checkpoints; --repair fixes what it can",
                        description=("Check a workdir's feature and label stores (every chunk against the checksum "
                                     "recorded when it was written), stage records and checkpoints. --repair marks "
                                     "damaged feature chunks for re-extraction, removes damaged records, checkpoints "
                                     "and label stores (and the records that name them), and records checksums for "
                                     "stores written before capflow kept them; the next `capflow extract` / "
                                     "`capflow run` redoes the rest. Exit status 1 when something damaged is left."))
    config_args(ve)
    ve.add_argument("paths", nargs="*", metavar="PATH", help="stores, records, checkpoints or folders to check "
                    "(default: run.workdir and the feature store folder)")
    ve.add_argument("--repair", action="store_true", help="repair what is damaged (see above)")
    ve.add_argument("--json", action="store_true", help="print one JSON object")
    ve.set_defaults(func=cmd_verify)
