"""Sequence-level knowledge distillation (SeqKD, SATIC): the teacher's beam-search captions of the training
images become a new caption source in the label store.

The teacher decodes every training image (beam 5 by default, at most ``max_words`` words) in batches; the top
``n_best`` hypotheses per image are stored as word ids under a named source (e.g. ``seqkd:<teacher digest>``),
next to the ground truth, so a student can train on ground truth, SeqKD captions or both
(:func:`captioning.training.recipe.label_sources`). The report says how far the distilled captions are from the
ground truth: CIDEr-D against the image's references, the share identical to one of them, lengths and
vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import numpy as np
import torch

from captioning.data.karpathy import SPLIT_CODES
from captioning.data.loader import FeatureSource, image_batches
from captioning.data.stores import LabelStore, StoreError
from captioning.data.text import RadixCodec, Vocabulary
from captioning.decoding import beam_search, word_ids
from captioning.metrics.cider import CiderD
from captioning.precision import autocast
from captioning.progress import bar as progress_bar
from captioning.training.recipe import references, split_rows

log = logging.getLogger(__name__)


@dataclass
class SeqKDReport:
    source: str
    source_code: int
    images: int
    captions: int
    avg_length: float
    gt_avg_length: float
    exact_match_fraction: float  # distilled caption identical to one of the image's references
    cider_vs_ground_truth: float  # CIDEr-D of the distilled captions against the references (train df)
    vocab_used: int
    gt_vocab_used: int

    def to_json(self) -> dict:
        return asdict(self)


def generate_seqkd(teacher, source: FeatureSource, labels_uri: str, vocab: Vocabulary, *, name: str,
                   codec: RadixCodec | None = None, beam: int = 5, n_best: int = 1, max_words: int = 16,
                   batch_size: int = 50, split: str = "train", device: str | torch.device = "cpu",
                   progress: bool = False, precision: str = "fp32") -> SeqKDReport:
    """Decode ``split`` with ``teacher`` and append the captions to the label store as source ``name``
    (``precision``: see :mod:`captioning.precision`)."""
    store = LabelStore.open(labels_uri, mode="r+")
    labels = store.read()
    if name in labels.sources.values():
        raise StoreError(f"{labels_uri}: SeqKD source {name!r} exists already (captions of that teacher are there)")
    refs = references(labels, vocab, split)
    rows = split_rows(labels, split, source.ok_rows())
    if not len(rows):
        raise ValueError(f"no {split} images with features to distil")
    width = int(store.group["tokens"].shape[1])
    max_words = min(max_words, width)
    per_word = codec.digits if codec is not None else 1
    max_tokens = max_words * per_word + 1
    teacher.eval().to(device)
    toks, lens, img_rows, img_ids = [], [], [], []
    n_batches = -(-len(rows) // batch_size)
    for b in progress_bar(image_batches(source, rows, batch_size), total=n_batches, desc="SeqKD", enabled=progress,
                  leave=False):
        b = b.to(device)
        with torch.inference_mode(), autocast(precision, device, cache=False):
            memory = teacher.encode(b.features.float(), b.boxes, b.region_mask)
            d = beam_search(teacher, memory, beam=beam, max_len=max_tokens, n_best=n_best)
        for i, (r, iid) in enumerate(zip(b.rows.tolist(), b.image_ids.tolist(), strict=True)):
            for j in range(n_best):
                w = word_ids(d.tokens[i, j].tolist(), codec)[0][:max_words]
                row = np.zeros(width, np.int32)
                row[: len(w)] = w
                toks.append(row)
                lens.append(len(w))
                img_rows.append(r)
                img_ids.append(iid)
    tokens = np.stack(toks)
    split_code = np.full(len(tokens), SPLIT_CODES[split], np.int8)
    code = store.add_source(name, tokens, np.asarray(lens), np.asarray(img_rows), np.asarray(img_ids), split_code)

    # how far from the ground truth
    gt = {k: [" ".join(map(str, r)) for r in v] for k, v in refs.ids.items()}
    cider = CiderD(gt)
    cands = [" ".join(map(str, t[:n])) for t, n in zip(tokens, lens, strict=True)]
    per = cider.score_batch(cands, img_ids)
    exact = np.mean([c in set(gt[i]) for c, i in zip(cands, img_ids, strict=True)])
    gt_words = [w for v in refs.ids.values() for r in v for w in r]
    report = SeqKDReport(
        source=name, source_code=code, images=len(rows), captions=len(tokens), avg_length=float(np.mean(lens)),
        gt_avg_length=float(np.mean([len(r) for v in refs.ids.values() for r in v])),
        exact_match_fraction=float(exact), cider_vs_ground_truth=float(np.mean(per)),
        vocab_used=len({int(w) for t, n in zip(tokens, lens, strict=True) for w in t[:n]}),
        gt_vocab_used=len(set(gt_words)),
    )
    log.info("SeqKD %s: %s", name, report.to_json())
    return report
