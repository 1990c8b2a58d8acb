"""Fused attention (scaled_dot_product_attention) equals the explicit softmax(QK^T/sqrt(d))V path, fp32 CPU.

Every registry preset, in eval mode: teacher forcing, cached incremental decoding (log-probs and greedy tokens),
and a training step's loss and gradients (dropout off); plus the edge cases of the fused path (query rows with
nothing to attend to, the geometry bias with a mask, dropout on the attention probabilities). CPUs take the
explicit path by default (``auto``), so every test here runs inside ``fused_attention()`` and computes the
reference inside ``explicit_attention()``."""

from __future__ import annotations

import pytest
import torch

from captioning.decoding import beam_search, greedy
from captioning.models import layers
from captioning.models.layers import MultiHeadAttention, attention_mode, explicit_attention, fused_attention
from captioning.models.registry import PRESETS
from tests.models.test_models import inputs, tiny

TOL = {"atol": 1e-5, "rtol": 1e-5}
ALL = sorted(PRESETS)


@pytest.fixture(autouse=True)
def fused_everywhere():
    with fused_attention():
        yield


def _targets(model, b: int = 3, t: int = 9, seed: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(3, model.vocab_size, (b, t), generator=g)
    body[body == model.bos] = 3
    body[body == model.eos] = 3
    body[1, 6:] = 0  # a shorter caption (padding)
    return torch.cat([torch.full((b, 1), model.bos), body], 1)


def _count_fused_calls(model, monkeypatch) -> list[int]:
    calls = [0]
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("name", ALL)
def test_teacher_forcing_fused_equals_explicit(name, monkeypatch):
    model = tiny(name)
    feats, boxes, mask = inputs()
    x, _ = model.teacher_inputs(_targets(model))
    calls = _count_fused_calls(model, monkeypatch)
    with torch.no_grad():
        fused = model(feats, boxes, mask, x)
        n_fused = calls[0]
        with explicit_attention():
            ref = model(feats, boxes, mask, x)
    assert calls[0] == n_fused  # the explicit path never calls SDPA
    if name.startswith("zodiac"):
        assert n_fused == 0  # GELU on the scores: always explicit
    else:
        assert n_fused > 0
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, ref, **TOL)


@pytest.mark.parametrize("name", ALL)
def test_cached_decoding_fused_equals_explicit(name):
    model = tiny(name)
    feats, boxes, mask = inputs()
    k = model.group_size
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        mem = model.encode(feats, boxes, mask)
        with explicit_attention():
            mem_ref = model.encode(feats, boxes, mask)
        torch.testing.assert_close(mem.states, mem_ref.states, **TOL)
        fused_cache, ref_cache = model.new_cache(), model.new_cache()
        tokens = model.start_tokens(3)
        for _ in range(6):
            a = model.decode_step(mem, tokens, fused_cache)
            with explicit_attention():
                b = model.decode_step(mem_ref, tokens, ref_cache)
            torch.testing.assert_close(a, b, **TOL)
            tokens = torch.randint(3, model.vocab_size, (3, k), generator=g)
    max_len = 12 if k == 1 else 3 * k * 2
    got = greedy(model, mem, max_len=max_len)
    with explicit_attention():
        ref = greedy(model, mem_ref, max_len=max_len)
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.token_logprobs, ref.token_logprobs, **TOL)


@pytest.mark.parametrize("name", ["aic", "acort-base", "ort-base", "lw-3x"])
def test_beam_search_fused_equals_explicit(name):
    model = tiny(name)
    feats, boxes, mask = inputs()
    with torch.no_grad():
        mem = model.encode(feats, boxes, mask)
    got = beam_search(model, mem, beam=3, max_len=10)
    with explicit_attention():
        ref = beam_search(model, mem, beam=3, max_len=10)
    assert torch.equal(got.tokens, ref.tokens)


