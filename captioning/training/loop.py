"""The training loop of every stage: cross-entropy (teacher forcing) by default, SCST when given its loss function
(:class:`captioning.training.scst.ScstLoss`), with epoch checkpoints that resume to identical weights.

Each epoch: batches from a :class:`~captioning.data.loader.CaptionDataset` (its order depends only on the seed
and the epoch), Adam(0.9, 0.98, 1e-9) with the Noam schedule (or a constant/step schedule), label smoothing,
gradient clipping by value, mixed precision on CUDA (``precision``: bf16, or fp16 with a gradient scaler; see
:mod:`captioning.precision`); then validation (a callable returning metrics, e.g. greedy CIDEr on
the val split), ``last.pt`` always and ``best.pt`` when the validation score improves, early stopping after
``patience`` epochs without improvement. A killed run restarts from ``last.pt`` (weights, optimizer, scheduler,
RNG state): on CPU it ends with the same weights as an uninterrupted run.

Data-parallel: called inside an initialised ``torch.distributed`` process group of N > 1 processes (see
:func:`captioning.training.ddp.launch`), :func:`train` trains with DistributedDataParallel. Every rank iterates the
same loader (same seed, so the same global batches) and trains on its own contiguous slice of each global batch;
the loss is normalised by the global number of target tokens, so N processes take the same steps as one process
on the same global batches (up to float rounding, without dropout: each rank draws its own dropout masks).
Rank 0 validates, writes the checkpoints and calls ``on_epoch``; the metrics go to every rank, so all ranks take
the same best-epoch and early-stopping decisions. Every rank resumes from ``last.pt``, which also holds each
rank's RNG state.

The loop does not wait for the GPU: the loss of each step stays on the device (summed in float64 there, exactly
the arithmetic of summing ``float(loss)`` on the host, so the logged numbers are the same) and is read every
``log_every`` steps and at the end of the epoch; batches are copied from pinned memory with ``non_blocking``
on CUDA; the optimizer is the fused Adam on CUDA. ``compile`` (``run.compile``): ``"off"`` (False), ``"default"``
(True: the XE step through ``torch.compile``) or ``"graphs"``: on CUDA in fp32/bf16 the XE step's forward,
loss, backward and clipping are replayed from a CUDA graph per batch shape (:mod:`captioning.training.graphs`;
the host no longer launches the step's ~2,000 kernels one by one); elsewhere (CPUs, fp16, data-parallel, a
custom loss) the eager step runs, so a CPU run is the same with any setting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from captioning import stopping
from captioning.data.loader import CaptionDataset, make_loader
from captioning.models.encoder_decoder import PAD, Captioner
from captioning.precision import autocast, grad_scaler, resolve_precision
from captioning.progress import bar as progress_bar
from captioning.training import checkpoint, ddp, graphs
from captioning.training.schedules import constant, noam, step_decay

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    epochs: int = 15
    batch_size: int = 10
    lr: float = 1.0  # base lr (Noam multiplies it); for "constant"/"step" the actual lr
    schedule: str = "noam"  # noam | constant | step
    noam_factor: float = 1.0
    warmup: int = 10000
    step_every: int = 3  # epochs, for "step"
    step_gamma: float = 0.8
    label_smoothing: float = 0.0
    clip: float | None = 0.1  # gradient clipping by value
    workers: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16 | auto (captioning.precision; CPUs always run fp32)
    compile: bool | str = False  # off (False) | default (True: torch.compile) | graphs (CUDA graphs): the XE step
    log_every: int = 50  # read the loss on the host (a device sync) every N steps; 1 = every step
    fused_optimizer: bool = True  # the fused Adam kernel on CUDA (ignored on CPU)
    patience: int | None = None  # early stopping (epochs without validation improvement)
    select_metric: str = "CIDEr"
    seed: int = 0


@dataclass(frozen=True)
class FitResult:
    """One training run (XE or SCST): its best validation metric and epoch (SCST: -1 = no epoch beat the starting
    weights), the epochs' history, its checkpoints, what an initialisation checkpoint filled (``init_loaded`` /
    ``init_skipped`` tensors; None: no initialisation), the processes and the wall seconds. JSON-able
    (``dataclasses.asdict``): what a data-parallel rank returns."""

    best_metric: float
    best_epoch: int | None
    epochs_run: int
    history: list[dict[str, Any]] = field(default_factory=list)
    last_checkpoint: str | None = None
    best_checkpoint: str | None = None
    resumed_from_epoch: int = 0
    init_loaded: int | None = None
    init_skipped: int | None = None
    processes: int = 1
    seconds: float = 0.0

    @property
    def checkpoint(self) -> str:
        """The weights that go on: the best checkpoint (the last when none was selected)."""
        return str(self.best_checkpoint or self.last_checkpoint)

    @property
    def init(self) -> dict[str, int]:
        """``init_loaded`` / ``init_skipped`` as metrics (empty without an initialisation)."""
        return {} if self.init_loaded is None else {"init_loaded": self.init_loaded,
                                                    "init_skipped": int(self.init_skipped or 0)}


def make_optimizer(model: torch.nn.Module, s: TrainSettings, steps_per_epoch: int):
    on_cuda = all(p.device.type == "cuda" for p in model.parameters())
    fused = True if (s.fused_optimizer and on_cuda) else None  # None = torch's default (foreach / for-loop)
    opt = torch.optim.Adam(model.parameters(), lr=s.lr, betas=(0.9, 0.98), eps=1e-9, fused=fused)
    if s.schedule == "noam":
        fn = noam(model.cfg.d_model, s.warmup, s.noam_factor)
    elif s.schedule == "step":
        fn = step_decay(max(1, s.step_every * steps_per_epoch), s.step_gamma)
    elif s.schedule == "constant":
        fn = constant()
    else:
        raise ValueError(f"unknown schedule {s.schedule!r}")
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, fn)


COMPILE_MODES = ("off", "default", "graphs")


def compile_mode(value: bool | str | None) -> str:
    """``run.compile`` / ``TrainSettings.compile`` as one of :data:`COMPILE_MODES` (booleans: off / default)."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "default"
    if isinstance(value, str) and value.lower() in COMPILE_MODES:
        return value.lower()
    raise ValueError(f"unknown compile mode {value!r}: one of {', '.join(COMPILE_MODES)} (or true/false)")


