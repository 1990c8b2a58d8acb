"""Cross-entropy (teacher forcing) training with epoch checkpoints that resume to identical weights.

Each epoch: batches from a :class:`~captioning.data.loader.CaptionDataset` (its order depends only on the seed
and the epoch), Adam(0.9, 0.98, 1e-9) with the Noam schedule (or a constant/step schedule), label smoothing,
gradient clipping by value, AMP on CUDA; then validation (a callable returning metrics, e.g. greedy CIDEr on
the val split), ``last.pt`` always and ``best.pt`` when the validation score improves, early stopping after
``patience`` epochs without improvement. A killed run restarts from ``last.pt`` (weights, optimizer, scheduler,
RNG state): on CPU it ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from captioning.data.loader import CaptionDataset, make_loader
from captioning.models.encoder_decoder import Captioner
from captioning.training import checkpoint
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
    amp: bool = False
    patience: int | None = None  # early stopping (epochs without validation improvement)
    select_metric: str = "CIDEr"
    seed: int = 0


@dataclass
class TrainResult:
    best_metric: float
    best_epoch: int
    epochs_run: int
    history: list[dict[str, Any]] = field(default_factory=list)
    last_checkpoint: Path | None = None
    best_checkpoint: Path | None = None
    resumed_from_epoch: int = 0


def make_optimizer(model: torch.nn.Module, s: TrainSettings, steps_per_epoch: int):
    opt = torch.optim.Adam(model.parameters(), lr=s.lr, betas=(0.9, 0.98), eps=1e-9)
    if s.schedule == "noam":
        fn = noam(model.cfg.d_model, s.warmup, s.noam_factor)
    elif s.schedule == "step":
        fn = step_decay(max(1, s.step_every * steps_per_epoch), s.step_gamma)
    elif s.schedule == "constant":
        fn = constant()
    else:
        raise ValueError(f"unknown schedule {s.schedule!r}")
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, fn)


StepFn = Callable[[Captioner, Any], torch.Tensor]


def _xe_step(model: Captioner, batch, s: TrainSettings) -> torch.Tensor:
    return model.xe_loss(batch.features, batch.boxes, batch.region_mask, batch.tokens, s.label_smoothing)


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
) -> TrainResult:
    """Train until ``settings.epochs`` (resuming from ``ckpt_dir/last.pt`` if present).

    ``loss_fn(model, batch)`` replaces the XE loss (SCST uses this loop with its own loss).
    ``stop_after_steps`` interrupts the run (tests of kill-and-resume)."""
    s = settings
    dev = torch.device(device)
    ckpt_dir = Path(ckpt_dir)
    model.to(dev)
    loader = make_loader(data, s.batch_size, workers=s.workers, pin_memory=dev.type == "cuda")
    steps_per_epoch = max(1, -(-len(data) // s.batch_size))
    opt, sched = make_optimizer(model, s, steps_per_epoch)
    scaler = torch.amp.GradScaler("cuda", enabled=s.amp and dev.type == "cuda")
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
        log.info("resuming from %s (epoch %d done)", last, st["epoch"])
    else:
        torch.manual_seed(s.seed)
    fn = loss_fn or (lambda m, b: _xe_step(m, b, s))
    epoch = start_epoch - 1
    for epoch in range(start_epoch, s.epochs):
        model.train()
        data.set_epoch(epoch)
        t0, seen, total = time.perf_counter(), 0, 0.0
        bar = tqdm(loader, total=steps_per_epoch, desc=f"epoch {epoch + 1}/{s.epochs}", disable=not progress,
                   leave=False)
        for batch in bar:
            batch = batch.to(dev, non_blocking=True)
            with torch.autocast(dev.type, enabled=s.amp and dev.type == "cuda"):
                loss = fn(model, batch)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if s.clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_value_(model.parameters(), s.clip)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            seen += len(batch)
            total += float(loss) * len(batch)
            bar.set_postfix(loss=f"{float(loss):.3f}", img_s=f"{seen / (time.perf_counter() - t0):.0f}")
            if stop_after_steps is not None and step >= stop_after_steps:
                raise KeyboardInterrupt(f"stopped after {step} steps (test hook)")
        metrics: dict[str, Any] = {"epoch": epoch, "loss": total / max(seen, 1), "lr": sched.get_last_lr()[0],
                                   "seconds": time.perf_counter() - t0}
        if validate is not None:
            model.eval()
            metrics.update(validate(model))
        history.append(metrics)
        score = metrics.get(s.select_metric, -metrics["loss"])
        improved = score > best
        if improved:
            best, best_epoch = score, epoch
        extra = {"best": best, "best_epoch": best_epoch, "history": history}
        checkpoint.save(last, model=model, arch=arch or model.cfg.to_dict(), vocab_digest=vocab_digest,
                        optimizer=opt, scheduler=sched, epoch=epoch, step=step, extra=extra)
        if improved:
            checkpoint.save(ckpt_dir / "best.pt", model=model, arch=arch or model.cfg.to_dict(),
                            vocab_digest=vocab_digest, epoch=epoch, step=step, extra={"metrics": metrics})
        if on_epoch is not None:
            on_epoch(epoch, metrics)
        log.info("epoch %d: %s", epoch, {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
        if s.patience is not None and epoch - best_epoch >= s.patience:
            log.info("early stop: no improvement of %s for %d epochs", s.select_metric, s.patience)
            break
    return TrainResult(best_metric=best, best_epoch=best_epoch, epochs_run=epoch + 1, history=history,
                       last_checkpoint=last if last.exists() else None,
                       best_checkpoint=ckpt_dir / "best.pt" if (ckpt_dir / "best.pt").exists() else None,
                       resumed_from_epoch=start_epoch)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[Captioner, dict[str, Any]]:
    """A Captioner from a checkpoint (weights_only loading)."""
    from captioning.models.encoder_decoder import ArchConfig

    st = checkpoint.load(path, map_location=device)
    model = Captioner(ArchConfig.from_dict(st["arch"]))
    model.load_state_dict(st["state_dict"])
    return model.to(device).eval(), st
