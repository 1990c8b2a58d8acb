"""CUDA: reduced-precision training steps and fused attention on the GPU (``gpu`` marker: `make test-gpu`).

Tolerances (documented here, asserted below):
- fp32, fused vs explicit attention on CUDA: 1e-4 on log-probs (the GPU kernels reduce in other orders than the
  CPU's; the CPU tests in test_attention.py hold 1e-5), greedy tokens equal;
- bf16 autocast, fused attention vs the fp32 explicit path: log-probs within 0.1 (max) and 0.02 (mean absolute
  difference). bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per operation); measured with CPU bf16
  autocast on the tiny presets: max 0.044, mean 0.010.
"""

from __future__ import annotations

import pytest
import torch

from captioning.decoding import greedy
from captioning.models.layers import MultiHeadAttention, explicit_attention, fused_attention
from captioning.models.registry import PRESETS
from captioning.precision import autocast, resolve_precision
from captioning.training import checkpoint
from captioning.training.loop import StepRunner, TrainSettings, make_optimizer, train
from tests.models.test_attention import _targets
from tests.models.test_models import inputs, tiny
from tests.training.test_xe import _dataset, _model, data  # noqa: F401  (fixture)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}
BF16_MAX, BF16_MEAN = 0.1, 0.02


@pytest.fixture(autouse=True)
def no_tf32():
    """Plain fp32 matrix products (TF32 would round to 10 bits of mantissa)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _bf16() -> None:
    try:
        resolve_precision("bf16", CUDA)
    except ValueError as e:
        pytest.skip(str(e))


def _on_cuda(*tensors):
    return [t.to(CUDA) for t in tensors]


def _step_runner(model, precision: str, **kw) -> StepRunner:
    s = TrainSettings(batch_size=6, warmup=5, precision=precision, **kw)
    opt, sched = make_optimizer(model, s, 4)
    return StepRunner(model, opt, sched, s, CUDA)


def _batch(d):
    from captioning.data.loader import collate

    ds = _dataset(d)
    return next(iter(torch.utils.data.DataLoader(ds, batch_size=6, collate_fn=collate))).to(CUDA)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_steps_train_fp32_weights(precision, data):  # noqa: F811
    if precision == "bf16":
        _bf16()
    model = _model().to(CUDA).train()
    runner = _step_runner(model, precision)
    assert runner.precision == precision
    assert runner.scaler.is_enabled() == (precision == "fp16")  # fp16 needs the gradient scaler, bf16 does not
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _batch(data)
    losses = [runner(batch) for _ in range(3)]
    assert all(v.dtype == torch.float64 and v.device.type == "cuda" for v in losses)
    assert all(torch.isfinite(v) for v in losses) and float(losses[-1]) < float(losses[0]) + 1.0
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert changed  # the optimizer stepped
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    for st in runner.opt.state.values():
        assert all(t.dtype == torch.float32 for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    if precision == "fp16":
        assert 0 < runner.scaler.get_scale() < float("inf")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_train_on_cuda_writes_fp32_checkpoints(precision, data, tmp_path):  # noqa: F811
    if precision == "bf16":
        _bf16()
    model = _model()
    s = TrainSettings(epochs=2, batch_size=6, warmup=5, label_smoothing=0.1, precision=precision, log_every=2)
    r = train(model, _dataset(data), s, tmp_path, device="cuda", progress=False)
    assert r.epochs_run == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in r.history)
    st = checkpoint.load(tmp_path / "last.pt")
    assert all(v.dtype == torch.float32 for v in st["state_dict"].values() if v.is_floating_point())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fused_equals_explicit_on_cuda_fp32(name):
    model = tiny(name).to(CUDA)
    feats, boxes, mask = _on_cuda(*inputs())
    x, _ = model.teacher_inputs(_targets(model).to(CUDA))
    with torch.no_grad():
        fused = model(feats, boxes, mask, x)
        with explicit_attention():
            ref = model(feats, boxes, mask, x)
        torch.testing.assert_close(fused, ref, **FP32_TOL)
        mem = model.encode(feats, boxes, mask)
    k = model.group_size
    max_len = 12 if k == 1 else 6 * k
    with fused_attention():  # auto mode decodes fp32 steps explicitly: SDPA's decoding path is tested here
        got = greedy(model, mem, max_len=max_len, static_cache=True, graphs=False)
    with explicit_attention():
        want = greedy(model, mem, max_len=max_len, static_cache=True, graphs=False)
    assert torch.equal(got.tokens, want.tokens)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fused_bf16_is_close_to_explicit_fp32_on_cuda(name):
    _bf16()
    model = tiny(name).to(CUDA)
    feats, boxes, mask = _on_cuda(*inputs())
    x, _ = model.teacher_inputs(_targets(model).to(CUDA))
    with torch.no_grad():
        with explicit_attention():
            ref = model(feats, boxes, mask, x)
        with autocast("bf16", CUDA):
            got = model(feats, boxes, mask, x)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()  # log-softmax in fp32
    diff = (got - ref).abs()
    assert diff.max() <= BF16_MAX and diff.mean() <= BF16_MEAN, (float(diff.max()), float(diff.mean()))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_rows_with_nothing_to_attend_to_on_cuda(precision):
    if precision == "bf16":
        _bf16()
    torch.manual_seed(0)
    att = MultiHeadAttention(64, 4, dropout=0.1).to(CUDA).train()
    x = torch.randn(2, 5, 64, device=CUDA, requires_grad=True)
    mem = torch.randn(2, 7, 64, device=CUDA, requires_grad=True)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool, device=CUDA)
    mask[1] = False
    bias = torch.randn(2, 4, 5, 7, device=CUDA)
    for b in (None, bias):
        with autocast(precision, CUDA):
            out = att(x, mem, mask, bias=b)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[1].float(), att.o.bias.float().expand(5, 64), atol=1e-2, rtol=0)
        out.float().square().sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(mem.grad).all()
        assert torch.count_nonzero(mem.grad[1]) == 0
        x.grad = mem.grad = None


def test_bf16_graph_decoding_across_autocast_contexts_equals_eager():
    """Decoding autocasts without the weight-cast cache: a CUDA graph captured in one autocast context and
    replayed in a later one (after the first context's memory was reused) decodes as the eager static path."""
    _bf16()
    model = tiny("aic").to(CUDA)
    feats, boxes, mask = _on_cuda(*inputs(r=12))
    with torch.no_grad(), autocast("bf16", CUDA, cache=False):
        mem = model.encode(feats, boxes, mask)
        first = greedy(model, mem, max_len=10, static_cache=True, graphs=True)
    junk = [torch.randn(1 << 16, device=CUDA, dtype=torch.bfloat16) for _ in range(64)]  # reuse freed blocks
    del junk
    with torch.no_grad(), autocast("bf16", CUDA, cache=False):
        again = greedy(model, mem, max_len=10, static_cache=True, graphs=True)
        eager = greedy(model, mem, max_len=10, static_cache=True, graphs=False)
    assert torch.equal(first.tokens, eager.tokens) and torch.equal(again.tokens, eager.tokens)


def test_bench_train_on_cuda_quick():
    from captioning.bench.train import run as run_train

    res = run_train(families=["aic"], device="cuda", quick=True, steps=2, warmup=2, memory_batches=(16,),
                    compile=True)
    assert res["machine"]["gpu"] and res["params"]["precision"] == resolve_precision("auto", CUDA)
    for r in res["rows"]:
        assert r["memory_peak_mb"] > 0 and r["images_per_s"] > 0 and r["tokens_per_s"] > 0
        assert r["precision"] == ("fp32" if r["path"] == "fp32_eager" else res["params"]["precision"])
        assert r["attention"] == ("explicit" if r["path"] == "fp32_eager" else "fused")
        assert r["loss"] == r["loss"]  # not NaN
    assert {r["batch"] for r in res["rows"]} == {8, 16}
    assert {(r["stage"], r["path"]) for r in res["rows"]} == {
        ("xe", "fp32_eager"), ("xe", "fast"), ("xe", "fast_compiled"), ("scst", "fp32_eager"), ("scst", "fast")}
    rows = {(r["stage"], r["path"], r["batch"]): r for r in res["rows"]}
    compiled = rows[("xe", "fast_compiled", 8)]["images_per_s"] / rows[("xe", "fp32_eager", 8)]["images_per_s"]
    assert res["ratios"]["speedup_vs_fp32_eager"] == pytest.approx(compiled, rel=1e-12)


@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_loader_batches_are_pinned(data, workers):  # noqa: F811
    from captioning.data.loader import make_loader

    batch = next(iter(make_loader(_dataset(data), 6, workers=workers, pin_memory=True)))
    assert all(t.is_pinned() for t in vars(batch).values())
    on_gpu = batch.to(CUDA, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.features.cpu(), batch.features)


def _graph_vs_eager(precision: str, data, *, dropout: float, steps: int = 6):  # noqa: F811
    """(losses, state dict, runner) of ``steps`` XE steps on one batch, eager (compile off) and graphs."""
    batch = _batch(data)
    out = {}
    for mode in ("off", "graphs"):
        model = _model().to(CUDA).train()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = dropout
        s = TrainSettings(batch_size=6, label_smoothing=0.1, clip=0.1, precision=precision, compile=mode)
        # plain SGD: Adam would turn rounding-level gradients of either sign into full-size steps
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        runner = StepRunner(model, opt, sched, s, CUDA)
        assert (runner.graphed is not None) == (mode == "graphs")
        torch.manual_seed(5)
        losses = [runner(batch) for _ in range(steps)]
        out[mode] = ([float(v) for v in losses], model.state_dict(), runner)
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_captured_xe_step_equals_eager_on_cuda(precision, data):  # noqa: F811
    """run.compile=graphs on CUDA: warm-up steps, capture and replays take the eager step's steps (dropout off):
    fp32 losses within 1e-5, weights within 1e-5; bf16 (the same kernels, replayed) within 1e-3 / 1e-3."""
    if precision == "bf16":
        _bf16()
    out = _graph_vs_eager(precision, data, dropout=0.0)
    (ref, ref_sd, _), (got, sd, runner) = out["off"], out["graphs"]
    g = runner.graphed
    assert g.failed is None, g.failed
    assert g.captures == 1 and g.replays == 6 - g.warmup - 0 and g.eager_steps == g.warmup
    tol = 1e-5 if precision == "fp32" else 1e-3
    assert got == pytest.approx(ref, abs=tol, rel=tol)
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], atol=tol, rtol=tol)


