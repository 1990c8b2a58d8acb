"""Data-parallel training started by an outside launcher: ``torchrun`` (one node or several), or anything that sets
torch's launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

Every process runs the same rank function as capflow's own launcher (:func:`captioning.training.stages.train_rank`,
what ``capflow train --nproc N`` and ``teacher.nproc`` / ``students.nproc`` spawn on one machine), so the weights
are the same for the same world size. The job - the model's :class:`~captioning.training.recipe.ModelPlan`, its
inputs (:class:`~captioning.training.stages.Inputs`) and checkpoint folder with every path absolute, the phase
(XE or SCST) and its starting checkpoint - is a JSON file written by
``capflow train ... --nproc N --torchrun-job JOB.json``::

    capflow train --preset P --model lw --nproc 16 --torchrun-job /shared/job.json
    # on each of the 2 nodes (8 processes each), the job, stores and checkpoint folder on shared storage or s3://
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id lw-1 \\
        -m captioning.training.torchrun /shared/job.json

Rank 0 writes the result (checkpoints, best metric, history: what ``capflow train --json`` prints) to
``--result`` (default ``<out>/torchrun-result.json``, written atomically) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from captioning.errors import InputError

JOB_FORMAT = "capflow-train-job/3"
_KEYS = {"format", "nproc", "plan", "inputs", "out", "phase", "start", "seqkd_source"}


class JobError(InputError, ValueError):
    """A job file that is not a capflow training job (damaged, of another version, edited by hand)."""


def write_job(path: str | Path, plan: Any, inputs: Any, out: str, nproc: int, *, phase: str = "xe",
              start: str | None = None, seqkd_source: str | None = None) -> Path:
    """The job file of one training run (its :class:`~captioning.training.recipe.ModelPlan`, inputs, folder and
    phase) for ``nproc`` processes in all (the launcher's world size)."""
    from captioning.training.recipe import ModelPlan
    from captioning.training.stages import Inputs, job_document

    if not isinstance(plan, ModelPlan):
        raise TypeError(f"plan must be a ModelPlan, not {type(plan).__name__}")
    if not isinstance(inputs, Inputs):
        raise TypeError(f"inputs must be Inputs, not {type(inputs).__name__}")
    doc = {"format": JOB_FORMAT, "nproc": nproc,
           **job_document(plan, inputs, out, phase=phase, start=start, seqkd_source=seqkd_source)}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    tmp.replace(p)
    return p


def read_job(path: str | Path) -> dict[str, Any]:
    """A job file, checked: its format, its keys, the plan and the inputs readable (:class:`JobError` naming the
    file otherwise)."""
    from captioning.training.recipe import ModelPlan
    from captioning.training.stages import Inputs

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise JobError(f"{path}: cannot be read as a capflow training job ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != JOB_FORMAT:
        raise JobError(f"{path}: not a capflow training job (format {JOB_FORMAT}; write one with "
                       "capflow train ... --torchrun-job FILE)")
    if set(doc) != _KEYS:
        raise JobError(f"{path}: a job has the keys {sorted(_KEYS)}; missing {sorted(_KEYS - set(doc))}, unexpected "
                       f"{sorted(set(doc) - _KEYS)}")
    try:
        ModelPlan.from_json(doc["plan"])
        Inputs(**doc["inputs"])
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise JobError(f"{path}: its plan or inputs do not match this capflow ({type(e).__name__}: {e})") from None
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
    from captioning.training.recipe import ModelPlan
    from captioning.training.stages import train_rank
    from captioning.util import resolve_device

    try:
        job = read_job(args.job)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plan = ModelPlan.from_json(job["plan"])
    device = resolve_device(plan.device)
    rank, world = ddp.init_from_env(device="cuda" if device.type == "cuda" else "cpu")
    try:
        if world != job["nproc"]:  # the stage's folder and its data shards are those of nproc processes
            raise SystemExit(f"{args.job} was written for {job['nproc']} processes, this launch has {world}: "
                             f"write it with --nproc {world}, or launch {job['nproc']} processes")
        out = train_rank(rank, world, job, False)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        result = Path(args.result or Path(job["out"]) / "torchrun-result.json")
        result.parent.mkdir(parents=True, exist_ok=True)
        tmp = result.with_name(result.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str), encoding="utf-8")
        tmp.replace(result)
        json.dump(out, sys.stdout, default=str)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
