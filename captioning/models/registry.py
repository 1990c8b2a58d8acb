"""Named architectures: every paper is a preset of :class:`ArchConfig`; combinations are one ``replace`` away.

Paper-size presets carry the vocabulary size their paper counts with (AIC/LW/ZoDIAC/SATIC: 9,487 words + 1
output class; ORT: 10,001; ACORT: radix v=768 -> 771 classes; ExpansionNet: ~10k). :func:`build` and
:func:`for_vocab` adapt a preset to a real vocabulary and to demo sizes.

Every preset also has a ``released`` flavour, ``<name>@released`` (:func:`released`): the fidelity options of
:class:`ArchConfig` set to reproduce the papers' released code's arithmetic (Annotated-Transformer LayerNorm for
AIC/SATIC/ZoDIAC/ORT/ACORT; ZoDIAC's FFN without ReLU and its pooling, computed per image as the released code
computes it for a batch of one; ExpansionNet's eps 1e-9, five dropout sites and no cross-attention dropout;
LW-Transformer's M2-shaped skeleton and per-group output projection; the released initialisation details).
Checkpoints imported from the released code (:mod:`captioning.models.released`) use these flavours. The
parameters are the preset's, except for LW-Transformer: its released attention merges the heads with one
``Linear(d/k, d/k)`` shared by the k groups (``fc_o`` of ``LScaledDotProductAttention``), where the paper's counts
imply a dense ``W_O``, so ``lw-*@released`` has fewer parameters than the paper reports (see ``PAPER_PARAMS``).
"""

from __future__ import annotations

from captioning.models.encoder_decoder import ArchConfig, Captioner

RELEASED_SUFFIX = "@released"
AIC = ArchConfig(vocab_size=9488)
_ORT = AIC.replace(geometry=True, vocab_size=10001)
_ACORT = _ORT.replace(share="kv", codec="radix", vocab_size=771, bos=769, eos=770,
                      enc_share=(0, 0, 0, 1, 1, 1), dec_share=(0, 0, 0, 1, 1, 1))
_LW = AIC.replace(groups=2, ffn="grouped")
_ZODIAC = AIC.replace(enc_attention="zodiac", dec_attention="zodiac", cross_attention="zodiac")

PRESETS: dict[str, ArchConfig] = {
    "aic": AIC,
    "ort-base": _ORT,
    "ort-small": _ORT.replace(d_model=256, d_ff=1024),
    "ort-xsmall": _ORT.replace(d_model=104, d_ff=416),
    "acort-base": _ACORT,
    "acort-base-al": _ACORT.replace(enc_share=(0,) * 6, dec_share=(0,) * 6),
    "acort-small": _ACORT.replace(d_model=256, d_ff=1024),
    "acort-xsmall": _ACORT.replace(d_model=256, d_ff=1024, enc_share=(0,) * 6, dec_share=(0,) * 6),
    "expansionnet": AIC.replace(
        d_model=768, heads=8, d_ff=2048, enc_layers=3, dec_layers=3, dropout=0.3, input_relu=False,
        input_dropout=0.3, enc_attention="expansion", dec_attention="expansion", pos_enc="learned",
        stack_output="concat", vocab_size=10001,
    ),
    "lw-1x": _LW,
    "lw-2x": _LW.replace(qk_expand=2),
    "lw-3x": _LW.replace(qk_expand=3),
    "satic-k2": AIC.replace(group_size=2),
    "satic-k4": AIC.replace(group_size=4),
    "satic-k6": AIC.replace(group_size=6),
    "zodiac-sigmoid": _ZODIAC,
    "zodiac-tanh": _ZODIAC.replace(zodiac_gate="tanh"),
}

# the paper figure each preset is checked against, and how that paper counts (see params.py)
PAPER_PARAMS: dict[str, tuple[int | None, str]] = {
    "aic": (54_914_832, "full"),
    "ort-base": (55_443_777, "full"),
    "ort-small": (16_700_000, "full"),
    "ort-xsmall": (4_140_000, "full"),
    "acort-base": (14_979_347, "full"),
    "acort-base-al": (8_410_379, "full"),
    "acort-small": (4_213_779, "full"),
    "acort-xsmall": (2_567_435, "full"),
    "expansionnet": (None, "full"),
    "lw-baseline": (44_107_776, "stacks"),
    "lw-1x": (24_036_864, "stacks"),
    "lw-2x": (26_405_376, "stacks"),
    "lw-3x": (28_773_888, "stacks"),
    "satic-k2": (54_914_832, "full"),
    "satic-k4": (54_914_832, "full"),
    "satic-k6": (54_914_832, "full"),
    "zodiac-sigmoid": (59_642_640, "full"),
    "zodiac-tanh": (59_642_640, "full"),
}
PAPER_PARAMS.update({name + RELEASED_SUFFIX: v for name, v in list(PAPER_PARAMS.items())})  # same counts...
# ...but LW-Transformer's released code (luogen1996/LWTransformer, ``train.py --model lwtransformer --LFFN
# --d_k 64|128|192``) shares one merge Linear(h*d_v/k, d/k) across the k=2 groups instead of the dense W_O the
# paper's figures count: 6 x (1 + 2) attentions x (512*512 + 512 - 256*256 - 256) = 3,543,552 fewer (the M2
# skeleton's extra LayerNorms are outside the "stacks" convention). These are the released model's counts.
PAPER_PARAMS.update({
    "lw-1x" + RELEASED_SUFFIX: (20_493_312, "stacks"),
    "lw-2x" + RELEASED_SUFFIX: (22_861_824, "stacks"),
    "lw-3x" + RELEASED_SUFFIX: (25_230_336, "stacks"),
})


