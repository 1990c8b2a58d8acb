"""Greedy decoding and sampling: every memory row decoded independently, with a ``choose(logp (A, K, V)) -> tokens
(A, K)`` (:func:`captioning.decoding.steps.argmax`, a sampler).

:func:`rowwise` is the eager engine (a growing cache, the re-decoded prefix or the released step cache; finished
rows leave the batch); :func:`static_rows` is the static engine's loop (rows fixed for the whole search), which a
whole-search CUDA graph records too (:class:`captioning.decoding.graphs.GraphRows`); :func:`static_search` runs it
eagerly over a static cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from captioning.decoding.steps import (
    CHECK_EVERY,
    PAD,
    StaticStepper,
    Stepper,
    choose_constrained,
    decode_steps,
    mask_specials,
    trim,
)


def row_outputs(model, n: int, dev, max_len: int):
    """What row-wise decoders share: (max_len, steps, K, eos) and the empty outputs of ``n`` rows on ``dev``
    (tokens (n, L) filled with PAD, token log-probs (n, L), lengths (n,)), L = steps * K."""
    max_len, steps = decode_steps(model, max_len)
    k, eos = int(model.group_size), int(model.eos)
    toks = torch.full((n, steps * k), PAD, dtype=torch.long, device=dev)
    tlp = torch.zeros(n, steps * k, dtype=torch.float32, device=dev)
    lengths = torch.zeros(n, dtype=torch.long, device=dev)
    return max_len, steps, k, eos, toks, tlp, lengths


def rowwise(model, memory, max_len: int, use_cache: bool,
            choose: Callable[[torch.Tensor], torch.Tensor], constraint: int = 0,
            released_cache: bool = False) -> tuple[torch.Tensor, ...]:
    """Decode every memory row independently; ``choose(logp (A, K, V)) -> tokens (A, K)``.

    Finished rows leave the batch (cache, prefix and memory keep only the open rows), and decoding stops
    as soon as every row is finished. ``constraint`` d > 0: the decoding constraint with words of d tokens.
    Returns (tokens (N, L), token log-probs (N, L), lengths (N,))."""
    n, dev = memory.states.shape[0], memory.states.device
    max_len, steps, k, eos, toks, tlp, lengths = row_outputs(model, n, dev, max_len)
    active = torch.arange(n, device=dev)  # original row of each open row
    offs = torch.arange(k, device=dev)
    stepper = Stepper(model, memory, use_cache, released_cache)
    inp = model.start_tokens(n, device=dev)
    for s in range(steps):
        logp = mask_specials(model, stepper.step(inp).float())  # (A, K, V)
        tok = choose_constrained(logp, toks[active, : s * k], constraint, choose) if constraint else choose(logp)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        is_eos = tok == eos
        # a position is kept if it is not after the group's first EOS and within max_len
        keep = ((is_eos.cumsum(1) - is_eos.long()) == 0) & (s * k + offs < max_len)[None]
        toks[active, s * k : (s + 1) * k] = torch.where(keep, tok, PAD)
        tlp[active, s * k : (s + 1) * k] = torch.where(keep, lp, 0.0)
        lengths[active] += keep.sum(1)
        if (s + 1) * k >= max_len:
            break
        open_ = ~(is_eos & keep).any(1)
        if not bool(open_.all()):
            if not bool(open_.any()):
                break
            idx = open_.nonzero().squeeze(1)
            stepper.reorder(idx)
            active, tok = active[idx], tok[idx]
        inp = tok
    width = max(int(lengths.max()) if n else 1, 1)
    return toks[:, :width], tlp[:, :width], lengths


def static_rows(model, step: Callable[[torch.Tensor], torch.Tensor], n: int, device, max_len: int,
                choose: Callable[[torch.Tensor], torch.Tensor], constraint: int = 0,
                check_every: int | None = CHECK_EVERY) -> tuple[torch.Tensor, ...]:
    """The static engine's row-wise loop (greedy or sampling): every row stays in the batch, finished rows' outputs
    are ignored, ``step(tokens (n, K)) -> log-probs (n, K, V)`` feeds the static cache. The host reads "all
    finished" every ``check_every`` steps; ``None`` never (no host sync at all: what a whole-search CUDA graph
    records, running every step). Same results as :func:`rowwise` with the same ``choose`` when it is
    deterministic. Returns (tokens (n, steps*K), token log-probs (n, steps*K), lengths (n,)): the full width, PAD
    after."""
    max_len, steps, k, eos, toks, tlp, lengths = row_outputs(model, n, device, max_len)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    offs = torch.arange(k, device=device)
    inp = model.start_tokens(n, device=device)
    for s in range(steps):
        logp = mask_specials(model, step(inp).float())  # (N, K, V)
        tok = choose_constrained(logp, toks[:, : s * k], constraint, choose) if constraint else choose(logp)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        is_eos = tok == eos
        keep = ((is_eos.cumsum(1) - is_eos.long()) == 0) & (offs < max_len - s * k)[None] & ~done[:, None]
        toks[:, s * k : (s + 1) * k] = torch.where(keep, tok, PAD)
        tlp[:, s * k : (s + 1) * k] = torch.where(keep, lp, 0.0)
        lengths += keep.sum(1)
        if (s + 1) * k >= max_len:
            break
        done |= (is_eos & keep).any(1)
        if check_every and (s + 1) % check_every == 0 and bool(done.all()):
            break
        inp = tok
    return toks, tlp, lengths


def static_search(model, memory, max_len: int, choose: Callable[[torch.Tensor], torch.Tensor],
                  constraint: int = 0) -> tuple[torch.Tensor, ...]:
    """Row-wise decoding on the static engine, eager: :func:`static_rows` over a static cache, checking "all
    finished" every CHECK_EVERY steps; the outputs cut to the longest caption."""
    _, steps = decode_steps(model, max_len)
    stepper = StaticStepper(model, memory, steps * int(model.group_size))
    n, dev = memory.states.shape[0], memory.states.device
    return trim(*static_rows(model, stepper.step, n, dev, max_len, choose, constraint))


__all__ = ["row_outputs", "rowwise", "static_rows", "static_search"]
