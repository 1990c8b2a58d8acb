"""The training stages of the pipeline as plain functions: XE (teacher or student), SeqKD, SCST, evaluation.

Each takes a :class:`StageContext` (the stage plan, vocabulary, label store, feature store, references) and a
checkpoint folder, so a stage that is killed resumes from its last epoch checkpoint when called again. The
Prefect tasks, ``capflow train`` and ``capflow bench learning`` call these; none of them re-implements
training logic. Nothing here knows about Prefect, MLflow or the pipeline's config: the plans come from
:mod:`captioning.training.recipe`, per-epoch metrics go to ``on_epoch``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from captioning.data.karpathy import Dataset
from captioning.data.loader import FeatureSource, ZarrFeatures, region_stats
from captioning.data.stores import Labels, LabelStore
from captioning.data.text import Vocabulary
from captioning.metrics.evaluation import evaluate_model, greedy_cider_validator
from captioning.models.encoder_decoder import ArchConfig, Captioner
from captioning.models.registry import PAPER_PARAMS
from captioning.training import checkpoint
from captioning.training.loop import TrainResult, TrainSettings, load_model, train
from captioning.training.recipe import (
    TEACHER_NAMES,
    StagePlan,
    TrainPlan,
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


@dataclass
class StageContext:
    plan: StagePlan
    vocab: Vocabulary
    labels_uri: str
    source: FeatureSource
    dataset: Dataset | None = None  # for metric references (full captions) and novelty; else the label store
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    progress: bool = False

    def __post_init__(self) -> None:
        self._labels: Labels | None = None

    @classmethod
    def from_paths(cls, plan: StagePlan, vocab_path: str | Path, labels_uri: str, features_uri: str,
                   dataset: Dataset | None = None, progress: bool = False) -> StageContext:
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

    @property
    def d_in(self) -> int:
        src = self.source
        return int(src.store.feature_dim) if isinstance(src, ZarrFeatures) else int(src.read(src.ok_rows()[:1])
                                                                                     .features[0].shape[1])

    def rows(self, split: str) -> np.ndarray:
        return split_rows(self.labels, split, self.source.ok_rows())

    def text_references(self, split: str) -> dict[int, list[str]]:
        if self.dataset is not None:
            return {e.image_id: list(e.captions) for e in self.dataset.split(split)}
        return references(self.labels, self.vocab, split).text

    def train_captions(self) -> list[str]:
        if self.dataset is not None:
            return [c for e in self.dataset.split("train") for c in e.captions]
        return [c for v in references(self.labels, self.vocab, "train").text.values() for c in v]

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
           stop_after_steps: int | None = None) -> tuple[Captioner, TrainResult, dict[str, Any]]:
    """XE training of ``arch`` (teacher or student) on ground truth / SeqKD / both; resumes from ckpt_dir.

    ``init_from``: a checkpoint whose matching tensors initialise the model (SATIC weight-init from the teacher).
    A model that standardises its features (``arch.standardize_features``) gets the training split's region
    statistics: those stored in ``init_from`` when it has them (the teacher's: the same split), else computed.
    Returns the best-validation model, the train result and an info dict (init report, sources). ``settings``:
    unset = the students' XE settings of the plan."""
    s = settings or ctx.plan.xe
    torch.manual_seed(s.seed)
    model = Captioner(arch)
    info: dict[str, Any] = {"captions": captions, "seqkd_source": seqkd_source}
    fresh = not (Path(ckpt_dir) / "last.pt").exists()  # else train() resumes every tensor from last.pt
    loaded: set[str] = set()
    if init_from is not None and fresh:
        st = checkpoint.load(init_from)
        rep = checkpoint.init_from(model, st["state_dict"])
        loaded = set(rep["loaded"])
        info["init_from"] = str(init_from)
        info["init_loaded"], info["init_skipped"] = len(rep["loaded"]), len(rep["skipped"])
    if arch.standardize_features and fresh and not {"feature_mean", "feature_scale"} <= loaded:
        model.set_feature_stats(*map(torch.from_numpy, region_stats(ctx.source, ctx.rows("train"))))
    codec = codec_for(arch, ctx.vocab)
    data = caption_dataset(ctx.source, ctx.labels, ctx.plan, codec=codec,
                           sources=label_sources(ctx.labels, captions, seqkd_source))
    res = train(model, data, s, ckpt_dir, validate=ctx.validator(model), on_epoch=on_epoch, device=ctx.device,
                vocab_digest=ctx.vocab.digest(), progress=ctx.progress, stop_after_steps=stop_after_steps)
    best, _ = load_model(res.best_checkpoint or res.last_checkpoint, device=ctx.device)
    return best, res, info


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
             stop_after_steps: int | None = None, student: str | None = None) -> tuple[Captioner, TrainResult]:
    """SCST fine-tuning starting from ``init_checkpoint`` (the XE best); resumes from ckpt_dir/last.pt.
    ``student`` names the student whose ``students.per_student`` SCST epochs apply (when ``settings`` is not
    given).

    The starting weights are validated first and compete for the best checkpoint (``best_epoch == -1``: no SCST
    epoch beat them on validation, and the returned model is the starting one). The model trains with
    ``students.scst.dropout`` at every dropout site (unset: its XE rates); its checkpoints record that rate."""
    p = ctx.plan
    s = settings or p.scst_for(student)
    model, _ = load_model(init_checkpoint, device=ctx.device, dropout=p.scst_dropout)
    codec = codec_for(model, ctx.vocab)
    refs = references(ctx.labels, ctx.vocab, "train").ids
    loss = ScstLoss(refs, samples=p.scst_samples, baseline=p.scst_baseline, max_tokens=ctx.max_tokens(model),
                    codec=codec)
    data = caption_dataset(ctx.source, ctx.labels, p, codec=codec, captions_per_image=1, seed_offset=1)

    def epoch_done(epoch: int, metrics: dict[str, Any]) -> None:
        metrics.update(loss.pop_stats())
        if on_epoch is not None:
            on_epoch(epoch, metrics)

    res = train(model, data, s, ckpt_dir, validate=ctx.validator(model), on_epoch=epoch_done, device=ctx.device,
                vocab_digest=ctx.vocab.digest(), loss_fn=loss, progress=ctx.progress,
                stop_after_steps=stop_after_steps, select_start=True)
    best, _ = load_model(res.best_checkpoint or res.last_checkpoint, device=ctx.device)
    return best, res


