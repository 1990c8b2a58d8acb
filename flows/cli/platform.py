"""CLI commands for the platform: ``capflow stack``, ``capflow deploy``, ``capflow serve``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from flows.stack import DEFAULT_PORTS, WORK_POOL, Stack, StackError, env_lines


def _stack(args: argparse.Namespace) -> Stack:
    st = Stack.load(args.home)
    for name in DEFAULT_PORTS:
        port = getattr(args, f"{name}_port", None)
        if port:
            st.ports[name] = port
    if getattr(args, "bucket", None):
        st.bucket = args.bucket
    return st


def _home_arg(st: Stack) -> str:
    """`` --home PATH`` for a command hint: the printed command works from any folder and shell."""
    import shlex

    return f" --home {shlex.quote(str(st.home))}"


def cmd_stack(args: argparse.Namespace) -> int:
    st = _stack(args)
    if args.action == "up":
        res = st.up(worker=not args.no_worker, timeout=args.timeout)
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"stack up in {st.home}")
            print(f"  Prefect UI   {st.prefect_ui}   (API {st.prefect_api})")
            print(f"  MLflow UI    {st.mlflow_url}   (artifacts -> s3://{st.bucket}/mlflow)")
            print(f"  S3 endpoint  {st.s3_endpoint}   (bucket {st.bucket}; moto server, snapshot kept at down)")
            if not args.no_worker:
                print(f"  worker       process work pool '{WORK_POOL}'")
            print(f'point this shell at it:  eval "$(capflow stack env{_home_arg(st)})"')
        return 0
    if args.action == "down":
        res = st.down()
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print("stack down" + (f"; ports still in use: {', '.join(res['ports_still_in_use'])}"
                                  if res["ports_still_in_use"] else "")
                  + (f"; {len(res['runs_killed'])} unfinished MLflow run(s) marked KILLED"
                     if res["runs_killed"] else ""))
            if "s3_kept" in res:
                print(f"  bucket {st.bucket}: {res['s3_kept']['objects']} objects kept in {res['s3_kept']['snapshot']}")
        if "s3_lost" in res:
            print(f"capflow stack down: warning: {res['s3_lost']}", file=sys.stderr)
        return 0 if not res["ports_still_in_use"] else 1
    if args.action == "status":
        res = st.status()
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"stack in {st.home}: {res['state']} ({res['healthy']} services healthy)")
            for name, s in res["services"].items():
                state = ("healthy" if s["healthy"] else "running, not healthy" if s["alive"] else
                         "stopped" if s["pid"] else "not started")
                print(f"  {name:8s} {state:22s} pid {s['pid'] or '-'}   log {s['log']}")
        if "s3_lost" in res:
            print(f"capflow stack status: warning: {res['s3_lost']}", file=sys.stderr)
        return 0 if res["running"] else 1
    if args.action == "env":
        if not st.state_file.exists() or not st.key_id:
            raise StackError(f"no stack in {st.home}: run 'capflow stack up{_home_arg(st)}' first")
        print(env_lines(st))
        return 0
    raise AssertionError(args.action)


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.cli.common import parse_students
    from flows.deployments import deploy
    from flows.pipeline import build_config

    students = parse_students(args.students)  # a CLIError (exit 2) when it names no student
    preset = args.preset or ("demo" if not args.config else None)
    try:  # the same validation as a run, before anything is registered
        build_config(preset, args.config, args.overrides, students, not args.no_scst)
    except ValueError as e:
        raise StackError(str(e)) from None
    params: dict[str, Any] = {"preset": preset, "scst": not args.no_scst}
    if args.config:
        params["config_path"] = os.path.abspath(args.config)
    if args.overrides:
        params["overrides"] = list(args.overrides)
    if students:
        params["students"] = students
    res = deploy(name=args.name, cron=args.cron, timezone=args.timezone, parameters=params, workdir=args.workdir,
                 paused=args.paused, work_pool=args.work_pool,
                 image=args.image)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        sched = ", ".join(f"{s['cron']} ({s['timezone']})" for s in res["schedules"])
        print(f"deployment {res['name']} on {res['api']}: schedule {sched}, concurrency limit "
              f"{res['concurrency_limit']}, work pool '{res['work_pool']}', working dir {res['working_dir']}")
        print(f"trigger now:  {res['run_command']}   (or 'Run' in the Prefect UI)")
        print(f"runs execute on a worker of pool '{res['work_pool']}': 'capflow stack up' starts one; "
              "elsewhere run 'capflow serve'")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run a Prefect process worker in the foreground (replaces this process)."""
    if not os.environ.get("PREFECT_API_URL"):
        raise StackError("PREFECT_API_URL is not set: point it at the Prefect server (eval \"$(capflow stack env)\")")
    from flows.stack import _bin

    cmd = [_bin("prefect"), "worker", "start", "--pool", args.pool, "--type", "process", "--install-policy", "never"]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


