"""The architecture of a :class:`~captioning.models.encoder_decoder.captioner.Captioner`: :class:`ArchConfig`
(every paper is a choice of its parts; the fidelity options are described in
:mod:`captioning.models.encoder_decoder`) and the checks of its combinations that the model makes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


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


def check_skeleton(cfg: ArchConfig) -> None:
    """The combinations a :class:`Captioner` refuses before it builds anything: an unknown skeleton, the ``m2``
    skeleton without post-LN, the released ACORT step cache on a model it does not fit."""
    if cfg.skeleton not in SKELETONS:
        raise ValueError(f"unknown skeleton {cfg.skeleton!r}: one of {', '.join(SKELETONS)}")
    if cfg.skeleton == "m2" and cfg.norm != "post":
        raise ValueError("the m2 skeleton is post-LN: set norm='post' with skeleton='m2'")
    if cfg.released_acort_cache and (cfg.group_size != 1 or cfg.dec_attention != "standard"):
        raise ValueError("released_acort_cache is the released ORT/ACORT decoder's step cache: it needs group "
                         "size 1 and standard decoder self-attention")


def share_map(share: tuple[int, ...] | None, n: int) -> tuple[int, ...]:
    """A stack's layer sharing map (``enc_share`` / ``dec_share``; None = no sharing): position -> layer id, the
    ids 0..k-1 all used."""
    m = tuple(range(n)) if share is None else tuple(share)
    if len(m) != n or sorted(set(m)) != list(range(len(set(m)))):
        raise ValueError(f"layer sharing map {m} must give {n} positions using ids 0..k-1")
    return m
