"""``capflow bench scale``: how each data-side stage's time and memory grow with the dataset, measured at several
sizes on synthetic COCO-shaped data, each stage in a fresh process.

Data (per size N, written once, not timed): a Karpathy-format annotation file with 5 captions per image whose
lengths follow the Karpathy test references' length histogram and whose words follow a Zipf-Mandelbrot law fitted
to them (:data:`ZIPF`); Karpathy-style splits (val and test each 5000/123,287 of the images, restval folded
into train); one tiny real JPEG per image; a feature store of every kept image whose regions are the embeddings
of its first caption's words plus noise (informative, at a reduced width, ``dim``). Planted faults, so that the
reject paths run and the counts can be checked: every 500th image file is empty (rejected by ingest), every
1000th caption is blank (dropped), every 997th feature-store row is a rejected row.

Stages (:data:`STAGES`; the pipeline-side ones are added by ``tasks.bench_scale``): each runs in its own Python
process, so that peaks do not mix: the modules it needs are imported first, the process waits until the threads
they started are idle, the peak resident memory is reset (``/proc/self/clear_refs``), then the stage is timed
(``repeats``: several fresh runs, the fastest kept); the row reports its wall and CPU time, the process's peak resident
memory (``VmHWM``) and the resident memory it started from, the bytes it wrote (``write_bytes`` of
``/proc/self/io``: files, including those it removed again) and the bytes its outputs hold on disk, plus the
counts it returned (images, captions, rejects...: the test suite checks them against the generator's).

Per stage: the growth exponents of time and of the memory above the start between the two largest sizes
(``log(y2/y1) / log(N2/N1)``: 1 = linear, 2 = quadratic), and the extrapolation to MS-COCO (123,287 images) and to
Conceptual Captions' 3.3M (as images of 5 captions) along them. A stage that cannot run at a size says why in
``not_measured`` (the S3 loader above ``s3_max_images``: the moto endpoint keeps every object in memory and is not
a throughput reference).

``planted-quadratic`` (not run by default) is a self-check of the fit: an O(N^2) loop whose exponent must come
out near 2.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from captioning.bench.machine import machine_info, status_mb

COCO_IMAGES = 123_287  # Karpathy's dataset_coco.json: images (616,767 captions)
CC3M_PAIRS = 3_300_000  # Conceptual Captions: image-caption pairs
EXTRAPOLATE_TO = (COCO_IMAGES, CC3M_PAIRS)
HELD_OUT_FRACTION = 5000 / COCO_IMAGES  # Karpathy's val and test split: 5000 images each
CAPTIONS_PER_IMAGE = 5
# caption lengths (words) of the 25,010 Karpathy test references: length -> count
LENGTHS = {6: 2, 7: 218, 8: 4031, 9: 5510, 10: 5438, 11: 3861, 12: 2435, 13: 1411, 14: 823, 15: 450, 16: 277,
           17: 178, 18: 107, 19: 65, 20: 53, 21: 40, 22: 30, 23: 23, 24: 12, 25: 11, 26: 5, 27: 1, 28: 4, 29: 5}
# word frequencies p(rank r) ~ (r + q)^-s over a 40,000-word lexicon, fitted to the Karpathy test references:
# top-10 words 35% of tokens (real: 37%), 7.2k distinct words in 25k captions (real: 7.2k), ~10.9k words seen
# >= 5 times at COCO's 617k captions (Karpathy's vocabulary: 9,487)
ZIPF = {"words": 40_000, "s": 1.65, "q": 10.0}
# planted faults: every n-th image file empty (rejected at ingest), caption blank (dropped at ingest), feature-store
# row rejected (an image the extractor could not use)
PLANTED = {"bad_image_every": 500, "blank_caption_every": 1000, "rejected_row_every": 997}
MIN_FIT_SECONDS = 0.05  # below this at the largest size a time exponent is reported but flagged as noise
FLAT_MEMORY_MB = 64.0  # memory above the start below this at the largest size counts as flat


# ---------------------------------------------------------------------- synthetic COCO-shaped data
def lexicon(words: int = ZIPF["words"]) -> list[str]:
    """Pronounceable pseudo-words, shortest for the most frequent ranks (syllable strings in rank order)."""
    syl = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    out: list[str] = []
    length = 1
    while len(out) < words:
        for k in range(len(syl) ** length):
            parts = []
            for _ in range(length):
                k, d = divmod(k, len(syl))
                parts.append(syl[d])
            out.append("".join(parts))
            if len(out) == words:
                break
        length += 1
    return out


def word_probabilities() -> np.ndarray:
    r = np.arange(1, ZIPF["words"] + 1, dtype=np.float64)
    p = (r + ZIPF["q"]) ** -ZIPF["s"]
    return p / p.sum()


def held_out(n: int) -> int:
    """Images in each of val and test at ``n`` images (COCO's proportion; at least 1)."""
    return max(1, round(n * HELD_OUT_FRACTION))


def image_id(i: np.ndarray | int):
    """COCO-like sparse, increasing image ids."""
    return 9 + 4 * i


def _jpeg_pool(count: int = 32) -> list[tuple[bytes, int, int]]:
    """Tiny distinct JPEG files (bytes, height, width)."""
    from PIL import Image

    rng = np.random.default_rng(7)
    pool = []
    for k in range(count):
        h, w = 24 + k % 5, 32 + k % 7
        arr = np.full((h, w, 3), rng.integers(0, 256, 3), np.uint8)
        arr[rng.integers(0, h, 8), rng.integers(0, w, 8)] = rng.integers(0, 256, (8, 3))
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=80)
        pool.append((buf.getvalue(), h, w))
    return pool