def add_commands(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None],
                 pipeline_args: Callable[[argparse.ArgumentParser], None]) -> None:
    s = sub.add_parser("stack", help="local Prefect + MLflow + S3 servers on 127.0.0.1", description=(
        "Start/stop a local stack: S3 endpoint (moto server), MLflow server (SQLite backend, artifacts proxied to "
        "s3://BUCKET/mlflow), Prefect server and a process worker for the 'capflow' work pool. Everything binds "
        "127.0.0.1; state (PIDs, logs, databases, bucket snapshot) lives in --home (default .capflow/stack or "
        "$CAPFLOW_STACK_HOME). 'eval \"$(capflow stack env)\"' points a shell at it."))
    s.add_argument("action", choices=["up", "down", "status", "env"])
    s.add_argument("--home", help="state folder (default $CAPFLOW_STACK_HOME or ./.capflow/stack)")
    for name, port in DEFAULT_PORTS.items():
        s.add_argument(f"--{name}-port", type=int, help=f"port for {name} (default {port}, or the stack's last)")
    s.add_argument("--bucket", help="bucket for MLflow artifacts (default capflow)")
    s.add_argument("--no-worker", action="store_true", help="do not start the Prefect worker (up)")
    s.add_argument("--timeout", type=float, default=120.0, help="seconds each service may take to be healthy")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_stack)

    d = sub.add_parser("deploy", help="register the nightly pipeline deployment on the Prefect server",
                       description=(
                           "Create/update the deployment 'capflow-pipeline/NAME' on $PREFECT_API_URL: cron schedule "
                           "(default 02:00 daily), concurrency limit 1 (overlapping runs are queued), work pool "
                           "'capflow', the pipeline's parameters as defaults (editable in the UI's form). Flow runs "
                           "use the current folder (or --workdir) as working directory."))
    config_args(d)
    d.add_argument("--name", default="nightly", help="deployment name (default nightly)")
    d.add_argument("--cron", default="0 2 * * *", help="cron expression (default '0 2 * * *')")
    d.add_argument("--timezone", default="UTC", help="IANA time zone of the schedule (default UTC)")
    pipeline_args(d)
    d.add_argument("--workdir", help="working directory of flow runs on a process pool (default: the current folder)")
    d.add_argument("--work-pool", default=WORK_POOL, help="work pool (default capflow, a process pool created when "
                   "missing; any other pool, e.g. kubernetes, must exist)")
    d.add_argument("--image", help="container image with capflow installed (container pools such as kubernetes)")
    d.add_argument("--paused", action="store_true", help="register with the schedule paused")
    d.add_argument("--json", action="store_true", help="print what the Prefect API reports as JSON")
    d.set_defaults(func=cmd_deploy)

    w = sub.add_parser("serve", help="run a Prefect worker that executes capflow deployments", description=(
        "Start a process worker for the work pool (default 'capflow') in the foreground; it executes triggered "
        "and scheduled runs of 'capflow deploy' deployments. Needs PREFECT_API_URL (and MLFLOW_TRACKING_URI, "
        "S3 settings) in the environment: flow runs inherit them."))
    w.add_argument("--pool", default=WORK_POOL, help="work pool (default capflow)")
    w.add_argument("--limit", type=int, help="most concurrent flow runs on this worker")
    w.set_defaults(func=cmd_serve)
