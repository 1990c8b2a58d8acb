"""Pipeline tasks after training: the leaderboard (table + CIDEr-vs-size/latency plot) and promotion of the best
student to the registry's ``champion`` alias - only if it beats the current champion on the same test set (a
champion scored on another test set is re-scored on this run's first)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task

from captioning.config import FeaturesConfig
from captioning.data.karpathy import Dataset
from captioning.metrics.evaluation import most_frequent_caption
from tasks.common import RunContext, log
from tasks.data import RETRY
from tasks.refs import DatasetRef, FeaturesRef, LabelsRef, Promotion, StudentFailure, StudentResult

COLUMNS = ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")


def scored_files(rc: RunContext, results: str, references: str, scores: Mapping[str, Any]) -> None:
    """``capflow evaluate``'s run: what was scored against what (both files as datasets by their digests), the
    scores, and the whole report (``metrics.json``); nothing without tracking."""
    from captioning.util import sha256_file

    with rc.tracker.run("evaluate", rc.parent_run) as run:
        rc.tracker.params(run, {"results": results, "references": references})
        rc.tracker.dataset(run, "results", sha256_file(results), results, "input")
        rc.tracker.dataset(run, "references", sha256_file(references), references, "evaluation")
        rc.tracker.metrics(run, {**scores["metrics"], "images": scores["images"],
                                 "unscored_references": scores.get("unscored_references") or 0},
                           dataset=("references", sha256_file(references)))
        rc.tracker.json_artifact(run, "metrics.json", dict(scores))


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
                     test_set: str, rescored: Mapping[str, Any] | None = None) -> Promotion:
    """Whether the run's best student (a leaderboard row) takes the ``champion`` alias: only when there is no
    champion or the best beats it on this run's test set (ties keep it). A champion scored on another test set is
    compared by ``rescored``, its score on this one (:func:`rescore_champion`: ``{"CIDEr", "how"}``); when it
    could not be re-scored (``{"error": why}``, or None) the best takes the alias and the reason says why it was
    not compared."""
    if best is None:
        return Promotion(changed=False, reason="no student finished", champion_version=current_version,
                         previous_version=current_version)
    cider = best["metrics"].get("CIDEr") or 0.0
    kw = {"candidate": best["student"], "candidate_version": best["model_version"], "candidate_cider": cider,
          "previous_version": current_version}
    if current_version is not None and current_version == best["model_version"]:
        return Promotion(changed=False, reason="already champion", champion_version=current_version, **kw)
    if current_version is None:
        return Promotion(changed=True, reason="no champion yet", champion_version=best["model_version"], **kw)
    cur = f"v{current_version}"
    if current_tags.get("test_set") == test_set:
        champ = float(current_tags.get("test_CIDEr") or 0.0)
        kw["champion_cider"] = champ
        if champ >= cider:
            return Promotion(changed=False, champion_version=current_version, **kw,
                             reason=f"current champion {cur} scores {champ:.4f} >= {cider:.4f} on the same test set")
        return Promotion(changed=True, reason="better than the current champion",
                         champion_version=best["model_version"], **kw)
    if rescored is None or rescored.get("CIDEr") is None:
        why = (rescored or {}).get("error") or "not re-scored"
        return Promotion(changed=True, champion_version=best["model_version"], **kw,
                         reason=f"current champion {cur} was scored on another test set and could not be scored on "
                                f"this one ({why}): promoted without a comparison")
    champ, how = float(rescored["CIDEr"]), str(rescored.get("how") or "re-scored")
    kw.update(champion_cider=champ, rescored=how)
    if champ >= cider:
        return Promotion(changed=False, champion_version=current_version, **kw,
                         reason=f"current champion {cur}, scored on another test set, re-scored on this one ({how}): "
                                f"{champ:.4f} >= {cider:.4f}")
    return Promotion(changed=True, champion_version=best["model_version"], **kw,
                     reason=f"better than the current champion {cur} re-scored on this test set ({how}): "
                            f"{cider:.4f} > {champ:.4f}")


def same_features(a: FeaturesConfig, b: FeaturesConfig) -> bool:
    """Whether a model trained on features of settings ``a`` sees exactly the features of a store of settings
    ``b``: the same source and, for the detector, the same store key (extractor settings and weights identity)."""
    if a.source != b.source:
        return False
    if a.source == "detector":
        from captioning.features.parallel import store_key

        try:
            return store_key(a) == store_key(b)
        except OSError:  # weights without a recorded sha256 that cannot be read here
            return False
    keys = ("min_boxes", "max_boxes", "feature_dim", "dtype")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def rescore_champion(rc: RunContext, version: str, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef
                     ) -> dict[str, Any]:
    """The registered ``version``'s test metrics on this run's test split by this run's evaluation (beam, words,
    decoding constraint, references): decoded from this run's feature store when the model's feature settings
    give the same features (:func:`same_features`), else from its own extraction of the test images (a detector
    model; ``capflow caption``'s path). Returns ``{"CIDEr", "metrics", "images", "how"}``, or ``{"error"}`` when
    neither is possible (the model cannot be used, or needs images this dataset does not have). Failures to
    reach the registry or the store raise (the task's retry, then the run fails): they never promote unchecked."""
    from captioning.data.text import Vocabulary
    from captioning.inference import CaptionerError, ImageCaptioner, model_files, read_meta
    from captioning.metrics.coco import score
    from captioning.metrics.evaluation import predict
    from captioning.training.loop import load_model
    from captioning.training.recipe import codec_for, max_tokens, stage_plan
    from captioning.training.stages import StageContext
    from tasks.model_refs import resolve_model

    cfg = rc.cfg
    folder = resolve_model(f"models:/{cfg.tracking.model_name}/{version}", rc.tracker.uri)
    try:
        files = model_files(folder)
        _, features = read_meta(files.meta)
    except CaptionerError as e:
        return {"error": f"its model folder cannot be used: {e}"}
    ds = Dataset.load(data.path)
    ctx = StageContext.from_paths(stage_plan(cfg), labels.vocab_path, labels.labels_uri, feats.uri, ds,
                                  progress=rc.progress)
    refs = ctx.text_references("test")
    constraint = cfg.evaluation.decoding_constraint
    if same_features(features, cfg.features):
        model, st = load_model(files.model, device=ctx.device)
        vocab = Vocabulary.load(files.vocab)
        if st.get("vocab_digest") and st["vocab_digest"] != vocab.digest():
            return {"error": f"{files.vocab} is not the vocabulary its model.pt was trained with"}
        preds = predict(model, ctx.source, ctx.rows("test"), vocab, codec=codec_for(model, vocab),
                        max_tokens=max_tokens(model, cfg.dataset.max_words, vocab.radix()),
                        beam=cfg.evaluation.beam, device=ctx.device, precision=ctx.precision,
                        decoding_constraint=constraint)
        how = "decoded from this run's feature store"
    elif features.source == "detector" and ds.images_root is not None:
        if constraint:
            return {"error": "its features differ from this run's and evaluation.decoding_constraint is on, which "
                             "captioning from images does not apply"}
        try:
            cap = ImageCaptioner(folder, device=cfg.run.device, beam=cfg.evaluation.beam, progress=rc.progress)
        except CaptionerError as e:
            return {"error": f"it cannot caption images: {e}"}
        cap.max_tokens = max_tokens(cap.model, cfg.dataset.max_words, cap.vocab.radix())
        entries = ds.split("test")
        res = cap.caption([ds.image_path(e) for e in entries])
        got = {c["file"]: c["caption"] for c in res.captions}
        preds = {e.image_id: got[str(ds.image_path(e))] for e in entries if str(ds.image_path(e)) in got}
        how = (f"its own feature settings differ from this run's: extracted from the {len(entries)} test images "
               f"({len(res.rejected)} rejected)")
    else:
        return {"error": f"it was trained on features.source={features.source} features other than this run's, "
                         "and there are no images to extract its own from"}
    if not preds:
        return {"error": "none of this run's test images could be captioned by it"}
    scored = score(preds, refs, spice_jars=cfg.evaluation.spice_jars)
    return {"CIDEr": scored["metrics"].get("CIDEr"), "metrics": scored["metrics"], "images": scored["images"],
            "how": how}


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


def promote(rc: RunContext, board: dict[str, Any], test_set: str, data: DatasetRef | None = None,
            feats: FeaturesRef | None = None, labels: LabelsRef | None = None) -> Promotion:
    """Give ``champion`` to the best student if it beats the current champion on this run's test set; a champion
    scored on another test set is first re-scored on this one (:func:`rescore_champion`, with the run's
    ``data``, ``feats`` and ``labels``)."""
    rows = board["leaderboard"]
    cur_version, cur_tags = rc.tracker.champion() if rows else (None, {})
    best_version = rows[0]["model_version"] if rows else None
    if best_version is not None and not rc.tracker.has_version(best_version):
        decision = Promotion(
            changed=False, champion_version=cur_version, previous_version=cur_version, candidate=rows[0]["student"],
            candidate_version=best_version, candidate_cider=rows[0]["metrics"].get("CIDEr"),
            reason=f"the best student's version v{best_version} is not registered in this tracking store "
                   f"({rc.tracker.uri}): its result was cached from a run store that another tracking store recorded "
                   "(runs sharing a run.store should share a tracking server)")
        log.warning("promotion: %s", decision.reason)
        rc.tracker.json_artifact(rc.parent_run, "promotion.json", decision.to_record())
        return decision
    rescored = None
    if (rows and cur_version is not None and cur_version != rows[0]["model_version"]
            and cur_tags.get("test_set") != test_set):
        if data is None or feats is None or labels is None:
            rescored = {"error": "this run's test set was not given to the promotion"}
        else:
            rescored = rescore_champion(rc, cur_version, data, feats, labels)
            if rescored.get("CIDEr") is not None:  # the champion's metrics on this run's test set, for comparison
                rc.tracker.metrics(rc.parent_run, rescored["metrics"], prefix="champion_rescored_test_")
    decision = decide_promotion(rows[0] if rows else None, cur_version, cur_tags, test_set, rescored)
    if decision.changed:
        rc.tracker.set_champion(decision.champion_version)
    rc.tracker.tags(rc.parent_run, {"champion_version": decision.champion_version,
                                    "champion_changed": decision.changed})
    rc.tracker.json_artifact(rc.parent_run, "promotion.json", decision.to_record())
    log.info("promotion: %s", decision)
    return decision


leaderboard_task = task(leaderboard, name="leaderboard", **RETRY)
promote_task = task(promote, name="promote", **RETRY)
