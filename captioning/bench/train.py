"""``capflow bench train``: XE and SCST training throughput at paper size, the fast path vs today's fp32 eager path.

Per family (AIC, ACORT, ExpansionNet, LW, SATIC, ZoDIAC; their registry presets at paper size: 6+6 layers,
d=512, ExpansionNet 3+3 at d=768), with random weights and synthetic data shaped like COCO training: batches of
50 images x 5 captions (SCST: 50 images x 5 samples), 50 regions x 2048-d float16 features per image, captions
of 5..16 random words. Batches come through the training loader (``make_loader``; on CUDA 2 worker processes,
``workers``, for both paths; one epoch per measurement) and each step is
:class:`captioning.training.loop.StepRunner`, the step of :func:`captioning.training.loop.train`. Two paths in the
same run, each on a fresh model with the same seed:

- ``fp32_eager`` (the anchor, today's path): fp32, explicit attention (``explicit_attention()``), the host reads
  the loss after every step (``float(loss)``), for-each Adam, pageable batches (before ``Batch.pin_memory``
  the loader's ``pin_memory=True`` left them unpinned);
- ``fast``: ``precision`` (auto = bf16 on a CUDA device that supports it; CPUs run fp32), fused attention
  (``scaled_dot_product_attention``; the ``auto`` attention mode, so CPUs keep the explicit path), the loss read
  once after the timed steps, fused Adam and pinned batches copied ``non_blocking`` on CUDA; with ``compile``
  an XE row ``fast_compiled`` is added (``torch.compile`` of the XE step); SCST's fast path samples through the
  decoding engines' auto choice (on CUDA one replayed graph per sampling search), the anchor eagerly (``graphs=
  False``); both SCST paths run with the dropout rates at 0, as ``students.scst.dropout``; with ``graphs`` XE and
  SCST rows ``fast_graphs`` (``run.compile: graphs``: forward, loss, backward and clipping replayed from a CUDA
  graph, :mod:`captioning.training.graphs`, SCST after its eager sampling and rewards; a row says how many steps
  were replays; on a CPU it is the eager step).

Each measurement runs ``warmup`` untimed steps, then ``steps`` timed ones (the clock stops after the device has
finished). Rows give images/s, tokens/s (XE: target tokens; SCST: sampled tokens that are rewarded) and, on CUDA,
the peak memory of the measurement; extra rows give the fast XE path of the first family at other batch sizes
(``memory_batches``: peak memory and throughput per batch size). Ratios: ``speedup_vs_fp32_eager`` (AIC XE
images/s, new path / anchor, the new path being ``fast_graphs`` where measured, else ``fast_compiled`` where
measured, else ``fast``; ``headline_path`` names it),
``scst_speedup_vs_fp32_eager`` (AIC SCST) and the same per family and path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from captioning.bench.machine import machine_info
from captioning.data.karpathy import SPLIT_CODES
from captioning.data.loader import CaptionDataset, MemoryFeatures, Rows, make_loader
from captioning.data.stores import Labels
from captioning.data.text import N_SPECIAL, PAD, RadixCodec
from captioning.models.encoder_decoder import ArchConfig, Captioner
from captioning.models.layers import explicit_attention
from captioning.models.names import FAMILIES, preset_name
from captioning.models.registry import preset, scaled
from captioning.precision import resolve_precision
from captioning.training.loop import StepRunner, TrainSettings, make_optimizer
from captioning.training.scst import ScstLoss

RADIX_WORDS = 9485  # word-like ids of a COCO-size vocabulary (9,487 words + <unk> - specials): 2 radix digits
QUICK = {"d_model": 64, "layers": 2, "heads": 4, "d_ff": 128, "d_in": 64, "vocab": 1000, "regions": 10, "batch": 8,
         "captions": 2, "max_words": 8, "steps": 2, "warmup": 1, "samples": 2, "memory_batches": (4, 16)}


def _arch(name: str, quick: bool, d_in: int) -> ArchConfig:
    cfg = preset(preset_name(name))
    if quick:
        cfg = scaled(cfg, d_model=QUICK["d_model"], layers=QUICK["layers"], heads=QUICK["heads"], d_ff=QUICK["d_ff"])
        if cfg.codec == "word":
            cfg = cfg.replace(vocab_size=QUICK["vocab"])
    return cfg.replace(d_in=d_in)


def _codec(cfg: ArchConfig) -> RadixCodec | None:
    return RadixCodec(base=cfg.vocab_size - 3, num_words=RADIX_WORDS) if cfg.codec == "radix" else None


class _PooledFeatures(MemoryFeatures):
    """Features of ``len(image_ids)`` images drawn from a smaller pool (image row r gets pool entry r % pool):
    one epoch can cover a whole measurement without holding every image's 50 x 2048 features."""

    def read(self, rows: np.ndarray) -> Rows:
        pool = len(self.features)
        return Rows(rows=rows, image_ids=self.ids[rows], features=[self.features[r % pool] for r in rows],
                    boxes=[self.boxes[r % pool] for r in rows])