def test_graph_captured_xe_step_with_dropout_trains_on_cuda(data):  # noqa: F811
    """With dropout each replay draws fresh masks (the graph's registered generator): finite losses that fall,
    and two replays of the same batch differ."""
    out = _graph_vs_eager("auto", data, dropout=0.1, steps=8)
    losses, _, runner = out["graphs"]
    assert runner.graphed.failed is None and runner.graphed.replays == 8 - runner.graphed.warmup
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert len(set(losses[-3:])) == 3


def _scst_setup():
    from captioning.training.scst import ScstLoss

    torch.manual_seed(0)
    model = tiny("aic")
    model = type(model)(model.cfg.with_dropout(0.0)).to(CUDA).train()
    f, bx, m = _on_cuda(*inputs())
    rl = ScstLoss({i: [[3, 4, 5, 6], [7, 8]] for i in range(f.shape[0])}, samples=3, max_tokens=10)

    class B:
        features, boxes, region_mask = f, bx, m
        image_ids = torch.arange(f.shape[0])

    return model, rl, B


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_captured_scst_update_equals_eager_on_cuda(precision):
    """SCST under run.compile=graphs: sampling and rewards eager, the update replayed; a replay gives the eager
    update's loss and gradients for the same draws."""
    from captioning.training.graphs import GraphedXeStep

    if precision == "bf16":
        _bf16()
    model, rl, B = _scst_setup()
    drawn = rl.draw(model, B)
    g = GraphedXeStep(model, rl.graph_loss, precision, CUDA, 0.1, inputs=rl.graph_inputs)
    values = [float(g(drawn)) for _ in range(4)]
    assert g.failed is None, g.failed
    assert g.captures == 1 and g.replays == 4 - g.warmup
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    with autocast(precision, CUDA):
        loss = rl.graph_loss(model, drawn)
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    tol = 1e-5 if precision == "fp32" else 2e-3
    assert values[-1] == pytest.approx(float(loss), abs=tol, rel=tol)
    want = [p.grad for p in model.parameters() if p.grad is not None]
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_scst_trains_through_the_graphed_step_on_cuda(precision):
    """The trainer's step with run.compile=graphs and SCST's loss: eager draws, replayed updates, eager Adam."""
    if precision == "bf16":
        _bf16()
    model, rl, B = _scst_setup()
    s = TrainSettings(batch_size=3, schedule="constant", lr=1e-4, clip=None, precision=precision, compile="graphs")
    opt, sched = make_optimizer(model, s, 10)
    runner = StepRunner(model, opt, sched, s, CUDA, loss_fn=rl)
    assert runner.graphed is not None and runner.prepare is not None
    out = [float(runner(B)) for _ in range(5)]
    assert runner.graphed.failed is None, runner.graphed.failed
    assert all(v == v for v in out) and runner.graphed.replays == 5 - runner.graphed.warmup
    assert rl.pop_stats()["reward"] >= 0  # the draws were rewarded (stats kept by the eager part)
    assert all(int(st["step"]) == 5 for st in opt.state.values())  # Adam stepped after every replay
