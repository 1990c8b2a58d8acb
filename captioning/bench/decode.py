"""``capflow bench decode``: greedy decoding latency (batch 1) and throughput (batch 50) at paper size.

Every preset is built at its paper size with random weights (latency does not depend on what the weights
learned, as long as every caption has the same length: decoding here runs the full ``max_words`` words, EOS
masked out, so no model stops early by chance). Inputs are 36 regions per image (the common fixed-36 setting).
Rows give, per preset, the encoder's share of the batch-1 latency too, because on a CPU the encoder (compute
bound) is a far larger part of a caption's latency than on the GPU the SATIC paper measured on (where each
decoder step is launch-overhead bound): the speed-up of semi-autoregressive decoding applies to the decoder
part only. Ratios: ``satic_k{2,4,6}_vs_aic`` (batch-1 latency speed-ups), ``cached_vs_uncached`` (AIC, batch 1).

Rows with ``path: "eager"`` decode with today's growing cache (``graphs=False``, on every device). On CUDA
(or with ``graphs=True``) every preset gains a ``path: "graph"`` row: the same greedy decoding with the static
cache and each decoder step (and the encoder) replayed from a CUDA graph (captured in the warm-up, not timed), with
``speedup_vs_eager`` (batch-1 latency) and ``throughput_vs_eager``, and the ratios
``graph_satic_k{2,4,6}_vs_aic``, ``graph_vs_eager_batch1`` and ``graph_vs_eager_batch{N}`` (AIC).
"""

from __future__ import annotations

import statistics
import time

import torch

from captioning.bench.machine import machine_info
from captioning.decoding import graphs as cuda_graphs
from captioning.decoding import greedy
from captioning.models.encoder_decoder import Captioner
from captioning.models.registry import PRESETS, preset


class _NoEOS(torch.nn.Module):
    """Wraps a model so that EOS is never chosen: every caption runs to max_len (fair latency comparison)."""

    def __init__(self, model: Captioner):
        super().__init__()
        self.model = model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    def decode_step(self, memory, tokens, cache, prefix=None):
        out = self.model.decode_step(memory, tokens, cache, prefix=prefix)
        out[..., self.model.eos] = float("-inf")
        return out


def _timeit(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(b: int, regions: int, d_in: int, g: torch.Generator, dev: torch.device):
    f = torch.randn(b, regions, d_in, generator=g).to(dev)
    xy = torch.rand(b, regions, 2, generator=g) * 0.5
    bx = torch.cat([xy, xy + 0.1 + torch.rand(b, regions, 2, generator=g) * 0.4], -1).to(dev)
    return f, bx, torch.ones(b, regions, dtype=torch.bool, device=dev)


def _measure(name: str, *, max_words: int, regions: int, repeats: int, batch: int, dev: torch.device,
             g: torch.Generator, uncached: bool, graphs: bool = False) -> dict:
    cfg = preset(name).replace(max_len=64)
    torch.manual_seed(0)
    model = Captioner(cfg).to(dev).eval()
    wrapped = _NoEOS(model)
    digits = 2 if cfg.codec == "radix" else 1  # radix models emit d digits per word (d=2 for COCO)
    max_len = -(-(max_words * digits) // cfg.group_size) * cfg.group_size
    one_in = _inputs(1, regions, cfg.d_in, g, dev)
    batch_in = _inputs(batch, regions, cfg.d_in, g, dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def encode(x):  # the graph rows replay a captured encoder too (launch-bound at batch 1 like the steps)
        return cuda_graphs.encode(model, *x) if graphs else model.encode(*x)

    def caption(x, use_cache=True):
        with torch.inference_mode():
            greedy(wrapped, encode(x), max_len=max_len, use_cache=use_cache, graphs=graphs, static_cache=graphs)
        sync()

    def encode_only():
        with torch.inference_mode():
            encode(one_in)
        sync()

    caption(one_in)  # warm-up
    t1 = _timeit(lambda: caption(one_in), repeats)
    te = _timeit(encode_only, repeats)
    caption(batch_in)
    tb = _timeit(lambda: caption(batch_in), max(1, repeats // 2))
    row = {
        "preset": name, "path": "graph" if graphs else "eager", "group_size": cfg.group_size, "codec": cfg.codec,
        "tokens": max_len,
        "steps": max_len // cfg.group_size, "latency_ms_batch1": 1e3 * t1, "encoder_ms_batch1": 1e3 * te,
        "decoder_ms_batch1": 1e3 * (t1 - te), f"images_per_s_batch{batch}": batch / tb,
    }
    if uncached:
        row["uncached_latency_ms_batch1"] = 1e3 * _timeit(lambda: caption(one_in, use_cache=False), repeats)
    return row


def _versus_aic(rows: list[dict], prefix: str = "") -> dict[str, float]:
    """Each row's speed-ups over the AIC row (in place); the SATIC latency ratios."""
    base = next(r for r in rows if r["preset"] == "aic")
    for r in rows:
        r["speedup_vs_aic"] = base["latency_ms_batch1"] / r["latency_ms_batch1"]
        r["decoder_speedup_vs_aic"] = base["decoder_ms_batch1"] / r["decoder_ms_batch1"]
    lat = {r["preset"]: r["latency_ms_batch1"] for r in rows}
    return {f"{prefix}satic_k{k}_vs_aic": lat["aic"] / lat[f"satic-k{k}"] for k in (2, 4, 6) if f"satic-k{k}" in lat}


def run(names: list[str] | None = None, max_words: int = 16, regions: int = 36, repeats: int = 5,
        batch: int = 50, device: str = "cpu", threads: int | None = None, graphs: bool | None = None) -> dict:
    """``graphs``: add the CUDA-graph rows (None = when ``device`` is a CUDA device)."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    graphs = dev.type == "cuda" if graphs is None else graphs
    names = names or ["aic", "satic-k2", "satic-k4", "satic-k6"] + [
        n for n in PRESETS if n not in ("aic", "satic-k2", "satic-k4", "satic-k6")]
    if "aic" not in names:
        names = ["aic", *names]
    g = torch.Generator().manual_seed(0)
    kw = {"max_words": max_words, "regions": regions, "repeats": repeats, "batch": batch, "dev": dev, "g": g}
    rows = [_measure(n, uncached=n == "aic", **kw) for n in names]
    ratios = _versus_aic(rows)
    base = rows[names.index("aic")]
    ratios["cached_vs_uncached"] = base["uncached_latency_ms_batch1"] / base["latency_ms_batch1"]
    if graphs:
        graph_rows = [_measure(n, uncached=False, graphs=True, **kw) for n in names]
        throughput = f"images_per_s_batch{batch}"
        for r, e in zip(graph_rows, rows, strict=True):
            r["speedup_vs_eager"] = e["latency_ms_batch1"] / r["latency_ms_batch1"]
            r["throughput_vs_eager"] = r[throughput] / e[throughput]
        ratios |= _versus_aic(graph_rows, "graph_")
        gbase = graph_rows[names.index("aic")]
        ratios["graph_vs_eager_batch1"] = gbase["speedup_vs_eager"]
        ratios[f"graph_vs_eager_batch{batch}"] = gbase["throughput_vs_eager"]
        rows += graph_rows
    return {
        "bench": "decode",
        "machine": machine_info() | {"device": str(dev)},
        "params": {"max_words": max_words, "regions": regions, "repeats": repeats, "batch": batch,
                   "graphs": graphs},
        "rows": rows,
        "ratios": ratios,
        "paper": {"satic_k2_vs_aic": 1.78, "satic_k4_vs_aic": 2.93, "satic_k6_vs_aic": 3.86},
    }