def _data(cfg: ArchConfig, images: int, regions: int, d_in: int, max_words: int, captions: int, seed: int,
          pool: int = 64) -> tuple[MemoryFeatures, Labels, dict[int, list[list[int]]]]:
    """Synthetic features (``regions`` per image, from a pool of ``pool`` images), ``captions`` random captions
    per image (as the label store holds them: word ids) and the same captions as SCST references."""
    rng = np.random.default_rng(seed)
    ids = np.arange(1, images + 1, dtype=np.int64)
    pool = min(pool, images)
    feats = np.maximum(rng.standard_normal((pool, regions, d_in), dtype=np.float32), 0).astype(np.float16)
    xy = rng.random((pool, regions, 2), dtype=np.float32) * 0.5
    boxes = np.concatenate([xy, xy + 0.1 + rng.random((pool, regions, 2), dtype=np.float32) * 0.4], -1)
    words = RADIX_WORDS if cfg.codec == "radix" else cfg.vocab_size - N_SPECIAL
    m = images * captions
    lengths = rng.integers(min(5, max_words), max_words + 1, size=m)
    tokens = np.zeros((m, max_words), np.int32)
    for k in range(m):
        tokens[k, : lengths[k]] = rng.integers(N_SPECIAL, N_SPECIAL + words, size=lengths[k])
    rows = np.repeat(np.arange(images), captions)
    zeros = np.zeros(m, np.int8)
    labels = Labels(tokens, lengths, rows, ids[rows], np.full(m, SPLIT_CODES["train"], np.int8), zeros, {0: "gt"})
    refs: dict[int, list[list[int]]] = {}
    for k in range(m):
        refs.setdefault(int(ids[rows[k]]), []).append(tokens[k, : lengths[k]].tolist())
    source = _PooledFeatures(feats, boxes, np.full(images, regions), ids, block_rows=8)
    return source, labels, refs


class _Counted:
    """SCST's loss with the rewarded-token counts kept (tokens/s); split for graphs as ScstLoss is."""

    graph_inputs = ScstLoss.graph_inputs

    def __init__(self, rl: ScstLoss, counts: list[torch.Tensor]):
        self.rl, self.counts = rl, counts

    def __call__(self, m, b):
        total, count = self.rl(m, b)
        self.counts.append(count.detach())
        return total, count

    def draw(self, m, b):
        d = self.rl.draw(m, b)
        self.counts.append((d.tokens != PAD).sum().float())
        return d

    def graph_loss(self, m, d):
        return self.rl.graph_loss(m, d)


