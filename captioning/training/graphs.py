"""The XE training step captured in a CUDA graph (``run.compile: graphs``): one launch per step. SCST's update
(after its eager sampling and rewards, :meth:`captioning.training.scst.ScstLoss.draw`) is captured the same way.

At paper size an XE step is launch-bound on a GPU: about 750 forward operations, as many backward nodes and the
autocast casts, each costing the host 10-30 us to dispatch, i.e. ~50 ms per step whatever the batch size,
while the arithmetic takes a few ms. :class:`GraphedXeStep` records forward, loss, backward and gradient
clipping once into a ``torch.cuda.CUDAGraph`` and replays it for every batch of the same shapes; the optimizer
(the fused Adam: one multi-tensor kernel) and the learning-rate schedule stay eager, so checkpoints, the
optimizer state and resuming are exactly those of the eager loop.

Static shapes: the inputs are copied into static tensors before each replay. Captions are already padded to a
fixed length by the loader (``max_words + 2``); the batch size is fixed by the first batch (a smaller last
batch runs eagerly); regions are padded, with masked regions, to the most seen so far (the largest count of a
feature store is reached after a few batches, so adaptive region counts cause a few captures, not one per
batch; a fixed count never pads). A new shape first runs ``warmup`` ordinary (eager) steps, then is captured;
the next batch of that shape replays it. Only the latest shape's graph is kept.

Gradients live in tensors allocated once (zeros, for the parameters that receive one); the captured step
zeroes and accumulates into them, so the eager steps (warm-up, last batch) and every graph write the same
tensors the optimizer reads. Dropout draws fresh masks on every replay (the default CUDA generator is
registered with the graph), not the eager path's masks: a graph run equals the eager run exactly only without
dropout (the tests' setting), and otherwise is the same training.

Autocast inside the graph: the step enters its own autocast region (with the weight-cast cache) inside the
capture, so the captured casts read the current weights at every replay. fp16 needs the gradient scaler,
whose inf checks read values on the host: :func:`supported` is False for it (and for CPUs), and the runner
uses the eager step there.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from captioning.precision import autocast

WARMUP = 2  # eager steps of a new shape before it is captured
STATIC_INPUTS = ("features", "boxes", "region_mask", "tokens")  # what the XE step reads of a batch


def supported(device: torch.device, precision: str) -> bool:
    """Whether the XE step can be graph-captured here: a CUDA device, fp32 or bf16 (fp16's scaler syncs)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and precision in ("fp32", "bf16")


def _capture(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """(graph, fn's result): ``fn``'s kernels recorded, not run (thread-local error mode: a loader's pin-memory
    thread may go on)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def _on_side_stream(device: torch.device, fn: Callable[[], Any]) -> Any:
    """``fn`` on a side stream (warm-up before a capture: lazy library initialisation must not be captured)."""
    if device.type != "cuda":
        return fn()
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn()
    main.wait_stream(side)
    return out


def pad_regions(t: torch.Tensor, regions: int) -> torch.Tensor:
    """A batch tensor (B, R, ...) padded with zeros (False for masks) to (B, ``regions``, ...)."""
    r = t.shape[1]
    if r == regions:
        return t
    out = t.new_zeros((t.shape[0], regions, *t.shape[2:]))
    out[:, :r] = t
    return out


class GraphedXeStep:
    """Forward, loss, backward and clipping of the XE step, replayed from a CUDA graph per batch shape.

    ``loss_fn(model, batch)`` is the step's loss (mean over the target tokens); ``optimizer_step()`` runs after
    the gradients are ready (clipping excluded: it is captured). ``__call__(batch)`` returns the batch's loss as
    a float64 device tensor (the caller's own; no host sync)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 precision: str, device: torch.device, clip: float | None, *, warmup: int = WARMUP,
                 inputs: tuple[str, ...] = STATIC_INPUTS):
        self.model, self.loss_fn, self.precision, self.device = model, loss_fn, precision, torch.device(device)
        self.inputs = inputs  # the batch attributes the loss reads (SCST: samples and advantages too)
        self.clip, self.warmup = clip, warmup
        self.key: tuple | None = None  # the shape the current graph (or warm-up count) is for
        self.seen = 0  # eager steps taken at self.key
        self.graph: Any = None
        self.static: dict[str, torch.Tensor] = {}
        self.out: torch.Tensor | None = None
        self.regions = 0  # regions padded to (the most seen so far)
        self.grads: list[torch.Tensor] | None = None  # the gradient tensors every path writes
        self.captures = self.replays = self.eager_steps = 0
        self.failed: str | None = None  # why capturing failed (then every step is eager)

    # ------------------------------------------------------------------ the step
    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _forward_backward(self, batch: Any) -> torch.Tensor:
        """Zero the gradients, loss under autocast, backward, clip: the recorded step (and the eager one)."""
        if self.grads is not None:
            if self.grads:
                torch._foreach_zero_(self.grads)
        else:  # the first step: fresh gradients (as the eager loop's zero_grad(set_to_none=True))
            for p in self.model.parameters():
                p.grad = None
        cache = not torch.is_autocast_enabled(self.device.type)  # an outer region's cache would outlive a replay
        with autocast(self.precision, self.device, cache=cache):
            loss = self.loss_fn(self.model, batch)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_value_(self.model.parameters(), self.clip)
        return loss.detach().to(torch.float64)

    def _fix_grads(self) -> None:
        """After the first eager step: keep its gradient tensors for good (accumulated into from now on)."""
        if self.grads is None:
            self.grads = self._grads()

    def _eager(self, batch: Any) -> torch.Tensor:
        self.eager_steps += 1
        value = self._forward_backward(batch)
        self._fix_grads()
        return value

    def _padded(self, batch: Any) -> dict[str, torch.Tensor]:
        r = batch.features.shape[1]
        self.regions = max(self.regions, r)
        out = {name: getattr(batch, name) for name in self.inputs}
        for name in ("features", "boxes", "region_mask"):
            out[name] = pad_regions(out[name], self.regions)
        return out

    def __call__(self, batch: Any) -> torch.Tensor:
        if self.failed is not None:
            return self._eager(batch)
        inputs = self._padded(batch)
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items())
        if key != self.key:
            if self.key is not None and self.graph is not None and len(batch) < self._rows():
                return self._eager(batch)  # a smaller (last) batch: eager, the graph stays
            self.key, self.seen, self.graph, self.static, self.out = key, 0, None, {}, None
        if self.graph is None:
            if self.seen < self.warmup:
                self.seen += 1
                return _on_side_stream(self.device, lambda: self._eager(_Inputs(inputs)))
            try:
                self._capture(inputs)
            except RuntimeError as e:  # an operation that cannot be captured: eager from now on
                self.failed = str(e)
                self.graph, self.static, self.out = None, {}, None
                warnings.warn(f"CUDA graph capture of the XE step failed ({e}); training eagerly", RuntimeWarning,
                              stacklevel=2)
                return self._eager(batch)
        for name, t in inputs.items():
            self.static[name].copy_(t, non_blocking=True)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self.graph.replay()
        self.replays += 1
        return self.out.clone()

    def _rows(self) -> int:
        return int(self.static["features"].shape[0]) if self.static else 0

    def _capture(self, inputs: dict[str, torch.Tensor]) -> None:
        self._fix_grads()
        self.static = {name: t.clone() for name, t in inputs.items()}
        batch = _Inputs(self.static)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self.graph, self.out = _capture(lambda: self._forward_backward(batch))
        # gradients the capture created (a parameter without one in the eager steps): kept for good as well
        have = {id(g) for g in self.grads}
        self.grads += [g for g in self._grads() if id(g) not in have]
        self.captures += 1


class _Inputs:
    """The static tensors as the batch the loss reads (``features``, ``boxes``, ``region_mask``, ``tokens``, ...)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.__dict__.update(tensors)

    def __len__(self) -> int:
        return int(self.features.shape[0])


__all__ = ["STATIC_INPUTS", "WARMUP", "GraphedXeStep", "pad_regions", "supported"]
