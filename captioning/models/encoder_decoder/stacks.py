"""The encoder and decoder layer stacks of the skeleton: a layer's token mixer (attention or expansion, looked up
by its kind), the residual + LayerNorm sublayers, the two layer types and a stack with its sharing map and
output."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from captioning.models.encoder_decoder.cache import Memory
from captioning.models.encoder_decoder.config import ArchConfig, share_map
from captioning.models.expansion import DynamicExpansion, StaticExpansion
from captioning.models.layers import FeedForward, GeometryBias, MultiHeadAttention, layer_norm


# ---------------------------------------------------------------------- mixers
def _attention(kind: str, cfg: ArchConfig, decoder: bool) -> nn.Module:
    return MultiHeadAttention(
        cfg.d_model, cfg.heads, dropout=cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout,
        share=cfg.share, groups=cfg.groups, qk_expand=cfg.qk_expand, grouped_merge=cfg.grouped_merge,
        zodiac=kind == "zodiac", zodiac_gate=cfg.zodiac_gate, zodiac_dropout=cfg.zodiac_dropout,
        zoneup=cfg.zoneup, zodiac_pool=cfg.zodiac_pool,
    )


def _expansion(kind: str, cfg: ArchConfig, decoder: bool) -> nn.Module:
    opts = {"dropout": cfg.dropout, "eps": cfg.expansion_eps, "dropout_sites": cfg.expansion_dropout}
    if decoder:
        return DynamicExpansion(cfg.d_model, cfg.expansion_dec, **opts)
    return StaticExpansion(cfg.d_model, cfg.expansion_enc, **opts)


#: attention kind (``ArchConfig.enc_attention`` / ``dec_attention`` / ``cross_attention``) -> its mixer's builder
MIXERS: dict[str, Callable[[str, ArchConfig, bool], nn.Module]] = {
    "standard": _attention,
    "zodiac": _attention,
    "expansion": _expansion,
}


def mixer(kind: str, cfg: ArchConfig, *, decoder: bool) -> nn.Module:
    """The token mixer of attention kind ``kind``; ``decoder`` picks an expansion layer's dynamic form."""
    build = MIXERS.get(kind)
    if build is None:
        raise ValueError(f"unknown attention kind {kind!r}")
    return build(kind, cfg, decoder)


def _mix_self(kind: str, mix: nn.Module, y: torch.Tensor, mask: torch.Tensor, *,
              attention_mask: torch.Tensor | None = None, cache: dict | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` mixed with itself by a layer's self-mixer of kind ``kind``: an expansion layer takes the visibility
    ``mask`` (and its ``cache`` when one is given); attention takes ``y`` as its keys too, ``attention_mask``
    (default ``mask``), the ``cache`` and the geometry ``bias``."""
    if kind == "expansion":
        return mix(y, mask) if cache is None else mix(y, mask, cache=cache)
    return mix(y, y, mask if attention_mask is None else attention_mask, bias=bias, cache=cache, kind="self")


def _ffn(cfg: ArchConfig) -> FeedForward:
    return FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.groups if cfg.ffn == "grouped" else 1,
                       activation=cfg.ffn_activation)


# ---------------------------------------------------------------------- layers
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
        self.mix = mixer(cfg.enc_attention, cfg, decoder=False)
        self.ffn = _ffn(cfg)
        self.sub1 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm, inner=m2)
        self.sub2 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm)
        self.geo = GeometryBias(64, cfg.heads) if cfg.geometry else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor, geo_emb: torch.Tensor | None) -> torch.Tensor:
        # box geometry biases attention only (an expansion layer has no logits to bias)
        bias = self.geo(geo_emb) if self.geo is not None and self.kind != "expansion" else None
        x = self.sub1(x, lambda y: _mix_self(self.kind, self.mix, y, mask, attention_mask=mask[:, None, None, :],
                                             bias=bias))
        return self.sub2(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        pre, m2 = cfg.norm == "pre", cfg.skeleton == "m2"
        self.kind = cfg.dec_attention
        self.self_mix = mixer(cfg.dec_attention, cfg, decoder=True)
        self.cross = mixer(cfg.cross_attention, cfg, decoder=False)
        self.ffn = _ffn(cfg)
        self.sub1 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm, inner=m2)
        self.sub2 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm, inner=m2)
        self.sub3 = _Sublayer(cfg.d_model, cfg.dropout, pre, cfg.layer_norm)

    def forward(self, x, memory: Memory, self_mask, cache: dict | None) -> torch.Tensor:
        sc = cache.setdefault("self", {}) if cache is not None else None
        cc = cache.setdefault("cross", {}) if cache is not None else None
        x = self.sub1(x, lambda y: _mix_self(self.kind, self.self_mix, y, self_mask, cache=sc))
        x = self.sub2(x, lambda y: self.cross(y, memory.states, memory.mask[:, None, None, :], cache=cc,
                                              kind="cross"))
        return self.sub3(x, self.ffn)


class Stack(nn.Module):
    """Layers with a sharing map and the stack's output (final LN, none in the M2 skeleton, or ExpansionNet's
    concatenation)."""

    def __init__(self, layer_cls, cfg: ArchConfig, n: int, share: tuple[int, ...] | None):
        super().__init__()
        self.map = share_map(share, n)
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
