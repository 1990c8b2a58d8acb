"""Data-parallel training started by an outside launcher: ``torchrun`` (one node or several), or anything that sets
torch's launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

Every process runs the same rank function as capflow's own launcher (:func:`captioning.training.stages.train_rank`,
what ``capflow train --nproc N`` and ``teacher.nproc`` / ``students.nproc`` spawn on one machine), so the weights
are the same for the same world size. The job - the model's :class:`~captioning.training.recipe.TrainPlan` and the
:class:`~captioning.training.stages.TrainSpec` with every path absolute - is a JSON file written by
``capflow train ... --nproc N --torchrun-job JOB.json``::

    capflow train --preset P --model lw --nproc 16 --torchrun-job /shared/job.json
    # on each of the 2 nodes (8 processes each), the job, stores and checkpoint folder on shared storage or s3://
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id lw-1 \\
        -m captioning.training.torchrun /shared/job.json

Rank 0 writes the result (checkpoints, best metric, history: what ``capflow train --json`` prints) to
``--result`` (default ``<spec.out>/torchrun-result.json``, written atomically) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

JOB_FORMAT = "capflow-train-job/2"


def write_job(path: str | Path, plan: Any, spec: Any, nproc: int) -> Path:
    """The job file of one training stage (its :class:`~captioning.training.recipe.TrainPlan` and spec) for
    ``nproc`` processes in all (the launcher's world size)."""
    from captioning.training.recipe import TrainPlan
    from captioning.training.stages import TrainSpec

    if not isinstance(spec, TrainSpec):
        raise TypeError(f"spec must be a TrainSpec, not {type(spec).__name__}")
    if not isinstance(plan, TrainPlan):
        raise TypeError(f"plan must be a TrainPlan, not {type(plan).__name__}")
    doc = {"format": JOB_FORMAT, "nproc": nproc, "plan": json.loads(plan.to_json()), "spec": asdict(spec)}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    tmp.replace(p)
    return p


def read_job(path: str | Path) -> dict[str, Any]:
    from captioning.training.stages import TrainSpec

    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or doc.get("format") != JOB_FORMAT:
        raise ValueError(f"{path}: not a capflow training job (format {JOB_FORMAT}; write one with "
                         "capflow train ... --torchrun-job FILE)")
    known = {f.name for f in fields(TrainSpec)}
    if set(doc["spec"]) - known:
        raise ValueError(f"{path}: unknown TrainSpec fields {sorted(set(doc['spec']) - known)}")
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m captioning.training.torchrun", description=(
        "One process of a data-parallel training stage under torchrun: joins the launcher's process group and runs "
        "capflow's rank function on the job written by `capflow train ... --torchrun-job FILE`."))
    parser.add_argument("job", help="job file (capflow train --torchrun-job)")
    parser.add_argument("--result", help="where rank 0 writes the result JSON (default <out>/torchrun-result.json)")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from captioning.training import ddp
    from captioning.training.recipe import TrainPlan
    from captioning.training.stages import train_rank
    from captioning.util import resolve_device

    job = read_job(args.job)
    plan = TrainPlan.from_json(job["plan"])
    device = resolve_device(plan.stage.device)
    rank, world = ddp.init_from_env(device="cuda" if device.type == "cuda" else "cpu")
    try:
        if world != job["nproc"]:  # the stage's folder and its data shards are those of nproc processes
            raise SystemExit(f"{args.job} was written for {job['nproc']} processes, this launch has {world}: "
                             f"write it with --nproc {world}, or launch {job['nproc']} processes")
        out = train_rank(rank, world, plan.to_json(), job["spec"], False)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        result = Path(args.result or Path(job["spec"]["out"]) / "torchrun-result.json")
        result.parent.mkdir(parents=True, exist_ok=True)
        tmp = result.with_name(result.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str), encoding="utf-8")
        tmp.replace(result)
        json.dump(out, sys.stdout, default=str)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
