"""run.compile=graphs: the graph-captured XE step (captioning.training.graphs) and how the runner uses it.

CUDA capture itself is tested in tests/models/test_gpu_training.py (``gpu`` marker). Here, on CPU, the capture is
replaced by a stand-in graph that re-runs the recorded function at every replay: the bookkeeping (static inputs,
region padding, warm-up, the gradients every path writes, the eager last batch, the eager optimizer) is the
real one, and the steps must equal the eager runner's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioning.data.loader import Batch, collate
from captioning.training import graphs
from captioning.training.loop import StepRunner, TrainSettings, compile_mode, make_optimizer, train
from tests.training.test_xe import _dataset, _model, data  # noqa: F401  (fixture)

CPU = torch.device("cpu")


class _StandInGraph:
    def __init__(self, fn, out):
        self.fn, self.out, self.replayed = fn, out, 0

    def replay(self):
        self.out.copy_(self.fn())
        self.replayed += 1


def _fake_capture(fn):
    out = torch.full((), float("nan"), dtype=torch.float64)  # a capture runs no kernel: nothing computed yet
    return _StandInGraph(fn, out), out


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(graphs, "_capture", _fake_capture)
    monkeypatch.setattr(graphs, "supported", lambda device, precision: precision in ("fp32", "bf16"))


def _varied(d):
    """The test images with 3 regions each, every eighth with 6 (the fixture's have 6 each)."""
    from captioning.data.loader import CaptionDataset, MemoryFeatures

    boxes = np.where(np.arange(len(d["ids"])) % 8 == 0, 6, 3)  # most images 3 regions, a few 6
    src = MemoryFeatures(d["features"].astype("float32"), d["boxes"], boxes, d["ids"], block_rows=4)
    return CaptionDataset(src, labels=d["labels"], captions_per_image=2, shuffle_buffer=8, seed=3)


def _batches(d, n: int, batch_size: int = 6, varied: bool = False) -> list[Batch]:
    ds = _varied(d) if varied else _dataset(d)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, collate_fn=collate)
    out = list(loader)
    while len(out) < n:
        out += out
    return out[:n]


def _fixed_regions(b: Batch, regions: int) -> Batch:
    """``b`` padded to ``regions`` regions (masked), so every batch has one shape."""
    pad = graphs.pad_regions
    return Batch(pad(b.features, regions), pad(b.boxes, regions), pad(b.region_mask, regions), b.tokens,
                 b.token_mask, b.image_ids, b.rows)


def _run(batches, mode: str, *, dropout: float = 0.1, label_smoothing: float = 0.0, clip: float | None = 0.1,
         sgd: bool = False):
    model = _model()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    model.train()
    s = TrainSettings(batch_size=6, warmup=5, label_smoothing=label_smoothing, clip=clip, compile=mode)
    opt, sched = make_optimizer(model, s, 4)
    if sgd:  # Adam would turn rounding-level gradients of either sign into full-size steps
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    runner = StepRunner(model, opt, sched, s, CPU)
    torch.manual_seed(11)
    losses = [float(runner(b)) for b in batches]
    return losses, model.state_dict(), runner


def test_compile_modes():
    assert [compile_mode(v) for v in (False, None, True, "off", "default", "graphs", "GRAPHS")] == \
        ["off", "off", "default", "off", "default", "graphs", "graphs"]
    with pytest.raises(ValueError, match="graphs"):
        compile_mode("fast")


def test_graphs_mode_is_the_eager_step_on_cpu(data):  # noqa: F811
    """Without a CUDA device run.compile=graphs trains eagerly: the same losses and weights, bit for bit."""
    batches = _batches(data, 4)
    ref_losses, ref_sd, _ = _run(batches, "off", label_smoothing=0.1)
    losses, sd, runner = _run(batches, "graphs", label_smoothing=0.1)
    assert runner.graphed is None
    assert losses == ref_losses
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_graph_step_equals_eager_step_bit_for_bit(data, stand_in):  # noqa: F811
    """Fixed shapes, dropout on, no label smoothing: warm-up steps, the capture's step and the replays take
    exactly the eager runner's steps (same losses, same weights, same optimizer state); the last, smaller batch
    runs eagerly and the graph is kept."""
    full = [_fixed_regions(b, 8) for b in _batches(data, 24, varied=True)]
    full = [b for b in full if len(b) == 6][:6]
    last = _fixed_regions(_batches(data, 4, batch_size=5)[0], 8)
    batches = [*full, last, full[0]]
    ref_losses, ref_sd, ref_runner = _run(batches, "off")
    losses, sd, runner = _run(batches, "graphs")
    g = runner.graphed
    assert g is not None and g.failed is None
    assert (g.eager_steps, g.captures, g.replays) == (graphs.WARMUP + 1, 1, len(batches) - graphs.WARMUP - 1)
    assert g.graph.replayed == g.replays
    assert losses == ref_losses
    for k in ref_sd:
        assert torch.equal(sd[k], ref_sd[k]), k
    # the gradient tensors are the ones fixed at the first step, and the optimizer read them
    assert all(p.grad is not None for p in runner.model.parameters())
    assert {id(p.grad) for p in runner.model.parameters()} == {id(t) for t in g.grads}
    ref_state = ref_runner.opt.state_dict()["state"]
    for k, st in runner.opt.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(v, ref_state[k][name]), (k, name)


def test_padded_regions_and_label_smoothing_stay_close(data, stand_in):  # noqa: F811
    """Region counts that vary per batch are padded (masked) to the most seen; with label smoothing the graph's
    loss sums masked token losses. No dropout (padding changes the masks' shapes), plain SGD: the steps equal
    the eager runner's up to float rounding."""
    batches = _batches(data, 8, varied=True)
    counts = {int(b.region_mask.shape[1]) for b in batches}
    assert len(counts) > 1  # the data really varies
    ref_losses, ref_sd, _ = _run(batches, "off", dropout=0.0, label_smoothing=0.1, sgd=True)
    losses, sd, runner = _run(batches, "graphs", dropout=0.0, label_smoothing=0.1, sgd=True)
    g = runner.graphed
    assert g.captures >= 1 and g.replays >= 1 and g.regions == max(counts)
    assert g.static["features"].shape[1] == g.regions
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], atol=1e-5, rtol=1e-4)


def test_a_failed_capture_trains_eagerly(data, monkeypatch):  # noqa: F811
    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", broken)
    monkeypatch.setattr(graphs, "supported", lambda device, precision: True)
    full = [b for b in (_fixed_regions(b, 8) for b in _batches(data, 24)) if len(b) == 6][:4]
    ref_losses, ref_sd, _ = _run(full, "off")
    with pytest.warns(RuntimeWarning, match="capture of the XE step failed"):
        losses, sd, runner = _run(full, "graphs")
    assert "not permitted" in runner.graphed.failed and runner.graphed.replays == 0
    assert losses == ref_losses
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_train_with_graphs_equals_eager_training(data, stand_in, tmp_path):  # noqa: F811
    """train() with run.compile=graphs (stand-in graphs on CPU; the fixture's images all have 6 regions): the
    epochs' losses and the final weights are those of the eager run, dropout included."""
    runs = {}
    for mode in ("off", "graphs"):
        model = _model()
        s = TrainSettings(epochs=2, batch_size=6, warmup=5, clip=0.1, seed=7, compile=mode)
        r = train(model, _dataset(data), s, tmp_path / mode, progress=False)
        runs[mode] = ([h["loss"] for h in r.history], model.state_dict())
    assert runs["graphs"][0] == runs["off"][0]
    assert all(torch.equal(runs["graphs"][1][k], v) for k, v in runs["off"][1].items())
