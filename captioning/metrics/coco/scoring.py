"""Scoring: :func:`score` (one evaluation, every requested metric on the PTB-tokenised captions, as
``COCOEvalCap`` computes it; METEOR in a thread while the others run) and :func:`evaluate_files`
(``capflow evaluate``)."""

from __future__ import annotations

import logging
import math
import subprocess
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.metrics.coco.chunked import bleu_in_chunks, cider_in_chunks
from captioning.metrics.coco.inputs import EvaluationInputError, check_ids, load_references, load_results
from captioning.metrics.coco.java import ptb_tokenize_counted
from captioning.metrics.coco.meteor import compute_meteor, meteor_scorer
from captioning.metrics.coco.spice import run_spice, spice_status

log = logging.getLogger(__package__)  # the package's logger (captioning.metrics.coco), as before the split

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")
BLEU_METRICS = METRICS[:4]


def _finite(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass
class _Tokenised:
    """Both sides PTB-tokenised, in pycocoevalcap's input form (``gts``: image -> references, ``res``: image ->
    [result]), with the word counts the report gives."""

    ids: list[int]
    gts: dict[int, list[str]]
    res: dict[int, list[str]]
    tokens: dict[str, Any]  # {"references": n, "results": n, "ptb_tokenizer": {"references": n, "results": n}}


@dataclass
class _Sheet:
    """What one evaluation has computed so far: metric -> corpus score, metric -> {image_id: score}, and the time
    each step took."""

    ids: list[int]
    metrics: dict[str, float | None] = field(default_factory=dict)
    per: dict[str, dict[int, float | None]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def record(self, name: str, corpus: float, per_image: Sequence[float]) -> None:
        self.metrics[name] = float(corpus)
        self.per[name] = dict(zip(self.ids, (float(x) for x in per_image)))


def _checked_ids(results: Mapping[int, str], references: Mapping[int, Sequence[str]],
                 metrics: Sequence[str]) -> list[int]:
    """The ids to score (``results``' order), after checking the metric names and both sides of every image."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {METRICS}")
    if not metrics:
        raise ValueError("no metrics requested")
    if not results:
        raise EvaluationInputError("no results to score")
    check_ids(results, references, "results")
    ids = list(results)
    for i in ids:
        refs = references[i]
        if isinstance(refs, str) or not refs or not all(isinstance(r, str) for r in refs):
            raise EvaluationInputError(f"references of image {i} must be a non-empty list of strings")
        if not isinstance(results[i], str):
            raise EvaluationInputError(f"result caption of image {i} is not a string")
    return ids


def _tokenise(results: Mapping[int, str], references: Mapping[int, Sequence[str]], ids: list[int]) -> _Tokenised:
    """Both sides through the PTB tokenizer, one Java run each."""
    tok_refs, ptb_refs = ptb_tokenize_counted([r for i in ids for r in references[i]])
    tok_res, ptb_res = ptb_tokenize_counted([results[i] for i in ids])
    gts: dict[int, list[str]] = {}
    pos = 0
    for i in ids:
        n = len(references[i])
        gts[i] = tok_refs[pos: pos + n]
        pos += n
    tokens = {"references": sum(len(c.split()) for c in tok_refs), "results": sum(len(c.split()) for c in tok_res),
              "ptb_tokenizer": {"references": ptb_refs, "results": ptb_res}}
    return _Tokenised(ids, gts, {i: [c] for i, c in zip(ids, tok_res)}, tokens)


def _bleu(gts: dict[int, list[str]], res: dict[int, list[str]]):
    score, per_image, scorer = bleu_in_chunks(gts, res)
    # the corpus totals BleuScorer prints with verbose=1, recomputed from its cooked statistics
    testlen = reflen = 0
    guess, correct = [0] * 4, [0] * 4
    for comps in scorer.ctest:
        testlen += comps["testlen"]
        reflen += scorer._single_reflen(comps["reflen"], "closest", comps["testlen"])
        for k in range(4):
            guess[k] += comps["guess"][k]
            correct[k] += comps["correct"][k]
    counts = {"testlen": testlen, "reflen": reflen, "guess": guess, "correct": correct,
              "ratio": (testlen + 1e-15) / (reflen + 1e-9)}
    return [float(s) for s in score], per_image, counts


def _score_bleu(tok: _Tokenised, want: set[str], sheet: _Sheet) -> dict[str, Any]:
    """The requested BLEU-n into ``sheet``; returns BLEU's corpus counts (``bleu_counts``)."""
    t0 = time.perf_counter()
    bleu, bleu_per, counts = _bleu(tok.gts, tok.res)
    for k, name in enumerate(BLEU_METRICS):
        if name in want:
            sheet.record(name, bleu[k], bleu_per[k])
    sheet.timings["BLEU"] = time.perf_counter() - t0
    return counts


def _rouge(gts: dict[int, list[str]], res: dict[int, list[str]]):
    from pycocoevalcap.rouge.rouge import Rouge

    return Rouge().compute_score(gts, res)


#: the metrics computed from the tokenised captions alone: name -> (gts, res) -> (corpus, per image); CIDEr a
#: chunk of images at a time (:mod:`.chunked`: pycocoevalcap's arithmetic in bounded memory)
_SCORERS: dict[str, Callable[[dict, dict], tuple[float, Any]]] = {"ROUGE_L": _rouge, "CIDEr": cider_in_chunks}


def _score_spice(tok: _Tokenised, jar_dir: Path | None, state: str, sheet: _Sheet) -> str:
    """SPICE into ``sheet`` (None when it cannot run, fails, or gives no F-score); returns the ``"spice"``
    state, which says why."""
    sheet.metrics["SPICE"] = None
    if jar_dir is None:
        return state
    t0 = time.perf_counter()
    try:
        s, scores = run_spice(tok.gts, tok.res, jar_dir)
    except (OSError, RuntimeError, subprocess.SubprocessError, ValueError, KeyError) as e:
        state = f"unavailable: SPICE run failed ({type(e).__name__}: {e})"
        warnings.warn(f"SPICE {state}", stacklevel=3)  # the caller of score
    else:
        sheet.per["SPICE"] = dict(zip(tok.ids, (_finite(x) for x in scores)))
        sheet.metrics["SPICE"] = _finite(s)
        if sheet.metrics["SPICE"] is None:  # pycocoevalcap would report NaN here
            bad = sum(v is None for v in sheet.per["SPICE"].values())
            state = f"unavailable: SPICE gave no F-score for {bad} image(s)"
    sheet.timings["SPICE"] = time.perf_counter() - t0
    return state


def _timed_meteor(meteor, tok: _Tokenised, timings: dict[str, float]) -> tuple[float, list[float]]:
    t = time.perf_counter()
    out = compute_meteor(meteor, tok.gts, tok.res)
    timings["METEOR"] = time.perf_counter() - t
    return out


def score(results: Mapping[int, str], references: Mapping[int, Sequence[str]], *,
          spice_jars: str | Path | None = None, metrics: Sequence[str] = METRICS,
          per_image: bool = False) -> dict:
    """Score generated captions (one per image) against references with the coco-caption metrics.

    Every image in ``results`` is scored; each needs references (extra reference images are ignored, and counted
    in ``"unscored_references"``). Returns::

        {"metrics": {name: float | None, ...},        # the requested ones; SPICE None when unavailable
         "images": n_scored, "unscored_references": n,
         "bleu_counts": {"testlen", "reflen", "guess": [4], "correct": [4], "ratio"},   # when BLEU requested
         "tokens": {"references": n, "results": n,    # words scored (PTB tokens, punctuation removed)
                    "ptb_tokenizer": {"references": n, "results": n}},  # the Java tokenizer's own count
         "spice": "available" | "unavailable: <reason>" | "not requested",
         "per_image": {metric: {image_id: float}}}    # only with per_image=True
    """
    ids = _checked_ids(results, references, metrics)
    want = set(metrics)
    sheet = _Sheet(ids)
    spice_jar_dir, spice_state = spice_status(spice_jars) if "SPICE" in want else (None, "not requested")
    bleu_counts = None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capflow-meteor")
    try:
        meteor = None
        if "METEOR" in want:
            t0 = time.perf_counter()
            meteor = meteor_scorer()  # a new JVM loads its paraphrase tables while we tokenise
            sheet.timings["meteor_spawn"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tok = _tokenise(results, references, ids)
        sheet.timings["tokenize"] = time.perf_counter() - t0
        fut = pool.submit(_timed_meteor, meteor, tok, sheet.timings) if meteor is not None else None
        if want & set(BLEU_METRICS):
            bleu_counts = _score_bleu(tok, want, sheet)
        for name, scorer in _SCORERS.items():
            if name in want:
                t0 = time.perf_counter()
                sheet.record(name, *scorer(tok.gts, tok.res))
                sheet.timings[name] = time.perf_counter() - t0
        if "SPICE" in want:
            spice_state = _score_spice(tok, spice_jar_dir, spice_state, sheet)
        if fut is not None:
            sheet.record("METEOR", *fut.result())
    finally:
        pool.shutdown(wait=True)

    out: dict[str, Any] = {
        "metrics": {m: sheet.metrics.get(m) for m in METRICS if m in want},
        "images": len(ids),
        "unscored_references": len(references) - len(ids),
    }
    if bleu_counts is not None:
        out["bleu_counts"] = bleu_counts
    out["tokens"] = tok.tokens
    out["spice"] = spice_state
    if per_image:
        out["per_image"] = {m: sheet.per[m] for m in METRICS if m in sheet.per}
    log.debug("coco metrics timings (s): %s", {k: round(v, 2) for k, v in sheet.timings.items()})
    return out


def evaluate_files(results_path: str | Path, references_path: str | Path,
                   spice_jars: str | Path | None = None, duplicates: str = "error") -> dict:
    """``capflow evaluate``: score a COCO results file against a COCO references file.

    Returns the JSON-ready dict the CLI prints: :func:`score`'s output (without per-image scores) plus the two
    file paths. Non-finite numbers are ``None``. ``duplicates``: see :func:`load_results`.
    """
    refs = load_references(references_path)
    results = load_results(results_path, refs, duplicates=duplicates)
    out = score(results, refs, spice_jars=spice_jars)
    out["metrics"] = {k: (None if v is None else _finite(v)) for k, v in out["metrics"].items()}
    return {"results": str(results_path), "references": str(references_path), **out}
