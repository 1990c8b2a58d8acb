"""SCST: rewards on words with EOS, baselines, re-scored log-probs equal the sampler's, kill-and-resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioning.data.text import EOS, PAD, RadixCodec
from captioning.decoding import sample
from captioning.metrics.cider import CiderD
from captioning.models.encoder_decoder import Captioner
from captioning.training import checkpoint
from captioning.training.recipe import model_plan, student_arch, teacher_arch, xe_settings
from captioning.training.scst import ScstLoss
from captioning.training.stages import fit_scst, fit_xe

REFS = {1: [[5, 6, 7], [5, 6, 8]], 2: [[9, 10], [9, 11, 12]]}


def test_words_append_eos_only_when_emitted_and_decode_radix():
    loss = ScstLoss(REFS, samples=2, max_tokens=8)
    toks = torch.tensor([[5, 6, 7, EOS, PAD], [5, 6, 7, 8, 9]])
    assert loss.words(toks) == [[5, 6, 7, EOS], [5, 6, 7, 8, 9]]
    codec = RadixCodec(base=4, num_words=20)  # 3 digits per word
    digits = codec.encode_caption([5, 6, 7])[1:]  # drop BOS; ends with the codec's EOS
    rl = ScstLoss(REFS, samples=2, max_tokens=20, codec=codec)
    assert rl.words(torch.tensor([digits])) == [[5, 6, 7, EOS]]
    assert rl.words(torch.tensor([digits[:-1]])) == [[5, 6, 7]]


def test_rewards_are_cider_d_with_eos_appended():
    loss = ScstLoss(REFS, samples=2, max_tokens=8)
    toks = torch.tensor([[5, 6, 7, EOS], [5, 6, 7, 0], [9, 10, EOS, 0]])
    got = loss.rewards(toks, [1, 1, 2])
    ref = CiderD({k: [" ".join(map(str, [*r, EOS])) for r in v] for k, v in REFS.items()})
    want = ref.score_batch(["5 6 7 2", "5 6 7", "9 10 2"], [1, 1, 2])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert got[0] > got[1] > 0  # stopping where the references stop is rewarded


def _tiny(name: str, vocab_size=40, radix=False):
    from captioning.models.registry import preset, scaled

    cfg = scaled(preset(name), d_model=32, layers=1, heads=2, d_ff=64).replace(d_in=12, vocab_size=vocab_size,
                                                                               max_len=24, dropout=0.0)
    if radix:
        cfg = cfg.replace(vocab_size=7, bos=5, eos=6)
    torch.manual_seed(1)
    return Captioner(cfg).eval()


@pytest.mark.parametrize("name", ["aic", "satic-k2", "acort-base"])
def test_teacher_forced_rescoring_equals_sampled_logprobs(name):
    """SCST's gradient path re-scores the samples: it must give the sampler's own log-probs."""
    model = _tiny(name, radix=name.startswith("acort"))
    feats, boxes = torch.randn(3, 5, 12), torch.rand(3, 5, 4)
    boxes[..., 2:] += boxes[..., :2]
    mask = torch.ones(3, 5, dtype=torch.bool)
    with torch.no_grad():
        memory = model.encode(feats, boxes, mask)
        drawn = sample(model, memory, n=4, max_len=12, generator=torch.Generator().manual_seed(0))
        toks = drawn.tokens.reshape(-1, drawn.tokens.shape[-1])
        targets = torch.cat([torch.full_like(toks[:, :1], model.bos), toks], 1)
        inputs, y = model.teacher_inputs(targets)
        logp = model.forward(None, None, None, inputs, memory=memory.repeat(4))
        rescored = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1) * (y != PAD)
    assert (y != PAD).sum() > 12
    torch.testing.assert_close(rescored, drawn.token_logprobs.reshape(rescored.shape), atol=1e-5, rtol=1e-5)


def test_mean_of_others_baseline_and_gradient_direction():
    """With the mean-of-others baseline the advantages of an image sum to zero; a step raises the log-prob
    of the better-than-average samples."""
    model = _tiny("aic").train()
    loss = ScstLoss({7: [[3, 4, 5]], 8: [[6, 7]]}, samples=16, max_tokens=6)  # enough that some samples score

    class B:
        features = torch.randn(2, 5, 12)
        boxes = torch.rand(2, 5, 4)
        region_mask = torch.ones(2, 5, dtype=torch.bool)
        image_ids = torch.tensor([7, 8])

    torch.manual_seed(0)
    total, tokens = loss(model, B)
    assert tokens > 0
    (total / tokens).backward()
    st = loss.pop_stats()
    assert st["reward"] > 0  # some samples hit the references (else every advantage is 0)
    assert st["reward"] == pytest.approx(st["baseline_reward"], abs=1e-12)  # mean of others: same average
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with pytest.raises(ValueError, match="at least 2"):
        ScstLoss(REFS, samples=1)
    greedy_loss = ScstLoss({7: [[3, 4, 5]], 8: [[6, 7]]}, samples=1, baseline="greedy", max_tokens=6)
    greedy_loss(model, B)[0].backward()


@pytest.mark.parametrize("name", ["aic", "satic-k2"])
def test_split_step_for_graphs_equals_the_loss(name):
    """The graph-captured SCST update's split (eager draw, then the update's loss on samples padded to
    max_tokens) gives the loss and the gradients of the one-piece loss for the same draws."""
    refs = {7: [[3, 4, 5]], 8: [[6, 7]], 9: [[3, 6, 9, 4]]}
    model = Captioner(_tiny(name).cfg.with_dropout(0.0)).train()  # every site off (SCST's default), as the
    # split encodes twice (with dropout on, the two encodings would draw different masks)

    class B:
        features = torch.randn(3, 5, 12)
        boxes = torch.rand(3, 5, 4)
        region_mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False]])
        image_ids = torch.tensor([7, 8, 9])

    whole, split = ScstLoss(refs, samples=6, max_tokens=10), ScstLoss(refs, samples=6, max_tokens=10)
    torch.manual_seed(3)
    total, count = whole(model, B)
    (total / count).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    drawn = split.draw(model, B)
    assert drawn.tokens.shape == (18, 10) and len(drawn) == 3 and not drawn.adv.requires_grad
    assert float(drawn.adv.abs().sum()) > 0  # some samples beat the others (else the test shows nothing)
    loss = split.graph_loss(model, drawn)
    loss.backward()
    torch.testing.assert_close(loss, total / count, atol=1e-6, rtol=1e-5)
    for g, w in zip((p.grad for p in model.parameters()), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    assert split.pop_stats() == whole.pop_stats()


def test_scst_kill_and_resume_gives_identical_weights(synth_ctx, tmp_path):
    ctx = synth_ctx
    cfg = ctx.cfg
    arch = teacher_arch(cfg.teacher.model, ctx.vocab, ctx.d_in, cfg.dataset.max_words)
    xe = xe_settings(cfg.teacher.xe, cfg, epochs=2)
    res = fit_xe(ctx, arch, tmp_path / "xe", settings=xe)
    init = res.best_checkpoint
    cfg.students.scst.epochs = 2
    cfg.students.scst.samples = 3
    ctx.plan = model_plan(cfg, "lw")  # the stage functions read the plan, made from the config once
    r1 = fit_scst(ctx, init, tmp_path / "ref")
    assert r1.epochs_run == 2 and all("reward" in h for h in r1.history)
    steps_per_epoch = -(-len(ctx.rows("train")) // cfg.loader.batch_size)
    with pytest.raises(KeyboardInterrupt):
        fit_scst(ctx, init, tmp_path / "killed", stop_after_steps=steps_per_epoch + 2)  # dies in epoch 2
    assert checkpoint.load(tmp_path / "killed" / "last.pt")["epoch"] == 0
    r2 = fit_scst(ctx, init, tmp_path / "killed")
    assert r2.resumed_from_epoch == 1
    a = checkpoint.load(tmp_path / "ref" / "last.pt")["state_dict"]
    b = checkpoint.load(tmp_path / "killed" / "last.pt")["state_dict"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    x = checkpoint.load(init)["state_dict"]
    assert any(not torch.equal(a[k], x[k]) for k in a)  # SCST changed the weights


def test_radix_student_scst_step(synth_ctx, tmp_path):
    ctx = synth_ctx
    cfg = ctx.cfg
    arch = student_arch("acort", "tiny", ctx.vocab, ctx.d_in, cfg.dataset.max_words)
    assert arch.codec == "radix"
    res = fit_xe(ctx, arch, tmp_path / "xe", settings=xe_settings(cfg.students.xe, cfg, epochs=1))
    cfg.students.scst.epochs = 1
    ctx.plan = model_plan(cfg, "lw")
    r = fit_scst(ctx, res.best_checkpoint, tmp_path / "scst")
    assert np.isfinite(r.history[0]["loss"]) and r.history[0]["reward"] >= 0


@pytest.mark.parametrize("sample_autocast", [False, True])
def test_sampling_runs_in_fp32_under_autocast_unless_asked(sample_autocast, monkeypatch):
    """Under reduced-precision autocast (CPU bf16 autocast standing in for CUDA's) the sampler and the greedy
    baseline run with autocast off (fp32 memory) by default, the re-scoring under autocast; with
    ``sample_autocast`` both decode under it. Without autocast (every CPU run) nothing changes: the same loss."""
    from captioning.training import scst

    seen = []

    def spy(fn):
        def wrapped(model, memory, **kw):
            seen.append((fn.__name__, torch.is_autocast_enabled("cpu"), memory.states.dtype))
            return fn(model, memory, **kw)
        return wrapped

    monkeypatch.setattr(scst, "sample", spy(scst.sample))
    monkeypatch.setattr(scst, "greedy", spy(scst.greedy))
    model = _tiny("aic").train()
    refs = {7: [[3, 4, 5]], 8: [[6, 7]]}

    class B:
        features = torch.randn(2, 5, 12)
        boxes = torch.rand(2, 5, 4)
        region_mask = torch.ones(2, 5, dtype=torch.bool)
        image_ids = torch.tensor([7, 8])

    for baseline, n in (("mean", 4), ("greedy", 2)):
        rl = ScstLoss(refs, samples=n, baseline=baseline, max_tokens=6, sample_autocast=sample_autocast)
        torch.manual_seed(0)
        plain = rl(model, B)
        torch.manual_seed(0)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, count = rl(model, B)
        assert [name for name, _, _ in seen] == (["sample"] if baseline == "mean" else ["sample", "greedy"])
        assert all(on == sample_autocast for _, on, _ in seen)
        if not sample_autocast:
            assert all(dtype == torch.float32 for _, _, dtype in seen)  # the memory handed over as fp32
        assert torch.isfinite(total) and count > 0
        total.backward()
        torch.manual_seed(0)
        again = rl(model, B)
        assert torch.equal(plain[0], again[0]) and torch.equal(plain[1], again[1])  # no autocast: unchanged


def test_with_dropout_sets_each_site_keeps_switched_off_sites_and_weights():
    from captioning.models import registry

    exp = registry.preset("expansionnet")
    assert exp.dropout == 0.3 and exp.input_dropout == 0.3
    off = exp.with_dropout(0.0)
    assert (off.dropout, off.input_dropout, off.zodiac_dropout) == (0.0, 0.0, 0.0)
    assert off.attn_dropout in (None, 0.0)
    rel = registry.preset("expansionnet@released")
    assert rel.attn_dropout == 0.0 and rel.with_dropout(0.1).attn_dropout == 0.0  # a site switched off stays off
    assert rel.with_dropout(0.1).dropout == 0.1
    assert registry.preset("aic").replace(input_dropout=0.0).with_dropout(0.2).input_dropout == 0.0
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="dropout"):
            exp.with_dropout(bad)
    small = registry.scaled(exp, d_model=32, layers=2, heads=2, d_ff=64).replace(vocab_size=20, d_in=8)
    a, b = Captioner(small), Captioner(small.with_dropout(0.0))
    assert a.state_dict().keys() == b.state_dict().keys()
    assert {m.p for m in a.modules() if isinstance(m, torch.nn.Dropout)} >= {0.3}
    assert {m.p for m in b.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}


@pytest.mark.parametrize("family", ["expansionnet", "zodiac"])
def test_scst_trains_with_dropout_off_by_default_and_records_it(family, synth_ctx, tmp_path, monkeypatch):
    """SCST's default (students.scst.dropout = 0): the policy it samples in train mode is the one decoding uses
    (eval mode), and its checkpoints say so; unset keeps the XE rates."""
    from captioning.training.loop import load_model

    ctx = synth_ctx
    cfg = ctx.cfg
    arch = student_arch(family, "tiny", ctx.vocab, ctx.d_in, cfg.dataset.max_words)
    assert arch.dropout > 0
    res = fit_xe(ctx, arch, tmp_path / "xe", settings=xe_settings(cfg.students.xe, cfg, epochs=1))
    sc = cfg.students.scst  # shared by the session's tests: changed through monkeypatch, restored after
    assert sc.dropout == 0.0
    monkeypatch.setattr(sc, "epochs", 1)
    monkeypatch.setattr(sc, "samples", 2)
    ctx.plan = model_plan(cfg, "lw")
    fit_scst(ctx, res.best_checkpoint, tmp_path / "scst")
    saved = checkpoint.load(tmp_path / "scst" / "last.pt")["arch"]
    assert saved["dropout"] == 0.0 and saved["input_dropout"] == 0.0

    m, _ = load_model(res.best_checkpoint, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    feats, boxes = torch.randn(2, 5, ctx.d_in, generator=g), torch.rand(2, 5, 4, generator=g).sort(-1).values
    mask = torch.ones(2, 5, dtype=torch.bool)
    tokens = torch.tensor([[m.bos, 5, 6, 7], [m.bos, 8, 9, 10]]) % m.cfg.vocab_size
    with torch.no_grad():
        m.train()
        train_lp = m.forward(feats, boxes, mask, tokens)
        m.eval()
        eval_lp = m.forward(feats, boxes, mask, tokens)
    assert torch.allclose(train_lp, eval_lp, atol=1e-6)
    kept, _ = load_model(res.best_checkpoint)  # unset: the XE rates, dropout active in train mode
    with torch.no_grad():
        kept.train()
        assert not torch.allclose(kept.forward(feats, boxes, mask, tokens), eval_lp, atol=1e-4)

    monkeypatch.setattr(sc, "dropout", None)
    ctx.plan = model_plan(cfg, "lw")
    fit_scst(ctx, res.best_checkpoint, tmp_path / "scst-kept")
    assert checkpoint.load(tmp_path / "scst-kept" / "last.pt")["arch"]["dropout"] == arch.dropout
