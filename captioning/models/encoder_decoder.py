"""The one encoder-decoder skeleton. Every paper is a choice of parts (:class:`ArchConfig`), not a copy.

Interface used by training and by every decoding algorithm (written once, in ``captioning.decoding``):
- ``encode(features, boxes, region_mask) -> Memory``
- ``forward(features, boxes, region_mask, inputs) -> log-probs (B, T, V)`` (teacher forcing)
- ``decode_step(memory, tokens (B, K), cache) -> log-probs (B, K, V)``, with ``cache = model.new_cache()``;
  ``cache=None`` recomputes the whole prefix (the uncached reference); ``model.new_cache(static=True,
  max_len=T, device=...)`` is the static-size cache (same numbers, fixed shapes and storage: CUDA graphs).

Semi-autoregressive decoding (SATIC) with group size K: the target sequence y = [w_1..w_T, EOS] is produced
K tokens per step. Decoder input position i holds y_{i-K} (the K start symbols are BOS), and the relaxed mask
lets position i see inputs j < (floor(i/K)+1)*K. K = 1 is exactly the autoregressive captioner.

Fidelity to the papers' released code. With the options below set as in :func:`registry.released` (preset names
``<preset>@released``) the skeleton computes the released modules' arithmetic; the defaults keep capflow's
choices (checkpoints trained before these options existed keep their meaning):

- ``layer_norm``: ``torch`` (``nn.LayerNorm``: biased variance, eps 1e-5 inside the root) or ``annotated``
  (``a * (x - mean) / (std_unbiased + 1e-6) + b``, the Annotated Transformer's, used by the released AIC, SATIC,
  ZoDIAC and ORT/ACORT code; up to 5e-3 apart on a normalised activation at d=512).
- ``ffn_activation``: ``relu`` or ``none`` (ZoDIAC's released model classes have no ReLU in the FFN).
- ``zodiac_pool``: ``sample`` (mean intensity per sample, head and query) or ``released`` (one scalar per sample
  with the released sum and denominator, as the released code computes it for a batch of one image: its own
  batch-level pooling would make a caption depend on the other images of the batch; see
  :meth:`~captioning.models.layers.MultiHeadAttention._released_pool`). Such a model decodes by re-running the
  whole prefix every step (:attr:`Captioner.prefix_decoding`: the decoding functions do it by themselves).
- ``released_acort_cache``: decode with the released ORT/ACORT code's step cache (jiahuei/sparse-image-captioning
  ``CachedMultiHeadedAttention``): a decoder layer shared by several positions keeps ONE self-attention cache, to
  which every position using it appends its keys/values in turn, and a cached step attends to all of it without a
  mask. That is not the function the model was trained with (teacher forcing and whole-prefix decoding see only
  the same position's keys at every earlier step); the published ACORT captions come from it. Off by default;
  without cross-layer sharing it changes nothing. Growing cache only (no static cache / CUDA graphs), K = 1.
- ``attn_dropout``: dropout on the attention weights (None = ``dropout``); ExpansionNet's released
  cross-attention has none.
- ``expansion_eps`` (1e-4; released 1e-9) and ``expansion_dropout`` (``capflow`` | ``released``): see
  :mod:`captioning.models.expansion`.
- ``init="released"``: ``xavier`` plus the released code's details: ExpansionNet's region projection and
  expansion slots Glorot-uniform, LW-Transformer's attention biases 0 (and, in the ``m2`` skeleton, its region
  projection and position table Glorot-uniform), ORT's per-head geometry biases equal across heads.
- ``grouped_merge``: the heads' merge ``W_O`` per group (one ``Linear(d/k, d/k)`` shared by the k groups), as
  LW-Transformer's released attention (``fc_o``) has it; capflow's LW presets keep the dense ``W_O`` the paper's
  parameter counts imply.
- ``skeleton``: ``capflow`` (the layers above: ``norm`` pre/post, embeddings scaled by sqrt(d) with dropout,
  sinusoid positions from 0, a final LN after each stack, an output layer with bias) or ``m2``, the
  M2-Transformer-shaped skeleton of LW-Transformer's released code (luogen1996/LWTransformer,
  ``models/transformer_lightweight``): post-LN (``norm="post"`` required) with every attention sublayer wrapped
  twice, ``LN(x + Drop(LN'(x + Drop(Attn(x)))))`` (``LN'`` is the released attention module's own residual +
  LayerNorm, ``sub<j>.inner_norm`` here); regions ``LN(Drop(ReLU(W x + b)))`` (``input_norm``); word embeddings
  neither scaled nor dropped out, plus a position table indexed from 1 (row 0 is the released padding row) that
  is stored with the weights (``pe``, persistent; frozen as in the released code, whose model-wide Glorot
  initialisation overwrites its sinusoid table: ``init="released"`` does the same); no final LN; an output layer
  without bias. ``FFN`` sublayers are ``LN(x + Drop(FFN(x)))``. The layers, masks and caches are the same code.
- ``standardize_features`` (capflow's pipeline presets turn it on through ``loader.standardize_features``; off
  in every registry preset and ``released`` flavour, as in the papers' code): region features are standardised per
  dimension before the region projection, ``(x - feature_mean) * feature_scale``, with the training split's
  statistics stored in the model as buffers (:meth:`Captioner.set_feature_stats`), so a saved model carries
  them to inference. Detector features share a large common offset (measured on the demo's random-weight
  detector: mean |x| 2.27 against a between-image standard deviation of 0.28 per dimension); without this, small
  models there collapse to one caption for every image.
- Not options (documented in README.md): an image with no valid region gets zero attention here, uniform
  attention in the references (their -1e9 fill); the M2 code's region mask (``sum(LN(x)) == 0`` after the input
  LayerNorm, so padded regions are in effect attended to) is not copied: padded regions are masked out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioning.data.text import PAD  # the one definition of the padding id (re-exported)
from captioning.models import static_cache
from captioning.models.layers import (
    BoxGeometry,
    FeedForward,
    GeometryBias,
    MultiHeadAttention,
    layer_norm,
    sinusoid_table,
)


@dataclass(frozen=True)
class ArchConfig:
    vocab_size: int = 9488  # output classes
    bos: int = 1
    eos: int = 2
    d_model: int = 512
    heads: int = 8
    d_ff: int = 2048
    enc_layers: int = 6
    dec_layers: int = 6
    dropout: float = 0.1
    d_in: int = 2048
    input_dropout: float = 0.5
    input_relu: bool = True
    norm: str = "pre"  # pre | post
    # attention kinds: standard | zodiac | expansion
    enc_attention: str = "standard"
    dec_attention: str = "standard"
    cross_attention: str = "standard"
    geometry: bool = False  # ORT box relations in encoder self-attention
    share: str | None = None  # None | kv | qk (ACORT)
    groups: int = 1  # LW-Transformer groups k (attention and, with ffn="grouped", FFN)
    qk_expand: int = 1  # LW 1x / 2x / 3x
    grouped_merge: bool = False
    ffn: str = "dense"  # dense | grouped
    enc_share: tuple[int, ...] | None = None  # layer position -> layer id, e.g. (0, 0, 0, 1, 1, 1)
    dec_share: tuple[int, ...] | None = None
    zodiac_gate: str = "sigmoid"
    zodiac_dropout: float = 0.2
    zoneup: float = 1.0
    expansion_enc: int = 64  # N_E (static expansion)
    expansion_dec: int = 16  # N_D (dynamic expansion)
    pos_enc: str = "sinusoidal"  # sinusoidal | learned
    max_len: int = 64  # longest decoder input (learned positions; caches)
    stack_output: str = "norm"  # norm: final LN | concat: ExpansionNet's LN(x_N + Drop(W_r [x_1..x_N]))
    group_size: int = 1  # SATIC K
    codec: str = "word"  # word | radix (tokens are radix digits)
    # weight initialisation: "xavier" = Glorot-uniform on every weight matrix of the encoder/decoder stacks, the
    # word embedding and the generator, as the Annotated-Transformer-based released code of these papers does
    # (see :meth:`Captioner.init_weights`); "default" = PyTorch's per-module defaults (nn.Embedding N(0, 1), so
    # the input Emb(w)*sqrt(d) has per-channel std sqrt(d)), kept for comparison
    # "released": xavier plus the released code's details (see the module docstring and Captioner.init_weights)
    init: str = "xavier"
    # fidelity options (module docstring): defaults = capflow's behaviour, released values in registry.released
    layer_norm: str = "torch"  # torch | annotated
    ffn_activation: str = "relu"  # relu | none
    zodiac_pool: str = "sample"  # sample | released
    attn_dropout: float | None = None  # dropout on attention weights; None = dropout
    expansion_eps: float = 1e-4
    expansion_dropout: str = "capflow"  # capflow | released
    skeleton: str = "capflow"  # capflow | m2 (LW-Transformer's released M2-shaped skeleton; module docstring)
    # region features standardised per dimension, (x - feature_mean) * feature_scale, before the region projection,
    # with statistics of the training split stored in the model (buffers; set by Captioner.set_feature_stats)
    standardize_features: bool = False
    # decode with the released ORT/ACORT step cache (one self-attention cache per shared layer; module docstring)
    released_acort_cache: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchConfig:
        d = dict(d)
        for k in ("enc_share", "dec_share"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)

    def replace(self, **kw: Any) -> ArchConfig:
        return replace(self, **kw)

    def with_dropout(self, p: float) -> ArchConfig:
        """The same model with each of its dropout sites at rate ``p`` (layers, regions, attention weights, ZoDIAC's
        refinement); a site the model has switched off (rate 0) stays off, and the weights are unaffected (SCST's
        ``students.scst.dropout``)."""
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        attn = None if self.attn_dropout is None else (self.attn_dropout and p)
        return replace(self, dropout=self.dropout and p, input_dropout=self.input_dropout and p, attn_dropout=attn,
                       zodiac_dropout=self.zodiac_dropout and p)


SKELETONS = ("capflow", "m2")


def _share_map(share: tuple[int, ...] | None, n: int) -> tuple[int, ...]:
    m = tuple(range(n)) if share is None else tuple(share)
    if len(m) != n or sorted(set(m)) != list(range(len(set(m)))):
        raise ValueError(f"layer sharing map {m} must give {n} positions using ids 0..k-1")
    return m


@dataclass
class Memory:
    """Encoder output for a batch of images."""

    states: torch.Tensor  # (B, R, d)
    mask: torch.Tensor  # (B, R) bool, True = a real region

    def select(self, idx: torch.Tensor) -> Memory:
        return Memory(self.states.index_select(0, idx), self.mask.index_select(0, idx))

    def repeat(self, n: int) -> Memory:
        return Memory(self.states.repeat_interleave(n, 0), self.mask.repeat_interleave(n, 0))


@dataclass
class DecoderCache:
    """Per decoder layer: {"self": {...}, "cross": {...}} states; ``length`` = decoder positions fed so far.

    Growing (default): the self-attention states grow by concatenation every step. Static (``max_len`` set, see
    :mod:`captioning.models.static_cache`): every layer's self states live in buffers of ``max_len`` positions
    allocated at the first step and written in place at the positions ``pos`` (a 0-d long device tensor, the
    device-side twin of ``length``) onwards; the batch size is fixed by the first step and ``reorder`` copies
    rows within the same buffers, so the storage never changes (what a CUDA graph needs)."""

    layers: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    length: int = 0
    max_len: int | None = None  # static: preallocated positions
    pos: torch.Tensor | None = None  # static: positions fed so far, on the device
    shared: bool = False  # the released ACORT step cache: positions of a shared layer share its "self" states

    @property
    def static(self) -> bool:
        return self.max_len is not None

    def reorder(self, idx: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows ``idx`` (beam search). ``cross=False`` leaves the cross-attention states alone (when
        every new row comes from a row of the same image, whose memory states are identical)."""
        seen: set[int] = set()
        parts: set[int] = set()
        for layer in self.layers:
            for name, part in layer.items():
                if (name == "cross" and not cross) or id(part) in parts:  # a shared part moves once
                    continue
                parts.add(id(part))
                for k, v in part.items():
                    if not isinstance(v, torch.Tensor) or k in static_cache.META:
                        continue
                    if not self.static:
                        part[k] = v.index_select(0, idx)
                    elif id(v) not in seen:  # in place; a buffer shared by two names (Share-kV) moves once
                        seen.add(id(v))
                        v.copy_(v.index_select(0, idx))

    def reset(self) -> None:
        """Static cache: start a new caption in the same buffers (keeps the cross states: see prime_cache)."""
        if not self.static:
            raise ValueError("only a static cache can be reset; make a new growing cache instead")
        self.length = 0
        self.pos.zero_()


