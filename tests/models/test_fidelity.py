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


# ---------------------------------------------------------------------- the released flavours (issue 16, part 2)
import pytest  # noqa: E402

from captioning.models.encoder_decoder import Captioner  # noqa: E402
from captioning.models.expansion import DynamicExpansion, StaticExpansion, row_normalize  # noqa: E402
from captioning.models.layers import AnnotatedLayerNorm, BoxGeometry, FeedForward, GeometryBias  # noqa: E402
from captioning.models.params import count  # noqa: E402
from captioning.models.registry import PAPER_PARAMS, preset, scaled  # noqa: E402


def tiny(name: str, **kw) -> Captioner:
    cfg = scaled(preset(name), d_model=32, layers=2, heads=4, d_ff=64)
    if cfg.codec == "radix":
        cfg = cfg.replace(vocab_size=20, bos=18, eos=19)
    else:
        cfg = cfg.replace(vocab_size=40)
    torch.manual_seed(0)
    return Captioner(cfg.replace(max_len=40, **kw))


# LW-Transformer's released flavour has its own (released code's) counts: tests/models/test_import_lw.py
@pytest.mark.parametrize("name", ["aic", "acort-base", "zodiac-sigmoid", "expansionnet", "satic-k4"])
def test_released_flavour_keeps_the_paper_parameter_count(name):
    with torch.device("meta"):
        default, rel = Captioner(preset(name)), Captioner(preset(name + "@released"))
    assert PAPER_PARAMS[name + "@released"] == PAPER_PARAMS[name]
    convention = PAPER_PARAMS[name][1]
    assert count(rel, convention) == count(default, convention)
    assert [n for n, _ in rel.named_parameters()] == [n for n, _ in default.named_parameters()]


def test_annotated_layer_norm_is_the_released_formula():
    torch.manual_seed(0)
    ln = AnnotatedLayerNorm(16)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    ln = ln.double()
    mean = x.sum(-1, keepdim=True) / 16
    std = ((x - mean) ** 2).sum(-1, keepdim=True).div(15).sqrt()  # unbiased
    ref = ln.weight * (x - mean) / (std + 1e-6) + ln.bias
    torch.testing.assert_close(ln(x), ref, atol=1e-12, rtol=0)
    assert (ln(x) - torch.nn.functional.layer_norm(x, (16,), ln.weight, ln.bias)).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["aic", "satic-k4", "ort-small", "acort-small", "zodiac-sigmoid"])
def test_annotated_references_get_the_annotated_layer_norm(name):
    rel, default = tiny(name + "@released"), tiny(name)
    norms = [m for m in rel.modules() if isinstance(m, torch.nn.LayerNorm | AnnotatedLayerNorm)]
    assert norms and all(isinstance(m, AnnotatedLayerNorm) for m in norms)
    assert not any(isinstance(m, AnnotatedLayerNorm) for m in default.modules())


def test_zodiac_released_ffn_has_no_relu():
    ffn = tiny("zodiac-sigmoid@released").encoder.layers[0].ffn
    assert isinstance(ffn, FeedForward)
    x = torch.randn(2, 3, 32)
    ffn.eval()
    torch.testing.assert_close(ffn(x), ffn.w2(ffn.w1(x)))
    relu = tiny("zodiac-sigmoid").encoder.layers[0].ffn.eval()
    torch.testing.assert_close(relu(x), relu.w2(torch.relu(relu.w1(x))))


def test_zodiac_released_pooling_is_the_released_scalar_of_each_sample_alone():
    """One scalar per sample: the released sum over heads, queries and valid keys divided by the mask's True entries,
    as the released code computes it for a batch of one image (its regions clipped to the valid ones)."""
    torch.manual_seed(1)
    att = MultiHeadAttention(12, 2, zodiac=True, dropout=0.0, zodiac_dropout=0.0, zodiac_pool="released").eval()
    x, mem = torch.randn(2, 3, 12), torch.randn(2, 4, 12)
    valid = [3, 2]
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])[:, None, None, :]
    g, dk = F.gelu, 6

    def heads(w, t):
        return g(w(g(t))).view(t.shape[0], t.shape[1], 2, dk).transpose(1, 2)

    def alone(query, keys, n_q):  # the released arithmetic for one sample: no padding, one scalar
        q, q2, k, v = heads(att.q, query), heads(att.q2, query), heads(att.k_proj, keys), heads(att.v, keys)
        s = g(q @ k.transpose(-1, -2) / math.sqrt(dk))
        pooled = g(q2 @ v.transpose(-1, -2) / math.sqrt(dk)).sum() / keys.shape[1]  # denominator: the valid keys
        out = (torch.softmax(s, -1) @ v) * (1 + torch.sigmoid(pooled))
        return att.o(out.transpose(1, 2).reshape(1, n_q, 12))

    with torch.no_grad():
        got = att(mem, mem, mask)  # the regions' self-attention: padded regions are neither keys nor queries
        for b, n in enumerate(valid):
            torch.testing.assert_close(got[b : b + 1, :n], alone(mem[b : b + 1, :n], mem[b : b + 1, :n], n),
                                       atol=1e-6, rtol=1e-6)
        got = att(x, mem, mask, kind="cross")  # decoder queries (all real) on each sample's valid regions
        for b, n in enumerate(valid):
            torch.testing.assert_close(got[b : b + 1], alone(x[b : b + 1], mem[b : b + 1, :n], 3), atol=1e-6,
                                       rtol=1e-6)
        # a sample's output does not depend on the others in the batch
        torch.testing.assert_close(att(x[:1], mem[:1], mask[:1], kind="cross"), got[:1], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="use_cache=False"):
        att(x, x, None, cache={}, kind="self")


