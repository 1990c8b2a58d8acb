"""XE training: it learns, checkpoints load with weights_only, and a killed run resumes to identical weights."""

from __future__ import annotations

import pytest
import torch

from captioning.bench.loader import make_data
from captioning.data.loader import CaptionDataset, MemoryFeatures
from captioning.models.encoder_decoder import Captioner
from captioning.models.registry import preset, scaled
from captioning.training import checkpoint
from captioning.training.loop import TrainSettings, load_model, train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("xe"), images=24, max_boxes=6, dim=32, chunk_rows=4)


def _model(name="aic"):
    cfg = scaled(preset(name), d_model=32, layers=1, heads=2, d_ff=64).replace(d_in=32, vocab_size=1000,
                                                                               max_len=24, dropout=0.1)
    torch.manual_seed(0)
    return Captioner(cfg)


def _dataset(d):
    src = MemoryFeatures(d["features"].astype("float32"), d["boxes"], d["num_boxes"], d["ids"], block_rows=4)
    return CaptionDataset(src, labels=d["labels"], captions_per_image=2, shuffle_buffer=8, seed=3)


SETTINGS = TrainSettings(epochs=3, batch_size=6, warmup=5, label_smoothing=0.1, clip=0.1, seed=7)


def test_resume_after_kill_gives_identical_weights(data, tmp_path):
    ref = _model()
    r = train(ref, _dataset(data), SETTINGS, tmp_path / "ref", progress=False)
    assert r.epochs_run == 3 and len(r.history) == 3 and r.resumed_from_epoch == 0
    killed = _model()
    with pytest.raises(KeyboardInterrupt):
        train(killed, _dataset(data), SETTINGS, tmp_path / "k", progress=False, stop_after_steps=6)  # mid-epoch 2
    assert checkpoint.load(tmp_path / "k" / "last.pt")["epoch"] == 0  # only epoch 1 finished
    resumed = _model()  # a fresh process would start from a fresh model
    r2 = train(resumed, _dataset(data), SETTINGS, tmp_path / "k", progress=False)
    assert r2.resumed_from_epoch == 1 and r2.epochs_run == 3
    for (k, a), (_, b) in zip(ref.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert [h["loss"] for h in r.history] == pytest.approx([h["loss"] for h in r2.history], abs=0)


def test_training_reduces_loss_and_selects_best(data, tmp_path):
    model = _model("satic-k2")
    calls = []

    def validate(m):
        assert not m.training
        calls.append(1)
        return {"CIDEr": [0.1, 0.5, 0.3][len(calls) - 1]}

    s = TrainSettings(epochs=3, batch_size=6, schedule="constant", lr=3e-3, clip=None)
    r = train(model, _dataset(data), s, tmp_path, validate=validate, progress=False)
    assert r.history[-1]["loss"] < r.history[0]["loss"]
    assert r.best_epoch == 1 and r.best_metric == 0.5
    best = checkpoint.load(r.best_checkpoint)
    assert best["epoch"] == 1 and best["extra"]["metrics"]["CIDEr"] == 0.5
    loaded, st = load_model(r.best_checkpoint)
    assert loaded.cfg == model.cfg and st["arch"]["group_size"] == 2


@pytest.mark.parametrize("scores,best_epoch", [([0.2, 0.3], -1), ([0.2, 0.9], 1)])
def test_select_start_keeps_the_starting_weights_unless_an_epoch_beats_them(data, tmp_path, scores, best_epoch):
    """Fine-tuning (SCST) validates its start first: a model worse on validation than the start is never best,
    the start competes as epoch -1, the training itself is unchanged, and a resumed run keeps the start's score."""
    start = _model()
    start_sd = {k: v.clone() for k, v in start.state_dict().items()}
    seen = []

    def validate(m):
        seen.append(1)
        return {"CIDEr": [0.5, *scores][len(seen) - 1]}  # the start scores 0.5

    s = TrainSettings(epochs=2, batch_size=6, schedule="constant", lr=1e-3, seed=4)
    r = train(start, _dataset(data), s, tmp_path / "sel", validate=validate, progress=False, select_start=True)
    assert len(seen) == 3 and r.best_epoch == best_epoch and r.best_metric == max(0.5, *scores)
    best = checkpoint.load(r.best_checkpoint)
    assert best["epoch"] == best_epoch
    if best_epoch == -1:
        assert best["extra"]["start"] and best["extra"]["metrics"]["CIDEr"] == 0.5
        for k, v in start_sd.items():
            assert torch.equal(best["state_dict"][k], v), k
    # validating the start draws no random numbers: the weights end as without select_start
    plain = _model()
    train(plain, _dataset(data), s, tmp_path / "plain", validate=lambda m: {"CIDEr": 0.0}, progress=False)
    for (k, a), (_, b) in zip(start.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    # resumed after the last epoch: nothing re-validated, the decision kept
    again = train(_model(), _dataset(data), s, tmp_path / "sel", validate=validate, progress=False,
                  select_start=True)
    assert len(seen) == 3 and again.best_epoch == best_epoch


def test_early_stopping(data, tmp_path):
    s = TrainSettings(epochs=6, batch_size=6, schedule="constant", lr=1e-3, patience=2)
    r = train(_model(), _dataset(data), s, tmp_path, validate=lambda m: {"CIDEr": 1.0}, progress=False)
    assert r.epochs_run == 3 and r.best_epoch == 0  # no improvement after epoch 0 for 2 epochs


def test_checkpoints_refuse_arbitrary_objects(tmp_path):
    p = tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "x": object()}, p)
    with pytest.raises(Exception, match=r"never unpickles") as info:
        checkpoint.load(p)
    assert str(p) in str(info.value) and "weights_only=False" not in str(info.value)  # no advice to unpickle
