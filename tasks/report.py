"""Pipeline tasks after training: the leaderboard (table + CIDEr-vs-size/latency plot) and promotion of the best
student to the registry's ``champion`` alias - only if it beats the current champion on the same test set (a
champion scored on another test set is re-scored on this run's first)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioning.config import FeaturesConfig
from captioning.data.karpathy import open_dataset
from captioning.data.stores import LabelStore
from captioning.errors import CapflowError
from captioning.metrics.evaluation import most_frequent_caption
from tasks.common import RunContext, log
from tasks.refs import (
    Baseline,
    DatasetRef,
    FeaturesRef,
    LabelsRef,
    Leaderboard,
    Promotion,
    Row,
    StudentFailure,
    StudentResult,
)

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


def markdown(board: Leaderboard) -> str:
    """The one leaderboard table (MLflow ``leaderboard.md``, the Prefect run summary, ``capflow run``); with a
    baseline a last row for it and the best student's CIDEr as a multiple of it."""
    head = ("| rank | student | preset | " + " | ".join(COLUMNS)
            + " | params | latency ms | distinct captions | repeated words |")
    lines = [head, "|" + "---|" * (len(COLUMNS) + 7)]
    for i, r in enumerate(board.rows, 1):
        lines.append(f"| {i} | {r.student} | {r.preset} | " + " | ".join(_fmt(r.metrics.get(c)) for c in COLUMNS)
                     + f" | {r.params:,} | {r.latency_ms:.1f} | {_fmt(r.distinct_captions)} "
                     f"| {_fmt(r.repeated_token_rate)} |")
    for f in board.failed:
        lines.append(f"| - | {f.student} | FAILED: {f.error[:80]} |")
    if board.baseline is not None:
        m = board.baseline.metrics
        lines.append("| - | baseline | most frequent training caption | "
                     + " | ".join("-" if c not in m else _fmt(m[c]) for c in COLUMNS) + " | - | - | 1 | - |")
        best, base = (board.best.metrics.get("CIDEr") if board.best else None), m.get("CIDEr")
        ratio = f"{best / base:.1f}x" if best is not None and base else "n/a"
        lines += ["", f"Baseline caption: \"{board.baseline.caption}\"; best student's test CIDEr = {ratio} the "
                  "baseline's."]
    return "\n".join(lines) + "\n"


def baseline_of(data: DatasetRef) -> Baseline:
    """The most-frequent-training-caption baseline on the dataset's test split."""
    ds = open_dataset(data.path)  # streamed
    refs = {e.image_id: list(e.captions) for e in ds.iter_entries("test")}
    caption, scored = most_frequent_caption((c for e in ds.iter_entries("train") for c in e.captions), refs)
    return Baseline(caption=caption, metrics=scored["metrics"])


@dataclass(frozen=True)
class Rescore:
    """A champion scored on another test set, scored on this run's: its metrics and how it was done."""
    metrics: dict[str, float | None]
    images: int
    how: str

    @property
    def cider(self) -> float | None:
        return self.metrics.get("CIDEr")


class CannotRescore(CapflowError):
    """The champion cannot be scored on this run's test set (its model cannot be used, or needs images or
    features this run does not have): it is compared by nothing, and the reason goes into the decision."""


