"""``capflow run``: the whole pipeline as a Prefect flow (:mod:`flows.pipeline`), recorded in MLflow."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flows.cli.common import CLIError, config_args, parse_students, pipeline_args, print_json


def cmd_run(args: argparse.Namespace) -> int:
    if os.environ.get("PREFECT_HOME"):  # Prefect's local server cannot create its database in a missing folder
        Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    from flows.pipeline import build_config, pipeline
    from flows.prefect_server import start_prefect_api
    from tasks.tracking import preflight, tracking_uri

    students = parse_students(args.students)
    try:
        cfg = build_config(args.preset or ("demo" if not args.config else None), args.config, args.overrides,
                           students, not args.no_scst)
    except ValueError as e:
        raise CLIError(str(e)) from None
    # an unreachable tracking server, Prefect's temporary server not starting, an unreachable Dask scheduler:
    # one line naming it, exit 3 (flows.cli.failures), before any stage runs
    preflight(tracking_uri(cfg))
    start_prefect_api()  # Prefect's temporary server (no PREFECT_API_URL): its failure named, with a way out
    res = pipeline(preset=args.preset or ("demo" if not args.config else None), config_path=args.config,
                   overrides=list(args.overrides), students=students, scst=not args.no_scst)
    if args.json:
        print_json(res)
        return 0 if not res["failed"] else 1
    from tasks.refs import Leaderboard
    from tasks.report import markdown

    print()
    print(markdown(Leaderboard.from_record(res)))
    ch = res["champion"]
    print(f"champion: {cfg.tracking.model_name} v{ch['version']} ({ch['reason']})")
    cached = [k for k, v in res["stages"].items() if v == "cached"]
    if cached:
        print(f"cached stages: {', '.join(cached)}")
    print("wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in res["seconds"].items()))
    print(f"MLflow run {res['mlflow_run_id']} in {res['tracking_uri']}")
    if res["tracking_uri"].startswith("sqlite:"):
        print(f"  look next: mlflow ui --backend-store-uri {res['tracking_uri']} --host 127.0.0.1 --port 5000")
    return 0 if not res["failed"] else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run the whole pipeline (Prefect flow, MLflow tracking)", description=(
        "Run the DAG ingest -> extract -> vocab -> teacher -> SeqKD -> students -> SCST -> evaluation -> "
        "leaderboard -> promotion as a Prefect flow, recording everything in MLflow. Finished stages are cached; "
        "a killed run resumes. Honours PREFECT_API_URL and MLFLOW_TRACKING_URI."))
    config_args(r)
    pipeline_args(r)
    r.add_argument("--json", action="store_true", help="print the run summary as JSON")
    r.set_defaults(func=cmd_run)


def cmd_report(args: argparse.Namespace) -> int:
    """The trade-off report of the workdir's recorded students (``capflow report``), rebuilt without training."""
    from flows.cli.common import stage_context
    from tasks.report import recorded_students, tradeoff_report

    args.no_track = True
    with stage_context(args, progress=False) as rc:
        results, data = recorded_students(rc)
        if not results:
            raise CLIError(f"no student is recorded in {rc.workdir.root}: run the pipeline (capflow run) or capflow "
                           "train --model NAME first")
        out = Path(args.out) if args.out else rc.workdir.root / "report" / "latest"
        written = tradeoff_report(results, data, out)
    if args.json:
        print_json({"report": str(out / "report.html"), "files": [str(p) for p in written],
                    "models": sorted(r.label or r.student for r in results)})
    else:
        print(f"report of {len(results)} models: {out / 'report.html'}")
    return 0


def add_report_command(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="the trade-off report of the recorded students (figures + one HTML page)",
                       description=("Rebuild the compact-captioner trade-off report from the workdir's recorded "
                                    "students: test CIDEr against parameters and against latency (Pareto fronts "
                                    "marked), every family's learning curves, sample test images with each model's "
                                    "caption; tradeoff.png, curves.png and a self-contained report.html in "
                                    "<workdir>/report/latest/ (or --out). capflow run writes the same report for "
                                    "each run and logs it to the run's MLflow artifacts."))
    config_args(r)
    r.add_argument("--out", help="folder of the report (default <workdir>/report/latest)")
    r.add_argument("--json", action="store_true", help="print where the report is as JSON")
    r.set_defaults(func=cmd_report)