StepFn = Callable[[Captioner, Any], torch.Tensor | tuple[torch.Tensor, torch.Tensor | int | float]]


def _xe_step(model: Captioner, batch, s: TrainSettings, sync_free: bool = False) -> torch.Tensor:
    return model.xe_loss(batch.features, batch.boxes, batch.region_mask, batch.tokens, s.label_smoothing,
                         sync_free=sync_free)


def _xe_sum_step(model: Captioner, batch, s: TrainSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token losses, number of target tokens): the XE loss as data-parallel training needs it."""
    total = model.xe_loss(batch.features, batch.boxes, batch.region_mask, batch.tokens, s.label_smoothing,
                          reduction="sum")
    return total, (batch.tokens[..., 1:] != PAD).sum()


def _sum_count(out: Any, images: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss_fn result as (sum, count): a (sum, count) pair as is, a plain tensor as a mean over the images."""
    if isinstance(out, tuple | list):
        total, count = out
        return total, torch.as_tensor(count, device=total.device).to(torch.float64)
    return out * images, torch.tensor(float(images), dtype=torch.float64, device=out.device)


class _LossModule(torch.nn.Module):
    """What DistributedDataParallel wraps: ``forward(batch) = loss_fn(model, batch)``, so any loss (XE, SCST with
    its sampling) runs inside DDP's forward."""

    def __init__(self, model: Captioner, fn: StepFn):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, batch):
        return self.fn(self.model, batch)


