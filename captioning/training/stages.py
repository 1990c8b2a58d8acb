"""The training stages as plain functions over one model's plan and its opened inputs: XE (teacher or student),
SeqKD, SCST, evaluation - and :func:`run_training`, one model's training in one or N data-parallel processes.

A :class:`StageContext` is a :class:`~captioning.training.recipe.ModelPlan` with its inputs opened once (the
vocabulary, the label store, the feature store, the dataset's captions); every function takes it and a checkpoint
folder, so a stage that is killed resumes from its last epoch checkpoint when called again. Training returns a
:class:`FitResult`, evaluation a :class:`~captioning.metrics.evaluation.Evaluation`. Nothing here knows about
Prefect, MLflow or the pipeline's config; per-epoch metrics go to ``on_epoch``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from captioning.data.columnar import DatasetFile
from captioning.data.karpathy import Dataset, open_dataset
from captioning.data.loader import FeatureSource, ZarrFeatures, region_stats
from captioning.data.stores import Labels, LabelStore
from captioning.data.text import Vocabulary
from captioning.metrics.evaluation import Evaluation, evaluate_model, greedy_cider_validator
from captioning.models.encoder_decoder import ArchConfig, Captioner
from captioning.models.registry import PAPER_PARAMS
from captioning.training import checkpoint
from captioning.training.loop import FitResult, TrainSettings, load_model, train
from captioning.training.recipe import (
    ModelPlan,
    caption_dataset,
    codec_for,
    label_sources,
    max_tokens,
    preset_name,
    references,
    split_rows,
)
from captioning.training.scst import ScstLoss
from captioning.training.seqkd import SeqKDReport, generate_seqkd
from captioning.util import resolve_device

log = logging.getLogger(__name__)
EpochFn = Callable[[int, dict[str, Any]], None]


@dataclass(frozen=True)
class Inputs:
    """Where one model's inputs are (paths or URIs): what data-parallel ranks and torchrun jobs open themselves.
    ``dataset``: the normalised dataset (full reference captions for validation and evaluation; else the label
    store's)."""

    vocab: str
    labels: str
    features: str
    dataset: str | None = None

    def open(self, plan: ModelPlan, progress: bool = False) -> StageContext:
        ds = open_dataset(self.dataset) if self.dataset else None  # streamed where it is a dataset file
        return StageContext.from_paths(plan, self.vocab, self.labels, self.features, ds, progress=progress)


@dataclass
class StageContext:
    """One model's plan and its inputs, opened once: every stage function of one job reads the same objects."""

    plan: ModelPlan
    vocab: Vocabulary
    labels_uri: str
    source: FeatureSource
    dataset: Dataset | DatasetFile | None = None  # metric references (full captions), novelty; else the labels
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    progress: bool = False

    def __post_init__(self) -> None:
        self._labels: Labels | None = None

    @classmethod
    def from_paths(cls, plan: ModelPlan, vocab_path: str | Path, labels_uri: str, features_uri: str,
                   dataset: Dataset | DatasetFile | None = None, progress: bool = False) -> StageContext:
        return cls(plan, Vocabulary.load(vocab_path), labels_uri, ZarrFeatures(features_uri), dataset,
                   resolve_device(plan.device), progress)

    @property
    def precision(self) -> str:
        """``run.precision`` (resolved against the device where it is used: see :mod:`captioning.precision`)."""
        return self.plan.precision

    @property
    def labels(self) -> Labels:
        if self._labels is None:
            self._labels = LabelStore.open(self.labels_uri).read()
        return self._labels

    def reload_labels(self) -> None:
        self._labels = None

    def references(self, split: str, spill: bool = False):
        """Ground-truth references of ``split`` (:func:`~captioning.training.recipe.references`): from the labels in
        memory once they are read, else streamed from the store a chunk at a time (``spill``: their tokens read from
        temporary files by position)."""
        if self._labels is not None:
            return references(self._labels, self.vocab, split)
        return references(LabelStore.open(self.labels_uri), self.vocab, split, spill=spill)

    @property
    def d_in(self) -> int:
        src = self.source
        return int(src.store.feature_dim) if isinstance(src, ZarrFeatures) else int(src.read(src.ok_rows()[:1])
                                                                                     .features[0].shape[1])

    def arch(self) -> ArchConfig:
        """The plan's architecture for these inputs (their vocabulary and feature width)."""
        return self.plan.arch(self.vocab, self.d_in)

    def rows(self, split: str) -> np.ndarray:
        return split_rows(self.labels, split, self.source.ok_rows())

    def text_references(self, split: str) -> dict[int, list[str]]:
        if self.dataset is not None:
            return {e.image_id: list(e.captions) for e in self.dataset.iter_entries(split)}
        return self.references(split).text

    def train_captions(self) -> list[str]:
        if self.dataset is not None:
            return [c for e in self.dataset.iter_entries("train") for c in e.captions]
        return [c for v in self.references("train").text.values() for c in v]

    def max_tokens(self, model: Captioner | ArchConfig) -> int:
        return max_tokens(model, self.plan.max_words, self.vocab.radix())

    def validator(self, model: Captioner):
        codec = codec_for(model, self.vocab)
        return greedy_cider_validator(self.source, self.rows("val"), self.text_references("val"), self.vocab,
                                      codec=codec, max_tokens=self.max_tokens(model), device=self.device,
                                      precision=self.precision)


def fit_xe(ctx: StageContext, arch: ArchConfig, ckpt_dir: str | Path, *, settings: TrainSettings | None = None,
           captions: str = "ground_truth", seqkd_source: str | None = None,
           init_from: str | Path | None = None, on_epoch: EpochFn | None = None,
           stop_after_steps: int | None = None) -> FitResult:
    """XE training of ``arch`` (teacher or student) on ground truth / SeqKD / both; resumes from ckpt_dir.

    ``init_from``: a checkpoint whose matching tensors initialise the model (SATIC weight-init from the teacher).
    A model that standardises its features (``arch.standardize_features``) gets the training split's region
    statistics: those stored in ``init_from`` when it has them (the teacher's: the same split), else computed.
    ``settings``: unset = the plan's XE settings."""
    t0 = time.perf_counter()
    s = settings or ctx.plan.xe
    torch.manual_seed(s.seed)
    model = Captioner(arch)
    fresh = not (Path(ckpt_dir) / "last.pt").exists()  # else train() resumes every tensor from last.pt
    init: dict[str, Any] | None = None
    if init_from is not None and fresh:
        rep = checkpoint.init_from(model, checkpoint.load(init_from)["state_dict"])
        init = {"loaded": len(rep["loaded"]), "skipped": len(rep["skipped"]), "names": set(rep["loaded"])}
    if arch.standardize_features and fresh and not {"feature_mean", "feature_scale"} <= (init or {}).get("names",
                                                                                                         set()):
        model.set_feature_stats(*map(torch.from_numpy, region_stats(ctx.source, ctx.rows("train"))))
    codec = codec_for(arch, ctx.vocab)
    data = caption_dataset(ctx.source, ctx.labels, ctx.plan, codec=codec,
                           sources=label_sources(ctx.labels, captions, seqkd_source))
    res = train(model, data, s, ckpt_dir, validate=ctx.validator(model), on_epoch=on_epoch, device=ctx.device,
                vocab_digest=ctx.vocab.digest(), progress=ctx.progress, stop_after_steps=stop_after_steps)
    return replace(res, init_loaded=(init or {}).get("loaded"), init_skipped=(init or {}).get("skipped"),
                   seconds=time.perf_counter() - t0)


def seqkd(ctx: StageContext, teacher: Captioner, name: str) -> SeqKDReport:
    """Teacher captions of the training images -> label-store source ``name`` (idempotent per name)."""
    existing = ctx.labels.sources.values()
    if name in existing:
        raise ValueError(f"SeqKD source {name!r} is already in {ctx.labels_uri}")
    rep = generate_seqkd(teacher, ctx.source, ctx.labels_uri, ctx.vocab, name=name, codec=codec_for(teacher, ctx.vocab),
                         beam=ctx.plan.seqkd_beam, max_words=ctx.plan.max_words,
                         device=ctx.device, progress=ctx.progress, precision=ctx.precision)
    ctx.reload_labels()
    return rep


def fit_scst(ctx: StageContext, init_checkpoint: str | Path, ckpt_dir: str | Path, *,
             settings: TrainSettings | None = None, on_epoch: EpochFn | None = None,
             stop_after_steps: int | None = None) -> FitResult:
    """SCST fine-tuning starting from ``init_checkpoint`` (the XE best) with the plan's SCST (``settings``: other
    train settings); resumes from ckpt_dir/last.pt.

    The starting weights are validated first and compete for the best checkpoint (``best_epoch == -1``: no SCST
    epoch beat them on validation, and the best checkpoint is the starting one). The model trains with the plan's
    SCST dropout at every dropout site (unset: its XE rates); its checkpoints record that rate."""
    t0 = time.perf_counter()
    sp = ctx.plan.scst
    if sp is None:
        raise ValueError(f"the plan of {ctx.plan.label} has no SCST (students.scst.enabled is false)")
    model, _ = load_model(init_checkpoint, device=ctx.device, dropout=sp.dropout)
    codec = codec_for(model, ctx.vocab)
    refs = ctx.references("train", spill=True)  # compact arrays (tokens in a file): ScstLoss's rewards read them
    loss = ScstLoss(refs, samples=sp.samples, baseline=sp.baseline, max_tokens=ctx.max_tokens(model), codec=codec)
    data = caption_dataset(ctx.source, ctx.labels, ctx.plan, codec=codec, captions_per_image=1, seed_offset=1)

    def epoch_done(epoch: int, metrics: dict[str, Any]) -> None:
        metrics.update(loss.pop_stats())
        if on_epoch is not None:
            on_epoch(epoch, metrics)

    res = train(model, data, settings or sp.settings, ckpt_dir, validate=ctx.validator(model), on_epoch=epoch_done,
                device=ctx.device, vocab_digest=ctx.vocab.digest(), loss_fn=loss, progress=ctx.progress,
                stop_after_steps=stop_after_steps, select_start=True)
    return replace(res, seconds=time.perf_counter() - t0)


def params_convention(arch_name: str) -> str:
    name = preset_name(arch_name)
    return PAPER_PARAMS.get(name, (None, "full"))[1]


def evaluate(ctx: StageContext, model: Captioner, *, split: str = "test", latency_images: int = 20,
             decoding_constraint: bool | None = None) -> Evaluation:
    """Beam-decode ``split`` with the plan's beam and score it (metrics, params - counted by the plan's preset's
    convention -, latency, novelty, length, predictions). ``decoding_constraint``: None = the plan's."""
    p = ctx.plan
    return evaluate_model(
        model, ctx.source, ctx.rows(split), ctx.text_references(split), ctx.vocab, codec=codec_for(model, ctx.vocab),
        max_tokens=ctx.max_tokens(model), beam=p.eval_beam, train_captions=ctx.train_captions(),
        params_convention=params_convention(p.preset), spice_jars=p.spice_jars, latency_images=latency_images,
        device=ctx.device, progress=ctx.progress, precision=ctx.precision,
        decoding_constraint=p.decoding_constraint if decoding_constraint is None else decoding_constraint)


# ---------------------------------------------------------------------- one model, one or N processes
def _fit(ctx: StageContext, out: str, phase: str, start: str | None, seqkd_source: str | None,
         on_epoch: EpochFn | None) -> FitResult:
    if phase == "scst":
        if start is None:
            raise ValueError("SCST needs the XE checkpoint it starts from")
        return fit_scst(ctx, start, out, on_epoch=on_epoch)
    if phase != "xe":
        raise ValueError(f"phase must be 'xe' or 'scst', got {phase!r}")
    return fit_xe(ctx, ctx.arch(), out, captions=ctx.plan.captions, seqkd_source=seqkd_source, init_from=start,
                  on_epoch=on_epoch)


def job_document(plan: ModelPlan, inputs: Inputs, out: str, *, phase: str = "xe", start: str | None = None,
                 seqkd_source: str | None = None) -> dict[str, Any]:
    """One training run as JSON (what a data-parallel rank or a torchrun job receives)."""
    return {"plan": json.loads(plan.to_json()), "inputs": asdict(inputs), "out": str(out), "phase": phase,
            "start": start, "seqkd_source": seqkd_source}


def train_rank(rank: int, world: int, job: dict[str, Any], progress: bool) -> dict[str, Any]:
    """One data-parallel process of :func:`run_training` (what :func:`captioning.training.ddp.launch` and
    ``python -m captioning.training.torchrun`` run): the job of :func:`job_document`; returns the FitResult's
    JSON."""
    from captioning.training.ddp import rank_device

    plan = ModelPlan.from_json(job["plan"])
    ctx = Inputs(**job["inputs"]).open(plan, progress and rank == 0)
    ctx.device = rank_device()
    return asdict(_fit(ctx, job["out"], job["phase"], job["start"], job["seqkd_source"], None))


def run_training(plan: ModelPlan, inputs: Inputs | StageContext, out: str | Path, *, phase: str = "xe",
                 start: str | None = None, seqkd_source: str | None = None, nproc: int | None = None,
                 on_epoch: EpochFn | None = None, progress: bool = False) -> FitResult:
    """Train ``plan``'s model: ``phase`` ``xe`` (on the plan's captions - ``seqkd_source`` names the SeqKD source -,
    initialised from ``start`` when given) or ``scst`` (from the XE checkpoint ``start``), checkpoints in ``out``
    (a killed run resumes from ``out/last.pt``). In this process (``nproc`` 1; ``on_epoch`` sees every epoch;
    ``inputs`` may be the job's opened :class:`StageContext`) or in ``nproc`` data-parallel processes (torch DDP
    on this machine: one GPU per process on CUDA, gloo on CPU; the epochs are in ``history``). ``nproc``: None =
    the plan's."""
    nproc = plan.nproc if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if nproc == 1:
        ctx = inputs if isinstance(inputs, StageContext) else inputs.open(plan, progress)
        return _fit(ctx, str(out), phase, start, seqkd_source, on_epoch)
    if isinstance(inputs, StageContext):
        raise ValueError("data-parallel training opens its inputs in each process: give their paths (Inputs)")
    from captioning.training.ddp import launch

    t0 = time.perf_counter()
    device = resolve_device(plan.device)
    doc = launch(train_rank, nproc, job_document(plan, inputs, str(out), phase=phase, start=start,
                                                 seqkd_source=seqkd_source), progress,
                 device="cuda" if device.type == "cuda" else "cpu")
    return FitResult(**{**doc, "seconds": time.perf_counter() - t0})