# ---------------------------------------------------------------------- layers
def _mixer(kind: str, cfg: ArchConfig, *, decoder: bool) -> nn.Module:
    if kind in ("standard", "zodiac"):
        return MultiHeadAttention(
            cfg.d_model, cfg.heads, dropout=cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout,
            share=cfg.share, groups=cfg.groups, qk_expand=cfg.qk_expand, grouped_merge=cfg.grouped_merge,
            zodiac=kind == "zodiac", zodiac_gate=cfg.zodiac_gate, zodiac_dropout=cfg.zodiac_dropout,
            zoneup=cfg.zoneup, zodiac_pool=cfg.zodiac_pool,
        )
    if kind == "expansion":
        from captioning.models.expansion import DynamicExpansion, StaticExpansion

        opts = {"dropout": cfg.dropout, "eps": cfg.expansion_eps, "dropout_sites": cfg.expansion_dropout}
        if decoder:
            return DynamicExpansion(cfg.d_model, cfg.expansion_dec, **opts)
        return StaticExpansion(cfg.d_model, cfg.expansion_enc, **opts)
    raise ValueError(f"unknown attention kind {kind!r}")


def _ffn(cfg: ArchConfig) -> FeedForward:
    return FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.groups if cfg.ffn == "grouped" else 1,
                       activation=cfg.ffn_activation)


