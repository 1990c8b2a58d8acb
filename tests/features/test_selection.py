"""The batched bitmask box selection equals the reference per-class NMS loop, case by case (CPU and CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioning.features.selection import (
    nms_max_conf_batched,
    nms_max_conf_reference,
    overlap_masks,
    select_boxes,
)


def _case(rng: np.random.Generator, r: int, k: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Clustered boxes (so NMS suppresses a lot) and softmax-like scores; ``ties`` quantises scores coarsely."""
    centres = rng.uniform(50, 550, size=(max(1, r // 10), 2))
    c = centres[rng.integers(0, len(centres), size=r)] + rng.normal(0, 15, size=(r, 2))
    wh = rng.uniform(10, 120, size=(r, 2))
    boxes = np.concatenate([c - wh / 2, c + wh / 2], axis=1).astype(np.float32)
    logits = rng.normal(0, 3, size=(r, k + 1))
    p = np.exp(logits - logits.max(1, keepdims=True))
    p = (p / p.sum(1, keepdims=True)).astype(np.float32)[:, :k]
    if ties:
        p = np.round(p * 20) / 20  # many exact ties, and zeros
        p = p.astype(np.float32)
    return torch.from_numpy(boxes), torch.from_numpy(p)


def _check_batch(cases, thr: float, device: str) -> None:
    boxes = [b.to(device) for b, _ in cases]
    scores = [s.to(device) for _, s in cases]
    over = [o.cpu().numpy() for o in overlap_masks(boxes, thr)]
    fast = nms_max_conf_batched(over, [s.cpu().numpy() for s in scores])
    for i, (b, s) in enumerate(zip(boxes, scores, strict=True)):
        ref = nms_max_conf_reference(b, s, thr).cpu().numpy()
        assert fast[i].dtype == np.float32 and fast[i].shape == ref.shape
        np.testing.assert_array_equal(fast[i], ref, err_msg=f"image {i} of the batch")


@pytest.mark.parametrize("k", [80, 1600])
def test_batched_equals_reference_on_random_batches_cpu(k: int) -> None:
    rng = np.random.default_rng(k)
    n_batches = 6 if k == 80 else 2
    for trial in range(n_batches):
        sizes = rng.integers(1, 120 if k == 1600 else 300, size=8)  # mixed proposal counts in one batch
        cases = [_case(rng, int(r), k, ties=bool(trial % 2)) for r in sizes]
        _check_batch(cases, thr=float(rng.choice([0.3, 0.5, 0.7])), device="cpu")


def test_batched_handles_empty_and_single_images() -> None:
    rng = np.random.default_rng(1)
    cases = [_case(rng, 1, 5, False), (torch.zeros(0, 4), torch.zeros(0, 5)), _case(rng, 70, 5, True)]
    _check_batch(cases, thr=0.3, device="cpu")
    assert nms_max_conf_batched([], []) == []
    out = nms_max_conf_batched([np.zeros((0, 0), bool)], [np.zeros((0, 3), np.float32)])
    assert out[0].shape == (0,)


def test_suppression_is_actually_exercised() -> None:
    """Guard against a vacuous comparison: the rule zeroes some boxes and keeps others, as hand-computed."""
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], dtype=torch.float32)
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.05], [0.2, 0.7]])
    # class 0: box 0 kept, box 1 suppressed (IoU 0.68), box 2 kept; class 1: box 0 kept, box 1 suppressed, box 2 kept
    expected = np.array([0.9, 0.0, 0.7], dtype=np.float32)
    np.testing.assert_array_equal(nms_max_conf_reference(boxes, scores, 0.3).numpy(), expected)
    over = [overlap_masks([boxes], 0.3)[0].numpy()]
    np.testing.assert_array_equal(nms_max_conf_batched(over, [scores.numpy()])[0], expected)


def test_mismatched_inputs_are_errors() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        nms_max_conf_batched([np.zeros((3, 3), bool)], [np.zeros((4, 2), np.float32)])
    with pytest.raises(ValueError, match="overlap masks"):
        nms_max_conf_batched([np.zeros((3, 3), bool)], [])


def test_select_boxes_rule() -> None:
    conf = np.array([0.1, 0.5, 0.5, 0.05, 0.9], dtype=np.float32)
    np.testing.assert_array_equal(select_boxes(conf, conf_threshold=0.2, min_boxes=1, max_boxes=10), [4, 1, 2])
    np.testing.assert_array_equal(select_boxes(conf, conf_threshold=0.2, min_boxes=4, max_boxes=10), [4, 1, 2, 0])
    np.testing.assert_array_equal(select_boxes(conf, conf_threshold=0.0, min_boxes=1, max_boxes=2), [4, 1])
    np.testing.assert_array_equal(
        select_boxes(conf, conf_threshold=0.2, min_boxes=1, max_boxes=10, fixed_boxes=5), [4, 1, 2, 0, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("k", [80, 1600])
def test_batched_equals_reference_on_cuda(k: int) -> None:
    rng = np.random.default_rng(100 + k)
    for trial in range(3):
        sizes = rng.integers(1, 300, size=8)
        cases = [_case(rng, int(r), k, ties=bool(trial % 2)) for r in sizes]
        _check_batch(cases, thr=0.3, device="cuda")


def _padded(cases, thr: float, device: str):
    boxes = [b.to(device) for b, _ in cases]
    over = overlap_masks(boxes, thr)
    sizes = [int(b.shape[0]) for b in boxes]
    r, k = max(sizes), cases[0][1].shape[1]
    o = torch.zeros(len(cases), r, r, dtype=torch.bool, device=device)
    s = torch.full((len(cases), r, k), float("-inf"), device=device)
    for j, (ov, (_, sc)) in enumerate(zip(over, cases, strict=True)):
        o[j, : sizes[j], : sizes[j]] = ov
        s[j, : sizes[j]] = sc.to(device)
    return o, s, sizes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("k", [80, 1600])
def test_torch_scan_equals_reference(k: int, device: str) -> None:
    from captioning.features.selection import nms_max_conf_batched_torch

    rng = np.random.default_rng(7 + k)
    for trial in range(2):
        sizes = rng.integers(1, 100 if (k == 1600 and device == "cpu") else 300, size=8)
        cases = [_case(rng, int(r), k, ties=bool(trial % 2)) for r in sizes]
        o, s, sz = _padded(cases, 0.3, device)
        got = nms_max_conf_batched_torch(o, s).cpu().numpy()
        for j, (b, sc) in enumerate(cases):
            ref = nms_max_conf_reference(b.to(device), sc.to(device), 0.3).cpu().numpy()
            np.testing.assert_array_equal(got[j, : sz[j]], ref, err_msg=f"image {j}")
