"""Evaluating a trained captioner on a split: decode, score, count, time.

:func:`predict` beam-decodes the images of a split into captions; :func:`evaluate_model` scores them with the
coco-caption metrics (:func:`captioning.metrics.coco.score`) and adds what the papers compare models by: the
parameter count (the paper's convention), batch-1 latency, the share of captions not seen in training and the
average length. :func:`greedy_cider_validator` is the cheap per-epoch validation of the trainers (greedy
decoding, fast CIDEr-D against the split's references).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from captioning.data.loader import FeatureSource, image_batches
from captioning.data.text import RadixCodec, Vocabulary
from captioning.decoding import beam_search, greedy, to_words
from captioning.metrics.cider import CiderD
from captioning.metrics.coco import score
from captioning.metrics.diversity import caption_stats, repetition_stats
from captioning.models.params import count
from captioning.precision import autocast
from captioning.progress import bar as progress_bar

#: the baseline's metrics: the fast ones (METEOR's JVM would cost a cached pipeline re-run seconds for one row)
BASELINE_METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr")


def most_frequent_caption(train_captions: Iterable[str], references: Mapping[int, Sequence[str]], *,
                          metrics: Sequence[str] = BASELINE_METRICS) -> tuple[str, dict]:
    """The baseline every captioner must beat: the most frequent training caption (ties: the first in sort
    order), predicted for every image of ``references`` and scored with :func:`score` -> (caption, its score)."""
    counts = Counter(train_captions)
    if not counts:
        raise ValueError("no training captions to take the most frequent one from")
    caption = min(counts, key=lambda c: (-counts[c], c))
    return caption, score({k: caption for k in references}, references, metrics=metrics)


def _constraint(decoding_constraint: bool, codec: RadixCodec | None) -> dict:
    """Search keywords of the decoding constraint (a radix word is ``codec.digits`` tokens)."""
    if not decoding_constraint:
        return {}
    return {"decoding_constraint": True, "word_tokens": codec.digits if codec is not None else 1}


def predict(model, source: FeatureSource, rows: np.ndarray, vocab: Vocabulary, *, codec: RadixCodec | None,
            max_tokens: int, beam: int = 3, batch_size: int = 50, device: str | torch.device = "cpu",
            progress: bool = False, desc: str = "decoding", precision: str = "fp32",
            decoding_constraint: bool = False) -> dict[int, str]:
    """``{image id: caption}`` for the images of ``rows`` (beam 1 = greedy); ``precision``: see
    :mod:`captioning.precision` (autocast on CUDA only; the search itself scores in float32);
    ``decoding_constraint``: no word right after itself (:mod:`captioning.decoding.search`)."""
    kw = _constraint(decoding_constraint, codec)
    model.eval()
    out: dict[int, str] = {}
    n_batches = -(-len(rows) // batch_size)
    for b in progress_bar(image_batches(source, rows, batch_size), total=n_batches, desc=desc, enabled=progress,
                  leave=False):
        b = b.to(device)
        with torch.inference_mode(), autocast(precision, device, cache=False):
            memory = model.encode(b.features.float(), b.boxes, b.region_mask)
            d = greedy(model, memory, max_len=max_tokens, **kw) if beam == 1 else \
                beam_search(model, memory, beam=beam, max_len=max_tokens, **kw)
        for iid, cap in zip(b.image_ids.tolist(), to_words(d.flat(), vocab, codec), strict=True):
            out[int(iid)] = cap
    return out


def greedy_cider_validator(source: FeatureSource, rows: np.ndarray, references: Mapping[int, Sequence[str]],
                           vocab: Vocabulary, *, codec: RadixCodec | None, max_tokens: int, batch_size: int = 50,
                           device: str | torch.device = "cpu", precision: str = "fp32"
                           ) -> Callable[..., dict[str, float]]:
    """A ``validate(model)`` callback: greedy captions of ``rows`` -> {"CIDEr": fast CIDEr-D} (df from the
    split's own references, as coco-caption computes it)."""
    cider = CiderD({k: list(v) for k, v in references.items()})

    def validate(model) -> dict[str, float]:
        caps = predict(model, source, rows, vocab, codec=codec, max_tokens=max_tokens, beam=1,
                       batch_size=batch_size, device=device, precision=precision)
        mean, _ = cider.score({k: v for k, v in caps.items() if k in cider.references})
        return {"CIDEr": mean}

    return validate


def latency_ms(model, source: FeatureSource, rows: np.ndarray, *, max_tokens: int, beam: int = 3, images: int = 20,
               device: str | torch.device = "cpu", precision: str = "fp32", decoding_constraint: bool = False,
               codec: RadixCodec | None = None) -> float:
    """Median wall time (ms) to caption one image (encode + beam search, batch 1) over ``images`` images."""
    kw = _constraint(decoding_constraint, codec)
    model.eval()
    times = []
    picked = np.sort(np.asarray(rows)[:images])
    for i, b in enumerate(image_batches(source, picked, 1)):
        b = b.to(device)
        if device != "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode(), autocast(precision, device, cache=False):
            memory = model.encode(b.features.float(), b.boxes, b.region_mask)
            if beam == 1:
                greedy(model, memory, max_len=max_tokens, **kw)
            else:
                beam_search(model, memory, beam=beam, max_len=max_tokens, **kw)
        if device != "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
        if i:  # the first call warms up allocators and kernels
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times) if times else float("nan")


