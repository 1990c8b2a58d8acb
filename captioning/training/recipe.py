"""From config to training objects: which architecture a student name means at which size, how long its
sequences are, which captions it trains on, and the train settings of each stage.

One place maps the pipeline's vocabulary (``teacher.model``, ``students.names``/``size``/``per_student``,
``xe``/``scst`` sections) onto the library: :class:`StudentPlan` (what a student name means), :class:`StagePlan`
(what the stage functions of :mod:`captioning.training.stages` read - they never see the pipeline config) and
:class:`TrainPlan` (one model's training, for :func:`~captioning.training.stages.run_training`). The CLI, the
pipeline's jobs and the benchmarks build their plans here, so identical configs build identical models.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from captioning.config import ModelConfig, PipelineConfig, SCSTConfig, XEConfig
from captioning.data.karpathy import SPLIT_CODES
from captioning.data.loader import CaptionDataset, FeatureSource
from captioning.data.stores import GROUND_TRUTH, Labels
from captioning.data.text import BOS, EOS, PAD, RadixCodec, Vocabulary
from captioning.models.encoder_decoder import ArchConfig, Captioner
from captioning.models.registry import PRESETS, for_vocab, preset, scaled
from captioning.training.loop import TrainSettings, compile_mode

#: student family -> the registry preset that stands for it (any registry preset name is accepted as well)
FAMILIES: dict[str, str] = {
    "aic": "aic",
    "acort": "acort-base",
    "expansionnet": "expansionnet",
    "lw": "lw-1x",
    "satic": "satic-k4",
    "zodiac": "zodiac-sigmoid",
}

#: model sizes below the papers' ("base" = the preset exactly as published): d_model, layers, heads, d_ff
SIZES: dict[str, tuple[int, int, int, int]] = {
    "small": (256, 3, 8, 1024),
    "demo": (128, 2, 4, 512),
    "tiny": (32, 1, 2, 64),
}


def preset_name(name: str) -> str:
    """A student family (``satic``) or a registry preset (``satic-k2``) -> the registry preset name."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name in PRESETS:
        return name
    raise ValueError(f"unknown student {name!r}: use a family ({', '.join(FAMILIES)}) or a registry preset "
                     f"({', '.join(sorted(PRESETS))})")


#: the names that mean the AIC teacher (``capflow train --model``, a plan of the teacher as an evaluated model)
TEACHER_NAMES = ("teacher", "aic")


@dataclass(frozen=True)
class StudentPlan:
    """What the recipe makes of one student name, decided here once: its registry preset, the captions it trains
    on (the teacher's SeqKD captions or the ground truth), whether it starts from the teacher's weights, its own SCST
    section (its ``students.per_student`` entry applied) and whether its XE weights are evaluated too
    (``evaluation.xe``). The pipeline's student job, ``capflow train``, ``capflow bench learning`` and the stage keys
    all read it.

    ``label`` names the stage when one name is trained several ways (SATIC's ablation, :func:`satic_ablation`).
    The plan of ``teacher`` is the AIC teacher as an evaluated model: its XE weights are the teacher stage's, then
    SCST and evaluation as for a student."""

    name: str
    preset: str
    captions: str  # "seqkd" | "ground_truth"
    init_from_teacher: bool
    scst: SCSTConfig
    evaluate_xe: bool = False
    label: str = ""

    @property
    def is_teacher(self) -> bool:
        return self.name in TEACHER_NAMES

    @property
    def stage(self) -> str:
        """The stage's name: ``student-<label or name>``."""
        return f"student-{self.label or self.name}"

    @property
    def needs_teacher(self) -> bool:
        return self.captions == "seqkd" or self.init_from_teacher or self.is_teacher


