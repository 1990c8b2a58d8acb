"""SeqKD captions in the label store, SATIC weight-init from the teacher, the evaluation report."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioning.data.loader import image_batches
from captioning.data.stores import LabelStore, StoreError
from captioning.decoding import beam_search
from captioning.models.params import count
from captioning.training.loop import load_model
from captioning.training.recipe import caption_dataset, label_sources, student_arch, teacher_arch, xe_settings
from captioning.training.stages import evaluate, fit_xe, seqkd


@pytest.fixture
def teacher(synth_ctx, tmp_path):
    ctx = synth_ctx
    arch = teacher_arch(ctx.cfg.teacher.model, ctx.vocab, ctx.d_in, ctx.cfg.dataset.max_words)
    res = fit_xe(ctx, arch, tmp_path / "teacher", settings=xe_settings(ctx.cfg.teacher.xe, ctx.cfg, epochs=2))
    return load_model(res.checkpoint)[0], res.best_checkpoint


def test_seqkd_adds_a_source_with_the_teachers_beam_captions(synth_ctx, teacher):
    ctx = synth_ctx
    model, _ = teacher
    before = ctx.labels
    rep = seqkd(ctx, model, "seqkd:test")
    after = LabelStore.open(ctx.labels_uri).read()
    train_rows = ctx.rows("train")
    assert rep.images == len(train_rows) == rep.captions
    code = {v: k for k, v in after.sources.items()}["seqkd:test"]
    assert rep.source_code == code
    new = after.select(after.source == code)
    assert len(new.tokens) == len(train_rows) and np.array_equal(np.sort(new.image_row), train_rows)
    assert np.all(new.split == 0)
    # ground truth untouched
    gt = after.select(after.source == 0)
    assert np.array_equal(gt.tokens, before.tokens) and np.array_equal(gt.image_id, before.image_id)
    # the stored caption of an image is the teacher's beam-search output for it
    b = next(image_batches(ctx.source, train_rows[:4], 4))
    with torch.inference_mode():
        d = beam_search(model, model.encode(b.features.float(), b.boxes, b.region_mask),
                        beam=ctx.cfg.students.seqkd_beam, max_len=ctx.max_tokens(model))
    for i, r in enumerate(b.rows.tolist()):
        stored = new.tokens[new.image_row == r][0]
        n = int(new.length[new.image_row == r][0])
        want = [t for t in d.tokens[i, 0].tolist() if t > 2][:n]
        assert stored[:n].tolist() == want and np.all(stored[n:] == 0)
    assert 0 <= rep.exact_match_fraction <= 1 and rep.cider_vs_ground_truth >= 0 and rep.avg_length > 0
    with pytest.raises(ValueError, match="already"):
        seqkd(ctx, model, "seqkd:test")
    with pytest.raises(StoreError):
        LabelStore.open(ctx.labels_uri, mode="r+").add_source("seqkd:test", new.tokens, new.length, new.image_row,
                                                              new.image_id, new.split)
    # students can train on GT, SeqKD or both
    for use, n_sources in (("ground_truth", 1), ("seqkd", 1), ("both", 2)):
        srcs = label_sources(ctx.labels, use, "seqkd:test")
        assert len(srcs) == n_sources
        assert len(caption_dataset(ctx.source, ctx.labels, ctx.plan, codec=None, sources=srcs)) == len(train_rows)
    with pytest.raises(ValueError, match="no SeqKD source"):
        label_sources(ctx.labels, "seqkd", "missing")


def test_satic_weight_init_from_teacher(synth_ctx, teacher, tmp_path):
    ctx = synth_ctx
    _, ckpt = teacher
    arch = student_arch("satic", "tiny", ctx.vocab, ctx.d_in, ctx.cfg.dataset.max_words)
    assert arch.group_size == 4
    s = xe_settings(ctx.cfg.students.xe, ctx.cfg, epochs=1)
    s.lr, s.schedule = 1e-12, "constant"  # (almost) no update: the weights stay the teacher's
    res = fit_xe(ctx, arch, tmp_path / "satic", settings=s, init_from=ckpt)
    model, _ = load_model(res.checkpoint)
    assert res.init_loaded > 0
    teacher_sd = torch.load(ckpt, weights_only=True)["state_dict"]
    same = [k for k, v in model.state_dict().items() if k in teacher_sd and teacher_sd[k].shape == v.shape]
    assert len(same) == res.init_loaded
    for k in same:
        torch.testing.assert_close(model.state_dict()[k], teacher_sd[k], atol=1e-6, rtol=0)


def test_evaluation_report(synth_ctx, teacher):
    ctx = synth_ctx
    model, _ = teacher
    out = evaluate(ctx, model, latency_images=3)
    test_ids = {e.image_id for e in ctx.dataset.split("test")}
    assert {p["image_id"] for p in out.predictions} == test_ids == set(range(min(test_ids), max(test_ids) + 1)) & \
        test_ids
    m = out.metrics
    assert set(m) >= {"Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE"} and m["SPICE"] is None
    assert out.spice.startswith("unavailable")
    assert out.params == count(model, "full") and out.latency_ms > 0
    assert 0 <= out.novel_fraction <= 1 and out.avg_length >= 0 and out.beam == ctx.cfg.evaluation.beam