def decide_promotion(best: Row | None, current_version: str | None, current_tags: dict[str, str],
                     test_set: str, rescored: Rescore | None = None, unscored: str | None = None) -> Promotion:
    """Whether the run's best student takes the ``champion`` alias: only when there is no champion or the best
    beats it on this run's test set (ties keep it). A champion scored on another test set is compared by
    ``rescored``, its score on this one (:func:`rescore_champion`); when it could not be re-scored (``unscored``:
    why) the best takes the alias and the reason says why it was not compared."""
    if best is None:
        return Promotion(changed=False, reason="no student finished", champion_version=current_version,
                         previous_version=current_version)
    cider = best.cider
    kw = {"candidate": best.student, "candidate_version": best.model_version, "candidate_cider": cider,
          "previous_version": current_version}
    if current_version is not None and current_version == best.model_version:
        return Promotion(changed=False, reason="already champion", champion_version=current_version, **kw)
    if current_version is None:
        return Promotion(changed=True, reason="no champion yet", champion_version=best.model_version, **kw)
    cur = f"v{current_version}"
    if current_tags.get("test_set") == test_set:
        champ = float(current_tags.get("test_CIDEr") or 0.0)
        kw["champion_cider"] = champ
        if champ >= cider:
            return Promotion(changed=False, champion_version=current_version, **kw,
                             reason=f"current champion {cur} scores {champ:.4f} >= {cider:.4f} on the same test set")
        return Promotion(changed=True, reason="better than the current champion",
                         champion_version=best.model_version, **kw)
    if rescored is None or rescored.cider is None:
        why = unscored or "not re-scored"
        return Promotion(changed=True, champion_version=best.model_version, **kw,
                         reason=f"current champion {cur} was scored on another test set and could not be scored on "
                                f"this one ({why}): promoted without a comparison")
    champ, how = float(rescored.cider), rescored.how or "re-scored"
    kw.update(champion_cider=champ, rescored=how)
    if champ >= cider:
        return Promotion(changed=False, champion_version=current_version, **kw,
                         reason=f"current champion {cur}, scored on another test set, re-scored on this one ({how}): "
                                f"{champ:.4f} >= {cider:.4f}")
    return Promotion(changed=True, champion_version=best.model_version, **kw,
                     reason=f"better than the current champion {cur} re-scored on this test set ({how}): "
                            f"{cider:.4f} > {champ:.4f}")


def same_features(a: FeaturesConfig, b: FeaturesConfig) -> bool:
    """Whether a model trained on features of settings ``a`` sees exactly the features of a store of settings
    ``b``: the same source and, for the detector, the same store key (extractor settings and weights identity)."""
    if a.source != b.source:
        return False
    if a.source == "detector":
        from captioning.features.naming import store_key

        try:
            return store_key(a) == store_key(b)
        except OSError:  # weights without a recorded sha256 that cannot be read here
            return False
    keys = ("min_boxes", "max_boxes", "feature_dim", "dtype")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def rescore_champion(rc: RunContext, version: str, data: DatasetRef, feats: FeaturesRef, labels: LabelsRef
                     ) -> Rescore:
    """The registered ``version``'s test metrics on this run's test split by this run's evaluation (beam, words,
    decoding constraint, references): decoded from this run's feature store when the model's feature settings
    give the same features (:func:`same_features`), else from its own extraction of the test images (a detector
    model; ``capflow caption``'s path). Raises :class:`CannotRescore` when neither is possible (the model cannot be
    used, or needs images this dataset does not have). Failures to reach the registry or the store raise (the
    task's retry, then the run fails): they never promote unchecked."""
    from captioning.data.loader import ZarrFeatures
    from captioning.data.text import Vocabulary
    from captioning.inference import CaptionerError, ImageCaptioner, model_files, read_meta
    from captioning.metrics.coco import score
    from captioning.metrics.evaluation import predict
    from captioning.training.loop import load_model
    from captioning.training.recipe import codec_for, max_tokens, split_rows
    from captioning.util import resolve_device
    from tasks.model_refs import resolve_model

    cfg = rc.cfg
    folder = resolve_model(f"models:/{cfg.tracking.model_name}/{version}", rc.tracker.uri)
    try:
        files = model_files(folder)
        _, features = read_meta(files.meta)
    except CaptionerError as e:
        raise CannotRescore(f"its model folder cannot be used: {e}") from None
    ds = open_dataset(data.path)
    refs = {e.image_id: list(e.captions) for e in ds.iter_entries("test")}
    constraint = cfg.evaluation.decoding_constraint
    if same_features(features, cfg.features):
        device = resolve_device(cfg.run.device)
        model, st = load_model(files.model, device=device)
        vocab = Vocabulary.load(files.vocab)
        if st.get("vocab_digest") and st["vocab_digest"] != vocab.digest():
            raise CannotRescore(f"{files.vocab} is not the vocabulary its model.pt was trained with")
        source = ZarrFeatures(feats.uri)
        rows = split_rows(LabelStore.open(labels.labels_uri).read(), "test", source.ok_rows())
        preds = predict(model, source, rows, vocab, codec=codec_for(model, vocab),
                        max_tokens=max_tokens(model, cfg.dataset.max_words, vocab.radix()),
                        beam=cfg.evaluation.beam, device=device, precision=cfg.run.precision,
                        decoding_constraint=constraint)
        how = "decoded from this run's feature store"
    elif features.source == "detector" and ds.images_root is not None:
        if constraint:
            raise CannotRescore("its features differ from this run's and evaluation.decoding_constraint is on, "
                                "which captioning from images does not apply")
        try:
            cap = ImageCaptioner(folder, device=cfg.run.device, beam=cfg.evaluation.beam, progress=rc.progress)
        except CaptionerError as e:
            raise CannotRescore(f"it cannot caption images: {e}") from None
        cap.max_tokens = max_tokens(cap.model, cfg.dataset.max_words, cap.vocab.radix())
        entries = list(ds.iter_entries("test"))
        res = cap.caption([ds.image_path(e) for e in entries])
        got = {c["file"]: c["caption"] for c in res.captions}
        preds = {e.image_id: got[str(ds.image_path(e))] for e in entries if str(ds.image_path(e)) in got}
        how = (f"its own feature settings differ from this run's: extracted from the {len(entries)} test images "
               f"({len(res.rejected)} rejected)")
    else:
        raise CannotRescore(f"it was trained on features.source={features.source} features other than this run's, "
                            "and there are no images to extract its own from")
    if not preds:
        raise CannotRescore("none of this run's test images could be captioned by it")
    scored = score(preds, refs, spice_jars=cfg.evaluation.spice_jars)
    return Rescore(metrics=scored["metrics"], images=scored["images"], how=how)