def params_convention(arch_name: str) -> str:
    name = preset_name(arch_name)
    return PAPER_PARAMS.get(name, (None, "full"))[1]


def evaluate(ctx: StageContext, model: Captioner, *, split: str = "test", arch_name: str = "aic",
             latency_images: int = 20, decoding_constraint: bool | None = None) -> dict[str, Any]:
    """Beam-decode ``split`` and score it (metrics, params, latency, novelty, length, predictions).
    ``decoding_constraint``: None = ``evaluation.decoding_constraint``."""
    if decoding_constraint is None:
        decoding_constraint = ctx.plan.decoding_constraint
    return evaluate_model(
        model, ctx.source, ctx.rows(split), ctx.text_references(split), ctx.vocab, codec=codec_for(model, ctx.vocab),
        max_tokens=ctx.max_tokens(model), beam=ctx.plan.eval_beam, train_captions=ctx.train_captions(),
        params_convention=params_convention(arch_name), spice_jars=ctx.plan.spice_jars,
        latency_images=latency_images, device=ctx.device, progress=ctx.progress, precision=ctx.precision,
        decoding_constraint=decoding_constraint)


# ---------------------------------------------------------------------- one model, one or N processes
@dataclass(frozen=True)
class TrainSpec:
    """What to train: ``model`` is ``teacher`` (AIC, ``teacher.*`` settings) or a student family / registry preset
    (``students.*`` settings); XE on ``captions``, or SCST from ``scst_from`` (an XE checkpoint). Checkpoints go to
    ``out`` (a killed run resumes from ``out/last.pt``)."""
    model: str
    vocab_path: str
    labels_uri: str
    features_uri: str
    out: str
    captions: str = "ground_truth"
    seqkd_source: str | None = None
    init_from: str | None = None
    scst_from: str | None = None
    dataset_path: str | None = None  # full reference captions for validation (else the label store's)

    @property
    def is_teacher(self) -> bool:
        return self.model in TEACHER_NAMES


def _spec_context(plan: TrainPlan, spec: TrainSpec, progress: bool) -> StageContext:
    ds = Dataset.load(spec.dataset_path) if spec.dataset_path else None
    return StageContext.from_paths(plan.stage, spec.vocab_path, spec.labels_uri, spec.features_uri, ds,
                                   progress=progress)


def _fit(ctx: StageContext, plan: TrainPlan, spec: TrainSpec, on_epoch: EpochFn | None
         ) -> tuple[TrainResult, dict[str, Any]]:
    if spec.scst_from:
        _, res = fit_scst(ctx, spec.scst_from, spec.out, settings=plan.scst, on_epoch=on_epoch)
        return res, {}
    _, res, info = fit_xe(ctx, plan.arch(ctx.vocab, ctx.d_in), spec.out, settings=plan.xe, captions=spec.captions,
                          seqkd_source=spec.seqkd_source, init_from=spec.init_from, on_epoch=on_epoch)
    return res, {k: v for k, v in info.items() if k.startswith("init_") and isinstance(v, int)}


def _result_json(fitted: tuple[TrainResult, dict[str, Any]], world: int) -> dict[str, Any]:
    res, init = fitted
    return {"init": init, "best_metric": res.best_metric, "best_epoch": res.best_epoch, "epochs_run": res.epochs_run,
            "resumed_from_epoch": res.resumed_from_epoch, "history": res.history, "processes": world,
            "best_checkpoint": str(res.best_checkpoint) if res.best_checkpoint else None,
            "last_checkpoint": str(res.last_checkpoint)}


def train_rank(rank: int, world: int, plan_json: str, spec_json: dict[str, Any], progress: bool) -> dict[str, Any]:
    """One data-parallel process of :func:`run_training` (what :func:`captioning.training.ddp.launch` runs)."""
    from captioning.training.ddp import rank_device

    plan = TrainPlan.from_json(plan_json)
    spec = TrainSpec(**spec_json)
    ctx = _spec_context(plan, spec, progress and rank == 0)
    ctx.device = rank_device()
    return _result_json(_fit(ctx, plan, spec, None), world)


def run_training(plan: TrainPlan, spec: TrainSpec, *, nproc: int = 1, on_epoch: EpochFn | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """Train one model as ``spec`` says with ``plan``'s settings (:func:`captioning.training.recipe.train_plan`),
    in this process (``nproc`` 1; ``on_epoch`` sees every epoch) or in ``nproc`` data-parallel processes (torch DDP
    on this machine: one GPU per process on CUDA, gloo on CPU; the epochs are returned in ``history``). Returns
    best/last checkpoints, best metric and epoch, history."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if nproc == 1:
        ctx = _spec_context(plan, spec, progress)
        return _result_json(_fit(ctx, plan, spec, on_epoch), 1)
    from dataclasses import asdict

    from captioning.training.ddp import launch

    device = resolve_device(plan.stage.device)
    return launch(train_rank, nproc, plan.to_json(), asdict(spec), progress,
                  device="cuda" if device.type == "cuda" else "cpu")