def _rank_seed(seed: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def _dist_loss(wrapped: DistributedDataParallel, batch, rank: int, world: int, precision: str
               ) -> tuple[torch.Tensor, float]:
    """This rank's share of a global batch through DDP -> (loss to backpropagate, global mean loss).

    The loss is ``sum_r / count * world``: DDP averages the gradients over the ranks, so the synchronised gradient
    is that of ``sum_all / count``, the global-batch mean. A rank without images (a last batch smaller than the
    world) still runs forward/backward (on one image, weighted 0) because every rank must join the gradient
    all-reduce."""
    part = ddp.shard(batch, rank, world)
    empty = len(part) == 0
    if empty:
        part = ddp.slice_batch(batch, 0, 1)
    with autocast(precision, batch.features.device, cache=False):
        out = wrapped(part)
    total, count = _sum_count(out, len(part))
    if empty:
        total, count = total * 0, count * 0
    stats = torch.stack([total.detach().to(torch.float64), count])
    dist.all_reduce(stats)
    g_total, g_count = stats.tolist()
    g_count = max(g_count, 1.0)
    return total * (world / g_count), g_total / g_count


class StepRunner:
    """One optimisation step of :func:`train` (and what ``capflow bench train`` times): the loss under the
    precision's autocast, backward (scaled for fp16), clipping by value, the optimizer and schedule steps.

    Calling it with a batch already on the device returns the batch's mean loss as a float64 tensor on the
    device (no host sync), or a float in data-parallel mode (whose all-reduce of the loss syncs anyway).
    ``settings.compile``: ``default`` compiles the XE step with ``torch.compile``, ``graphs`` replays it from a
    CUDA graph (:class:`captioning.training.graphs.GraphedXeStep`; CUDA, fp32/bf16); both single process. A custom
    ``loss_fn`` stays eager unless it is split for graphs (``graph_inputs``, ``draw``, ``graph_loss``: SCST,
    whose sampling and rewards run eagerly before the replayed update); ``default`` compiles XE only.
    ``self.graphed`` is the graph runner where it is used, else None."""

    def __init__(self, model: Captioner, opt: torch.optim.Optimizer, sched, settings: TrainSettings,
                 device: torch.device, *, loss_fn: StepFn | None = None,
                 wrapped: DistributedDataParallel | None = None, rank: int = 0, world: int = 1):
        s = settings
        self.model, self.opt, self.sched, self.s = model, opt, sched, s
        self.wrapped, self.rank, self.world = wrapped, rank, world
        self.precision = resolve_precision(s.precision, device)
        self.device = device
        self.scaler = grad_scaler(self.precision, device)
        fn: StepFn = loss_fn or (lambda m, b: _xe_step(m, b, s))
        mode = compile_mode(s.compile)
        xe_only = loss_fn is None and wrapped is None
        if mode == "default" and xe_only:
            fn = torch.compile(fn)
        self.fn = fn
        self.graphed = None
        self.prepare: Callable[[Captioner, Any], Any] | None = None  # eager work before a graphed loss (SCST)
        if mode == "graphs" and wrapped is None and graphs.supported(device, self.precision):
            if xe_only:
                self.graphed = graphs.GraphedXeStep(model, lambda m, b: _xe_step(m, b, s, sync_free=True),
                                                    self.precision, device, s.clip)
            elif getattr(loss_fn, "graph_inputs", None):  # a loss split into eager draw + graphed update
                self.graphed = graphs.GraphedXeStep(model, loss_fn.graph_loss, self.precision, device, s.clip,
                                                    inputs=tuple(loss_fn.graph_inputs))
                self.prepare = loss_fn.draw
        # a custom loss (SCST) decodes, see captioning.precision.autocast; unless it says its decoding is eager
        self.cache_casts = loss_fn is None or bool(getattr(loss_fn, "autocast_cache", False))

    def __call__(self, batch) -> torch.Tensor | float:
        if self.graphed is not None:  # forward, backward and clipping replayed; the optimizer eager
            value = self.graphed(self.prepare(self.model, batch) if self.prepare is not None else batch)
            self.opt.step()
            self.sched.step()
            return value
        if self.wrapped is None:
            with autocast(self.precision, self.device, cache=self.cache_casts):
                loss = self.fn(self.model, batch)
            if isinstance(loss, tuple | list):
                loss = loss[0] / torch.as_tensor(loss[1], device=loss[0].device).clamp(min=1)
            value: torch.Tensor | float = loss.detach().to(torch.float64)
        else:
            loss, value = _dist_loss(self.wrapped, batch, self.rank, self.world, self.precision)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.s.clip:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_value_(self.model.parameters(), self.s.clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        return value


def train(
    model: Captioner,
    data: CaptionDataset,
    settings: TrainSettings,
    ckpt_dir: str | Path,
    *,
    validate: Callable[[Captioner], dict[str, float]] | None = None,
    on_epoch: Callable[[int, dict[str, Any]], None] | None = None,
    device: str | torch.device = "cpu",
    arch: dict[str, Any] | None = None,
    vocab_digest: str = "",
    loss_fn: StepFn | None = None,
    progress: bool = True,
    stop_after_steps: int | None = None,
    distributed: bool | None = None,
    select_start: bool = False,
) -> FitResult:
    """Train until ``settings.epochs`` (resuming from ``ckpt_dir/last.pt`` if present).

    ``loss_fn(model, batch)`` replaces the XE loss (SCST uses this loop with its own loss). It returns either a
    scalar tensor, the mean loss over the batch's *images* (equal weight per image), or a pair ``(sum, count)``:
    a sum of per-unit losses (e.g. tokens) and the number of units, the loss being ``sum / count``. Only the
    pair is exact data-parallel when units per image vary (the loss is then normalised by the global count);
    a plain tensor is weighted by the rank's share of the global batch's images.
    ``stop_after_steps`` interrupts the run (tests of kill-and-resume).

    ``distributed``: None (default) trains data-parallel when called inside an initialised ``torch.distributed``
    process group of more than one process; False forces single-process training. In data-parallel mode
    ``settings.batch_size`` is the global batch size, ``validate``/``on_epoch`` run on rank 0 only, and
    ``device`` is this rank's device (:func:`captioning.training.ddp.rank_device`).

    ``select_start``: validate the starting weights before the first epoch and let them compete for ``best.pt``
    (as epoch -1): fine-tuning (SCST) then never returns a model worse on validation than the one it started
    from. ``FitResult.best_epoch == -1`` says no epoch beat the start."""
    s = settings
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    rank, world = ddp.world()
    if distributed is False or world == 1:
        rank, world = 0, 1
    elif distributed is True and world == 1:
        raise RuntimeError("distributed=True needs an initialised process group of more than one process")
    ckpt_dir = Path(ckpt_dir)
    model.to(dev)
    pinned = dev.type == "cuda"  # pinned host batches: asynchronous (non_blocking) copies to the GPU
    loader = make_loader(data, s.batch_size, workers=s.workers, pin_memory=pinned)
    steps_per_epoch = max(1, -(-len(data) // s.batch_size))
    opt, sched = make_optimizer(model, s, steps_per_epoch)
    start_epoch, step, best, best_epoch, history = 0, 0, float("-inf"), -1, []
    last = ckpt_dir / "last.pt"
    if last.exists():
        st = checkpoint.load(last, map_location=dev)
        model.load_state_dict(st["state_dict"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        checkpoint.set_rng_state(st["rng"])
        start_epoch, step = st["epoch"] + 1, st["step"]
        best, best_epoch = st["extra"].get("best", best), st["extra"].get("best_epoch", best_epoch)
        history = st["extra"].get("history", [])
        if world > 1:  # each rank continues its own random streams (another world size: fresh per-rank seeds)
            per_rank = st["extra"].get("rank_rng") or []
            if len(per_rank) == world:
                checkpoint.set_rng_state(per_rank[rank])
            elif rank:
                torch.manual_seed(_rank_seed(s.seed + start_epoch, rank))
        if rank == 0:
            log.info("resuming from %s (epoch %d done)", last, st["epoch"])
    else:
        torch.manual_seed(s.seed if rank == 0 else _rank_seed(s.seed, rank))
        if select_start and validate is not None:
            best = _validate_start(model, validate, ckpt_dir, s, arch, vocab_digest, rank, world)
            if best > float("-inf"):
                best_epoch = -1
    wrapped = None
    if world > 1:  # DDP broadcasts rank 0's weights here and averages the gradients in backward
        dist_fn = loss_fn or (lambda m, b: _xe_sum_step(m, b, s))
        wrapped = DistributedDataParallel(_LossModule(model, dist_fn),
                                          device_ids=[dev.index] if dev.type == "cuda" else None)
    runner = StepRunner(model, opt, sched, s, dev, loss_fn=loss_fn, wrapped=wrapped, rank=rank, world=world)
    epoch = start_epoch - 1
    for epoch in range(start_epoch, s.epochs):
        model.train()
        data.set_epoch(epoch)
        t0, seen = time.perf_counter(), 0
        # sum over the epoch of (batch mean loss x images), float64 on the device: read every log_every steps
        total = torch.zeros((), dtype=torch.float64, device=dev)
        bar = progress_bar(loader, total=steps_per_epoch, desc=f"epoch {epoch + 1}/{s.epochs}",
                           enabled=progress and rank == 0, leave=False)
        for batch in bar:
            batch = batch.to(dev, non_blocking=pinned)
            value = runner(batch)
            step += 1
            seen += len(batch)
            total += value * len(batch)
            if s.log_every and step % s.log_every == 0:
                bar.set_postfix(loss=f"{float(total) / seen:.3f}", img_s=f"{seen / (time.perf_counter() - t0):.0f}")
            if stop_after_steps is not None and step >= stop_after_steps:
                raise KeyboardInterrupt(f"stopped after {step} steps (test hook)")
            stopping.check(f"training step {step}; {last} holds the last finished epoch")  # SIGTERM, any thread
        metrics: dict[str, Any] = {"epoch": epoch, "loss": float(total) / max(seen, 1),
                                   "lr": sched.get_last_lr()[0], "seconds": time.perf_counter() - t0}
        if validate is not None and rank == 0:
            model.eval()
            metrics.update(validate(model))
        rank_rng = None
        if world > 1:  # every rank takes rank 0's metrics, hence the same best/early-stop decisions
            box = [metrics]
            dist.broadcast_object_list(box, src=0)
            metrics = box[0]
            rank_rng = [None] * world if rank == 0 else None
            dist.gather_object(checkpoint.rng_state(), rank_rng, dst=0)
        history.append(metrics)
        score = metrics.get(s.select_metric, -metrics["loss"])
        improved = score > best
        if improved:
            best, best_epoch = score, epoch
        if rank == 0:
            extra = {"best": best, "best_epoch": best_epoch, "history": history}
            if rank_rng is not None:
                extra["rank_rng"] = rank_rng
            checkpoint.save(last, model=model, arch=arch or model.cfg.to_dict(), vocab_digest=vocab_digest,
                            optimizer=opt, scheduler=sched, epoch=epoch, step=step, extra=extra)
            if improved:
                checkpoint.save(ckpt_dir / "best.pt", model=model, arch=arch or model.cfg.to_dict(),
                                vocab_digest=vocab_digest, epoch=epoch, step=step, extra={"metrics": metrics})
            if on_epoch is not None:
                on_epoch(epoch, metrics)
            log.info("epoch %d: %s", epoch,
                     {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
        if s.patience is not None and epoch - best_epoch >= s.patience:
            if rank == 0:
                log.info("early stop: no improvement of %s for %d epochs", s.select_metric, s.patience)
            break
    if world > 1:
        del wrapped
        dist.barrier()  # rank 0's checkpoints are written before any rank returns
    return FitResult(best_metric=best, best_epoch=best_epoch, epochs_run=epoch + 1, history=history,
                     last_checkpoint=str(last) if last.exists() else None,
                     best_checkpoint=str(ckpt_dir / "best.pt") if (ckpt_dir / "best.pt").exists() else None,
                     resumed_from_epoch=start_epoch, processes=world)


def _validate_start(model: Captioner, validate: Callable[[Captioner], dict[str, float]], ckpt_dir: Path,
                    s: TrainSettings, arch: dict[str, Any] | None, vocab_digest: str, rank: int, world: int) -> float:
    """The starting weights' validation score (rank 0 validates, every rank gets it); rank 0 writes them as
    ``best.pt`` (epoch -1). Consumes no random numbers, so a run with it trains exactly as one without."""
    metrics: dict[str, Any] = {}
    if rank == 0:
        was_training = model.training
        model.eval()
        metrics = {"epoch": -1, **validate(model)}
        model.train(was_training)
    if world > 1:
        box = [metrics]
        dist.broadcast_object_list(box, src=0)
        metrics = box[0]
    if s.select_metric not in metrics:
        return float("-inf")
    if rank == 0:
        checkpoint.save(ckpt_dir / "best.pt", model=model, arch=arch or model.cfg.to_dict(),
                        vocab_digest=vocab_digest, epoch=-1, step=0, extra={"metrics": metrics, "start": True})
        log.info("starting weights: %s %.4f", s.select_metric, metrics[s.select_metric])
    return float(metrics[s.select_metric])


def load_model(path: str | Path, device: str | torch.device = "cpu", *,
               dropout: float | None = None) -> tuple[Captioner, dict[str, Any]]:
    """A Captioner from a checkpoint (weights_only loading); ``dropout``: rebuilt with every dropout site at that
    rate (:meth:`ArchConfig.with_dropout`), the rate its checkpoints then record."""
    from captioning.models.encoder_decoder import ArchConfig

    st = checkpoint.load(path, map_location=device)
    arch = ArchConfig.from_dict(st["arch"])
    model = Captioner(arch if dropout is None else arch.with_dropout(dropout))
    model.load_state_dict(st["state_dict"])
    return model.to(device).eval(), st
