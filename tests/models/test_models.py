"""The model zoo on one skeleton: paper parameter counts, cached == uncached steps, masks, sharing, training."""

from __future__ import annotations

import pytest
import torch

from captioning.data.text import RadixCodec
from captioning.models.encoder_decoder import Captioner
from captioning.models.layers import MultiHeadAttention
from captioning.models.params import count
from captioning.models.registry import PAPER_PARAMS, PRESETS, preset, scaled

EXACT = {  # the acceptance figures
    "aic": 54_914_832, "ort-base": 55_443_777, "acort-base": 14_979_347, "acort-base-al": 8_410_379,
    "acort-small": 4_213_779, "acort-xsmall": 2_567_435, "lw-baseline": 44_107_776, "lw-1x": 24_036_864,
    "lw-2x": 26_405_376, "lw-3x": 28_773_888, "zodiac-sigmoid": 59_642_640, "zodiac-tanh": 59_642_640,
    "satic-k2": 54_914_832, "satic-k4": 54_914_832, "satic-k6": 54_914_832,
}
NON_EXPANSION = list(PRESETS)  # expansionnet included
CODEC = RadixCodec(base=6, num_words=30)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_paper_parameter_counts(name):
    paper, convention = PAPER_PARAMS[name]
    assert paper == EXACT[name]
    with torch.device("meta"):  # no memory, no init: counting only
        model = Captioner(preset(name))
    assert count(model, convention) == EXACT[name]


def tiny(name: str, **kw) -> Captioner:
    cfg = scaled(preset(name), d_model=32, layers=2, heads=4, d_ff=64)
    if cfg.codec == "radix":
        cfg = cfg.replace(vocab_size=CODEC.size, bos=CODEC.bos, eos=CODEC.eos)
    else:
        cfg = cfg.replace(vocab_size=40)
    cfg = cfg.replace(max_len=40, **kw)
    torch.manual_seed(0)
    return Captioner(cfg).eval()


