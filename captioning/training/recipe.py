"""From config to one plan per model: which architecture a name means at which size, which captions it trains on,
how it starts, its XE and SCST settings and how it is evaluated - decided once, by :func:`model_plan`.

A :class:`ModelPlan` is the only description of a model to train (the teacher, a student, an ablation variant).
It is frozen and JSON-able: the pipeline's jobs build it from the config and hand it down; data-parallel ranks,
torchrun jobs and Dask workers receive it as text. The library's stage functions
(:mod:`captioning.training.stages`) read the plan, never the pipeline config. A student's ``students.per_student``
entry is applied here and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from captioning.config import PipelineConfig, SCSTConfig, XEConfig
from captioning.data.karpathy import SPLIT_CODES
from captioning.data.loader import CaptionDataset, FeatureSource
from captioning.data.spill import SpilledArray
from captioning.data.stores import GROUND_TRUTH, Labels, LabelStore
from captioning.data.text import BOS, EOS, PAD, RadixCodec, Vocabulary
from captioning.models.encoder_decoder import ArchConfig, Captioner
from captioning.models.names import SIZES, TEACHER_NAMES, preset_name
from captioning.models.registry import for_vocab, preset, scaled
from captioning.training.loop import TrainSettings, compile_mode


def size_of(size: str) -> tuple[int, int, int, int] | None:
    """``students.size`` -> (d_model, layers, heads, d_ff); None for ``base`` (the preset as published)."""
    if size == "base":
        return None
    if size in SIZES:
        return SIZES[size]
    raise ValueError(f"unknown size {size!r}: base or one of {', '.join(SIZES)}")


@dataclass(frozen=True)
class ScstPlan:
    """SCST of one model: its train settings, sampling and reward, and its ``students.scst`` section as it applies to
    this model (its ``per_student`` epochs in ``epochs``: tracked as params, part of the stage key)."""

    settings: TrainSettings
    samples: int
    baseline: str
    dropout: float | None
    section: dict[str, Any]


@dataclass(frozen=True)
class ModelPlan:
    """One model to train and evaluate, resolved from the config once (:func:`model_plan`).

    ``name`` is what was asked for (``teacher``, a family, a registry preset), ``label`` names its stage when one
    name is trained several ways (SATIC's ablation), ``preset`` the registry preset, ``size`` its (d_model, layers,
    heads, d_ff) or None (as published), ``dropout`` its stacks' dropout (None: the preset's). ``captions`` is what
    its XE trains on (``seqkd`` | ``ground_truth`` | ``both``), ``init_from_teacher`` whether the teacher's weights
    start it; the teacher's own plan (``is_teacher``) takes the teacher stage's XE weights as its XE result. ``xe``
    and ``scst`` (None: no SCST) are its training, the ``eval_*`` fields its test evaluation, ``evaluate_xe`` whether
    its XE weights are scored too. ``seed``, ``device``, ``nproc`` (data-parallel processes) and the data settings
    are the run's."""

    name: str
    label: str
    preset: str
    size: tuple[int, int, int, int] | None
    dropout: float | None
    standardize: bool
    captions: str
    init_from_teacher: bool
    xe: TrainSettings
    scst: ScstPlan | None
    evaluate_xe: bool
    eval_beam: int
    decoding_constraint: bool
    spice_jars: str | None
    seqkd_beam: int
    max_words: int
    captions_per_image: int
    shuffle_buffer: int
    seed: int
    device: str
    nproc: int

    @property
    def is_teacher(self) -> bool:
        return self.name in TEACHER_NAMES

    @property
    def stage(self) -> str:
        """The student job's stage: ``student-<label>``."""
        return f"student-{self.label}"

    @property
    def needs_teacher(self) -> bool:
        return self.captions != "ground_truth" or self.init_from_teacher or self.is_teacher

    @property
    def precision(self) -> str:
        return self.xe.precision

    def arch(self, vocab: Vocabulary, d_in: int) -> ArchConfig:
        """The architecture once the stores give the vocabulary and the feature width."""
        return build_arch(self.preset, self.size, self.dropout, vocab, d_in, self.max_words,
                          standardize=self.standardize)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> ModelPlan:
        d = json.loads(text) if isinstance(text, str) else dict(text)
        sc = d.get("scst")
        return cls(**{**d, "size": tuple(d["size"]) if d.get("size") else None, "xe": TrainSettings(**d["xe"]),
                      "scst": ScstPlan(**{**sc, "settings": TrainSettings(**sc["settings"])}) if sc else None})

    def digest(self, *, through: str = "evaluation") -> str:
        """What the results of this plan depend on, as a digest (a stage key's part): ``through="xe"`` - the XE
        training only (the teacher stage); ``"evaluation"`` - XE, SCST and the test evaluation. The device is not
        part of it (the same plan on another device is the same stage)."""
        d = asdict(self)
        d.pop("device")
        if through == "xe":
            for k in ("scst", "evaluate_xe", "eval_beam", "decoding_constraint", "spice_jars", "seqkd_beam", "label"):
                d.pop(k)
        elif through != "evaluation":
            raise ValueError(f"through must be 'xe' or 'evaluation', got {through!r}")
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def xe_settings(xe: XEConfig, cfg: PipelineConfig, *, epochs: int | None = None) -> TrainSettings:
    lo = cfg.loader
    return TrainSettings(epochs=epochs or xe.epochs, batch_size=lo.batch_size, schedule="noam",
                         noam_factor=xe.noam_factor, warmup=xe.warmup, label_smoothing=xe.label_smoothing,
                         clip=xe.clip, workers=lo.dataloader_workers, seed=cfg.run.seed,
                         precision=cfg.run.precision, compile=cfg.run.compile)


