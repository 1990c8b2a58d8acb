"""Pipeline tasks after training: the leaderboard (table + CIDEr-vs-size/latency plot) and promotion of the best
student to the registry's ``champion`` alias - only if it beats the current champion on the same test set."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from prefect import task

from captioning.data.karpathy import Dataset
from captioning.metrics.evaluation import most_frequent_caption
from tasks.common import RunContext, log
from tasks.data import RETRY
from tasks.refs import DatasetRef, Promotion, StudentFailure, StudentResult

COLUMNS = ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")


def _fmt(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def rank(results: list[StudentResult | StudentFailure]) -> tuple[list[StudentResult], list[StudentFailure]]:
    """Finished students best first (test CIDEr, then fewer parameters, then name), and the failed ones."""
    ok = [r for r in results if isinstance(r, StudentResult)]
    failed = [r for r in results if isinstance(r, StudentFailure)]
    return sorted(ok, key=lambda r: (-(r.metrics.get("CIDEr") or 0.0), r.params, r.student)), failed


def leaderboard_rows(ranked: list[StudentResult]) -> list[dict[str, Any]]:
    """The leaderboard's JSON rows (``leaderboard.json``, the run summary)."""
    return [{"student": r.student, "preset": r.preset, "metrics": r.metrics, "params": r.params,
             "latency_ms": r.latency_ms, "unique_fraction": r.unique_fraction,
             "distinct_captions": r.distinct_captions, "repeated_token_rate": r.repeated_token_rate, "run_id": r.run_id,
             "model_version": r.model_version} for r in ranked]


def markdown(rows: list[dict[str, Any]], failed: list[dict[str, Any]], baseline: dict[str, Any] | None = None
             ) -> str:
    """The one leaderboard table (MLflow ``leaderboard.md``, the Prefect run summary, ``capflow run``); with a
    ``baseline`` (:func:`baseline_of`) a last row for it and the best student's CIDEr as a multiple of it."""
    head = ("| rank | student | preset | " + " | ".join(COLUMNS)
            + " | params | latency ms | distinct captions | repeated words |")
    lines = [head, "|" + "---|" * (len(COLUMNS) + 7)]
    for i, r in enumerate(rows, 1):
        m = r["metrics"]
        lines.append(f"| {i} | {r['student']} | {r['preset']} | " + " | ".join(_fmt(m.get(c)) for c in COLUMNS)
                     + f" | {r['params']:,} | {r['latency_ms']:.1f} | {_fmt(r.get('distinct_captions'))} "
                     f"| {_fmt(r.get('repeated_token_rate'))} |")
    for f in failed:
        lines.append(f"| - | {f['student']} | FAILED: {f['error'][:80]} |")
    if baseline is not None:
        m = baseline["metrics"]
        lines.append("| - | baseline | most frequent training caption | "
                     + " | ".join("-" if c not in m else _fmt(m[c]) for c in COLUMNS) + " | - | - | 1 | - |")
        best, base = (rows[0]["metrics"].get("CIDEr") if rows else None), m.get("CIDEr")
        ratio = f"{best / base:.1f}x" if best is not None and base else "n/a"
        lines += ["", f"Baseline caption: \"{baseline['caption']}\"; best student's test CIDEr = {ratio} the "
                  "baseline's."]
    return "\n".join(lines) + "\n"


def baseline_of(data: DatasetRef) -> dict[str, Any]:
    """The most-frequent-training-caption baseline on the dataset's test split: {caption, metrics}."""
    ds = Dataset.load(data.path)
    refs = {e.image_id: list(e.captions) for e in ds.split("test")}
    caption, scored = most_frequent_caption((c for e in ds.split("train") for c in e.captions), refs)
    return {"caption": caption, "metrics": scored["metrics"]}


