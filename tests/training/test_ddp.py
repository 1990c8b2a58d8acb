"""Data-parallel training (2 CPU processes, gloo) takes the same steps as one process on the same global batches."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from captioning.bench.loader import make_data
from captioning.data.loader import CaptionDataset, MemoryFeatures, make_loader
from captioning.models.encoder_decoder import Captioner
from captioning.models.registry import preset, scaled
from captioning.training import checkpoint, ddp
from captioning.training.loop import TrainSettings, train

# A small constant lr: Adam turns gradients that are zero in exact arithmetic but rounding noise in practice into
# steps of about lr, so a large lr (Noam with warmup 5 reaches ~0.08 here) makes such weights differ by ~lr.
XE = TrainSettings(epochs=2, batch_size=6, schedule="constant", lr=1e-3, label_smoothing=0.1, clip=0.1, seed=7)
# 24 images in batches of 23: shares of 12/11 images, then a last batch of 1 image (rank 1 gets none)
UNEVEN = TrainSettings(epochs=2, batch_size=23, schedule="constant", lr=1e-3, clip=None, seed=7)
TIMEOUT = timedelta(seconds=120)  # a collective that never completes fails the test instead of hanging it


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = make_data(tmp_path_factory.mktemp("ddp"), images=24, max_boxes=6, dim=32, chunk_rows=4)
    return {k: d[k] for k in ("features", "boxes", "num_boxes", "ids", "labels")}


def _model(dropout: float = 0.0):
    cfg = scaled(preset("aic"), d_model=32, layers=1, heads=2, d_ff=64).replace(
        d_in=32, vocab_size=1000, max_len=24, dropout=dropout, input_dropout=dropout)  # 0: no dropout masks
    torch.manual_seed(0)
    return Captioner(cfg)


def _dataset(d):
    src = MemoryFeatures(d["features"].astype("float32"), d["boxes"], d["num_boxes"], d["ids"], block_rows=4)
    return CaptionDataset(src, labels=d["labels"], captions_per_image=2, shuffle_buffer=8, seed=3)


def _per_image_loss(model, batch):
    """A custom loss returning a plain tensor, a mean over the batch's images (token losses summed per image)."""
    total = model.xe_loss(batch.features, batch.boxes, batch.region_mask, batch.tokens, reduction="sum")
    return total / len(batch)


def _key_bias(name: str) -> bool:
    return name.endswith("k_proj.bias")


def _logp(weights, batch):
    model = _model()
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        tokens = batch.tokens.reshape(-1, batch.tokens.shape[-1])
        inputs, _ = model.teacher_inputs(tokens)
        return model(batch.features, batch.boxes, batch.region_mask, inputs)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, world, d, root):
    root = Path(root)
    assert dist.get_world_size() == world == 2 and ddp.rank_device() == torch.device("cpu")
    out = {}
    model = _model()
    r = train(model, _dataset(d), XE, root / "xe", progress=False)
    out["xe"] = (_weights(model), r.history)
    model = _model()
    r = train(model, _dataset(d), UNEVEN, root / "uneven", progress=False, loss_fn=_per_image_loss)
    out["uneven"] = (_weights(model), r.history)
    # with dropout (each rank its own masks): killed in epoch 2, then every rank resumes from rank 0's last.pt,
    # which holds every rank's RNG state
    model = _model(0.1)
    train(model, _dataset(d), XE, root / "dropout", progress=False)
    out["dropout"] = _weights(model)
    with pytest.raises(KeyboardInterrupt):
        train(_model(0.1), _dataset(d), XE, root / "killed", progress=False, stop_after_steps=6)
    model = _model(0.1)
    r = train(model, _dataset(d), XE, root / "killed", progress=False)
    out["resumed"] = (_weights(model), r.resumed_from_epoch)
    # validation on rank 0 only; its (flat) score stops every rank after epoch 2
    calls = []
    s = TrainSettings(epochs=5, batch_size=6, schedule="constant", lr=1e-3, patience=1, seed=7)
    r = train(_model(), _dataset(d), s, root / "early", progress=False,
              validate=lambda m: calls.append(1) or {"CIDEr": 1.0})
    assert len(calls) == (2 if rank == 0 else 0) and r.epochs_run == 2
    return out


def test_two_processes_equal_one(data, tmp_path):
    init = _weights(_model())
    single = {}
    for name, s, fn in (("xe", XE, None), ("uneven", UNEVEN, _per_image_loss)):
        model = _model()
        r = train(model, _dataset(data), s, tmp_path / "single" / name, progress=False, loss_fn=fn)
        single[name] = (_weights(model), r.history)

    out = ddp.launch(_worker, 2, data, str(tmp_path / "ddp"), timeout=TIMEOUT)

    batch = next(iter(make_loader(_dataset(data), 6)))
    for name in ("xe", "uneven"):
        (w1, h1), (w2, h2) = single[name], out[name]
        diff = max((w1[k] - w2[k]).abs().max().item() for k in w1 if not _key_bias(k))
        print(f"{name}: max |1-proc - 2-proc| = {diff:.3g}")
        for k in w1:
            if not _key_bias(k):
                assert torch.allclose(w1[k], w2[k], atol=1e-6, rtol=1e-5), (name, k)
        assert all(not torch.equal(w2[k], init[k]) for k in init), name  # training moved every weight
        # attention key biases get a zero gradient in exact arithmetic (softmax ignores a shift common to all
        # keys), so Adam moves them by rounding noise, differently per run; the models compute the same function
        lp1, lp2 = _logp(w1, batch), _logp(w2, batch)
        assert torch.allclose(lp1, lp2, atol=1e-5, rtol=1e-5), (name, (lp1 - lp2).abs().max())
        assert [h["loss"] for h in h2] == pytest.approx([h["loss"] for h in h1], rel=1e-5)
    w, resumed_from = out["resumed"]
    assert resumed_from == 1
    for k in w:
        assert torch.equal(w[k], out["dropout"][k]), k  # kill + resume = uninterrupted, bit for bit

    run = tmp_path / "ddp" / "xe"
    assert sorted(p.name for p in run.iterdir()) == ["best.pt", "last.pt"]  # no second writer, no stray temp files
    st = checkpoint.load(run / "last.pt")
    assert st["epoch"] == 1 and len(st["extra"]["rank_rng"]) == 2
    for k, v in st["state_dict"].items():
        assert torch.equal(v, out["xe"][0][k]), k


def test_shard_bounds_split_evenly():
    assert [ddp.shard_bounds(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [ddp.shard_bounds(1, r, 2) for r in range(2)] == [(0, 1), (1, 1)]


def _fail(rank, world):
    if rank == 1:
        raise ValueError("boom in rank 1")
    dist.barrier()  # would wait forever for rank 1
    return "unreachable"


def test_exception_in_a_rank_reaches_the_caller():
    with pytest.raises(ValueError, match="boom in rank 1") as info:
        ddp.launch(_fail, 2, timeout=TIMEOUT)
    assert any("raised in rank 1" in n for n in getattr(info.value, "__notes__", []))