def scst_settings(scst: SCSTConfig, cfg: PipelineConfig) -> TrainSettings:
    """SCST's train settings from ``scst`` (the section as it applies to one model: :func:`model_plan`)."""
    lo = cfg.loader
    return TrainSettings(epochs=scst.epochs, batch_size=scst.batch_size or lo.batch_size,
                         schedule="constant", lr=scst.lr, clip=None, workers=lo.dataloader_workers,
                         seed=cfg.run.seed + 1, precision=cfg.run.precision,
                         compile="graphs" if compile_mode(cfg.run.compile) == "graphs" else False)


def model_plan(cfg: PipelineConfig, name: str) -> ModelPlan:
    """The plan of ``name``: ``teacher`` (or ``aic``: the ``teacher.*`` sections; as an evaluated model, its XE
    weights are the teacher stage's, then SCST and evaluation as for a student), or a student family / registry
    preset (``students.*``, its ``per_student`` entry applied). Unknown names raise ValueError."""
    st, ev, run = cfg.students, cfg.evaluation, cfg.run
    if name in TEACHER_NAMES:
        m = cfg.teacher.model
        pname, size, dropout = preset_name(m.arch), (m.d_model, m.layers, m.heads, m.d_ff), m.dropout
        captions, init, xe, section, nproc = "ground_truth", False, cfg.teacher.xe, st.scst, cfg.teacher.nproc
    else:
        own = st.overrides_for(name)
        pname, size, dropout = preset_name(name), size_of(st.size), None
        captions, init, xe, nproc = "seqkd" if own.seqkd else "ground_truth", own.teacher_init, st.xe, st.nproc
        section = st.scst.model_copy(update={"epochs": own.scst_epochs or st.scst.epochs})
    scst = ScstPlan(settings=scst_settings(section, cfg), samples=section.samples, baseline=section.baseline,
                    dropout=section.dropout, section=section.model_dump(mode="json")) if section.enabled else None
    return ModelPlan(
        name=name, label=name, preset=pname, size=size, dropout=dropout, standardize=cfg.loader.standardize_features,
        captions=captions, init_from_teacher=init, xe=xe_settings(xe, cfg), scst=scst, evaluate_xe=ev.xe,
        eval_beam=ev.beam, decoding_constraint=ev.decoding_constraint, spice_jars=ev.spice_jars,
        seqkd_beam=st.seqkd_beam, max_words=cfg.dataset.max_words, captions_per_image=cfg.loader.captions_per_image,
        shuffle_buffer=cfg.loader.shuffle_buffer, seed=run.seed, device=run.device, nproc=nproc)


