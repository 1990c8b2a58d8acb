"""What every ``capflow`` command shares: the configuration options, user-facing errors, JSON output, and the
single-stage commands' run context (the pipeline's workdir layout and stage records; MLflow runs when a tracking
URI is set)."""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from captioning.config import PipelineConfig, load_config, preset_names
from captioning.errors import InputError


class CLIError(InputError):
    """A user-facing error: printed without a traceback, exit status 2."""


def config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--preset", help=f"named preset ({', '.join(preset_names())})")
    g.add_argument("--config", metavar="FILE", help="YAML config file")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set dataset.max_reject_fraction=0.05 (repeatable)")


def pipeline_args(p: argparse.ArgumentParser) -> None:
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


def load_cfg(args: argparse.Namespace) -> PipelineConfig:
    return load_config(args.preset, args.config, args.overrides)


#: commands that write into the workdir: each holds its lock (one run per workdir, captioning.locks)
WRITERS = frozenset({"run", "ingest", "extract", "import-features", "vocab", "train"})


def workdir_lock(args: argparse.Namespace):
    """The workdir lock a command holds while it runs (a no-op context for commands that only read). ``capflow
    run`` without a preset or config runs the demo preset, so its workdir is the demo's."""
    import contextlib

    command = getattr(args, "command", "")
    if command not in WRITERS and not (command == "verify" and getattr(args, "repair", False)):
        return contextlib.nullcontext()
    from captioning.locks import hold_workdir

    preset = args.preset or ("demo" if command == "run" and not args.config else None)
    cfg = load_config(preset, args.config, args.overrides)
    if command == "verify" and not cfg.workdir.is_dir():
        return contextlib.nullcontext()  # verify names the missing workdir itself
    return hold_workdir(cfg.workdir, f"capflow {command}")


def tracking_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-track", action="store_true", help="record no MLflow run, even with a tracking URI set "
                   "(MLFLOW_TRACKING_URI or tracking.tracking_uri)")


@contextlib.contextmanager
def stage_context(args: argparse.Namespace, progress: bool = True, rerun: frozenset[str] = frozenset()):
    """The run context of a single-stage command: the pipeline's workdir layout and stage records; with a tracking
    URI set (and no ``--no-track``) a parent run ``capflow <command>`` whose stage runs have the pipeline's shape
    (:meth:`tasks.common.RunContext.tracked`), else no MLflow at all (:meth:`~tasks.common.RunContext.local`)."""
    from tasks.common import RunContext, tracking_requested

    cfg = load_cfg(args)
    if getattr(args, "no_track", False) or not tracking_requested(cfg):
        yield RunContext.local(cfg, progress=progress, rerun=rerun)
        return
    from tasks.tracking import Tracker

    command = getattr(args, "command", "") or "command"
    with RunContext.tracked(cfg, Tracker(cfg), f"capflow {command}", {"capflow.command": command},
                            progress=progress, rerun=rerun) as rc:
        yield rc


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str, ensure_ascii=False))
