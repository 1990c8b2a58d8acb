"""Parts of the one encoder-decoder skeleton: attention variants, FFN variants, ORT box geometry.

One attention module covers the papers' variants as options that combine freely:
- projections: standard (W_Q, W_K, W_V, W_O); Share-kV (V := K, ACORT); Share-QK (K := W_Q x, ACORT);
- group-wise (LW-Transformer): the input is split into ``groups`` channel groups *before* the projections, one
  shared set of projections (d/k -> (h/k) * d_qk) serves every group, and the groups' heads are simply heads;
  ``qk_expand`` widens Q and K per head (1x/2x/3x = 64/128/192 at d=512, h=8); the merge W_O is dense, or
  shared per group with ``grouped_merge`` (the paper's G-LML);
- ZoDIAC: GELU before and after the projections, a second query projection Q2, refined attention
  ``softmax(mask(G(QK^T/sqrt(d))))`` and an intensity gate ``zoneup + phi(mean over valid keys of
  G(Q2 V^T / sqrt(d)))`` per sample, head and query (never across the batch, and never across query positions,
  which would let a decoder position see the future); ``zodiac_pool="released"`` pools as the released code
  does for a batch of one image (see :meth:`MultiHeadAttention._released_pool`);
- ORT geometry: an additive ``log(max(G, 1e-6))`` per head, from :class:`BoxGeometry`.

Incremental decoding: ``forward(..., cache=...)`` appends the new keys/values to ``cache`` (self-attention) or
reuses the memory's keys/values computed once (cross-attention), so a step costs O(t).

Fused attention: every variant but ZoDIAC (GELU on the scores) runs through
``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels on CUDA): standard,
Share-kV, Share-QK, group-wise (its groups' heads are heads), ``qk_expand`` (scale ``1/sqrt(d_qk)`` given
explicitly), cross-attention, and ORT's geometry as an additive float mask with -inf where the boolean mask
forbids. Query rows with nothing to attend to give 0, as in the explicit path. Which path runs is
:func:`attention_mode`: ``auto`` (the default) fuses on accelerators and keeps the explicit path on CPUs, where it
is as fast at these sizes (SDPA's math backend is the same arithmetic behind more dispatch, and the CPU flash
kernel rounds a one-position cached step differently from the full recomputation, beyond the 1e-5 the
cached == uncached tests hold); ``fused_attention()`` forces SDPA everywhere (the CPU equivalence tests),
``explicit_attention()`` the reference everywhere (``capflow bench train``'s anchor); ``.fused = False`` on a
module keeps that module explicit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from captioning.models import static_cache

ATTENTION_MODES = ("auto", "fused", "explicit")
_MODE = "auto"  # process-wide (not thread-local): see attention_mode()
DECODE_QUERIES = 8  # auto mode: fp32 attention of at most this many query positions without autograd is explicit


@contextlib.contextmanager
def attention_mode(mode: str) -> Iterator[None]:
    """Inside the block every :class:`MultiHeadAttention` computes attention the ``mode`` way: ``fused``
    (``scaled_dot_product_attention`` wherever the arithmetic allows, CPUs included), ``explicit``
    (``softmax(QK^T/sqrt(d)) V`` materialised: the reference) or ``auto`` (fused on accelerators, explicit on
    CPUs and for fp32 decoding steps of at most :data:`DECODE_QUERIES` query positions without autograd; the
    default outside any block). ZoDIAC is explicit in every mode."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"unknown attention mode {mode!r}: one of {', '.join(ATTENTION_MODES)}")
    global _MODE
    before = _MODE
    _MODE = mode
    try:
        yield
    finally:
        _MODE = before


def explicit_attention() -> contextlib.AbstractContextManager:
    """``attention_mode("explicit")``: the reference path everywhere."""
    return attention_mode("explicit")


def fused_attention() -> contextlib.AbstractContextManager:
    """``attention_mode("fused")``: ``scaled_dot_product_attention`` on every device (CPUs included)."""
    return attention_mode("fused")


