"""The compact-captioner trade-off report: every trained model's test CIDEr against its parameter count and against
its measured greedy latency (the Pareto front marked), the learning curves of every family, and a page of sample
test images with each model's caption - as PNG figures and one self-contained HTML page (figures and images
inlined), what none of the papers' code draws across families.

Pure rendering from recorded figures (:class:`ModelPoint`): the pipeline's report step and ``capflow report`` feed
it from the leaderboard and the students' stage records; nothing here trains or scores.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from captioning.util import atomic_write


@dataclass(frozen=True)
class ModelPoint:
    """One trained model's figures: test CIDEr, parameters, latency (ms, batch 1, beam search as evaluated), its
    per-epoch validation CIDEr (``curves``: ``xe`` / ``scst`` -> values) and its test captions (image id ->
    caption)."""

    name: str
    preset: str
    cider: float
    params: int
    latency_ms: float
    curves: Mapping[str, Sequence[float]] = field(default_factory=dict)
    captions: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    """A test image shown with every model's caption and its references."""

    image_id: int
    path: str
    references: Sequence[str] = ()


def pareto(points: Sequence[ModelPoint], cost: str) -> list[str]:
    """The models no other beats on CIDEr at a lower or equal ``cost`` (``params`` | ``latency_ms``), cheapest
    first."""
    front, best = [], float("-inf")
    for p in sorted(points, key=lambda q: (getattr(q, cost), -q.cider, q.name)):
        if p.cider > best:
            front.append(p.name)
            best = p.cider
    return front


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def figures(points: Sequence[ModelPoint]) -> dict[str, bytes]:
    """``tradeoff.png`` (CIDEr vs parameters and vs latency, fronts marked) and ``curves.png`` (validation CIDEr per
    epoch, XE then SCST, one line per model) as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, cost, label in ((axes[0], "params", "parameters"), (axes[1], "latency_ms", "greedy latency, batch 1 (ms)")):
        front = pareto(points, cost)
        for p in points:
            on = p.name in front
            ax.scatter(getattr(p, cost), p.cider, s=60 if on else 30, marker="o" if on else "x",
                       color="tab:red" if on else "tab:blue")
            ax.annotate(p.name, (getattr(p, cost), p.cider), fontsize=8, xytext=(4, 3), textcoords="offset points")
        line = sorted((getattr(p, cost), p.cider) for p in points if p.name in front)
        if len(line) > 1:
            ax.plot(*zip(*line, strict=True), color="tab:red", linewidth=1, label="Pareto front")
            ax.legend(fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("test CIDEr")
        ax.grid(alpha=0.3)
    sizes = [p.params for p in points]
    if sizes and min(sizes) > 0 and max(sizes) / min(sizes) > 20:  # a log axis only where sizes span decades
        axes[0].set_xscale("log")
    fig.suptitle("compact captioners: quality against size and speed")
    fig.tight_layout()
    out["tradeoff.png"] = _png(fig)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for p in points:
        xe, scst = list(p.curves.get("xe") or []), list(p.curves.get("scst") or [])
        if xe or scst:
            ax.plot(range(1, len(xe) + len(scst) + 1), xe + scst, marker=".", label=p.name)
            if xe and scst:
                ax.axvline(len(xe) + 0.5, color="grey", linewidth=0.5)
    ax.set_xlabel("epoch (XE, then SCST)")
    ax.set_ylabel("validation CIDEr")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out["curves.png"] = _png(fig)
    plt.close(fig)
    return out


def _img(data: bytes, mime: str, alt: str, width: int | None = None) -> str:
    size = f' width="{width}"' if width else ""
    return f'<img alt="{html.escape(alt)}"{size} src="data:{mime};base64,{base64.b64encode(data).decode()}">'


def page(points: Sequence[ModelPoint], samples: Sequence[Sample], figs: Mapping[str, bytes], title: str) -> str:
    """The self-contained HTML page: the figures, the table of the plotted numbers (also as JSON in
    ``<script id="figures">``), the samples with each model's caption."""
    fronts = {c: pareto(points, c) for c in ("params", "latency_ms")}
    rows = "".join(
        f"<tr><td>{html.escape(p.name)}</td><td>{html.escape(p.preset)}</td><td>{p.cider:.4f}</td>"
        f"<td>{p.params:,}</td><td>{p.latency_ms:.2f}</td>"
        f"<td>{'yes' if p.name in fronts['params'] else ''}</td><td>{'yes' if p.name in fronts['latency_ms'] else ''}"
        "</td></tr>" for p in sorted(points, key=lambda q: -q.cider))
    cells = []
    for s in samples:
        path = Path(s.path)
        mime = "image/png" if path.suffix.lower() == ".png" else "image/jpeg"
        caps = "".join(f"<li><b>{html.escape(p.name)}</b>: {html.escape(p.captions.get(s.image_id, '-'))}</li>"
                       for p in points)
        refs = "".join(f"<li>{html.escape(r)}</li>" for r in s.references[:3])
        cells.append(f'<div class="sample">{_img(path.read_bytes(), mime, f"image {s.image_id}", 280)}'
                     f"<p>image {s.image_id}</p><ul>{caps}</ul><p>references</p><ul class=ref>{refs}</ul></div>")
    data = json.dumps({"models": [asdict(p) | {"captions": None} for p in points], "pareto": fronts},
                      default=float)
    figs_html = "".join(f"<figure>{_img(b, 'image/png', name)}<figcaption>{name}</figcaption></figure>"
                        for name, b in figs.items())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:3px 8px;text-align:right}.sample{display:inline-block;vertical-align:top;width:300px;margin:6px}"
            ".ref{color:#666}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{figs_html}<h2>The plotted numbers</h2><table><tr><th>model</th>"
            "<th>preset</th><th>test CIDEr</th><th>params</th><th>latency ms</th><th>front (size)</th>"
            f"<th>front (speed)</th></tr>{rows}</table><h2>Sample test images</h2>{''.join(cells)}"
            f'<script id="figures" type="application/json">{html.escape(data, quote=False)}</script></body></html>')


def write(points: Sequence[ModelPoint], samples: Sequence[Sample], out: str | Path,
          title: str = "capflow: compact captioners compared") -> list[Path]:
    """The report into folder ``out``: ``tradeoff.png``, ``curves.png``, ``report.html`` (each replaced whole)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    figs = figures(points)
    written = []
    for name, data in {**figs, "report.html": page(points, samples, figs, title).encode("utf-8")}.items():
        written.append(atomic_write(folder / name, lambda f, d=data: f.write(d), name))
    return written