class _Sublayer(nn.Module):
    """Residual + LayerNorm around a sublayer, pre-LN (x + Drop(f(LN x))) or post-LN (LN(x + Drop(f x))).

    ``inner=True`` (the M2 skeleton's attention sublayers, post-LN only): a second residual + LayerNorm inside,
    ``LN(x + Drop(LN'(x + Drop'(f x))))`` - the released attention module's own (``inner_norm``) within the
    layer's (``norm``)."""

    def __init__(self, d: int, dropout: float, pre: bool, norm: str = "torch", inner: bool = False):
        super().__init__()
        if pre and inner:
            raise ValueError("the inner residual + LayerNorm belongs to the post-LN (M2) skeleton")
        self.norm = layer_norm(norm, d)
        self.drop = nn.Dropout(dropout)
        self.pre = pre
        self.inner_norm = layer_norm(norm, d) if inner else None
        self.inner_drop = nn.Dropout(dropout) if inner else None

    def forward(self, x: torch.Tensor, fn) -> torch.Tensor:
        if self.pre:
            return x + self.drop(fn(self.norm(x)))
        y = fn(x)
        if self.inner_norm is not None:
            y = self.inner_norm(x + self.inner_drop(y))
        return self.norm(x + self.drop(y))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        pre, m2 = cfg.norm == "pre", cfg.skeleton == "m2"
        self.kind = cfg.enc_attention
        self.mix = _mixer(cfg.enc_attention, cfg, decoder=False)
        self.ffn = _ffn(cfg)
        self.sub1 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm, inner=m2)
        self.sub2 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm)
        self.geo = GeometryBias(64, cfg.heads) if cfg.geometry else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor, geo_emb: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "expansion":
            x = self.sub1(x, lambda y: self.mix(y, mask))
        else:
            bias = self.geo(geo_emb) if self.geo is not None else None
            x = self.sub1(x, lambda y: self.mix(y, y, mask[:, None, None, :], bias=bias))
        return self.sub2(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        pre, m2 = cfg.norm == "pre", cfg.skeleton == "m2"
        self.kind = cfg.dec_attention
        self.self_mix = _mixer(cfg.dec_attention, cfg, decoder=True)
        self.cross = _mixer(cfg.cross_attention, cfg, decoder=False)
        self.ffn = _ffn(cfg)
        self.sub1 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm, inner=m2)
        self.sub2 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm, inner=m2)
        self.sub3 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm)

    def forward(self, x, memory: Memory, self_mask, cache: dict | None) -> torch.Tensor:
        sc = cache.setdefault("self", {}) if cache is not None else None
        cc = cache.setdefault("cross", {}) if cache is not None else None
        if self.kind == "expansion":
            x = self.sub1(x, lambda y: self.self_mix(y, self_mask, cache=sc))
        else:
            x = self.sub1(x, lambda y: self.self_mix(y, y, self_mask, cache=sc, kind="self"))
        x = self.sub2(x, lambda y: self.cross(y, memory.states, memory.mask[:, None, None, :], cache=cc,
                                              kind="cross"))
        return self.sub3(x, self.ffn)


