"""run.precision: resolution per device, the one autocast/scaler helper, and how the setting reaches the stages.

CUDA behaviour itself (bf16/fp16 training steps, SDPA on the GPU) is tested in tests/models/test_gpu_training.py
under the ``gpu`` marker; here: CPUs always run fp32, so a CPU run is the same whatever the setting."""

from __future__ import annotations

import warnings

import pytest
import torch

from captioning import precision as P
from captioning.config import ConfigError, load_config
from captioning.training.loop import StepRunner, TrainSettings, make_optimizer, train
from captioning.training.recipe import scst_settings, xe_settings
from tests.training.test_xe import _dataset, _model, data  # noqa: F401  (fixture)


@pytest.mark.parametrize("p", ["fp32", "bf16", "fp16", "auto"])
def test_cpu_always_runs_fp32(p):
    assert P.resolve_precision(p, "cpu") == "fp32"
    assert P.resolve_precision(p, torch.device("cpu")) == "fp32"
    with P.autocast(p, "cpu"):
        assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert not P.grad_scaler(p, "cpu").is_enabled()


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="fp8"):
        P.resolve_precision("fp8", "cpu")


def test_cuda_resolution(monkeypatch):
    """On CUDA: auto = bf16 where the device computes in bf16 natively, else fp32; bf16 asked for on an old
    device is an error naming fp16; the contexts carry the right dtype (checked without a GPU)."""
    monkeypatch.setattr(P, "_bf16_supported", lambda dev: True)
    assert P.resolve_precision("auto", "cuda") == "bf16"
    assert P.resolve_precision("fp16", "cuda:0") == "fp16"
    assert P.resolve_precision("fp32", "cuda") == "fp32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available" where there is none
        ctx = P.autocast("auto", "cuda")
        assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16
        ctx = P.autocast("fp16", "cuda", cache=False)
        assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.float16 and not ctx._cache_enabled
    monkeypatch.setattr(P, "_bf16_supported", lambda dev: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Tesla V100")
    assert P.resolve_precision("auto", "cuda") == "fp32"
    with pytest.raises(ValueError, match="fp16"):
        P.resolve_precision("bf16", "cuda")


def test_config_keys_reach_the_train_settings():
    cfg = load_config("tiny")
    assert cfg.run.precision == "auto" and cfg.run.compile is False
    cfg = load_config("tiny", overrides=["run.precision=fp16", "run.compile=true"])
    xe = xe_settings(cfg.students.xe, cfg)
    assert (xe.precision, xe.compile) == ("fp16", True)
    sc = scst_settings(cfg.students.scst, cfg)
    assert sc.precision == "fp16" and sc.compile is False  # torch.compile is for XE only
    graphs = load_config("tiny", overrides=["run.compile=graphs"])
    # SCST's update is graph-captured too (its sampling and rewards run eagerly before it)
    assert scst_settings(graphs.students.scst, graphs).compile == "graphs"
    with pytest.raises(ConfigError, match=r"run\.precision"):
        load_config("tiny", overrides=["run.precision=fp8"])


def test_step_runner_keeps_the_loss_on_the_device(data):  # noqa: F811
    model = _model()
    s = TrainSettings(epochs=1, batch_size=6, warmup=5)
    opt, sched = make_optimizer(model, s, 4)
    runner = StepRunner(model, opt, sched, s, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ds = _dataset(data)
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=6, collate_fn=_collate())))
    value = runner(batch)
    assert isinstance(value, torch.Tensor) and value.dtype == torch.float64 and value.dim() == 0
    assert torch.isfinite(value) and float(value) > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # a step was taken


def _collate():
    from captioning.data.loader import collate

    return collate


def test_precision_and_log_every_do_not_change_a_cpu_run(data, tmp_path):  # noqa: F811
    """Every precision runs fp32 on a CPU, and reading the loss every step or every 50 steps logs the same
    numbers: the runs end with identical weights and identical per-epoch losses."""
    runs = {}
    for key, kw in {"fp32": {}, "bf16": {"precision": "bf16", "log_every": 1},
                    "auto": {"precision": "auto", "log_every": 0}}.items():
        model = _model()
        s = TrainSettings(epochs=2, batch_size=6, warmup=5, label_smoothing=0.1, seed=7, **kw)
        r = train(model, _dataset(data), s, tmp_path / key, progress=False)
        runs[key] = (r.history, model.state_dict())
    ref_hist, ref_sd = runs["fp32"]
    for key in ("bf16", "auto"):
        hist, sd = runs[key]
        assert [h["loss"] for h in hist] == [h["loss"] for h in ref_hist]
        assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


@pytest.mark.slow
def test_compiled_xe_step_equals_eager(data):  # noqa: F811
    """run.compile: the torch.compile'd XE step computes the eager step's losses and updates (dropout off: the
    compiled graph draws its dropout masks from its own generator). CPU inductor: about a minute to compile."""
    batch = next(iter(torch.utils.data.DataLoader(_dataset(data), batch_size=6, collate_fn=_collate())))
    out = {}
    for comp in (False, True):
        model = _model()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        s = TrainSettings(batch_size=6, label_smoothing=0.1, compile=comp)
        # plain SGD: Adam would turn rounding-level gradients of either sign into full-size steps
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        runner = StepRunner(model, opt, sched, s, torch.device("cpu"))
        assert hasattr(runner.fn, "_torchdynamo_orig_callable") == comp  # compiled by torch.compile
        out[comp] = ([float(runner(batch)) for _ in range(3)], model.state_dict())
    (eager, eager_sd), (compiled, compiled_sd) = out[False], out[True]
    assert compiled == pytest.approx(eager, abs=1e-4)
    for k in eager_sd:
        torch.testing.assert_close(compiled_sd[k], eager_sd[k], atol=1e-4, rtol=1e-3)


def test_the_loader_pins_batches(data, monkeypatch):  # noqa: F811
    """``make_loader(pin_memory=True)`` (CUDA training) pins every tensor of a Batch, so the loop's
    ``non_blocking`` copies are asynchronous (Tensor.pin_memory is faked: it needs a CUDA device)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from captioning.data.loader import Batch

    pinned = []

    def fake_pin(self, *a, **kw):
        pinned.append(self)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    batch = next(iter(torch.utils.data.DataLoader(_dataset(data), batch_size=6, collate_fn=_collate())))
    out = pin_memory(batch)  # what the DataLoader's pinning does with each batch
    assert isinstance(out, Batch) and len(pinned) == 7
    for a, b in zip(vars(batch).values(), vars(out).values(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
