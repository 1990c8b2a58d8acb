"""Region-feature standardisation: statistics of the training split, stored in the model, applied at encode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioning.data.loader import region_stats
from captioning.models.encoder_decoder import ArchConfig, Captioner
from captioning.models.registry import PRESETS, RELEASED_SUFFIX, preset
from captioning.training.loop import load_model
from captioning.training.recipe import student_arch, teacher_arch, xe_settings
from captioning.training.stages import fit_xe

TINY = ArchConfig(vocab_size=20, d_model=16, heads=2, d_ff=32, enc_layers=1, dec_layers=1, d_in=6, max_len=12)


def _regions(ctx, rows):
    r = ctx.source.read(np.sort(rows))
    return np.concatenate([f for f in r.features if len(f)]).astype(np.float64)


def test_region_stats_are_the_mean_and_deviation_of_every_real_region(synth_ctx):
    rows = synth_ctx.rows("train")
    mean, std = region_stats(synth_ctx.source, rows)
    x = _regions(synth_ctx, rows)
    np.testing.assert_allclose(mean, x.mean(0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(std, x.std(0), rtol=1e-7, atol=1e-9)
    # a subset: evenly spaced rows, deterministic
    sub_mean, _ = region_stats(synth_ctx.source, rows, max_images=5)
    picked = np.unique(rows)[np.linspace(0, len(np.unique(rows)) - 1, 5).round().astype(int)]
    np.testing.assert_allclose(sub_mean, _regions(synth_ctx, picked).mean(0), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="no rows"):
        region_stats(synth_ctx.source, np.array([], dtype=np.int64))


def test_a_standardising_model_equals_the_plain_model_on_standardised_features():
    torch.manual_seed(0)
    plain = Captioner(TINY).eval()
    std_model = Captioner(TINY.replace(standardize_features=True)).eval()
    missing, unexpected = std_model.load_state_dict(plain.state_dict(), strict=False)
    assert set(missing) == {"feature_mean", "feature_scale"} and not unexpected
    mean, dev = torch.randn(6) * 3, torch.rand(6) + 0.5
    std_model.set_feature_stats(mean, dev)
    feats, boxes = torch.randn(2, 4, 6) * 2 + 1, torch.rand(2, 4, 4)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    got = std_model.encode(feats, boxes, mask).states
    want = plain.encode((feats - mean) / dev, boxes, mask).states
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # without statistics the buffers are the identity
    fresh = Captioner(TINY.replace(standardize_features=True)).eval()
    fresh.load_state_dict(plain.state_dict(), strict=False)
    torch.testing.assert_close(fresh.encode(feats, boxes, mask).states, plain.encode(feats, boxes, mask).states)


def test_set_feature_stats_checks_its_input_and_leaves_dead_channels_unscaled():
    m = Captioner(TINY.replace(standardize_features=True))
    dev = torch.tensor([1.0, 2.0, 0.5, 0.0, 1e-9, 4.0])
    m.set_feature_stats(torch.zeros(6), dev)
    np.testing.assert_allclose(m.feature_scale.numpy(), [1.0, 0.5, 2.0, 1.0, 1.0, 0.25])
    with pytest.raises(ValueError, match="6 values"):
        m.set_feature_stats(torch.zeros(5), torch.ones(5))
    with pytest.raises(ValueError, match="finite"):
        m.set_feature_stats(torch.full((6,), float("nan")), torch.ones(6))
    with pytest.raises(ValueError, match="does not standardise"):
        Captioner(TINY).set_feature_stats(torch.zeros(6), torch.ones(6))


def test_registry_presets_and_released_flavours_do_not_standardise():
    for name in PRESETS:
        assert not preset(name).standardize_features
        assert not preset(name + RELEASED_SUFFIX).standardize_features
    assert "feature_mean" not in Captioner(TINY).state_dict()


def test_training_stores_the_training_splits_statistics_in_the_saved_model(synth_ctx, tmp_path):
    ctx = synth_ctx
    assert ctx.cfg.loader.standardize_features  # the pipeline's default
    arch = teacher_arch(ctx.cfg.teacher.model, ctx.vocab, ctx.d_in, ctx.cfg.dataset.max_words,
                        standardize=ctx.cfg.loader.standardize_features)
    assert arch.standardize_features
    res = fit_xe(ctx, arch, tmp_path / "t", settings=xe_settings(ctx.cfg.teacher.xe, ctx.cfg, epochs=1))
    model, _ = load_model(res.checkpoint)
    mean, dev = region_stats(ctx.source, ctx.rows("train"))
    np.testing.assert_allclose(model.feature_mean.numpy(), mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.feature_scale.numpy(), 1 / dev, rtol=1e-5)
    loaded, _ = load_model(res.best_checkpoint)
    torch.testing.assert_close(loaded.feature_mean, model.feature_mean)
    torch.testing.assert_close(loaded.feature_scale, model.feature_scale)
    # a student built the same way carries the option; without it, no buffers
    assert student_arch("lw", "tiny", ctx.vocab, ctx.d_in, 16, standardize=True).standardize_features
    assert not student_arch("lw", "tiny", ctx.vocab, ctx.d_in, 16).standardize_features


def test_weight_init_takes_the_teachers_statistics_without_recomputing_them(synth_ctx, tmp_path, monkeypatch):
    """SATIC's weight-init: the teacher's stored statistics (same training split) are loaded, not recomputed; an
    init checkpoint without them leaves the student to compute its own."""
    from captioning.training import stages

    ctx = synth_ctx
    words = ctx.cfg.dataset.max_words
    teacher = teacher_arch(ctx.cfg.teacher.model, ctx.vocab, ctx.d_in, words, standardize=True)
    one = xe_settings(ctx.cfg.students.xe, ctx.cfg, epochs=1)
    t_res = fit_xe(ctx, teacher, tmp_path / "t", settings=one)
    t_model, _ = load_model(t_res.checkpoint)
    calls = []
    real = stages.region_stats
    monkeypatch.setattr(stages, "region_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    student = student_arch("satic", "tiny", ctx.vocab, ctx.d_in, words, standardize=True)
    s_res = fit_xe(ctx, student, tmp_path / "s", settings=one, init_from=t_res.best_checkpoint)
    s_model, _ = load_model(s_res.checkpoint)
    assert calls == [] and s_res.init_loaded > 0
    torch.testing.assert_close(s_model.feature_mean, t_model.feature_mean)
    torch.testing.assert_close(s_model.feature_scale, t_model.feature_scale)

    plain = teacher_arch(ctx.cfg.teacher.model, ctx.vocab, ctx.d_in, words)  # no statistics in its checkpoint
    p_res = fit_xe(ctx, plain, tmp_path / "p", settings=one)
    s2, _ = load_model(fit_xe(ctx, student, tmp_path / "s2", settings=one, init_from=p_res.best_checkpoint).checkpoint)
    assert calls == [1]
    mean, _ = real(ctx.source, ctx.rows("train"))
    np.testing.assert_allclose(s2.feature_mean.numpy(), mean, rtol=1e-6, atol=1e-6)
