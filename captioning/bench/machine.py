"""What every ``capflow bench`` result states about the machine it ran on (machines of one kind differ: compare
figures only within one run, or across runs of the same machine)."""

from __future__ import annotations

import os
import platform
import resource


def machine_info(**extra: object) -> dict:
    """Python, OS, CPU model and counts, numpy/torch versions, torch threads and the CPU capability torch's kernels
    were picked for (AVX2, AVX512, ...: CPU float results reproduce to the bit only at the same capability and
    threads); ``extra`` entries appended (e.g. ``device=...``)."""
    import numpy as np
    import torch

    from captioning.util import usable_cpus

    usable = usable_cpus()
    return {"python": platform.python_version(), "platform": platform.platform(),
            "processor": _cpu_model() or platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "cpus_usable": usable, "numpy": np.__version__, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), **extra}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, in MiB. ``VmHWM`` belongs to the
    process's own address space; ``getrusage``'s ``ru_maxrss`` would also count the parent's peak before exec."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if field == "VmHWM" else float("nan")