def plot(rows: tuple[Row, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "params", "parameters"), (axes[1], "latency_ms", "latency, batch 1 (ms)")):
        for r in rows:
            ax.scatter(getattr(r, key), r.cider)
            ax.annotate(r.student, (getattr(r, key), r.cider), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("CIDEr (test)")
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    fig.suptitle("capflow leaderboard")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def leaderboard(rc: RunContext, results: list[StudentResult | StudentFailure], data: DatasetRef | None = None
                ) -> Leaderboard:
    """Rank the students; table, plot and JSON into the parent run; with ``data``, the most-frequent-caption
    baseline on its test split beside them (parent-run metric ``baseline_test_CIDEr``)."""
    ranked, failures = rank(results)
    baseline = baseline_of(data) if data is not None and data.splits.get("test") else None
    board = Leaderboard(rows=tuple(Row.of(r) for r in ranked), failed=tuple(failures), baseline=baseline)
    if baseline is not None:
        rc.tracker.metrics(rc.parent_run, {"baseline_test_CIDEr": baseline.metrics.get("CIDEr") or 0.0})
    with tempfile.TemporaryDirectory() as tmp:
        md = Path(tmp) / "leaderboard.md"
        md.write_text(markdown(board), encoding="utf-8")
        rc.tracker.artifact(rc.parent_run, md)
        if board.rows:
            png = Path(tmp) / "leaderboard.png"
            plot(board.rows, png)
            rc.tracker.artifact(rc.parent_run, png)
    rc.tracker.json_artifact(rc.parent_run, "leaderboard.json", board.to_record())
    for i, r in enumerate(board.rows):
        rc.tracker.metrics(rc.parent_run, {f"{r.student}_test_CIDEr": r.cider})
        if i == 0:
            rc.tracker.tags(rc.parent_run, {"best_student": r.student})
    rc.tracker.metrics(rc.parent_run, {"students_failed": len(board.failed), "students_ok": len(board.rows)})
    if board.rows:  # the trade-off report: kept in the workdir and logged beside the table
        folder = rc.workdir.root / "report" / (rc.parent_run or "local")
        tradeoff_report(results, data, folder)
        rc.tracker.artifact(rc.parent_run, folder, "report")
    return board


def promote(rc: RunContext, board: Leaderboard, test_set: str, data: DatasetRef | None = None,
            feats: FeaturesRef | None = None, labels: LabelsRef | None = None) -> Promotion:
    """Give ``champion`` to the best student if it beats the current champion on this run's test set; a champion
    scored on another test set is first re-scored on this one (:func:`rescore_champion`, with the run's
    ``data``, ``feats`` and ``labels``)."""
    best = board.best
    cur_version, cur_tags = rc.tracker.champion() if best is not None else (None, {})
    if best is not None and best.model_version is not None and not rc.tracker.has_version(best.model_version):
        decision = Promotion(
            changed=False, champion_version=cur_version, previous_version=cur_version, candidate=best.student,
            candidate_version=best.model_version, candidate_cider=best.metrics.get("CIDEr"),
            reason=f"the best student's version v{best.model_version} is not registered in this tracking store "
                   f"({rc.tracker.uri}): its result was cached from a run store that another tracking store recorded "
                   "(runs sharing a run.store should share a tracking server)")
        log.warning("promotion: %s", decision.reason)
        rc.tracker.json_artifact(rc.parent_run, "promotion.json", decision.to_record())
        return decision
    rescored, unscored = None, None
    if (best is not None and cur_version is not None and cur_version != best.model_version
            and cur_tags.get("test_set") != test_set):
        if data is None or feats is None or labels is None:
            unscored = "this run's test set was not given to the promotion"
        else:
            try:
                rescored = rescore_champion(rc, cur_version, data, feats, labels)
            except CannotRescore as e:
                unscored = str(e)
            if rescored is not None and rescored.cider is not None:  # its metrics on this run's test set
                rc.tracker.metrics(rc.parent_run, rescored.metrics, prefix="champion_rescored_test_")
    decision = decide_promotion(best, cur_version, cur_tags, test_set, rescored, unscored)
    if decision.changed:
        rc.tracker.set_champion(decision.champion_version)
    rc.tracker.tags(rc.parent_run, {"champion_version": decision.champion_version,
                                    "champion_changed": decision.changed})
    rc.tracker.json_artifact(rc.parent_run, "promotion.json", decision.to_record())
    log.info("promotion: %s", decision)
    return decision


# ---------------------------------------------------------------------- the trade-off report (figures, HTML)
def _points(results: list[StudentResult]) -> list[Any]:
    from captioning.tradeoff import ModelPoint

    points = []
    for r in results:
        curves = {k: [h.get("CIDEr") for h in (r.training.get(k) or {}).get("history") or [] if h.get("CIDEr")
                      is not None] for k in ("xe", "scst")}
        try:
            preds = json.loads(Path(r.predictions).read_text(encoding="utf-8"))
            captions = {int(p["image_id"]): str(p["caption"]) for p in preds}
        except (OSError, ValueError, KeyError, TypeError):
            captions = {}
        points.append(ModelPoint(name=r.label or r.student, preset=r.preset, cider=r.metrics.get("CIDEr") or 0.0,
                                 params=r.params, latency_ms=r.latency_ms, curves=curves, captions=captions))
    return points


def _samples(data: DatasetRef | None, n: int = 6) -> list[Any]:
    from captioning.tradeoff import Sample

    if data is None:
        return []
    ds = open_dataset(data.path)
    if ds.images_root is None:
        return []
    out = []
    for e in ds.iter_entries("test"):
        path = ds.image_path(e)
        if path.is_file() and path.suffix.lower() in (".jpg", ".jpeg", ".png"):
            out.append(Sample(image_id=e.image_id, path=str(path), references=list(e.captions)))
        if len(out) == n:
            break
    return out


def tradeoff_report(results: list[StudentResult | StudentFailure], data: DatasetRef | None, out: str | Path
                    ) -> list[Path]:
    """The trade-off report (:mod:`captioning.tradeoff`) of the finished students into ``out``: their recorded
    test CIDEr, parameters and latency, learning curves and test captions, with sample test images of ``data``."""
    from captioning.tradeoff import write

    ranked, _ = rank(results)
    return write(_points(ranked), _samples(data), out)


def recorded_students(rc: RunContext) -> tuple[list[StudentResult], DatasetRef | None]:
    """Every student stage's most recent record in the workdir (one per stage), and the latest dataset record:
    what ``capflow report`` draws."""
    from tasks.cache import StageRecordError, read_record
    from tasks.refs import RecordMismatch

    latest: dict[str, tuple[float, StudentResult]] = {}
    for p in rc.cache.root.glob("student-*.json") if rc.cache.root.is_dir() else []:
        try:
            doc = read_record(p)
            r = StudentResult.from_record(doc["result"])
        except (StageRecordError, RecordMismatch, TypeError):
            continue
        stage, t = str(doc.get("stage")), p.stat().st_mtime
        if stage not in latest or t > latest[stage][0]:
            latest[stage] = (t, r)
    return [r for _, r in latest.values()], rc.cache.latest("ingest", DatasetRef)