class MultiHeadAttention(nn.Module):
    fused: bool = True  # False: this module always takes the explicit path

    def __init__(
        self,
        d_model: int,
        heads: int,
        *,
        dropout: float = 0.1,
        share: str | None = None,  # None | "kv" | "qk"
        groups: int = 1,
        qk_expand: int = 1,
        grouped_merge: bool = False,
        zodiac: bool = False,
        zodiac_gate: str = "sigmoid",
        zodiac_dropout: float = 0.2,
        zoneup: float = 1.0,
        zodiac_pool: str = "sample",
    ):
        super().__init__()
        if share not in (None, "kv", "qk"):
            raise ValueError(f"unknown attention sharing {share!r}")
        if d_model % groups or heads % groups:
            raise ValueError(f"d_model {d_model} and heads {heads} must be divisible by groups {groups}")
        self.d, self.h, self.k = d_model, heads, groups
        self.share = share
        self.zodiac = zodiac
        self.hg = heads // groups  # heads per group
        self.d_v = d_model // heads
        self.d_qk = self.d_v * qk_expand
        d_in = d_model // groups
        self.q = nn.Linear(d_in, self.hg * self.d_qk)
        if share != "qk":
            self.k_proj = nn.Linear(d_in, self.hg * self.d_qk)
        if share != "kv":
            self.v = nn.Linear(d_in, self.hg * self.d_v)
        elif qk_expand != 1:
            raise ValueError("Share-kV needs equal Q/K and V widths (qk_expand=1)")
        if zodiac:
            self.q2 = nn.Linear(d_in, self.hg * self.d_qk)
            if self.d_qk != self.d_v:
                raise ValueError("ZoDIAC intensity needs equal Q and V widths (qk_expand=1)")
            self.gate = torch.sigmoid if zodiac_gate == "sigmoid" else torch.tanh
            self.zoneup = zoneup
            self.z_drop = nn.Dropout(zodiac_dropout)
            if zodiac_pool not in ("sample", "released"):
                raise ValueError(f"unknown ZoDIAC pooling {zodiac_pool!r}: sample or released")
            self.zodiac_pool = zodiac_pool
        self.grouped_merge = grouped_merge
        self.o = nn.Linear(d_model // groups, d_model // groups) if grouped_merge else nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    # ------------------------------------------------------------------ projections
    def _split(self, x: torch.Tensor, proj: nn.Linear, width: int) -> torch.Tensor:
        """(B, T, d) -> (B, h, T, width): groups before the projection, heads after."""
        b, t, _ = x.shape
        if self.zodiac:
            x = F.gelu(x)
        y = proj(x.view(b, t, self.k, self.d // self.k))  # (B, T, k, hg*width)
        if self.zodiac:
            y = F.gelu(y)
        return y.view(b, t, self.k, self.hg, width).permute(0, 2, 3, 1, 4).reshape(b, self.h, t, width)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.share == "qk":
            k = self._split(x, self.q, self.d_qk)
        else:
            k = self._split(x, self.k_proj, self.d_qk)
        v = k if self.share == "kv" else self._split(x, self.v, self.d_v)
        return k, v

    def _fused_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d_qk) + bias, masked) v through ``F.scaled_dot_product_attention``; (B, h, Tq, d_v).

        A query row whose mask is all False would get NaN from SDPA (and NaN gradients): such rows attend to
        every key instead and their output is set to 0 afterwards (no gradient flows through them), which is
        what the explicit path gives. On CPUs (``fused_attention()``) the math backend is used: the CPU flash
        kernel's blocked softmax rounds a one-position cached step differently from the full recomputation (by up
        to ~1e-5 on the log-probs after a few layers), the math backend like the explicit path."""
        empty = None
        if mask is not None:
            empty = ~mask.any(-1, keepdim=True)  # (..., Tq, 1)
            mask = mask | empty
        attn_mask = mask
        if bias is not None:
            attn_mask = bias.to(q.dtype)
            if mask is not None:
                attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
        with sdpa_kernel(SDPBackend.MATH) if q.device.type == "cpu" else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                 dropout_p=self.drop.p if self.training else 0.0,
                                                 scale=1.0 / math.sqrt(self.d_qk))
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
        return out

    def _use_fused(self, q: torch.Tensor) -> bool:
        if self.zodiac or not self.fused or _MODE == "explicit":
            return False
        if _MODE == "fused":
            return True
        # auto: fused on accelerators, except fp32 decoding steps (a few query positions, no gradient): there the
        # fp32 memory-efficient kernel took 24 us a call on an H100 (AIC, batch 50: 23% of a greedy search's GPU
        # time), more than the explicit path's few small kernels
        few = q.shape[-2] <= DECODE_QUERIES and q.dtype == torch.float32 and not torch.is_grad_enabled()
        return q.device.type != "cpu" and not few

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        mask: torch.Tensor | None,
        *,
        bias: torch.Tensor | None = None,
        cache: dict[str, Any] | None = None,
        kind: str = "self",
    ) -> torch.Tensor:
        """query (B, Tq, d); key (B, Tk, d) or None with a filled cross cache; mask broadcastable to
        (B, h, Tq, Tk), True = may attend; bias (B, h, Tq, Tk) added to the logits (geometry)."""
        b, tq, _ = query.shape
        q = self._split(query, self.q, self.d_qk)
        if cache is not None and kind == "cross" and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = self.project_kv(key)
            if static_cache.is_static(cache):  # preallocated positions, written in place (see static_cache)
                k = static_cache.write(cache, "k", k, 2)
                v = k if self.share == "kv" else static_cache.write(cache, "v", v, 2)
            elif cache is not None:
                if kind == "self" and "k" in cache:
                    k = torch.cat([cache["k"], k], dim=2)
                    v = k if self.share == "kv" else torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        if self.zodiac and self.zodiac_pool == "released" and cache is not None and kind == "self":
            raise ValueError("zodiac_pool='released' pools over every query of the prefix: decode without a cache "
                             "(use_cache=False)")
        if self._use_fused(q):
            out = self._fused_attention(q, k, v, mask, bias)
        else:
            out = self._explicit_attention(query, q, k, v, mask, bias, self_attention=key is query)
        # (B, h, Tq, d_v) -> heads back to channels, group-major
        out = out.transpose(1, 2).reshape(b, tq, self.h * self.d_v)
        if self.grouped_merge:
            return self.o(out.view(b, tq, self.k, self.d // self.k)).reshape(b, tq, self.d)
        return self.o(out)

    def _explicit_attention(self, query: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor | None, bias: torch.Tensor | None,
                            self_attention: bool = False) -> torch.Tensor:
        """The scores materialised: ZoDIAC's refined attention and intensity gate, and the reference path.
        ``self_attention``: the keys are the queries (the released ZoDIAC pooling leaves padded regions out)."""
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_qk)
        if self.zodiac:
            scores = F.gelu(scores)
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        attn = torch.nan_to_num(attn)  # rows with nothing to attend to (padding queries)
        if self.zodiac:  # RA = Dropout(softmax(...) V): the dropout acts on the attention output, then the gate
            out = self.z_drop(attn @ v)
            q2 = self._split(query, self.q2, self.d_qk)
            inten = F.gelu(q2 @ v.transpose(-1, -2) / math.sqrt(self.d_qk))  # (B, h, Tq, Tk)
            if self.zodiac_pool == "released":
                pooled = self._released_pool(inten, mask, regions=self_attention)
            elif mask is not None:
                valid = mask.expand_as(inten)
                pooled = (inten * valid).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
            else:
                pooled = inten.mean(-1, keepdim=True)
            out = out * (self.zoneup + self.gate(pooled))
        else:
            out = self.drop(attn) @ v
        return out

    @staticmethod
    def _released_pool(inten: torch.Tensor, mask: torch.Tensor | None, regions: bool = False) -> torch.Tensor:
        """The released ZoDIAC code's pooling (``zodiac_pool="released"``) as that code computes it for a batch of
        ONE image: per sample one scalar, the sum of the intensities at every (head, query, valid key) divided by
        the number of True entries of the mask as given (``(1, 1, 1, Tk)`` for memory keys: the valid regions;
        ``(1, 1, Tq, Tk)`` for the decoder's own causal mask: ``Tq (Tq + 1) / 2``), so the head and query counts
        are missing from the denominator, as released. The released code divides one sum over the whole batch (or
        beam) by the whole batch's mask, so there a caption depends on the other rows; here every row is computed
        as if it were alone, whatever the batch (and rows can leave a search without changing the others).
        ``regions``: the regions' self-attention, whose padded queries are left out as well (the released code
        clips a lone image's regions to the valid ones). (B, h, Tq, Tk) -> (B, 1, 1, 1). The gate changes every
        query's output as the prefix grows, so decoding re-runs the whole prefix (``use_cache=False``)."""
        if mask is None:
            return inten.mean(dim=(1, 2, 3), keepdim=True)
        m = mask.to(inten.dtype)
        valid = m
        if regions and m.shape[-2] == 1 and m.shape[-1] == inten.shape[-2]:
            valid = m * m.transpose(-1, -2)  # (B, 1, Tq, Tk): valid query and valid key
        num = (inten * valid).sum(dim=(1, 2, 3))
        den = m.sum(dim=(1, 2, 3))  # per sample; one count for all when the mask has no batch dimension
        return (num / den).reshape(-1, 1, 1, 1)


class FeedForward(nn.Module):
    """Dense FFN, or LW-Transformer's G-FFN: dense first layer, then one shared W_2' applied per group.

    ``activation="none"`` drops the ReLU (``w_2(Drop(w_1 x))``), as ZoDIAC's released model classes
    (``ZTransformerModel.py``, ``ZTransformerModel2.py``) do; capflow's default keeps it."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1, groups: int = 1, activation: str = "relu"):
        super().__init__()
        if d_ff % groups or d_model % groups:
            raise ValueError(f"d_ff {d_ff} and d_model {d_model} must be divisible by groups {groups}")
        if activation not in ("relu", "none"):
            raise ValueError(f"unknown FFN activation {activation!r}: relu or none")
        self.act = F.relu if activation == "relu" else (lambda t: t)
        self.k = groups
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff // groups, d_model // groups)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.w1(x)))
        if self.k == 1:
            return self.w2(h)
        b, t, f = h.shape
        return self.w2(h.view(b, t, self.k, f // self.k)).reshape(b, t, -1)


class BoxGeometry(nn.Module):
    """ORT box relations: the 64-d embedding of pairwise box geometry, computed once per forward."""

    def __init__(self, dim: int = 64, wave_len: float = 1000.0, scale: float = 100.0, width_offset: float = 1.0):
        super().__init__()
        self.dim, self.wave_len, self.scale, self.width_offset = dim, wave_len, scale, width_offset

    def forward(self, boxes: torch.Tensor) -> torch.Tensor:
        """boxes (B, R, 4) x1,y1,x2,y2 in [0,1] -> (B, R, R, dim)."""
        if not boxes.is_floating_point():
            boxes = boxes.float()
        x0, y0, x1, y1 = boxes.unbind(-1)  # in the boxes' own precision (float64 models stay float64)
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        w = (x1 - x0) + self.width_offset
        h = (y1 - y0) + self.width_offset
        dx = torch.log(torch.clamp((cx[..., :, None] - cx[..., None, :]).abs() / w[..., :, None], min=1e-3))
        dy = torch.log(torch.clamp((cy[..., :, None] - cy[..., None, :]).abs() / h[..., :, None], min=1e-3))
        dw = torch.log(w[..., :, None] / w[..., None, :])
        dh = torch.log(h[..., :, None] / h[..., None, :])
        delta = torch.stack([dx, dy, dw, dh], -1)  # (B, R, R, 4)
        n = self.dim // 8
        omega = self.wave_len ** (-torch.arange(n, device=boxes.device, dtype=boxes.dtype) / n)
        arg = (self.scale * delta)[..., None] * omega  # (B, R, R, 4, n)
        emb = torch.cat([torch.sin(arg), torch.cos(arg)], -1)  # (B, R, R, 4, 2n)
        return emb.flatten(-2)  # (B, R, R, 8n = dim)


class GeometryBias(nn.Module):
    """Per-layer ORT weights: G^h = ReLU(w_h . E + b_h); returns log(max(G, 1e-6)) as (B, h, R, R)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.w = nn.Linear(dim, heads)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        g = F.relu(self.w(emb))  # (B, R, R, h)
        return torch.log(torch.clamp(g, min=1e-6)).permute(0, 3, 1, 2)


class AnnotatedLayerNorm(nn.Module):
    """The Annotated Transformer's LayerNorm, used by the released AIC (ruotianluo), SATIC, ZoDIAC and ORT/ACORT
    code: ``weight * (x - mean) / (std + eps) + bias`` with the *unbiased* standard deviation and ``eps`` outside
    the root (``nn.LayerNorm``: biased variance, eps inside the root). Parameters are named like
    ``nn.LayerNorm``'s (``weight``, ``bias``), so checkpoints of either kind load into the other."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        return self.weight * (x - mean) / (x.std(-1, keepdim=True) + self.eps) + self.bias


LAYER_NORMS = ("torch", "annotated")


def layer_norm(kind: str, d: int) -> nn.Module:
    """``torch``: ``nn.LayerNorm(d)`` (capflow's default); ``annotated``: :class:`AnnotatedLayerNorm`."""
    if kind == "torch":
        return nn.LayerNorm(d)
    if kind == "annotated":
        return AnnotatedLayerNorm(d)
    raise ValueError(f"unknown layer norm {kind!r}: one of {', '.join(LAYER_NORMS)}")


def sinusoid_table(length: int, d: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    i = torch.arange(0, d, 2, dtype=torch.float32)
    ang = pos / torch.pow(10000.0, i / d)
    pe = torch.zeros(length, d)
    pe[:, 0::2] = torch.sin(ang)
    pe[:, 1::2] = torch.cos(ang[:, : d // 2])
    return pe
