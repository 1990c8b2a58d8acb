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
import signal
import sys
from collections.abc import Callable

from captioning.config import load_config
from flows.cli.common import CLIError, config_args, parse_students, pipeline_args
from flows.cli.failures import INFRA_EXIT

__all__ = ["INFRA_EXIT", "CLIError", "build_parser", "config_args", "main", "parse_students"]


def build_parser() -> argparse.ArgumentParser:
    from flows.cli import bench, data, import_checkpoint, models, platform, run, train, workdir

    p = argparse.ArgumentParser(prog="capflow", description="Train and compare compact, fast image captioners.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (CAPFLOW_QUIET=1); without it, "
                   "long commands show a bar on a terminal, a line every CAPFLOW_PROGRESS_EVERY seconds (30) elsewhere")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    data.add_commands(sub)
    workdir.add_commands(sub)
    run.add_commands(sub)
    run.add_report_command(sub)
    train.add_commands(sub)
    models.add_commands(sub)
    bench.add_commands(sub)
    platform.add_commands(sub, config_args, pipeline_args)
    import_checkpoint.add_import_command(sub, config_args)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quiet:
        from captioning.progress import QUIET_ENV

        os.environ[QUIET_ENV] = "1"
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    func: Callable[[argparse.Namespace], int] = args.func
    from captioning.errors import CapflowError, InputError
    from flows import shutdown
    from flows.cli.common import workdir_lock

    try:
        # SIGTERM/SIGINT stop every stage (any thread) within a grace period; one run per workdir: a second
        # writer stops here, naming the holder
        with shutdown.graceful(), workdir_lock(args):
            return func(args)
    except InputError as e:  # refused input (captioning.errors): the message, exit 2
        from captioning.redact import redact

        print(f"capflow {args.command}: error: {redact(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # the disk, the S3 endpoint, the tracking server, ...: one line naming what failed
        from flows.cli.failures import describe

        msg = describe(e, args.command, _writing(args))
        if msg is None:
            if not isinstance(e, CapflowError):
                raise
            from captioning.redact import redact

            if args.verbose:
                import traceback

                traceback.print_exc()
            print(f"capflow {args.command}: error: {redact(e)}", file=sys.stderr)
            return 1
        if args.verbose:
            import traceback

            traceback.print_exc()
        print(f"capflow {args.command}: error: {msg}", file=sys.stderr)
        return INFRA_EXIT
    except BaseException as e:
        if not shutdown.is_stop(e):
            raise
        code = shutdown.exit_status(e)
        if not isinstance(e, KeyboardInterrupt):  # a signal (a KeyboardInterrupt here was raised by code)
            shutdown.exiting(code - 128)
        # Prefect's temporary server stops at exit, after Prefect sent its last logs and states (stopping it here
        # would leave those waiting on a dead server); the watchdog bounds the whole exit
        print(f"capflow {args.command}: stopped ({signal.Signals(code - 128).name}); finished stages and the last "
              "epoch checkpoints are kept: the same command resumes", file=sys.stderr)
        if argv is None and not isinstance(e, KeyboardInterrupt) and shutdown.prefect_server_gone(code - 128):
            shutdown.exit_now(code)  # Prefect's exit handlers would wait for its dead server until the watchdog
        return code


def _writing(args: argparse.Namespace) -> str:
    """What a command writes into, for a failure that names no file (a full disk under a store's chunk): the
    feature store for extract/import-features, else the workdir; "" when the configuration is unreadable."""
    if not hasattr(args, "overrides"):
        return ""
    try:
        preset = args.preset or ("demo" if args.command == "run" and not args.config else None)
        cfg = load_config(preset, args.config, args.overrides)
    except Exception:
        return ""
    if args.command in ("extract", "import-features"):
        return f"the feature store folder {cfg.feature_store_uri()}"
    return f"the workdir {cfg.workdir}"
