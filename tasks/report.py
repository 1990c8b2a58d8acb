"""Pipeline tasks after training: the leaderboard (table + CIDEr-vs-size/latency plot) and promotion of the best
student to the registry's ``champion`` alias - only if it beats the current champion on the same test set."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from prefect import task

from tasks.common import RunContext, log
from tasks.data import RETRY

COLUMNS = ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")


def _fmt(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def leaderboard_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ok = [r for r in results if "error" not in r]
    rows = [{"student": r["student"], "preset": r["preset"], "metrics": r["metrics"], "params": r["params"],
             "latency_ms": r["latency_ms"], "run_id": r["run_id"], "model_version": r.get("model_version")}
            for r in ok]
    return sorted(rows, key=lambda r: -(r["metrics"].get("CIDEr") or 0.0))


def markdown(rows: list[dict[str, Any]], failed: list[dict[str, Any]]) -> str:
    head = "| rank | student | preset | " + " | ".join(COLUMNS) + " | params | latency ms |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 5)]
    for i, r in enumerate(rows, 1):
        m = r["metrics"]
        lines.append(f"| {i} | {r['student']} | {r['preset']} | " + " | ".join(_fmt(m.get(c)) for c in COLUMNS)
                     + f" | {r['params']:,} | {r['latency_ms']:.1f} |")
    for f in failed:
        lines.append(f"| - | {f['student']} | FAILED: {f['error'][:80]} |")
    return "\n".join(lines) + "\n"


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


@task(name="leaderboard", **RETRY)
def leaderboard_task(rc: RunContext, results: list[dict[str, Any]]) -> dict[str, Any]:
    rows = leaderboard_rows(results)
    failed = [{"student": r["student"], "error": r["error"]} for r in results if "error" in r]
    with tempfile.TemporaryDirectory() as tmp:
        md = Path(tmp) / "leaderboard.md"
        md.write_text(markdown(rows, failed), encoding="utf-8")
        rc.tracker.artifact(rc.parent_run, md)
        if rows:
            png = Path(tmp) / "leaderboard.png"
            plot(rows, png)
            rc.tracker.artifact(rc.parent_run, png)
    rc.tracker.json_artifact(rc.parent_run, "leaderboard.json", {"leaderboard": rows, "failed": failed})
    for i, r in enumerate(rows):
        rc.tracker.metrics(rc.parent_run, {f"{r['student']}_test_CIDEr": r["metrics"].get("CIDEr") or 0.0})
        if i == 0:
            rc.tracker.tags(rc.parent_run, {"best_student": r["student"]})
    rc.tracker.metrics(rc.parent_run, {"students_failed": len(failed), "students_ok": len(rows)})
    return {"leaderboard": rows, "failed": failed}


@task(name="promote", **RETRY)
def promote_task(rc: RunContext, board: dict[str, Any], test_set: str) -> dict[str, Any]:
    """Give ``champion`` to the best student if it beats the current champion on the same test set."""
    rows = board["leaderboard"]
    if not rows:
        return {"champion": None, "changed": False, "reason": "no student finished"}
    best = rows[0]
    cider = best["metrics"].get("CIDEr") or 0.0
    cur_version, cur_tags = rc.tracker.champion()
    decision: dict[str, Any] = {"candidate": best["student"], "candidate_version": best["model_version"],
                                "candidate_CIDEr": cider, "previous_version": cur_version}
    if cur_version == best["model_version"]:
        decision.update(changed=False, reason="already champion")
    elif cur_version is not None and cur_tags.get("test_set") == test_set and \
            float(cur_tags.get("test_CIDEr") or 0.0) >= cider:
        decision.update(changed=False, reason=f"current champion v{cur_version} scores "
                        f"{float(cur_tags['test_CIDEr']):.4f} >= {cider:.4f} on the same test set")
    else:
        rc.tracker.set_champion(best["model_version"])
        decision.update(changed=True, reason="no champion yet" if cur_version is None else
                        "better than the current champion" if cur_tags.get("test_set") == test_set else
                        "current champion was scored on another test set")
    champion_version = best["model_version"] if decision["changed"] else cur_version
    decision["champion_version"] = champion_version
    rc.tracker.tags(rc.parent_run, {"champion_version": champion_version, "champion_changed": decision["changed"]})
    rc.tracker.json_artifact(rc.parent_run, "promotion.json", decision)
    log.info("promotion: %s", decision)
    return decision