@dataclass(frozen=True)
class Evaluation:
    """One model's scores on one split: the caption metrics (``metrics``: pycocoevalcap's names; None = not
    computed, e.g. SPICE without its jars), its size and speed, the diversity of its captions and the captions
    themselves (``predictions``: COCO results, ``[{"image_id", "caption"}]``)."""

    metrics: dict[str, float | None]
    spice: Any
    images: int
    beam: int
    params: int
    params_convention: str
    latency_ms: float
    decoding_constraint: bool
    novel_fraction: float
    unique_fraction: float
    avg_length: float
    vocab_used: int
    distinct_captions: int
    repeat_caption_fraction: float
    repeated_token_rate: float
    predictions: list[dict[str, Any]] = field(repr=False, default_factory=list)

    #: the figures beside the metrics that the pipeline logs and ranks by
    SUMMARY: ClassVar[tuple[str, ...]] = ("params", "latency_ms", "novel_fraction", "avg_length", "unique_fraction",
                                          "distinct_captions", "repeat_caption_fraction", "repeated_token_rate")

    def summary(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.SUMMARY}

    def scored(self) -> dict[str, float]:
        """The metrics that were computed."""
        return {k: v for k, v in self.metrics.items() if v is not None}

    def to_json(self, predictions: bool = False) -> dict[str, Any]:
        """The evaluation as JSON (``metrics.json``); the captions only when asked."""
        d = asdict(self)
        if not predictions:
            d.pop("predictions")
        return d


def evaluate_model(model, source: FeatureSource, rows: np.ndarray, references: Mapping[int, Sequence[str]],
                   vocab: Vocabulary, *, codec: RadixCodec | None, max_tokens: int, beam: int = 3,
                   train_captions: Iterable[str] = (), params_convention: str = "full",
                   spice_jars: str | Path | None = None, latency_images: int = 20, batch_size: int = 50,
                   device: str | torch.device = "cpu", progress: bool = False, precision: str = "fp32",
                   decoding_constraint: bool = False) -> Evaluation:
    """Predictions + metrics of one model on one split (ARCHITECTURE.md, "Predictions and metrics")."""
    preds = predict(model, source, rows, vocab, codec=codec, max_tokens=max_tokens, beam=beam,
                    batch_size=batch_size, device=device, progress=progress, precision=precision,
                    decoding_constraint=decoding_constraint)
    scored = score(preds, references, spice_jars=spice_jars)
    stats = caption_stats(preds, train_captions)
    reps = repetition_stats(preds.values())
    return Evaluation(
        metrics=scored["metrics"], spice=scored["spice"], images=scored["images"], beam=beam,
        params=count(model, params_convention), params_convention=params_convention,
        latency_ms=latency_ms(model, source, rows, max_tokens=max_tokens, beam=beam, images=latency_images,
                              device=device, precision=precision, decoding_constraint=decoding_constraint,
                              codec=codec),
        decoding_constraint=decoding_constraint, novel_fraction=stats["novel_fraction"],
        unique_fraction=stats["unique_fraction"], avg_length=stats["avg_length"], vocab_used=stats["vocab_used"],
        distinct_captions=reps["distinct_captions"], repeat_caption_fraction=reps["repeat_caption_fraction"],
        repeated_token_rate=reps["repeated_token_rate"],
        predictions=[{"image_id": k, "caption": v} for k, v in sorted(preds.items())])