@pytest.mark.parametrize("name", ALL)
def test_training_loss_and_gradients_fused_equal_explicit(name):
    """Train mode with every dropout off: the same loss and the same gradients through both paths."""
    model = tiny(name, dropout=0.0, input_dropout=0.0, zodiac_dropout=0.0).train()
    feats, boxes, mask = inputs()
    targets = _targets(model)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model.xe_loss(feats, boxes, mask, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads()
    with explicit_attention():
        ref_loss, ref_grads = loss_and_grads()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert grads.keys() == ref_grads.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("kw", [{}, {"share": "kv"}, {"share": "qk"}, {"groups": 2, "grouped_merge": True},
                                {"groups": 2, "qk_expand": 3}])
def test_rows_with_nothing_to_attend_to_give_zero_and_finite_gradients(kw):
    torch.manual_seed(0)
    att = MultiHeadAttention(16, 4, dropout=0.0, **kw).eval()
    x = torch.randn(2, 5, 16, requires_grad=True)
    mem = torch.randn(2, 4, 16, requires_grad=True)
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    mask[1] = False  # the second image has no region at all
    bias = torch.randn(2, 4, 5, 4)
    for b in (None, bias):
        out = att(x, mem, mask, bias=b)
        with explicit_attention():
            ref = att(x, mem, mask, bias=b)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, **TOL)
        # the empty rows carry only the merge's bias (their attention output is 0)
        torch.testing.assert_close(out[1], att.o.bias.expand(5, 16) if not att.grouped_merge else
                                   att.o.bias.repeat(2).expand(5, 16))
        out.square().sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(mem.grad).all()
        assert torch.count_nonzero(mem.grad[1]) == 0  # nothing flows into the masked-out keys
        x.grad = mem.grad = None


def test_geometry_bias_with_padding_mask_equals_explicit():
    torch.manual_seed(0)
    att = MultiHeadAttention(16, 4, dropout=0.0).eval()
    x = torch.randn(3, 6, 16)
    mask = torch.ones(3, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False
    mask[2, ..., 1:] = False
    bias = torch.log(torch.rand(3, 4, 6, 6).clamp(min=1e-6))
    with torch.no_grad():
        out = att(x, x, mask, bias=bias)
        with explicit_attention():
            ref = att(x, x, mask, bias=bias)
    torch.testing.assert_close(out, ref, **TOL)


def test_attention_dropout_in_training_only():
    torch.manual_seed(0)
    att = MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 7, 16)
    causal = torch.tril(torch.ones(7, 7, dtype=torch.bool))[None, None]
    att.eval()
    with torch.no_grad():
        ev = att(x, x, causal)
        torch.testing.assert_close(att(x, x, causal), ev, atol=0, rtol=0)  # no dropout in eval
        att.train()
        a, b = att(x, x, causal), att(x, x, causal)
        assert not torch.allclose(a, b)  # attention probabilities are dropped in training
        att.drop.p = 0.0
        torch.testing.assert_close(att(x, x, causal), ev, **TOL)


def test_attention_modes(monkeypatch):
    att = MultiHeadAttention(8, 2, dropout=0.0).eval()
    x = torch.randn(1, 3, 8)
    calls = _count_fused_calls(att, monkeypatch)
    with torch.no_grad():
        fused = att(x, x, None)
        assert layers._MODE == "fused" and calls[0] == 1
        with explicit_attention():
            assert layers._MODE == "explicit"
            ref = att(x, x, None)
        assert layers._MODE == "fused" and calls[0] == 1  # restored; the explicit path never calls SDPA
        with attention_mode("auto"):  # the default: CPUs take the explicit path, accelerators SDPA
            torch.testing.assert_close(att(x, x, None), ref, atol=0, rtol=0)
            assert calls[0] == 1
        att.fused = False  # per module: explicit whatever the mode
        torch.testing.assert_close(att(x, x, None), ref, atol=0, rtol=0)
        assert calls[0] == 1
    torch.testing.assert_close(fused, ref, **TOL)
    with pytest.raises(ValueError, match="flash"), attention_mode("flash"):
        pass