def _captions(rng: np.random.Generator, count: int, cdf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``count`` captions' word ranks: (flat ranks, lengths)."""
    lens = np.fromiter(LENGTHS, np.int64)
    p = np.fromiter(LENGTHS.values(), np.float64)
    lengths = rng.choice(lens, size=count, p=p / p.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), len(cdf) - 1)
    return ranks, lengths


def generate(params: Mapping[str, Any]) -> dict[str, Any]:
    """Write the size-``images`` dataset under ``root`` (annotations.json, images/, features.zarr, and the same
    store at ``s3_features`` when given); returns the expected counts. Streams: memory stays flat in N."""
    from captioning.data.stores import OK, REJECTED, FeatureStore

    root = Path(params["root"])
    n, dim, boxes_max = int(params["images"]), int(params["dim"]), int(params["max_boxes"])
    chunk_rows = int(params["chunk_rows"])
    rng = np.random.default_rng([int(params.get("seed", 0)), n])
    words = lexicon()
    cdf = np.cumsum(word_probabilities())
    embed = rng.standard_normal((len(words), dim), dtype=np.float32)
    pool = _jpeg_pool()
    held = held_out(n)
    order = rng.permutation(n)
    split = np.where(rng.random(n) < 0.27, "restval", "train").astype(object)
    split[order[:held]] = "val"
    split[order[held: 2 * held]] = "test"
    rates = {k: int(params.get(k, v)) for k, v in PLANTED.items()}
    bad = (np.arange(n) % rates["bad_image_every"]) == rates["bad_image_every"] - 1
    kept = np.flatnonzero(~bad)
    row_of_image = np.full(n, -1, np.int64)
    row_of_image[kept] = np.arange(len(kept))
    for sub in ("train2014", "val2014"):
        (root / "images" / sub).mkdir(parents=True, exist_ok=True)
    uris = [str(root / "features.zarr")] + ([params["s3_features"]] if params.get("s3_features") else [])
    stores = [FeatureStore.create(u, image_id(kept), max_boxes=boxes_max, feature_dim=dim, chunk_rows=chunk_rows,
                                  dtype=params.get("dtype", "float16"), compressor="lz4", overwrite=True,
                                  attrs={"source": "bench-scale"}) for u in uris]
    block = chunk_rows * max(1, 4096 // chunk_rows)  # feature rows per write: whole chunks
    pending: dict[str, list] = {"features": [], "boxes": [], "num_boxes": [], "image_size": [], "status": [],
                                "reject_reason": []}
    written_rows = 0
    captions = blank = kept_captions = 0
    sentid = 0
    store_rejects = 0

    def flush(final: bool) -> None:
        nonlocal written_rows
        have = sum(len(x) for x in pending["num_boxes"])
        take = have if final else (have // block) * block
        if take == 0:
            return
        cat = {k: (np.concatenate(v) if k != "reject_reason" else [r for part in v for r in part])
               for k, v in pending.items()}
        for st in stores:
            st.write_rows(written_rows, features=cat["features"][:take], boxes=cat["boxes"][:take],
                          num_boxes=cat["num_boxes"][:take], image_size=cat["image_size"][:take],
                          status=cat["status"][:take], reject_reason=cat["reject_reason"][:take])
        written_rows += take
        for k in pending:
            pending[k] = [cat[k][take:]] if take < have else []

    step = 2048
    with open(root / "annotations.json", "w", encoding="utf-8") as ann:
        ann.write('{"dataset": "coco", "images": [\n')
        first = True
        for s in range(0, n, step):
            idx = np.arange(s, min(s + step, n))
            ranks, lengths = _captions(rng, len(idx) * CAPTIONS_PER_IMAGE, cdf)
            ends = np.cumsum(lengths)
            starts = ends - lengths
            feat_rows = []
            for j, i in enumerate(idx.tolist()):
                iid = int(image_id(i))
                sub = "val2014" if split[i] in ("val", "test") else "train2014"
                name = f"COCO_{sub}_{iid:012d}.jpg"
                data, h, w = pool[i % len(pool)]
                (root / "images" / sub / name).write_bytes(b"" if bad[i] else data)
                sents = []
                for c in range(CAPTIONS_PER_IMAGE):
                    k = j * CAPTIONS_PER_IMAGE + c
                    toks = [words[t] for t in ranks[starts[k]: ends[k]]]
                    if (sentid + 1) % rates["blank_caption_every"] == 0:
                        raw, toks = " . ", []
                        blank += 1
                    else:
                        raw = (toks[0].capitalize() + " " + " ".join(toks[1:])).strip() + "."
                        kept_captions += int(not bad[i])
                    sents.append({"tokens": toks, "raw": raw, "imgid": i, "sentid": sentid})
                    sentid += 1
                captions += CAPTIONS_PER_IMAGE
                entry = {"filepath": sub, "filename": name, "imgid": i, "split": str(split[i]),
                         "sentids": [x["sentid"] for x in sents], "sentences": sents, "cocoid": iid}
                ann.write(("" if first else ",\n") + json.dumps(entry))
                first = False
                if not bad[i]:
                    feat_rows.append((i, ranks[starts[j * CAPTIONS_PER_IMAGE]: ends[j * CAPTIONS_PER_IMAGE]], h, w))
            # feature rows of this step's kept images: regions = embeddings of the first caption's words + noise
            m = len(feat_rows)
            if m:
                nb = rng.integers(min(10, boxes_max), boxes_max + 1, size=m).astype(np.int16)
                cap0 = np.zeros((m, boxes_max), np.int64)
                for r, (_, rk, _, _) in enumerate(feat_rows):
                    cap0[r] = np.resize(rk, boxes_max)
                feats = embed[cap0] + np.float32(0.1) * rng.standard_normal((m, boxes_max, dim), dtype=np.float32)
                feats[np.arange(boxes_max)[None, :] >= nb[:, None]] = 0
                xy = rng.random((m, boxes_max, 2), dtype=np.float32) * np.float32(0.6)
                bx = np.concatenate([xy, xy + np.float32(0.1) + rng.random((m, boxes_max, 2), dtype=np.float32)
                                     * np.float32(0.3)], -1)
                bx[np.arange(boxes_max)[None, :] >= nb[:, None]] = 0
                rows = row_of_image[[i for i, *_ in feat_rows]]
                every = rates["rejected_row_every"]
                status = np.where(rows % every == every - 1, REJECTED, OK).astype(np.int8)
                store_rejects += int((status == REJECTED).sum())
                pending["features"].append(feats)
                pending["boxes"].append(bx)
                pending["num_boxes"].append(nb)
                pending["image_size"].append(np.array([(h, w) for *_, h, w in feat_rows], np.int32))
                pending["status"].append(status)
                pending["reject_reason"].append(["bench: planted reject" if x == REJECTED else "" for x in status])
                flush(final=False)
        ann.write("\n]}\n")
    flush(final=True)
    assert written_rows == len(kept)
    every = rates["rejected_row_every"]
    train_ok = int(np.sum(np.isin(split[kept], ("train", "restval")) & (np.arange(len(kept)) % every != every - 1)))
    return {"images": n, "kept": len(kept), "bad_images": int(bad.sum()), "captions": captions,
            "blank_captions": blank, "kept_captions": kept_captions, "held_out": held, "train_ok_rows": train_ok,
            "store_rows": len(kept), "store_rejects": store_rejects,
            "annotation_bytes": (root / "annotations.json").stat().st_size,
            "store_bytes": _tree_bytes(root / "features.zarr")}


def _tree_bytes(path: str | Path) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


# ---------------------------------------------------------------------- the stages (run in a child process)
def _config(p: Mapping[str, Any]):
    from captioning.config import PipelineConfig

    # the planted empty files are 0.2% by default; tests plant more
    return PipelineConfig.model_validate({"run": {"workdir": p["out"]}, "dataset": {
        "annotations": p["annotations"], "images": p["images_root"], "max_reject_fraction": 0.05}})


def stage_ingest(p: Mapping[str, Any]) -> dict[str, Any]:
    """What the ingest job does without MLflow: read + validate + hash (``prepare.ingest``), then write the
    normalised dataset and its reject list into the workdir."""
    from captioning.data.plans import ingest_plan
    from captioning.data.prepare import ingest
    from captioning.workdir import Workdir

    cfg = _config(p)
    ds = ingest(ingest_plan(cfg))
    wd = Workdir.of(cfg)
    path = ds.save(wd.dataset(ds.digest))
    summary = ds.summary()
    rejects = {"rejected": summary["rejected"], "dropped_captions": summary["dropped_captions"],
               "excluded": summary["excluded"]}
    wd.rejects(ds.digest).write_text(json.dumps(rejects, indent=1, ensure_ascii=False), encoding="utf-8")
    link = Path(p["out"]) / "dataset.path"
    link.write_text(str(path), encoding="utf-8")
    return {"images": summary["images"], "captions": summary["captions"], "rejected": len(ds.rejected),
            "dropped_captions": len(ds.dropped_captions), "entries": ds.entries, "outputs": [p["out"]]}


def _dataset_path(p: Mapping[str, Any]) -> str:
    return Path(p["ingest_out"], "dataset.path").read_text(encoding="utf-8")


def stage_vocab(p: Mapping[str, Any]) -> dict[str, Any]:
    """The vocab job without MLflow: load the dataset, the feature store's row index, vocabulary + label store
    (``vocab_and_labels``), the label store's digest."""
    from captioning.data.karpathy import Dataset
    from captioning.data.prepare import vocab_and_labels
    from captioning.data.stores import FeatureStore, LabelStore

    ds = Dataset.load(_dataset_path(p))
    rows = FeatureStore.open(p["features"]).row_of()
    from captioning.data.plans import vocab_plan

    res = vocab_and_labels(vocab_plan(_config(p)), ds, p["out"], rows)
    digest = LabelStore.open(res.labels_uri).digest()
    return {"words": len(res.vocab.words), "label_rows": res.captions, "digest": digest[:16], "outputs": [p["out"]]}


def _labels_uri(p: Mapping[str, Any]) -> str:
    return str(Path(p["vocab_out"]) / "labels.zarr")


def stage_region_stats(p: Mapping[str, Any]) -> dict[str, Any]:
    """Region-feature statistics of the training split, as ``fit_xe`` computes them (label store -> train rows ->
    ``region_stats``, which samples at most 4096 images)."""
    from captioning.data.loader import ZarrFeatures, region_stats
    from captioning.data.stores import LabelStore
    from captioning.training.recipe import split_rows

    labels = LabelStore.open(_labels_uri(p)).read()
    src = ZarrFeatures(p["features"])
    rows = split_rows(labels, "train", src.ok_rows())
    mean, sd = region_stats(src, rows)
    return {"train_rows": len(rows), "sampled_rows": int(min(len(rows), 4096)),
            "mean_abs": float(np.abs(mean).mean()), "sd_mean": float(sd.mean())}


def stage_loader(p: Mapping[str, Any]) -> dict[str, Any]:
    """One training epoch of the train split through ``CaptionDataset`` + ``make_loader`` (batch 50, 5 captions
    per image, shuffled, in-process), from the feature store at ``p['features']`` (local or s3://)."""
    from captioning.data.loader import CaptionDataset, ZarrFeatures, make_loader

    ds = CaptionDataset(ZarrFeatures(p["features"]), _labels_uri(p), split="train", captions_per_image=5,
                        shuffle=True, seed=0)
    images = batches = regions = 0
    for batch in make_loader(ds, batch_size=50):
        images += len(batch)
        batches += 1
        regions += int(batch.region_mask.sum())
    return {"epoch_images": images, "batches": batches, "regions": regions}


def stage_cider(p: Mapping[str, Any]) -> dict[str, Any]:
    """SCST's reward set-up as ``fit_scst`` does it (label store -> train references -> ``ScstLoss``, which builds
    CIDEr-D's document frequencies and reference vectors), then 20 reward batches of 50 images x 5 samples (the
    samples: other training images' references)."""
    from captioning.data.stores import LabelStore
    from captioning.data.text import EOS, Vocabulary
    from captioning.training.recipe import references
    from captioning.training.scst import ScstLoss

    t0 = time.perf_counter()
    labels = LabelStore.open(_labels_uri(p)).read()
    vocab = Vocabulary.load(Path(p["vocab_out"]) / "vocab.json")
    refs = references(labels, vocab, "train").ids
    t_refs = time.perf_counter() - t0
    loss = ScstLoss(refs, samples=5)
    t_df = time.perf_counter() - t0 - t_refs
    ids = list(refs)
    rng = np.random.default_rng(0)
    t1 = time.perf_counter()
    scored = 0
    for _ in range(20):
        imgs = [ids[i] for i in rng.integers(0, len(ids), 50)]
        others = [ids[i] for i in rng.integers(0, len(ids), 250)]
        cands = [np.asarray([*refs[o][0], EOS], np.int64) for o in others]
        scores = loss.cider.score_batch(cands, [i for i in imgs for _ in range(5)])
        scored += len(scores)
    return {"train_images": len(ids), "ngrams": int(loss.cider.table_size), "references_seconds": t_refs,
            "df_seconds": t_df, "batch_ms": (time.perf_counter() - t1) / 20 * 1000, "scored": scored}


def stage_coco_eval(p: Mapping[str, Any]) -> dict[str, Any]:
    """pycocoevalcap (BLEU, METEOR, ROUGE-L, CIDEr; SPICE needs CoreNLP, not here) on the test split: each test
    image's result is the first reference of the next test image. The test split grows with N here (COCO's
    proportion: 5000 images at 123,287)."""
    from captioning.data.karpathy import Dataset
    from captioning.metrics.coco import close_meteor, score

    ds = Dataset.load(_dataset_path(p))
    test = ds.split("test")
    refs = {e.image_id: list(e.captions) for e in test}
    results = {e.image_id: test[(k + 1) % len(test)].captions[0] for k, e in enumerate(test)}
    out = score(results, refs, metrics=("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"))
    close_meteor()
    return {"test_images": out["images"], "CIDEr": out["metrics"].get("CIDEr"),
            "METEOR": out["metrics"].get("METEOR")}


def stage_digests(p: Mapping[str, Any]) -> dict[str, Any]:
    """The lineage digests a pipeline run computes: the dataset's (over the normalised dataset), the feature
    store's manifest digest (ids, status, attributes, chunk checksums) and the label store's."""
    from captioning.data.karpathy import Dataset, dataset_digest
    from captioning.data.stores import FeatureStore, LabelStore

    t0 = time.perf_counter()
    ds = Dataset.load(_dataset_path(p))
    d = dataset_digest(ds)
    t1 = time.perf_counter()
    m = FeatureStore.open(p["features"]).manifest()
    t2 = time.perf_counter()
    lab = LabelStore.open(_labels_uri(p)).digest()
    t3 = time.perf_counter()
    return {"dataset_digest_seconds": t1 - t0, "manifest_seconds": t2 - t1, "labels_digest_seconds": t3 - t2,
            "dataset_digest": d[:16], "features_digest": m["digest"][:16], "labels_digest": lab[:16]}


def stage_planted_quadratic(p: Mapping[str, Any]) -> dict[str, Any]:
    """Self-check of the fit: all pairs of N items compared in a Python loop (O(N^2); 2,000 items take ~0.1 s)."""
    k = max(2, int(p["images"]))
    items = list(range(k))
    pairs = 0
    for i in items:
        for j in items[:i]:
            pairs += (i ^ j) & 1
    return {"items": k, "pairs": k * (k - 1) // 2, "odd_pairs": pairs}


@dataclass(frozen=True)
class Stage:
    """One measured stage: ``func`` (``module:function``, called with the size's parameters in a fresh process
    after ``imports`` are loaded) returns its counts (``outputs``: paths whose bytes are the stage's output)."""

    name: str
    func: str
    what: str
    imports: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # stages whose outputs it reads
    s3: bool = False  # reads the feature store on the S3 endpoint
    default: bool = True  # run when no stages are named
    data: bool = True  # reads the generated data set
    out_of: str | None = None  # works in this stage's output folder instead of its own (a second pass over it)


_M = "captioning.bench.scale"
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("ingest", f"{_M}:stage_ingest", "parse + validate + hash images (cold hash cache) + write the dataset JSON",
          ("captioning.data.prepare",)),
    Stage("ingest-warm", f"{_M}:stage_ingest", "ingest again, image hashes cached (what every pipeline run pays)",
          ("captioning.data.prepare",), needs=("ingest",), out_of="ingest"),
    Stage("vocab", f"{_M}:stage_vocab", "vocabulary + label store + its digest", ("captioning.data.prepare",),
          needs=("ingest",)),
    Stage("region-stats", f"{_M}:stage_region_stats", "training-split region statistics (<= 4096 images)",
          ("captioning.data.loader", "captioning.training.recipe"), needs=("vocab",)),
    Stage("loader", f"{_M}:stage_loader", "one epoch of the train split, local Zarr store, batch 50",
          ("captioning.data.loader",), needs=("vocab",)),
    Stage("loader-s3", f"{_M}:stage_loader", "one epoch of the train split, store on the S3 endpoint (moto)",
          ("captioning.data.loader", "s3fs"), needs=("vocab",), s3=True),
    Stage("cider", f"{_M}:stage_cider", "SCST rewards: train references, CIDEr-D df + vectors, 20 batches 50x5",
          ("captioning.training.scst", "captioning.training.recipe"), needs=("vocab",)),
    Stage("coco-eval", f"{_M}:stage_coco_eval", "pycocoevalcap BLEU/METEOR/ROUGE-L/CIDEr on the test split",
          ("captioning.metrics.coco", "captioning.data.karpathy"), needs=("ingest",)),
    Stage("digests", f"{_M}:stage_digests", "dataset digest, feature-store manifest, label-store digest",
          ("captioning.data.karpathy", "captioning.data.stores"), needs=("ingest", "vocab")),
    Stage("planted-quadratic", f"{_M}:stage_planted_quadratic", "self-check of the fit: an O(N^2) loop",
          default=False, data=False),
)}


# ---------------------------------------------------------------------- measuring one stage in a child process
def _io_write_bytes() -> int | None:
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - not Linux, or no task I/O accounting
        pass
    return None


def _reset_peak() -> bool:
    """Reset this process's peak resident memory (``VmHWM``) to its current resident memory (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:  # pragma: no cover - not Linux, or not allowed
        return False


def _quiesce(limit: float = 1.0) -> None:
    """Wait (at most ``limit`` seconds) until the process uses no CPU while its main thread sleeps: native threads
    started by the imports (BLAS pools spin for a while) would otherwise be counted in the stage's CPU time."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        c0 = time.process_time()
        time.sleep(0.02)
        if time.process_time() - c0 < 0.002:
            return


def child(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Run one stage in this process (fresh): imports first, then the timed call; seconds, memory, bytes."""
    for m in spec.get("imports", ()):
        importlib.import_module(m)
    mod, fn = spec["func"].split(":")
    func = getattr(importlib.import_module(mod), fn)
    _quiesce()
    reset = _reset_peak()
    start_rss = status_mb("VmRSS")
    io0 = _io_write_bytes()
    c0, t0 = time.process_time(), time.perf_counter()
    counts = dict(func(spec["params"]) or {})
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = status_mb("VmHWM")
    io1 = _io_write_bytes()
    outputs = counts.pop("outputs", [])
    return {"seconds": seconds, "cpu_seconds": cpu, "start_rss_mb": start_rss, "peak_rss_mb": peak, "peak_reset": reset,
            "write_bytes": (io1 - io0) if io0 is not None and io1 is not None else None,
            "output_bytes": sum(_tree_bytes(o) for o in outputs), "counts": counts}


def _spawn(spec: Mapping[str, Any], env: Mapping[str, str] | None = None, timeout: float | None = None
           ) -> dict[str, Any]:
    repo = str(Path(__file__).resolve().parents[2])
    full_env = {**os.environ, **(env or {}),
                "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "captioning.bench.scale", json.dumps(spec)], capture_output=True,
                          text=True, check=False, env=full_env, timeout=timeout, cwd=repo)
    if proc.returncode != 0:
        raise RuntimeError(f"stage {spec['func']} failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- the S3 endpoint (moto server)
class _MotoEndpoint:
    """A moto S3 server on 127.0.0.1 with throw-away credentials, for the ``loader-s3`` stage."""

    def __init__(self, bucket: str = "capflow-bench"):
        self.bucket = bucket
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def start(self, timeout: float = 60.0) -> None:
        exe = Path(sys.executable).with_name("moto_server")
        if not exe.exists():
            found = shutil.which("moto_server")
            if found is None:
                raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
            exe = Path(found)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
        endpoint = f"http://127.0.0.1:{port}"
        self.env = {"AWS_ACCESS_KEY_ID": "bench-" + secrets.token_hex(4),
                    "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16), "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL_S3": endpoint}
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on {endpoint}") from None
                time.sleep(0.3)
        req = urllib.request.Request(f"{endpoint}/{self.bucket}", method="PUT")  # moto accepts unsigned requests
        with urllib.request.urlopen(req, timeout=10):
            pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


# ---------------------------------------------------------------------- the fit
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


# ---------------------------------------------------------------------- the benchmark
def _closure(names: Sequence[str], stages: Mapping[str, Stage]) -> list[str]:
    want: set[str] = set()

    def add(n: str) -> None:
        if n not in stages:
            raise ValueError(f"unknown stage {n!r} (known: {', '.join(stages)})")
        if n not in want:
            want.add(n)
            for d in stages[n].needs:
                add(d)
    for n in names:
        add(n)
    return [n for n in stages if n in want]  # registry order = dependency order


def run(sizes: Sequence[int] = (1000, 10_000, 100_000), stages: Sequence[str] | None = None, *,
        extra_stages: Mapping[str, Stage] | None = None, dim: int = 64, max_boxes: int = 36, chunk_rows: int = 8,
        dtype: str = "float16", s3_max_images: int = 10_000, disk: bool = True,
        planted: Mapping[str, int] | None = None, repeats: int = 1, workdir: str | None = None, keep: bool = False,
        progress: bool = False) -> dict[str, Any]:
    """Measure ``stages`` (default: every default stage, with ``extra_stages`` added after the library's) at each
    of ``sizes`` images. ``planted``: the fault rates (:data:`PLANTED` keys). ``repeats``: runs of each stage at each
    size, each in a fresh process and (unless it works in another stage's folder) on an emptied output folder,
    the fastest kept (wall and CPU time each): other work on a shared machine only ever adds time. See the module
    docstring."""
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] < 20:
        raise ValueError("sizes must be image counts of at least 20")
    rates = {**PLANTED, **(planted or {})}
    registry = {**STAGES, **(extra_stages or {})}
    names = _closure(list(stages) if stages else [n for n, s in registry.items() if s.default], registry)
    root = Path(tempfile.mkdtemp(prefix="capflow-bench-scale-", dir=workdir))
    moto = _MotoEndpoint()
    use_s3 = any(registry[n].s3 for n in names) and sizes[0] <= s3_max_images
    rows: list[dict[str, Any]] = []
    not_measured: list[dict[str, Any]] = []
    generated: list[dict[str, Any]] = []

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)
    try:
        if use_s3:
            moto.start()
        for n in sizes:
            base = root / f"n{n}"
            base.mkdir()
            s3_uri = f"s3://{moto.bucket}/n{n}/features.zarr" if use_s3 and n <= s3_max_images else None
            if any(registry[name].data for name in names):
                say(f"[scale] generating {n} images")
                t0 = time.perf_counter()
                gen = _spawn({"func": f"{_M}:generate", "params": {
                    "root": str(base), "images": n, "dim": dim, "max_boxes": max_boxes, "chunk_rows": chunk_rows,
                    "dtype": dtype, "s3_features": s3_uri, **rates}}, env=moto.env)
                generated.append({"images": n, **gen["counts"], "seconds": time.perf_counter() - t0})
            outs = {name: base / "out" / (registry[name].out_of or name) for name in registry}
            common = {"images": n, "annotations": str(base / "annotations.json"), "images_root": str(base / "images"),
                      "features": str(base / "features.zarr"), "root": str(base),
                      **{f"{name.replace('-', '_')}_out": str(path) for name, path in outs.items()}}
            for name in names:
                st = registry[name]
                if st.s3 and s3_uri is None:
                    not_measured.append({"stage": name, "images": n, "reason": (
                        f"the S3 endpoint here is moto, which holds every object in memory and is no throughput "
                        f"reference: measured up to {s3_max_images} images")})
                    continue
                outs[name].mkdir(parents=True, exist_ok=True)
                params = {**common, "out": str(outs[name]), **({"features": s3_uri} if st.s3 else {})}
                say(f"[scale] {name} at {n} images")
                spec = {"func": st.func, "imports": list(st.imports), "params": params}
                got = _spawn(spec, env=moto.env)
                for _ in range(repeats - 1):
                    if st.out_of is None:  # the same start as the first run (ingest: a cold hash cache)
                        shutil.rmtree(outs[name], ignore_errors=True)
                        outs[name].mkdir(parents=True)
                    again = _spawn(spec, env=moto.env)
                    if again["seconds"] < got["seconds"]:
                        got = {**again, "cpu_seconds": min(again["cpu_seconds"], got["cpu_seconds"])}
                    else:
                        got["cpu_seconds"] = min(again["cpu_seconds"], got["cpu_seconds"])
                rows.append({"stage": name, "images": n, "seconds": got["seconds"], "cpu_seconds": got["cpu_seconds"],
                             "peak_rss_mb": got["peak_rss_mb"], "start_rss_mb": got["start_rss_mb"],
                             "work_rss_mb": max(0.0, got["peak_rss_mb"] - got["start_rss_mb"]),
                             "write_bytes": got["write_bytes"], "output_bytes": got["output_bytes"],
                             "peak_reset": got["peak_reset"], "counts": got["counts"]})
                say(f"[scale]   {got['seconds']:.2f} s, peak {got['peak_rss_mb']:.0f} MiB")
            if not keep:
                shutil.rmtree(base, ignore_errors=True)  # the next size needs the disk
    finally:
        moto.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    fits = {}
    for name in names:
        f = fit_stage([r for r in rows if r["stage"] == name])
        te = f["time_exponent"]
        f["what"] = registry[name].what
        f["time_ok"] = te is None or te <= 1.1 or bool(f.get("time_noise"))
        fits[name] = f
    out = {
        "bench": "scale",
        "machine": machine_info(),
        "params": {"sizes": sizes, "stages": names, "feature_dim": dim, "max_boxes": max_boxes,
                   "chunk_rows": chunk_rows, "dtype": dtype, "captions_per_image": CAPTIONS_PER_IMAGE,
                   "s3_max_images": s3_max_images, "extrapolate_to": list(EXTRAPOLATE_TO), "zipf": ZIPF,
                   "planted": rates, "repeats": repeats,
                   "kept": str(root) if keep else None},
        "generated": generated,
        "rows": rows,
        "stages": fits,
        "not_measured": not_measured,
        "ratios": {f"{k}_time_exponent": v["time_exponent"] for k, v in fits.items()
                   if v["time_exponent"] is not None},
    }
    if disk:
        out["disk_per_100k_images"] = disk_table(workdir=workdir)
    out["table"] = table(out)
    return out


# ---------------------------------------------------------------------- disk per 100k images
def disk_table(widths: Sequence[int] = (512, 1024, 2048), dtypes: Sequence[str] = ("float16", "float32"), *,
               images: int = 128, min_boxes: int = 10, max_boxes: int = 100, chunk_rows: int = 8,
               workdir: str | None = None) -> list[dict[str, Any]]:
    """Measured feature-store bytes per image at each width and dtype (10..100 boxes per image, zero-padded to
    100, lz4; values like pooled ReLU features: ~30% zeros, mean ~0.8), scaled to 100k images; plus the label
    store per 100k images (5 captions, 16 words)."""
    from captioning.data.stores import OK, FeatureStore

    out = []
    rng = np.random.default_rng(0)
    nb = rng.integers(min_boxes, max_boxes + 1, size=images).astype(np.int16)
    with tempfile.TemporaryDirectory(prefix="capflow-bench-disk-", dir=workdir) as tmp:
        for d in widths:
            feats = np.maximum(rng.standard_normal((images, max_boxes, d), dtype=np.float32) + np.float32(0.52), 0)
            feats *= np.float32(1.4)
            feats[np.arange(max_boxes)[None, :] >= nb[:, None]] = 0
            boxes = np.zeros((images, max_boxes, 4), np.float32)
            boxes[..., 2:] = 0.5
            for dt in dtypes:
                uri = str(Path(tmp) / f"f{d}{dt}.zarr")
                st = FeatureStore.create(uri, np.arange(images), max_boxes=max_boxes, feature_dim=d,
                                         chunk_rows=chunk_rows, dtype=dt, compressor="lz4")
                st.write_rows(0, features=feats, boxes=boxes, num_boxes=nb, image_size=np.full((images, 2), 480),
                              status=np.full(images, OK, np.int8))
                per = _tree_bytes(uri) / images
                raw = max_boxes * d * np.dtype(dt).itemsize
                out.append({"feature_dim": d, "dtype": dt, "bytes_per_image": round(per),
                            "gb_per_100k_images": round(per * 1e5 / 1e9, 2), "raw_bytes_per_image": raw,
                            "mean_boxes": float(nb.mean())})
                shutil.rmtree(uri, ignore_errors=True)
    return out


# ---------------------------------------------------------------------- rendering
def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _mb(v: float | int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f}"


def table(result: Mapping[str, Any]) -> str:
    """The result as markdown: one line per stage and size, then one per stage with exponents and
    extrapolations."""
    lines = ["| stage | images | seconds | CPU s | peak RSS MiB | start RSS MiB | written MiB | output MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['stage']} | {r['images']:,} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['start_rss_mb']:.0f} | {_mb(r['write_bytes'])} | "
                     f"{_mb(r['output_bytes'])} |")
    for m in result.get("not_measured", []):
        lines.append(f"| {m['stage']} | {m['images']:,} | not measured: {m['reason']} | | | | | |")
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


def stage_names(stages: Mapping[str, Stage] | None = None) -> list[str]:
    return list({**STAGES, **(stages or {})})


__all__ = ["STAGES", "Stage", "child", "disk_table", "extrapolate", "fit_stage", "generate", "growth_exponent",
           "run", "table"]

if __name__ == "__main__":  # a measured child process
    print(json.dumps(child(json.loads(sys.argv[1])), default=str))
