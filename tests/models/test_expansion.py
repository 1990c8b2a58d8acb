"""ExpansionNet's static and dynamic expansion layers, alone and inside the Captioner skeleton."""

from __future__ import annotations

import pytest
import torch

from captioning.models.encoder_decoder import Captioner
from captioning.models.expansion import DynamicExpansion, StaticExpansion, row_normalize
from captioning.models.params import count
from captioning.models.registry import preset, scaled

D, N_E, N_D = 32, 8, 4
ATOL = 1e-5


def small_cfg(**kw):
    # scaled(layers=2) keeps ExpansionNet's half-depth stacks (1+1) and scales N_E/N_D down to 4/2 at d=32;
    # these tests want 2+2 layers, N_E=8, N_D=4
    cfg = scaled(preset("expansionnet"), d_model=D, layers=2, heads=4, d_ff=64)
    return cfg.replace(vocab_size=50, max_len=32, enc_layers=2, dec_layers=2, expansion_enc=N_E,
                       expansion_dec=N_D, **kw)


def small_model(seed: int = 0, **kw) -> Captioner:
    torch.manual_seed(seed)
    return Captioner(small_cfg(**kw)).eval()


def relaxed(t: int, k: int) -> torch.Tensor:
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    return (j < (i // k + 1) * k)[None, None]


def image_batch(b: int = 3, r: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, r, 2048, generator=g)
    boxes = torch.rand(b, r, 4, generator=g)
    mask = torch.ones(b, r, dtype=torch.bool)
    mask[1, r - 2 :] = False
    mask[2, 3:] = False
    return feats, boxes, mask


# ---------------------------------------------------------------------- rn
def test_row_normalize_sums_to_one_over_valid_entries():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(4, 5, 9, generator=g) + 0.1
    mask = torch.rand(4, 5, 9, generator=g) > 0.4
    mask[..., 0] = True
    out = row_normalize(a, mask, eps=1e-6)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    torch.testing.assert_close(out.sum(-1), torch.ones(4, 5), atol=1e-5, rtol=0)
    # a row with no mass gives zeros, never NaN
    z = row_normalize(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(z, torch.zeros(2, 3))


# ---------------------------------------------------------------------- static expansion
def test_static_shape_and_padding_invariance():
    torch.manual_seed(0)
    m = StaticExpansion(D, N_E, dropout=0.1).eval()
    x = torch.randn(2, 6, D)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    out = m(x, mask)
    assert out.shape == (2, 6, D)
    assert torch.isfinite(out).all()
    # appending padded regions with random features leaves the real regions' outputs unchanged
    x2 = torch.cat([x, 5 * torch.randn(2, 3, D)], 1)
    x2[1, 4:6] = torch.randn(2, D)  # padded rows of the original batch may hold anything too
    mask2 = torch.cat([mask, torch.zeros(2, 3, dtype=torch.bool)], 1)
    out2 = m(x2, mask2)
    torch.testing.assert_close(out2[:, :6][mask], out[mask], atol=ATOL, rtol=0)
    assert torch.equal(out2[~mask2], torch.zeros_like(out2[~mask2]))


def test_encoder_ignores_padded_regions():
    model = small_model()
    feats, boxes, mask = image_batch()
    mem = model.encode(feats, boxes, mask)
    assert mem.states.shape == (3, 7, D)
    pad_feats = torch.cat([feats, torch.randn(3, 4, 2048)], 1)
    pad_boxes = torch.cat([boxes, torch.rand(3, 4, 4)], 1)
    pad_mask = torch.cat([mask, torch.zeros(3, 4, dtype=torch.bool)], 1)
    mem2 = model.encode(pad_feats, pad_boxes, pad_mask)
    torch.testing.assert_close(mem2.states[:, :7][mask], mem.states[mask], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- dynamic expansion
def test_dynamic_causal():
    torch.manual_seed(0)
    m = DynamicExpansion(D, N_D).eval()
    x = torch.randn(2, 8, D)
    mask = relaxed(8, 1)
    out = m(x, mask)
    assert out.shape == (2, 8, D)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(2, 3, D)
    out2 = m(x2, mask)
    torch.testing.assert_close(out2[:, :5], out[:, :5], atol=ATOL, rtol=0)
    assert (out2[:, 5] - out[:, 5]).abs().max() > 1e-3


def test_dynamic_relaxed_groups():
    torch.manual_seed(0)
    m = DynamicExpansion(D, N_D).eval()
    k = 2
    x = torch.randn(2, 8, D)
    mask = relaxed(8, k)
    out = m(x, mask)
    # later groups (positions 4..7 = groups 2, 3) do not change groups 0 and 1
    x2 = x.clone()
    x2[:, 4:] = torch.randn(2, 4, D)
    torch.testing.assert_close(m(x2, mask)[:, :4], out[:, :4], atol=ATOL, rtol=0)
    # ... but the second input of a group changes its first position's output (same group, relaxed mask)
    x3 = x.clone()
    x3[:, 3] = torch.randn(2, D)
    out3 = m(x3, mask)
    torch.testing.assert_close(out3[:, :2], out[:, :2], atol=ATOL, rtol=0)
    assert (out3[:, 2] - out[:, 2]).abs().max() > 1e-3


def test_dynamic_incremental_matches_full():
    torch.manual_seed(0)
    m = DynamicExpansion(D, N_D).eval()
    x = torch.randn(2, 9, D)
    for k, chunks in ((1, (1, 3, 2, 1, 2)), (3, (3, 3, 3))):
        full_mask = relaxed(9, k)
        ref = m(x, full_mask)
        cache: dict = {}
        outs, at = [], 0
        for n in chunks:
            outs.append(m(x[:, at : at + n], full_mask[..., at : at + n, : at + n], cache=cache))
            at += n
        torch.testing.assert_close(torch.cat(outs, 1), ref, atol=ATOL, rtol=0)
        assert cache["fa"].shape == (2, 9, N_D, D) and cache["k"].shape == (2, 9, D)


# ---------------------------------------------------------------------- the whole model
@pytest.mark.parametrize("k", [1, 2])
def test_cached_decoding_matches_uncached(k):
    model = small_model(group_size=k)
    feats, boxes, mask = image_batch()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        mem = model.encode(feats, boxes, mask)
        cache = model.new_cache()
        tokens = model.start_tokens(3)
        prefix = None
        steps = []
        for _ in range(6):
            cached = model.decode_step(mem, tokens, cache)
            ref = model.decode_step(mem, tokens, None, prefix=prefix)
            assert cached.shape == (3, k, 50)
            torch.testing.assert_close(cached, ref, atol=ATOL, rtol=0)
            steps.append(cached)
            prefix = tokens if prefix is None else torch.cat([prefix, tokens], 1)
            tokens = torch.randint(3, 50, (3, k), generator=g)
        # teacher forcing on the whole input sequence = the concatenated step outputs
        tf = model(None, None, None, prefix, memory=mem)
        torch.testing.assert_close(tf, torch.cat(steps, 1), atol=ATOL, rtol=1e-5)  # float32 rounding
        # beam-search reordering keeps the cache consistent
        idx = torch.tensor([2, 2, 0])
        cache.reorder(idx)
        nxt = model.decode_step(mem.select(idx), tokens[idx], cache)
        ref = model.decode_step(mem.select(idx), tokens[idx], None, prefix=prefix[idx])
        torch.testing.assert_close(nxt, ref, atol=ATOL, rtol=0)


def test_training_step_gives_finite_grads():
    model = small_model().train()
    feats, boxes, mask = image_batch()
    g = torch.Generator().manual_seed(7)
    targets = torch.randint(3, 50, (3, 2, 10), generator=g)
    targets[..., 0] = model.bos
    targets[..., 7] = model.eos
    targets[..., 8:] = 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model.xe_loss(feats, boxes, mask, targets, label_smoothing=0.1)
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    for name, p in model.named_parameters():
        if ".mix." in name or ".self_mix." in name:
            assert p.grad.abs().sum() > 0, name
    before = model.decoder.layers[0].self_mix.queries.detach().clone()
    opt.step()
    assert not torch.equal(before, model.decoder.layers[0].self_mix.queries)


def test_paper_size_parameter_count():
    cfg = preset("expansionnet")
    assert (cfg.d_model, cfg.enc_layers, cfg.dec_layers, cfg.expansion_enc, cfg.expansion_dec, cfg.vocab_size) == (
        768, 3, 3, 64, 16, 10001)
    with torch.device("meta"):
        model = Captioner(cfg)
    n = count(model, "full")
    print(f"ExpansionNet paper-size parameters: {n:,}")
    assert 62_000_000 < n < 63_800_000  # PAPERS.md: ~62.9M at d=768, V ~ 10k
