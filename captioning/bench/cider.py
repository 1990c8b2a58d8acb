"""``capflow bench cider``: capflow's CIDEr-D (:mod:`captioning.metrics.cider`) against pycocoevalcap 1.2.

Material: the 5000 Karpathy-test references (COCO format) and ACORT's published test captions. Every caption
is PTB-tokenised once, the way coco-caption does before CIDEr (its Java ``PTBTokenizer``: lower case,
punctuation removed), and both scorers get the same tokens.

(1) Correctness: pycocoevalcap's ``Cider`` over all images vs ``CiderD(same references).score`` (df from the
    references of the scored images on both sides): ``max_abs_diff`` is the largest per-image difference.
(2) Speed at SCST size: batches of ``batch_images`` images x ``samples`` candidates. The samples of an image
    are its ACORT caption and variants of it (its words shuffled, another image's caption, the caption cut
    two words short, the caption followed by an ``<eos>`` token that no reference has, then shuffled captions
    of other images). Timed per pass over all batches (median over ``repeats``):
    (a) the anchor: pycocoevalcap's ``CiderScorer`` used as SCST code uses it, a scorer per batch fed
        ``(candidate, references)`` pairs, then ``compute_score()``. Its API cannot take precomputed document
        frequencies (``compute_score`` always recounts them from the batch's references, and ``compute_cider``
        always sets log N from the batch size), so the anchor's df is per batch: that is what it computes;
    (a') for transparency, the same with the df step replaced by the whole corpus' df counted once
        (``compute_doc_freq`` bypassed, ``compute_cider`` called directly): timing only, since its log N is
        still that of the batch;
    (b) ``CiderD.score_batch`` with the df and reference vectors precomputed once over the reference corpus
        (the build is a separate, one-off row).
    ``speedup_vs_pycocoevalcap`` = time(a) / time(b); ``speedup_vs_pycocoevalcap_df_once`` = time(a') / time(b).
    The per-batch scores of (a) are reproduced by a CiderD built over the batch's references (one reference
    set per candidate, as the anchor counts them): ``max_abs_diff_batch_anchor``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path

import numpy as np

from captioning.bench.machine import machine_info
from captioning.metrics.cider import CiderD


def _load(references_path: Path, results_path: Path, images: int | None):
    refs = json.loads(Path(references_path).read_text())
    results = json.loads(Path(results_path).read_text())
    gts: dict = defaultdict(list)
    for a in refs["annotations"]:
        gts[a["image_id"]].append(a["caption"])
    res: dict = {}
    for r in results:
        res.setdefault(r["image_id"], r["caption"])  # first caption of an image, as coco-caption keeps it
    ids = [i for i in res if i in gts]
    if images is not None:
        ids = ids[:images]
    return ids, {i: gts[i] for i in ids}, {i: res[i] for i in ids}


def ptb_tokenize_pairs(gts: dict, res: dict) -> tuple[dict, dict]:
    """PTB-tokenise references and candidates in one Java run (coco-caption's tokenizer)."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    def clean(c: str) -> str:  # a line break inside a caption would shift every following caption
        return " ".join(c.splitlines())

    both = {("g", i): [{"caption": clean(c)} for c in caps] for i, caps in gts.items()}
    both.update({("r", i): [{"caption": clean(c)}] for i, c in res.items()})
    out = PTBTokenizer().tokenize(both)
    return ({i: out[("g", i)] for i in gts}, {i: out[("r", i)][0] for i in res})


def make_samples(ids: list, res_tok: dict, samples: int, seed: int = 0) -> dict:
    """Per image, ``samples`` candidate captions (tokenised strings): the caption and variants of it."""
    rng = np.random.default_rng(seed)
    n = len(ids)
    out = {}
    for pos, i in enumerate(ids):
        words = res_tok[i].split()
        cands = []
        for s in range(samples):
            if s == 0:
                c = words
            elif s == 1:
                c = list(rng.permutation(words)) if words else []
            elif s == 2:
                c = res_tok[ids[(pos + 1 + int(rng.integers(max(n - 1, 1)))) % n]].split()
            elif s == 3:
                c = words[: max(1, len(words) - 2)]
            elif s == 4:
                c = [*words, "<eos>"]
            else:
                other = res_tok[ids[int(rng.integers(n))]].split()
                c = list(rng.permutation(other)) if other else []
            cands.append(" ".join(c))
        out[i] = cands
    return out


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(references_path: str | Path, results_path: str | Path,
        batch_images: int = 50, samples: int = 5, repeats: int = 3, images: int | None = None,
        seed: int = 0) -> dict:
    """Run the benchmark; returns the JSON-able result (see the module docstring). ``images``: use only the
    first that many images of the results file (None: all)."""
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.cider.cider_scorer import CiderScorer

    ids, gts_raw, res_raw = _load(Path(references_path), Path(results_path), images)
    if not ids:
        raise ValueError("no image has both references and a result")
    t0 = time.perf_counter()
    gts, res = ptb_tokenize_pairs(gts_raw, res_raw)
    t_tok = time.perf_counter() - t0

    # (1) correctness over all images
    t0 = time.perf_counter()
    pyco_mean, pyco_scores = Cider().compute_score(gts, {i: [res[i]] for i in ids})
    t_pyco = time.perf_counter() - t0
    t0 = time.perf_counter()
    scorer = CiderD(gts)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    mean, per_id = scorer.score(res)
    t_score = time.perf_counter() - t0
    # pycocoevalcap returns its scores in the order of gts.keys()
    max_abs_diff = float(max(abs(per_id[i] - float(p)) for i, p in zip(gts.keys(), pyco_scores, strict=True)))

    # (2) speed at SCST size
    cand = make_samples(ids, res, samples, seed)
    batches = []
    for b in range(0, len(ids), batch_images):
        chunk = ids[b:b + batch_images]
        batches.append(([c for i in chunk for c in cand[i]], [i for i in chunk for _ in range(samples)]))

    def anchor_pass():
        out = []
        for cands, rids in batches:
            cs = CiderScorer(n=4, sigma=6.0)
            for c, r in zip(cands, rids, strict=True):
                cs += (c, gts[r])
            out.append(cs.compute_score()[1])
        return out

    corpus_df: defaultdict = defaultdict(float)
    corpus_scorer = CiderScorer(n=4, sigma=6.0)
    for i in ids:
        corpus_scorer += (None, gts[i])
    corpus_scorer.compute_doc_freq()
    corpus_df.update(corpus_scorer.document_frequency)

    def anchor_df_once_pass():
        for cands, rids in batches:
            cs = CiderScorer(n=4, sigma=6.0)
            for c, r in zip(cands, rids, strict=True):
                cs += (c, gts[r])
            cs.document_frequency = corpus_df  # df counted once; compute_doc_freq skipped
            cs.compute_cider()

    def ours_pass():
        return [scorer.score_batch(cands, rids) for cands, rids in batches]

    anchor_scores = anchor_pass()  # warm-up and the anchor's scores
    ours_pass()
    t_anchor = _median_time(anchor_pass, repeats)
    t_anchor_df = _median_time(anchor_df_once_pass, repeats)
    t_ours = _median_time(ours_pass, repeats)

    # the anchor's per-batch numbers, reproduced by CiderD over each batch's references
    diff_batch = 0.0
    for (cands, rids), expect in zip(batches, anchor_scores, strict=True):
        per_batch = CiderD({k: gts[r] for k, r in enumerate(rids)})
        got = per_batch.score_batch(cands, list(range(len(cands))))
        diff_batch = max(diff_batch, float(np.abs(got - np.asarray(expect)).max()))
    # score_batch (corpus df) equals score on the same candidates
    first_cands, first_ids = batches[0]
    diff_score = float(np.abs(scorer.score_batch(first_cands, first_ids)
                              - np.array([scorer.score({r: c})[0] for c, r in zip(first_cands, first_ids,
                                                                                     strict=True)])).max())

    n_b = len(batches)
    per_batch_n = batch_images * samples
    rows = [
        {"name": "ptb_tokenize", "what": "PTBTokenizer (Java), references and captions, once", "seconds": t_tok},
        {"name": "pycocoevalcap_cider_corpus", "what": f"pycocoevalcap Cider over {len(ids)} images",
         "seconds": t_pyco, "cider": float(pyco_mean)},
        {"name": "ciderd_build", "what": "CiderD(references): df + reference vectors, once", "seconds": t_build,
         "table_ngrams": scorer.table_size},
        {"name": "ciderd_score_corpus", "what": f"CiderD.score over {len(ids)} images", "seconds": t_score,
         "cider": mean, "max_abs_diff": max_abs_diff},
        {"name": "pycocoevalcap_per_batch", "what": "(a) anchor: CiderScorer per batch, df from the batch's refs",
         "ms_per_batch": 1e3 * t_anchor / n_b, "batches": n_b, "candidates_per_batch": per_batch_n},
        {"name": "pycocoevalcap_per_batch_df_once", "what": "(a') CiderScorer per batch, corpus df counted once, "
         "compute_cider only (timing only: log N still the batch's)", "ms_per_batch": 1e3 * t_anchor_df / n_b,
         "batches": n_b, "candidates_per_batch": per_batch_n},
        {"name": "ciderd_score_batch", "what": "(b) CiderD.score_batch, df + reference vectors precomputed",
         "ms_per_batch": 1e3 * t_ours / n_b, "batches": n_b, "candidates_per_batch": per_batch_n,
         "max_abs_diff_batch_anchor": diff_batch, "max_abs_diff_score_batch_vs_score": diff_score},
        {"name": "max_abs_diff", "what": "max per-image |CiderD - pycocoevalcap Cider| (all images)",
         "value": max_abs_diff},
    ]
    return {
        "bench": "cider",
        "machine": machine_info(pycocoevalcap=version("pycocoevalcap")),
        "config": {"images": len(ids), "batch_images": batch_images, "samples": samples, "repeats": repeats,
                   "seed": seed, "references": str(references_path), "results": str(results_path)},
        "anchor": "pycocoevalcap 1.2 CiderScorer, one scorer per batch with compute_score() (df recounted from "
                  "the batch's references: its API cannot take a precomputed df); the df-once variant is "
                  "reported as speedup_vs_pycocoevalcap_df_once",
        "anchor_df": "per_batch",
        "rows": rows,
        "ratios": {"speedup_vs_pycocoevalcap": t_anchor / t_ours,
                   "speedup_vs_pycocoevalcap_df_once": t_anchor_df / t_ours},
        "max_abs_diff": max_abs_diff,
        "max_abs_diff_batch_anchor": diff_batch,
        "cider_pycocoevalcap": float(pyco_mean),
        "cider_ciderd": mean,
    }


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(), indent=2))