def inputs(b=3, r=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, r, 2048, generator=g)
    xy = torch.rand(b, r, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.1 + torch.rand(b, r, 2, generator=g) * 0.4], -1)
    mask = torch.ones(b, r, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    return feats, boxes, mask


@pytest.mark.parametrize("name", NON_EXPANSION)
def test_cached_steps_equal_full_recomputation(name):
    model = tiny(name)
    feats, boxes, mask = inputs()
    k = model.group_size
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        mem = model.encode(feats, boxes, mask)
        cache = model.new_cache()
        tokens = model.start_tokens(3)
        prefix = torch.zeros(3, 0, dtype=torch.long)
        for _ in range(5):
            a = model.decode_step(mem, tokens, cache)
            b = model.decode_step(mem, tokens, None, prefix=prefix)
            assert a.shape == (3, k, model.vocab_size)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            prefix = torch.cat([prefix, tokens], 1)
            tokens = torch.randint(3, model.vocab_size, (3, k), generator=g)
        # teacher forcing over the whole input equals the concatenated steps
        full = model.forward(feats, boxes, mask, torch.cat([prefix, tokens], 1))
        torch.testing.assert_close(full[:, -k:], model.decode_step(mem, tokens, cache), atol=1e-5, rtol=1e-5)


def test_relaxed_mask_matches_the_formula():
    for k in (1, 2, 4, 6):
        model = tiny("aic", group_size=k)
        m = model.relaxed_mask(13, 13)[0, 0]
        for i in range(13):
            for j in range(13):
                assert bool(m[i, j]) == (j < (i // k + 1) * k)
        if k == 1:
            assert torch.equal(m, torch.tril(torch.ones(13, 13, dtype=torch.bool)))


def test_satic_k1_is_the_aic():
    aic = tiny("aic")
    satic = tiny("satic-k2", group_size=1)
    satic.load_state_dict(aic.state_dict())
    feats, boxes, mask = inputs()
    targets = torch.tensor([[1, 5, 6, 7, 2, 0]] * 3)
    x1, y1 = aic.teacher_inputs(targets)
    x2, y2 = satic.teacher_inputs(targets)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.tolist()[0] == [1, 5, 6, 7, 2] and y1.tolist()[0] == [5, 6, 7, 2, 0]
    with torch.no_grad():
        torch.testing.assert_close(aic(feats, boxes, mask, x1), satic(feats, boxes, mask, x2), atol=0, rtol=0)
    k2 = tiny("satic-k2")
    x, y = k2.teacher_inputs(targets)
    assert x.tolist()[0] == [1, 1, 5, 6, 7] and y.tolist()[0] == [5, 6, 7, 2, 0]  # y shifted by K=2


def test_satic_positions_see_exactly_their_relaxed_past():
    model = tiny("satic-k2")
    feats, boxes, mask = inputs()
    x = torch.randint(3, 40, (3, 8))
    with torch.no_grad():
        base = model(feats, boxes, mask, x)
        x2 = x.clone()
        x2[:, 5] = (x2[:, 5] + 1 - 3) % 37 + 3  # change an input of group 2 (positions 4, 5)
        out = model(feats, boxes, mask, x2)
    torch.testing.assert_close(out[:, :4], base[:, :4])  # groups 0, 1 cannot see it
    assert not torch.allclose(out[:, 4], base[:, 4])  # position 4 sees its whole group


@pytest.mark.parametrize("gate", ["sigmoid", "tanh"])
def test_zodiac_pooling_is_per_sample(gate):
    model = tiny("zodiac-" + gate)
    feats, boxes, mask = inputs(b=3)
    x = torch.randint(3, 40, (3, 7))
    with torch.no_grad():
        together = model(feats, boxes, mask, x)
        for i in range(3):
            r = int(mask[i].sum())
            alone = model(feats[i : i + 1, :r], boxes[i : i + 1, :r], mask[i : i + 1, :r], x[i : i + 1])
            torch.testing.assert_close(alone[0], together[i], atol=1e-5, rtol=1e-5)


def test_zodiac_intensity_gate_values():
    att = MultiHeadAttention(8, 2, zodiac=True, zodiac_gate="tanh", zoneup=1.0, dropout=0.0, zodiac_dropout=0.0)
    att.eval()
    x = torch.randn(1, 3, 8)
    out = att(x, x, None)
    assert out.shape == (1, 3, 8) and torch.isfinite(out).all()
    assert sum(p.numel() for p in att.parameters()) == 5 * (8 * 8 + 8)  # Q1, Q2, K, V, O


def test_shared_layers_share_storage():
    m = tiny("acort-base")  # (0,0,0,1,1,1) scaled to 2 layers -> (0,1)
    assert m.encoder.map == (0, 1)
    cfg = preset("acort-base").replace(d_model=32, heads=4, d_ff=64, vocab_size=CODEC.size, bos=CODEC.bos,
                                       eos=CODEC.eos)
    m6 = Captioner(cfg)
    assert m6.encoder.map == (0, 0, 0, 1, 1, 1) and len(m6.encoder.layers) == 2
    ptrs = {m6.encoder.layers[lid].ffn.w1.weight.data_ptr() for lid in m6.encoder.map}
    assert len(ptrs) == 2
    al = Captioner(preset("acort-base-al").replace(d_model=32, heads=4, d_ff=64, vocab_size=CODEC.size,
                                                   bos=CODEC.bos, eos=CODEC.eos))
    assert len(al.encoder.layers) == 1 and len(al.decoder.layers) == 1
    # Share-kV: no value projection; values are the keys
    attn = m6.encoder.layers[0].mix
    assert not hasattr(attn, "v") and hasattr(attn, "k_proj")


@pytest.mark.parametrize("name", NON_EXPANSION)
def test_every_preset_trains_one_step(name):
    model = tiny(name).train()
    feats, boxes, mask = inputs()
    vocab = model.vocab_size
    targets = torch.full((3, 2, 9), 0, dtype=torch.long)
    targets[:, :, 0] = model.bos
    words = torch.randint(3, min(vocab, 3 + CODEC.base), (3, 2, 6))
    targets[:, :, 1:7] = words
    targets[:, :, 7] = model.eos
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model.xe_loss(feats, boxes, mask, targets, label_smoothing=0.1)
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    before = model.generator.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.generator.weight)
    with torch.no_grad():
        assert model.xe_loss(feats, boxes, mask, targets) < 10


def test_box_geometry_follows_ort():
    from captioning.models.layers import BoxGeometry

    boxes = torch.tensor([[[0.1, 0.2, 0.5, 0.6], [0.3, 0.1, 0.9, 0.4]]])
    emb = BoxGeometry(64)(boxes)
    assert emb.shape == (1, 2, 2, 64)
    cx = torch.tensor([0.3, 0.6])
    cy = torch.tensor([0.4, 0.25])
    w = torch.tensor([0.4, 0.6]) + 1.0  # the released code's +1.0 on normalised widths
    h = torch.tensor([0.4, 0.3]) + 1.0
    i, j = 0, 1
    delta = torch.tensor([
        torch.log(torch.clamp((cx[i] - cx[j]).abs() / w[i], min=1e-3)),
        torch.log(torch.clamp((cy[i] - cy[j]).abs() / h[i], min=1e-3)),
        torch.log(w[i] / w[j]),
        torch.log(h[i] / h[j]),
    ])
    omega = 1000.0 ** (-torch.arange(8) / 8)
    arg = 100 * delta[:, None] * omega
    expected = torch.cat([torch.sin(arg), torch.cos(arg)], -1).flatten()
    torch.testing.assert_close(emb[0, i, j], expected, atol=1e-4, rtol=1e-4)  # sin of args ~ 100
    # self-relation: |dx| = 0 -> log(1e-3)
    assert torch.allclose(emb[0, 0, 0, 0], torch.sin(torch.tensor(100 * torch.log(torch.tensor(1e-3)))))
