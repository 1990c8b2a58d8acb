"""The scale bench's report arithmetic and rendering.

Per stage: the growth exponents of time and of the memory above the start between the two largest sizes
(``log(y2/y1) / log(N2/N1)``: 1 = linear, 2 = quadratic), and the extrapolation to MS-COCO (123,287 images) and to
Conceptual Captions' 3.3M (as images of the run's captions per image) along them; the result as markdown tables.
:func:`estimate`: the time a run will take, from reference rates measured on the project's machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from captioning.bench.scale.data import COCO_IMAGES

CC3M_PAIRS = 3_300_000  # Conceptual Captions: image-caption pairs
EXTRAPOLATE_TO = (COCO_IMAGES, CC3M_PAIRS)
MIN_FIT_SECONDS = 0.05  # below this at the largest size a time exponent is reported but flagged as noise
FLAT_MEMORY_MB = 64.0  # memory above the start below this at the largest size counts as flat

__all__ = ["CC3M_PAIRS", "EXTRAPOLATE_TO", "FLAT_MEMORY_MB", "MIN_FIT_SECONDS", "REFERENCE", "REFERENCE_BYTES",
           "estimate", "extrapolate", "fit_stage", "growth_exponent", "table"]


def growth_exponent(n1: float, y1: float, n2: float, y2: float) -> float | None:
    """b in y ~ N^b through two points (None when a value is not positive or the sizes are equal)."""
    if n1 <= 0 or n2 <= 0 or n1 == n2 or not (y1 > 0 and y2 > 0):
        return None
    return math.log(y2 / y1) / math.log(n2 / n1)


def extrapolate(n: float, y: float, exponent: float | None, target: float) -> float | None:
    """y at ``target`` along y ~ N^exponent through (n, y)."""
    if exponent is None or not y > 0:
        return None
    return y * (target / n) ** exponent


def fit_stage(rows: Sequence[Mapping[str, Any]], targets: Iterable[int] = EXTRAPOLATE_TO) -> dict[str, Any]:
    """Exponents and extrapolations of one stage's rows (one per size, measured ones only), from the two largest
    sizes: time, and memory above the process's start (floored at 1 MiB, so that flat memory reads ~0)."""
    rows = sorted((r for r in rows if "seconds" in r), key=lambda r: r["images"])
    if len(rows) < 2:
        return {"sizes": [r["images"] for r in rows], "time_exponent": None, "rss_exponent": None,
                "extrapolated": {}, "note": "fewer than two measured sizes: no fit"}
    a, b = rows[-2], rows[-1]
    te = growth_exponent(a["images"], a["seconds"], b["images"], b["seconds"])
    ce = growth_exponent(a["images"], a["cpu_seconds"], b["images"], b["cpu_seconds"]) if "cpu_seconds" in b else None
    wa, wb = max(a["work_rss_mb"], 1.0), max(b["work_rss_mb"], 1.0)
    me = growth_exponent(a["images"], wa, b["images"], wb)
    ext = {}
    for t in targets:
        sec = extrapolate(b["images"], b["seconds"], te, t)
        work = extrapolate(b["images"], wb, me, t) if wb > 1.0 else b["work_rss_mb"]
        ext[str(t)] = {"seconds": sec, "peak_rss_mb": None if work is None else b["start_rss_mb"] + work}
    flat = b["work_rss_mb"] <= FLAT_MEMORY_MB
    return {"sizes": [a["images"], b["images"]], "time_exponent": te, "cpu_exponent": ce, "rss_exponent": me,
            "time_noise": b["seconds"] < MIN_FIT_SECONDS, "memory_flat": flat,
            "work_rss_mb_per_1k_images": b["work_rss_mb"] / b["images"] * 1000, "extrapolated": ext}


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _mb(v: float | int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f}"


