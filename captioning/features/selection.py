"""Bottom-up box selection: per-class greedy NMS over the proposal boxes, the best surviving class score per box.

The rule (from the original bottom-up ``generate_tsv.py``): for every class, visit the proposals by that class's
score, descending (ties: lower proposal index first); a proposal is kept in the class unless an earlier kept
proposal of the same class overlaps it with IoU > threshold. A proposal's score is its highest class probability
among the classes in which it was kept (0 when it was kept in none).

Two implementations of the same rule:

* :func:`nms_max_conf_reference` - the original formulation: a loop over the R ranks, each step vectorised over
  the classes of one image, on the tensors' device. Kept as the reference (tests, ``capflow bench extract``'s
  anchor); each step costs several kernel launches, so on a GPU the loop is launch-bound (~18 ms per image).
* :func:`nms_max_conf_batched` - the production path: the same scan over ranks, vectorised over *all images of a
  batch and all classes at once*, with each class's "suppressed" set held as a bitmask of ``ceil(R/64)`` 64-bit
  words instead of R booleans. It runs in NumPy on the CPU (the caller overlaps it with the GPU's next batch),
  and is exactly equal to the reference: it is boolean bookkeeping over the same IoU mask and the same orders,
  no arithmetic on scores. Only the IoU mask is floating point; callers compute it on the device the reference
  would use (:func:`overlap_masks`), so the comparison ``IoU > threshold`` rounds identically.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def nms_max_conf_reference(boxes: torch.Tensor, scores: torch.Tensor, nms_threshold: float) -> torch.Tensor:
    """Per-class greedy NMS over ``boxes`` (R, 4) for every class of ``scores`` (R, K) at once (reference loop).

    Returns, per box, its best score among the classes in which it survived (0 if none).
    """
    from torchvision.ops import box_iou

    r, k = scores.shape
    if r == 0 or k == 0:
        return torch.zeros(r, dtype=torch.float32, device=scores.device)
    over = box_iou(boxes, boxes) > nms_threshold  # (R, R)
    order = torch.sort(scores, dim=0, descending=True, stable=True).indices  # (R, K): rank -> box
    suppressed = torch.zeros(k, r, dtype=torch.bool, device=scores.device)
    kept = torch.zeros(k, r, dtype=torch.bool, device=scores.device)
    cls = torch.arange(k, device=scores.device)
    for i in range(r):
        idx = order[i]
        alive = ~suppressed[cls, idx]
        kept[cls, idx] = alive
        suppressed |= over[idx] & alive[:, None]
    return torch.where(kept.T, scores, torch.zeros((), dtype=scores.dtype, device=scores.device)).amax(dim=1)


def overlap_masks(boxes: Sequence[torch.Tensor], nms_threshold: float) -> list[torch.Tensor]:
    """``IoU > threshold`` (R_i, R_i) per image, computed where the boxes are, exactly as the reference does."""
    from torchvision.ops import box_iou

    return [box_iou(b.float(), b.float()) > nms_threshold for b in boxes]


def _pack_rows(over: np.ndarray, words: int) -> np.ndarray:
    """(B, R, R) bool -> (B, R, words) uint64, bit c of word w = column 64 w + c."""
    b, r, _ = over.shape
    padded = np.zeros((b, r, words * 64), dtype=bool)
    padded[:, :, :r] = over
    return np.packbits(padded, axis=2, bitorder="little").view("<u8").reshape(b, r, words)


def nms_max_conf_batched(over: Sequence[np.ndarray], scores: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The reference rule for a batch of images at once (exactly equal to :func:`nms_max_conf_reference`).

    ``over[i]`` (R_i, R_i) bool is image i's ``IoU > threshold`` mask, ``scores[i]`` (R_i, K) its class scores
    (background excluded; finite). Returns one (R_i,) float32 array per image.
    """
    n = len(over)
    if n != len(scores):
        raise ValueError(f"{n} overlap masks but {len(scores)} score arrays")
    if n == 0:
        return []
    sizes = [int(s.shape[0]) for s in scores]
    k = int(scores[0].shape[1])
    for i, (o, s) in enumerate(zip(over, scores, strict=True)):
        if s.ndim != 2 or s.shape[1] != k or o.shape != (s.shape[0], s.shape[0]):
            raise ValueError(f"image {i}: scores {s.shape} and overlap mask {o.shape} do not fit (K={k})")
    r = max(sizes)
    if r == 0 or k == 0:
        return [np.zeros(m, dtype=np.float32) for m in sizes]
    words = (r + 63) // 64
    s_pad = np.full((n, r, k), -np.inf, dtype=np.float32)  # padding rows sort after every real box
    o_pad = np.zeros((n, r, r), dtype=bool)  # ... and neither suppress nor are suppressed by anything real
    for i, (o, s) in enumerate(zip(over, scores, strict=True)):
        s_pad[i, : sizes[i]] = s
        o_pad[i, : sizes[i], : sizes[i]] = o
    rows = _pack_rows(o_pad, words).reshape(n * r, words)  # row b * R + j: the boxes that box j of image b covers
    # rank -> box per (image, class); stable on the negated scores = descending, ties by lower index (as torch)
    order = np.argsort(-s_pad, axis=1, kind="stable")  # (B, R, K)
    supp = np.zeros(n * k * words, dtype=np.uint64)  # (B, K, W) flat: each class's suppressed boxes as bits
    alive_by_rank = np.empty((n, r, k), dtype=bool)
    row_base = (np.arange(n) * r)[:, None]  # (B, 1)
    word_base = (np.arange(n * k) * words).reshape(n, k)  # (B, K)
    one = np.uint64(1)
    supp3 = supp.reshape(n, k, words)
    for i in range(r):
        idx = order[:, i, :]  # (B, K): the box each class visits at rank i
        word = np.take(supp, word_base + (idx >> 6))
        alive = ((word >> (idx & 63).astype(np.uint64)) & one) == 0
        alive_by_rank[:, i, :] = alive
        cover = np.take(rows, (idx + row_base).ravel(), axis=0).reshape(n, k, words)
        cover *= alive[:, :, None]  # a suppressed box suppresses nothing
        supp3 |= cover
    kept = np.empty((n, r, k), dtype=bool)
    np.put_along_axis(kept, order, alive_by_rank, axis=1)
    best = np.where(kept, s_pad, np.float32(0)).max(axis=2)  # (B, R)
    return [best[i, : sizes[i]].astype(np.float32) for i in range(n)]