def student_plan(cfg: PipelineConfig, name: str) -> StudentPlan:
    """The plan of student ``name`` (a family, a registry preset, or ``teacher``; unknown names raise
    ValueError)."""
    st = cfg.students
    if name in TEACHER_NAMES:
        return StudentPlan(name=name, preset=cfg.teacher.model.arch, captions="ground_truth", init_from_teacher=False,
                           scst=st.scst, evaluate_xe=cfg.evaluation.xe)
    own = st.overrides_for(name)
    return StudentPlan(name=name, preset=preset_name(name), captions="seqkd" if own.seqkd else "ground_truth",
                       init_from_teacher=own.teacher_init, scst=st.scst_for(name), evaluate_xe=cfg.evaluation.xe)


def satic_ablation(cfg: PipelineConfig, name: str = "satic") -> dict[str, StudentPlan]:
    """SATIC's Table 4 as three plans of ``name``: ``base`` (ground truth, random init), ``seqkd`` (SeqKD captions,
    random init) and ``weight_init`` (SeqKD captions, the teacher's weights), each its own stage."""
    plan = student_plan(cfg, name)
    return {variant: replace(plan, captions=captions, init_from_teacher=init, label=f"{name}-{variant}")
            for variant, captions, init in (("base", "ground_truth", False), ("seqkd", "seqkd", False),
                                            ("weight_init", "seqkd", True))}


def max_tokens(cfg: ArchConfig | Captioner, max_words: int, codec: RadixCodec | None) -> int:
    """Output tokens a caption of ``max_words`` words needs, EOS included (radix: ``digits`` per word)."""
    a = cfg.cfg if isinstance(cfg, Captioner) else cfg
    per_word = codec.digits if (a.codec == "radix" and codec is not None) else 1
    return max_words * per_word + 1