def satic_ablation(cfg: PipelineConfig, name: str = "satic") -> dict[str, ModelPlan]:
    """SATIC's Table 4 as three plans of ``name``: ``base`` (ground truth, random init), ``seqkd`` (SeqKD captions,
    random init) and ``weight_init`` (SeqKD captions, the teacher's weights), each its own stage."""
    plan = model_plan(cfg, name)
    return {variant: replace(plan, captions=captions, init_from_teacher=init, label=f"{name}-{variant}")
            for variant, captions, init in (("base", "ground_truth", False), ("seqkd", "seqkd", False),
                                            ("weight_init", "seqkd", True))}


def max_tokens(cfg: ArchConfig | Captioner, max_words: int, codec: RadixCodec | None) -> int:
    """Output tokens a caption of ``max_words`` words needs, EOS included (radix: ``digits`` per word)."""
    a = cfg.cfg if isinstance(cfg, Captioner) else cfg
    per_word = codec.digits if (a.codec == "radix" and codec is not None) else 1
    return max_words * per_word + 1


def build_arch(pname: str, size: tuple[int, int, int, int] | None, dropout: float | None, vocab: Vocabulary,
               d_in: int, max_words: int, *, standardize: bool = False) -> ArchConfig:
    """A registry preset at ``size`` (None: as published) with ``dropout`` (None: the preset's), adapted to the
    vocabulary, the feature width and the caption length."""
    base = preset(preset_name(pname))
    arch = base if size is None else scaled(base, d_model=size[0], layers=size[1], heads=size[2], d_ff=size[3])
    codec = vocab.radix()
    k = arch.group_size
    per_word = codec.digits if arch.codec == "radix" else 1
    positions = -(-(max_words * per_word + 1 + k) // k) * k  # inputs: K starts + the caption, whole groups
    out = for_vocab(arch, word_vocab_size=len(vocab), bos=BOS, eos=EOS, radix_size=codec.size, radix_bos=codec.bos,
                    radix_eos=codec.eos, max_len=max(positions, arch.max_len if arch.pos_enc == "learned" else 0))
    changes: dict[str, Any] = {"d_in": d_in, "standardize_features": standardize}
    if dropout is not None:
        changes["dropout"] = dropout
    return out.replace(**changes)


def teacher_arch(model: Any, vocab: Vocabulary, d_in: int, max_words: int, *, standardize: bool = False
                 ) -> ArchConfig:
    """The preset named by a ``teacher.model`` section at its size and dropout."""
    return build_arch(model.arch, (model.d_model, model.layers, model.heads, model.d_ff), model.dropout, vocab, d_in,
                      max_words, standardize=standardize)


def student_arch(name: str, size: str, vocab: Vocabulary, d_in: int, max_words: int, *,
                 standardize: bool = False) -> ArchConfig:
    """A student family/preset at ``size`` ("base" = as published, else :data:`SIZES`)."""
    return build_arch(name, size_of(size), None, vocab, d_in, max_words, standardize=standardize)


def codec_for(arch: ArchConfig | Captioner, vocab: Vocabulary) -> RadixCodec | None:
    a = arch.cfg if isinstance(arch, Captioner) else arch
    return vocab.radix() if a.codec == "radix" else None


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


def caption_dataset(source: FeatureSource, labels: Labels, plan: ModelPlan, *, codec: RadixCodec | None,
                    split: str = "train", sources: list[int] | None = None, captions_per_image: int | None = None,
                    seed_offset: int = 0) -> CaptionDataset:
    return CaptionDataset(source, labels=labels, split=split, captions_per_image=captions_per_image or
                          plan.captions_per_image, shuffle_buffer=plan.shuffle_buffer, seed=plan.seed + seed_offset,
                          codec=codec, sources=sources)


@dataclass(eq=False)
class References:
    """Ground-truth captions per image of one split in compact arrays (CSR): image i (id ``image_ids[i]``, feature
    row ``image_rows[i]``) has the captions ``caption_offsets[i]`` .. ``caption_offsets[i + 1] - 1``; caption c is
    the word ids ``tokens[token_offsets[c]:token_offsets[c + 1]]`` (PAD removed). Images come in the order of their
    first caption in the label store, captions in the store's order. ``tokens`` is uint16 when the vocabulary fits
    (int32 otherwise): a few bytes per token and nothing per caption or image in Python.

    ``ids`` (word-id lists, for rewards), ``text`` (strings, for metrics) and ``rows`` (feature row) are dicts
    keyed by image id, built from the arrays on first use: Python objects per caption, for evaluation-sized
    splits - SCST takes the arrays themselves (:class:`captioning.training.scst.ScstLoss`)."""

    tokens: np.ndarray
    token_offsets: np.ndarray
    caption_offsets: np.ndarray
    image_ids: np.ndarray
    image_rows: np.ndarray
    vocab: Vocabulary

    def __len__(self) -> int:
        return len(self.image_ids)

    def _captions(self):
        toks, off = np.asarray(self.tokens).tolist(), np.asarray(self.token_offsets).tolist()
        for i, iid in enumerate(self.image_ids.tolist()):
            lo, hi = int(self.caption_offsets[i]), int(self.caption_offsets[i + 1])
            yield iid, [toks[off[c]:off[c + 1]] for c in range(lo, hi)]

    @cached_property
    def ids(self) -> dict[int, list[list[int]]]:
        return dict(self._captions())

    @cached_property
    def text(self) -> dict[int, list[str]]:
        vocab = self.vocab
        words = [vocab.word_of(i) for i in range(len(vocab))]  # id -> word, one list index per token
        return {iid: [" ".join(vocab.decode(w) if BOS in w or EOS in w else [words[t] for t in w]) for w in caps]
                for iid, caps in self._captions()}

    @cached_property
    def rows(self) -> dict[int, int]:
        return dict(zip(self.image_ids.tolist(), self.image_rows.tolist(), strict=True))


_REF_CHUNK = 65_536  # label rows per step of references(): its temporaries stay those of a chunk


class _CompactTokens:
    """Caption tokens gathered into one flat array a block of label rows at a time (PAD removed): uint16 while
    every word id fits (the vocabulary has <= 65,536 words), int32 from the first block that does not. With
    ``spill`` the tokens and offsets go to :class:`~captioning.data.spill.SpilledArray` files as they come and are
    read back by position (never held whole); else they are concatenated in memory."""

    def __init__(self, vocab: Vocabulary, spill: bool = False):
        self.small = len(vocab) <= 2**16
        self.parts: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        self.spilled = SpilledArray(np.uint16 if self.small else np.int32) if spill else None
        self.offsets = SpilledArray(np.int64) if spill else None
        self.total = 0
        if self.offsets is not None:
            self.offsets.append(np.zeros(1, np.int64))

    def add(self, tokens: np.ndarray, length: np.ndarray) -> None:
        keep = (np.arange(tokens.shape[1]) < length[:, None]) & (tokens != PAD)
        flat = tokens[keep]
        was_small = self.small
        self.small = self.small and (not len(flat) or (flat.min() >= 0 and flat.max() < 2**16))
        counts = keep.sum(1)
        if self.spilled is None:
            self.parts.append(flat.astype(np.uint16) if self.small else flat.astype(np.int32))
            self.counts.append(counts)
            return
        if was_small and not self.small:
            self.spilled = self.spilled.widened(np.int32)
        self.spilled.append(flat)
        assert self.offsets is not None  # spilled together
        self.offsets.append(self.total + np.cumsum(counts))
        self.total += int(counts.sum())

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, token_offsets)."""
        if self.spilled is not None and self.offsets is not None:
            return self.spilled.array(), self.offsets.array()
        dtype = np.uint16 if self.small else np.int32
        tokens = np.concatenate(self.parts).astype(dtype, copy=False) if self.parts else np.zeros(0, np.int32)
        self.parts = []
        n_tok = np.concatenate(self.counts) if self.counts else np.zeros(0, np.int64)
        return tokens, np.concatenate([[0], np.cumsum(n_tok)]).astype(np.int64)


def references(labels: Labels | LabelStore, vocab: Vocabulary, split: str, *, spill: bool = False) -> References:
    """Ground-truth references of ``split`` from the label store (words outside the vocabulary are <unk>;
    for metrics use the dataset's own captions when they are at hand), as compact arrays.

    ``labels``: the store in memory, or the :class:`LabelStore` itself, read a chunk at a time (each chunk checked
    against its checksums): only the references are held, never the store's tokens. Where an image's captions are
    not one run of rows (a store written otherwise than image by image) the store's columns are read whole.
    ``spill`` (a store streamed): the tokens and their offsets go to temporary files read back by position
    (:class:`~captioning.data.spill.SpilledArray`): SCST's rewards read a batch's references from there."""
    if isinstance(labels, LabelStore):
        streamed = _streamed_references(labels, vocab, split, spill)
        if streamed is not None:
            return streamed
        labels = labels.read()
    idx = np.flatnonzero((labels.split == SPLIT_CODES[split]) & (labels.source == GROUND_TRUTH))
    iid = labels.image_id[idx].astype(np.int64)
    uniq, first, inv = np.unique(iid, return_index=True, return_inverse=True)
    del iid
    by_first = np.argsort(first, kind="stable")  # images in the order of their first caption
    rank = np.empty(len(uniq), np.int64)
    rank[by_first] = np.arange(len(uniq), dtype=np.int64)
    img_of_cap = rank[inv.reshape(-1)]
    del inv, rank, first
    order = idx[np.argsort(img_of_cap, kind="stable")]  # label rows, image by image, store order within
    caption_offsets = np.concatenate([[0], np.cumsum(np.bincount(img_of_cap, minlength=len(uniq)))]).astype(np.int64)
    del img_of_cap, idx
    compact = _CompactTokens(vocab)
    for lo in range(0, len(order), _REF_CHUNK):
        rows = order[lo:lo + _REF_CHUNK]
        compact.add(labels.tokens[rows], labels.length[rows])
    tokens, token_offsets = compact.arrays()
    last = order[caption_offsets[1:] - 1] if len(uniq) else np.zeros(0, np.int64)
    image_rows = labels.image_row[last].astype(np.int64)  # the row of each image's last caption
    return References(tokens, token_offsets, caption_offsets, uniq[by_first], image_rows, vocab)


def _streamed_references(store: LabelStore, vocab: Vocabulary, split: str, spill: bool) -> References | None:
    """:func:`references` in one pass over the store, a chunk at a time; None when some image's captions of the
    split are not one run of rows (then the order of first captions needs every row at once)."""
    code = SPLIT_CODES[split]
    compact = _CompactTokens(vocab, spill)
    run_ids: list[np.ndarray] = []  # per block: the image id of each run of rows, its captions and last feature row
    run_caps: list[np.ndarray] = []
    run_rows: list[np.ndarray] = []
    for _, v in store.blocks(("tokens", "length", "image_row", "image_id", "split", "source")):
        sel = np.flatnonzero((v["split"] == code) & (v["source"] == GROUND_TRUTH))
        if not len(sel):
            continue
        compact.add(v["tokens"][sel], v["length"][sel])
        iid = v["image_id"][sel].astype(np.int64)
        starts = np.flatnonzero(np.concatenate([[True], iid[1:] != iid[:-1]]))
        ends = np.append(starts[1:], len(iid))
        ids, caps, rows = iid[starts], ends - starts, v["image_row"][sel[ends - 1]]
        if run_ids and run_ids[-1][-1] == ids[0]:  # the previous block's last image goes on
            run_caps[-1][-1] += caps[0]
            run_rows[-1][-1] = rows[0]
            if len(ids) == 1:
                continue
            ids, caps, rows = ids[1:], caps[1:], rows[1:]
        run_ids.append(ids)
        run_caps.append(caps.astype(np.int64))
        run_rows.append(rows.astype(np.int64))
    image_ids = np.concatenate(run_ids) if run_ids else np.zeros(0, np.int64)
    if len(np.unique(image_ids)) != len(image_ids):
        return None
    tokens, token_offsets = compact.arrays()
    counts = np.concatenate(run_caps) if run_caps else np.zeros(0, np.int64)
    caption_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    image_rows = np.concatenate(run_rows) if run_rows else np.zeros(0, np.int64)
    return References(tokens, token_offsets, caption_offsets, image_ids, image_rows, vocab)


def split_rows(labels: Labels, split: str, ok_rows: np.ndarray) -> np.ndarray:
    """Feature-store rows of a split's images that have usable features."""
    rows = np.unique(labels.image_row[(labels.split == SPLIT_CODES[split]) & (labels.source == GROUND_TRUTH)])
    return np.intersect1d(rows, ok_rows)