def decide_promotion(best: dict[str, Any] | None, current_version: str | None, current_tags: dict[str, str],
                     test_set: str) -> Promotion:
    """Whether the run's best student (a leaderboard row) takes the ``champion`` alias: only when there is no
    champion, the champion was scored on another test set, or the best beats it on this one (ties keep it)."""
    if best is None:
        return Promotion(changed=False, reason="no student finished", champion_version=current_version,
                         previous_version=current_version)
    cider = best["metrics"].get("CIDEr") or 0.0
    kw = {"candidate": best["student"], "candidate_version": best["model_version"], "candidate_cider": cider,
          "previous_version": current_version}
    if current_version is not None and current_version == best["model_version"]:
        return Promotion(changed=False, reason="already champion", champion_version=current_version, **kw)
    same_set = current_version is not None and current_tags.get("test_set") == test_set
    if same_set and float(current_tags.get("test_CIDEr") or 0.0) >= cider:
        return Promotion(changed=False, champion_version=current_version, **kw,
                         reason=f"current champion v{current_version} scores "
                                f"{float(current_tags['test_CIDEr']):.4f} >= {cider:.4f} on the same test set")
    reason = ("no champion yet" if current_version is None else "better than the current champion" if same_set
              else "current champion was scored on another test set")
    return Promotion(changed=True, reason=reason, champion_version=best["model_version"], **kw)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "params", "parameters"), (axes[1], "latency_ms", "latency, batch 1 (ms)")):
        for r in rows:
            ax.scatter(r[key], r["metrics"].get("CIDEr") or 0.0)
            ax.annotate(r["student"], (r[key], r["metrics"].get("CIDEr") or 0.0), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("CIDEr (test)")
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    fig.suptitle("capflow leaderboard")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def leaderboard(rc: RunContext, results: list[StudentResult | StudentFailure], data: DatasetRef | None = None
                ) -> dict[str, Any]:
    """Rank the students; table, plot and JSON into the parent run; with ``data``, the most-frequent-caption
    baseline on its test split beside them (``baseline``; parent-run metric ``baseline_test_CIDEr``)."""
    ranked, failures = rank(results)
    rows = leaderboard_rows(ranked)
    failed = [{"student": f.student, "error": f.error} for f in failures]
    baseline = baseline_of(data) if data is not None and data.splits.get("test") else None
    if baseline is not None:
        rc.tracker.metrics(rc.parent_run, {"baseline_test_CIDEr": baseline["metrics"].get("CIDEr") or 0.0})
    with tempfile.TemporaryDirectory() as tmp:
        md = Path(tmp) / "leaderboard.md"
        md.write_text(markdown(rows, failed, baseline), encoding="utf-8")
        rc.tracker.artifact(rc.parent_run, md)
        if rows:
            png = Path(tmp) / "leaderboard.png"
            plot(rows, png)
            rc.tracker.artifact(rc.parent_run, png)
    rc.tracker.json_artifact(rc.parent_run, "leaderboard.json", {"leaderboard": rows, "failed": failed,
                                                                 "baseline": baseline})
    for i, r in enumerate(rows):
        rc.tracker.metrics(rc.parent_run, {f"{r['student']}_test_CIDEr": r["metrics"].get("CIDEr") or 0.0})
        if i == 0:
            rc.tracker.tags(rc.parent_run, {"best_student": r["student"]})
    rc.tracker.metrics(rc.parent_run, {"students_failed": len(failed), "students_ok": len(rows)})
    return {"leaderboard": rows, "failed": failed, "baseline": baseline}


def promote(rc: RunContext, board: dict[str, Any], test_set: str) -> Promotion:
    """Give ``champion`` to the best student if it beats the current champion on the same test set."""
    rows = board["leaderboard"]
    cur_version, cur_tags = rc.tracker.champion() if rows else (None, {})
    decision = decide_promotion(rows[0] if rows else None, cur_version, cur_tags, test_set)
    if decision.changed:
        rc.tracker.set_champion(decision.champion_version)
    rc.tracker.tags(rc.parent_run, {"champion_version": decision.champion_version,
                                    "champion_changed": decision.changed})
    rc.tracker.json_artifact(rc.parent_run, "promotion.json", decision.to_record())
    log.info("promotion: %s", decision)
    return decision


leaderboard_task = task(leaderboard, name="leaderboard", **RETRY)
promote_task = task(promote, name="promote", **RETRY)