def released(cfg: ArchConfig) -> ArchConfig:
    """The released code's arithmetic for an architecture (any preset or combination): see the module docstring.

    Group-wise attention (``groups > 1``: LW-Transformer) gets the released M2-shaped skeleton
    (``skeleton="m2"``, post-LN; see :mod:`captioning.models.encoder_decoder`), the per-group output projection
    (``grouped_merge``) and the released region dropout (the layers' 0.1); its LayerNorms are ``nn.LayerNorm``."""
    changes: dict = {"init": "released"}
    expansion = "expansion" in (cfg.enc_attention, cfg.dec_attention)
    if expansion:  # ExpansionNet: nn.LayerNorm already; eps, dropout sites, no attention-weight dropout
        changes.update(expansion_eps=1e-9, expansion_dropout="released", attn_dropout=0.0)
    elif cfg.groups == 1:  # the Annotated-Transformer-based references (AIC, SATIC, ZoDIAC, ORT/ACORT)
        changes.update(layer_norm="annotated")
    else:  # LW-Transformer (luogen1996/LWTransformer, built on the M2-Transformer code)
        changes.update(skeleton="m2", norm="post", grouped_merge=True, input_dropout=cfg.dropout)
    if "zodiac" in (cfg.enc_attention, cfg.dec_attention, cfg.cross_attention):
        changes.update(ffn_activation="none", zodiac_pool="released")
    return cfg.replace(**changes)


def preset(name: str) -> ArchConfig:
    if name.endswith(RELEASED_SUFFIX):
        return released(preset(name[: -len(RELEASED_SUFFIX)]))
    if name == "lw-baseline":
        return AIC
    if name not in PRESETS:
        raise KeyError(f"unknown architecture {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def _scale_share(m: tuple[int, ...] | None, n: int) -> tuple[int, ...] | None:
    """A sharing map for n layers with the same proportions, e.g. (0,0,0,1,1,1) -> (0,1) for n=2."""
    if m is None:
        return None
    picked = [m[(p * len(m)) // n] for p in range(n)]
    ids = {v: i for i, v in enumerate(dict.fromkeys(picked))}
    return tuple(ids[v] for v in picked)


def scaled(cfg: ArchConfig, *, d_model: int, layers: int, heads: int, d_ff: int) -> ArchConfig:
    """The same architecture at another size (demo/tiny). ExpansionNet keeps its half-depth stacks."""
    enc = dec = layers if cfg.enc_layers == 6 else max(1, (layers + 1) // 2)
    n_e = max(4, cfg.expansion_enc * d_model // 768) if cfg.enc_attention == "expansion" else cfg.expansion_enc
    n_d = max(2, cfg.expansion_dec * d_model // 768) if cfg.dec_attention == "expansion" else cfg.expansion_dec
    return cfg.replace(d_model=d_model, heads=heads, d_ff=d_ff, enc_layers=enc, dec_layers=dec,
                       enc_share=_scale_share(cfg.enc_share, enc), dec_share=_scale_share(cfg.dec_share, dec),
                       expansion_enc=n_e, expansion_dec=n_d)


def for_vocab(cfg: ArchConfig, *, word_vocab_size: int, bos: int, eos: int, radix_size: int | None = None,
              radix_bos: int | None = None, radix_eos: int | None = None, max_len: int = 64) -> ArchConfig:
    """Adapt output classes and special ids to a real vocabulary (word ids or radix digits)."""
    if cfg.codec == "radix":
        if radix_size is None:
            raise ValueError("a radix architecture needs the radix codec's size and special ids")
        return cfg.replace(vocab_size=radix_size, bos=radix_bos, eos=radix_eos, max_len=max_len)
    return cfg.replace(vocab_size=word_vocab_size, bos=bos, eos=eos, max_len=max_len)


def build(name_or_cfg: str | ArchConfig, **changes) -> Captioner:
    cfg = preset(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    return Captioner(cfg.replace(**changes) if changes else cfg)
