"""The ``capflow`` command: a package of thin commands (parse the arguments, call the stage's job or the library,
render the result). Each module registers its commands with ``add_commands``:

- :mod:`flows.cli.data` - ingest, extract, import-features, vocab (the data stages' jobs, :mod:`tasks.data`)
- :mod:`flows.cli.train` - train (the training job, :func:`captioning.training.stages.run_training`)
- :mod:`flows.cli.run` - run (the whole pipeline, :mod:`flows.pipeline`)
- :mod:`flows.cli.models` - params, evaluate, caption
- :mod:`flows.cli.import_checkpoint` - import-checkpoint (released checkpoints -> model folders)
- :mod:`flows.cli.bench` - bench
- :mod:`flows.cli.workdir` - config, verify
- :mod:`flows.cli.platform` - stack, deploy, serve (the local servers and the Prefect deployment)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from captioning.config import ConfigError
from flows.cli.common import CLIError, config_args, parse_students, pipeline_args

__all__ = ["CLIError", "build_parser", "config_args", "main", "parse_students"]


def build_parser() -> argparse.ArgumentParser:
    from flows.cli import bench, data, import_checkpoint, models, platform, run, train, workdir

    p = argparse.ArgumentParser(prog="capflow", description="Train and compare compact, fast image captioners.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    data.add_commands(sub)
    workdir.add_commands(sub)
    run.add_commands(sub)
    train.add_commands(sub)
    models.add_commands(sub)
    bench.add_commands(sub)
    platform.add_commands(sub, config_args, pipeline_args)
    import_checkpoint.add_import_command(sub, config_args)
    return p


def main(argv: list[str] | None = None) -> int:
    # before anything imports prefect (it reads its settings once): the temporary Prefect server that `capflow run`
    # starts gets 90 s instead of Prefect's 20 s, which a loaded machine overran (an explicit setting wins)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    # and sends no telemetry (offline, it logged an ERROR in every run); PREFECT_SERVER_ANALYTICS_ENABLED=true wins
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    func: Callable[[argparse.Namespace], int] = args.func
    from captioning.data.karpathy import DatasetError
    from captioning.data.stores import StoreError
    from captioning.safe_pickle import UnsafePickleError
    from flows.stack import StackError
    from tasks.data import MissingStageError

    try:
        return func(args)
    except (ConfigError, DatasetError, StoreError, StackError, CLIError, UnsafePickleError, MissingStageError) as e:
        from captioning.redact import redact

        print(f"capflow {args.command}: error: {redact(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