def test_expansion_eps_and_released_values():
    a = torch.tensor([[1e-3, 0.0]])
    assert row_normalize(a)[0, 0].item() == pytest.approx(0.909, abs=1e-3)  # capflow's 1e-4
    assert row_normalize(a, eps=1e-9)[0, 0].item() == pytest.approx(1.0, abs=1e-5)
    rel = tiny("expansionnet@released")
    exp = [m for m in rel.modules() if isinstance(m, StaticExpansion | DynamicExpansion)]
    assert exp and all(m.eps == 1e-9 and m.released for m in exp)
    assert all(m.eps == 1e-4 and not m.released for m in tiny("expansionnet").modules()
               if isinstance(m, StaticExpansion | DynamicExpansion))
    cross = rel.decoder.layers[0].cross
    assert cross.drop.p == 0.0 and tiny("expansionnet").decoder.layers[0].cross.drop.p == 0.3


def test_static_expansion_released_dropout_sites():
    torch.manual_seed(0)
    m = StaticExpansion(8, 4, dropout=0.5, eps=1e-9, dropout_sites="released").train()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    torch.manual_seed(3)
    out = m(x, mask)
    with torch.no_grad():  # the released block by hand, random draws in its order
        torch.manual_seed(3)
        z = F.dropout(m.queries @ m.key(x).transpose(1, 2) / math.sqrt(8), 0.5, True)
        cols = mask[:, None, :]

        def rn(t):
            return t / (t.sum(-1, keepdim=True) + 1e-9)

        fa = F.dropout(rn(F.relu(z) * cols) @ m.val_a(x) + m.biases, 0.5, True)
        fb = F.dropout(rn(F.relu(-z) * cols) @ m.val_b(x) + m.biases, 0.5, True)
        ya = F.dropout(rn(F.relu(z.transpose(1, 2))) @ fa, 0.5, True)
        yb = F.dropout(rn(F.relu(-z.transpose(1, 2))) @ fb, 0.5, True)
        s = torch.sigmoid(m.select(x))
        ref = (s * ya + (1 - s) * yb) * mask[..., None]
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_dynamic_expansion_released_dropout_sites_and_bias_after_dropout():
    torch.manual_seed(0)
    n, d, t = 3, 8, 4
    m = DynamicExpansion(d, n, dropout=0.5, eps=1e-9, dropout_sites="released").train()
    x = torch.randn(2, t, d)
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    torch.manual_seed(5)
    out = m(x, causal[None, None])
    with torch.no_grad():  # the released block's (T*N, T) formulation by hand
        torch.manual_seed(5)
        cond = m.cond(x)[:, :, None, :]
        q = (m.queries[None, None] + cond).reshape(2, t * n, d)
        bias = (m.biases[None, None] + cond).reshape(2, t * n, d)
        z = F.dropout(q @ m.key(x).transpose(1, 2) / math.sqrt(d), 0.5, True)  # (B, T*N, T)
        m1 = causal[:, None, :].expand(t, n, t).reshape(t * n, t)
        m2 = causal[:, :, None].expand(t, t, n).reshape(t, t * n)

        def rn(w):
            return w / (w.sum(-1, keepdim=True) + 1e-9)

        fa = F.dropout(rn(F.relu(z) * m1) @ m.val_a(x), 0.5, True)
        fb = F.dropout(rn(F.relu(-z) * m1) @ m.val_b(x), 0.5, True)
        ya = F.dropout(rn(F.relu(z.transpose(1, 2)) * m2) @ (fa + bias), 0.5, True)
        yb = F.dropout(rn(F.relu(-z.transpose(1, 2)) * m2) @ (fb + bias), 0.5, True)
        s = torch.sigmoid(m.select(x))
        ref = s * ya + (1 - s) * yb
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_released_init_details():
    ort = tiny("ort-small@released")
    for layer in ort.encoder.layers:
        b = layer.geo.w.bias
        assert torch.equal(b, b[:1].expand_as(b))
    assert not torch.equal(tiny("ort-small").encoder.layers[0].geo.w.bias[:1].expand(4),
                           tiny("ort-small").encoder.layers[0].geo.w.bias)
    lw = tiny("lw-1x@released")
    att = lw.encoder.layers[0].mix
    assert all(float(lin.bias.detach().abs().max()) == 0.0 for lin in (att.q, att.k_proj, att.v, att.o))
    exp, default = tiny("expansionnet@released"), tiny("expansionnet")
    slots = exp.encoder.layers[0].mix.queries.detach()  # Glorot-uniform (N_E, d): bound sqrt(6 / (N_E + d))
    bound = math.sqrt(6 / sum(slots.shape))
    assert float(slots.abs().max()) <= bound
    assert float(default.encoder.layers[0].mix.queries.detach().std()) > 2 * float(slots.std())
    w = exp.input_proj.weight.detach()  # Glorot too (PyTorch's default bound is 1/sqrt(fan_in))
    assert float(w.abs().max()) > 1 / math.sqrt(w.shape[1])
    assert float(w.abs().max()) <= math.sqrt(6 / sum(w.shape))


def test_box_geometry_keeps_float64():
    boxes = torch.tensor([[[0.1, 0.1, 0.5, 0.6], [0.3, 0.2, 0.9, 0.8]]], dtype=torch.float64)
    emb = BoxGeometry(64)(boxes)
    assert emb.dtype == torch.float64
    g = GeometryBias(64, 4).double()
    assert g(emb).dtype == torch.float64
    model = tiny("ort-small").double().eval()
    feats = torch.randn(1, 2, 2048, dtype=torch.float64)
    out = model(feats, boxes, torch.ones(1, 2, dtype=torch.bool), torch.tensor([[1, 5, 6]]))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