def _adapt(arch: ArchConfig, vocab: Vocabulary, d_in: int, max_words: int, dropout: float | None,
           standardize: bool) -> ArchConfig:
    codec = vocab.radix()
    k = arch.group_size
    per_word = codec.digits if arch.codec == "radix" else 1
    positions = -(-(max_words * per_word + 1 + k) // k) * k  # inputs: K starts + the caption, whole groups
    out = for_vocab(arch, word_vocab_size=len(vocab), bos=BOS, eos=EOS, radix_size=codec.size, radix_bos=codec.bos,
                    radix_eos=codec.eos, max_len=max(positions, arch.max_len if arch.pos_enc == "learned" else 0))
    changes = {"d_in": d_in, "standardize_features": standardize}
    if dropout is not None:
        changes["dropout"] = dropout
    return out.replace(**changes)


def teacher_arch(model: ModelConfig, vocab: Vocabulary, d_in: int, max_words: int, *,
                 standardize: bool = False) -> ArchConfig:
    """The AIC teacher (or any preset named by ``teacher.model.arch``) at the configured size; ``standardize``:
    ``loader.standardize_features``."""
    base = preset(preset_name(model.arch))
    sized = scaled(base, d_model=model.d_model, layers=model.layers, heads=model.heads, d_ff=model.d_ff)
    return _adapt(sized, vocab, d_in, max_words, model.dropout, standardize)


def student_arch(name: str, size: str, vocab: Vocabulary, d_in: int, max_words: int, *,
                 standardize: bool = False) -> ArchConfig:
    """A student family/preset at ``size`` ("base" = as published, else :data:`SIZES`)."""
    base = preset(preset_name(name))
    if size == "base":
        sized = base
    elif size in SIZES:
        d, n, h, f = SIZES[size]
        sized = scaled(base, d_model=d, layers=n, heads=h, d_ff=f)
    else:
        raise ValueError(f"unknown size {size!r}: base or one of {', '.join(SIZES)}")
    return _adapt(sized, vocab, d_in, max_words, None, standardize)


def codec_for(arch: ArchConfig | Captioner, vocab: Vocabulary) -> RadixCodec | None:
    a = arch.cfg if isinstance(arch, Captioner) else arch
    return vocab.radix() if a.codec == "radix" else None


def xe_settings(xe: XEConfig, cfg: PipelineConfig, *, epochs: int | None = None) -> TrainSettings:
    lo = cfg.loader
    return TrainSettings(epochs=epochs or xe.epochs, batch_size=lo.batch_size, schedule="noam",
                         noam_factor=xe.noam_factor, warmup=xe.warmup, label_smoothing=xe.label_smoothing,
                         clip=xe.clip, workers=lo.dataloader_workers, seed=cfg.run.seed,
                         precision=cfg.run.precision, compile=cfg.run.compile)


def scst_settings(scst: SCSTConfig, cfg: PipelineConfig, student: str | None = None) -> TrainSettings:
    """SCST's train settings; ``student`` (a family or registry preset) picks its ``students.per_student``
    SCST epochs."""
    lo = cfg.loader
    return TrainSettings(epochs=cfg.students.scst_for(student).epochs if student else scst.epochs,
                         batch_size=scst.batch_size or lo.batch_size,
                         schedule="constant", lr=scst.lr, clip=None, workers=lo.dataloader_workers,
                         seed=cfg.run.seed + 1, precision=cfg.run.precision,
                         compile="graphs" if compile_mode(cfg.run.compile) == "graphs" else False)


@dataclass(frozen=True)
class StagePlan:
    """What the library's stage functions read, taken from the config once (:func:`stage_plan`): the run's seed,
    device, precision and caption length, the training data's batches, SeqKD's and the evaluation's decoding, SCST's
    sampling and reward, and the students' default XE and SCST settings (``scst_epochs``: a student's own SCST
    epochs, ``students.per_student``)."""

    seed: int
    device: str
    precision: str
    max_words: int
    captions_per_image: int
    shuffle_buffer: int
    seqkd_beam: int
    eval_beam: int
    decoding_constraint: bool
    spice_jars: str | None
    scst_samples: int
    scst_baseline: str
    scst_dropout: float | None
    xe: TrainSettings
    scst: TrainSettings
    scst_epochs: dict[str, int] = field(default_factory=dict)

    def scst_for(self, student: str | None) -> TrainSettings:
        """SCST's settings for ``student`` (its own epochs when it has them)."""
        return replace(self.scst, epochs=self.scst_epochs.get(student, self.scst.epochs)) if student else self.scst


def stage_plan(cfg: PipelineConfig) -> StagePlan:
    st, sc, ev = cfg.students, cfg.students.scst, cfg.evaluation
    return StagePlan(
        seed=cfg.run.seed, device=cfg.run.device, precision=cfg.run.precision, max_words=cfg.dataset.max_words,
        captions_per_image=cfg.loader.captions_per_image, shuffle_buffer=cfg.loader.shuffle_buffer,
        seqkd_beam=st.seqkd_beam, eval_beam=ev.beam, decoding_constraint=ev.decoding_constraint,
        spice_jars=ev.spice_jars, scst_samples=sc.samples, scst_baseline=sc.baseline, scst_dropout=sc.dropout,
        xe=xe_settings(st.xe, cfg), scst=scst_settings(sc, cfg),
        scst_epochs={n: o.scst_epochs for n, o in st.per_student.items() if o.scst_epochs})


@dataclass(frozen=True)
class TrainPlan:
    """One model's training (:func:`captioning.training.stages.run_training`): the stage plan, what builds its
    architecture once the stores give the vocabulary and the feature width (``teacher``: the ``teacher.model``
    section; a student: its family/preset at ``size``), and its XE and SCST settings. JSON-able: data-parallel
    processes and torchrun jobs receive it as text."""

    stage: StagePlan
    model: str
    size: str
    teacher: dict[str, Any]
    standardize: bool
    xe: TrainSettings
    scst: TrainSettings

    @property
    def is_teacher(self) -> bool:
        return self.model in TEACHER_NAMES

    def arch(self, vocab: Vocabulary, d_in: int) -> ArchConfig:
        if self.is_teacher:
            return teacher_arch(ModelConfig(**self.teacher), vocab, d_in, self.stage.max_words,
                                standardize=self.standardize)
        return student_arch(self.model, self.size, vocab, d_in, self.stage.max_words, standardize=self.standardize)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> TrainPlan:
        d = json.loads(text) if isinstance(text, str) else dict(text)
        st = dict(d["stage"])
        stage = StagePlan(**{**st, "xe": TrainSettings(**st["xe"]), "scst": TrainSettings(**st["scst"])})
        return cls(**{**d, "stage": stage, "xe": TrainSettings(**d["xe"]), "scst": TrainSettings(**d["scst"])})


def train_plan(cfg: PipelineConfig, model: str) -> TrainPlan:
    """The plan of ``model``: ``teacher`` (or ``aic``) or a student family / registry preset."""
    teacher = model in TEACHER_NAMES
    xe = xe_settings(cfg.teacher.xe if teacher else cfg.students.xe, cfg)
    return TrainPlan(stage=stage_plan(cfg), model=model, size=cfg.students.size,
                     teacher=cfg.teacher.model.model_dump(mode="json"), standardize=cfg.loader.standardize_features,
                     xe=xe, scst=scst_settings(cfg.students.scst, cfg, None if teacher else model))


def label_sources(labels: Labels, use: str, seqkd_name: str | None) -> list[int]:
    """Label-store source codes for ``use`` = ground_truth | seqkd | both."""
    codes = {v: k for k, v in labels.sources.items()}
    out = []
    if use in ("ground_truth", "both"):
        out.append(GROUND_TRUTH)
    if use in ("seqkd", "both"):
        if seqkd_name is None or seqkd_name not in codes:
            raise ValueError(f"no SeqKD source {seqkd_name!r} in the label store (have {sorted(codes)})")
        out.append(codes[seqkd_name])
    if not out:
        raise ValueError(f"captions must be ground_truth, seqkd or both, got {use!r}")
    return out


def caption_dataset(source: FeatureSource, labels: Labels, plan: StagePlan, *, codec: RadixCodec | None,
                    split: str = "train", sources: list[int] | None = None, captions_per_image: int | None = None,
                    seed_offset: int = 0) -> CaptionDataset:
    return CaptionDataset(source, labels=labels, split=split, captions_per_image=captions_per_image or
                          plan.captions_per_image, shuffle_buffer=plan.shuffle_buffer, seed=plan.seed + seed_offset,
                          codec=codec, sources=sources)


@dataclass
class References:
    """Ground-truth captions per image of one split: word-id sequences (rewards) and strings (metrics)."""

    ids: dict[int, list[list[int]]]
    text: dict[int, list[str]]
    rows: dict[int, int]


def references(labels: Labels, vocab: Vocabulary, split: str) -> References:
    """Ground-truth references of ``split`` from the label store (words outside the vocabulary are <unk>;
    for metrics use the dataset's own captions when they are at hand)."""
    sel = labels.select((labels.split == SPLIT_CODES[split]) & (labels.source == GROUND_TRUTH))
    ids: dict[int, list[list[int]]] = {}
    text: dict[int, list[str]] = {}
    rows: dict[int, int] = {}
    words = [vocab.word_of(i) for i in range(len(vocab))]  # id -> word, one list index per token
    # Python ints from whole arrays at once (per-element numpy scalars cost ~5x more at COCO's 566k captions)
    for tok, n, iid, row in zip(sel.tokens.tolist(), sel.length.tolist(), sel.image_id.tolist(),
                                sel.image_row.tolist(), strict=True):
        w = [t for t in tok[:n] if t != PAD]
        ids.setdefault(iid, []).append(w)
        text.setdefault(iid, []).append(" ".join(vocab.decode(w) if BOS in w or EOS in w else [words[t] for t in w]))
        rows[iid] = row
    return References(ids, text, rows)


def split_rows(labels: Labels, split: str, ok_rows: np.ndarray) -> np.ndarray:
    """Feature-store rows of a split's images that have usable features."""
    rows = np.unique(labels.image_row[(labels.split == SPLIT_CODES[split]) & (labels.source == GROUND_TRUTH)])
    return np.intersect1d(rows, ok_rows)
