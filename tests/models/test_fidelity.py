"""Fidelity to the papers' released code: the ZoDIAC dropout site, the ``released`` flavours' arithmetic and
the importers of released checkpoints (state dicts built here with the released code's names and shapes)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from captioning.models.layers import MultiHeadAttention


def _zodiac_reference(att: MultiHeadAttention, x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """The released formula by hand: RA = Dropout(softmax(G(Q K^T / sqrt(d_k))) V), out = W_o(RA * IV)."""
    b, t, d = x.shape
    h, dk = att.h, att.d_v
    g = F.gelu

    def heads(w: torch.nn.Linear) -> torch.Tensor:
        return g(w(g(x))).view(b, t, h, dk).transpose(1, 2)

    q, k, v, q2 = heads(att.q), heads(att.k_proj), heads(att.v), heads(att.q2)
    probs = torch.softmax(g(q @ k.transpose(-1, -2) / math.sqrt(dk)), -1)
    torch.manual_seed(seed)  # the module's first random draw is its ZoDIAC dropout
    ra = F.dropout(probs @ v, p, training=True)
    iv = 1.0 + torch.sigmoid(g(q2 @ v.transpose(-1, -2) / math.sqrt(dk)).mean(-1, keepdim=True))
    return att.o((ra * iv).transpose(1, 2).reshape(b, t, d))


def test_zodiac_dropout_acts_on_the_attention_output():
    torch.manual_seed(0)
    att = MultiHeadAttention(12, 2, zodiac=True, dropout=0.0, zodiac_dropout=0.5).train()
    x = torch.randn(2, 5, 12)  # 5 keys, d_k = 6: the probabilities and the output differ in shape
    torch.manual_seed(123)
    out = att(x, x, None)
    with torch.no_grad():
        ref = _zodiac_reference(att, x, 123, 0.5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # and the dropout zeroes whole per-head output entries: with W_o = identity, zeros appear in the output
    with torch.no_grad():
        att.o.weight.copy_(torch.eye(12))
        att.o.bias.zero_()
    torch.manual_seed(7)
    out = att(x, x, None)
    zeros = (out == 0).float().mean().item()
    assert 0.3 < zeros < 0.7, zeros  # about half the entries with p=0.5; dropping probabilities gives ~none