def select_boxes(max_conf: np.ndarray, *, conf_threshold: float, min_boxes: int, max_boxes: int,
                 fixed_boxes: int | None = None) -> np.ndarray:
    """Indices of the kept boxes, by score descending then index."""
    r = max_conf.shape[0]
    order = np.lexsort((np.arange(r), -max_conf.astype(np.float64)))
    if fixed_boxes is not None:
        n = fixed_boxes
    else:
        above = int(np.count_nonzero(max_conf > conf_threshold))
        n = min(max(above, min_boxes), max_boxes)
    return order[: min(n, r)]


def nms_max_conf_batched_torch(over: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """:func:`nms_max_conf_batched` on padded tensors, where they are (used on CUDA: the scan then costs kernel
    launches on the device instead of host time, and only the scores travel to the host).

    ``over`` (B, R, R) bool with False in padding rows/columns; ``scores`` (B, R, K) with ``-inf`` in padding rows.
    Returns (B, R) float32 (padding rows: 0). The same boolean bookkeeping over the same stable order, so it is
    exactly equal to the reference.
    """
    n, r, k = scores.shape
    dev = scores.device
    if n == 0 or r == 0 or k == 0:
        return torch.zeros(n, r, dtype=torch.float32, device=dev)
    words = (r + 63) // 64
    bits = torch.zeros(n, r, words * 64, dtype=torch.int64, device=dev)
    bits[:, :, :r] = over.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(64, dtype=torch.int64, device=dev),
                                       torch.arange(64, dtype=torch.int64, device=dev))
    # distinct powers of two: their (wrapping) int64 sum is their bitwise OR
    rows = (bits.view(n, r, words, 64) * weights).sum(-1).view(n * r, words)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # (B, R, K)
    word_idx = (torch.arange(n * k, device=dev) * words).view(n, 1, k) + torch.bitwise_right_shift(order, 6)
    bit = torch.bitwise_left_shift(torch.ones((), dtype=torch.int64, device=dev), torch.bitwise_and(order, 63))
    row_idx = order + (torch.arange(n, device=dev) * r).view(n, 1, 1)
    word_idx = word_idx.transpose(0, 1).reshape(r, n * k).contiguous()
    bit = bit.transpose(0, 1).reshape(r, n * k).contiguous()
    row_idx = row_idx.transpose(0, 1).reshape(r, n * k).contiguous()
    supp = torch.zeros(n * k * words, dtype=torch.int64, device=dev)
    supp2 = supp.view(n * k, words)
    alive_by_rank = torch.empty(r, n * k, dtype=torch.bool, device=dev)
    for i in range(r):
        alive = torch.bitwise_and(supp.take(word_idx[i]), bit[i]) == 0
        alive_by_rank[i] = alive
        supp2.bitwise_or_(rows.index_select(0, row_idx[i]) * alive[:, None])
    kept = torch.zeros(n, r, k, dtype=torch.bool, device=dev)
    kept.scatter_(1, order, alive_by_rank.view(r, n, k).transpose(0, 1))
    return torch.where(kept, scores, torch.zeros((), dtype=scores.dtype, device=dev)).amax(dim=2).clamp(min=0)