def _batches(ds: CaptionDataset, batch: int, pinned: bool, workers: int) -> Iterator[Any]:
    loader = make_loader(ds, batch, workers=workers, drop_last=True, pin_memory=pinned)
    epoch = 0
    while True:
        ds.set_epoch(epoch)
        epoch += 1
        yield from loader


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _measure(cfg: ArchConfig, ds: CaptionDataset, dev: torch.device, *, batch: int, stage: str, path: str,
             precision: str, compile: bool | str, steps: int, warmup: int, scst: dict[str, Any] | None,
             seed: int, workers: int) -> dict[str, Any]:
    anchor = path == "fp32_eager"
    torch.manual_seed(seed)
    if stage == "scst":  # SCST trains with its dropout rates at 0 (students.scst.dropout's default)
        cfg = cfg.with_dropout(0.0)
    model = Captioner(cfg).to(dev).train()
    if stage == "xe":
        s = TrainSettings(batch_size=batch, schedule="noam", warmup=10000, clip=0.1, precision=precision,
                          compile=compile, fused_optimizer=not anchor)
    else:
        s = TrainSettings(batch_size=batch, schedule="constant", lr=5e-5, clip=None, precision=precision,
                          compile=compile, fused_optimizer=not anchor)
    opt, sched = make_optimizer(model, s, 100)
    counts: list[torch.Tensor] = []
    loss_fn = None
    if scst is not None:
        rl = ScstLoss(scst["refs"], samples=scst["samples"], max_tokens=scst["max_tokens"], codec=scst["codec"],
                      graphs=False if anchor else None)

        loss_fn = _Counted(rl, counts)

    runner = StepRunner(model, opt, sched, s, dev, loss_fn=loss_fn)
    pinned = dev.type == "cuda" and not anchor  # today's loader asked for pinning but left its batches pageable
    it = _batches(ds, batch, pinned, workers)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    tokens = 0
    total = torch.zeros((), dtype=torch.float64, device=dev)
    with explicit_attention() if anchor else contextlib.nullcontext():
        for i in range(warmup + steps):
            if i == warmup:
                _sync(dev)
                t0 = time.perf_counter()
                tokens, counts[:] = 0, []
                total.zero_()
            b = next(it)
            if stage == "xe":
                tokens += int((b.tokens[..., 1:] != PAD).sum())  # on the host batch: no device sync
            value = runner(b.to(dev, non_blocking=pinned))
            total += value
            if anchor:
                float(value)  # today's loop read float(loss) after every step
        loss = float(total) / steps  # waits for the device
        seconds = time.perf_counter() - t0
    it.close()  # stops the loader's workers
    if stage == "scst":
        tokens = int(sum(float(c) for c in counts))
    row: dict[str, Any] = {
        "stage": stage, "path": path, "precision": runner.precision,
        "attention": "explicit" if anchor or dev.type == "cpu" else "fused",
        "compile": compile, "batch": batch, "captions": ds.captions_per_image if stage == "xe" else scst["samples"],
        "steps": steps, "seconds": seconds, "images_per_s": steps * batch / seconds, "tokens_per_s": tokens / seconds,
        "loss": loss, "memory_peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
    }
    if runner.graphed is not None:
        g = runner.graphed
        row.update(graph_replays=g.replays, graph_captures=g.captures, graph_failed=g.failed)
    del runner, opt, sched, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(families: list[str] | None = None, device: str = "cpu", batch: int | None = None, captions: int | None = None,
        steps: int | None = None, warmup: int | None = None, regions: int | None = None, max_words: int | None = None,
        samples: int | None = None, memory_batches: tuple[int, ...] | None = None, precision: str = "auto",
        compile: bool = False, graphs: bool = False, scst: bool = True, quick: bool = False, threads: int | None = None,
        workers: int | None = None, seed: int = 0) -> dict:
    """The benchmark's JSON (see the module docstring). ``quick``: small models and batches (a CPU check of the
    whole benchmark in seconds, not a measurement); explicit arguments override either size."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    q = QUICK if quick else {}
    d_in = q.get("d_in", 2048)
    regions = regions or q.get("regions", 50)
    batch = batch or q.get("batch", 50)
    captions = captions or q.get("captions", 5)
    max_words = max_words or q.get("max_words", 16)
    samples = samples or q.get("samples", 5)
    steps = steps or q.get("steps", 20 if dev.type == "cuda" else 3)
    warmup = warmup or q.get("warmup", 5 if dev.type == "cuda" else 1)
    if memory_batches is None:
        memory_batches = q.get("memory_batches", (25, 100, 200) if dev.type == "cuda" else ())
    if workers is None:
        workers = 2 if dev.type == "cuda" else 0  # loader processes (both paths): batches ready ahead of the GPU
    families = families or list(FAMILIES)
    fast_precision = resolve_precision(precision, dev)
    rows: list[dict[str, Any]] = []
    for fam in families:
        cfg = _arch(fam, quick, d_in)
        codec = _codec(cfg)
        per_word = codec.digits if codec is not None else 1
        cfg = cfg.replace(max_len=max(cfg.max_len, -(-(max_words * per_word + 1 + cfg.group_size)
                                                        // cfg.group_size) * cfg.group_size))
        images = max(b * (warmup + steps) for b in (batch, *memory_batches))  # one epoch per measurement
        source, labels, refs = _data(cfg, images, regions, d_in, max_words, captions, seed)
        xe_ds = CaptionDataset(source, labels=labels, captions_per_image=captions, shuffle_buffer=64, seed=seed,
                               codec=codec)
        common = {"family": fam, "preset": preset_name(fam), "d_model": cfg.d_model,
                  "layers": f"{cfg.enc_layers}+{cfg.dec_layers}", "regions": regions}
        paths = [("fp32_eager", "fp32", False), ("fast", fast_precision, False)]
        if compile:
            paths.append(("fast_compiled", fast_precision, True))
        if graphs:
            paths.append(("fast_graphs", fast_precision, "graphs"))
        for path, prec, comp in paths:
            rows.append(common | _measure(cfg, xe_ds, dev, batch=batch, stage="xe", path=path, precision=prec,
                                          compile=comp, steps=steps, warmup=warmup, scst=None, seed=seed,
                                          workers=workers))
        if scst:
            sc_ds = CaptionDataset(source, labels=labels, captions_per_image=1, shuffle_buffer=64, seed=seed + 1,
                                   codec=codec)
            sc = {"refs": refs, "samples": samples, "max_tokens": max_words * per_word + 1, "codec": codec}
            sc_paths = [("fp32_eager", "fp32", False), ("fast", fast_precision, False)]
            if graphs:
                sc_paths.append(("fast_graphs", fast_precision, "graphs"))
            for path, prec, comp in sc_paths:
                rows.append(common | _measure(cfg, sc_ds, dev, batch=batch, stage="scst", path=path, precision=prec,
                                              compile=comp, steps=steps, warmup=warmup, scst=sc, seed=seed,
                                              workers=workers))
        if fam == families[0]:
            for b in memory_batches:
                if b != batch:
                    rows.append(common | _measure(cfg, xe_ds, dev, batch=b, stage="xe", path="fast",
                                                  precision=fast_precision, compile=False, steps=steps,
                                                  warmup=warmup, scst=None, seed=seed, workers=workers))
    ratios: dict[str, float] = {}
    main = [r for r in rows if r["batch"] == batch]
    for fam in families:
        for stage in ("xe", "scst"):
            got = {r["path"]: r["images_per_s"] for r in main if r["family"] == fam and r["stage"] == stage}
            if "fast" in got and "fp32_eager" in got:
                ratios[f"{stage}_speedup_vs_fp32_eager_{fam}"] = got["fast"] / got["fp32_eager"]
            if "fast_compiled" in got and "fp32_eager" in got:
                ratios[f"{stage}_compiled_speedup_vs_fp32_eager_{fam}"] = got["fast_compiled"] / got["fp32_eager"]
            if "fast_graphs" in got and "fp32_eager" in got:
                ratios[f"{stage}_graphs_speedup_vs_fp32_eager_{fam}"] = got["fast_graphs"] / got["fp32_eager"]
    head, headline, headline_path = families[0], {}, {}
    for stage, key in (("xe", "speedup_vs_fp32_eager"), ("scst", "scst_speedup_vs_fp32_eager")):
        # the new path: the graph-captured one where it was measured, else the compiled one, else fast
        for path, name in (("fast_graphs", f"{stage}_graphs_speedup_vs_fp32_eager_{head}"),
                           ("fast_compiled", f"{stage}_compiled_speedup_vs_fp32_eager_{head}"),
                           ("fast", f"{stage}_speedup_vs_fp32_eager_{head}")):
            if name in ratios:
                headline[key], headline_path[stage] = ratios[name], path
                break
    ratios = headline | ratios
    machine = machine_info() | {"device": str(dev)}
    if dev.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(dev)
        machine["cuda"] = torch.version.cuda
    return {
        "bench": "train",
        "machine": machine,
        "params": {"families": families, "batch": batch, "captions": captions, "scst_samples": samples,
                   "regions": regions, "d_in": d_in, "max_words": max_words, "steps": steps, "warmup": warmup,
                   "precision": fast_precision, "compile": compile, "graphs": graphs, "quick": quick,
                   "workers": workers, "memory_batches": list(memory_batches)},
        "rows": rows,
        "ratios": ratios,
        "headline_path": headline_path,
        "targets": {"speedup_vs_fp32_eager": 4.0, "scst_speedup_vs_fp32_eager": 4.0},
        "issue_targets_images_per_s": {"aic_xe": 2000, "aic_scst": 640},
    }
