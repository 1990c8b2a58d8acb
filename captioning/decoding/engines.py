"""Which engine decodes, and the steppers for it: what sits between the public searches
(:mod:`captioning.decoding.search`) and the CUDA-graph runners (:mod:`captioning.decoding.graphs`).

The options a model allows (:func:`decoding_mode`: prefix models re-decode the whole prefix, the released ACORT
step cache is an eager growing cache), the engine for the options (:func:`engine`: eager, static, or CUDA graphs
on the static cache; ``None`` = auto), a search run on it with the fallback to eager when an automatic capture
fails (:func:`run_engine`), and the searches with their steppers opened here, so that the loops
(:mod:`captioning.decoding.rows`, :mod:`captioning.decoding.beam`) never see a graph: :func:`rows_static` (greedy
and sampling on the static engine: one replayed graph for the whole search, or eager) and :func:`run_beam`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from captioning.decoding.beam import search_beams
from captioning.decoding.graphs import available, failed, graph_step, mark_failed, run_rows
from captioning.decoding.rows import static_search
from captioning.decoding.steps import Decoded, StaticStepper, Stepper, trim


def decoding_mode(model, use_cache: bool, static_cache: bool | None, graphs: bool | None,
                  released_acort_cache: bool | None) -> tuple[bool, bool | None, bool | None, bool]:
    """The options as the model allows them -> (use_cache, static_cache, graphs, released step cache): prefix
    models (``model.prefix_decoding``) re-decode the whole prefix eagerly; the released ACORT step cache is an
    eager growing cache (:mod:`captioning.decoding.search`'s doc). Asking for what such a model cannot do is an
    error."""
    cfg = getattr(model, "cfg", None)
    released = (bool(getattr(cfg, "released_acort_cache", False)) if released_acort_cache is None
                else bool(released_acort_cache))
    if getattr(model, "prefix_decoding", False):
        if static_cache or graphs or released_acort_cache:
            raise ValueError("this model re-runs the whole prefix every step (the released ZoDIAC pooling): no static "
                             "cache, CUDA graphs or step cache")
        return False, False, False, False
    if released:
        if not use_cache:
            raise ValueError("released_acort_cache is a step cache; use_cache=False decodes the whole prefix")
        if static_cache or graphs:
            raise ValueError("the released ACORT step cache is an eager growing cache: no static cache or CUDA graphs")
        return True, False, False, True
    return use_cache, static_cache, graphs, False


def dropout_active(model) -> bool:
    """Whether the model would drop anything (graph-captured decoding needs it not to)."""
    if isinstance(model, torch.nn.Module):
        return any(isinstance(m, torch.nn.Dropout) and m.training and m.p > 0 for m in model.modules())
    return bool(getattr(model, "training", False))


def engine(model, memory, use_cache: bool, static_cache: bool | None, graphs: bool | None) -> tuple[bool, bool]:
    """-> (static cache, CUDA graphs) for the options (None = auto)."""
    if graphs is None:
        graphs = (use_cache and static_cache is not False and memory.states.is_cuda and available()
                  and not dropout_active(model) and not failed(model))
    elif graphs:
        if not use_cache or static_cache is False:
            raise ValueError("CUDA graphs decode with the static cache (use_cache=True, static_cache not False)")
        if not memory.states.is_cuda:
            raise ValueError("CUDA graphs need the memory on a CUDA device")
        if dropout_active(model):
            raise ValueError("graph-captured decoding needs the model in eval mode (no active dropout)")
    if graphs:
        return True, True
    if static_cache and not use_cache:
        raise ValueError("static_cache=True needs use_cache=True")
    return bool(static_cache), False


def run_engine(run, model, memory, use_cache: bool, static_cache: bool | None, graphs: bool | None):
    """``run(static, graphs)`` on the chosen engine; in auto mode a failed capture falls back to eager."""
    static, use_graphs = engine(model, memory, use_cache, static_cache, graphs)
    if not use_graphs or graphs is not None:
        return run(static, use_graphs)
    try:
        return run(True, True)
    except RuntimeError as e:  # a model whose step cannot be captured: decode eagerly from now on
        mark_failed(model)
        warnings.warn(f"CUDA graph capture failed ({e}); decoding eagerly", RuntimeWarning, stacklevel=3)
        return run(bool(static_cache), False)


def rows_static(model, memory, max_len: int, graphs: bool, choose: Callable[[torch.Tensor], torch.Tensor],
                constraint: int = 0, sampler: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """Row-wise decoding on the static engine. ``graphs``: the whole search replayed from one CUDA graph
    (:func:`captioning.decoding.graphs.run_rows`; ``sampler`` = ("greedy",) or ("sample", temperature) names
    ``choose`` there); else eager, checking "all finished" every CHECK_EVERY steps
    (:func:`captioning.decoding.rows.static_search`)."""
    if graphs:
        return trim(*run_rows(model, memory, max_len, sampler or ("greedy",), constraint))
    return static_search(model, memory, max_len, choose, constraint)


def static_stepper(model, memory, positions: int, graphs: bool) -> StaticStepper:
    """The static cache for ``memory``'s rows and ``positions`` positions, each step eager or replayed from the
    captured step (:func:`captioning.decoding.graphs.graph_step`, started on ``memory``)."""
    return StaticStepper(model, memory, positions, graph_step(model, memory, positions) if graphs else None)


def run_beam(model, memory, w: int, max_len: int, alpha: float, n_best: int, use_cache: bool, static: bool = False,
         graphs: bool = False, constraint: int = 0, released_cache: bool = False) -> Decoded:
    """Beam search (:func:`captioning.decoding.beam.search_beams`) on the engine: the eager growing cache or
    prefix (``released_cache``: the released ACORT step cache), or the static cache (``static``), each step
    replayed from a captured graph when ``graphs``."""

    def open_stepper(rows, positions: int):
        if static:
            return static_stepper(model, rows, positions, graphs)
        return Stepper(model, rows, use_cache, released_cache)

    return search_beams(model, memory, w, max_len, alpha, n_best, static, open_stepper, constraint)


__all__ = ["decoding_mode", "dropout_active", "engine", "rows_static", "run_beam", "run_engine", "static_stepper"]