def table(result: Mapping[str, Any]) -> str:
    """The result as markdown: one line per stage and size, then one per stage with exponents and
    extrapolations."""
    quiet = bool(result.get("params", {}).get("quiet_check"))
    extra = (" others' cores |", "---:|", " |") if quiet else ("", "", "")
    lines = ["| stage | images | seconds | CPU s | peak RSS MiB | start RSS MiB | written MiB | output MiB |"
             + extra[0],
             "|---|---:|---:|---:|---:|---:|---:|---:|" + extra[1]]
    for r in result["rows"]:
        line = (f"| {r['stage']} | {r['images']:,} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | "
                f"{r['peak_rss_mb']:.0f} | {r['start_rss_mb']:.0f} | {_mb(r['write_bytes'])} | "
                f"{_mb(r['output_bytes'])} |")
        if quiet:
            line += f" {_fmt(r.get('others_cpu_per_s'))}{' (noisy)' if r.get('noisy') else ''} |"
        lines.append(line)
    for m in result.get("not_measured", []):
        lines.append(f"| {m['stage']} | {m['images']:,} | not measured: {m['reason']} | | | | | |" + extra[2])
    lines += ["", "| stage | time exponent | CPU exponent | memory exponent | s at 123k | peak MiB at 123k | "
              "s at 3.3M | peak MiB at 3.3M |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, f in result["stages"].items():
        e = f.get("extrapolated", {})
        c, m = e.get(str(COCO_IMAGES), {}), e.get(str(CC3M_PAIRS), {})
        te = _fmt(f["time_exponent"]) + (" (noise)" if f.get("time_noise") else "")
        me = _fmt(f["rss_exponent"]) + (" (flat)" if f.get("memory_flat") else "")
        lines.append(f"| {name} | {te} | {_fmt(f.get('cpu_exponent'))} | {me} | {_fmt(c.get('seconds'), '.1f')} | "
                     f"{_fmt(c.get('peak_rss_mb'), '.0f')} | {_fmt(m.get('seconds'), '.0f')} | "
                     f"{_fmt(m.get('peak_rss_mb'), '.0f')} |")
    return "\n".join(lines)


# measured on the project's 2-core machine (docs/benchmarks.md, "A CC3M dry run, stage by stage"), 1 caption per
# image, shards input, 64-d store, at 20,000 and 200,000 images (other work used 1.0-1.4 of its 2 cores meanwhile):
# wall seconds per 1,000 images at 200,000, grown linearly (the CPU-time exponents read 0.87-1.01)
REFERENCE: dict[str, dict[str, float]] = {
    "generate": {"s_per_1k": 0.494, "exponent": 1.0, "at": 200_000},
    "ingest": {"s_per_1k": 0.182, "exponent": 1.0, "at": 200_000},
    "vocab": {"s_per_1k": 0.0148, "exponent": 1.0, "at": 200_000},
    "cider": {"s_per_1k": 0.0135, "exponent": 1.0, "at": 200_000},
    "digests": {"s_per_1k": 0.0202, "exponent": 1.0, "at": 200_000},
}
REFERENCE_BYTES = {"shards": 2559, "store": 3347}  # per image at 200,000 (1 caption, 64-d float16 store)


def estimate(sizes: Sequence[int], stages: Sequence[str] | None, repeats: int = 1) -> dict[str, Any]:
    """Seconds a run will take (data generation + every stage with a reference rate, ``repeats`` times each),
    from :data:`REFERENCE` along its exponents, and the disk the largest size's data takes (shards + feature
    store, :data:`REFERENCE_BYTES`); stages without a reference are listed in ``unknown``."""
    per: dict[str, float] = {}
    stages = list(stages or ())
    unknown = [s for s in stages if s not in REFERENCE]
    for n in sizes:
        for name in ("generate", *stages):
            ref = REFERENCE.get(name)
            if ref is None:
                continue
            at = ref["s_per_1k"] * ref["at"] / 1000
            sec = at * (n / ref["at"]) ** ref["exponent"] * (1 if name == "generate" else repeats)
            per[name] = per.get(name, 0.0) + sec
    disk = max(sizes, default=0) * sum(REFERENCE_BYTES.values())
    return {"seconds": sum(per.values()), "per_stage": per, "unknown": unknown, "disk_bytes": disk}