class _Stack(nn.Module):
    """Layers with a sharing map and the stack's output (final LN, none in the M2 skeleton, or ExpansionNet's
    concatenation)."""

    def __init__(self, layer_cls, cfg: ArchConfig, n: int, share: tuple[int, ...] | None):
        super().__init__()
        self.map = _share_map(share, n)
        self.layers = nn.ModuleList(layer_cls(cfg) for _ in range(len(set(self.map))))
        self.out_kind = cfg.stack_output
        final_norm = cfg.skeleton != "m2" or cfg.stack_output == "concat"
        self.norm = layer_norm(cfg.layer_norm, cfg.d_model) if final_norm else None
        if cfg.stack_output == "concat":
            self.w_r = nn.Linear(n * cfg.d_model, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)

    def run(self, x: torch.Tensor, step) -> torch.Tensor:
        outs = []
        for pos, lid in enumerate(self.map):
            x = step(pos, self.layers[lid], x)
            outs.append(x)
        if self.out_kind == "concat":
            return self.norm(x + self.drop(self.w_r(torch.cat(outs, -1))))
        return x if self.norm is None else self.norm(x)


# ---------------------------------------------------------------------- the model
class Captioner(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        if cfg.skeleton not in SKELETONS:
            raise ValueError(f"unknown skeleton {cfg.skeleton!r}: one of {', '.join(SKELETONS)}")
        m2 = cfg.skeleton == "m2"
        if m2 and cfg.norm != "post":
            raise ValueError("the m2 skeleton is post-LN: set norm='post' with skeleton='m2'")
        if cfg.released_acort_cache and (cfg.group_size != 1 or cfg.dec_attention != "standard"):
            raise ValueError("released_acort_cache is the released ORT/ACORT decoder's step cache: it needs group "
                             "size 1 and standard decoder self-attention")
        self.cfg = cfg
        d = cfg.d_model
        if cfg.standardize_features:  # identity until set_feature_stats
            self.register_buffer("feature_mean", torch.zeros(cfg.d_in))
            self.register_buffer("feature_scale", torch.ones(cfg.d_in))
        self.input_proj = nn.Linear(cfg.d_in, d)
        self.input_drop = nn.Dropout(cfg.input_dropout)
        self.input_norm = layer_norm(cfg.layer_norm, d) if m2 else None
        self.geometry = BoxGeometry(64) if cfg.geometry else None
        self.encoder = _Stack(EncoderLayer, cfg, cfg.enc_layers, cfg.enc_share)
        self.decoder = _Stack(DecoderLayer, cfg, cfg.dec_layers, cfg.dec_share)
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.embed_drop = nn.Dropout(cfg.dropout)
        rows = cfg.max_len + 1 if m2 else cfg.max_len  # m2: positions 1..max_len, row 0 = the padding row
        if cfg.pos_enc == "learned":
            self.pos = nn.Embedding(rows, d)
        else:  # m2: a frozen table stored with the weights (the released one is not the sinusoid: init_weights)
            table = sinusoid_table(rows, d)
            if m2:
                table[0] = 0.0
            self.register_buffer("pe", table, persistent=m2)
        self.generator = nn.Linear(d, cfg.vocab_size, bias=not m2)
        self.init_weights()

    def init_weights(self) -> None:
        """Apply ``cfg.init`` (nothing to do for "default").

        "xavier" follows the released code these papers build on (the Annotated Transformer's ``make_model``; the
        ORT/ACORT code, yahoo/object_relation_transformer and jiahuei/sparse-image-captioning
        ``relation_transformer.py``): ``xavier_uniform_`` on every parameter with ``dim() > 1`` of the
        encoder-decoder, i.e. everything but the region projection ``Linear(d_in -> d)``; each head's geometry
        weight ``w_h`` is its own ``Linear(64, 1)`` there, so it gets its own fan-in/fan-out here; ExpansionNet's
        learned expansion slots keep their own initialisation (see ``expansion.py``).

        Why it matters: with PyTorch's ``N(0, 1)`` embedding, ``Emb(w)*sqrt(d)`` is about sqrt(d) times larger
        per channel than the sinusoidal position code and than every pre-LN sublayer's output, so the residual
        stream stays dominated by the current token's embedding and position is drowned out. Models that must
        know *where* they are suffer most: ACORT (the same digit token means a frequency block in slot 0 and a
        word in slot 1) and SATIC (the K positions of a group differ only by position). Measured on the
        ``learning`` preset (demo size, d=128): ACORT with default init emits digit 1 forever ("a a a ...", val
        CIDEr 0.000 every epoch though the loss falls to 1.36), with xavier best val CIDEr 0.99; AIC after 5 XE
        epochs val CIDEr 0.37 (default) -> 0.79 (xavier).
        """
        if self.cfg.init == "default":
            return
        if self.cfg.init not in ("xavier", "released"):
            raise ValueError(f"unknown init {self.cfg.init!r}: default, xavier or released")
        from captioning.models.expansion import DynamicExpansion, StaticExpansion

        released = self.cfg.init == "released"
        m2 = self.cfg.skeleton == "m2"
        expansion = [m for m in self.modules() if isinstance(m, StaticExpansion | DynamicExpansion)]
        own_init = set() if released else {id(p) for m in expansion for p in (m.queries, m.biases)}
        # ExpansionNet's and the M2-based LW-Transformer's released code initialise every dim > 1 parameter, the
        # region projection included
        skip_input = not (released and (expansion or m2))
        for name, p in self.named_parameters():
            if p.dim() < 2 or (skip_input and name.startswith("input_proj.")) or id(p) in own_init:
                continue
            if name.endswith(".geo.w.weight"):  # (heads, 64): one Linear(64, 1) per head in the released code
                for row in p.data.split(1, 0):
                    nn.init.xavier_uniform_(row)
            else:
                nn.init.xavier_uniform_(p)
        if not released:
            return
        with torch.no_grad():
            if m2 and self.cfg.pos_enc != "learned":
                # the M2 code's Transformer.init_weights runs xavier_uniform_ over model.parameters(), which
                # include the frozen sinusoid table (nn.Embedding.from_pretrained): the released table is random
                nn.init.xavier_uniform_(self.pe)
            for m in self.modules():
                if isinstance(m, GeometryBias):  # the released heads are deep copies of one Linear(64, 1)
                    m.w.bias.copy_(m.w.bias[:1].expand_as(m.w.bias).clone())
                if isinstance(m, MultiHeadAttention) and m.k > 1:  # LW's released attention: biases start at 0
                    for lin in (m.q, getattr(m, "k_proj", None), getattr(m, "v", None), m.o):
                        if lin is not None:
                            nn.init.zeros_(lin.bias)

    # ------------------------------------------------------------------ properties
    @property
    def group_size(self) -> int:
        return self.cfg.group_size

    @property
    def prefix_decoding(self) -> bool:
        """True when a decoding step must re-run the whole prefix (no cache): the released ZoDIAC pooling, whose
        gate changes every earlier position's output as the prefix grows. The decoding functions read it."""
        return self.cfg.zodiac_pool == "released" and "zodiac" in (
            self.cfg.enc_attention, self.cfg.dec_attention, self.cfg.cross_attention)

    @property
    def bos(self) -> int:
        return self.cfg.bos

    @property
    def eos(self) -> int:
        return self.cfg.eos

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def set_feature_stats(self, mean: torch.Tensor, std: torch.Tensor, *, floor: float = 1e-3) -> None:
        """Store the training split's per-dimension region-feature mean and standard deviation (``d_in`` each).
        A dimension whose deviation is below ``floor`` times the median deviation (a dead detector channel) is
        centred but not scaled up."""
        if not self.cfg.standardize_features:
            raise ValueError("this model does not standardise its features (ArchConfig.standardize_features)")
        mean, std = torch.as_tensor(mean, dtype=torch.float64), torch.as_tensor(std, dtype=torch.float64)
        if mean.shape != (self.cfg.d_in,) or std.shape != (self.cfg.d_in,):
            raise ValueError(f"feature statistics must have {self.cfg.d_in} values each, got "
                             f"{tuple(mean.shape)} and {tuple(std.shape)}")
        if not (torch.isfinite(mean).all() and torch.isfinite(std).all()) or (std < 0).any():
            raise ValueError("feature statistics must be finite, with non-negative deviations")
        low = std < floor * std.median().clamp_min(1e-12)
        scale = torch.where(low, torch.ones_like(std), 1.0 / std.clamp_min(1e-12))
        with torch.no_grad():
            self.feature_mean.copy_(mean.to(self.feature_mean.dtype))
            self.feature_scale.copy_(scale.to(self.feature_scale.dtype))

    # ------------------------------------------------------------------ encoder
    def encode(self, features: torch.Tensor, boxes: torch.Tensor, region_mask: torch.Tensor) -> Memory:
        if self.cfg.standardize_features:
            features = (features.to(self.feature_mean.dtype) - self.feature_mean) * self.feature_scale
        x = self.input_proj(features.to(self.input_proj.weight.dtype))
        if self.cfg.input_relu:
            x = F.relu(x)
        x = self.input_drop(x)
        if self.input_norm is not None:
            x = self.input_norm(x)
        x = x * region_mask[..., None]
        geo = self.geometry(boxes) if self.geometry is not None else None
        states = self.encoder.run(x, lambda pos, layer, h: layer(h, region_mask, geo))
        return Memory(states, region_mask)

    # ------------------------------------------------------------------ decoder
    def relaxed_mask(self, t_q: int, t_k: int, offset: int = 0, device=None) -> torch.Tensor:
        """(1, 1, t_q, t_k) bool: query position offset+i may see key j < (floor((offset+i)/K)+1)*K."""
        k = self.group_size
        i = torch.arange(offset, offset + t_q, device=device)[:, None]
        j = torch.arange(t_k, device=device)[None, :]
        return (j < (torch.div(i, k, rounding_mode="floor") + 1) * k)[None, None]

    def _embed(self, tokens: torch.Tensor, offset: int) -> torch.Tensor:
        t = tokens.shape[1]
        if offset + t > self.cfg.max_len:
            raise ValueError(f"decoder position {offset + t} exceeds max_len {self.cfg.max_len}")
        return self._embed_at(tokens, torch.arange(offset, offset + t, device=tokens.device))

    def _embed_at(self, tokens: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Decoder inputs: ``tokens`` (B, t) at the 0-based decoder positions ``idx`` (t,)."""
        learned = self.cfg.pos_enc == "learned"
        if self.cfg.skeleton == "m2":  # no scaling, no dropout; the table's row p+1 holds position p
            pos = self.pos(idx + 1) if learned else self.pe.index_select(0, idx + 1)
            return self.embed(tokens) + pos
        d = self.cfg.d_model
        if learned:
            return self.embed_drop(self.embed(tokens)) * math.sqrt(d) + self.pos(idx)
        return self.embed_drop(self.embed(tokens) * math.sqrt(d) + self.pe.index_select(0, idx))

    def _decode(self, memory: Memory, tokens: torch.Tensor, offset: int, caches: list | None,
                shared: bool = False) -> torch.Tensor:
        x = self._embed(tokens, offset)
        t = tokens.shape[1]
        if caches is None:
            mask = self.relaxed_mask(t, t, 0, tokens.device)
        elif shared:  # the released ACORT step cache: one token per step, every cached key visible (no mask)
            if t != 1:
                raise ValueError("the released ACORT step cache feeds one token per step")
            mask = None
        else:  # new positions see every cached position and, by the relaxed mask, their own group
            mask = self.relaxed_mask(t, offset + t, offset, tokens.device)
        h = self.decoder.run(x, lambda pos, layer, y: layer(y, memory, mask, caches[pos] if caches else None))
        return torch.log_softmax(self.generator(h).float(), dim=-1)

    def forward(self, features, boxes, region_mask, inputs: torch.Tensor, memory: Memory | None = None
                ) -> torch.Tensor:
        """Teacher forcing: ``inputs`` (B, T) decoder inputs (see :meth:`teacher_inputs`) -> (B, T, V)."""
        if memory is None:
            memory = self.encode(features, boxes, region_mask)
        if memory.states.shape[0] != inputs.shape[0]:
            memory = memory.repeat(inputs.shape[0] // memory.states.shape[0])
        return self._decode(memory, inputs, 0, None)

    def new_cache(self, static: bool = False, max_len: int | None = None, device=None,
                  released_acort_cache: bool = False) -> DecoderCache:
        """A growing cache, or with ``static=True`` a static one of ``max_len`` positions (default the model's
        ``cfg.max_len``) whose position counter lives on ``device`` (see :class:`DecoderCache`).

        ``released_acort_cache``: the released ORT/ACORT step cache, where the positions of a shared decoder layer
        share one self-attention state (module docstring); growing only. (The decoding functions ask for it when
        ``cfg.released_acort_cache`` is set or when told to.)"""
        if released_acort_cache:
            if static:
                raise ValueError("the released ACORT step cache grows by a layer's uses per step: no static cache")
            if self.group_size != 1:
                raise ValueError("the released ACORT step cache is for autoregressive models (group size 1)")
            selfs: dict[int, dict[str, Any]] = {lid: {} for lid in set(self.decoder.map)}
            return DecoderCache(layers=[{"self": selfs[lid], "cross": {}} for lid in self.decoder.map], shared=True)
        if not static:
            return DecoderCache(layers=[{} for _ in self.decoder.map])
        size = self.cfg.max_len if max_len is None else int(max_len)
        if not 1 <= size <= self.cfg.max_len:
            raise ValueError(f"a static cache holds 1..{self.cfg.max_len} positions (the model's max_len), "
                             f"not {size}")
        return DecoderCache(layers=[{"self": {static_cache.SIZE: size}} for _ in self.decoder.map], max_len=size,
                            pos=torch.zeros((), dtype=torch.long, device=device))

    def prime_cache(self, memory: Memory, cache: DecoderCache, in_place: bool = False) -> None:
        """Compute the cross-attention keys/values of ``memory`` now (a cache otherwise computes them at its first
        step), into the tensors already there when their shapes match (what a captured step reads; with
        ``in_place=True`` anything else is an error)."""
        for pos, lid in enumerate(self.decoder.map):
            cross = self.decoder.layers[lid].cross
            if not isinstance(cross, MultiHeadAttention):
                continue
            k, v = cross.project_kv(memory.states)
            part = cache.layers[pos].setdefault("cross", {})
            old_k, old_v = part.get("k"), part.get("v")
            if (old_k is not None and old_k.shape == k.shape and old_k.dtype == k.dtype
                    and old_v.shape == v.shape and (old_v is old_k) == (v is k)):
                old_k.copy_(k)
                if v is not k:
                    old_v.copy_(v)
            elif in_place:
                raise ValueError(f"cross states {tuple(k.shape)} {k.dtype} do not fit the cache's tensors")
            else:
                part["k"], part["v"] = k, v

    def decode_step(self, memory: Memory, tokens: torch.Tensor, cache: DecoderCache | None,
                    prefix: torch.Tensor | None = None) -> torch.Tensor:
        """Feed the next ``tokens`` (B, K); returns log-probs (B, K, V) of the next K output positions.

        With ``cache`` the step costs O(t); with ``cache=None`` the whole ``prefix`` (B, t) + tokens is decoded
        again (the reference the cached path must equal)."""
        if cache is None:
            full = tokens if prefix is None else torch.cat([prefix, tokens], 1)
            return self._decode(memory, full, 0, None)[:, -tokens.shape[1] :]
        if cache.length % self.group_size or tokens.shape[1] % self.group_size:
            raise ValueError(f"cached decoding feeds whole groups of {self.group_size} tokens")
        if cache.static:
            if cache.length + tokens.shape[1] > cache.max_len:
                raise ValueError(f"decoder position {cache.length + tokens.shape[1]} exceeds the static cache's "
                                 f"{cache.max_len} positions")
            out = self._decode_static(memory, tokens, cache)
        else:
            out = self._decode(memory, tokens, cache.length, cache.layers, shared=cache.shared)
        cache.length += tokens.shape[1]
        return out

    def _decode_static(self, memory: Memory, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """One step with a static cache: the same numbers as ``_decode`` with a growing cache, but every shape is
        fixed and the positions come from ``cache.pos`` on the device (no host value), so the step can be
        captured in a CUDA graph. Keys beyond the new positions' groups are masked out."""
        t = tokens.shape[1]
        idx = cache.pos + torch.arange(t, device=tokens.device)  # positions written by this step
        x = self._embed_at(tokens, idx)
        k = self.group_size
        j = torch.arange(cache.max_len, device=tokens.device)
        mask = (j[None, :] < (torch.div(idx, k, rounding_mode="floor") + 1)[:, None] * k)[None, None]
        for layer in cache.layers:
            layer["self"][static_cache.INDEX] = idx
        h = self.decoder.run(x, lambda pos, layer, y: layer(y, memory, mask, cache.layers[pos]))
        cache.pos.add_(t)
        return torch.log_softmax(self.generator(h).float(), dim=-1)

    def start_tokens(self, batch: int, device=None) -> torch.Tensor:
        return torch.full((batch, self.group_size), self.bos, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ training helpers
    def teacher_inputs(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Loader targets [BOS, y_1.., EOS, PAD..] (N, T+1) -> (decoder inputs, outputs to predict), both (N, T).

        Inputs are K start symbols then y shifted by K; K = 1 gives the usual [BOS, y_1..] -> [y_1.., EOS]."""
        y = targets[:, 1:]
        k = self.group_size
        start = torch.full((y.shape[0], k), self.bos, dtype=y.dtype, device=y.device)
        inputs = torch.cat([start, y[:, : max(y.shape[1] - k, 0)]], 1)[:, : y.shape[1]]
        return inputs, y

    def xe_loss(self, features, boxes, region_mask, targets: torch.Tensor, label_smoothing: float = 0.0,
                reduction: str = "mean", sync_free: bool = False) -> torch.Tensor:
        """Mean token cross-entropy; ``targets`` (B, C, T+1) or (N, T+1) with the images repeated C times.

        ``reduction="sum"`` gives the sum over the target tokens instead (data-parallel training divides it by
        the global token count). ``sync_free``: label smoothing sums the masked losses instead of selecting the
        target tokens (a selection's size is read on the host, which a CUDA graph cannot do); the same value up
        to float rounding."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
        if targets.dim() == 3:
            b, c, t = targets.shape
            targets = targets.reshape(b * c, t)
            memory = self.encode(features, boxes, region_mask).repeat(c)
        else:
            memory = self.encode(features, boxes, region_mask)
        inputs, y = self.teacher_inputs(targets)
        logp = self.forward(None, None, None, inputs, memory=memory)
        if not label_smoothing:
            return F.nll_loss(logp.reshape(-1, logp.shape[-1]), y.reshape(-1), ignore_index=PAD, reduction=reduction)
        return _smoothed_nll(logp, y, label_smoothing, reduction, sync_free)


def _smoothed_nll(logp: torch.Tensor, y: torch.Tensor, eps: float, reduction: str = "mean",
                  sync_free: bool = False) -> torch.Tensor:
    valid = y != PAD
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    smooth = -logp.mean(-1)
    loss = (1 - eps) * nll + eps * smooth
    if sync_free:
        total = torch.where(valid, loss, 0.0).sum()
        return total if reduction == "sum" else total / valid.sum().clamp(min=1)
    return loss[valid].sum() if reduction == "sum" else loss[valid].mean()
